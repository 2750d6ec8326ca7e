//! Staging buffers kept between transfers. A fresh memfd costs a page fault
//! per page on first touch and a teardown afterwards, which on a remap was
//! about half the CPU of both sides; a buffer taken back from here is
//! already faulted in. A destination's buffer is registered under a new key
//! per transfer (it is writable by that transfer alone). A source's is only
//! read here, so it stays registered between transfers to the same peer:
//! over shm the peer keeps its mapping of it, where a new key made both
//! sides unmap it, hand the memfd over again and map it anew per transfer.

use kvwire_transport::mem::MemError;
use kvwire_transport::{HostMem, Region};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Buffers are allocated in whole MiB, so sizes that differ a little share them.
const GRAIN: u64 = 1 << 20;

#[derive(Debug)]
pub(super) struct StagePool {
    free: Mutex<Vec<Arc<HostMem>>>,
    sources: Mutex<Sources>,
    cap: u64,
}

/// Source stages: idle ones, registered, by the peer they went to; and
/// the peer of each one in use, by key.
#[derive(Debug, Default)]
struct Sources {
    idle: Vec<(String, Arc<Region>)>,
    out: HashMap<u32, String>,
}

/// Whether a buffer of `have` bytes suits a need of `len`: it fits, within twice.
fn suits(have: u64, len: u64) -> bool {
    have >= len && have <= len.saturating_mul(2).max(GRAIN)
}

impl StagePool {
    /// A pool holding at most `cap` bytes of idle buffers.
    pub fn new(cap: u64) -> StagePool {
        StagePool { free: Mutex::new(Vec::new()), sources: Mutex::new(Sources::default()), cap }
    }

    /// A buffer of at least `len` bytes: the smallest idle one that fits
    /// within twice `len`, else a new one.
    pub fn take(&self, len: u64) -> Result<Arc<HostMem>, MemError> {
        {
            let mut free = self.free.lock().expect("stage pool lock");
            let fits = free.iter().enumerate().filter(|(_, m)| suits(m.len(), len)).min_by_key(|(_, m)| m.len());
            if let Some((i, _)) = fits {
                return Ok(free.swap_remove(i));
            }
        }
        HostMem::new("kvwire-stage", len.div_ceil(GRAIN) * GRAIN).map(Arc::new)
    }

    /// A source stage of at least `len` bytes that went to `peer` before,
    /// still registered; else `register` makes one (whole: later transfers
    /// may need more of it). Either way it is `peer`'s until [`StagePool::give_source`].
    pub fn take_source(&self, peer: &str, len: u64, register: impl FnOnce(Arc<HostMem>) -> Result<Arc<Region>, String>) -> Result<Arc<Region>, String> {
        let kept = {
            let mut s = self.sources.lock().expect("stage pool lock");
            let fits = s.idle.iter().enumerate().filter(|(_, (p, r))| p == peer && suits(r.len, len)).min_by_key(|(_, (_, r))| r.len).map(|(i, _)| i);
            fits.map(|i| s.idle.swap_remove(i).1)
        };
        let region = match kept {
            Some(r) => r,
            None => {
                let mem = self.take(len).map_err(|e| e.to_string())?;
                register(mem)?
            }
        };
        self.sources.lock().expect("stage pool lock").out.insert(region.key, peer.to_string());
        Ok(region)
    }

    /// Takes back a source stage from [`StagePool::take_source`] to keep it
    /// registered for its peer, when `wanted` and the pool has room;
    /// returns it otherwise, and any other region, for the caller to revoke.
    pub fn give_source(&self, region: Arc<Region>, wanted: impl Fn() -> bool) -> Option<Arc<Region>> {
        let mut s = self.sources.lock().expect("stage pool lock");
        let Some(peer) = s.out.remove(&region.key) else { return Some(region) };
        if !wanted() {
            return Some(region);
        }
        let free: u64 = self.free.lock().expect("stage pool lock").iter().map(|m| m.len()).sum();
        let idle: u64 = s.idle.iter().map(|(_, r)| r.len).sum();
        if free + idle + region.len > self.cap {
            return Some(region);
        }
        s.idle.push((peer, region));
        None
    }

    /// Takes back the memory of a revoked staging region, when nothing else
    /// holds it any more (a writer still placing into it keeps it out) and
    /// the pool has room; else it is let go.
    pub fn give(&self, region: Arc<Region>, wanted: impl Fn() -> bool) {
        let Ok(region) = Arc::try_unwrap(region) else { return };
        let mem = region.mem;
        if Arc::strong_count(&mem) != 1 {
            return;
        }
        let idle: u64 = self.sources.lock().expect("stage pool lock").idle.iter().map(|(_, r)| r.len).sum();
        let mut free = self.free.lock().expect("stage pool lock");
        if !wanted() {
            return;
        }
        let held: u64 = idle + free.iter().map(|m| m.len()).sum::<u64>();
        if held + mem.len() <= self.cap {
            free.push(mem);
        }
    }

