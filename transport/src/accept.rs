//! The destination's one acceptance path, shared by every backend.
//!
//! A write reaching a destination is accepted in this order, and only
//! here:
//!
//! 1. **key**: its region is registered (not unknown, not revoked) and
//!    granted to the node whose session this connection proved, and to
//!    the write's slot
//!    ([`crate::registry::Grant`]); a local region takes no remote write;
//! 2. **bounds**: it has bytes, and all of them lie inside the region;
//! 3. **tag**: its (slot, layer) has a flag in this endpoint's table;
//! 4. **room**: the bytes it adds do not take the layer past what the plan
//!    declared ([`Placement::expect`]);
//! 5. **place**: the backend puts the bytes in (TCP reads the payload into
//!    the region, shm copies from the shared source; for verbs the NIC
//!    already did, before the note naming the write arrived);
//! 6. **count**: the range is counted once with
//!    [`Placement::placed_range`], so a range that lands twice (a slice
//!    re-sent on another rail after its first rail failed) adds nothing
//!    the second time. The key is checked again: a region revoked while
//!    its bytes were being placed counts nothing.
//!
//! [`admit`] does steps 1–4 and returns an [`Admitted`] write, the only
//! thing [`count`] takes, so no backend can count what was not checked.
//! [`accept`] runs the whole path with the backend's placing step.
//!
//! # How every backend reacts
//!
//! | what happened | destination | source |
//! |---|---|---|
//! | a [`Refusal`] | touches no byte (steps 1–4) or counts none (5–6); logs a `warn` with the peer; keeps serving the connection | tcp, shm: the `Nack` fails the batch with [`crate::TransportError::Refused`] carrying the refusal's text; verbs has no way back (one-sided), its source checks key and bounds against the peer's hello before posting, with the same texts |
//! | a malformed frame or write-note message | closes that connection only | its batches fail with `PeerClosed` |
//! | an answer for a write that is not outstanding | — | closes the connection (the stream lost sync); outstanding batches fail with `PeerClosed` |
//!
//! A refused verbs write has already landed when its note is refused; it
//! is not counted, so its layer's flag is never published from it.

use crate::placement::{Placement, PlacementError};
use crate::registry::{Region, Registry};
use kvwire_core::protocol::{check_write, Tag, WriteError};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// A write as the destination sees it: where its bytes go and what they
/// count toward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Incoming {
    /// (slot, layer) the bytes count toward.
    pub tag: Tag,
    /// Destination region key.
    pub key: u32,
    /// Offset in the destination region (of the first run).
    pub offset: u64,
    /// Bytes (per run).
    pub len: u64,
    /// (runs, distance between them) of a strided write (shm); None: one run.
    pub stride: Option<(u64, u64)>,
}

impl Incoming {
    /// Bytes it moves.
    pub fn bytes(&self) -> u64 {
        self.len.saturating_mul(self.stride.map_or(1, |s| s.0))
    }
}

/// Why a destination refused a write. Its text is what a `Nack` carries.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// No region has this key: never registered, or revoked.
    #[error("unknown or revoked remote key {0:#010x}")]
    UnknownKey(u32),
    /// The region is local, or granted to another node.
    #[error("region {0:#010x} is not open to this connection's node")]
    NotGranted(u32),
    /// The region belongs to another transfer slot.
    #[error("region {key:#010x} belongs to slot {granted}, not to slot {slot}")]
    OtherSlot {
        /// Region key.
        key: u32,
        /// The write's slot.
        slot: u16,
        /// The slot the region was granted to.
        granted: u16,
    },
    /// The write reaches past its region.
    #[error("write of {len} bytes at offset {offset} exceeds region {key:#010x} of {region_len} bytes")]
    OutOfBounds {
        /// Region key.
        key: u32,
        /// Offset of the write.
        offset: u64,
        /// Length of the write.
        len: u64,
        /// Length of the region.
        region_len: u64,
    },
    /// A zero-length write: it would count nothing and hide a bug.
    #[error("zero-length write")]
    ZeroLength,
    /// The tag names a slot or layer outside this endpoint's flag table.
    #[error("slot {slot} layer {layer} is outside the destination's flag table")]
    UnknownTag {
        /// Slot.
        slot: u16,
        /// Layer.
        layer: u16,
    },
    /// The write would take its layer past the bytes the plan declared.
    #[error("slot {slot} layer {layer}: {placed} bytes placed, more than the {expected} expected")]
    Overrun {
        /// Slot.
        slot: u16,
        /// Layer.
        layer: u16,
        /// Bytes the layer would hold with this write.
        placed: u64,
        /// Bytes declared.
        expected: u64,
    },
    /// (shm) The source region was never shared on this connection.
    #[error("source region {0:#010x} was never shared on this connection")]
    SourceNotShared(u32),
    /// (shm) The read reaches past the shared source window.
    #[error("source read of {len} bytes at offset {offset} exceeds source region {key:#010x} of {region_len} bytes")]
    SourceOutOfBounds {
        /// Source key.
        key: u32,
        /// Offset of the read in the source window.
        offset: u64,
        /// Length of the read.
        len: u64,
        /// Length of the source window.
        region_len: u64,
    },
    /// (shm) The shared source could not be mapped or copied from.
    #[error("source region {key:#010x}: {reason}")]
    SourceUnusable {
        /// Source key.
        key: u32,
        /// What went wrong.
        reason: String,
    },
    /// The bytes were placed, but counting them failed (another write of
    /// the layer overran it meanwhile, or its flag cannot be published).
    #[error("bytes placed, but not counted: {0}")]
    Uncounted(PlacementError),
    /// A write that overlaps a strided write's runs, or a strided write
    /// that overlaps bytes placed before (not an exact repeat): its bytes
    /// could count twice.
    #[error("{0}")]
    Overlap(PlacementError),
}

