//! A device-resident source's staging ring. Each layer's source bytes (its
//! footprint: what its segments read, as it lies in device memory) are
//! copied device → host into one slot of a ring the transfer holds, and
//! written from there; a slot is copied into again only once the writes
//! of the layer it held completed. So a
//! transfer holds `depth` layers of pinned host memory, not its ranks',
//! and once its last layer's copies are done nothing of it reads the
//! device again: that is where the source is released (DESIGN §1).

use super::ByRegion;
use super::state::{DeviceMems, Pin};
use super::Daemon;
use kvwire_core::plan::{Plan, Segment};
use kvwire_core::schedule::Schedule;
use kvwire_core::shard::RegionId;
use kvwire_transport::device::bound::BoundMem;
use kvwire_transport::{HostMem, Region};
use std::sync::{Arc, Mutex};

/// Ring buffers are allocated in whole MiB, so sizes that differ a little share them.
const GRAIN: u64 = 1 << 20;

/// A pinned buffer, kept between transfers: pinning is a driver call
/// that costs about as much as a large copy.
struct Pinned {
    mem: Arc<HostMem>,
    // Unpins on drop; it may hold `mem` too.
    _pin: Pin,
    // References to `mem` while idle (ours, and the pin's if it holds one):
    // more when it comes back means a late reader still holds it.
    idle_refs: usize,
}

/// Idle pinned ring buffers, at most `cap` bytes of them.
pub(super) struct RingPool {
    free: Mutex<Vec<Pinned>>,
    cap: u64,
}

impl RingPool {
    pub fn new(cap: u64) -> RingPool {
        RingPool { free: Mutex::new(Vec::new()), cap }
    }

    /// Lets every idle buffer go.
    pub fn clear(&self) {
        self.free.lock().expect("ring pool lock").clear();
    }
}

/// Where a ring's bytes are read from, for one transfer: a
/// device-resident rank's allocation (copied by its stream; its host
/// mirror names it), or a host-resident rank's memory (copied here).
pub(super) struct RingSource {
    pub rank: u32,
    pub mem: Arc<HostMem>,
    pub dev: Option<Arc<dyn BoundMem>>,
    /// The key the NIC reads the device allocation under in place
    /// (GPUDirect), offsets as in `mem`; None: written from the ring.
    pub direct: Option<u32>,
}

/// A piece of a layer's source footprint: `len` bytes at `from` in source
/// `src`, at `at` in the layer's slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Extent {
    pub src: usize,
    pub from: u64,
    pub len: u64,
    pub at: u64,
}

/// One layer's slot: the bytes its segments read, as they lie in their
/// memory (the runs merged, so the device copies are few and large, as a
/// whole block's are), then the staged segments the source gathers
/// ([`super::source`]'s `gathers`), each in one piece, packed from the
/// footprint on the host.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct SlotLayout {
    /// Sorted by (source, offset); none overlap.
    pub extents: Vec<Extent>,
    /// (segment, offset in the slot), in plan order.
    pub packed: Vec<(usize, u64)>,
}

/// Where each layer's source bytes lie in a ring slot. It holds no
/// memory: it is kept with its plan, for the group's life.
pub(super) struct RingLayout {
    /// Per source: its rank, and a region that lies in it.
    pub sources: Vec<(u32, RegionId)>,
    /// (rank, region) → (source, the region's offset in it).
    pub regions: ByRegion<(usize, u64)>,
    pub layers: Vec<SlotLayout>,
    /// Bytes of one slot: the largest layer's.
    pub slot_bytes: u64,
}

