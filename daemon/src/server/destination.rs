//! The destination side: authenticated peer connections, each the pump of
//! a [`DestinationSession`]; offers into prepared requests, planned here
//! from both sides' layouts before they are accepted; and each transfer's
//! landing set up ([`super::landing`]): the manifest checked, then each
//! layer unpacked, verified and published.

use super::announce::mismatch;
use super::device::Copies;
use super::error::Refusal;
use super::landing::{Landing, LAND_ON_ARRIVAL_MAX};
use super::state::{running, DeviceMems, Role, SlotId};
use super::{ByRegion, in_parts, pieces, read_mem, region_view, Daemon, Part, RunReader};
use crate::metrics::Metrics;
use crate::peer::{self, Outbox, Sealed};
use kvwire_client::control::*;
use kvwire_client::wire::{write_msg, WireError};
use kvwire_core::codec::Codec;
use kvwire_core::layout::ModelSpec;
use kvwire_core::manifest::{Checksums, Expected, LayerChecksum, Manifest, ManifestError, Reading};
use std::sync::mpsc::{self, Sender};
use kvwire_core::plan::{self, CostModel, Plan, PlanInput, Segment, Side};
use kvwire_core::protocol::TransportKind;
use kvwire_core::schedule::{self, Schedule, Staged};
use kvwire_core::session::msg::{Accept, Expect, LayerSums, Offer, PeerMsg};
use kvwire_core::session::{DestinationSession, DestinationStep, Timeouts};
use kvwire_core::shard::{LayoutSpec, RegionId};
use kvwire_core::CacheFormat;
use kvwire_transport::auth::{ConnectionCaps, Deadline, Gate, Pass};
use kvwire_transport::mem::Streaming;
use kvwire_transport::{Grant, Hop, Region, Tag};
use kvwire_transport::idle::IdleSpin;
use std::collections::HashMap;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A transfer's verdict from how it ended: None when it landed, else why not.
pub(super) fn verdict_of(state: TransferState, error: Option<String>) -> Option<String> {
    match state {
        TransferState::Done => None,
        other => Some(error.unwrap_or_else(|| format!("{other:?}").to_lowercase())),
    }
}

/// A peer connection's transfers: those running, by slot, and those whose
/// verdict went, which a ping or an abort that crossed the verdict still
/// counts toward (the source counts what it sent and read until then).
#[derive(Default)]
struct Transfers {
    mine: HashMap<u16, Mine>,
    // Those whose verdict went, by slot, and the last of them.
    past: HashMap<u16, SlotId>,
    last: Option<SlotId>,
}

impl Transfers {
    /// Notes the verdicts `verdicts` sent since the last look: their slots
    /// are no longer the connection's. Returns the session.
    fn judged<'a>(&mut self, verdicts: &Verdicts, session: &'a mut DestinationSession) -> &'a mut DestinationSession {
        for (id, error) in verdicts.sent() {
            session.judged(id.slot, error);
            if self.mine.get(&id.slot).is_some_and(|m| m.id == id) {
                self.mine.remove(&id.slot);
            }
            self.past.insert(id.slot, id);
            self.last = Some(id);
        }
        session
    }

    /// The transfer a message counts toward, before it is handled: the one
    /// it names, a ping's the connection's one transfer; an abort or a ping
    /// that crossed its transfer's verdict, that transfer's. An offer names
    /// none, even beside a running transfer: it counts toward the slot it
    /// enters, once accepted.
    fn named(&self, m: &PeerMsg) -> Option<SlotId> {
        match (m, m.slot()) {
            (PeerMsg::Offer(_), _) => None,
            (PeerMsg::Abort { .. }, Some(slot)) => self.mine.get(&slot).map(|m| m.id).or_else(|| self.past.get(&slot).copied()),
            (_, Some(slot)) => self.mine.get(&slot).map(|m| m.id),
            (_, None) if self.mine.len() == 1 => self.mine.values().next().map(|m| m.id),
            (PeerMsg::Ping, None) if self.mine.is_empty() => self.last,
            _ => None,
        }
    }
}

/// How long a peer may take over its whole handshake.
const PEER_HANDSHAKE: Duration = Duration::from_secs(10);

/// Anyone may connect to the peer port at will: refusals there are logged
/// within a budget ([`kvwire_transport::logbudget`]), and all counted.
static REFUSED_PEERS: kvwire_transport::logbudget::LogBudget = kvwire_transport::logbudget::LogBudget::new();

/// A transfer accepted on a peer connection: its slot, and where its
/// manifest and per-layer checksums go.
pub(super) struct Mine {
    pub id: SlotId,
    pub to: Lands,
}

/// The verdicts of one peer connection's transfers. Whichever thread
/// ends a transfer pushes its verdict on the connection ([`Verdicts::push`])
/// as it publishes the transfer's end: the source asks for nothing, and
/// the connection's own thread is not woken for it. That thread learns of
/// the verdicts sent at its next message ([`Verdicts::sent`]).
pub(super) struct Verdicts {
    outbox: Outbox,
    // No transfer of this connection runs: announcements may go on it.
    idle: Arc<AtomicBool>,
    // Adds a verdict's frame bytes to its transfer's count, before it goes.
    count: Box<dyn Fn(SlotId, u64) + Send + Sync>,
    inner: Mutex<VerdictState>,
}

#[derive(Default)]
struct VerdictState {
    live: HashMap<u16, Live>,
    sent: Vec<(SlotId, Option<String>)>,
}

/// Where a transfer of the connection stands, for its verdict.
enum Live {
    /// Taken on, and its accept not sent yet: a verdict waits for it.
    Entering,
    /// Its verdict goes as soon as it ends.
    Open,
    /// It ended before its accept went: its verdict goes right after.
    Owed(SlotId, Option<String>),
}

