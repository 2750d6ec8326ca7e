//! Plans kept for the next request with the same inputs: the group (its
//! model, layout and format, by generation), both sides' layouts and block
//! tables, the token counts and the codec. An engine that sends from and
//! into the same blocks again is not planned for again, on either side.
//! Bounded by count and by segments; a plan too large to keep is built for
//! its transfer alone. Requests with new block tables plan as before.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Most plans one cache keeps.
const MAX_PLANS: usize = 64;
/// Most segments one cache keeps, its plans together (about 80 bytes each).
const MAX_SEGMENTS: u64 = 256 << 10;

pub(super) struct Plans<K, V> {
    kept: Mutex<Kept<K, V>>,
}

struct Kept<K, V> {
    map: HashMap<K, Entry<V>>,
    segments: u64,
    clock: u64,
}

struct Entry<V> {
    value: Arc<V>,
    segments: u64,
    used: u64,
}

impl<K: Hash + Eq, V> Plans<K, V> {
    pub fn new() -> Self {
        Plans { kept: Mutex::new(Kept { map: HashMap::new(), segments: 0, clock: 0 }) }
    }

    /// The value under `key`: kept (counted in `reused`), or built now
    /// (outside the lock) and kept when its `segments` fit.
    pub fn get_or_build<E>(&self, key: K, reused: &AtomicU64, segments: impl FnOnce(&V) -> u64, build: impl FnOnce() -> Result<V, E>) -> Result<Arc<V>, E> {
        {
            let mut k = self.kept.lock().expect("plans lock");
            k.clock += 1;
            let now = k.clock;
            if let Some(e) = k.map.get_mut(&key) {
                e.used = now;
                reused.fetch_add(1, Ordering::Relaxed);
                return Ok(e.value.clone());
            }
        }
        let value = Arc::new(build()?);
        let n = segments(&value);
        if n <= MAX_SEGMENTS / 4 {
            let mut k = self.kept.lock().expect("plans lock");
            // The least recently used go first; clock values are unique.
            while !k.map.is_empty() && (k.map.len() >= MAX_PLANS || k.segments + n > MAX_SEGMENTS) {
                let oldest = k.map.values().map(|e| e.used).min().expect("not empty");
                let mut freed = 0;
                k.map.retain(|_, e| {
                    let keep = e.used != oldest;
                    if !keep {
                        freed += e.segments;
                    }
                    keep
                });
                k.segments -= freed;
            }
            k.clock += 1;
            let used = k.clock;
            // Built twice at once: the later one replaces the earlier.
            if let Some(old) = k.map.insert(key, Entry { value: value.clone(), segments: n, used }) {
                k.segments -= old.segments;
            }
            k.segments += n;
        }
        Ok(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_values_are_reused_and_the_least_recent_go_first() {
        let p: Plans<u32, u64> = Plans::new();
        let (built, hits) = (std::cell::Cell::new(0), AtomicU64::new(0));
        let get = |k: u32, segs: u64| {
            *p.get_or_build(k, &hits, |_| segs, || {
                built.set(built.get() + 1);
                Ok::<_, ()>(u64::from(k) * 10)
            })
            .unwrap()
        };
        assert_eq!(get(1, 1), 10);
        assert_eq!(get(1, 1), 10);
        assert_eq!((built.get(), hits.load(Ordering::Relaxed)), (1, 1));
        // Fill to the count bound; 1 stays recent, so 2 goes first.
        for k in 2..=MAX_PLANS as u32 {
            get(k, 1);
            get(1, 1);
        }
        get(1000, 1);
        let before = built.get();
        get(1, 1);
        assert_eq!(built.get(), before, "the recently used plan is kept");
        get(2, 1);
        assert_eq!(built.get(), before + 1, "the least recently used plan went");
        // Over a quarter of the segment bound: built, never kept.
        get(5000, MAX_SEGMENTS / 4 + 1);
        get(5000, MAX_SEGMENTS / 4 + 1);
        assert_eq!(built.get(), before + 3);
        // A failed build keeps nothing.
        assert!(p.get_or_build(7000, &hits, |_| 1, || Err::<u64, _>("no")).is_err());
        assert_eq!(get(7000, 1), 70000);
    }

    #[test]
    fn the_segment_bound_holds() {
        let p: Plans<u32, u32> = Plans::new();
        for k in 0..40 {
            p.get_or_build(k, &AtomicU64::new(0), |_| MAX_SEGMENTS / 8, || Ok::<_, ()>(k)).unwrap();
            let kept = p.kept.lock().unwrap();
            assert!(kept.segments <= MAX_SEGMENTS, "{} segments kept", kept.segments);
            assert_eq!(kept.segments, kept.map.values().map(|e| e.segments).sum::<u64>());
        }
    }
}
