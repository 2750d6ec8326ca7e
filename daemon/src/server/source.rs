//! The source side of a transfer, as named phases: negotiate (connect,
//! authenticate, offer → accept: the one round trip) → plan → stage
//! (device → host) → manifest (sent, not answered) → post (pack, batches,
//! the transfer thread).
//! Any phase's error ends the transfer in one place, [`Daemon::submit`]:
//! the destination is told (`Abort`, when it holds a slot), the slot fails,
//! and the client gets the error's code.

use super::announce::Heard;
use super::device::CopyError;
use super::error::Refusal;
use super::link::{LinkError, PeerLink};
use super::ring::{Ring, RingLayout};
use super::state::{Boundary, DeviceMems, Role, SlotId};
use super::{ByRegion, in_parts, pieces, read_mem, region_view, Daemon, Part, RunBytes, RunReader, PEER_CONN_WAIT, REPLY_TIMEOUT};
use crate::config::PeerConfig;
use crate::metrics::Metrics;
use crate::peer;
use crate::stripe::Outcome;
use kvwire_client::control::*;
use kvwire_core::codec::Codec;
use kvwire_core::layout::ModelSpec;
use kvwire_core::manifest::{Checksums, LayerChecksum, Manifest, Reading};
use kvwire_core::plan::{self, CostModel, Mode, Plan, PlanCounters, PlanInput, Segment, Side};
use kvwire_core::reuse::{check_prefix, CacheIdentity};
use kvwire_core::schedule::{self, Schedule, Staged, WriteTarget};
use kvwire_core::session::msg::{Accept, Expect, ManifestWire, Offer, RailAddr};
use kvwire_core::session::{SessionError, SourceEvent, SourceSession, Timeouts};
use kvwire_core::shard::{LayoutSpec, RegionId};
use kvwire_core::CacheFormat;
use kvwire_transport::{Batch, Hop, Region, Stride, Tag, WriteOp};
use std::collections::HashMap;
use crate::peer::Sealed;
use kvwire_transport::auth::Deadline;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// What a submit reads of its source group, snapshotted once: the regions
/// stay registered (`Arc`) while the transfer uses them.
struct SourceGroup {
    gen: u64,
    model: ModelSpec,
    format: CacheFormat,
    layout_text: String,
    identity: CacheIdentity,
    num_blocks: u32,
    regions: ByRegion<Arc<Region>>,
    devices: DeviceMems,
    side: Side,
}

/// The plan against the destination, and its schedule.
pub(super) struct Planned {
    dst: Side,
    plan: Plan,
    schedule: Schedule,
    // Where a device-resident source stages each layer, once asked for.
    ring: std::sync::OnceLock<Arc<RingLayout>>,
}

/// Time spent packing and hashing, and the bytes each covered.
#[derive(Debug, Default, Clone, Copy)]
struct PackTimes {
    packing: Duration,
    hashing: Duration,
    packed: u64,
    hashed: u64,
}

impl PackTimes {
    /// Parts that ran side by side: the longest time, all the bytes.
    fn beside(&self, o: &PackTimes) -> PackTimes {
        PackTimes { packing: self.packing.max(o.packing), hashing: self.hashing.max(o.hashing), packed: self.packed + o.packed, hashed: self.hashed + o.hashed }
    }
}

/// What a transfer's status reports of its size, known before any byte moves.
struct Size {
    layers: usize,
    counters: PlanCounters,
    stage_bytes: u64,
    // What the writes carry, after packing and any codec.
    compressed: u64,
}

impl Size {
    fn of(g: &SourceGroup, p: &Planned) -> Size {
        Size { layers: g.model.layers.len(), counters: p.plan.counters.clone(), stage_bytes: p.schedule.stage_bytes, compressed: p.schedule.wire_bytes() }
    }
}

/// Per destination rank, the rails it prefers (a bit per rail), and the
/// destination rank of each destination key.
pub(super) type RailPreference = (HashMap<u32, u64>, HashMap<u32, u32>);

impl Daemon {
    pub(super) fn submit(self: &Arc<Self>, client: u64, s: Submit) -> Reply {
        let start = self.source_group(client, &s).and_then(|g| {
            let codec = s.codec.as_deref().map(Codec::parse).transpose().map_err(|e| Refusal::new(Code::BadRequest, format!("codec: {e}")))?;
            let peer = self.resolve_peer(&s.peer)?;
            Ok((g, codec, peer))
        });
        let (g, codec, peer) = match start {
            Ok(x) => x,
            Err(r) => return r.reply(),
        };
        let (id, stop) = match self.alloc_slot(Role::Source, &s.request, &s.group, client, None) {
            Ok(x) => x,
            Err(r) => return r.reply(),
        };
        let mut link = None;
        match self.run_source(id, stop, s, g, codec, &peer, &mut link) {
            Ok(reply) => reply,
            Err(r) => {
                if let Some(l) = link {
                    l.abort(&r.message);
                    self.count_wire(id, l.control_bytes());
                }
                self.fail(id, &r.message);
                r.reply()
            }
        }
    }

    #[allow(clippy::too_many_arguments)] // the phases' inputs, each used once
    fn run_source(
        self: &Arc<Self>,
        id: SlotId,
        stop: Arc<AtomicBool>,
        s: Submit,
        g: SourceGroup,
        codec: Option<Codec>,
        peer: &PeerConfig,
        link: &mut Option<Arc<PeerLink>>,
    ) -> Result<Reply, Refusal> {
        let offer = Offer {
            dst_group: s.dst_group.clone(),
            dst_request: s.dst_request.clone(),
            src_request: s.request.clone(),
            identity: g.identity.clone(),
            tokens: s.tokens,
            codec: s.codec.clone(),
            src_layout: g.layout_text.clone(),
            src_num_blocks: g.num_blocks,
            src_block_table: s.block_table.clone(),
        };
        // An idle kept connection first: what the destination announced on
        // each is read on the way, and the one this request was announced
        // on is preferred. An announcement heard is claimed on whichever is
        // taken (the destination granted the node, not one connection),
        // with no round trip. Otherwise the offer, and its accept.
        self.with_slot(id, |sl| sl.peer = peer.name.clone());
        let key = (peer.name.clone(), peer.address.clone());
        let announced_on = |c: &Sealed| self.announcements.session_of(&peer.name, &s.dst_group, &s.dst_request) == Some(c.credential().session);
        let kept = self.peer_conns.take_preferring(&key, |c| self.drain_announcements(&peer.name, c), announced_on, PEER_CONN_WAIT);
        let heard = self.announcements.take(&peer.name, &s.dst_group, &s.dst_request);
        let claimed = match (kept, heard) {
            (Some(c), Some(h)) => self.claim_on(c, h, peer, &s, &g, codec, &offer, link),
            (kept, heard) => Err((kept, heard.map(|h| (h.session, h.bytes)))),
        };
        let (accept, p) = match claimed {
            Ok(x) => x,
            Err((conn, announced)) => {
                let accept = self.negotiate(peer, offer, link, conn)?;
                // An announcement of this request that was not claimed, or
                // that crossed the offer, is stale now. It crossed for this
                // transfer where the offer went on its connection: the
                // destination counts it then too.
                let crossed = self.announcements.take(&peer.name, &s.dst_group, &s.dst_request).map(|h| (h.session, h.bytes));
                if let Some(l) = link.as_ref() {
                    let here = |a: Option<(u64, u64)>| a.filter(|(on, _)| *on == l.credential.session).map_or(0, |(_, b)| b);
                    l.count_announcement(here(announced) + here(crossed));
                }
                let p = self.plan_against(&g, &s, &accept, codec)?;
                (accept, p)
            }
        };
        let l = link.as_ref().expect("negotiated").clone();
        if !g.devices.is_empty() {
            return self.ring_source(id, stop, s, g, p, codec, accept, l);
        }
        if s.stream {
            return self.stream_source(id, stop, s, g, p, codec, accept, l);
        }
        // A large transfer is packed and hashed beside the wire: the
        // manifest goes without checksums, each layer's follow as they are
        // computed, and its bytes as soon as it is packed (the destination
        // verifies a layer once both are in). Over one rail only: each
        // post of packed layers is a stripe run of its own, and a rail
        // that failed in one run would be tried again in the next, so a
        // striped transfer keeps one run and packs first.
        let beside = self.cfg.verify_checksums && p.plan.counters.total_bytes_moved >= self.cfg.transport.hash_beside_bytes;
        if beside && accept.rails.len() <= 1 {
            return self.pipelined_source(id, stop, s, g, p, codec, accept, l);
        }
        let (rails, prefer) = rails_of(&accept);
        let size = Size::of(&g, &p);
        let (g, peer_slot, dst_request) = (Arc::new(g), accept.slot, s.dst_request.clone());
        let dst_request_here = dst_request.clone();
        // Packed first: the checksums then read gathered segments from
        // staging in one piece, not run by run from the cache again.
        let (sg, sp, sa) = (g.clone(), p.clone(), accept.clone());
        let start = move |d: &Daemon, link: &Arc<PeerLink>| -> Result<(Option<Arc<Region>>, Vec<Batch>), Refusal> {
            // Hashed as it is packed, piece by piece, unless beside the wire.
            let (stage, sums) = match beside {
                true => (d.pack(id, &sg, &sp, codec)?, Sums::Follow),
                false => d.pack_and_hash(id, &sg, &sp, codec).map(|(st, sums)| (st, Sums::Ready(sums)))?,
            };
            d.keeping_stage(stage, |st| {
                d.expect(id, &sg, &dst_request, &sp, codec, &sa, sums, link)?;
                batches(&sg, &sp, &sa, codec, st)
            })
        };
        // A large submit is answered once the transfer is planned and its
        // slot claimed: packing, hashing and the manifest run on the
        // transfer thread, not on the engine's call (a failure there fails
        // the transfer, as one on the wire does). A small one is packed,
        // hashed and its manifest sent here, before the answer; its writes
        // follow on this same thread once the answer is out (`post`), or
        // on a worker beside the manifest where this thread cannot take
        // them. The destination granted the keys before it accepted or
        // announced, and needs the manifest only to verify.
        let small = starts_on_submit(&g, &s, &p);
        let early = match small {
            true => Some(self.keeping_stage(self.pack(id, &g, &p, codec)?, |st| batches(&g, &p, &accept, codec, st))?),
            false => None,
        };
        let stage_here = early.as_ref().and_then(|(st, _)| st.clone());
        let (manifest_out, manifest_sent) = mpsc::sync_channel::<bool>(1);
        let (mg, mp) = (g.clone(), p.clone());
        let mover = move |d: &Arc<Daemon>, stop: &Arc<AtomicBool>, link: &Arc<PeerLink>| {
            let mut total = Outcome::default();
            let (stage, batches) = match early.map_or_else(|| start(d, link), Ok) {
                Ok(x) => x,
                Err(r) => return (total, Err(r.message)),
            };
            let hashing = beside.then(|| d.hash_beside(id, mg, mp, codec, stage.clone(), link.clone(), stop.clone()));
            let moved = d.move_bytes(id, &rails, &prefer, batches, stop, link, &mut total).map(|_| ());
            // Every layer's checksums are out before the transfer waits for
            // its verdict, which the destination gives only once each layer
            // verified. A small transfer's manifest went before or beside
            // its writes; its stage, which the manifest hashed, is kept
            // until it is out.
            let manifest = match small {
                true => manifest_sent.recv().unwrap_or(false).then_some(()).ok_or_else(|| "the manifest did not go out".to_string()),
                false => Ok(()),
            };
            let hashed = hashing.map_or(Ok(()), |rx| rx.recv().unwrap_or_else(|_| Err("the hashing job ended without a word".into())));
            // Every write completed or failed, and the hashing job ended: nothing reads it now.
            d.drop_stage(stage);
            (total, moved.and(manifest).and(hashed))
        };
        // A small transfer's answer waits for its manifest, which can fail it.
        let reply = self.post(id, stop, s, size, codec, peer_slot, None, l.clone(), !small, mover)?;
        if small {
            let sent = self.expect(id, &g, &dst_request_here, &p, codec, &accept, Sums::Now(stage_here.as_deref()), &l);
            drop(stage_here);
            let _ = manifest_out.send(sent.is_ok());
            sent?;
        }
        Ok(reply)
    }

