//! Staging buffers kept between transfers. A fresh memfd costs a page fault
//! per page on first touch and a teardown afterwards, which on a remap was
//! about half the CPU of both sides; a buffer taken back from here is
//! already faulted in. Each transfer still registers it under its own key.

use kvwire_core::plan::Plan;
use kvwire_core::schedule::Schedule;
use kvwire_core::shard::RegionId;
use kvwire_transport::mem::MemError;
use kvwire_transport::{HostMem, Region, Scatter};
use std::collections::HashMap;
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

/// A destination's staging scattered into its cache as it arrives (tcp
/// and shm place the bytes themselves): each staged segment's bytes go
/// straight to its runs, in the order the source packed them, so the
/// payload crosses memory once instead of landing in staging and being
/// unpacked from there. Only without a codec, where staged bytes are the
/// runs' bytes as they are.
#[derive(Debug)]
pub(super) struct StageScatter {
    // Each distinct destination memory once; segments name theirs by index.
    mems: Vec<Arc<HostMem>>,
    // In staging order, which is offset order, back to back.
    segs: Vec<ScatterSeg>,
}

#[derive(Debug, Clone, Copy)]
struct ScatterSeg {
    // Where it starts in staging, and its bytes there.
    at: u64,
    bytes: u64,
    mem: u32,
    // Its first run in that memory, each run's bytes, and the distance between runs.
    first: u64,
    len: u64,
    stride: u64,
}

impl StageScatter {
    /// The scatter of `schedule`'s staged segments into `regions`, checked:
    /// every run lies inside its region's window.
    pub fn new(plan: &Plan, schedule: &Schedule, regions: &HashMap<(u32, RegionId), Arc<Region>>) -> Result<StageScatter, String> {
        let mut mems: Vec<Arc<HostMem>> = Vec::new();
        let mut segs = Vec::with_capacity(schedule.staged.len());
        for st in &schedule.staged {
            let seg = plan.segments.get(st.seg).ok_or_else(|| format!("staged segment {} is not in the plan", st.seg))?;
            if st.size != seg.bytes() {
                return Err(format!("segment {} stages {} bytes for {} bytes of runs", st.seg, st.size, seg.bytes()));
            }
            if st.size == 0 {
                continue;
            }
            let r = regions.get(&(seg.dst_rank, seg.dst_region)).ok_or_else(|| format!("segment {}: rank {} has no region {:?}", st.seg, seg.dst_rank, seg.dst_region))?;
            let last = (seg.count - 1).checked_mul(seg.dst_stride).and_then(|o| o.checked_add(seg.dst_offset)?.checked_add(seg.len));
            if last.is_none_or(|end| end > r.len) {
                return Err(format!("segment {}: its runs reach past region {:?} of {} bytes", st.seg, seg.dst_region, r.len));
            }
            let mem = match mems.iter().position(|m| Arc::ptr_eq(m, &r.mem)) {
                Some(i) => i,
                None => {
                    mems.push(r.mem.clone());
                    mems.len() - 1
                }
            };
            segs.push(ScatterSeg { at: st.offset, bytes: st.size, mem: mem as u32, first: r.offset + seg.dst_offset, len: seg.len, stride: seg.dst_stride });
        }
        Ok(StageScatter { mems, segs })
    }
}

impl Scatter for StageScatter {
    fn pieces(&self, offset: u64, len: u64, place: &mut dyn FnMut(&HostMem, u64, u64) -> std::io::Result<()>) -> std::io::Result<()> {
        let end = offset.checked_add(len).ok_or_else(|| std::io::Error::other("write range overflows"))?;
        let mut o = offset;
        let mut i = self.segs.partition_point(|s| s.at + s.bytes <= o);
        while o < end {
            let s = self.segs.get(i).filter(|s| s.at <= o).ok_or_else(|| std::io::Error::other(format!("staging byte {o} belongs to no staged segment")))?;
            let into = o - s.at;
            let (run, within) = (into / s.len, into % s.len);
            // Runs back to back at the destination go as one piece.
            let n = if s.stride == s.len { s.at + s.bytes - o } else { s.len - within }.min(end - o);
            place(&self.mems[s.mem as usize], s.first + run * s.stride + within, n)?;
            o += n;
            if o == s.at + s.bytes {
                i += 1;
            }
        }
        Ok(())
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
    fn a_scattered_range_goes_to_its_runs_across_segments_and_nowhere_else() {
        let (a, b) = (Arc::new(HostMem::new("a", 64).unwrap()), Arc::new(HostMem::new("b", 64).unwrap()));
        // Segment 0: 3 runs of 4 bytes, 10 apart, from byte 2 of `a`;
        // segment 1: 2 runs of 5 back to back from byte 30 of `b`.
        let segs = vec![
            ScatterSeg { at: 0, bytes: 12, mem: 0, first: 2, len: 4, stride: 10 },
            ScatterSeg { at: 12, bytes: 10, mem: 1, first: 30, len: 5, stride: 5 },
        ];
        let sc = StageScatter { mems: vec![a.clone(), b.clone()], segs };
        let pieces = |offset: u64, len: u64| {
            let mut got = Vec::new();
            let r = sc.pieces(offset, len, &mut |m, at, n| {
                got.push((if std::ptr::eq(m, &*a) { 'a' } else { 'b' }, at, n));
                Ok(())
            });
            r.map(|()| got).map_err(|e| e.to_string())
        };
        // From inside run 0 of segment 0 into segment 1, whose runs join.
        assert_eq!(pieces(2, 14), Ok(vec![('a', 4, 2), ('a', 12, 4), ('a', 22, 4), ('b', 30, 4)]));
        assert_eq!(pieces(0, 22).unwrap().iter().map(|p| p.2).sum::<u64>(), 22);
        assert_eq!(pieces(13, 9), Ok(vec![('b', 31, 9)]));
        // Past the last segment: refused, naming the byte.
        assert_eq!(pieces(20, 4), Err("staging byte 22 belongs to no staged segment".into()));
        assert!(pieces(u64::MAX, 2).is_err());
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
