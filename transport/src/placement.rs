//! Destination-side accounting: bytes placed per (transfer slot, layer),
//! counted — never inferred from ordering — and the flag published only when
//! the count reaches what the plan sends for that layer.

use crate::accept::RefusalCounts;
use crate::flags::FlagTable;
use crate::metrics::{Hop, Hops};
use kvwire_core::protocol::Tag;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// Why placement accounting refused an event.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum PlacementError {
    /// More bytes arrived for a layer than the plan sends.
    #[error("slot {slot} layer {layer}: {placed} bytes placed, more than the {expected} expected")]
    Overrun {
        /// Slot.
        slot: u16,
        /// Layer.
        layer: u16,
        /// Bytes placed so far.
        placed: u64,
        /// Bytes expected.
        expected: u64,
    },
    /// The tag is outside the flag table.
    #[error("slot {slot} layer {layer} is outside the flag table")]
    NoFlag {
        /// Slot.
        slot: u16,
        /// Layer.
        layer: u16,
    },
    /// No transfer declared this (slot, layer): nothing may count toward it.
    #[error("slot {slot} layer {layer}: no transfer expects bytes there")]
    Undeclared {
        /// Slot.
        slot: u16,
        /// Layer.
        layer: u16,
    },
    /// The layer was already declared with another size.
    #[error("slot {slot} layer {layer} already expects {expected} bytes, not {asked}")]
    Redeclared {
        /// Slot.
        slot: u16,
        /// Layer.
        layer: u16,
        /// Bytes declared before.
        expected: u64,
        /// Bytes declared now.
        asked: u64,
    },
    /// A strided write whose runs overlap one another (a distance shorter
    /// than a run), or of more than [`MAX_STRIDED_RUNS`] runs.
    #[error("slot {slot} layer {layer}: a strided write of {count} runs of {len} bytes every {stride} at offset {offset} of region {key:#010x}: its runs overlap one another, or they are more than 2^24")]
    StrideShape {
        /// Slot.
        slot: u16,
        /// Layer.
        layer: u16,
        /// Region key.
        key: u32,
        /// Offset of its first run.
        offset: u64,
        /// Bytes per run.
        len: u64,
        /// Runs.
        count: u64,
        /// Distance between runs.
        stride: u64,
    },
    /// A write whose bytes overlap a strided write's runs, or a strided
    /// write whose runs overlap bytes placed before, other than an exact
    /// repeat: they would count twice.
    #[error("slot {slot} layer {layer}: a write at offset {offset} of region {key:#010x} overlaps the runs of a strided write placed there")]
    StrideOverlap {
        /// Slot.
        slot: u16,
        /// Layer.
        layer: u16,
        /// Region key.
        key: u32,
        /// Offset of the write (its first run).
        offset: u64,
    },
}

/// What was placed in one region for one (slot, layer).
#[derive(Debug, Default)]
struct Placed {
    /// Disjoint byte ranges of plain writes (start → end).
    ranges: BTreeMap<u64, u64>,
    /// Strided writes placed, by their first run's offset. Their runs
    /// interleave with other strided writes' (a remap's heads), so they
    /// are not kept as ranges: none overlaps another's runs or a range.
    strided: BTreeMap<u64, Runs>,
    /// The longest strided span.
    max_span: u64,
}

/// `count` runs of `len` bytes, `stride` apart, from `at`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Runs {
    at: u64,
    len: u64,
    count: u64,
    stride: u64,
}

impl Runs {
    fn end(&self) -> u64 {
        self.at.saturating_add(crate::Stride::span(self.count, self.stride, self.len).unwrap_or(u64::MAX))
    }

    /// Whether a run reaches into `start..end` (an O(1) test: the runs
    /// that can are the indices between two bounds).
    fn hits(&self, start: u64, end: u64) -> bool {
        if self.len == 0 || start >= end || end <= self.at || start >= self.end() {
            return false;
        }
        if self.count == 1 || self.stride == 0 {
            return true;
        }
        // Run i covers at + i*stride .. + len: the first that ends after `start`,
        // and whether it starts before `end`.
        let first = (start.saturating_sub(self.at) + 1).saturating_sub(self.len).div_ceil(self.stride);
        first < self.count && self.at + first * self.stride < end
    }