    /// A large host-resident source: a worker packs and hashes it layer by
    /// layer, sending each layer's checksums, while the transfer thread
    /// posts the layers packed so far. The wire starts once the first
    /// layer is packed, not the whole transfer. The manifest goes first,
    /// without checksums; each layer's go before its bytes.
    #[allow(clippy::too_many_arguments)] // what the transfer thread takes over
    fn pipelined_source(self: &Arc<Self>, id: SlotId, stop: Arc<AtomicBool>, s: Submit, g: SourceGroup, p: Arc<Planned>, codec: Option<Codec>, accept: Box<Accept>, l: Arc<PeerLink>) -> Result<Reply, Refusal> {
        let size = Size::of(&g, &p);
        let (rails, prefer) = rails_of(&accept);
        let n = p.schedule.layers.len();
        let (g, peer_slot, dst_request) = (Arc::new(g), accept.slot, s.dst_request.clone());
        let mover = move |d: &Arc<Daemon>, stop: &Arc<AtomicBool>, link: &Arc<PeerLink>| {
            let mut total = Outcome::default();
            let (stage, batches) = match d.layer_by_layer(id, &g, &dst_request, &p, codec, &accept, link) {
                Ok(x) => x,
                Err(r) => return (total, Err(r.message)),
            };
            let halt = Arc::new(AtomicBool::new(false));
            let packed = d.pack_ahead(id, g, p, codec, stage.clone(), link.clone(), [stop.clone(), halt.clone()]);
            let mut batches = batches.into_iter();
            let moved = (|| {
                let mut layer = 0;
                while layer < n {
                    let next = |r: Result<Result<usize, String>, _>| r.unwrap_or_else(|_| Err("the packing job ended without a word".into()));
                    let mut upto = next(packed.recv())? + 1;
                    // Layers packed meanwhile go with it: one post, not one each.
                    while let Ok(more) = packed.try_recv() {
                        upto = more? + 1;
                    }
                    d.move_bytes(id, &rails, &prefer, batches.by_ref().take(upto - layer).collect(), stop, link, &mut total)?;
                    layer = upto;
                }
                Ok(())
            })();
            // The job stops before its next layer; once it dropped its end
            // of the channel it reads neither the cache nor the stage.
            halt.store(true, Ordering::Release);
            while packed.recv().is_ok() {}
            d.drop_stage(stage);
            (total, moved)
        };
        self.post(id, stop, s, size, codec, peer_slot, None, l, true, mover)
    }

    /// Packs and hashes a transfer's layers in order on a worker, sending
    /// each one's checksums; says on the returned channel which layer is
    /// ready to post, or why it stopped. Any of `stops` ends it before its
    /// next layer; it drops its end of the channel last.
    #[allow(clippy::too_many_arguments)] // what the job takes over
    fn pack_ahead(
        self: &Arc<Self>,
        id: SlotId,
        g: Arc<SourceGroup>,
        p: Arc<Planned>,
        codec: Option<Codec>,
        stage: Option<Arc<Region>>,
        link: Arc<PeerLink>,
        stops: [Arc<AtomicBool>; 2],
    ) -> mpsc::Receiver<Result<usize, String>> {
        let d = self.clone();
        self.on_worker("kvwired-pack", "packing", move |tx| {
            for layer in 0..p.schedule.layers.len() {
                if stops.iter().any(|s| s.load(Ordering::Acquire)) {
                    let _ = tx.send(Err("cancelled".to_string()));
                    break;
                }
                let done = d.host_layer(id, &g, &p, codec, layer, stage.as_deref(), &link).map(|()| layer).map_err(|r| r.message);
                let failed = done.is_err();
                if tx.send(done).is_err() || failed {
                    break;
                }
            }
        })
    }

    /// Hashes a transfer's layers in order on a worker, sending each one's
    /// checksums as soon as they are known; says on the returned channel
    /// how it ended.
    #[allow(clippy::too_many_arguments)] // what the job takes over
    fn hash_beside(
        self: &Arc<Self>,
        id: SlotId,
        g: Arc<SourceGroup>,
        p: Arc<Planned>,
        codec: Option<Codec>,
        stage: Option<Arc<Region>>,
        link: Arc<PeerLink>,
        stop: Arc<AtomicBool>,
    ) -> mpsc::Receiver<Result<(), String>> {
        let d = self.clone();
        self.on_worker("kvwired-hash", "hashing", move |tx| {
            let done = (0..p.schedule.layers.len()).try_for_each(|layer| {
                if stop.load(Ordering::Acquire) {
                    return Err("cancelled".to_string());
                }
                d.send_layer_checksums(id, &g, &p, codec, layer, stage.as_deref(), &link).map_err(|r| r.message)
            });
            let _ = tx.send(done);
        })
    }

