//! Staging buffers kept between transfers. A fresh memfd costs a page fault
//! per page on first touch and a teardown afterwards, which on a remap was
//! about half the CPU of both sides; a buffer taken back from here is
//! already faulted in. Each transfer still registers it under its own key.

use kvwire_transport::mem::MemError;
use kvwire_transport::{HostMem, Region};
use std::sync::{Arc, Mutex};

/// Buffers are allocated in whole MiB, so sizes that differ a little share them.
const GRAIN: u64 = 1 << 20;

#[derive(Debug)]
pub(super) struct StagePool {
    free: Mutex<Vec<Arc<HostMem>>>,
    cap: u64,
}

impl StagePool {
    /// A pool holding at most `cap` bytes of idle buffers.
    pub fn new(cap: u64) -> StagePool {
        StagePool { free: Mutex::new(Vec::new()), cap }
    }

    /// A buffer of at least `len` bytes: the smallest idle one that fits
    /// within twice `len`, else a new one.
    pub fn take(&self, len: u64) -> Result<Arc<HostMem>, MemError> {
        {
            let mut free = self.free.lock().expect("stage pool lock");
            let fits = free.iter().enumerate().filter(|(_, m)| m.len() >= len && m.len() <= len.saturating_mul(2).max(GRAIN)).min_by_key(|(_, m)| m.len());
            if let Some((i, _)) = fits {
                return Ok(free.swap_remove(i));
            }
        }
        HostMem::new("kvwire-stage", len.div_ceil(GRAIN) * GRAIN).map(Arc::new)
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
        let mut free = self.free.lock().expect("stage pool lock");
        if !wanted() {
            return;
        }
        let held: u64 = free.iter().map(|m| m.len()).sum();
        if held + mem.len() <= self.cap {
            free.push(mem);
        }
    }

    /// Lets every idle buffer go.
    pub fn clear(&self) {
        self.free.lock().expect("stage pool lock").clear();
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
        pool.clear();
        assert!(pool.free.lock().unwrap().is_empty());
    }
}
