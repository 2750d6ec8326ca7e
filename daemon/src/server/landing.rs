//! A transfer's landing at the destination: its manifest checked, then
//! layer by layer, once the layer's bytes are placed, unpacked and hashed,
//! compared once its checksums are in (a streaming source's follow its
//! bytes), and published; then `decoder_usable`.
//!
//! One state, two drivers. A large transfer has a receive thread that
//! waits for whatever the landing waits for next. A small one has none:
//! each event advances it on the thread that brings it, the peer
//! connection's (manifest, checksums) or the data plane's (a layer's last
//! bytes, [`kvwire_transport::Placement::on_complete`]). Waking a thread
//! for each of those cost a small transfer more than landing it, and put
//! a scheduling delay between its last byte and its flag.

use super::destination::{Inbound, Receive};
use super::device::Copies;
use super::state::{Boundary, SlotId};
use super::Daemon;
use kvwire_client::control::DECODER_USABLE;
use kvwire_core::manifest::{LayerChecksum, Manifest};
use kvwire_transport::Tag;
use std::collections::{HashMap, VecDeque};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, TryLockError};
use std::time::{Duration, Instant};

/// Payload up to which a transfer lands on its events' threads: its
/// layers unpack and verify in tens of microseconds, which the data
/// connection can wait; above it a layer would hold that connection's
/// reads for long, and a receive thread lands beside the wire. Measured
/// on loopback with four clients: at 64 KiB and at 1 MiB, 15% lower p50
/// to `decoder_usable` than a receive thread, and 15-20% less CPU at the
/// destination.
pub(super) const LAND_ON_ARRIVAL_MAX: u64 = 1 << 20;

/// Where one transfer's landing stands.
pub(super) struct Landing {
    r: Receive,
    // By when the transfer must have landed: the transfer timeout after its accept.
    deadline: Instant,
    manifest: Option<Manifest>,
    // Its checksums come layer by layer (the manifest said so).
    streamed: bool,
    // Per layer, whether its checksums came (streamed only).
    sums: Vec<bool>,
    // Layers marked received (all bytes placed), and landed.
    received: usize,
    landed: usize,
    // Landed layers whose host → device copies were started and not yet
    // seen to end, in layer order; when each rank's stream ended its last.
    copying: VecDeque<(usize, Copies)>,
    free_at: HashMap<u32, Instant>,
    // The next layer's checksums as it landed, once it is unpacked and
    // hashed and until they compare.
    hashed: Option<Vec<LayerChecksum>>,
    // Landed or failed, and its staging buffer given back.
    over: bool,
}

/// What a landing waits for next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Next {
    Manifest,
    Bytes(Tag),
    Sums(usize),
    Over,
}

/// Landings driven by their events, by slot: what a placed layer's hook looks up.
pub(super) type Landings = Mutex<HashMap<u16, Arc<Mutex<Landing>>>>;

impl Landing {
    pub fn new(r: Receive, timeout: Duration) -> Landing {
        let layers = r.p.schedule.layers.len();
        Landing { r, deadline: Instant::now() + timeout, manifest: None, streamed: false, sums: vec![false; layers], received: 0, landed: 0, copying: VecDeque::new(), free_at: HashMap::new(), hashed: None, over: false }
    }

    fn id(&self) -> SlotId {
        self.r.id
    }
}