impl Refusal {
    /// What kind of refusal it is, as a metric label ([`REASONS`]).
    pub fn reason(&self) -> &'static str {
        REASONS[self.index()]
    }

    fn index(&self) -> usize {
        match self {
            Refusal::UnknownKey(_) => 0,
            Refusal::NotGranted(_) => 1,
            Refusal::OtherSlot { .. } => 2,
            Refusal::OutOfBounds { .. } => 3,
            Refusal::ZeroLength => 4,
            Refusal::UnknownTag { .. } => 5,
            Refusal::Overrun { .. } => 6,
            Refusal::SourceNotShared(_) => 7,
            Refusal::SourceOutOfBounds { .. } => 8,
            Refusal::SourceUnusable { .. } => 9,
            Refusal::Uncounted(_) => 10,
            Refusal::Overlap(_) => 11,
        }
    }

    /// Whether the write is not its slot's to make: its key is unknown,
    /// not this node's, or another slot's, or no transfer declared the
    /// slot. What it carried counts toward no transfer's `wire_bytes`, so a
    /// peer cannot charge its traffic to a transfer it does not hold.
    pub fn foreign(&self) -> bool {
        matches!(self, Refusal::UnknownKey(_) | Refusal::NotGranted(_) | Refusal::OtherSlot { .. } | Refusal::UnknownTag { .. })
    }
}

impl From<WriteError> for Refusal {
    fn from(e: WriteError) -> Refusal {
        match e {
            WriteError::UnknownKey(k) => Refusal::UnknownKey(k),
            WriteError::OutOfBounds { key, offset, len, region_len } => Refusal::OutOfBounds { key, offset, len, region_len },
            WriteError::ZeroLength => Refusal::ZeroLength,
        }
    }
}

/// Refusal of a room check (before any byte is placed).
fn before_placing(e: PlacementError) -> Refusal {
    match e {
        PlacementError::Overrun { slot, layer, placed, expected } => Refusal::Overrun { slot, layer, placed, expected },
        PlacementError::NoFlag { slot, layer } | PlacementError::Undeclared { slot, layer } => Refusal::UnknownTag { slot, layer },
        e @ (PlacementError::StrideOverlap { .. } | PlacementError::StrideShape { .. }) => Refusal::Overlap(e),
        e @ PlacementError::Redeclared { .. } => Refusal::Uncounted(e),
    }
}

/// A write that passed steps 1–4: its bytes may be placed, then counted
/// with [`count`].
#[derive(Debug)]
#[must_use = "an admitted write is counted with accept::count once its bytes are placed"]
pub struct Admitted {
    write: Incoming,
    region: Arc<Region>,
}

impl Admitted {
    /// The write.
    pub fn write(&self) -> Incoming {
        self.write
    }

    /// Its destination region (the `Arc` keeps the mapping alive).
    pub fn region(&self) -> &Arc<Region> {
        &self.region
    }

    /// Where its first byte goes in the region's memory
    /// (`region.offset + offset`); its span from there is inside it.
    pub fn mem_offset(&self) -> u64 {
        self.region.offset + self.write.offset
    }
}