    /// Runs `job` on a worker with the sending end of a channel and returns
    /// the receiving end. A panic, or a job that cannot start, arrives on
    /// it as an error naming `what`. What the job holds is dropped before
    /// its end of the channel.
    fn on_worker<T: Send + 'static>(&self, name: &str, what: &'static str, job: impl FnOnce(&mpsc::Sender<Result<T, String>>) + Send + 'static) -> mpsc::Receiver<Result<T, String>> {
        let (tx, rx) = mpsc::channel();
        let (panicked, unstarted) = (tx.clone(), tx.clone());
        let on_panic = move |why: String| {
            let _ = panicked.send(Err(format!("internal error: the {what} job panicked: {why}")));
        };
        if let Err(e) = self.workers.spawn(name, move || job(&tx), on_panic) {
            let _ = unstarted.send(Err(format!("cannot start the {what} job: {e}")));
        }
        rx
    }

    /// The manifest out: checksums in it, or to follow per layer when the
    /// transfer streams or hashes beside the wire. From here the
    /// destination waits for bytes; the heartbeat starts with the
    /// transfer thread ([`Daemon::post`]).
    #[allow(clippy::too_many_arguments)] // the phases' inputs
    fn expect(&self, id: SlotId, g: &SourceGroup, dst_request: &str, p: &Planned, codec: Option<Codec>, accept: &Accept, sums: Sums<'_>, l: &Arc<PeerLink>) -> Result<(), Refusal> {
        let layer_sums = matches!(sums, Sums::Follow);
        let manifest = self.manifest(id, g, p, dst_request, codec, sums)?;
        let expect = Expect { slot: accept.slot, manifest: ManifestWire::of(&manifest), layer_sums };
        l.send_expect(expect, p.schedule.stage_bytes)?;
        l.read_timeout(Duration::from_secs(self.cfg.limits.peer_timeout_secs));
        Ok(())
    }

    /// What a transfer moved layer by layer (streamed, or packed beside the
    /// wire) starts with: the manifest out, each layer's checksums to
    /// follow; a staging buffer for what it packs; and one batch of writes
    /// per layer.
    #[allow(clippy::too_many_arguments)] // the transfer's parts
    fn layer_by_layer(&self, id: SlotId, g: &SourceGroup, dst_request: &str, p: &Planned, codec: Option<Codec>, accept: &Accept, l: &Arc<PeerLink>) -> Result<(Option<Arc<Region>>, Vec<Batch>), Refusal> {
        self.expect(id, g, dst_request, p, codec, accept, Sums::Follow, l)?;
        let src_stage = self.stage_buffer(id, stage_needed(p, codec))?;
        self.keeping_stage(src_stage, |st| batches(g, p, accept, codec, st))
    }

    /// `f`'s result beside `stage`; on an error the stage goes back to the pool.
    fn keeping_stage<T>(&self, stage: Option<Arc<Region>>, f: impl FnOnce(Option<&Arc<Region>>) -> Result<T, Refusal>) -> Result<(Option<Arc<Region>>, T), Refusal> {
        match f(stage.as_ref()) {
            Ok(t) => Ok((stage, t)),
            Err(r) => {
                self.drop_stage(stage);
                Err(r)
            }
        }
    }

    /// A streamed submit from host memory: the destination accepted and
    /// the manifest's claims are out; the reply goes back now, and the
    /// transfer thread moves each layer once every source rank holding
    /// part of it said it is written ([`super::produced`]): hash it, send
    /// its checksums, pack it, post it. The layers' waits share the
    /// transfer timeout.
    #[allow(clippy::too_many_arguments)] // what the transfer thread takes over
    fn stream_source(self: &Arc<Self>, id: SlotId, stop: Arc<AtomicBool>, s: Submit, g: SourceGroup, p: Arc<Planned>, codec: Option<Codec>, accept: Box<Accept>, l: Arc<PeerLink>) -> Result<Reply, Refusal> {
        let (src_stage, batches) = self.layer_by_layer(id, &g, &s.dst_request, &p, codec, &accept, &l)?;
        let n = g.model.layers.len();
        let readers = readers_of(&p.plan, n);
        let size = Size::of(&g, &p);
        let (rails, prefer) = rails_of(&accept);
        let deadline = Instant::now() + Duration::from_secs(self.cfg.limits.transfer_timeout_secs);
        let stage = src_stage.clone();
        let (group, request) = (s.group.clone(), s.request.clone());
        let mover = move |d: &Arc<Daemon>, stop: &Arc<AtomicBool>, link: &Arc<PeerLink>| {
            let mut total = Outcome::default();
            let mut batches = batches.into_iter();
            let moved = (|| {
                let mut layer = 0;
                while layer < n {
                    d.produced.wait(&group, &request, &readers[layer], layer as u16, deadline, stop)?;
                    // Layers the engine wrote meanwhile go with this one: one post, not one each.
                    let upto = layer + d.produced.ready_from(&group, &request, &readers, layer).max(1);
                    for l in layer..upto {
                        d.slot_mark(id, Boundary::Produced(l));
                        d.host_layer(id, &g, &p, codec, l, stage.as_deref(), link).map_err(|r| r.message)?;
                    }
                    d.move_bytes(id, &rails, &prefer, batches.by_ref().take(upto - layer).collect(), stop, link, &mut total)?;
                    layer = upto;
                }
                Ok(())
            })();
            d.produced.forget(&group, &request);
            (total, moved)
        };
        self.post(id, stop, s, size, codec, accept.slot, src_stage, l, true, mover)
    }

    /// A device-resident source through a staging ring ([`super::ring`]):
    /// layer L's device → host copies gather its bytes into slot L mod
    /// depth, where its checksums are computed and its writes start. Copies
    /// run up to depth - 1 layers ahead of the wire, and a slot is copied
    /// into again only once its layer's writes completed. The source is
    /// released once the last layer's copies are done, as nothing reads
    /// the device after them. Streamed, a layer's copies start only once
    /// every rank reading it said it is written. What the source gathers
    /// (with a codec, every segment, its rows converted) is packed from
    /// the footprint into the slot's end. An allocation the NIC reads in
    /// place (GPUDirect, [`super::state::DevicePath`]) is written from
    /// device memory as soon as its layer's copies are enqueued; the copy
    /// still serves the checksums and what is gathered, and the source is
    /// released only once the last writes completed.
    #[allow(clippy::too_many_arguments)] // what the transfer thread takes over
    fn ring_source(self: &Arc<Self>, id: SlotId, stop: Arc<AtomicBool>, s: Submit, g: SourceGroup, p: Arc<Planned>, codec: Option<Codec>, accept: Box<Accept>, l: Arc<PeerLink>) -> Result<Reply, Refusal> {
        let ring_failed = |e: String| Refusal::new(Code::TransferFailed, format!("staging ring: {e}"));
        // Laid out once per plan: a request like an earlier one takes its
        // layout, while its regions are where they were.
        // A segment the NIC reads in place is copied only for its
        // checksums, or to be gathered.
        let in_place = |s: &Segment| {
            let r = g.regions.get(&(s.src_rank, s.src_region));
            let alloc = g.devices.get(&s.src_rank).zip(r).and_then(|(devs, r)| devs.iter().find(|m| Arc::ptr_eq(&m.mirror, &r.mem)));
            alloc.is_some_and(|m| m.path.key().is_some())
        };
        let copied = |s: &Segment| self.cfg.verify_checksums || !in_place(s);
        let build = || RingLayout::build(&p.plan, &p.schedule, &g.regions, |s| gathers(s, codec), copied).map(Arc::new).map_err(ring_failed);
        let kept = match p.ring.get() {
            Some(l) => l.clone(),
            None => {
                let l = build()?;
                p.ring.get_or_init(|| l).clone()
            }
        };
        let (layout, sources) = match kept.resolve(&g.regions, &g.devices) {
            Ok(s) => (kept, s),
            Err(_) => {
                let fresh = build()?;
                let sources = fresh.resolve(&g.regions, &g.devices).map_err(ring_failed)?;
                (fresh, sources)
            }
        };
        let ring = self.take_ring(layout, sources, self.cfg.device.ring_depth as usize).map_err(ring_failed)?;
        self.with_slot(id, |sl| sl.staging = ring.bytes());
        let n = g.model.layers.len();
        if let Err(r) = self.expect(id, &g, &s.dst_request, &p, codec, &accept, Sums::Follow, &l) {
            self.give_ring(ring);
            return Err(r);
        }
        // Each layer's writes are listed when its turn comes, beside the
        // previous layer's on the wire: listed all up front (a write per
        // staged segment) they held back the first copies.
        let dst_keys = dst_keys(&accept);
        let peer_slot = accept.slot;
        let size = Size::of(&g, &p);
        let (rails, prefer) = rails_of(&accept);
        let deadline = Instant::now() + Duration::from_secs(self.cfg.limits.transfer_timeout_secs);
        let gate = s.stream.then(|| (s.group.clone(), s.request.clone(), readers_of(&p.plan, n)));
        let in_place_any = ring.sources.iter().any(|s| s.direct.is_some());
        let mover = move |d: &Arc<Daemon>, stop: &Arc<AtomicBool>, link: &Arc<PeerLink>| {
            let mut total = Outcome::default();
            let failed = |layer: usize| move |e: CopyError| format!("device → host staging of layer {layer}: {e}");
            // Copies started and not awaited, in layer order.
            let mut copies = std::collections::VecDeque::new();
            // Layers whose copies were started, and layers known written.
            let (mut started, mut produced) = (0, if gate.is_some() { 0 } else { n });
            // When each rank's stream ended its last copies: the next layer's
            // copies, queued behind them, start there.
            let mut free_at = HashMap::new();
            // A layer's writes go out on a thread of their own while this one
            // packs and hashes the next layer (one layer on the wire at a
            // time); it hands back the running total with its outcome.
            type Wire<'s> = std::thread::ScopedJoinHandle<'s, (Outcome, Result<(), String>)>;
            let moved = std::thread::scope(|sc| {
                let mut wire: Option<(usize, Wire<'_>)> = None;
                // Starts the copies of the layers before `upto` not yet started.
                let start = |copies: &mut std::collections::VecDeque<_>, started: &mut usize, upto: usize| {
                    while *started < upto {
                        d.slot_mark(id, Boundary::Staging(*started));
                        copies.push_back(d.start_ring_copies(&ring, *started).map_err(failed(*started)));
                        *started += 1;
                    }
                };
                let landed = |wire: &mut Option<(usize, Wire<'_>)>, total: &mut Outcome| -> Result<(), String> {
                    let Some((layer, h)) = wire.take() else { return Ok(()) };
                    let (t, r) = h.join().unwrap_or_else(|_| (std::mem::take(total), Err("the writes' thread panicked".into())));
                    *total = t;
                    r?;
                    d.slot_mark(id, Boundary::Sent(layer));
                    Ok(())
                };
                let run = (|| {
                    for layer in 0..n {
                        if let Some((group, request, readers)) = &gate {
                            if produced <= layer {
                                d.produced.wait(group, request, &readers[layer], layer as u16, deadline, stop)?;
                                d.slot_mark(id, Boundary::Produced(layer));
                                produced = layer + 1;
                            }
                            // Layers the engine wrote meanwhile are copied ahead too.
                            let more = if produced < n { d.produced.ready_from(group, request, readers, produced) } else { 0 };
                            for l in produced..produced + more {
                                d.slot_mark(id, Boundary::Produced(l));
                            }
                            produced += more;
                        }
                        // The slots up to depth - 1 layers ahead are free once
                        // every layer before this one left the wire; the one
                        // the previous layer's writes still read is taken
                        // below, once they are out.
                        start(&mut copies, &mut started, produced.min(if wire.is_some() { layer + ring.depth - 1 } else { layer + ring.depth }));
                        if started <= layer {
                            // One slot: this layer's is the one on the wire.
                            landed(&mut wire, &mut total)?;
                            start(&mut copies, &mut started, produced.min(layer + ring.depth));
                        }
                        let (in_place, from_ring) = ring_batch(&p, &accept, &dst_keys, &ring, codec, layer).map_err(|r| r.message)?;
                        // Read in place by the NIC: out while this layer's copies
                        // (for its checksums and what is gathered) still run.
                        let from_ring = match in_place.writes.is_empty() {
                            true => Some(from_ring),
                            false => {
                                landed(&mut wire, &mut total)?;
                                let bytes = in_place.bytes();
                                d.move_bytes(id, &rails, &prefer, vec![in_place], stop, link, &mut total)?;
                                d.with_slot(id, |sl| sl.in_place += bytes);
                                Some(from_ring).filter(|b| !b.writes.is_empty())
                            }
                        };
                        let staged = copies.pop_front().expect("this layer's copies were started")?.finish(d, id, &mut free_at).map_err(failed(layer))?;
                        d.slot_mark_at(id, Boundary::HostStaged(layer), staged);
                        // In place, the NIC reads the engine's memory until the
                        // last writes complete: the release comes with them.
                        if layer + 1 == n && !in_place_any {
                            d.release_source(id);
                        }
                        if stop.load(Ordering::Acquire) {
                            return Err("cancelled".to_string());
                        }
                        d.ring_pack(id, &g, &p, &ring, codec, layer).map_err(|r| r.message)?;
                        let sums = |part: &Part| {
                            let (base, mut find) = (ring.base(layer), ring.layout.finder(layer));
                            let read = |rank, region, offset, len| find(rank, region, offset, len).and_then(|at| region_view(&ring.region, base + at, len)).map(RunBytes::Mapped);
                            // Packed bytes are what the destination holds only without a codec.
                            let whole = |i: usize| ring.packed(layer, i).filter(|_| codec.is_none()).and_then(|at| region_view(&ring.region, at, p.plan.segments.at(i).bytes())).map(RunBytes::Mapped);
                            let mut sums = part.sums(&p.plan, Reading::Source);
                            d.sums_of(&mut sums, &g, codec, part.iter().copied(), read, whole).map(|()| sums.finish())
                        };
                        d.send_sums(id, &p, layer, link, sums).map_err(|r| r.message)?;
                        // The previous layer's writes are out: its slot takes
                        // the copies of the layer depth - 1 ahead.
                        landed(&mut wire, &mut total)?;
                        start(&mut copies, &mut started, produced.min(layer + ring.depth));
                        match from_ring {
                            // A large layer's writes run beside the next layer's packing.
                            Some(b) if layer + 1 < n && b.bytes() >= OVERLAP_BYTES => {
                                let (mut t, rails, prefer) = (std::mem::take(&mut total), &rails, &prefer);
                                let h = sc.spawn(move || {
                                    let r = d.move_bytes(id, rails, prefer, vec![b], stop, link, &mut t).map(|_| ());
                                    (t, r)
                                });
                                wire = Some((layer, h));
                            }
                            Some(b) => {
                                d.move_bytes(id, &rails, &prefer, vec![b], stop, link, &mut total)?;
                                d.slot_mark(id, Boundary::Sent(layer));
                            }
                            None => d.slot_mark(id, Boundary::Sent(layer)),
                        }
                    }
                    Ok(())
                })();
                // Writes still out end before the ring goes back; the first error is the one told.
                let last = landed(&mut wire, &mut total);
                run.and(last)
            });
            // Copies started and not awaited still write into the ring: they
            // end before it goes back.
            for c in copies.into_iter().flatten() {
                let _ = c.finish(d, id, &mut free_at);
            }
            if let Some((group, request, _)) = &gate {
                d.produced.forget(group, request);
            }
            d.give_ring(ring);
            (total, moved)
        };
        self.post(id, stop, s, size, codec, peer_slot, None, l, true, mover)
    }

    /// Gathers layer `layer`'s packed segments in its ring slot, from its
    /// footprint there to their place after it (converting their rows with
    /// a codec).
    fn ring_pack(&self, id: SlotId, g: &SourceGroup, p: &Planned, ring: &Ring, codec: Option<Codec>, layer: usize) -> Result<(), Refusal> {
        let packed = &ring.layout.layers[layer].packed;
        if packed.is_empty() {
            return Ok(());
        }
        let started = Instant::now();
        let segs: Vec<usize> = packed.iter().map(|&(i, _)| i).collect();
        let bytes = segs.iter().map(|&i| p.plan.segments.at(i).bytes()).sum::<u64>();
        // A large layer is packed in parts side by side (only its packed
        // segments: the parts' stream offsets are not used, nothing is hashed here).
        in_parts(&p.plan, segs, bytes, |part| self.ring_pack_part(g, p, ring, codec, layer, part))?;
        self.slot_hop(id, Hop::Pack, started.elapsed(), bytes);
        Ok(())
    }

    /// [`Daemon::ring_pack`] of packed segments `segs` of layer `layer`.
    fn ring_pack_part(&self, g: &SourceGroup, p: &Planned, ring: &Ring, codec: Option<Codec>, layer: usize, segs: &[usize]) -> Result<(), Refusal> {
        let failed = |what: String| Refusal::new(Code::TransferFailed, format!("pack: {what}"));
        let mem = &ring.region.mem;
        for &i in segs {
            let s = &p.plan.segments.at(i);
            let to = ring.region.offset + ring.packed(layer, i).expect("a packed segment");
            let missing = |k: usize| failed(format!("segment {i} run {k} is not in layer {layer}'s ring slot"));
            match (codec, p.schedule.staged_of(i)) {
                (Some(_), Some(st)) => {
                    let (base, mut find) = (ring.region.offset + ring.base(layer), ring.layout.finder(layer));
                    let read = |so, len| read_mem(mem, base + find(s.src_rank, s.src_region, so, len)?, len);
                    let coded = schedule::pack(s, &st, &g.format, codec, read).ok_or_else(|| missing(0))?;
                    mem.write(to, &coded).map_err(|e| failed(e.to_string()))?;
                }
                (Some(_), None) => return Err(failed(format!("segment {i} is not staged"))),
                (None, _) => {
                    for (k, from) in ring.runs(layer, s).enumerate() {
                        let from = from.ok_or_else(|| missing(k))?;
                        mem.copy_to(ring.region.offset + from, mem, to + k as u64 * s.len, s.len).map_err(|e| failed(e.to_string()))?;
                    }
                }
            }
        }
        Ok(())
    }

    /// The submit's source group, complete, and its side for the request.
    fn source_group(&self, client: u64, s: &Submit) -> Result<SourceGroup, Refusal> {
        let st = self.groups.lock().expect("groups lock");
        let g = st.access(client, &s.group)?;
        g.require_complete(&s.group)?;
        let side = Side::with_table(&g.model, &g.layout, g.format, s.tokens, s.block_table.clone(), g.num_blocks).map_err(|e| Refusal::new(Code::BadRequest, format!("source request: {e}")))?;
        Ok(SourceGroup {
            gen: g.gen,
            model: g.model.clone(),
            format: g.format,
            layout_text: g.layout_text.clone(),
            identity: g.identity.clone(),
            num_blocks: g.num_blocks,
            regions: g.regions(),
            devices: g.devices(),
            side,
        })
    }

    /// Negotiate: the offer out on an authenticated connection to `peer` —
    /// `kept`, an idle one kept from an earlier transfer, else a new one —
    /// and the accept back. A kept connection the peer has since closed is
    /// replaced by a new one.
    fn negotiate(&self, peer: &PeerConfig, offer: Offer, link: &mut Option<Arc<PeerLink>>, kept: Option<Sealed>) -> Result<Box<Accept>, Refusal> {
        let timeouts = self.peer_timeouts();
        Metrics::add(&self.metrics.offered, 1);
        let answer = match kept {
            Some(kept) => match self.offer_on(kept, peer, offer.clone(), timeouts, link) {
                Err(LinkError::Wire(why)) => {
                    tracing::debug!(peer = peer.name, why, "kept peer connection is gone; connecting anew");
                    self.offer_on(self.connect_peer(peer)?, peer, offer, timeouts, link)
                }
                other => {
                    Metrics::add(&self.metrics.peer_conns_reused, 1);
                    other
                }
            },
            None => self.offer_on(self.connect_peer(peer)?, peer, offer, timeouts, link),
        };
        match answer.map_err(|e| negotiation_failed(&peer.name, e, "refused"))? {
            SourceEvent::Accepted(a) => Ok(a),
            other => Err(Refusal::new(Code::PeerRefused, format!("unexpected peer reply {other:?}"))),
        }
    }

    fn peer_timeouts(&self) -> Timeouts {
        Timeouts {
            reply: REPLY_TIMEOUT,
            peer: Duration::from_secs(self.cfg.limits.peer_timeout_secs),
            transfer: Duration::from_secs(self.cfg.limits.transfer_timeout_secs),
        }
    }

    /// Claims the request on kept connection `c` when the destination
    /// announced it (`h`, on this connection or another to the same
    /// daemon), and this side's plan fits what it set
    /// aside (each layer's bytes, the staging buffer): the claim goes out
    /// unanswered, and the transfer is accepted already. Otherwise the
    /// connection back for the offer (none when it failed), and the
    /// announcement's bytes; a claim the destination would refuse (tokens,
    /// identity) is offered instead, so the refusal comes back with its
    /// reason.
    #[allow(clippy::too_many_arguments)] // the submit's parts
    fn claim_on(&self, mut c: Sealed, h: Heard, peer: &PeerConfig, s: &Submit, g: &SourceGroup, codec: Option<Codec>, offer: &Offer, link: &mut Option<Arc<PeerLink>>) -> Result<(Box<Accept>, Arc<Planned>), (Option<Sealed>, Option<(u64, u64)>)> {
        let (ann, heard) = (h.announce, Some((h.session, h.bytes)));
        if codec.is_some() || ann.tokens != s.tokens {
            return Err((Some(c), heard));
        }
        if check_prefix(&ann.identity, &g.identity, ann.accept.prefix_tokens, s.tokens).is_err() {
            return Err((Some(c), heard));
        }
        let transport = self.ep.transport();
        let Ok(p) = self.plan_against(g, s, &ann.accept, None) else { return Err((Some(c), heard)) };
        let sends: Vec<u64> = p.schedule.layers.iter().map(|l| l.wire_bytes).collect();
        if sends != ann.layer_bytes || p.schedule.stage_bytes > ann.accept.stage_len {
            return Err((Some(c), heard));
        }
        let timeouts = self.peer_timeouts();
        let Ok((session, claim)) = SourceSession::claim(Instant::now(), ann.accept.clone(), ann.gen, offer.clone(), transport, timeouts) else { return Err((Some(c), heard)) };
        // No reply is due to a claim: reads on it from here (pings, until
        // `done`) wait up to the peer timeout, as the manifest's sets it.
        let _ = c.read_timeout(timeouts.peer);
        let l = link.insert(Arc::new(PeerLink::new(c, session, peer, timeouts.peer, self.announcements.clone())));
        // A small transfer's manifest follows at once: the claim leaves
        // with it, in one write (one wake-up of the destination, not two).
        let sent = match starts_on_submit(g, s, &p) {
            true => l.hold(&claim),
            false => l.send(&claim),
        };
        if let Err(e) = sent {
            tracing::debug!(peer = peer.name, error = %e, "kept peer connection is gone; offering on a new one");
            *link = None;
            return Err((None, heard));
        }
        l.count_announcement(h.bytes);
        Metrics::add(&self.metrics.claimed, 1);
        Metrics::add(&self.metrics.peer_conns_reused, 1);
        Ok((Box::new(ann.accept), p))
    }

    /// Opens the transfer's session on `stream` and sends its offer.
    fn offer_on(&self, mut stream: Sealed, peer: &PeerConfig, offer: Offer, timeouts: Timeouts, link: &mut Option<Arc<PeerLink>>) -> Result<SourceEvent, LinkError> {
        let _ = stream.read_timeout(REPLY_TIMEOUT);
        let (session, first) = SourceSession::start(Instant::now(), offer, self.ep.transport(), timeouts);
        link.insert(Arc::new(PeerLink::new(stream, session, peer, timeouts.peer, self.announcements.clone()))).exchange(&first)
    }

    /// Connects to `peer` and authenticates both ways; the peer must be
    /// the node configured (or discovered) at that address.
    fn connect_peer(&self, peer: &PeerConfig) -> Result<Sealed, Refusal> {
        let unreachable = |e: &dyn std::fmt::Display| Refusal::new(Code::PeerUnreachable, format!("peer `{}` at {}: {e}", peer.name, peer.address));
        let addr = peer.address.parse().map_err(|e| unreachable(&e))?;
        let pc = TcpStream::connect_timeout(&addr, Duration::from_secs(self.cfg.limits.peer_timeout_secs)).map_err(|e| unreachable(&e))?;
        // Small messages, some unanswered (the manifest), each wanted at
        // once: Nagle would hold one behind the other's ack.
        let _ = pc.set_nodelay(true);
        let authed = peer::connect_auth(&mut Deadline::new(&pc, REPLY_TIMEOUT), &self.secret, &self.cfg.node);
        let _ = pc.set_write_timeout(Some(Duration::from_secs(self.cfg.limits.peer_timeout_secs)));
        match authed {
            Ok((name, cred)) if name == peer.name => {
                Metrics::add(&self.metrics.peer_conns_opened, 1);
                let mut sealed = Sealed::new(pc, cred, true);
                // The data connections proved in its session go with it,
                // wherever it is let go (not kept, lost, failed): only that
                // session's transfers may take them, and kept they would
                // pile up against the peer's cap on connections.
                let (conns, session) = (self.data_conns.clone(), sealed.credential().session);
                sealed.on_end(move || conns.drop_where(|&(_, _, s)| s == session));
                Ok(sealed)
            }
            Ok((name, _)) => Err(Refusal::new(Code::AuthFailed, format!("peer at {} is `{name}`, not `{}`", peer.address, peer.name))),
            Err(e) => Err(Refusal::new(Code::AuthFailed, e)),
        }
    }

    /// The manifest: identity, shapes, maps, positions, and checksums of
    /// what the destination must hold — the source bytes, or with a codec
    /// the source bytes as the destination will decode them, from `sums`
    /// (with [`Sums::Follow`] they follow layer by layer instead); with
    /// checksums off there are none.
    fn manifest(&self, id: SlotId, g: &SourceGroup, p: &Planned, dst_request: &str, codec: Option<Codec>, sums: Sums<'_>) -> Result<Manifest, Refusal> {
        let mut m = Manifest::claims(&g.identity, &g.model, &g.side, &p.dst, &p.plan, dst_request).map_err(|e| Refusal::new(Code::BadRequest, format!("manifest: {e}")))?;
        if !self.cfg.verify_checksums {
            return Ok(m);
        }
        match sums {
            Sums::Follow => {}
            Sums::Now(stage) => {
                let started = Instant::now();
                m.checksums = self.source_sums(Checksums::new(&p.plan, Reading::Source), g, p, codec, 0..p.plan.segments.len(), stage)?;
                self.slot_hop(id, Hop::Verify, started.elapsed(), p.plan.counters.total_bytes_moved);
            }
            Sums::Ready(sums) => m.checksums = sums,
        }
        Ok(m)
    }

    /// Checksums of the source bytes of segments `segs` (whole layers, in
    /// plan order, or a part's, [`Part::sums`]), as the destination will
    /// hold them, hashed into `sums`. Segments packed into `stage` already
    /// (without a codec) are read there, in one piece.
    #[allow(clippy::too_many_arguments)] // the transfer's parts
    fn source_sums(&self, mut sums: Checksums, g: &SourceGroup, p: &Planned, codec: Option<Codec>, segs: impl IntoIterator<Item = usize>, stage: Option<&Region>) -> Result<Vec<LayerChecksum>, Refusal> {
        self.add_source_sums(&mut sums, g, p, codec, segs, stage)?;
        Ok(sums.finish())
    }

    /// [`Daemon::source_sums`], added to `sums`.
    fn add_source_sums(&self, sums: &mut Checksums, g: &SourceGroup, p: &Planned, codec: Option<Codec>, segs: impl IntoIterator<Item = usize>, stage: Option<&Region>) -> Result<(), Refusal> {
        let runs = RunReader::new(&g.regions);
        let whole = |i: usize| -> Option<RunBytes<'_>> {
            let stage = stage.filter(|_| codec.is_none())?;
            let st = p.schedule.staged_of(i)?;
            if !gathers(&p.plan.segments.at(i), codec) {
                return None;
            }
            region_view(stage, st.offset, st.size).map(RunBytes::Mapped)
        };
        self.sums_of(sums, g, codec, segs, |rank, region, offset, len| runs.read(rank, region, offset, len), whole)
    }

    /// Packs the staged segments among `segs` (whole layers, in plan order;
    /// `bytes` in all) into `stage` and, when this daemon hashes, hashes
    /// all of `segs`, piece by piece: each piece right after it is packed,
    /// while it is in the CPU's cache. Several MiB go in parts side by
    /// side, whole checksum chunks each, each part holding the work for as
    /// long as the longest. Returns the checksums (none with checksums
    /// off); the pack and verify hops get their own times.
    #[allow(clippy::too_many_arguments)] // the transfer's parts
    fn pack_hashed(&self, id: SlotId, g: &SourceGroup, p: &Planned, codec: Option<Codec>, stage: Option<&Region>, segs: Vec<usize>, bytes: u64) -> Result<Vec<LayerChecksum>, Refusal> {
        let parts = in_parts(&p.plan, segs, bytes, |part| {
            self.pack_hashed_timed(g, p, codec, stage, part.iter().copied(), part.sums(&p.plan, Reading::Source))
        })?;
        let (mut sums, mut t) = (Vec::new(), PackTimes::default());
        for (s, pt) in parts {
            sums.extend(s);
            t = t.beside(&pt);
        }
        // In list order, as the manifest carries them.
        sums.sort_unstable_by_key(LayerChecksum::key);
        if t.packed > 0 {
            self.slot_hop(id, Hop::Pack, t.packing, t.packed);
        }
        if self.cfg.verify_checksums {
            self.slot_hop(id, Hop::Verify, t.hashing, t.hashed);
        }
        Ok(sums)
    }

    /// One part of [`Daemon::pack_hashed`], into `sums` (the part's,
    /// [`Part::sums`]), its times returned rather than recorded.
    #[allow(clippy::too_many_arguments)] // the transfer's parts
    fn pack_hashed_timed(&self, g: &SourceGroup, p: &Planned, codec: Option<Codec>, stage: Option<&Region>, segs: impl IntoIterator<Item = usize>, mut sums: Checksums) -> Result<(Vec<LayerChecksum>, PackTimes), Refusal> {
        let hashes = self.cfg.verify_checksums;
        let mut t = PackTimes::default();
        for (piece, bytes) in pieces(&p.plan, segs) {
            if let Some(stage) = stage {
                let started = Instant::now();
                t.packed += self.pack_into(stage, g, p, codec, piece.iter().filter_map(|&i| p.schedule.staged_of(i)))?;
                t.packing += started.elapsed();
            }
            if hashes {
                let started = Instant::now();
                self.add_source_sums(&mut sums, g, p, codec, piece.iter().copied(), stage)?;
                t.hashing += started.elapsed();
                t.hashed += bytes;
            }
        }
        Ok((sums.finish(), t))
    }

    /// Checksums of segments `segs` as the destination will hold them: the
    /// source bytes `raw` reads run by run (with a codec, converted and
    /// back, as they will land), or `whole`, a segment's bytes in one piece.
    fn sums_of<'a>(
        &self,
        sums: &mut Checksums,
        g: &SourceGroup,
        codec: Option<Codec>,
        segs: impl IntoIterator<Item = usize>,
        mut raw: impl FnMut(u32, RegionId, u64, u64) -> Option<RunBytes<'a>>,
        whole: impl FnMut(usize) -> Option<RunBytes<'a>>,
    ) -> Result<(), Refusal> {
        let elem = codec.and_then(|c| c.element_bytes(&g.format).ok()).unwrap_or(0);
        let dim_of = |region: RegionId| {
            g.model.layers[region.layer as usize].tensors().iter().find(|t| t.tensor == region.tensor).map_or(0, |t| t.dim) as usize
        };
        let read = |rank: u32, region: RegionId, offset: u64, len: u64| -> Option<RunBytes<'a>> {
            let raw = raw(rank, region, offset, len)?;
            match codec {
                Some(_) => {
                    let dim = dim_of(region);
                    let coded = kvwire_core::codec::encode_rows(raw.as_ref(), elem, dim);
                    Some(RunBytes::Owned(kvwire_core::codec::decode_rows(&coded, elem, dim)))
                }
                None => Some(raw),
            }
        };
        sums.add(segs, read, whole).map_err(|e| Refusal::new(Code::BadRequest, format!("manifest: {e}")))
    }

    /// Layer `layer`, in host memory now: its staged segments packed, and
    /// its checksums out (before any of its bytes).
    #[allow(clippy::too_many_arguments)] // the transfer's parts, each used once
    fn host_layer(&self, id: SlotId, g: &SourceGroup, p: &Planned, codec: Option<Codec>, layer: usize, stage: Option<&Region>, link: &PeerLink) -> Result<(), Refusal> {
        let ls = &p.schedule.layers[layer];
        let packs = ls.staged.iter().any(|st| gathers(&p.plan.segments.at(st.seg), codec));
        // Hashed as it is packed, piece by piece (an empty list with checksums off).
        let sums = self.pack_hashed(id, g, p, codec, stage.filter(|_| packs), ls.segments(), ls.wire_bytes)?;
        link.send_layer_sums(layer as u16, sums)
    }

    /// Hashes layer `layer` (its own segments, in plan order) and sends its
    /// checksums, unanswered, ahead of or beside its writes; with checksums
    /// off, an empty list.
    #[allow(clippy::too_many_arguments)] // the transfer's parts
    fn send_layer_checksums(&self, id: SlotId, g: &SourceGroup, p: &Planned, codec: Option<Codec>, layer: usize, stage: Option<&Region>, link: &PeerLink) -> Result<(), Refusal> {
        self.send_sums(id, p, layer, link, |part| self.source_sums(part.sums(&p.plan, Reading::Source), g, p, codec, part.iter().copied(), stage))
    }

    /// Layer `layer`'s checksums, as `sums` computes them over each part of
    /// its segments (a large layer's checksum chunks side by side, [`in_parts`]),
    /// out unanswered; with checksums off, an empty list.
    fn send_sums(&self, id: SlotId, p: &Planned, layer: usize, link: &PeerLink, sums: impl Fn(&Part) -> Result<Vec<LayerChecksum>, Refusal> + Sync) -> Result<(), Refusal> {
        let sums = if self.cfg.verify_checksums {
            let started = Instant::now();
            let (segs, bytes) = layer_segments(p, layer);
            let mut sums = in_parts(&p.plan, segs, p.schedule.layers[layer].wire_bytes, sums)?.concat();
            sums.sort_unstable_by_key(LayerChecksum::key);
            self.slot_hop(id, Hop::Verify, started.elapsed(), bytes);
            sums
        } else {
            Vec::new()
        };
        link.send_layer_sums(layer as u16, sums)
    }

    /// [`Daemon::pack`], hashing every segment as it goes ([`Daemon::pack_hashed`]).
    fn pack_and_hash(&self, id: SlotId, g: &SourceGroup, p: &Planned, codec: Option<Codec>) -> Result<(Option<Arc<Region>>, Vec<LayerChecksum>), Refusal> {
        let stage = self.stage_buffer(id, stage_needed(p, codec))?;
        let all = (0..p.plan.segments.len()).collect();
        match self.pack_hashed(id, g, p, codec, stage.as_deref(), all, p.plan.counters.total_bytes_moved) {
            Ok(sums) => Ok((stage, sums)),
            Err(r) => {
                self.drop_stage(stage);
                Err(r)
            }
        }
    }

    /// Packs (and encodes) the staged segments into one registered buffer.
    fn pack(&self, id: SlotId, g: &SourceGroup, p: &Planned, codec: Option<Codec>) -> Result<Option<Arc<Region>>, Refusal> {
        let started = Instant::now();
        let Some(stage) = self.stage_buffer(id, stage_needed(p, codec))? else { return Ok(None) };
        match self.pack_into(&stage, g, p, codec, p.schedule.staged.iter()) {
            Ok(bytes) => {
                self.slot_hop(id, Hop::Pack, started.elapsed(), bytes);
                Ok(Some(stage))
            }
            Err(r) => {
                self.drop_stage(Some(stage));
                Err(r)
            }
        }
    }

    /// A registered staging buffer of `total` bytes from the pool (none
    /// when nothing is staged).
    fn stage_buffer(&self, id: SlotId, total: u64) -> Result<Option<Arc<Region>>, Refusal> {
        if total == 0 {
            return Ok(None);
        }
        let mut peer = String::new();
        self.with_slot(id, |s| peer = s.peer.clone());
        let register = |mem: Arc<kvwire_transport::HostMem>| {
            let len = mem.len();
            self.register_region(mem, 0, len, None).map_err(|e| e.to_string())
        };
        let stage = self.stage_pool.take_source(&peer, total, register).map_err(|e| Refusal::new(Code::TransferFailed, format!("pack: {e}")))?;
        self.with_slot(id, |s| s.staging = total);
        Ok(Some(stage))
    }

    /// Packs (and encodes) the segments of `staged` that need it
    /// ([`gathers`]) into the staging buffer; returns the bytes written.
    fn pack_into(&self, stage: &Region, g: &SourceGroup, p: &Planned, codec: Option<Codec>, staged: impl Iterator<Item = Staged>) -> Result<u64, Refusal> {
        let failed = |e: &dyn std::fmt::Display| Refusal::new(Code::TransferFailed, format!("pack: {e}"));
        let mut total = 0;
        for st in staged {
            let seg = &p.plan.segments.at(st.seg);
            if !gathers(seg, codec) {
                continue;
            }
            let r = g.regions.get(&(seg.src_rank, seg.src_region)).ok_or_else(|| failed(&"source region missing"))?;
            total += st.size;
            if codec.is_none() {
                // Runs go straight from the cache into staging, back to back
                // there: one copy for all where they are back to back in the
                // cache too.
                r.mem.copy_runs_to(r.offset + seg.src_offset, seg.src_stride, &stage.mem, stage.offset + st.offset, seg.len, seg.len, seg.count).map_err(|e| failed(&e))?;
                continue;
            }
            let bytes = schedule::pack(seg, &st, &g.format, codec, |o, l| read_mem(&r.mem, r.offset + o, l)).ok_or_else(|| failed(&"cannot read a packed source run"))?;
            stage.mem.write(stage.offset + st.offset, &bytes).map_err(|e| failed(&e))?;
        }
        Ok(total)
    }

    /// Post: records the transfer's size and starts the transfer thread,
    /// which runs `mover` (striping the batches over the rails) and ends
    /// the transfer (`source_released`, then the destination's verdict) or
    /// fails it (`Abort`). With `final_answer` nothing after this can fail
    /// the submit, and the transfer thread may answer it first
    /// ([`super::control::answer_early`]).
    #[allow(clippy::too_many_arguments)] // what the transfer thread takes over
    fn post(
        self: &Arc<Self>,
        id: SlotId,
        stop: Arc<AtomicBool>,
        s: Submit,
        size: Size,
        codec: Option<Codec>,
        peer_slot: u16,
        src_stage: Option<Arc<Region>>,
        link: Arc<PeerLink>,
        final_answer: bool,
        mover: impl FnOnce(&Arc<Daemon>, &Arc<AtomicBool>, &Arc<PeerLink>) -> (Outcome, Result<(), String>) + Send + 'static,
    ) -> Result<Reply, Refusal> {
        let c = &size.counters;
        // What crossed the link is counted as the transfer ends.
        self.with_slot(id, |sl| sl.sized(size.layers, c, size.compressed));
        Metrics::add(&self.metrics.reused_bytes, c.reused_bytes);
        let (payload, stage_total) = (c.total_bytes_moved, size.stage_bytes);
        let reply = Reply::Submitted { slot: id.slot, peer_slot, bytes: c.total_bytes_moved, segments: c.segments };
        let d = self.clone();
        let thread_link = link.clone();
        let (peer_name, peer_addr) = (link.peer.clone(), link.addr.clone());
        let (pd, panic_link) = (self.clone(), link.clone());
        let on_panic = move |why: String| {
            let why = format!("internal error: the transfer thread panicked: {why}");
            tracing::error!(slot = id.slot, why, "transfer failed");
            let _ = panic_link.abort(&why);
            pd.fail(id, why);
        };
        let answer = final_answer.then(|| super::control::answer_early(&reply)).flatten();
        let thread_answer = answer.clone();
        let job = move || {
            if let Some(a) = thread_answer {
                a.send();
            }
            let span = tracing::info_span!("transfer", slot = id.slot, request = s.request, peer = thread_link.peer);
            let _g = span.enter();
            let (outcome, result) = mover(&d, &stop, &thread_link);
            d.drop_stage(src_stage);
            // What the connections say they carried, not a guess at their
            // framing, and the control frames both ways; a failed transfer
            // too, as far as it got. Counted before the transfer's end is
            // published, so its status is final when a waiter wakes.
            let count = |d: &Daemon| d.count_wire(id, outcome.bytes + outcome.framing + thread_link.control_bytes());
            match result {
                Ok(()) => {
                    let (bytes, writes) = (outcome.bytes, outcome.writes);
                    Metrics::add(&d.metrics.payload_bytes, payload);
                    if codec.is_some() {
                        Metrics::add(&d.metrics.compressed_bytes, stage_total);
                    }
                    // The source's memory is free now; the transfer is done
                    // only once the destination says it landed.
                    // The next transfer to this peer (an engine submits as
                    // soon as it sees source_released) waits for this
                    // connection rather than making a new one mid-verdict.
                    let key = (peer_name, peer_addr);
                    d.peer_conns.expect(&key);
                    d.release_source(id);
                    tracing::info!(bytes, writes, "source released");
                    let verdict = thread_link.done();
                    count(&d);
                    match verdict {
                        Ok(conn) => {
                            // The source's own decoder_usable: the destination's
                            // verdict, published as the transfer ends here.
                            d.complete(id, DECODER_USABLE, Boundary::DecoderUsable);
                            match conn {
                                Some(conn) => d.peer_conns.keep(key, conn, || d.keeping()),
                                None => d.peer_conns.lost(&key),
                            }
                        }
                        Err(why) => {
                            d.peer_conns.lost(&key);
                            tracing::warn!(why, "transfer failed after the source was released");
                            d.fail(id, why);
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "transfer failed");
                    let e = match thread_link.abort(&e) {
                        Some(theirs) => format!("the destination failed the transfer: {theirs} (here: {e})"),
                        None => e,
                    };
                    count(&d);
                    d.fail(id, e);
                }
            }
        };
        // A small transfer (answered only once its manifest is out) runs
        // on the thread that took its submit, after the answer: no thread
        // is woken before its writes leave.
        let spawned = match final_answer {
            false => super::control::run_after_answer(super::workers::guarded(job, on_panic)).or_else(|job| self.workers.spawn("kvwired-xfer", job, |_| {})),
            true => self.workers.spawn("kvwired-xfer", job, on_panic),
        };
        if let Err(e) = spawned {
            if let Some(a) = answer {
                a.withdraw();
            }
            return Err(Refusal::new(Code::TransferFailed, format!("cannot start the transfer thread: {e}")));
        }
        // The heartbeat keeps the destination told that this side is alive
        // while bytes flow, and learns at once when it is not: a check on
        // the ticker, which wakes no thread of this transfer's own.
        let (beat, d) = (link.clone(), self.clone());
        self.ticker.add(Box::new(move || {
            beat.heartbeat(&|ping| d.workers.spawn("kvwired-ping", ping, |why| tracing::error!(why, "a ping panicked")))
        }));
        Ok(reply)
    }

    /// Where peer `name` listens: the static `[[peers]]` list, then etcd
    /// (one lookup, at most `discovery::CALL_TIMEOUT`).
    fn resolve_peer(&self, name: &str) -> Result<PeerConfig, Refusal> {
        if let Some(p) = self.cfg.peers.iter().find(|p| p.name == name) {
            return Ok(p.clone());
        }
        let Some(disc) = self.discovery.get() else {
            return Err(Refusal::new(Code::UnknownPeer, format!("peer `{name}` is not configured")));
        };
        let (etcd, ours) = (disc.endpoints(), self.ep.transport());
        match disc.lookup(name) {
            Ok(Some(e)) if e.version != peer::PEER_VERSION => Err(Refusal::new(
                Code::PeerRefused,
                format!("peer `{name}` (etcd at {etcd}) speaks peer protocol v{}, this daemon v{}", e.version, peer::PEER_VERSION),
            )),
            Ok(Some(e)) if e.transport.parse() != Ok(ours) => {
                Err(Refusal::new(Code::PeerRefused, format!("peer `{name}` (etcd at {etcd}) speaks `{}`, this daemon `{ours}`", e.transport)))
            }
            Ok(Some(e)) => Ok(PeerConfig { name: e.name, address: e.peer }),
            Ok(None) => Err(Refusal::new(Code::UnknownPeer, format!("peer `{name}` is not configured and not registered in etcd at {etcd}"))),
            Err(e) => Err(Refusal::new(Code::UnknownPeer, format!("peer `{name}` is not configured, and etcd cannot say where it is: {e}"))),
        }
    }
}