impl Verdicts {
    pub fn new(outbox: Outbox, idle: Arc<AtomicBool>, count: impl Fn(SlotId, u64) + Send + Sync + 'static) -> Verdicts {
        Verdicts { outbox, idle, count: Box::new(count), inner: Mutex::new(VerdictState::default()) }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, VerdictState> {
        self.inner.lock().expect("verdicts lock")
    }

    /// Slot `slot` is this connection's from now on (its accept, if it
    /// has one, is about to go).
    fn enter(&self, slot: u16) {
        self.state().live.insert(slot, Live::Entering);
        self.idle.store(false, Ordering::Release);
    }

    /// What the connection sent after taking slots on has gone: their
    /// verdicts may go now, and those owed already go at once.
    fn open(&self) {
        let owed: Vec<(SlotId, Option<String>)> = {
            let mut st = self.state();
            let mut owed = Vec::new();
            for live in st.live.values_mut() {
                match std::mem::replace(live, Live::Open) {
                    Live::Owed(id, error) => owed.push((id, error)),
                    Live::Entering | Live::Open => {}
                }
            }
            owed
        };
        for (id, error) in owed {
            self.push(id, error);
        }
    }

    /// The source aborted `slot`: it is no longer this connection's.
    fn leave(&self, slot: u16) {
        let mut st = self.state();
        st.live.remove(&slot);
        self.idle.store(st.live.is_empty(), Ordering::Release);
    }

    /// The connection ended: no verdict goes on it any more.
    fn close(&self) {
        self.state().live.clear();
    }

    /// The verdicts sent since the last call, for the connection's thread.
    fn sent(&self) -> Vec<(SlotId, Option<String>)> {
        std::mem::take(&mut self.state().sent)
    }

    /// Transfer `id` of this connection ended here: landed (`error` None)
    /// or failed. Its verdict goes now, counted toward it before it is
    /// sent; or right after its accept, when that has not gone yet.
    /// Nothing goes for a slot the connection no longer runs. The caller
    /// holds no lock of the daemon's.
    pub fn push(&self, id: SlotId, error: Option<String>) {
        {
            let mut st = self.state();
            match st.live.get_mut(&id.slot) {
                Some(live @ Live::Entering) => {
                    *live = Live::Owed(id, error);
                    return;
                }
                Some(Live::Open) => {}
                Some(Live::Owed(..)) | None => return,
            }
            st.live.remove(&id.slot);
            // Noted before it goes: the source's next message may react to
            // it, and the connection's thread must know first.
            st.sent.push((id, error.clone()));
            // Idle before the verdict goes: a source that has it may
            // prepare its next request at once.
            self.idle.store(st.live.is_empty(), Ordering::Release);
        }
        if let Err(e) = self.outbox.send_counted(&DestinationSession::verdict(id.slot, error), |len| (self.count)(id, len)) {
            // The connection's thread sees it broken and ends it.
            tracing::debug!(slot = id.slot, error = %e, "the verdict could not be sent");
        }
    }
}

/// Who lands a transfer ([`super::landing`]).
pub(super) enum Lands {
    /// Its receive thread, through this channel.
    Thread(Sender<Inbound>),
    /// Its events, on the threads that bring them.
    OnArrival(Arc<Mutex<Landing>>),
}

impl Daemon {
    /// Hands the source's message `m` to whoever lands its transfer.
    fn deliver(&self, to: &Lands, m: Inbound) {
        match to {
            Lands::Thread(tx) => {
                let _ = tx.send(m);
            }
            Lands::OnArrival(l) => self.landing_inbound(l, m),
        }
    }
}

/// What the peer connection hands a transfer's receive thread.
pub(super) enum Inbound {
    Expect(Box<Expect>),
    Sums(Box<LayerSums>),
}

/// The source's side of the plan, from its offer: layout, blocks per
/// region, block table, codec.
type SourceSide = (String, u32, Vec<u32>, Option<String>);

/// What a receive's plan depends on (see [`super::plans`]).
#[derive(PartialEq, Eq, Hash)]
pub(super) struct ReceivedKey {
    group: u64,
    tokens: u64,
    prefix: u64,
    table: Vec<u32>,
    src_layout: String,
    src_blocks: u32,
    src_table: Vec<u32>,
    codec: Option<Codec>,
}

/// The destination's plan from both sides' layouts, and its schedule.
pub(super) struct Replanned {
    dst: Side,
    plan: Plan,
    pub schedule: Schedule,
}

/// What landing one transfer works from.
pub(super) struct Receive {
    pub id: SlotId,
    request: String,
    model: ModelSpec,
    format: CacheFormat,
    codec: Option<Codec>,
    // The plan and schedule, perhaps an earlier request's like this one.
    pub p: Arc<Replanned>,
    // What the manifest must claim: this side's identity, shapes, maps and positions.
    expected: Expected,
    regions: ByRegion<Arc<Region>>,
    devices: DeviceMems,
    pub stage: Option<Arc<Region>>,
}

impl Daemon {
    pub(super) fn peer_loop(self: Arc<Self>, l: TcpListener) {
        let gate = Gate::new(ConnectionCaps::default());
        for s in l.incoming() {
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            let Ok(s) = s else { continue };
            let pass = match gate.enter() {
                Ok(p) => p,
                Err(why) => {
                    Metrics::add(&self.metrics.peers_refused, 1);
                    tracing::debug!(from = ?s.peer_addr().ok(), why, "peer connection refused");
                    continue;
                }
            };
            let d = self.clone();
            let _ = std::thread::Builder::new().name("kvwired-peer".into()).spawn(move || d.serve_peer(s, pass));
        }
    }