    /// Whether any of its runs overlaps one of `o`'s: in O(1) at one
    /// stride (a remap's heads of a block), else run by run over the one
    /// with fewer runs inside the other's span.
    fn meets(&self, o: &Runs) -> bool {
        if self.len == 0 || o.len == 0 {
            return false;
        }
        if self.stride == o.stride && self.stride > 0 && self.count > 1 && o.count > 1 {
            // Run i here and run j there overlap iff, with k = j - i,
            // at - o.at - o.len < k * stride < at - o.at + len.
            let (d, s) = (i128::from(self.at) - i128::from(o.at), i128::from(self.stride));
            let lo = (d - i128::from(o.len)).div_euclid(s) + 1;
            let hi = (d + i128::from(self.len) - 1).div_euclid(s);
            return lo.max(1 - i128::from(self.count)) <= hi.min(i128::from(o.count) - 1);
        }
        let (few, many) = if self.count <= o.count { (self, o) } else { (o, self) };
        (0..few.count).map(|i| few.at + i * few.stride).take_while(|&s| s < many.end()).any(|s| many.hits(s, s + few.len))
    }
}

impl Placed {
    /// Strided writes whose span may reach into `start..end`.
    fn near(&self, start: u64, end: u64) -> impl Iterator<Item = &Runs> {
        self.strided.range(start.saturating_sub(self.max_span)..end).map(|(_, r)| r).filter(move |r| r.end() > start)
    }

    /// Whether a plain write of `start..end` would overlap a strided write's runs.
    fn plain_meets_strided(&self, start: u64, end: u64) -> bool {
        self.near(start, end).any(|r| r.hits(start, end))
    }

    /// The bytes strided write `w` adds: 0 when it repeats one placed
    /// before exactly; None when it overlaps anything else placed.
    fn strided_fresh(&self, w: &Runs) -> Option<u64> {
        if let Some(had) = self.strided.get(&w.at) {
            return (had == w).then_some(0);
        }
        let ranges_hit = self.ranges.range(..w.end()).rev().take_while(|(_, &e)| e > w.at).any(|(&s, &e)| w.hits(s, e));
        let strided_hit = self.near(w.at, w.end()).any(|r| r.meets(w));
        (!ranges_hit && !strided_hit).then(|| w.len.saturating_mul(w.count))
    }
}

/// Most runs one strided write may have (a 16M-row segment).
pub const MAX_STRIDED_RUNS: u64 = 1 << 24;

#[derive(Debug, Default, Clone, Copy)]
struct Count {
    expected: Option<u64>,
    placed: u64,
    published: bool,
}

/// Placed-byte counters of one destination endpoint, and its flags.
#[derive(Debug)]
pub struct Placement {
    // Ordered by (slot, layer): a slot's reset removes its own range
    // rather than scanning every bucket a busy moment left allocated.
    counts: Mutex<BTreeMap<Tag, Count>>,
    // Byte ranges placed per (tag, region key), for transports that may
    // deliver a write twice (a slice re-sent on another rail after its
    // first rail failed): a range is counted once, however often it lands.
    // With them, the strided writes placed there (shm).
    ranges: Mutex<BTreeMap<(Tag, u32), Placed>>,
    // Bytes that crossed the link per slot, as this end saw them: each
    // write's framing, its payload and its answer. A fixed row per slot
    // of the flag table, so nothing an outsider sends can grow it.
    crossed: Box<[AtomicU64]>,
    flags: FlagTable,
    hops: Arc<Hops>,
    // Bytes only for (slot, layer)s declared first: what a daemon facing
    // outsiders wants (its counting tables then hold nothing an outsider
    // made up); a bare endpoint may declare after bytes arrived.
    declared_only: bool,
    // Told of each (slot, layer) whose bytes are all placed, on the thread
    // that placed the last of them (see [`Placement::on_complete`]).
    complete: OnceLock<Hook>,
    refusals: RefusalCounts,
}

/// What [`Placement::on_complete`] runs.
pub type CompleteHook = Box<dyn Fn(Tag) + Send + Sync>;

struct Hook(CompleteHook);

impl std::fmt::Debug for Hook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Hook")
    }
}

impl Placement {
    /// Accounting publishing into `flags`, timing into `hops`.
    pub fn new(flags: FlagTable, hops: Arc<Hops>) -> Placement {
        let crossed = (0..flags.slots()).map(|_| AtomicU64::new(0)).collect();
        let (counts, ranges, refusals) = (Mutex::new(BTreeMap::new()), Mutex::new(BTreeMap::new()), RefusalCounts::default());
        Placement { counts, ranges, crossed, flags, hops, declared_only: false, complete: OnceLock::new(), refusals }
    }