impl PeerLink {
    /// The manifest out, answered by nothing: the writes follow at once.
    /// The session first checks the destination's staging size against
    /// the schedule.
    fn send_expect(&self, e: Expect, stage_bytes: u64) -> Result<(), Refusal> {
        let m = self.session(|s| s.expect(Instant::now(), e, stage_bytes)).map_err(|e| Refusal::new(Code::PeerRefused, format!("peer `{}`: {e}", self.peer)))?;
        self.send(&m).map_err(|e| negotiation_failed(&self.peer, e, "refused the transfer"))
    }

    /// A streamed layer's checksums out, answered by nothing: its writes follow.
    fn send_layer_sums(&self, layer: u16, sums: Vec<LayerChecksum>) -> Result<(), Refusal> {
        let m = self.session(|s| s.layer_sums(layer, sums)).map_err(|e| Refusal::new(Code::TransferFailed, format!("peer `{}`: {e}", self.peer)))?;
        self.send(&m).map_err(|e| negotiation_failed(&self.peer, e, "refused the transfer"))
    }
}

/// Where the manifest's checksums come from.
enum Sums<'a> {
    /// Per layer, after the manifest (streamed, or hashed beside the wire).
    Follow,
    /// Hashed when the manifest is made; packed segments read in this stage.
    Now(Option<&'a Region>),
    /// Hashed already, as they were packed.
    Ready(Vec<LayerChecksum>),
}