    fn serve_peer(self: &Arc<Self>, mut s: TcpStream, mut pass: Pass) {
        let from = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        // One deadline for the whole handshake, however slowly its bytes come.
        let authed = peer::accept_auth(&mut Deadline::new(&s, PEER_HANDSHAKE), &self.secret, &self.cfg.node).and_then(|(peer, cred)| {
            let grantee = self.ep.registry().open_session(&cred, &peer).map_err(|e| peer::AuthError::Denied(e.to_string()))?;
            Ok((peer, cred, grantee))
        });
        // `grantee`: what this node's grants name here. Every connection of
        // the node has it, so a transfer negotiated or announced on one may
        // write over another's data connections.
        let (peer, cred, grantee) = match authed {
            Ok(p) => p,
            Err(e) => {
                Metrics::add(&self.metrics.peers_refused, 1);
                if let Some(held_back) = REFUSED_PEERS.admit() {
                    tracing::warn!(from, error = %e, held_back, "peer refused");
                }
                let _ = write_msg(&mut s, &PeerMsg::Refused { reason: "authentication failed: wrong shared secret or protocol".into() });
                return;
            }
        };
        pass.authenticated();
        let _ = s.set_nodelay(true);
        let _ = s.set_write_timeout(Some(Duration::from_secs(self.cfg.limits.peer_timeout_secs)));
        let session_id = cred.session;
        let mut s = Sealed::new(s, cred, false);
        // Announcements to this peer may go on this connection while it is idle.
        let idle = self.outboxes.open(&peer, session_id, grantee, s.outbox());
        // Weak: a running slot holds its connection's verdicts.
        let d = Arc::downgrade(self);
        let count = move |id: SlotId, len: u64| {
            if let Some(d) = d.upgrade() {
                d.with_slot(id, |sl| sl.wire += len);
            }
        };
        let verdicts = Arc::new(Verdicts::new(s.outbox(), idle, count));
        let l = &self.cfg.limits;
        let transfer = Duration::from_secs(l.transfer_timeout_secs);
        let timeouts = Timeouts { reply: transfer, peer: Duration::from_secs(l.peer_timeout_secs), transfer };
        let mut session = DestinationSession::new(Instant::now(), &peer, timeouts);
        // Transfers accepted on this connection, by slot: its messages may
        // name only these, and those still running when it ends fail then.
        let mut t = Transfers::default();
        let mut spin = IdleSpin::new(self.cfg.idle_poll());
        let ended = loop {
            t.judged(&verdicts, &mut session);
            // The socket's timeout changes only when it must be shorter, or
            // when it is far too short: not at every message, whose
            // deadline moved a little (a read that ends early is tried
            // again). Rounded down to a power of two of milliseconds, so
            // that a deadline that nears shortens it a few times, not at
            // every read.
            let wait = coarse(session.poll_timeout().saturating_duration_since(Instant::now()));
            let set = s.read_timeout_set().unwrap_or(Duration::ZERO);
            if wait < set || wait > set * 8 {
                let _ = s.read_timeout(wait);
            }
            let before = s.frames_read();
            let msg = match s.recv_polling(&mut spin) {
                Ok(m) => m,
                Err(WireError::Closed) => break format!("peer `{peer}` went away mid-transfer"),
                Err(e) if e.is_timeout() => match t.judged(&verdicts, &mut session).handle_timeout(Instant::now()) {
                    Some(e) => break format!("peer `{peer}` {e}"),
                    None => continue,
                },
                Err(e) => break format!("peer `{peer}` connection failed mid-transfer: {e}"),
            };
            // What the source sends may answer a verdict sent meanwhile.
            t.judged(&verdicts, &mut session);
            // A message counts toward its transfer ([`Transfers::named`]),
            // before it is handed on: the transfer may end, and its verdict
            // go, before this thread runs again. An offer or a claim counts
            // toward the slot it enters. An answer too, sealed once and
            // counted before it is sent.
            let read = s.frames_read() - before;
            let msg_slot = msg.slot();
            let named = t.named(&msg);
            if let Some(id) = named {
                self.with_slot(id, |sl| sl.wire += read);
            }
            let reply = self.peer_step(&peer, session_id, grantee, &mut session, &mut t.mine, &verdicts, msg);
            // A claim's slot is this connection's only once honoured.
            let entered = named.is_none().then(|| reply.as_ref().and_then(PeerMsg::slot).or(msg_slot).and_then(|slot| t.mine.get(&slot)).map(|m| m.id)).flatten();
            let count = |len: u64| match (named, entered) {
                (Some(id), _) => self.with_slot(id, |sl| sl.wire += len),
                (None, Some(id)) => self.with_slot(id, |sl| sl.wire += read + len),
                (None, None) => {}
            };
            let sent = match reply {
                Some(reply) => s.send_counted(&reply, count),
                None => {
                    count(0);
                    Ok(())
                }
            };
            if let Err(e) = sent {
                break format!("peer `{peer}` connection failed mid-transfer: {e}");
            }
            // A slot taken on has its accept out: its verdict may follow.
            verdicts.open();
        };
        // No new data connection can prove this session now; its transfers'
        // regions are revoked as each ends. What was announced to the node
        // stays claimable on its other connections; once its last is gone,
        // it waits for an offer.
        self.outboxes.close(&peer, session_id);
        verdicts.close();
        if let Some(gone) = self.ep.registry().close_session(session_id) {
            self.unannounce_node(gone);
        }
        // A source that ends its connection before its verdict will write
        // no more: what has not arrived never will.
        for slot in session.closed() {
            if let Some(Mine { id, .. }) = t.mine.remove(&slot) {
                if self.fail(id, &ended) {
                    tracing::warn!(peer, slot, why = ended, "transfer failed: its source is gone");
                }
            }
        }
    }