    /// This accounting, refusing bytes for any (slot, layer) no
    /// [`Placement::expect`] declared before they arrived.
    pub fn declared_only(self) -> Placement {
        Placement { declared_only: true, ..self }
    }

    /// Runs `hook` for each (slot, layer) whose bytes are all placed, as
    /// the write that completes it is counted, on the data plane's thread
    /// that placed it, outside every lock here: whoever lands the layer
    /// can do so there, with no thread woken to do it. The hook must be
    /// quick, as the connection reads nothing meanwhile. One hook per
    /// placement: false when one was set already.
    pub fn on_complete(&self, hook: CompleteHook) -> bool {
        self.complete.set(Hook(hook)).is_ok()
    }

    /// The flag page.
    pub fn flags(&self) -> &FlagTable {
        &self.flags
    }

    /// The hop histograms.
    pub fn hops(&self) -> &Arc<Hops> {
        &self.hops
    }

    /// Writes refused on any connection of this accounting, by reason.
    pub fn refusals(&self) -> &RefusalCounts {
        &self.refusals
    }

    /// Declares that the plan sends `bytes` for `tag`. Bytes may already
    /// have arrived; the flag is published as soon as both agree.
    pub fn expect(&self, tag: Tag, bytes: u64) -> Result<(), PlacementError> {
        if !self.flags.contains(tag) {
            return Err(PlacementError::NoFlag { slot: tag.slot, layer: tag.layer });
        }
        let mut counts = self.counts.lock().expect("placement lock");
        let c = counts.entry(tag).or_default();
        if let Some(expected) = c.expected {
            if expected != bytes {
                return Err(PlacementError::Redeclared { slot: tag.slot, layer: tag.layer, expected, asked: bytes });
            }
        }
        c.expected = Some(bytes);
        self.settle(tag, c).map(|_| ())
    }

    /// Bytes declared so far for all the layers of `slot`: how large its
    /// transfer is, where the bytes land.
    pub fn slot_expected(&self, slot: u16) -> u64 {
        let counts = self.counts.lock().expect("placement lock");
        counts.range(Tag { slot, layer: 0 }..=Tag { slot, layer: u16::MAX }).filter_map(|(_, c)| c.expected).sum()
    }

    /// Refuses, before any byte is written, a write that would take `tag`
    /// past its declared size.
    pub fn check_room(&self, tag: Tag, bytes: u64) -> Result<(), PlacementError> {
        let counts = self.counts.lock().expect("placement lock");
        match counts.get(&tag) {
            Some(Count { expected: Some(expected), placed, .. }) if placed.saturating_add(bytes) > *expected => {
                Err(PlacementError::Overrun { slot: tag.slot, layer: tag.layer, placed: placed + bytes, expected: *expected })
            }
            Some(Count { expected: Some(_), .. }) => Ok(()),
            // Nothing declared: refused before a byte lands, so the counting
            // tables only ever hold what transfers declared.
            _ if self.declared_only => Err(PlacementError::Undeclared { slot: tag.slot, layer: tag.layer }),
            _ => Ok(()),
        }
    }

    /// Counts `bytes` placed for `tag`, whose data is already visible in the
    /// region; `seen_at` is when the transport saw the remote completion.
    pub fn placed(&self, tag: Tag, bytes: u64, seen_at: std::time::Instant) -> Result<(), PlacementError> {
        let mut counts = self.counts.lock().expect("placement lock");
        let c = counts.entry(tag).or_default();
        c.placed = c.placed.saturating_add(bytes);
        // Read the clock before settling: once the flag is up the waiter may
        // end the transfer, and a sample read after that would outlast it.
        let took = seen_at.elapsed();
        let r = self.settle(tag, c);
        drop(counts);
        self.hops.record(Hop::Place, took, bytes);
        if let (Ok(true), Some(hook)) = (&r, self.complete.get()) {
            (hook.0)(tag);
        }
        r.map(|_| ())
    }

