//! Things kept idle between transfers, a few per key: authenticated peer
//! connections by peer, data connections by rail and peer address. The next
//! transfer with the same key takes one instead of making it anew.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;

pub(super) struct Kept<K, V> {
    idle: Mutex<HashMap<K, Vec<V>>>,
    per_key: usize,
}

impl<K, V> std::fmt::Debug for Kept<K, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let idle = self.idle.lock().map(|m| m.values().map(Vec::len).sum::<usize>()).unwrap_or(0);
        f.debug_struct("Kept").field("idle", &idle).field("per_key", &self.per_key).finish()
    }
}

impl<K: Eq + Hash, V> Kept<K, V> {
    /// At most `per_key` kept for each key.
    pub fn new(per_key: usize) -> Kept<K, V> {
        Kept { idle: Mutex::new(HashMap::new()), per_key }
    }

    /// A kept one for `key` that `usable` accepts; those it refuses are
    /// dropped on the way.
    pub fn take(&self, key: &K, mut usable: impl FnMut(&mut V) -> bool) -> Option<V> {
        let mut idle = self.idle.lock().expect("kept lock");
        let v = idle.get_mut(key)?;
        while let Some(mut x) = v.pop() {
            if usable(&mut x) {
                return Some(x);
            }
        }
        None
    }

    /// Keeps `x` for the next transfer, unless enough are kept or `wanted`
    /// says no (asked under the lock [`Kept::clear`] takes, so nothing is
    /// kept after a clear that `wanted` already knew about).
    pub fn keep(&self, key: K, x: V, wanted: impl Fn() -> bool) {
        let mut idle = self.idle.lock().expect("kept lock");
        if !wanted() {
            return;
        }
        let v = idle.entry(key).or_default();
        if v.len() < self.per_key {
            v.push(x);
        }
    }

    /// Lets every kept one go (closing a connection ends the peer's side too).
    pub fn clear(&self) {
        self.idle.lock().expect("kept lock").clear();
    }
}
