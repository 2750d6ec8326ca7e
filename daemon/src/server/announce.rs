//! Receives announced ahead. A destination told at prepare which node will
//! fill a request grants that node the transfer's keys, declares the bytes
//! each layer will receive, sets a staging buffer aside, and sends the
//! accept it would have answered an offer with on an idle peer connection
//! the node opened. The node books it; its submit for that request then
//! claims it on whichever of its connections to here it takes (the one
//! announced on may be carrying another transfer by then) and posts its
//! writes at once: no round trip before the first byte. The grant names
//! the node, so its writes are admitted over that connection's data
//! connections; the announcement stands while the node has any
//! connection here.
//!
//! Everything here is best effort: a receive that cannot be announced, an
//! announcement the source cannot use (a codec, another staging size, a
//! connection gone), and an offer into an announced receive all fall back
//! to the offer and its accept.

use super::destination::{replan, Mine};
use super::state::{Announced, Group, Slot, SlotId};
use super::Daemon;
use crate::metrics::Metrics;
use crate::peer::{Outbox, Sealed, Waiting};
use kvwire_client::control::{PrepareReceive, TransferState};
use kvwire_core::reuse::check_prefix;
use kvwire_core::schedule::Schedule;
use kvwire_core::session::msg::{Accept, Announce, Claim, Offer, PeerMsg, PeerRegion, RailAddr};
use kvwire_transport::{Grant, Tag};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long a source reads an idle connection's waiting announcement:
/// one is written whole, so this bounds only a peer that stalls mid-frame.
const DRAIN_TIMEOUT: Duration = Duration::from_millis(200);

/// Announcements a source keeps unclaimed, all peers together: a peer
/// announcing more than its requests cannot grow this daemon's memory.
const BOOK_MAX: usize = 4096;

/// The destination's authenticated peer connections, by peer: where an
/// announcement to that peer can go.
#[derive(Default)]
pub(super) struct Outboxes(Mutex<HashMap<String, Vec<PeerOutbox>>>);

struct PeerOutbox {
    session: u64,
    // The node's id here (grants name it).
    grantee: u64,
    outbox: Outbox,
    // No transfer of this connection runs: the source reads it only when
    // it takes the connection for its next transfer.
    idle: Arc<AtomicBool>,
}

impl Outboxes {
    /// Connection `session` from `peer` (node `grantee` here) is
    /// authenticated; the returned flag says whether it is idle (its owner
    /// keeps it current).
    pub fn open(&self, peer: &str, session: u64, grantee: u64, outbox: Outbox) -> Arc<AtomicBool> {
        let idle = Arc::new(AtomicBool::new(true));
        self.0.lock().expect("outboxes lock").entry(peer.to_string()).or_default().push(PeerOutbox { session, grantee, outbox, idle: idle.clone() });
        idle
    }

    /// Connection `session` from `peer` ended.
    pub fn close(&self, peer: &str, session: u64) {
        let mut m = self.0.lock().expect("outboxes lock");
        if let Some(v) = m.get_mut(peer) {
            v.retain(|o| o.session != session);
            if v.is_empty() {
                m.remove(peer);
            }
        }
    }

    /// Where to announce to `peer`: its newest idle connection, else its
    /// newest one (its source reads an announcement there in the current
    /// transfer's next exchange, at the latest its verdict, and books it
    /// for when the connection comes back), or why there is none. With
    /// its session, and the node's id here.
    fn pick(&self, peer: &str) -> Result<(u64, u64, Outbox), String> {
        let m = self.0.lock().expect("outboxes lock");
        let all = m.get(peer).map_or(&[][..], |v| &v[..]);
        match all.iter().rev().find(|o| o.idle.load(Ordering::Acquire)).or_else(|| all.last()) {
            Some(o) => Ok((o.session, o.grantee, o.outbox.clone())),
            None => Err(format!("no connection from `{peer}` to announce on (its first transfer here offers)")),
        }
    }
}

/// An announcement a source heard: on which connection, and its sealed
/// frame's bytes, which count toward the transfer into the request it
/// announces.
pub(super) struct Heard {
    pub session: u64,
    pub bytes: u64,
    pub announce: Announce,
}

/// Announcements a source heard and has not claimed, by (peer, group,
/// request).
#[derive(Default)]
pub(super) struct AnnounceBook {
    map: Mutex<HashMap<(String, String, String), (u64, Heard)>>,
    seq: AtomicU64,
}

