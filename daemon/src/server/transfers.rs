//! A transfer slot's lifetime: taken, timed, marked, published, ended.

use super::destination::verdict_of;
use super::error::Refusal;
use super::state::{running, Boundary, Role, Slot, SlotId};
use super::Daemon;
use crate::metrics::Metrics;
use kvwire_client::control::{Code, PrepareReceive, TransferState, FLAG_COLUMNS, FLAG_SLOTS, MAX_TRANSFER_LAYERS, SOURCE_RELEASED};
use kvwire_transport::{Hop, Tag};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One rank's piece of concurrent work on a hop ([`Daemon::slot_hop_spans`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct RankSpan {
    pub rank: u32,
    pub from: Instant,
    pub done: Instant,
    pub bytes: u64,
}

impl Daemon {
    /// Takes a free slot: the oldest finished one, so a late write for an
    /// old transfer is least likely to meet a reused slot.
    pub(super) fn alloc_slot(
        &self,
        role: Role,
        request: &str,
        group: &str,
        owner: u64,
        recv: Option<PrepareReceive>,
    ) -> Result<(SlotId, Arc<AtomicBool>), Refusal> {
        self.expire_prepared();
        let mut st = self.slots.lock().expect("slots lock");
        let max = self.cfg.limits.max_inflight_transfers;
        if self.live.len() >= max {
            return Err(Refusal::new(Code::Limit, format!("limits.max_inflight_transfers {max} reached")));
        }
        for i in 0..FLAG_SLOTS {
            let slot = (st.next_slot + i) % FLAG_SLOTS;
            if st.map.get(&slot).is_none_or(|s| !running(s.state)) {
                st.next_slot = (slot + 1) % FLAG_SLOTS;
                st.next_gen += 1;
                let gen = st.next_gen;
                // The old transfer's keys were revoked when it ended, so no
                // late write of it can count toward the new one.
                self.ep.placement().reset_slot(slot);
                self.page.clear_slot(slot);
                let stop = Arc::new(AtomicBool::new(false));
                // The slot it replaces had ended.
                st.map.insert(slot, Slot::new(gen, role, request, group, owner, recv, stop.clone()));
                self.live.insert(slot);
                return Ok((SlotId { slot, gen }, stop));
            }
        }
        Err(Refusal::new(Code::Limit, "no free flag slot"))
    }

    /// Fails receives prepared longer than the transfer timeout ago that no
    /// source offered into: a client that prepares and never transfers
    /// cannot hold slots for good.
    fn expire_prepared(&self) {
        let timeout = Duration::from_secs(self.cfg.limits.transfer_timeout_secs);
        // Only the live slots are read: all 256 are in use once as many
        // transfers have run, and reading each on every prepare and submit
        // cost both daemons several µs a transfer.
        let stale: Vec<SlotId> = {
            let st = self.slots.lock().expect("slots lock");
            st.live(&self.live).filter(|(_, s)| s.state == TransferState::Prepared && s.started.elapsed() > timeout).map(|(id, _)| id).collect()
        };
        for id in stale {
            self.fail(id, format!("prepared more than {}s ago and no source offered", timeout.as_secs()));
        }
    }

    /// Ends transfer `id` (if it still runs): records the outcome, stops its
    /// threads, fails its flags unless done, and revokes its keys; then
    /// tells its source (its verdict). Returns whether this call ended it.
    pub(super) fn finish(&self, id: SlotId, state: TransferState, error: Option<String>) -> bool {
        let verdicts = {
            let mut st = self.slots.lock().expect("slots lock");
            let Some(s) = st.get_mut(id).filter(|s| running(s.state)) else { return false };
            self.end(id, s, state, error.clone());
            s.verdicts.take()
        };
        if let Some(v) = verdicts {
            v.push(id, verdict_of(state, error));
        }
        true
    }