impl RingLayout {
    /// The slots of `plan`'s layers, read from `regions`; `packs` says
    /// which staged segments are gathered, and `copied` which other
    /// segments' bytes the slot holds (not those the NIC reads in place
    /// with nothing to check).
    pub fn build(plan: &Plan, schedule: &Schedule, regions: &ByRegion<Arc<Region>>, packs: impl Fn(&Segment) -> bool, copied: impl Fn(&Segment) -> bool) -> Result<RingLayout, String> {
        let mut sources: Vec<(u32, RegionId)> = Vec::new();
        let mut at_region: ByRegion<(usize, u64)> = ByRegion::default();
        let mut source_of = |rank: u32, region: RegionId| -> Result<(usize, u64), String> {
            if let Some(&w) = at_region.get(&(rank, region)) {
                return Ok(w);
            }
            let r = regions.get(&(rank, region)).ok_or_else(|| format!("rank {rank} has no region {region:?}"))?;
            let same = |&(rk, rg): &(u32, RegionId)| rk == rank && regions.get(&(rk, rg)).is_some_and(|o| Arc::ptr_eq(&o.mem, &r.mem));
            let src = match sources.iter().position(same) {
                Some(i) => i,
                None => {
                    sources.push((rank, region));
                    sources.len() - 1
                }
            };
            at_region.insert((rank, region), (src, r.offset));
            Ok((src, r.offset))
        };
        let mut slot_bytes = 0;
        let mut layers = Vec::with_capacity(schedule.layers.len());
        for ls in &schedule.layers {
            let mut runs = Vec::new();
            let staged = ls.staged.iter().map(|st| (st.seg, true));
            for (i, is_staged) in ls.direct.iter().map(|i| (i, false)).chain(staged) {
                let s = &plan.segments.at(i);
                let (src, base) = source_of(s.src_rank, s.src_region)?;
                if (is_staged && packs(s)) || copied(s) {
                    runs.extend(s.runs().map(|(so, _)| (src, base + so, s.len)));
                }
            }
            runs.sort_unstable();
            // Runs that touch or overlap (a byte two destination ranks read) become one extent.
            let mut extents: Vec<Extent> = Vec::new();
            let mut at = 0;
            for (src, from, len) in runs {
                match extents.last_mut() {
                    Some(e) if e.src == src && from <= e.from + e.len => {
                        let end = (from + len).max(e.from + e.len);
                        at += end - (e.from + e.len);
                        e.len = end - e.from;
                    }
                    _ => {
                        extents.push(Extent { src, from, len, at });
                        at += len;
                    }
                }
            }
            let mut packed = Vec::new();
            for st in ls.staged.iter().filter(|st| packs(&plan.segments.at(st.seg))) {
                packed.push((st.seg, at));
                at += st.size;
            }
            slot_bytes = slot_bytes.max(at);
            layers.push(SlotLayout { extents, packed });
        }
        Ok(RingLayout { sources, regions: at_region, layers, slot_bytes })
    }

    /// This transfer's memory of each source, from its group's regions and
    /// device allocations. Every region must still lie where the layout
    /// was made (a rank released and registered again may hold other
    /// memory): else an error, and the layout is made anew.
    pub fn resolve(&self, regions: &ByRegion<Arc<Region>>, devices: &DeviceMems) -> Result<Vec<RingSource>, String> {
        let sources = self
            .sources
            .iter()
            .map(|&(rank, region)| {
                let r = regions.get(&(rank, region)).ok_or_else(|| format!("rank {rank} has no region {region:?}"))?;
                let dev = match devices.get(&rank) {
                    Some(devs) => Some(devs.iter().find(|m| Arc::ptr_eq(&m.mirror, &r.mem)).ok_or_else(|| format!("rank {rank} region {region:?} lies in no registered allocation"))?),
                    None => None,
                };
                Ok(RingSource { rank, mem: r.mem.clone(), dev: dev.map(|m| m.dev.clone()), direct: dev.and_then(|m| m.path.key()) })
            })
            .collect::<Result<Vec<_>, String>>()?;
        for (&(rank, region), &(src, offset)) in &self.regions {
            match regions.get(&(rank, region)) {
                Some(r) if Arc::ptr_eq(&r.mem, &sources[src].mem) && r.offset == offset => {}
                _ => return Err(format!("rank {rank} region {region:?} moved since its ring layout was made")),
            }
        }
        Ok(sources)
    }

    /// Where `len` bytes at `offset` in (`rank`, `region`) lie in layer
    /// `layer`'s slot, when its footprint holds them.
    pub fn find(&self, layer: usize, rank: u32, region: RegionId, offset: u64, len: u64) -> Option<u64> {
        let &(src, base) = self.regions.get(&(rank, region))?;
        let off = base + offset;
        let ext = &self.layers[layer].extents;
        let e = ext[..ext.partition_point(|e| (e.src, e.from) <= (src, off))].last()?;
        (e.src == src && off + len <= e.from + e.len).then(|| e.at + off - e.from)
    }