    /// Publishes `tag`'s flag once its count reaches what was declared;
    /// true when this call published it.
    fn settle(&self, tag: Tag, c: &mut Count) -> Result<bool, PlacementError> {
        match c.expected {
            Some(expected) if c.placed > expected => {
                Err(PlacementError::Overrun { slot: tag.slot, layer: tag.layer, placed: c.placed, expected })
            }
            Some(expected) if c.placed == expected && !c.published && !self.flags.failed(tag) => {
                if !self.flags.publish(tag) {
                    return Err(PlacementError::NoFlag { slot: tag.slot, layer: tag.layer });
                }
                c.published = true;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// Bytes of `key[offset..offset+len]` not yet placed for `tag`; an
    /// error when they overlap a strided write's runs.
    pub fn new_bytes(&self, tag: Tag, key: u32, offset: u64, len: u64) -> Result<u64, PlacementError> {
        let ranges = self.ranges.lock().expect("placement lock");
        let end = offset.saturating_add(len);
        match ranges.get(&(tag, key)) {
            Some(p) if p.plain_meets_strided(offset, end) => Err(PlacementError::StrideOverlap { slot: tag.slot, layer: tag.layer, key, offset }),
            Some(p) => Ok(len - overlap(&p.ranges, offset, end)),
            None => Ok(len),
        }
    }

    /// [`Placement::check_room`] for a write of `key[offset..offset+len]`
    /// that may repeat bytes already placed: only its new bytes count.
    pub fn check_room_range(&self, tag: Tag, key: u32, offset: u64, len: u64) -> Result<(), PlacementError> {
        self.check_room(tag, self.new_bytes(tag, key, offset, len)?)
    }

    /// [`Placement::placed`] for a write of `key[offset..offset+len]`:
    /// counts only the bytes no earlier write of `tag` covered. Returns them.
    pub fn placed_range(&self, tag: Tag, key: u32, offset: u64, len: u64, seen_at: std::time::Instant) -> Result<u64, PlacementError> {
        let fresh = {
            let mut ranges = self.ranges.lock().expect("placement lock");
            let end = offset.saturating_add(len);
            let p = ranges.entry((tag, key)).or_default();
            if p.plain_meets_strided(offset, end) {
                return Err(PlacementError::StrideOverlap { slot: tag.slot, layer: tag.layer, key, offset });
            }
            cover(&mut p.ranges, offset, end)
        };
        self.placed(tag, fresh, seen_at).map(|()| fresh)
    }

    /// The bytes a strided write of `count` runs of `len` bytes, `stride`
    /// apart, from `key[offset]`, adds to `tag`; with `place`, it is
    /// recorded as placed. An exact repeat adds nothing; one that overlaps
    /// anything else placed is refused.
    #[allow(clippy::too_many_arguments)] // the tag, the region and the runs
    fn strided(&self, tag: Tag, key: u32, offset: u64, len: u64, count: u64, stride: u64, place: bool) -> Result<u64, PlacementError> {
        let w = Runs { at: offset, len, count, stride };
        let overlap = PlacementError::StrideOverlap { slot: tag.slot, layer: tag.layer, key, offset };
        // Runs that overlap one another would count their bytes twice; the
        // overlap tests' cost is bounded by the runs.
        if count > 1 && stride < len || count > MAX_STRIDED_RUNS {
            return Err(PlacementError::StrideShape { slot: tag.slot, layer: tag.layer, key, offset, len, count, stride });
        }
        let mut ranges = self.ranges.lock().expect("placement lock");
        let fresh = match ranges.get(&(tag, key)) {
            Some(p) => p.strided_fresh(&w).ok_or(overlap)?,
            None => len.saturating_mul(count),
        };
        if place && fresh > 0 {
            let p = ranges.entry((tag, key)).or_default();
            p.max_span = p.max_span.max(w.end() - w.at);
            p.strided.insert(offset, w);
        }
        Ok(fresh)
    }

    /// [`Placement::check_room`] for a strided write (shm's
    /// [`crate::Stride`]): only a write that overlaps nothing placed, or
    /// repeats one exactly, and its new bytes count.
    #[allow(clippy::too_many_arguments)] // the tag, the region and the runs
    pub fn check_room_strided(&self, tag: Tag, key: u32, offset: u64, len: u64, count: u64, stride: u64) -> Result<(), PlacementError> {
        self.check_room(tag, self.strided(tag, key, offset, len, count, stride, false)?)
    }

    /// [`Placement::placed`] for a strided write: counts its bytes the
    /// first time it lands. Returns them.
    #[allow(clippy::too_many_arguments)] // the tag, the region, the runs and when
    pub fn placed_strided(&self, tag: Tag, key: u32, offset: u64, len: u64, count: u64, stride: u64, seen_at: std::time::Instant) -> Result<u64, PlacementError> {
        let fresh = self.strided(tag, key, offset, len, count, stride, true)?;
        self.placed(tag, fresh, seen_at).map(|()| fresh)
    }

    /// Bytes placed so far for `tag`.
    pub fn placed_bytes(&self, tag: Tag) -> u64 {
        self.counts.lock().expect("placement lock").get(&tag).map_or(0, |c| c.placed)
    }

    /// Adds `bytes` that crossed the link for a write to `slot` (its
    /// framing, payload and answer, as the receiving backend read and sent
    /// them). Backends count a write before its bytes are counted as placed,
    /// so the figure already holds it once a flag it completes is seen.
    /// Slots outside the flag table count nothing.
    pub fn crossed(&self, slot: u16, bytes: u64) {
        if let Some(c) = self.crossed.get(usize::from(slot)) {
            c.fetch_add(bytes, Ordering::Relaxed);
        }
    }

    /// Takes back `bytes` counted by [`Placement::crossed`] ahead of a write
    /// that then did not move them (an shm write refused before its copy),
    /// or whose range had landed before: payload counts once, as at the
    /// source, where a re-sent slice is `retransmitted_bytes`.
    pub fn uncrossed(&self, slot: u16, bytes: u64) {
        if let Some(c) = self.crossed.get(usize::from(slot)) {
            let _ = c.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| Some(v.saturating_sub(bytes)));
        }
    }

    /// Bytes that crossed the link for writes to `slot` since it was last reset.
    pub fn crossed_bytes(&self, slot: u16) -> u64 {
        self.crossed.get(usize::from(slot)).map_or(0, |c| c.load(Ordering::Relaxed))
    }

    /// Waits for `tag`'s flag; returns how long after its publish it was
    /// seen. Not recorded as the `notify` hop: this table says the bytes
    /// are placed, and the one who waits on it here is the daemon itself,
    /// not the engine (DESIGN's `notify` is a client seeing `layer_ready`).
    pub fn wait(&self, tag: Tag, timeout: Duration) -> Result<Duration, crate::flags::WaitError> {
        self.flags.wait(tag, timeout)
    }

    /// Marks every layer of `slot` below `columns` failed: no flag of it
    /// will be published, and waiters return at once.
    pub fn fail_slot(&self, slot: u16, columns: u16) {
        for layer in 0..columns {
            self.flags.fail(Tag { slot, layer });
        }
    }

    /// Forgets every count of `slot` and clears its flags, so the slot can
    /// serve a new transfer. Call only after the old transfer's region keys
    /// were revoked, or late writes would count toward the new one.
    pub fn reset_slot(&self, slot: u16) {
        let (first, last) = (Tag { slot, layer: 0 }, Tag { slot, layer: u16::MAX });
        {
            let mut counts = self.counts.lock().expect("placement lock");
            let gone: Vec<Tag> = counts.range(first..=last).map(|(t, _)| *t).collect();
            for t in gone {
                counts.remove(&t);
            }
        }
        {
            let mut ranges = self.ranges.lock().expect("placement lock");
            let gone: Vec<(Tag, u32)> = ranges.range((first, 0)..=(last, u32::MAX)).map(|(k, _)| *k).collect();
            for k in gone {
                ranges.remove(&k);
            }
        }
        if let Some(c) = self.crossed.get(usize::from(slot)) {
            c.store(0, Ordering::Relaxed);
        }
        self.flags.clear_slot(slot);
    }
}

/// Bytes of `start..end` that the disjoint ranges in `m` (start → end) cover.
fn overlap(m: &BTreeMap<u64, u64>, start: u64, end: u64) -> u64 {
    let first = m.range(..=start).next_back().map_or(start, |(&s, _)| s);
    m.range(first..end).map(|(&s, &e)| e.min(end).saturating_sub(s.max(start))).sum()
}

/// Adds `start..end` to `m`, merging what it touches; returns the bytes it newly covers.
fn cover(m: &mut BTreeMap<u64, u64>, start: u64, end: u64) -> u64 {
    if start >= end {
        return 0;
    }
    let fresh = (end - start) - overlap(m, start, end);
    let first = m.range(..=start).next_back().filter(|(_, &e)| e >= start).map_or(start, |(&s, _)| s);
    let touched: Vec<(u64, u64)> = m.range(first..=end).map(|(&s, &e)| (s, e)).collect();
    let (mut lo, mut hi) = (start, end);
    for (s, e) in touched {
        m.remove(&s);
        lo = lo.min(s);
        hi = hi.max(e);
    }
    m.insert(lo, hi);
    fresh
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strided_runs_meet_exactly_where_their_bytes_do() {
        // Rows 0, 2, 4, 6 of 64 bytes (0..64, 128..192, ...).
        let even = Runs { at: 0, len: 64, count: 4, stride: 128 };
        assert!(even.hits(0, 1) && even.hits(63, 64) && even.hits(383, 500));
        assert!(!even.hits(64, 128) && !even.hits(448, 1000) && !even.hits(192, 256));
        assert!(even.hits(100, 200), "spans a gap into the next run");
        let odd = Runs { at: 64, ..even };
        assert!(!even.meets(&odd) && !odd.meets(&even));
        assert!(even.meets(&Runs { at: 256, len: 64, count: 1, stride: 0 }));
        assert!(even.meets(&Runs { at: 32, len: 64, count: 2, stride: 1000 }), "straddles rows 0 and 1");
        assert!(!even.meets(&Runs { at: 64, len: 32, count: 8, stride: 128 }));
        assert!(even.meets(&Runs { at: 64, len: 32, count: 3, stride: 96 }), "its third run is row 4");
        // One stride: the O(1) test against the run-by-run one.
        for at in 0..600 {
            for (len, count) in [(1, 2), (64, 4), (65, 3), (128, 2), (10, 9)] {
                let o = Runs { at, len, count, stride: 128 };
                let slow = (0..o.count).any(|j| even.hits(o.at + j * 128, o.at + j * 128 + len));
                assert_eq!(even.meets(&o), slow, "{o:?}");
                assert_eq!(o.meets(&even), slow, "{o:?}");
            }
        }
    }

    #[test]
    fn the_complete_hook_runs_once_per_layer_outside_the_lock() {
        let p = Arc::new(Placement::new(FlagTable::new(2, 2).unwrap(), Arc::new(Hops::default())));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (pw, sw) = (Arc::downgrade(&p), seen.clone());
        // The hook reads the placement back: it runs with no lock of it held.
        assert!(p.on_complete(Box::new(move |tag| sw.lock().unwrap().push((tag, pw.upgrade().unwrap().placed_bytes(tag))))));
        assert!(!p.on_complete(Box::new(|_| {})), "a second hook was taken");
        let (t, other) = (Tag { slot: 1, layer: 0 }, Tag { slot: 1, layer: 1 });
        p.expect(t, 100).unwrap();
        p.expect(other, 10).unwrap();
        let now = std::time::Instant::now();
        assert_eq!(p.placed_range(t, 7, 0, 60, now), Ok(60));
        assert!(seen.lock().unwrap().is_empty(), "hook before the layer was whole");
        assert_eq!(p.placed_range(t, 7, 60, 40, now), Ok(40));
        // The same range again (a slice re-sent on another rail) completes nothing new.
        assert_eq!(p.placed_range(t, 7, 0, 100, now), Ok(0));
        assert_eq!(*seen.lock().unwrap(), vec![(t, 100)]);
        assert_eq!(p.placed_range(other, 7, 0, 10, now), Ok(10));
        assert_eq!(*seen.lock().unwrap(), vec![(t, 100), (other, 10)]);
    }

    #[test]
    fn ranges_count_each_byte_once_and_merge() {
        let mut m = BTreeMap::new();
        assert_eq!(cover(&mut m, 10, 20), 10);
        assert_eq!(cover(&mut m, 10, 20), 0);
        assert_eq!(cover(&mut m, 15, 25), 5);
        assert_eq!(cover(&mut m, 0, 5), 5);
        assert_eq!(m.len(), 2);
        assert_eq!(cover(&mut m, 5, 10), 5); // fills the gap: adjacent ranges merge
        assert_eq!(m.into_iter().collect::<Vec<_>>(), vec![(0, 25)]);
        let mut m = BTreeMap::new();
        for (s, e) in [(0, 4), (8, 12), (16, 20)] {
            cover(&mut m, s, e);
        }
        assert_eq!(overlap(&m, 2, 18), 2 + 4 + 2);
        assert_eq!(cover(&mut m, 2, 18), 16 - 8);
        assert_eq!(m.into_iter().collect::<Vec<_>>(), vec![(0, 20)]);
        assert_eq!(cover(&mut BTreeMap::new(), 7, 7), 0);
    }
}