impl AnnounceBook {
    /// Books `h` from `peer`; a newer one for the same request replaces
    /// it, and past [`BOOK_MAX`] the oldest goes.
    pub fn note(&self, peer: &str, h: Heard) {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let mut m = self.map.lock().expect("announce book lock");
        m.insert((peer.to_string(), h.announce.group.clone(), h.announce.request.clone()), (seq, h));
        if m.len() > BOOK_MAX {
            if let Some(oldest) = m.iter().min_by_key(|(_, (seq, _))| *seq).map(|(k, _)| k.clone()) {
                m.remove(&oldest);
            }
        }
    }

    /// The connection `peer`'s announcement of `request` of `group` came on.
    pub fn session_of(&self, peer: &str, group: &str, request: &str) -> Option<u64> {
        let m = self.map.lock().expect("announce book lock");
        m.get(&(peer.to_string(), group.to_string(), request.to_string())).map(|(_, h)| h.session)
    }

    /// Takes the announcement of `peer`'s request `request` of `group`.
    pub fn take(&self, peer: &str, group: &str, request: &str) -> Option<Heard> {
        let mut m = self.map.lock().expect("announce book lock");
        m.remove(&(peer.to_string(), group.to_string(), request.to_string())).map(|(_, h)| h)
    }
}

/// Why an offer (or a claim) does not fit the prepared request: the token
/// count, or the first field of the identity that differs.
pub(super) fn mismatch(g: &Group, recv: &PrepareReceive, o: &Offer) -> Option<String> {
    if o.tokens != recv.tokens {
        return Some(format!("offer has {} tokens, the prepared request {}", o.tokens, recv.tokens));
    }
    check_prefix(&g.identity, &o.identity, recv.prefix_tokens, recv.tokens).err().map(|e| e.to_string())
}

impl Daemon {
    /// The accept for request `recv` of `g` in `slot`: keys for this
    /// transfer alone (see `Slot::keys`), writable only by connections of
    /// node `grantee` and only for `slot`; the staging buffer is the caller's.
    pub(super) fn accept_for(&self, g: &Group, recv: &PrepareReceive, slot: u16, grantee: u64) -> Result<Accept, String> {
        let mut regions = Vec::new();
        for (rank, rc) in &g.ranks {
            for (region, r) in &rc.regions {
                match self.register_region(r.mem.clone(), r.offset, r.len, Some(Grant { peer: grantee, slot })) {
                    Ok(w) => regions.push(PeerRegion { rank: *rank, region: *region, key: w.key, len: w.len }),
                    Err(e) => {
                        for r in &regions {
                            self.revoke_key(r.key);
                        }
                        return Err(format!("{} cannot register the transfer's regions: {e}", self.cfg.node));
                    }
                }
            }
        }
        Ok(Accept {
            slot,
            layout: g.layout_text.clone(),
            format: g.format.id(),
            num_blocks: g.num_blocks,
            block_table: recv.block_table.clone(),
            prefix_tokens: recv.prefix_tokens,
            data_addr: self.rails[0].advertise.clone(),
            rails: self.rails.iter().map(|r| RailAddr { name: r.name.clone(), addr: r.advertise.clone() }).collect(),
            locality: self.rank_rails(g),
            transport: self.ep.transport().as_str().into(),
            regions,
            stage_key: 0,
            stage_len: 0,
        })
    }