    /// [`RingLayout::find`] for a stream of reads that mostly continue one
    /// another (a layer's checksums, run after run): the last region and
    /// extent are tried before any lookup.
    pub fn finder(&self, layer: usize) -> impl FnMut(u32, RegionId, u64, u64) -> Option<u64> + '_ {
        let ext = &self.layers[layer].extents;
        let (mut key, mut at, mut i) = (None, (0, 0), 0);
        move |rank, region, offset, len| {
            if key != Some((rank, region)) {
                at = *self.regions.get(&(rank, region))?;
                key = Some((rank, region));
            }
            let (src, off) = (at.0, at.1 + offset);
            let holds = |e: &Extent| e.src == src && e.from <= off && off + len <= e.from + e.len;
            if !ext.get(i).is_some_and(holds) {
                i = if ext.get(i + 1).is_some_and(holds) { i + 1 } else { ext.partition_point(|e| (e.src, e.from) <= (src, off)).checked_sub(1)? };
            }
            let e = &ext[i];
            holds(e).then(|| e.at + off - e.from)
        }
    }

    /// Where each of segment `s`'s runs lies in layer `layer`'s slot, in
    /// run order: one lookup for the segment, then a walk forward (its
    /// runs go up in offset), not a search per run.
    pub fn runs<'a>(&'a self, layer: usize, s: &'a Segment) -> impl Iterator<Item = Option<u64>> + 'a {
        let at = self.regions.get(&(s.src_rank, s.src_region)).copied();
        let ext = &self.layers[layer].extents;
        let mut i = at.map_or(0, |(src, base)| ext.partition_point(|e| (e.src, e.from) <= (src, base + s.src_offset)).saturating_sub(1));
        s.runs().map(move |(so, _)| {
            let (src, base) = at?;
            let off = base + so;
            while i + 1 < ext.len() && (ext[i + 1].src, ext[i + 1].from) <= (src, off) {
                i += 1;
            }
            let e = ext.get(i)?;
            (e.src == src && e.from <= off && off + s.len <= e.from + e.len).then(|| e.at + off - e.from)
        })
    }

    /// Where staged segment `seg`, gathered, lies in layer `layer`'s slot.
    pub fn packed(&self, layer: usize, seg: usize) -> Option<u64> {
        let p = &self.layers[layer].packed;
        p.binary_search_by_key(&seg, |&(s, _)| s).ok().map(|i| p[i].1)
    }
}

/// A transfer's ring: registered, pinned, `depth` slots of `slot_bytes`.
pub(super) struct Ring {
    pub region: Arc<Region>,
    pinned: Pinned,
    pub depth: usize,
    pub layout: Arc<RingLayout>,
    pub sources: Vec<RingSource>,
}

impl Ring {
    /// Offset of layer `layer`'s slot in the ring.
    pub fn base(&self, layer: usize) -> u64 {
        (layer % self.depth) as u64 * self.layout.slot_bytes
    }

    /// Bytes the ring holds (what the transfer pins).
    pub fn bytes(&self) -> u64 {
        self.depth as u64 * self.layout.slot_bytes
    }

    /// Where `len` bytes at `offset` in (`rank`, `region`) lie in the
    /// ring, once layer `layer`'s copies are done.
    pub fn find(&self, layer: usize, rank: u32, region: RegionId, offset: u64, len: u64) -> Option<u64> {
        Some(self.base(layer) + self.layout.find(layer, rank, region, offset, len)?)
    }

    /// Where each of segment `s`'s runs lies in the ring, once layer
    /// `layer`'s copies are done.
    pub fn runs<'a>(&'a self, layer: usize, s: &'a Segment) -> impl Iterator<Item = Option<u64>> + 'a {
        let base = self.base(layer);
        self.layout.runs(layer, s).map(move |at| Some(base + at?))
    }

    /// Where staged segment `seg` of layer `layer` lies in the ring, gathered.
    pub fn packed(&self, layer: usize, seg: usize) -> Option<u64> {
        Some(self.base(layer) + self.layout.packed(layer, seg)?)
    }
}