    /// One message of a peer connection, through its session; returns the
    /// answer, if it has one.
    #[allow(clippy::too_many_arguments)] // the connection's identity and state
    fn peer_step(self: &Arc<Self>, peer: &str, session_id: u64, grantee: u64, session: &mut DestinationSession, mine: &mut HashMap<u16, Mine>, verdicts: &Arc<Verdicts>, msg: PeerMsg) -> Option<PeerMsg> {
        Some(match session.handle(Instant::now(), msg) {
            DestinationStep::Reply(m) => m,
            DestinationStep::Ignore => return None,
            DestinationStep::Offer(o) => match self.offer(peer, session_id, grantee, *o) {
                Ok((a, m)) => {
                    self.judge_by(m.id, verdicts);
                    mine.insert(a.slot, m);
                    session.accept(a)
                }
                Err(reason) => session.refuse(reason),
            },
            DestinationStep::Claim(c) => {
                let slot = c.slot;
                match self.claim(peer, grantee, *c) {
                    Ok(m) => {
                        self.judge_by(m.id, verdicts);
                        mine.insert(slot, m);
                        session.claimed(slot);
                        return None;
                    }
                    Err(reason) => session.refuse(reason),
                }
            }
            // Handed to whoever lands the slot, which checks them (the
            // session passes one manifest per slot, and sums only after it).
            DestinationStep::Expect(e) => {
                if let Some(m) = mine.get(&e.slot) {
                    self.deliver(&m.to, Inbound::Expect(e));
                }
                return None;
            }
            DestinationStep::LayerSums(l) => {
                if let Some(m) = mine.get(&l.slot) {
                    self.deliver(&m.to, Inbound::Sums(l));
                }
                return None;
            }
            DestinationStep::Aborted { slot, reason, reply } => {
                if let Some(Mine { id, .. }) = mine.remove(&slot) {
                    // No verdict for it: the answer below is its last word.
                    verdicts.leave(slot);
                    tracing::warn!(peer, slot, reason, "source aborted");
                    if !self.fail(id, format!("source aborted: {reason}")) {
                        // It had failed here first: say why, so the source
                        // reports the cause rather than its echo.
                        let st = self.slots.lock().expect("slots lock");
                        let first = st.map.get(&slot).filter(|s| s.gen == id.gen && s.state == TransferState::Failed).and_then(|s| s.error.clone());
                        if let Some(why) = first {
                            return Some(PeerMsg::Refused { reason: why });
                        }
                    }
                }
                reply
            }
        })
    }

    /// Transfer `id` was taken on by a peer connection: its verdict goes
    /// there as it ends ([`Verdicts`]); when it ended already, right after
    /// the accept (or, for a claim, at once).
    fn judge_by(&self, id: SlotId, verdicts: &Arc<Verdicts>) {
        let ended = {
            let mut st = self.slots.lock().expect("slots lock");
            verdicts.enter(id.slot);
            match st.get_mut(id) {
                Some(s) if running(s.state) => {
                    s.verdicts = Some(verdicts.clone());
                    return;
                }
                Some(s) => verdict_of(s.state, s.error.clone()),
                None => Some("the transfer's slot was taken again".into()),
            }
        };
        verdicts.push(id, ended);
    }

    /// An offer on connection `session` into a prepared request: checks it
    /// against the group and the request, grants this transfer its own
    /// keys, writable only by connections of node `grantee` and only for
    /// this slot, then plans it, stages it and sets up its landing
    /// ([`Daemon::receive_for`]).
    fn offer(self: &Arc<Self>, peer: &str, session: u64, grantee: u64, o: Offer) -> Result<(Accept, Mine), String> {
        let src = (o.src_layout.clone(), o.src_num_blocks, o.src_block_table.clone(), o.codec.clone());
        let (mut accept, id) = self.grant(peer, session, grantee, o)?;
        match self.receive_for(id, grantee, src, None) {
            Ok((key, len, to)) => {
                (accept.stage_key, accept.stage_len) = (key, len);
                Ok((accept, Mine { id, to }))
            }
            Err(r) => {
                self.fail(id, &r.message);
                Err(r.message)
            }
        }
    }

    /// The offer's checks and this transfer's keys.
    fn grant(&self, peer: &str, session: u64, grantee: u64, o: Offer) -> Result<(Accept, SlotId), String> {
        let groups = self.groups.lock().expect("groups lock");
        let mut slots = self.slots.lock().expect("slots lock");
        let Some(g) = groups.map.get(&o.dst_group) else { return Err(format!("no group `{}` on {}", o.dst_group, self.cfg.node)) };
        let found = slots.live(&self.live).find(|(_, s)| {
            s.state == TransferState::Prepared && s.recv.as_ref().is_some_and(|r| r.group == o.dst_group && r.request == o.dst_request)
        });
        let Some((id, sl)) = found else {
            return Err(format!("request `{}` of group `{}` is not prepared on {}", o.dst_request, o.dst_group, self.cfg.node));
        };
        let (slot, recv) = (id.slot, sl.recv.clone().expect("prepared slots hold their receive"));
        // A source offering into a request announced to it (it missed the
        // announcement, or could not use it) replaces the announcement,
        // which counts only where the source could have read it: on this
        // connection.
        if let Some(sl) = slots.get_mut(id) {
            if let Some((on, bytes)) = self.unannounce_in(id, sl) {
                if on == session {
                    sl.wire += bytes;
                }
            }
        }
        // A source offering something else into this request ends it: the
        // decode side's waits fail now, with the reason, instead of at
        // their own timeout.
        if let Some(why) = mismatch(g, &recv, &o) {
            if let Some(sl) = slots.get_mut(id) {
                self.end(id, sl, TransferState::Failed, Some(format!("refused the offer of `{peer}` (request `{}`): {why}", o.src_request)));
            }
            tracing::warn!(peer, slot, request = o.dst_request, why, "offer refused; the prepared receive fails");
            return Err(why);
        }
        let accept = self.accept_for(g, &recv, slot, grantee)?;
        if let Some(sl) = slots.get_mut(id) {
            sl.keys = accept.regions.iter().map(|r| r.key).collect();
            sl.receiving_from(peer);
        }
        tracing::info!(peer, slot, request = o.dst_request, src_request = o.src_request, "transfer accepted");
        Ok((accept, id))
    }