    /// Ends transfer `id` as done at boundary `b`, publishing its last flag
    /// `column` under the same lock as the state change (a client that sees
    /// the flag and then asks for the status finds the transfer done); then
    /// tells its source.
    pub(super) fn complete(&self, id: SlotId, column: u16, b: Boundary) -> bool {
        let (published, verdicts) = {
            let mut st = self.slots.lock().expect("slots lock");
            let Some(s) = st.get_mut(id).filter(|s| running(s.state)) else { return false };
            let at = s.started.elapsed();
            s.marks.push(b.at(at));
            self.end(id, s, TransferState::Done, None);
            let verdicts = s.verdicts.take();
            (self.page.publish(Tag { slot: id.slot, layer: column }), verdicts)
        };
        if let Some(v) = verdicts {
            v.push(id, None);
        }
        published
    }

    /// Records the outcome in the slot (whose lock the caller holds).
    pub(super) fn end(&self, id: SlotId, s: &mut Slot, state: TransferState, error: Option<String>) {
        if running(s.state) && !running(state) {
            self.live.remove(id.slot);
        }
        s.state = state;
        s.error = error;
        s.elapsed = Some(s.started.elapsed());
        s.stop.store(true, Ordering::Release);
        let c = match (s.role, state) {
            (Role::Source, TransferState::Done) => &self.metrics.source_done,
            (Role::Source, _) => &self.metrics.source_failed,
            (Role::Destination, TransferState::Done) => &self.metrics.destination_done,
            (Role::Destination, _) => &self.metrics.destination_failed,
        };
        Metrics::add(c, 1);
        // Under the slots lock: the slot cannot be taken again before its
        // keys are gone and its flags failed.
        for key in std::mem::take(&mut s.keys) {
            self.revoke_key(key);
        }
        if let Some(a) = s.announced.take() {
            self.drop_stage(a.stage);
        }
        if state != TransferState::Done {
            self.fail_flags(id.slot);
        }
    }

    /// Ends transfer `id` as failed with `why`.
    pub(super) fn fail(&self, id: SlotId, why: impl std::fmt::Display) -> bool {
        self.finish(id, TransferState::Failed, Some(why.to_string()))
    }

    /// The source's memory is free for its engine again: marked and
    /// published once, whichever comes first of a ring's last copies and
    /// the end of the writes. False when it was already, or the transfer
    /// no longer runs.
    pub(super) fn release_source(&self, id: SlotId) -> bool {
        {
            let mut st = self.slots.lock().expect("slots lock");
            let Some(s) = st.get_mut(id).filter(|s| running(s.state)) else { return false };
            if s.marks.iter().any(|m| m.boundary == Boundary::SourceReleased) {
                return false;
            }
            let at = s.started.elapsed();
            s.marks.push(Boundary::SourceReleased.at(at));
        }
        self.publish(id, SOURCE_RELEASED)
    }

    /// Publishes `column` of transfer `id` on the clients' page, if it still runs.
    pub(super) fn publish(&self, id: SlotId, column: u16) -> bool {
        let st = self.slots.lock().expect("slots lock");
        let current = st.map.get(&id.slot).is_some_and(|s| s.gen == id.gen && running(s.state));
        current && self.page.publish(Tag { slot: id.slot, layer: column })
    }

    /// Concurrent work on one hop, one span per (rank, piece): each span
    /// goes into the histograms as a sample and into its rank's figure, and
    /// the slot's total grows by the union of the spans, the wall time the
    /// hop was busy (DESIGN §6; summing them would count overlap twice).
    pub(super) fn slot_hop_spans(&self, id: SlotId, hop: Hop, spans: &[RankSpan]) {
        let Some(origin) = spans.iter().map(|s| s.from).min() else { return };
        let ns = |t: Instant| t.saturating_duration_since(origin).as_nanos() as u64;
        let wall = kvwire_core::timing::union_ns(&spans.iter().map(|s| (ns(s.from), ns(s.done))).collect::<Vec<_>>());
        let peer = {
            let mut st = self.slots.lock().expect("slots lock");
            let Some(s) = st.get_mut(id) else { return };
            let e = s.hops.entry(hop.name()).or_default();
            e.0 += wall;
            e.1 += spans.iter().map(|s| s.bytes).sum::<u64>();
            for sp in spans {
                let r = s.rank_hops.entry((hop.name(), sp.rank)).or_default();
                r.0 += sp.done.saturating_duration_since(sp.from).as_nanos() as u64;
                r.1 += sp.bytes;
            }
            (!s.peer.is_empty()).then(|| self.peer_hops.lock().expect("peer hops lock").entry(s.peer.clone()).or_default().clone())
        };
        for sp in spans {
            let took = sp.done.saturating_duration_since(sp.from);
            self.hops().record(hop, took, sp.bytes);
            if let Some(h) = &peer {
                h.record(hop, took, sp.bytes);
            }
        }
    }