impl Daemon {
    /// A ring of `depth` slots for `layout`, pinned for the device's copies
    /// and registered for the writes: an idle one from the pool that fits
    /// within twice the need, else a new one.
    pub(super) fn take_ring(&self, layout: Arc<RingLayout>, sources: Vec<RingSource>, depth: usize) -> Result<Ring, String> {
        // A transfer that moves nothing (the destination holds every
        // position) still gets a region to name.
        let len = (depth as u64).checked_mul(layout.slot_bytes).ok_or("a ring past 64 bits")?.max(1);
        let reused = {
            let mut free = self.ring_pool.free.lock().expect("ring pool lock");
            let fits = free.iter().enumerate().filter(|(_, p)| p.mem.len() >= len && p.mem.len() <= len.saturating_mul(2).max(GRAIN)).min_by_key(|(_, p)| p.mem.len());
            fits.map(|(i, _)| i).map(|i| free.swap_remove(i))
        };
        let pinned = match reused {
            Some(p) => p,
            None => {
                let device = self.device.as_ref().ok_or("no device backend for a device-resident rank")?;
                let mem = Arc::new(HostMem::new("kvwire-ring", len.div_ceil(GRAIN) * GRAIN).map_err(|e| format!("ring of {len} bytes: {e}"))?);
                let pin = device.pin(&mem).map_err(|e| format!("pinning a ring of {len} bytes: {e}"))?;
                let idle_refs = Arc::strong_count(&mem);
                let pin = Pin::new(pin, mem.len(), &self.metrics.pinned_ring_bytes);
                Pinned { mem, _pin: pin, idle_refs }
            }
        };
        match self.register_region(pinned.mem.clone(), 0, len, None) {
            Ok(region) => Ok(Ring { region, pinned, depth, layout, sources }),
            Err(e) => Err(format!("registering a ring of {len} bytes: {e}")),
        }
    }

    /// Revokes a ring (late writes from it fail) and keeps its buffer for
    /// the next transfer when nothing else still holds it and the pool has
    /// room; else it is unpinned and let go.
    pub(super) fn give_ring(&self, ring: Ring) {
        let Ring { region, pinned, .. } = ring;
        self.revoke_key(region.key);
        drop(region);
        if Arc::strong_count(&pinned.mem) != pinned.idle_refs || !self.keeping() {
            return;
        }
        let mut free = self.ring_pool.free.lock().expect("ring pool lock");
        let held: u64 = free.iter().map(|p| p.mem.len()).sum();
        if held + pinned.mem.len() <= self.ring_pool.cap {
            free.push(pinned);
        }
    }
}


#[cfg(test)]
mod tests {
    use super::*;
    use kvwire_core::layout::Tensor;
    use kvwire_core::plan::{Mode, PlanCounters};
    use kvwire_core::schedule::{LayerSchedule, SegList, Staged, StagedList};
    use kvwire_transport::Registry;
    use std::collections::HashMap;

    fn seg(layer: u32, src_offset: u64, len: u64, count: u64, src_stride: u64, mode: Mode) -> Segment {
        let region = RegionId { layer, tensor: Tensor::K };
        Segment { src_rank: 0, src_region: region, src_offset, dst_rank: 0, dst_region: region, dst_offset: 0, len, count, src_stride, dst_stride: len, mode }
    }