    /// Plans the transfer from the source's side and this side's
    /// registration, stages it, expects its bytes, and sets up its landing:
    /// a small one on its events' threads, a large one (or one into device
    /// memory, whose copies wait on their events) on a receive thread.
    /// Returns the staging buffer's key and size, and where the manifest goes.
    pub(super) fn receive_for(self: &Arc<Self>, id: SlotId, grantee: u64, src: SourceSide, announced: Option<Option<Arc<Region>>>) -> Result<(u32, u64, Lands), Refusal> {
        let mut r = self.receive_of(id, grantee, src, announced)?;
        let n = r.model.layers.len();
        let c = &r.p.plan.counters;
        self.with_slot(id, |sl| sl.sized(n, c, r.p.schedule.wire_bytes()));
        Metrics::add(&self.metrics.received_bytes, c.total_bytes_moved);
        let expected = r.p.schedule.layers.iter().enumerate().try_for_each(|(l, ls)| self.ep.placement().expect(Tag { slot: id.slot, layer: l as u16 }, ls.wire_bytes));
        if let Err(err) = expected {
            self.drop_stage(r.stage.take());
            return Err(Refusal::new(Code::TransferFailed, err));
        }
        let staging = (r.stage.as_ref().map_or(0, |s| s.key), r.p.schedule.stage_bytes);
        let timeout = Duration::from_secs(self.cfg.limits.transfer_timeout_secs);
        if r.devices.is_empty() && c.total_bytes_moved <= LAND_ON_ARRIVAL_MAX {
            let l = self.land_on_arrival(Landing::new(r, timeout));
            return Ok((staging.0, staging.1, Lands::OnArrival(l)));
        }
        let stage = r.stage.clone();
        let (tx, rx) = mpsc::channel();
        let (d, pd) = (self.clone(), self.clone());
        let on_panic = move |why: String| {
            let why = format!("internal error: the receive thread panicked: {why}");
            tracing::error!(slot = id.slot, why, "transfer failed");
            pd.fail(id, why);
        };
        let request = r.request.clone();
        let l = Landing::new(r, timeout);
        let spawned = self.workers.spawn("kvwired-recv", move || {
            let span = tracing::info_span!("receive", slot = id.slot, request);
            let _g = span.enter();
            d.receive(l, rx);
        }, on_panic);
        if let Err(err) = spawned {
            self.drop_stage(stage);
            return Err(Refusal::new(Code::TransferFailed, format!("cannot start the receive thread: {err}")));
        }
        Ok((staging.0, staging.1, Lands::Thread(tx)))
    }

    /// Everything landing the transfer needs, checked: the plan from both
    /// sides' layouts, what the manifest must claim, the schedule and its
    /// staging buffer.
    fn receive_of(&self, id: SlotId, grantee: u64, src: SourceSide, announced: Option<Option<Arc<Region>>>) -> Result<Receive, Refusal> {
        // An announced staging buffer not taken into the receive (it failed
        // first) goes back, its key revoked.
        let mut announced = announced;
        let r = self.receive_of_with(id, grantee, src, &mut announced);
        if let Some(stage) = announced {
            self.drop_stage(stage);
        }
        r
    }

    fn receive_of_with(&self, id: SlotId, grantee: u64, (src_layout, src_num_blocks, src_table, codec): SourceSide, announced: &mut Option<Option<Arc<Region>>>) -> Result<Receive, Refusal> {
        let refuse = |m: String| Refusal::new(Code::TransferFailed, m);
        let recv = {
            let st = self.slots.lock().expect("slots lock");
            let sl = st.map.get(&id.slot).filter(|s| s.gen == id.gen && s.role == Role::Destination && s.state == TransferState::Running);
            sl.and_then(|s| s.recv.clone()).ok_or_else(|| refuse(format!("slot {} is not receiving", id.slot)))?
        };
        let (gen, model, format, layout, num_blocks, identity, regions, devices) = {
            let st = self.groups.lock().expect("groups lock");
            let g = st.map.get(&recv.group).ok_or_else(|| refuse(format!("group `{}` is gone", recv.group)))?;
            (g.gen, g.model.clone(), g.format, g.layout.clone(), g.num_blocks, g.identity.clone(), g.regions(), g.devices())
        };
        let codec = codec.as_deref().map(Codec::parse).transpose().map_err(|err| refuse(err.to_string()))?;
        let key = ReceivedKey {
            group: gen,
            tokens: recv.tokens,
            prefix: recv.prefix_tokens,
            table: recv.block_table.clone(),
            src_layout: src_layout.clone(),
            src_blocks: src_num_blocks,
            src_table: src_table.clone(),
            codec,
        };
        let p = self.received_plans.get_or_build(key, &self.metrics.plans_reused_received, |p| p.plan.segments.len() as u64, || {
            let src_layout = LayoutSpec::parse(&src_layout).map_err(|err| refuse(format!("source plan: {err}")))?;
            let (dst, plan) = replan(&model, layout, format, num_blocks, &recv, &src_layout, src_num_blocks, src_table, self.ep.transport()).map_err(|err| refuse(format!("source plan: {err}")))?;
            let schedule = Schedule::new(&model, &format, &plan, codec).map_err(|err| refuse(err.to_string()))?;
            Ok(Replanned { dst, plan, schedule })
        })?;
        let expected = Expected::new(&identity, &model, &p.dst, &recv.request, recv.tokens, recv.prefix_tokens).map_err(|err| refuse(format!("registration: {err}")))?;
        let schedule = &p.schedule;
        // Staged segments land in one buffer and are unpacked per layer:
        // the one set aside at the announcement (as large as the payload,
        // so it holds any schedule's), or a new one.
        let stage = match announced {
            Some(stage) => {
                let have = stage.as_ref().map_or(0, |r| r.len);
                if schedule.stage_bytes > have {
                    return Err(refuse(format!("the claim stages {} bytes, the announcement set {have} aside", schedule.stage_bytes)));
                }
                announced.take().flatten()
            }
            None => self.stage_for(schedule.stage_bytes, Some(Grant { peer: grantee, slot: id.slot })).map_err(|err| refuse(format!("staging: {err}")))?,
        };
        self.with_slot(id, |s| s.staging = stage.as_ref().map_or(0, |r| r.len));
        Ok(Receive { id, request: recv.request, model, format, codec, p, expected, regions, devices, stage })
    }