impl Daemon {
    /// Lands what can land now; says what it waits for next.
    fn advance(&self, l: &mut Landing) -> Next {
        if l.over {
            return Next::Over;
        }
        let Some(manifest) = &l.manifest else { return Next::Manifest };
        let id = l.id();
        let layers = l.r.p.schedule.layers.len();
        while l.landed < layers {
            let layer = l.landed;
            let tag = Tag { slot: id.slot, layer: layer as u16 };
            if l.received == layer {
                if self.ep.placement().flags().ready(tag).is_none() {
                    // Nothing else to do before the bytes come: the layers
                    // copying to the device are published as they end.
                    return match self.device_landed(id, &mut l.copying, &mut l.free_at, true) {
                        Ok(()) => Next::Bytes(tag),
                        Err(why) => self.end_landing(l, Some(why)),
                    };
                }
                self.slot_mark(id, Boundary::HostReceived(layer));
                l.received += 1;
            }
            // Unpacked and hashed as soon as its bytes are in; compared once
            // its checksums are too (a streamed layer's follow its bytes on
            // the peer connection).
            if l.hashed.is_none() {
                match self.unpack_and_hash(&l.r, layer) {
                    Ok(sums) => l.hashed = Some(sums),
                    Err(why) => return self.end_landing(l, Some(why)),
                }
            }
            if l.streamed && self.cfg.verify_checksums && !l.sums[layer] {
                return match self.device_landed(id, &mut l.copying, &mut l.free_at, true) {
                    Ok(()) => Next::Sums(layer),
                    Err(why) => self.end_landing(l, Some(why)),
                };
            }
            let sums = l.hashed.take().unwrap_or_default();
            match self.land_layer(&l.r, manifest, layer, &sums) {
                Err(why) => return self.end_landing(l, Some(why)),
                // Its copies run while the next layer is unpacked and verified.
                Ok(Some(copies)) => l.copying.push_back((layer, copies)),
                Ok(None) => self.layer_ready(id, layer),
            }
            l.landed += 1;
            if let Err(why) = self.device_landed(id, &mut l.copying, &mut l.free_at, false) {
                return self.end_landing(l, Some(why));
            }
        }
        if let Err(why) = self.device_landed(id, &mut l.copying, &mut l.free_at, true) {
            return self.end_landing(l, Some(why));
        }
        self.complete(id, DECODER_USABLE, Boundary::DecoderUsable);
        tracing::info!(slot = id.slot, "decoder usable");
        self.end_landing(l, None)
    }

    /// Publishes layer `layer`: its flag, then its mark.
    fn layer_ready(&self, id: SlotId, layer: usize) {
        self.publish(id, layer as u16);
        self.slot_mark(id, Boundary::LayerReady(layer));
    }

    /// Publishes the device-resident layers whose copies ended, in layer
    /// order: all of them with `wait`, else those already ended.
    fn device_landed(&self, id: SlotId, copying: &mut VecDeque<(usize, Copies)>, free_at: &mut HashMap<u32, Instant>, wait: bool) -> Result<(), String> {
        while let Some((layer, copies)) = copying.pop_front() {
            if !wait && !copies.ended() {
                copying.push_front((layer, copies));
                break;
            }
            copies.finish(self, id, free_at).map_err(|err| format!("host → device copy: {err}"))?;
            self.slot_mark(id, Boundary::DeviceComplete(layer));
            self.layer_ready(id, layer);
        }
        Ok(())
    }

    /// Takes what the source's connection brought: the manifest, checked
    /// field by field, or a layer's checksums.
    fn take_inbound(&self, l: &mut Landing, m: Inbound) {
        if l.over {
            return;
        }
        let failed = match (m, &mut l.manifest) {
            // The session passes one manifest per slot.
            (Inbound::Expect(_), Some(_)) => None,
            (Inbound::Expect(e), None) => match self.checked_manifest(&l.r, &e) {
                Ok(m) => {
                    (l.manifest, l.streamed) = (Some(m), e.layer_sums);
                    None
                }
                Err(why) => {
                    tracing::warn!(slot = l.id().slot, why, "manifest refused; no flag for this transfer");
                    Some(why)
                }
            },
            // The session passes sums only after the manifest.
            (Inbound::Sums(_), None) => Some("layer checksums before the manifest".to_string()),
            (Inbound::Sums(_), Some(_)) if !l.streamed => None,
            (Inbound::Sums(s), Some(manifest)) => {
                let layer = usize::from(s.layer);
                let wire = l.r.p.schedule.layers.get(layer).map(|ls| ls.wire_bytes);
                match wire {
                    None => Some(format!("checksums for layer {layer}; the model has {}", l.sums.len())),
                    Some(wire) => match manifest.add_layer_checksums(u32::from(s.layer), &s.checksums) {
                        Err(e) => Some(e.to_string()),
                        Ok(()) if self.cfg.verify_checksums && s.checksums.is_empty() && wire > 0 => {
                            Some(format!("this daemon verifies checksums and layer {layer}'s carry none"))
                        }
                        Ok(()) => {
                            l.sums[layer] = true;
                            None
                        }
                    },
                }
            }
        };
        if let Some(why) = failed {
            self.end_landing(l, Some(why));
        }
    }

    /// Ends the landing: fails the transfer with `failed`, if given (a
    /// transfer failed elsewhere was failed there), and gives its staging
    /// buffer back; nothing reads it after this.
    fn end_landing(&self, l: &mut Landing, failed: Option<String>) -> Next {
        // Copies still running write into the engine's device memory: they
        // end before the transfer is said to have failed.
        for (_, copies) in l.copying.drain(..) {
            copies.drain(self);
        }
        if let Some(why) = failed {
            self.fail(l.id(), why);
        }
        l.over = true;
        self.drop_stage(l.r.stage.take());
        Next::Over
    }