    /// Announces prepared receive `id` to node `to`, on a connection it
    /// opened here ([`Outboxes::pick`]); why not, when it cannot.
    pub(super) fn announce(&self, id: SlotId, to: &str) -> Result<(), String> {
        let max = self.cfg.transport.announce_max_bytes;
        if max == 0 {
            return Err("transport.announce_max_bytes is 0".into());
        }
        let (msg, outbox) = {
            let groups = self.groups.lock().expect("groups lock");
            let mut slots = self.slots.lock().expect("slots lock");
            let sl = slots.get_mut(id).filter(|s| s.state == TransferState::Prepared && s.announced.is_none()).ok_or("the receive is no longer prepared")?;
            let recv = sl.recv.clone().expect("prepared slots hold their receive");
            let g = groups.map.get(&recv.group).ok_or_else(|| format!("group `{}` is gone", recv.group))?;
            // A request's payload is what its blocks hold, less a prefix and
            // a partial last block: one whose blocks hold more than twice
            // the bound is not planned here at all.
            let blocks = recv.block_table.len() as u64;
            let held: u64 = g.ranks.values().flat_map(|rc| rc.regions.values()).map(|r| r.len / u64::from(g.num_blocks.max(1)) * blocks).sum();
            if held / 2 > max {
                return Err(format!("its blocks hold {held} bytes, above transport.announce_max_bytes {max}"));
            }
            // Each layer's bytes, whatever the source's layout: every
            // destination byte past the prefix is written once. A plan from
            // this side's own layout counts them.
            let key = (g.gen, recv.tokens, recv.prefix_tokens, recv.block_table.clone());
            let layer_bytes = self.announced_plans.get_or_build(key, &self.metrics.plans_reused_announced, |_| 1, || {
                let (_, plan) = replan(&g.model, g.layout.clone(), g.format, g.num_blocks, &recv, &g.layout, g.num_blocks, recv.block_table.clone(), self.ep.transport())?;
                let schedule = Schedule::new(&g.model, &g.format, &plan, None).map_err(|e| e.to_string())?;
                Ok::<_, String>(schedule.layers.iter().map(|l| l.wire_bytes).collect::<Vec<u64>>())
            })?;
            let total: u64 = layer_bytes.iter().sum();
            if total > max {
                return Err(format!("{total} payload bytes, above transport.announce_max_bytes {max}"));
            }
            // Where it goes: the bound first, a property of the request.
            let (session, grantee, outbox) = self.outboxes.pick(to)?;
            let mut accept = self.accept_for(g, &recv, id.slot, grantee)?;
            let keys: Vec<u32> = accept.regions.iter().map(|r| r.key).collect();
            let undo = |d: &Daemon| keys.iter().for_each(|&k| {
                d.revoke_key(k);
            });
            // The staging buffer is as large as the payload: it holds
            // whatever part of it a source's schedule packs.
            let stage = match self.stage_for(total, Some(Grant { peer: grantee, slot: id.slot })) {
                Ok(s) => s,
                Err(e) => {
                    undo(self);
                    return Err(format!("staging: {e}"));
                }
            };
            (accept.stage_key, accept.stage_len) = (stage.as_ref().map_or(0, |s| s.key), total);
            let declared = layer_bytes.iter().enumerate().try_for_each(|(l, &b)| self.ep.placement().expect(Tag { slot: id.slot, layer: l as u16 }, b));
            if let Err(e) = declared {
                undo(self);
                self.drop_stage(stage);
                self.ep.placement().reset_slot(id.slot);
                return Err(e.to_string());
            }
            sl.keys = keys;
            sl.announced = Some(Announced { session, grantee, stage, bytes: 0 });
            (PeerMsg::Announce(Announce { group: recv.group.clone(), request: recv.request.clone(), gen: id.gen, tokens: recv.tokens, identity: g.identity.clone(), layer_bytes: layer_bytes.to_vec(), accept }), outbox)
        };
        // Sent outside the locks: a slow peer holds up no other request.
        let size = |len: u64| {
            self.with_slot(id, |sl| {
                if let Some(a) = sl.announced.as_mut() {
                    a.bytes = len;
                }
            })
        };
        if let Err(e) = outbox.send_counted(&msg, size) {
            let mut slots = self.slots.lock().expect("slots lock");
            if let Some(sl) = slots.get_mut(id) {
                self.unannounce_in(id, sl);
            }
            return Err(format!("cannot send the announcement to `{to}`: {e}"));
        }
        Metrics::add(&self.metrics.announced, 1);
        tracing::debug!(slot = id.slot, to, "receive announced");
        Ok(())
    }

    /// Takes back slot `sl`'s announcement, if it has one (its keys, its
    /// staging buffer, its declared bytes): it is a plain prepared receive
    /// again. The caller holds the slots lock. Returns the session it was
    /// sent on and its frame's bytes.
    pub(super) fn unannounce_in(&self, id: SlotId, sl: &mut Slot) -> Option<(u64, u64)> {
        let a = sl.announced.take()?;
        for key in std::mem::take(&mut sl.keys) {
            self.revoke_key(key);
        }
        self.drop_stage(a.stage);
        self.ep.placement().reset_slot(id.slot);
        Some((a.session, a.bytes))
    }

