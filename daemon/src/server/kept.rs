//! Things kept idle between transfers, a few per key: authenticated peer
//! connections by peer, data connections by rail and peer address. The next
//! transfer with the same key takes one instead of making it anew.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

struct Inner<K, V> {
    idle: HashMap<K, Vec<V>>,
    // Per key, how many in use now are expected back soon (see `expect`).
    coming: HashMap<K, usize>,
    // Takers waiting for one to come back: a return wakes them only when
    // there are any (a wake is a system call, on every transfer's end).
    waiting: usize,
}

pub(super) struct Kept<K, V> {
    inner: Mutex<Inner<K, V>>,
    returned: Condvar,
    per_key: usize,
}

impl<K, V> std::fmt::Debug for Kept<K, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let idle = self.inner.lock().map(|m| m.idle.values().map(Vec::len).sum::<usize>()).unwrap_or(0);
        f.debug_struct("Kept").field("idle", &idle).field("per_key", &self.per_key).finish()
    }
}

impl<K: Eq + Hash + Clone, V> Kept<K, V> {
    /// At most `per_key` kept for each key.
    pub fn new(per_key: usize) -> Kept<K, V> {
        Kept { inner: Mutex::new(Inner { idle: HashMap::new(), coming: HashMap::new(), waiting: 0 }), returned: Condvar::new(), per_key }
    }

