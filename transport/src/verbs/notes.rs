//! Registered buffers for write notes: a source's send ring, a
//! destination's receive buffers (one per pre-posted receive).

use super::shared::Shared;
use super::{chain, verbs_err, NOTE_BUF};
use crate::mem::HostMem;
use crate::TransportError;
use kvwire_core::protocol::WriteNote;
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::AccessFlags;
use std::sync::Arc;

/// Registered note buffers: a source's send ring, a destination's
/// receive buffers (one per pre-posted receive).
pub(super) struct NoteRing {
    // Field order is drop order: the MR before the memory it covers.
    pub(super) mr: Arc<MemoryRegion>,
    pub(super) mem: HostMem,
    pub(super) slots: u32,
}

impl std::fmt::Debug for NoteRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NoteRing").field("slots", &self.slots).finish()
    }
}

impl NoteRing {
    pub(super) fn new(shared: &Shared, slots: u32) -> Result<NoteRing, TransportError> {
        let slots = slots.max(1);
        let len = u64::from(slots) * NOTE_BUF as u64;
        let mem = HostMem::new("kvwire-verbs-notes", len)?;
        // SAFETY: the whole live mapping of `mem`, which the ring holds and
        // drops after the MR (field order).
        let mr = unsafe { shared.pd.reg_mr(mem.as_ptr() as usize, len as usize, AccessFlags::LocalWrite) }.map_err(|e| {
            verbs_err("ibv_reg_mr", format!("{len}-byte note buffers on {}: {} (raise `ulimit -l`?)", shared.info.device, chain(&e)))
        })?;
        Ok(NoteRing { mr, mem, slots })
    }

    pub(super) fn addr(&self, slot: u32) -> u64 {
        self.mem.as_ptr() as u64 + u64::from(slot) * NOTE_BUF as u64
    }

    /// The notes a completed receive left in `slot`.
    pub(super) fn read(&self, slot: u64, len: u32) -> Result<Vec<WriteNote>, TransportError> {
        if slot >= u64::from(self.slots) || len as usize > NOTE_BUF {
            return Err(TransportError::Refused(format!("receive completion for slot {slot} with {len} bytes is outside the note buffers")));
        }
        let mut b = vec![0u8; len as usize];
        self.mem.read(slot * NOTE_BUF as u64, &mut b)?;
        Ok(WriteNote::decode_all(&b)?)
    }
}