/// The destination's rails (a peer of an older build names one: its data
/// address), and which each of its ranks prefers.
fn rails_of(accept: &Accept) -> (Vec<RailAddr>, RailPreference) {
    let rails = if accept.rails.is_empty() { vec![RailAddr { name: "rail0".into(), addr: accept.data_addr.clone() }] } else { accept.rails.clone() };
    (rails, rail_preference(accept))
}

/// A failed exchange as the client sees it: the peer's refusal, a reply
/// the session would not take, or a lost connection.
fn negotiation_failed(peer: &str, e: LinkError, refused_what: &str) -> Refusal {
    match e {
        LinkError::Session(SessionError::Refused(reason)) => Refusal::new(Code::PeerRefused, format!("peer `{peer}` {refused_what}: {reason}")),
        LinkError::Session(e) => Refusal::new(Code::PeerRefused, format!("peer `{peer}`: {e}")),
        LinkError::Wire(w) => Refusal::new(Code::PeerUnreachable, w),
    }
}

/// What a plan against a destination depends on, besides this daemon's
/// transport (see [`super::plans`]).
#[derive(PartialEq, Eq, Hash)]
pub(super) struct SentKey {
    group: u64,
    tokens: u64,
    table: Vec<u32>,
    dst_format: String,
    dst_layout: String,
    dst_blocks: u32,
    dst_table: Vec<u32>,
    prefix: u64,
    codec: Option<Codec>,
}

