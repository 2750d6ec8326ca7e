//! Rails: the data-plane endpoints a transfer's slices are striped over,
//! the keys registered on each, and which rails sit closest to a rank's memory.

use super::link::PeerLink;
use super::source::RailPreference;
use super::state::{Boundary, Group, SlotId};
use super::Daemon;
use crate::metrics::Metrics;
use crate::stripe;
use kvwire_client::control::RailUse;
use kvwire_core::session::msg::{RailAddr, RankRails};
use kvwire_transport::{Batch, Connection, Grant, Hop, HostMem, Region, TransportError, WriteOp};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

impl Daemon {
    /// Registers a window on the data plane and with every rail's device,
    /// writable from afar only as `grant` says (None: a local window, which
    /// no peer may write into). Nothing stays registered when one of them
    /// refuses.
    pub(super) fn register_region(&self, mem: Arc<HostMem>, offset: u64, len: u64, grant: Option<Grant>) -> Result<Arc<Region>, TransportError> {
        let region = self.ep.register(mem, offset, len, grant)?;
        for r in self.rails.iter().filter_map(|r| r.ep.as_ref()) {
            if let Err(e) = r.attach(&region) {
                self.revoke_key(region.key);
                return Err(e);
            }
        }
        Ok(region)
    }

    /// Revokes `key` on the data plane and on every rail, so no rail can
    /// still place a late write into it. Returns whether it was registered.
    pub(super) fn revoke_key(&self, key: u32) -> bool {
        let was = self.ep.revoke(key);
        for r in self.rails.iter().filter_map(|r| r.ep.as_ref()) {
            r.revoke(key);
        }
        was
    }

    /// Per rank of `g`, the rails closest to its memory, where some are
    /// closer than others (host memory: by NUMA node, read from the pages).
    pub(super) fn rank_rails(&self, g: &Group) -> Vec<RankRails> {
        let Some(topo) = &self.topology else { return Vec::new() };
        let devices: Vec<&str> = self.rails.iter().map(|r| r.device.as_deref().unwrap_or("")).collect();
        let mut out = Vec::new();
        for (rank, rc) in &g.ranks {
            // GPU memory goes by its device's PCI address (the rail on its
            // PCIe switch first); host memory, or a device whose address is
            // unknown, by the NUMA node of the pages the NIC reads.
            let gpu = rc.device.as_ref().and_then(|d| d.devs.first()).and_then(|m| m.dev.pci_bus_id()).and_then(|p| p.parse().ok());
            let mem = match gpu {
                Some(pci) => kvwire_core::topology::MemPlace::Gpu { pci },
                None => {
                    // The client's pages are in this mapping only once touched here:
                    // a read maps the page the client placed (shared memfd).
                    // A rank in several memfds goes by its first.
                    let _ = rc.mems[0].read(0, &mut [0u8; 1]);
                    kvwire_core::topology::MemPlace::Host { numa: kvwire_transport::topology::numa_node_of(rc.mems[0].as_ptr()) }
                }
            };
            let ranked = kvwire_core::topology::rank(topo, &mem, &devices);
            let Some(&(_, best)) = ranked.first() else { continue };
            let rails: Vec<String> = ranked.iter().filter(|(_, l)| *l == best).map(|(i, _)| self.rails[*i].name.clone()).collect();
            if rails.len() < self.rails.len() {
                out.push(RankRails { rank: *rank, rails, level: best.label().into() });
            }
        }
        out
    }