    /// A kept one for `key` that `usable` accepts; those it refuses are
    /// dropped on the way. While none is idle but one is expected back
    /// ([`Kept::expect`]), waits up to `wait` for it: taking it back is
    /// cheaper than making a new one.
    pub fn take(&self, key: &K, mut usable: impl FnMut(&mut V) -> bool, wait: Duration) -> Option<V> {
        let until = Instant::now() + wait;
        let mut inner = self.inner.lock().expect("kept lock");
        loop {
            if let Some(v) = inner.idle.get_mut(key) {
                while let Some(mut x) = v.pop() {
                    if usable(&mut x) {
                        return Some(x);
                    }
                }
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() || inner.coming.get(key).copied().unwrap_or(0) == 0 {
                return None;
            }
            inner.waiting += 1;
            inner = self.returned.wait_timeout(inner, left).expect("kept lock").0;
            inner.waiting -= 1;
        }
    }

    /// As [`Kept::take`], but every idle one for `key` is shown to
    /// `usable` first, and the one `preferred` picks is taken if there is
    /// one (the others stay kept).
    pub fn take_preferring(&self, key: &K, mut usable: impl FnMut(&mut V) -> bool, preferred: impl Fn(&V) -> bool, wait: Duration) -> Option<V> {
        {
            let mut inner = self.inner.lock().expect("kept lock");
            if let Some(v) = inner.idle.get_mut(key) {
                v.retain_mut(|x| usable(x));
                if let Some(i) = v.iter().position(&preferred) {
                    return Some(v.remove(i));
                }
                // Shown to `usable` already: not again.
                if let Some(x) = v.pop() {
                    return Some(x);
                }
            }
        }
        self.take(key, usable, wait)
    }

    /// One in use for `key` is expected back soon: [`Kept::take`] may wait
    /// for it. Each call is ended by [`Kept::keep`] or [`Kept::lost`].
    pub fn expect(&self, key: &K) {
        // Keeping none, nothing comes back to wait for.
        if self.per_key == 0 {
            return;
        }
        *self.inner.lock().expect("kept lock").coming.entry(key.clone()).or_default() += 1;
    }

    /// An expected one will not come back.
    pub fn lost(&self, key: &K) {
        let mut inner = self.inner.lock().expect("kept lock");
        Self::arrived(&mut inner, key);
        self.wake(inner);
    }

    /// Keeps `x` for the next transfer, unless enough are kept or `wanted`
    /// says no (asked under the lock [`Kept::clear`] takes, so nothing is
    /// kept after a clear that `wanted` already knew about). Ends an
    /// [`Kept::expect`] for `key`, if one is open.
    pub fn keep(&self, key: K, x: V, wanted: impl Fn() -> bool) {
        let mut inner = self.inner.lock().expect("kept lock");
        Self::arrived(&mut inner, &key);
        if wanted() {
            let v = inner.idle.entry(key).or_default();
            if v.len() < self.per_key {
                v.push(x);
            }
        }
        self.wake(inner);
    }

    /// Releases `inner` and wakes the takers waiting, if any.
    fn wake(&self, inner: std::sync::MutexGuard<'_, Inner<K, V>>) {
        let any = inner.waiting > 0;
        drop(inner);
        if any {
            self.returned.notify_all();
        }
    }

    /// Lets go of every idle one whose key `gone` picks.
    pub fn drop_where(&self, gone: impl Fn(&K) -> bool) {
        self.inner.lock().expect("kept lock").idle.retain(|k, _| !gone(k));
    }

    fn arrived(inner: &mut Inner<K, V>, key: &K) {
        if let Some(n) = inner.coming.get_mut(key) {
            *n -= 1;
            if *n == 0 {
                inner.coming.remove(key);
            }
        }
    }

    /// Lets every kept one go (closing a connection ends the peer's side too).
    pub fn clear(&self) {
        self.inner.lock().expect("kept lock").idle.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn the_idle_ones_of_a_key_can_be_let_go() {
        let k: Kept<(u32, u64), u32> = Kept::new(2);
        k.keep((0, 7), 1, || true);
        k.keep((0, 7), 2, || true);
        k.keep((1, 8), 5, || true);
        // Session 7 ended: its connections on every rail go, 8's stay.
        k.drop_where(|&(_, s)| s == 7);
        assert_eq!(k.take(&(0, 7), |_| true, Duration::ZERO), None);
        assert_eq!(k.take(&(1, 8), |_| true, Duration::ZERO), Some(5));
    }

    #[test]
    fn take_waits_only_for_one_expected_back() {
        let k: Arc<Kept<&str, u32>> = Arc::new(Kept::new(2));
        // Nothing idle, nothing expected: no wait at all.
        let t = Instant::now();
        assert_eq!(k.take(&"p", |_| true, Duration::from_secs(5)), None);
        assert!(t.elapsed() < Duration::from_secs(5));
        // One expected back: a taker gets it when it is kept.
        k.expect(&"p");
        let giver = {
            let k = k.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                k.keep("p", 7, || true)
            })
        };
        let t = Instant::now();
        assert_eq!(k.take(&"p", |_| true, Duration::from_secs(30)), Some(7));
        assert!(t.elapsed() < Duration::from_secs(20), "woken as it was kept, not at the end of the wait");
        giver.join().unwrap();
        // One expected that is lost: the taker stops waiting.
        k.expect(&"p");
        let loser = {
            let k = k.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                k.lost(&"p")
            })
        };
        let t = Instant::now();
        assert_eq!(k.take(&"p", |_| true, Duration::from_secs(30)), None);
        assert!(t.elapsed() < Duration::from_secs(20), "woken as it was lost, not at the end of the wait");
        loser.join().unwrap();
        // Other keys are not waited for.
        k.expect(&"q");
        assert_eq!(k.take(&"p", |_| true, Duration::from_secs(30)), None);
    }

    #[test]
    fn keeping_none_keeps_nothing_and_never_waits() {
        let k: Kept<&str, u32> = Kept::new(0);
        k.expect(&"p");
        k.keep("p", 1, || true);
        // Still expected by a second transfer: nothing will come back to it.
        k.expect(&"p");
        let t = Instant::now();
        assert_eq!(k.take(&"p", |_| true, Duration::from_secs(30)), None);
        assert!(t.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn take_preferring_takes_the_preferred_one_and_keeps_the_rest() {
        let k: Kept<&str, u32> = Kept::new(4);
        for x in [1, 2, 3, 4] {
            k.keep("p", x, || true);
        }
        // Every idle one is shown to `usable` (4 is refused and dropped),
        // the preferred one is taken, the rest stay.
        let mut shown = Vec::new();
        let got = k.take_preferring(&"p", |x| {
            shown.push(*x);
            *x != 4
        }, |x| *x == 2, Duration::ZERO);
        assert_eq!(got, Some(2));
        shown.sort();
        assert_eq!(shown, [1, 2, 3, 4]);
        // None preferred: the newest usable one, as `take` gives.
        assert_eq!(k.take_preferring(&"p", |_| true, |x| *x == 9, Duration::ZERO), Some(3));
        assert_eq!(k.take(&"p", |_| true, Duration::ZERO), Some(1));
        assert_eq!(k.take(&"p", |_| true, Duration::ZERO), None);
    }
}