impl Daemon {
    /// Plans against the destination's layout, and schedules the plan; a
    /// request like an earlier one takes that one's.
    fn plan_against(&self, g: &SourceGroup, s: &Submit, a: &Accept, codec: Option<Codec>) -> Result<Arc<Planned>, Refusal> {
        let key = SentKey {
            group: g.gen,
            tokens: s.tokens,
            table: s.block_table.clone(),
            dst_format: a.format.clone(),
            dst_layout: a.layout.clone(),
            dst_blocks: a.num_blocks,
            dst_table: a.block_table.clone(),
            prefix: a.prefix_tokens,
            codec,
        };
        let transport = self.ep.transport();
        self.sent_plans.get_or_build(key, &self.metrics.plans_reused_sent, |p| p.plan.segments.len() as u64, || {
            let failed = |e: &dyn std::fmt::Display| Refusal::new(Code::BadRequest, format!("planning failed: {e:#}"));
            let dst_format = CacheFormat::parse(&a.format).map_err(|e| failed(&e))?;
            let dst_layout = LayoutSpec::parse(&a.layout).map_err(|e| failed(&e))?;
            let dst = Side::with_table(&g.model, &dst_layout, dst_format, s.tokens, a.block_table.clone(), a.num_blocks).map_err(|e| failed(&e))?;
            let input = PlanInput { model: &g.model, tokens: s.tokens, prefix_tokens: a.prefix_tokens, src: &g.side, dst: &dst, cost: CostModel::for_transport(transport) };
            let plan = plan::build(&input).map_err(|e| failed(&e))?;
            let schedule = Schedule::new(&g.model, &g.format, &plan, codec).map_err(|e| Refusal::new(Code::BadRequest, format!("schedule: {e}")))?;
            Ok(Planned { dst, plan, schedule, ring: Default::default() })
        })
    }
}