    /// Adds `took` to the slot's `hop` total, and to the daemon's histogram.
    pub(super) fn slot_hop(&self, id: SlotId, hop: Hop, took: Duration, bytes: u64) {
        self.hops().record(hop, took, bytes);
        let mut st = self.slots.lock().expect("slots lock");
        if let Some(s) = st.get_mut(id) {
            let e = s.hops.entry(hop.name()).or_default();
            e.0 += took.as_nanos() as u64;
            e.1 += bytes;
            if !s.peer.is_empty() {
                let h = self.peer_hops.lock().expect("peer hops lock").entry(s.peer.clone()).or_default().clone();
                h.record(hop, took, bytes);
            }
        }
    }

    /// Records that transfer `id` reached boundary `b` now.
    pub(super) fn slot_mark(&self, id: SlotId, b: Boundary) {
        self.slot_mark_at(id, b, Instant::now());
    }

    /// As [`Daemon::slot_mark`], for a boundary reached at `when` (a device
    /// copy's end, which the stream knows before the transfer looks): it
    /// takes its place among the marks by time.
    pub(super) fn slot_mark_at(&self, id: SlotId, b: Boundary, when: Instant) {
        let mut st = self.slots.lock().expect("slots lock");
        if let Some(s) = st.get_mut(id) {
            let mark = b.at(when.saturating_duration_since(s.started));
            let at = s.marks.partition_point(|m| m.at_ns <= mark.at_ns);
            s.marks.insert(at, mark);
        }
    }

    /// Runs `f` on transfer `id`'s slot, if it still holds that transfer.
    /// Counts `bytes` that crossed the link for source transfer `id` (its
    /// data and framing as its connections counted them, its control
    /// frames): in `kvwire_wire_bytes_total` and in its status.
    pub(super) fn count_wire(&self, id: SlotId, bytes: u64) {
        Metrics::add(&self.metrics.wire_bytes, bytes);
        self.with_slot(id, |s| s.wire += bytes);
    }

    /// Whether transfer `id` still runs (its slot not taken again since).
    pub(super) fn runs(&self, id: SlotId) -> bool {
        self.slots.lock().expect("slots lock").get_mut(id).is_some_and(|s| running(s.state))
    }

    pub(super) fn with_slot(&self, id: SlotId, f: impl FnOnce(&mut Slot)) {
        if let Some(s) = self.slots.lock().expect("slots lock").get_mut(id) {
            f(s);
        }
    }

    /// Fails every flag of `slot`, internal and client-visible: waiters stop at once.
    pub(super) fn fail_flags(&self, slot: u16) {
        self.ep.placement().fail_slot(slot, MAX_TRANSFER_LAYERS);
        for layer in 0..FLAG_COLUMNS {
            self.page.fail(Tag { slot, layer });
        }
    }

    /// The transfer in `slot`, if `client` made it or holds a rank of its
    /// group; else the refusal.
    pub(super) fn slot_access(&self, client: u64, slot: u16) -> Result<SlotId, Refusal> {
        let (id, owner, group) = {
            let st = self.slots.lock().expect("slots lock");
            let Some(s) = st.map.get(&slot) else { return Err(Refusal::new(Code::UnknownSlot, format!("no transfer in slot {slot}"))) };
            (SlotId { slot, gen: s.gen }, s.owner, s.group.clone())
        };
        if owner == client || self.groups.lock().expect("groups lock").access(client, &group).is_ok() {
            return Ok(id);
        }
        Err(Refusal::new(Code::PermissionDenied, format!("slot {slot} is a transfer of group `{group}`, which this client holds no rank of")))
    }
}