    /// The source's manifest, checked field by field against this side's
    /// registration and plan, before any flag of the slot is published.
    pub(super) fn checked_manifest(&self, r: &Receive, e: &Expect) -> Result<Manifest, String> {
        let manifest = e.manifest.manifest().map_err(|err| format!("manifest: {err}"))?;
        manifest.check(&r.expected).map_err(|err| err.to_string())?;
        if e.layer_sums && !manifest.checksums.is_empty() {
            return Err("manifest: it carries checksums and says they follow per layer".into());
        }
        if self.cfg.verify_checksums && !e.layer_sums && manifest.checksums.is_empty() && r.p.plan.counters.total_bytes_moved > 0 {
            return Err("this daemon verifies checksums and the manifest carries none".into());
        }
        Ok(manifest)
    }

    /// One layer whose bytes are all placed and hashed
    /// ([`Daemon::unpack_and_hash`]): its checksums compared with the
    /// manifest's, and its copies to the device started where it lives
    /// there. A device-resident layer is usable only once those completed
    /// (their event, not their enqueue): the caller awaits them, landing
    /// the next layer meanwhile. A layer that fails gets no flag, and the
    /// transfer fails.
    pub(super) fn land_layer(&self, r: &Receive, manifest: &Manifest, layer: usize, sums: &[LayerChecksum]) -> Result<Option<Copies>, String> {
        if self.verifying(r, layer) {
            let this_layer = |_, l: u32| l as usize == layer;
            manifest.verify_checksums_of(sums, this_layer).map_err(|err| refused(layer, err))?;
        }
        if r.devices.is_empty() {
            return Ok(None);
        }
        let segs = r.p.schedule.layers[layer].segments();
        self.start_device_copies(&r.p.plan, &segs, layer, &r.regions, &r.devices).map(Some).map_err(|err| format!("host → device copy: {err}"))
    }

    /// Whether layer `layer` is checked against the manifest here.
    pub(super) fn verifying(&self, r: &Receive, layer: usize) -> bool {
        self.cfg.verify_checksums && r.p.schedule.layers[layer].wire_bytes > 0
    }

    /// Layer `layer`: its staged segments unpacked, and (when this daemon
    /// verifies) every segment hashed, its direct ones where they landed;
    /// its checksums, to compare once the manifest's for the layer are in
    /// ([`Daemon::land_layer`]). Piece by piece, each piece hashed and
    /// unpacked while it is in the CPU's cache. Without a codec a staged
    /// segment's bytes sit in staging exactly as its runs will hold them:
    /// hashed there, in one piece, then scattered. With a codec the
    /// checksums cover the decoded runs: unpacked first, then hashed where
    /// they landed. A piece is unpacked before the layer's checksums
    /// compare, as its direct segments landed before; nothing is published
    /// before they compare.
    pub(super) fn unpack_and_hash(&self, r: &Receive, layer: usize) -> Result<Vec<LayerChecksum>, String> {
        let ls = &r.p.schedule.layers[layer];
        let verifying = self.verifying(r, layer);
        // Nothing to hash, and every byte landed where it belongs: no part
        // to run (each part past the first starts a thread).
        if !verifying && ls.staged.iter().all(|st| st.placed) {
            return Ok(Vec::new());
        }
        let landed = in_parts(&r.p.plan, ls.segments(), ls.wire_bytes, |part| land_part(r, part, verifying, layer))?;
        // Parts ran side by side: a hop held the layer as long as its longest part.
        let (mut hashing, mut unpacking, mut unpacked, mut sums) = (Duration::ZERO, Duration::ZERO, 0, Vec::new());
        for p in landed {
            (hashing, unpacking, unpacked) = (hashing.max(p.hashing), unpacking.max(p.unpacking), unpacked + p.unpacked);
            sums.extend(p.sums);
        }
        if unpacked > 0 {
            self.slot_hop(r.id, Hop::Unpack, unpacking, unpacked);
        }
        if verifying {
            self.slot_hop(r.id, Hop::Verify, hashing, ls.wire_bytes);
        }
        Ok(sums)
    }

    /// A registered staging buffer of `len` bytes from the pool (none for
    /// 0); a destination's is writable only under `grant`.
    pub(super) fn stage_for(&self, len: u64, grant: Option<Grant>) -> Result<Option<Arc<Region>>, String> {
        if len == 0 {
            return Ok(None);
        }
        let mem = self.stage_pool.take(len).map_err(|e| e.to_string())?;
        self.register_region(mem, 0, len, grant).map(Some).map_err(|e| e.to_string())
    }

    /// Revokes a staging buffer (either side's; late writes to it fail) and
    /// hands its memory back to the pool.
    pub(super) fn drop_stage(&self, stage: Option<Arc<Region>>) {
        // A source's stays registered for its peer's next transfer.
        if let Some(r) = stage.and_then(|r| self.stage_pool.give_source(r, || self.keeping())) {
            self.revoke_key(r.key);
            self.stage_pool.give(r, || self.keeping());
        }
    }
}

/// The largest power of two of milliseconds not above `d`, and at least 1 ms.
fn coarse(d: Duration) -> Duration {
    let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1);
    Duration::from_millis(1 << ms.ilog2())
}