/// Layer `layer`'s own segments, from its schedule (not a pass over the
/// whole plan per layer), in plan order, and the bytes they move.
fn layer_segments(p: &Planned, layer: usize) -> (Vec<usize>, u64) {
    let segs = p.schedule.layers[layer].segments();
    let bytes = segs.iter().map(|&i| p.plan.segments.at(i).bytes()).sum();
    (segs, bytes)
}

/// Whether the source gathers staged segment `seg` into its staging buffer
/// before sending it: with a codec (it converts the rows), when its runs
/// are apart at the source, or when it is small. Runs back to back there
/// are one range already, written from the cache into the destination's
/// staging as they are: a pass over the bytes saved (a tp8 -> tp2 remap's
/// source holds each block whole, and only the destination scatters). But
/// such a write cannot join its neighbours (they read other ranks'
/// regions), and each write costs a frame and an answer: below
/// [`IN_PLACE_MIN`] the copy is cheaper than the write it saves.
fn gathers(seg: &Segment, codec: Option<Codec>) -> bool {
    codec.is_some() || !seg.src_contiguous() || seg.bytes() < IN_PLACE_MIN
}

/// The smallest segment written from the cache as it is. Measured over tcp
/// on loopback: a tp8 -> tp2 remap's 64 KiB segments sent one write each
/// took longer on the wire than packing them cost (a write's frame and
/// answer, about 5-8 us, against a 64 KiB copy's 6-8 us); its 512 KiB
/// segments did not. Measured again once such a segment packed as one
/// copy and frames went out gathered: from 16 KiB, tp8 -> tp2 at 256
/// tokens took 13.1-14.0 ms against 12.5-13.0 packed.
const IN_PLACE_MIN: u64 = 128 << 10;

/// From this many bytes a device-resident source's layer goes on the wire
/// from a thread of its own while the next layer is packed and hashed:
/// below it the thread's start costs more than the overlap saves.
const OVERLAP_BYTES: u64 = 256 << 10;

/// Below this payload a submit packs, hashes and sends its manifest before
/// it answers. Measured on loopback: at 64 KiB that is 6% lower latency to
/// `decoder_usable` than leaving it to the transfer thread, while at 1 MiB
/// the transfer thread doing it answered the engine 0.26 ms sooner. Its
/// writes leaving before its manifest instead (the destination takes
/// bytes it does not expect yet) was slower at 64 KiB: 0.137-0.151 ms
/// against 0.122-0.124 (`kvwire-soak --tokens 16`, three pairs).
const SUBMIT_WAITS_BELOW: u64 = 256 << 10;

/// Whether a submit packs its transfer and starts its writes before it
/// answers (a small one from host memory, not streamed): its manifest then
/// goes from the submitting thread, beside the writes.
fn starts_on_submit(g: &SourceGroup, s: &Submit, p: &Planned) -> bool {
    g.devices.is_empty() && !s.stream && p.plan.counters.total_bytes_moved < SUBMIT_WAITS_BELOW
}

