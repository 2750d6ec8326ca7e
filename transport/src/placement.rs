//! Destination-side accounting: bytes placed per (transfer slot, layer),
//! counted — never inferred from ordering — and the flag published only when
//! the count reaches what the plan sends for that layer.

use crate::flags::FlagTable;
use crate::metrics::{Hop, Hops};
use kvwire_core::protocol::Tag;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
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
}

#[derive(Debug, Default, Clone, Copy)]
struct Count {
    expected: Option<u64>,
    placed: u64,
    published: bool,
}

/// Placed-byte counters of one destination endpoint, and its flags.
#[derive(Debug)]
pub struct Placement {
    counts: Mutex<HashMap<Tag, Count>>,
    flags: FlagTable,
    hops: Arc<Hops>,
}

impl Placement {
    /// Accounting publishing into `flags`, timing into `hops`.
    pub fn new(flags: FlagTable, hops: Arc<Hops>) -> Placement {
        Placement { counts: Mutex::new(HashMap::new()), flags, hops }
    }

    /// The flag page.
    pub fn flags(&self) -> &FlagTable {
        &self.flags
    }

    /// The hop histograms.
    pub fn hops(&self) -> &Arc<Hops> {
        &self.hops
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
        self.settle(tag, c)
    }

    /// Refuses, before any byte is written, a write that would take `tag`
    /// past its declared size.
    pub fn check_room(&self, tag: Tag, bytes: u64) -> Result<(), PlacementError> {
        let counts = self.counts.lock().expect("placement lock");
        match counts.get(&tag) {
            Some(Count { expected: Some(expected), placed, .. }) if placed.saturating_add(bytes) > *expected => {
                Err(PlacementError::Overrun { slot: tag.slot, layer: tag.layer, placed: placed + bytes, expected: *expected })
            }
            _ => Ok(()),
        }
    }

    /// Counts `bytes` placed for `tag`, whose data is already visible in the
    /// region; `seen_at` is when the transport saw the remote completion.
    pub fn placed(&self, tag: Tag, bytes: u64, seen_at: std::time::Instant) -> Result<(), PlacementError> {
        let mut counts = self.counts.lock().expect("placement lock");
        let c = counts.entry(tag).or_default();
        c.placed = c.placed.saturating_add(bytes);
        let r = self.settle(tag, c);
        self.hops.record(Hop::Place, seen_at.elapsed(), bytes);
        r
    }

    fn settle(&self, tag: Tag, c: &mut Count) -> Result<(), PlacementError> {
        match c.expected {
            Some(expected) if c.placed > expected => {
                Err(PlacementError::Overrun { slot: tag.slot, layer: tag.layer, placed: c.placed, expected })
            }
            Some(expected) if c.placed == expected && !c.published && !self.flags.failed(tag) => {
                if !self.flags.publish(tag) {
                    return Err(PlacementError::NoFlag { slot: tag.slot, layer: tag.layer });
                }
                c.published = true;
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// Bytes placed so far for `tag`.
    pub fn placed_bytes(&self, tag: Tag) -> u64 {
        self.counts.lock().expect("placement lock").get(&tag).map_or(0, |c| c.placed)
    }

    /// Waits for `tag`'s flag and records the `notify` hop.
    pub fn wait(&self, tag: Tag, timeout: Duration) -> Result<Duration, crate::flags::WaitError> {
        let d = self.flags.wait(tag, timeout)?;
        self.hops.record(Hop::Notify, d, 0);
        Ok(d)
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
        self.counts.lock().expect("placement lock").retain(|t, _| t.slot != slot);
        self.flags.clear_slot(slot);
    }
}