    /// Why the landing had not ended by its deadline, waiting for `next`.
    fn overdue(&self, next: Next) -> String {
        let secs = self.cfg.limits.transfer_timeout_secs;
        match next {
            Next::Manifest => format!("no manifest within {secs}s of the accept"),
            Next::Sums(layer) => format!("no checksums for layer {layer} within the transfer timeout"),
            Next::Bytes(tag) => format!("layer {} of transfer slot {} not placed within {secs}s of the accept", tag.layer, tag.slot),
            Next::Over => "ended".into(),
        }
    }

    /// The receive thread: waits for whatever the landing waits for next,
    /// until it has landed or failed.
    pub(super) fn receive(&self, mut l: Landing, inbound: Receiver<Inbound>) {
        loop {
            let next = self.advance(&mut l);
            let left = l.deadline.saturating_duration_since(Instant::now());
            match next {
                Next::Over => return,
                Next::Bytes(tag) => {
                    if let Err(err) = self.ep.placement().wait(tag, left) {
                        self.end_landing(&mut l, Some(err.to_string()));
                    }
                }
                Next::Manifest | Next::Sums(_) => match inbound.recv_timeout(left) {
                    Ok(m) => self.take_inbound(&mut l, m),
                    Err(RecvTimeoutError::Timeout) => {
                        let why = self.overdue(next);
                        self.end_landing(&mut l, Some(why));
                    }
                    // The slot ended before its manifest came (aborted, or
                    // its connection closed): it was failed there.
                    Err(RecvTimeoutError::Disconnected) if next == Next::Manifest => {
                        self.end_landing(&mut l, None);
                    }
                    Err(RecvTimeoutError::Disconnected) => {
                        let layer = match next {
                            Next::Sums(layer) => layer,
                            _ => 0,
                        };
                        self.end_landing(&mut l, Some(format!("the source's connection ended before layer {layer}'s checksums")));
                    }
                },
            }
        }
    }

    /// Lands `l` on its events' threads from now on: each placed layer and
    /// each message of its source advances it there, and a check on the
    /// ticker ends it once its transfer ended elsewhere (its staging buffer
    /// back) or its deadline passed.
    pub(super) fn land_on_arrival(self: &Arc<Self>, l: Landing) -> Arc<Mutex<Landing>> {
        let slot = l.id().slot;
        let l = Arc::new(Mutex::new(l));
        self.landings.lock().expect("landings lock").insert(slot, l.clone());
        let (d, watched) = (Arc::downgrade(self), l.clone());
        self.ticker.add(Box::new(move || {
            let Some(d) = d.upgrade() else { return false };
            d.watch_landing(&watched)
        }));
        l
    }

    /// The ticker's look at an event-driven landing; false once it ended.
    /// Never waits: a landing busy on another thread is looked at next tick.
    fn watch_landing(&self, landing: &Arc<Mutex<Landing>>) -> bool {
        let mut l = match landing.try_lock() {
            Ok(l) => l,
            Err(TryLockError::WouldBlock) => return true,
            Err(TryLockError::Poisoned(_)) => panic!("landing lock poisoned"),
        };
        if !l.over {
            let id = l.id();
            if !self.runs(id) {
                self.end_landing(&mut l, None);
            } else if Instant::now() >= l.deadline {
                let why = self.overdue(self.advance(&mut l));
                if !l.over {
                    self.end_landing(&mut l, Some(why));
                }
            } else {
                return true;
            }
        }
        let slot = l.id().slot;
        drop(l);
        let mut all = self.landings.lock().expect("landings lock");
        if all.get(&slot).is_some_and(|x| Arc::ptr_eq(x, landing)) {
            all.remove(&slot);
        }
        false
    }

    /// A message of the source for an event-driven landing.
    pub(super) fn landing_inbound(&self, landing: &Mutex<Landing>, m: Inbound) {
        let mut l = landing.lock().expect("landing lock");
        self.take_inbound(&mut l, m);
        self.advance(&mut l);
    }

    /// The data plane placed all of `tag`'s bytes: its landing, if it is
    /// driven by events, goes on here.
    pub(super) fn layer_placed(&self, tag: Tag) {
        let Some(landing) = self.landings.lock().expect("landings lock").get(&tag.slot).cloned() else { return };
        self.advance(&mut landing.lock().expect("landing lock"));
    }
}