/// Bytes of the source's staging buffer: the schedule's staging layout,
/// or none when no staged segment is gathered.
fn stage_needed(p: &Planned, codec: Option<Codec>) -> u64 {
    match p.schedule.staged.iter().any(|st| gathers(&p.plan.segments.at(st.seg), codec)) {
        true => p.schedule.stage_bytes,
        false => 0,
    }
}

/// Per layer, the source ranks it reads: only those must have written it
/// before a streamed transfer moves it.
fn readers_of(plan: &Plan, layers: usize) -> Vec<Vec<u32>> {
    let mut readers: Vec<Vec<u32>> = vec![Vec::new(); layers];
    for seg in &plan.segments {
        let r = &mut readers[seg.dst_region.layer as usize];
        if !r.contains(&seg.src_rank) {
            r.push(seg.src_rank);
        }
    }
    readers
}

/// The destination's key of each of its (rank, region).
fn dst_keys(a: &Accept) -> ByRegion<u32> {
    a.regions.iter().map(|r| ((r.rank, r.region), r.key)).collect()
}

/// Appends `op` to `writes`, as one write with the last when it continues
/// it on both sides: packed segments lie back to back in both staging
/// buffers, so a layer's staged bytes become one write instead of one per
/// segment (each a frame and an answer on tcp, a work request on verbs).
fn push_write(writes: &mut Vec<WriteOp>, op: WriteOp) {
    match writes.last_mut() {
        Some(last)
            if last.stride.is_none()
                && op.stride.is_none()
                && last.src_key == op.src_key
                && last.dst_key == op.dst_key
                && last.src_offset + last.len == op.src_offset
                && last.dst_offset + last.len == op.dst_offset =>
        {
            last.len += op.len
        }
        _ => writes.push(op),
    }
}

/// Layer `layer`'s writes, as two batches: those the NIC reads in place
/// from device memory its source registered (GPUDirect), and those from
/// the layer's slot of `ring`. A direct segment's runs go each into place,
/// a staged one whole into the destination's staging: gathered in the
/// slot, or (back to back at the source) from the device or the footprint.
fn ring_batch(p: &Planned, a: &Accept, dst_keys: &ByRegion<u32>, ring: &Ring, codec: Option<Codec>, layer: usize) -> Result<(Batch, Batch), Refusal> {
    let ls = &p.schedule.layers[layer];
    let missing = |i: usize| Refusal::new(Code::TransferFailed, format!("segment {i} is not in layer {layer}'s ring slot"));
    // Where a segment's source allocation is read in place: its key, and
    // the offset of its region there.
    let in_place = |s: &Segment| ring.layout.regions.get(&(s.src_rank, s.src_region)).and_then(|&(src, base)| Some((ring.sources[src].direct?, base)));
    let (mut device, mut slot) = (Vec::new(), Vec::new());
    for i in ls.direct.iter() {
        let s = &p.plan.segments.at(i);
        let &dst_key = dst_keys.get(&(s.dst_rank, s.dst_region)).ok_or_else(|| Refusal::new(Code::PeerRefused, format!("no region for dst rank {} {:?}", s.dst_rank, s.dst_region)))?;
        let stride = (s.mode == Mode::Strided).then_some(Stride { count: s.count, src: s.src_stride, dst: s.dst_stride });
        // From the slot, one strided write where its runs kept their
        // distance there (they lie in one footprint extent); else a write a
        // run, which the destination counts as exactly.
        let place = in_place(s);
        let in_slot = stride.filter(|_| place.is_none()).and_then(|_| strided_in_slot(ring, layer, s));
        match place {
            Some((src_key, base)) if stride.is_some() => {
                device.push(WriteOp { src_key, src_offset: base + s.src_offset, dst_key, dst_offset: s.dst_offset, len: s.len, stride });
            }
            None if in_slot.is_some() => {
                let src_offset = in_slot.ok_or_else(|| missing(i))?;
                slot.push(WriteOp { src_key: ring.region.key, src_offset, dst_key, dst_offset: s.dst_offset, len: s.len, stride });
            }
            Some((src_key, base)) => {
                for (src_offset, dst_offset) in s.runs() {
                    push_write(&mut device, WriteOp { src_key, src_offset: base + src_offset, dst_key, dst_offset, len: s.len, stride: None });
                }
            }
            None => {
                for (from, (_, dst_offset)) in ring.runs(layer, s).zip(s.runs()) {
                    let src_offset = from.ok_or_else(|| missing(i))?;
                    push_write(&mut slot, WriteOp { src_key: ring.region.key, src_offset, dst_key, dst_offset, len: s.len, stride: None });
                }
            }
        }
    }
    for st in ls.staged.iter() {
        let s = &p.plan.segments.at(st.seg);
        let (writes, src_key, src_offset) = match (gathers(s, codec), in_place(s)) {
            (true, _) => (&mut slot, ring.region.key, ring.packed(layer, st.seg)),
            (false, Some((key, base))) => (&mut device, key, Some(base + s.src_offset)),
            (false, None) => (&mut slot, ring.region.key, ring.find(layer, s.src_rank, s.src_region, s.src_offset, s.bytes())),
        };
        // Landing in place: straight into its destination runs.
        let (dst_key, dst_offset) = match st.placed {
            true => (*dst_keys.get(&(s.dst_rank, s.dst_region)).ok_or_else(|| Refusal::new(Code::PeerRefused, format!("no region for dst rank {} {:?}", s.dst_rank, s.dst_region)))?, s.dst_offset),
            false => (a.stage_key, st.offset),
        };
        push_write(writes, WriteOp { src_key, src_offset: src_offset.ok_or_else(|| missing(st.seg))?, dst_key, dst_offset, len: st.size, stride: None });
    }
    let tag = Tag { slot: a.slot, layer: layer as u16 };
    Ok((Batch { tag, writes: device }, Batch { tag, writes: slot }))
}

/// Where strided segment `s`'s first run lies in layer `layer`'s slot of
/// `ring`, when all its runs lie there at their source distance.
fn strided_in_slot(ring: &Ring, layer: usize, s: &Segment) -> Option<u64> {
    let mut at = ring.runs(layer, s);
    let first = at.next()??;
    let mut next = first;
    for run in at {
        next += s.src_stride;
        if run? != next {
            return None;
        }
    }
    Some(first)
}

/// The schedule's writes per layer, with both sides' keys.
fn batches(g: &SourceGroup, p: &Planned, a: &Accept, codec: Option<Codec>, src_stage: Option<&Arc<Region>>) -> Result<Vec<Batch>, Refusal> {
    let dst_keys = dst_keys(a);
    let missing = |src: (u32, RegionId), dst: (u32, RegionId)| {
        Refusal::new(Code::PeerRefused, format!("no region for src rank {} / dst rank {} {:?}", src.0, dst.0, dst.1))
    };
    // A staged segment's write to (key, offset): from staging where it was
    // gathered, else from the cache, where its runs lie back to back.
    let staged_write = |seg: usize, offset: u64, len: u64, (dst_key, dst_offset): (u32, u64)| -> Result<WriteOp, Refusal> {
        let s = &p.plan.segments.at(seg);
        if gathers(s, codec) {
            let stage = src_stage.ok_or_else(|| Refusal::new(Code::TransferFailed, "staged writes without a staging buffer"))?;
            return Ok(WriteOp { src_key: stage.key, src_offset: offset, dst_key, dst_offset, len, stride: None });
        }
        let sr = g.regions.get(&(s.src_rank, s.src_region)).ok_or_else(|| missing((s.src_rank, s.src_region), (s.dst_rank, s.dst_region)))?;
        Ok(WriteOp { src_key: sr.key, src_offset: s.src_offset, dst_key, dst_offset, len, stride: None })
    };
    let mut out = Vec::with_capacity(p.schedule.layers.len());
    for layer in 0..p.schedule.layers.len() {
        let mut writes: Vec<WriteOp> = Vec::new();
        for w in p.schedule.writes(&p.plan, layer) {
            let op = match w {
                WriteTarget::Direct { src, src_offset, dst, dst_offset, len } => {
                    let (Some(sr), Some(&dk)) = (g.regions.get(&src), dst_keys.get(&dst)) else { return Err(missing(src, dst)) };
                    WriteOp { src_key: sr.key, src_offset, dst_key: dk, dst_offset, len, stride: None }
                }
                WriteTarget::Strided { src, src_offset, dst, dst_offset, len, count, src_stride, dst_stride } => {
                    let (Some(sr), Some(&dk)) = (g.regions.get(&src), dst_keys.get(&dst)) else { return Err(missing(src, dst)) };
                    WriteOp { src_key: sr.key, src_offset, dst_key: dk, dst_offset, len, stride: Some(Stride { count, src: src_stride, dst: dst_stride }) }
                }
                WriteTarget::Staged { seg, offset, len } => staged_write(seg, offset, len, (a.stage_key, offset))?,
                WriteTarget::Placed { seg, offset, dst, dst_offset, len } => {
                    let &dk = dst_keys.get(&dst).ok_or_else(|| missing((dst.0, dst.1), dst))?;
                    staged_write(seg, offset, len, (dk, dst_offset))?
                }
            };
            push_write(&mut writes, op);
        }
        out.push(Batch { tag: Tag { slot: a.slot, layer: layer as u16 }, writes });
    }
    Ok(out)
}

/// Which rails each destination rank prefers, as a bit per rail (the
/// session checked there are at most 64, all named), and the rank of each
/// destination key.
fn rail_preference(a: &Accept) -> RailPreference {
    let prefer = a
        .locality
        .iter()
        .map(|p| (p.rank, a.rails.iter().enumerate().filter(|(_, r)| p.rails.contains(&r.name)).fold(0u64, |m, (i, _)| m | 1 << i)))
        .collect();
    let key_rank = a.regions.iter().map(|r| (r.key, r.rank)).collect();
    (prefer, key_rank)
}