/// Why layer `layer` gets no flag, logged.
fn refused(layer: usize, err: ManifestError) -> String {
    tracing::warn!(layer, error = %err, "verification failed; no flag for this layer");
    err.to_string()
}

/// What one part of a layer's segments came to: its checksums (with
/// `verifying`), and its time hashing and unpacking.
struct Landed {
    sums: Vec<LayerChecksum>,
    hashing: Duration,
    unpacking: Duration,
    unpacked: u64,
}

/// Unpacks and hashes `part` of layer `layer`'s segments (whole checksum
/// chunks), piece by piece, each piece hashed and unpacked while it is in
/// the CPU's cache ([`Daemon::unpack_and_hash`]).
fn land_part(r: &Receive, part: &Part, verifying: bool, layer: usize) -> Result<Landed, String> {
    let in_staging = r.codec.is_none();
    let runs = RunReader::new(&r.regions);
    let stage = r.stage.as_deref().filter(|_| in_staging);
    let mut sums = part.sums(&r.p.plan, Reading::Destination);
    let (mut hashing, mut unpacking, mut unpacked) = (Duration::ZERO, Duration::ZERO, 0);
    for (piece, _) in pieces(&r.p.plan, part.iter().copied()) {
        let mut hash = |sums: &mut Checksums| {
            let t = Instant::now();
            let read = |rank: u32, region: RegionId, offset: u64, len: u64| runs.read(rank, region, offset, len);
            // A staged segment in one piece: in staging, or where it landed in place.
            let whole = |i: usize| {
                let st = r.p.schedule.staged_of(i)?;
                match st.placed {
                    true => {
                        let s = r.p.plan.segments.at(i);
                        region_view(r.regions.get(&(s.dst_rank, s.dst_region))?, s.dst_offset, st.size)
                    }
                    false => region_view(stage?, st.offset, st.size),
                }
            };
            let added = sums.add(piece.iter().copied(), read, whole);
            hashing += t.elapsed();
            added.map_err(|err| refused(layer, err))
        };
        if verifying && in_staging {
            hash(&mut sums)?;
        }
        let t = Instant::now();
        // The piece's streamed rows are fenced once, as it ends.
        let streaming = Streaming::new();
        for &i in &piece {
            if let Some(st) = r.p.schedule.staged_of(i).filter(|st| !st.placed) {
                let seg = r.p.plan.segments.at(i);
                unpack_segment(r, &seg, &st, &streaming).ok_or_else(|| format!("unpack of layer {layer} failed"))?;
                unpacked += seg.bytes();
            }
        }
        drop(streaming);
        unpacking += t.elapsed();
        if verifying && !in_staging {
            hash(&mut sums)?;
        }
    }
    let sums = if verifying { sums.finish() } else { Vec::new() };
    Ok(Landed { sums, hashing, unpacking, unpacked })
}

/// Moves one staged segment from the staging buffer into its runs in the
/// cache (decoding it on the way with a codec); `None` when a range is not
/// there.
///
/// Without a codec its rows are streamed past the caches through
/// `streaming`, whatever their size: each row copied plainly first reads
/// its lines for ownership, and the daemon reads none of them again (the
/// stage was hashed). kvwire-soak over tcp, 1 client, against the build
/// that copied them plainly below 8 MiB of transfer, same minutes: a 1 MiB transfer (512 rows of 2 KiB, into
/// shuffled blocks) unpacked in 73-77 µs against 107-116, p50 0.72-0.79 ms
/// against 0.77-0.81; 256 KiB 18 µs against 31; 64 KiB level. Llama-3.1-8b
/// tp=8 -> tp=2 at 256 tokens (32 MiB in 64 KiB segments) unpacked in 2.2-2.9
/// ms against 5.1-6.4 plainly.
fn unpack_segment(r: &Receive, seg: &Segment, st: &Staged, streaming: &Streaming) -> Option<()> {
    let stage = r.stage.as_ref()?;
    let dst = r.regions.get(&(seg.dst_rank, seg.dst_region))?;
    if r.codec.is_none() {
        // Runs go straight from staging into the cache: one copy for all
        // where they lie back to back there too.
        let dst_at = dst.offset + seg.dst_offset;
        return streaming.copy_runs(&stage.mem, st.offset, seg.len, &dst.mem, dst_at, seg.dst_stride, seg.len, seg.count).ok();
    }
    let bytes = read_mem(&stage.mem, st.offset, st.size)?;
    let data = schedule::unpack(&bytes, st, &r.format, r.codec)?;
    for (k, (_, dof)) in seg.runs().enumerate() {
        let run = data.get(k * seg.len as usize..(k + 1) * seg.len as usize)?;
        dst.mem.write(dst.offset + dof, run).ok()?;
    }
    Some(())
}

/// This side's plan of the transfer, from its own registration and the
/// source's layout and block table.
#[allow(clippy::too_many_arguments)] // both sides' layouts and tables, and the transport the plan's costs come from
pub(super) fn replan(model: &ModelSpec, layout: LayoutSpec, format: CacheFormat, num_blocks: u32, recv: &PrepareReceive, src_layout: &LayoutSpec, src_num_blocks: u32, src_table: Vec<u32>, transport: TransportKind) -> Result<(Side, Plan), String> {
    let dst = Side::with_table(model, &layout, format, recv.tokens, recv.block_table.clone(), num_blocks).map_err(|e| e.to_string())?;
    let src = Side::with_table(model, src_layout, format, recv.tokens, src_table, src_num_blocks).map_err(|e| e.to_string())?;
    let input = PlanInput { model, tokens: recv.tokens, prefix_tokens: recv.prefix_tokens, src: &src, dst: &dst, cost: CostModel::for_transport(transport) };
    let plan = plan::build(&input).map_err(|e| e.to_string())?;
    Ok((dst, plan))
}