    /// Sends every batch, cut into slices striped across the destination's
    /// rails (`stripe`), until each completed at least once; records per
    /// rail what it carried and what was sent again, either way. `total`
    /// holds what earlier calls for the same transfer moved (a streamed
    /// transfer calls once per layer); the return is it with this call's added.
    #[allow(clippy::too_many_arguments)] // the transfer's rails, batches and running totals
    pub(super) fn move_bytes(
        &self,
        id: SlotId,
        rails: &[RailAddr],
        prefer: &RailPreference,
        batches: Vec<Batch>,
        stop: &Arc<AtomicBool>,
        link: &Arc<PeerLink>,
        total: &mut stripe::Outcome,
    ) -> Result<stripe::Outcome, String> {
        let t = &self.cfg.transport;
        let (rank_mask, key_rank) = prefer;
        // The rails a write's destination rank prefers (0: none, as for
        // staging buffers and unknown keys). Ranks that prefer the same
        // rails share slices: cut by rank, a remap's layer of writes
        // alternating between ranks went as a slice every few writes,
        // four in flight at a time.
        let prefers = |w: &WriteOp| key_rank.get(&w.dst_key).and_then(|r| rank_mask.get(r)).copied().unwrap_or(0);
        let slices = stripe::cut(batches, t.slice_bytes, prefers);
        let masks: Vec<u64> = slices.iter().map(|b| b.writes.first().map_or(0, prefers)).collect();
        let settings = stripe::Settings {
            window: 4,
            window_bytes: 4 * t.slice_bytes,
            stall: Duration::from_millis(t.rail_stall_ms),
            deadline: Instant::now() + Duration::from_secs(self.cfg.limits.transfer_timeout_secs),
        };
        let (stop, lost) = (stop.clone(), link.clone());
        let interrupted = Arc::new(move || -> Option<String> {
            if stop.load(Ordering::Acquire) {
                return Some("cancelled".into());
            }
            lost.lost()
        });
        // The peer's rail i from our rail i (the same fabric, for verbs: a
        // QP can only reach what its own device reaches); with fewer rails
        // here, ours are reused in turn. A kept connection proved the
        // session it was made in, so only that session's transfers take it.
        let cred = &link.credential;
        let connect = |i: usize, rail: &RailAddr| {
            if let Some(c) = self.data_conns.take(&(i, rail.addr.clone(), cred.session), |c| c.reusable(), Duration::ZERO) {
                Metrics::add(&self.metrics.data_conns_reused, 1);
                return Ok(c);
            }
            let local = &self.rails[i % self.rails.len()];
            let c = local.ep.as_ref().unwrap_or(&self.ep).connect(&rail.addr, cred)?;
            Metrics::add(&self.metrics.data_conns_opened, 1);
            Ok(c)
        };
        let park = |i: usize, rail: &RailAddr, c: Box<dyn Connection>| self.data_conns.keep((i, rail.addr.clone(), cred.session), c, || self.keeping());
        let total_posted = total.writes + total.bytes;
        // Setup ends at the first post, on whichever rail: handshake,
        // planning, manifest, packing, data-plane connect.
        let posting = std::sync::Once::new();
        // This transfer's share of each rail's in-flight gauge: what it
        // still holds when it ends comes off the gauge, and only that (other
        // transfers may be using the same rails).
        let inflight: Mutex<HashMap<(String, String), u64>> = Mutex::new(HashMap::new());
        let event = |rail: &RailAddr, e: stripe::RailEvent<'_>| {
            if matches!(e, stripe::RailEvent::Starting) {
                // A streamed transfer posts once per layer: the first counts.
                posting.call_once(|| {
                    if total_posted == 0 {
                        self.slot_mark(id, Boundary::Posting)
                    }
                });
            }
            self.rail_event_in_slot(id, rail, &e);
            self.rail_event_in_metrics(&inflight, rail, &e);
        };
        let watch = |check: Box<dyn FnMut() -> bool + Send>| {
            self.ticker.add(check);
            Ok(())
        };
        let (outcome, result) = stripe::run(&slices, &masks, rails, (&connect, &park), &settings, interrupted, &event, &watch);
        {
            let mine = inflight.into_inner().expect("rail in-flight lock");
            let mut m = self.metrics.rails.lock().expect("rail metrics lock");
            for r in &outcome.rails {
                let key = (r.name.clone(), r.addr.clone());
                let totals = m.entry(key.clone()).or_default();
                totals.busy_ns += r.busy_ns;
                // Slices this transfer left in flight (re-sent elsewhere, or
                // abandoned when it failed) never complete on this rail.
                totals.inflight = totals.inflight.saturating_sub(mine.get(&key).copied().unwrap_or(0));
            }
        }
        Metrics::add(&self.metrics.retransmitted_bytes, outcome.retransmitted);
        total.absorb(&outcome);
        self.with_slot(id, |s| {
            s.retransmitted = total.retransmitted;
            s.rails = total.rails.clone();
        });
        result.map_err(|e| format!("peer `{}`: {e}", link.peer))?;
        // `wire` per transfer: the links' busy span, first post to last
        // completion (slices overlap, so per-slice times would double count).
        self.slot_hop(id, Hop::Post, outcome.post_time, outcome.bytes);
        self.slot_hop(id, Hop::Wire, outcome.wire, outcome.bytes);
        Ok(total.clone())
    }

    /// The transfer's status shows its rails while it runs.
    fn rail_event_in_slot(&self, id: SlotId, rail: &RailAddr, e: &stripe::RailEvent<'_>) {
        self.with_slot(id, |s| {
            let at = match s.rails.iter().position(|r| r.name == rail.name) {
                Some(at) => at,
                None => {
                    s.rails.push(RailUse {
                        name: rail.name.clone(),
                        addr: rail.addr.clone(),
                        bytes: 0,
                        slices: 0,
                        retransmitted_bytes: 0,
                        busy_ns: 0,
                        failed: None,
                    });
                    s.rails.len() - 1
                }
            };
            let r = &mut s.rails[at];
            match e {
                stripe::RailEvent::Starting | stripe::RailEvent::Posted => {}
                stripe::RailEvent::Completed(bytes) => {
                    r.bytes += bytes;
                    r.slices += 1;
                }
                stripe::RailEvent::Failed(resent, why) => {
                    r.retransmitted_bytes += resent;
                    r.failed = Some(why.to_string());
                }
            }
        });
    }

    /// The daemon's per-rail totals and in-flight gauge.
    fn rail_event_in_metrics(&self, inflight: &Mutex<HashMap<(String, String), u64>>, rail: &RailAddr, e: &stripe::RailEvent<'_>) {
        let rail_key = (rail.name.clone(), rail.addr.clone());
        let mut mine = inflight.lock().expect("rail in-flight lock");
        let mut m = self.metrics.rails.lock().expect("rail metrics lock");
        let r = m.entry(rail_key.clone()).or_default();
        match e {
            stripe::RailEvent::Starting => {}
            stripe::RailEvent::Posted => {
                r.inflight += 1;
                *mine.entry(rail_key).or_default() += 1;
            }
            stripe::RailEvent::Completed(bytes) => {
                r.inflight = r.inflight.saturating_sub(1);
                let held = mine.entry(rail_key).or_default();
                *held = held.saturating_sub(1);
                r.bytes += bytes;
                r.slices += 1;
            }
            stripe::RailEvent::Failed(resent, _) => {
                r.failures += 1;
                r.resent_bytes += resent;
            }
        }
    }
}