    /// Lets every idle buffer go; returns the source stages kept
    /// registered, for the caller to revoke.
    #[must_use]
    pub fn clear(&self) -> Vec<Arc<Region>> {
        self.free.lock().expect("stage pool lock").clear();
        std::mem::take(&mut self.sources.lock().expect("stage pool lock").idle).into_iter().map(|(_, r)| r).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvwire_transport::Registry;

    fn region(reg: &Registry, mem: Arc<HostMem>, len: u64) -> Arc<Region> {
        let r = reg.register(mem, 0, len, None).unwrap();
        reg.revoke(r.key);
        r
    }

    #[test]
    fn a_given_back_buffer_is_taken_again_and_the_cap_holds() {
        let reg = Registry::new(16);
        let pool = StagePool::new(3 * GRAIN);
        let a = pool.take(GRAIN + 1).unwrap();
        assert_eq!(a.len(), 2 * GRAIN, "whole MiB");
        let at = a.as_ptr();
        pool.give(region(&reg, a, GRAIN + 1), || true);
        // Fits within twice the need: the same mapping comes back.
        let b = pool.take(GRAIN + 100).unwrap();
        assert_eq!(b.as_ptr(), at);
        // Too big for the need (more than twice): a new one.
        pool.give(region(&reg, b, 10), || true);
        let small = pool.take(10).unwrap();
        assert_ne!(small.as_ptr(), at);
        assert_eq!(small.len(), GRAIN);
        // Past the cap (2 MiB idle + 3 MiB > 3 MiB): let go.
        let c = pool.take(3 * GRAIN).unwrap();
        assert_ne!(c.as_ptr(), at);
        pool.give(region(&reg, c, 1), || true);
        assert_eq!(pool.free.lock().unwrap().len(), 1);
        // Memory someone still holds is never pooled.
        let held = pool.take(GRAIN).unwrap();
        let keep = held.clone();
        pool.give(region(&reg, held, 1), || true);
        assert!(pool.free.lock().unwrap().iter().all(|m| m.as_ptr() != keep.as_ptr()));
        // Unwanted (no client left): let go; clear empties the pool.
        let idle = pool.free.lock().unwrap().len();
        pool.give(region(&reg, Arc::new(HostMem::new("t", GRAIN).unwrap()), 1), || false);
        assert_eq!(pool.free.lock().unwrap().len(), idle);
        pool.give(region(&reg, Arc::new(HostMem::new("t", GRAIN).unwrap()), 1), || true);
        assert_eq!(pool.free.lock().unwrap().len(), idle + 1);
        assert!(pool.clear().is_empty());
        assert!(pool.free.lock().unwrap().is_empty());
    }

    #[test]
    fn a_source_stage_stays_registered_for_its_peer_alone() {
        let reg = Registry::new(16);
        let pool = StagePool::new(3 * GRAIN);
        let register = |mem: Arc<HostMem>| {
            let len = mem.len();
            reg.register(mem, 0, len, None).map_err(|e| e.to_string())
        };
        let a = pool.take_source("a", 100, register).unwrap();
        assert_eq!(a.len, GRAIN, "registered whole");
        let key = a.key;
        assert!(pool.give_source(a, || true).is_none(), "kept");
        // The same peer gets it back under the same key; another peer does not.
        let b = pool.take_source("b", 100, register).unwrap();
        assert_ne!(b.key, key);
        let a = pool.take_source("a", 200, register).unwrap();
        assert_eq!(a.key, key);
        assert!(reg.get(key).is_some());
        // Unwanted, past the cap, or never taken from here: handed back to revoke.
        assert_eq!(pool.give_source(b, || false).map(|r| r.len), Some(GRAIN));
        let big = pool.take_source("a", 3 * GRAIN, register).unwrap();
        assert!(pool.give_source(a, || true).is_none());
        assert!(pool.give_source(big, || true).is_some(), "1 + 3 MiB > 3 MiB");
        let foreign = reg.register(Arc::new(HostMem::new("t", GRAIN).unwrap()), 0, GRAIN, None).unwrap();
        assert!(pool.give_source(foreign, || true).is_some());
        // Kept ones count against the cap of plain buffers too, and clear hands them back.
        pool.give(region(&reg, Arc::new(HostMem::new("t", 3 * GRAIN).unwrap()), 1), || true);
        assert!(pool.free.lock().unwrap().is_empty());
        assert_eq!(pool.clear().iter().map(|r| r.key).collect::<Vec<_>>(), vec![key]);
    }
}