/// Steps 1–4 for a write arriving on a connection that proved a session of
/// node `peer` (its id, [`crate::registry::Session::peer_id`]): key,
/// bounds, tag, room. Touches nothing.
pub fn admit(registry: &Registry, placement: &Placement, peer: u64, w: Incoming) -> Result<Admitted, Refusal> {
    let region = registry.get(w.key).ok_or(Refusal::UnknownKey(w.key))?;
    match region.grant {
        Some(g) if g.peer == peer => {
            if g.slot != w.tag.slot {
                return Err(Refusal::OtherSlot { key: w.key, slot: w.tag.slot, granted: g.slot });
            }
        }
        _ => return Err(Refusal::NotGranted(w.key)),
    }
    // A strided write's span, first run to last, lies in the region.
    let span = match w.stride {
        Some((count, stride)) => crate::Stride::span(count, stride, w.len).filter(|_| w.len > 0).ok_or(Refusal::OutOfBounds { key: w.key, offset: w.offset, len: u64::MAX, region_len: region.len })?,
        None => w.len,
    };
    check_write(w.key, Some(region.len), w.offset, span)?;
    if !placement.flags().contains(w.tag) {
        return Err(Refusal::UnknownTag { slot: w.tag.slot, layer: w.tag.layer });
    }
    match w.stride {
        Some((count, stride)) => placement.check_room_strided(w.tag, w.key, w.offset, w.len, count, stride),
        None => placement.check_room_range(w.tag, w.key, w.offset, w.len),
    }
    .map_err(before_placing)?;
    Ok(Admitted { write: w, region })
}

/// Step 6: counts an admitted write whose bytes are in place, once per
/// byte however often its range arrives. `seen_at` is when the transport
/// saw the bytes complete. Returns the bytes newly counted.
pub fn count(registry: &Registry, placement: &Placement, a: Admitted, seen_at: Instant) -> Result<u64, Refusal> {
    let w = a.write;
    // Revoked (or revoked and re-registered) while placing: a fenced write.
    if !registry.get(w.key).is_some_and(|r| Arc::ptr_eq(&r, &a.region)) {
        return Err(Refusal::UnknownKey(w.key));
    }
    // Let go of the region first: counting may complete a layer whose
    // landing then gives its staging buffer back, whole only when no one
    // else holds it.
    drop(a);
    match w.stride {
        Some((count, stride)) => placement.placed_strided(w.tag, w.key, w.offset, w.len, count, stride, seen_at),
        None => placement.placed_range(w.tag, w.key, w.offset, w.len, seen_at),
    }
    .map_err(Refusal::Uncounted)
}

/// The whole path: [`admit`], then `place` (the backend's step 5, which
/// returns when its bytes were seen in place), then [`count`]. Returns the
/// bytes newly counted. `E` lets a backend tell a refusal from its own
/// failures (a TCP payload that never arrived ends the connection).
pub fn accept<E: From<Refusal>>(
    registry: &Registry,
    placement: &Placement,
    peer: u64,
    w: Incoming,
    place: impl FnOnce(&Admitted) -> Result<Instant, E>,
) -> Result<u64, E> {
    let a = admit(registry, placement, peer, w)?;
    let seen_at = place(&a)?;
    Ok(count(registry, placement, a, seen_at)?)
}

/// Every kind of [`Refusal`], as [`Refusal::reason`] names it.
pub const REASONS: [&str; 12] = [
    "unknown_key",
    "not_granted",
    "other_slot",
    "out_of_bounds",
    "zero_length",
    "unknown_tag",
    "overrun",
    "source_not_shared",
    "source_out_of_bounds",
    "source_unusable",
    "uncounted",
    "overlap",
];

/// Writes an endpoint refused, by reason, over all its connections.
#[derive(Debug, Default)]
pub struct RefusalCounts([AtomicU64; REASONS.len()]);

impl RefusalCounts {
    fn note(&self, why: &Refusal) {
        self.0[why.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// (reason, writes refused for it), for every reason.
    pub fn by_reason(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        REASONS.iter().zip(&self.0).map(|(r, n)| (*r, n.load(Ordering::Relaxed)))
    }
}

/// Counts a refused write under its reason, and logs it within the budget
/// every connection shares ([`crate::logbudget`]): a peer cannot flood the
/// log, nor can a failed transfer, whose writes in flight are all refused
/// as its keys are revoked.
pub(crate) fn refused(placement: &Placement, transport: &'static str, peer: &str, w: Incoming, why: &Refusal) {
    placement.refusals().note(why);
    if let Some(held_back) = crate::logbudget::WRITES.admit() {
        tracing::warn!(transport, peer, slot = w.tag.slot, layer = w.tag.layer, key = w.key, offset = w.offset, len = w.len, runs = w.stride.map_or(1, |s| s.0), %why, held_back, "write refused");
    }
}