#[cfg(test)]
mod tests {
    use super::{coarse, Verdicts};
    use crate::peer::{PeerMsg, Sealed};
    use crate::server::state::SlotId;
    use std::net::{TcpListener, TcpStream};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    /// A verdict goes only after its slot's accept (owed until then), once,
    /// counted toward its transfer before it goes, and not at all for a
    /// slot the source aborted or on a connection that ended; the
    /// connection's thread learns of each one sent, and the connection is
    /// idle again once no slot of it runs.
    #[test]
    fn a_verdict_follows_its_accept_goes_once_and_only_for_a_slot_the_connection_runs() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        let cred = kvwire_transport::Credential::random();
        let (dst, mut src) = (Sealed::new(b, cred.clone(), false), Sealed::new(a, cred, true));
        let counted = Arc::new(Mutex::new(Vec::new()));
        let c = counted.clone();
        let idle = Arc::new(AtomicBool::new(true));
        let v = Verdicts::new(dst.outbox(), idle.clone(), move |id, len| c.lock().unwrap().push((id, len)));
        let id = |slot: u16| SlotId { slot, gen: u64::from(slot) + 10 };
        let verdict = |slot: u16, error: Option<&str>| PeerMsg::Verdict { slot, error: error.map(String::from) };

        // Ended before its accept went: owed, and sent right after it.
        v.enter(1);
        assert!(!idle.load(Ordering::Acquire));
        v.push(id(1), Some("cancelled by client".into()));
        assert!(v.sent().is_empty(), "owed, not sent");
        dst.outbox().send_counted(&PeerMsg::Ok, |_| {}).unwrap();
        v.open();
        assert_eq!(src.recv().unwrap(), PeerMsg::Ok);
        assert_eq!(src.recv().unwrap(), verdict(1, Some("cancelled by client")));
        assert_eq!(v.sent(), [(id(1), Some("cancelled by client".to_string()))]);
        assert!(idle.load(Ordering::Acquire));

        // Two running; one aborted by its source: only the other's verdict, once.
        v.enter(2);
        v.enter(3);
        v.open();
        v.leave(3);
        assert!(!idle.load(Ordering::Acquire), "slot 2 still runs");
        v.push(id(3), Some("source aborted: x".into()));
        v.push(id(2), None);
        v.push(id(2), None);
        assert_eq!(src.recv().unwrap(), verdict(2, None));
        assert_eq!(v.sent(), [(id(2), None)]);
        assert!(idle.load(Ordering::Acquire));

        // The connection ended: nothing more goes on it.
        v.enter(4);
        v.open();
        v.close();
        v.push(id(4), None);
        assert!(v.sent().is_empty());
        src.read_timeout(Duration::from_millis(100)).unwrap();
        assert!(src.recv().is_err_and(|e| e.is_timeout()), "nothing else was sent");
        // Each sent verdict counted toward its own transfer, before it went.
        let counted = counted.lock().unwrap();
        assert_eq!(counted.iter().map(|c| c.0).collect::<Vec<_>>(), [id(1), id(2)]);
        assert!(counted.iter().all(|c| c.1 > 32), "{counted:?}");
    }

    /// A ping or an abort that crossed its transfer's verdict still counts
    /// toward that transfer, as the source counts it; a message naming a
    /// slot number the connection ran before (a stale manifest) does not.
    #[test]
    fn a_ping_or_an_abort_that_crossed_a_verdict_counts_toward_its_transfer() {
        use super::{Lands, Mine, Transfers};
        use kvwire_core::session::msg::{Expect, ManifestWire};
        use kvwire_core::session::{DestinationSession, Timeouts};
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let _a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        let dst = Sealed::new(b, kvwire_transport::Credential::random(), false);
        let v = Verdicts::new(dst.outbox(), Arc::new(AtomicBool::new(true)), |_, _| {});
        let t10 = Duration::from_secs(10);
        let mut session = DestinationSession::new(std::time::Instant::now(), "a", Timeouts { reply: t10, peer: t10, transfer: t10 });
        let mut t = Transfers::default();
        let (old, other) = (SlotId { slot: 3, gen: 7 }, SlotId { slot: 4, gen: 8 });
        for id in [old, other] {
            t.mine.insert(id.slot, Mine { id, to: Lands::Thread(std::sync::mpsc::channel().0) });
            session.claimed(id.slot);
            v.enter(id.slot);
        }
        v.open();
        let abort = PeerMsg::Abort { slot: 3, reason: "x".into() };
        let stale = PeerMsg::Expect(Expect { slot: 3, manifest: ManifestWire::from_bytes(Vec::new()), layer_sums: false });
        // Two running: a ping names neither.
        assert_eq!((t.named(&PeerMsg::Ping), t.named(&abort)), (None, Some(old)));
        v.push(other, None);
        v.push(old, Some("checksum mismatch".into()));
        t.judged(&v, &mut session);
        assert!(t.mine.is_empty() && session.slot(3).is_none());
        assert_eq!((t.named(&PeerMsg::Ping), t.named(&abort), t.named(&stale)), (Some(old), Some(old), None));
    }

    #[test]
    fn a_wait_is_rounded_down_to_a_power_of_two_of_milliseconds_never_to_zero() {
        let ms = Duration::from_millis;
        assert_eq!(coarse(Duration::ZERO), ms(1));
        assert_eq!(coarse(Duration::from_micros(1500)), ms(1));
        assert_eq!(coarse(ms(2)), ms(2));
        assert_eq!(coarse(ms(1023)), ms(512));
        assert_eq!(coarse(ms(1024)), ms(1024));
        assert_eq!(coarse(Duration::from_secs(30)), ms(16384));
        // Never later than asked, and never half as long or less.
        for t in (1..5000).map(ms) {
            let c = coarse(t);
            assert!(c <= t && c * 2 > t, "{t:?} -> {c:?}");
        }
    }
}