    /// Node `grantee`'s last connection ended: what was announced to it
    /// waits for an offer (its id is no node's now, so nothing could claim
    /// or write it).
    pub(super) fn unannounce_node(&self, grantee: u64) {
        let mut slots = self.slots.lock().expect("slots lock");
        // Announced slots are prepared, so live.
        let ids: Vec<SlotId> = slots.live(&self.live).filter(|(_, s)| s.announced.as_ref().is_some_and(|a| a.grantee == grantee)).map(|(id, _)| id).collect();
        for id in ids {
            if let Some(sl) = slots.get_mut(id) {
                self.unannounce_in(id, sl);
            }
        }
    }

    /// A claim on a connection of `peer` (node `grantee` here): the slot
    /// must be one announced to that node, in the preparation announced,
    /// for the request the offer names; the offer is checked as any offer
    /// is. Then it runs as an accepted transfer, with the keys and staging
    /// set aside.
    pub(super) fn claim(self: &Arc<Self>, peer: &str, grantee: u64, c: Claim) -> Result<Mine, String> {
        let o = c.offer;
        let src = (o.src_layout.clone(), o.src_num_blocks, o.src_block_table.clone(), None);
        let (id, stage) = {
            let groups = self.groups.lock().expect("groups lock");
            let mut slots = self.slots.lock().expect("slots lock");
            let id = SlotId { slot: c.slot, gen: c.gen };
            let sl = slots.get_mut(id).filter(|s| s.state == TransferState::Prepared && s.announced.as_ref().is_some_and(|a| a.grantee == grantee));
            let Some(sl) = sl else {
                return Err(format!("claim of slot {} (preparation {}), which is not announced to `{peer}` now", c.slot, c.gen));
            };
            let recv = sl.recv.clone().expect("prepared slots hold their receive");
            if recv.group != o.dst_group || recv.request != o.dst_request {
                return Err(format!("claim of slot {} names request `{}` of group `{}`; it holds `{}` of `{}`", c.slot, o.dst_request, o.dst_group, recv.request, recv.group));
            }
            let g = groups.map.get(&recv.group).ok_or_else(|| format!("group `{}` is gone", recv.group))?;
            let why = if o.codec.is_some() { Some("a claim carries no codec (a coded transfer offers)".to_string()) } else { mismatch(g, &recv, &o) };
            if let Some(why) = why {
                self.end(id, sl, TransferState::Failed, Some(format!("refused the claim of `{peer}` (request `{}`): {why}", o.src_request)));
                tracing::warn!(peer, slot = c.slot, request = o.dst_request, why, "claim refused; the prepared receive fails");
                return Err(why);
            }
            let a = sl.announced.take().expect("announced");
            // The claim shows the announcement crossed: it counts.
            sl.wire += a.bytes;
            sl.receiving_from(peer);
            (id, a.stage)
        };
        tracing::info!(peer, slot = c.slot, request = o.dst_request, src_request = o.src_request, "announced transfer claimed");
        match self.receive_for(id, grantee, src, Some(stage)) {
            Ok((_, _, to)) => Ok(Mine { id, to }),
            Err(r) => {
                self.fail(id, &r.message);
                Err(r.message)
            }
        }
    }

    /// Reads what waits on idle connection `c` to `peer`: announcements,
    /// which are booked. False when the connection is gone, or sent
    /// anything else (it is dropped).
    pub(super) fn drain_announcements(&self, peer: &str, c: &mut Sealed) -> bool {
        loop {
            // A whole frame is read as the connection's timeout stands (it
            // cannot block); part of one waits at most DRAIN_TIMEOUT.
            match c.waiting() {
                Ok(Waiting::Nothing) => return true,
                Ok(Waiting::Whole) => {}
                Ok(Waiting::Part) => {
                    let _ = c.read_timeout(DRAIN_TIMEOUT);
                }
                Err(_) => return false,
            }
            let before = c.frames_read();
            match c.recv() {
                Ok(PeerMsg::Announce(announce)) => {
                    let h = Heard { session: c.credential().session, bytes: c.frames_read() - before, announce };
                    self.announcements.note(peer, h);
                }
                Ok(other) => {
                    tracing::warn!(peer, got = kvwire_core::session::kind(&other), "an idle peer connection sent something other than an announcement; dropped");
                    return false;
                }
                Err(_) => return false,
            }
        }
    }
}