    #[test]
    fn a_slot_holds_its_layers_footprint_merged_then_what_it_packs() {
        let reg = Registry::new(16);
        let mem = Arc::new(HostMem::new("t", 1 << 16).unwrap());
        let k = |layer| RegionId { layer, tensor: Tensor::K };
        // Two regions in one memory: layer 1's starts 4096 bytes in.
        let regions: ByRegion<_> = [(0, 0u64), (1, 4096)].into_iter().map(|(l, at)| ((0u32, k(l)), reg.register(mem.clone(), at, 4096, None).unwrap())).collect();
        let segments = vec![
            // Layer 0: runs at 0 and 200 of 100 bytes; then 100..200 (joins
            // the two); then 150..250 read twice (overlaps); then a packed
            // segment of runs 1000, 1100 apart.
            seg(0, 0, 100, 2, 200, Mode::Direct),
            seg(0, 100, 100, 1, 0, Mode::Direct),
            seg(0, 150, 100, 1, 0, Mode::Direct),
            seg(0, 1000, 10, 2, 100, Mode::Packed),
            // Layer 1: one run.
            seg(1, 8, 64, 1, 0, Mode::Direct),
        ];
        let counters = PlanCounters { segments: 5, writes: 0, total_bytes_moved: 0, packed_bytes: 0, direct_bytes: 0, reused_bytes: 0, metadata_bytes: 0, src_ranks: vec![], dst_ranks: vec![] };
        let plan = Plan { tokens: 1, prefix_tokens: 0, cost: Default::default(), counters, segments: segments.into() };
        let packed = Staged { seg: 3, offset: 0, size: 20, dim: 1, placed: false };
        let list = |segs: &[usize]| {
            let mut l = SegList::default();
            segs.iter().for_each(|&s| l.push(s));
            l
        };
        let one = || {
            let mut l = StagedList::default();
            l.push(packed);
            l
        };
        let schedule = Schedule {
            layers: vec![
                LayerSchedule { direct: list(&[0, 1, 2]), staged: one(), wire_bytes: 420 },
                LayerSchedule { direct: list(&[4]), staged: StagedList::default(), wire_bytes: 64 },
            ],
            staged: one(),
            stage_bytes: 20,
            hint: Default::default(),
        };
        let l = RingLayout::build(&plan, &schedule, &regions, |s| s.mode == Mode::Packed, |_| true).unwrap();
        assert_eq!(l.sources, vec![(0, k(0))], "one memory, one source");
        let sources = l.resolve(&regions, &HashMap::new()).unwrap();
        assert!(Arc::ptr_eq(&sources[0].mem, &mem) && sources[0].dev.is_none());
        // Layer 1's region registered elsewhere since (its rank released
        // and registered again): the layout no longer holds.
        let moved: ByRegion<_> = [(0, 0u64), (1, 8192)].into_iter().map(|(l, at)| ((0u32, k(l)), reg.register(mem.clone(), at, 4096, None).unwrap())).collect();
        let err = l.resolve(&moved, &HashMap::new()).err().unwrap();
        assert!(err.contains("moved"), "{err}");
        let e = |from, len, at| Extent { src: 0, from, len, at };
        // 0..300 in one piece, then 1000..1010 and 1100..1110; the packed copy after them.
        assert_eq!(l.layers[0].extents, vec![e(0, 300, 0), e(1000, 10, 300), e(1100, 10, 310)]);
        assert_eq!(l.layers[0].packed, vec![(3, 320)]);
        assert_eq!(l.layers[1].extents, vec![e(4096 + 8, 64, 0)]);
        assert_eq!(l.slot_bytes, 340, "the larger layer's footprint and packing");
        // Lookups by region offset: inside an extent, and not across its end.
        assert_eq!(l.find(0, 0, k(0), 150, 100), Some(150));
        assert_eq!(l.find(0, 0, k(0), 1100, 10), Some(310));
        assert_eq!(l.find(0, 0, k(0), 1005, 10), None, "past an extent's end");
        assert_eq!(l.find(0, 0, k(0), 500, 1), None, "outside the footprint");
        assert_eq!(l.find(1, 0, k(1), 8, 64), Some(0));
        assert_eq!(l.find(1, 0, k(0), 8, 64), None, "another layer's slot");
        // The walk over a segment's runs, and the finder that remembers
        // where it was, agree with the lookup.
        assert_eq!(l.runs(0, &plan.segments.at(0)).collect::<Vec<_>>(), vec![Some(0), Some(200)]);
        assert_eq!(l.runs(0, &plan.segments.at(3)).collect::<Vec<_>>(), vec![Some(300), Some(310)]);
        assert_eq!(l.runs(1, &plan.segments.at(3)).collect::<Vec<_>>(), vec![None, None], "another layer's slot");
        let mut f = l.finder(0);
        for (offset, len, want) in [(150, 100, Some(150)), (1100, 10, Some(310)), (0, 10, Some(0)), (1000, 10, Some(300)), (1005, 10, None), (250, 50, Some(250))] {
            assert_eq!(f(0, k(0), offset, len), want, "{offset}+{len}");
        }
        assert_eq!(f(0, k(1), 8, 64), None, "layer 1's bytes are not in layer 0's slot");
        assert_eq!(l.packed(0, 3), Some(320));
        assert_eq!(l.packed(0, 0), None);
        // A region no rank holds is an error naming it.
        let err = RingLayout::build(&plan, &schedule, &ByRegion::default(), |_| false, |_| true).err().unwrap();
        assert!(err.contains("rank 0 has no region"), "{err}");
    }
}
