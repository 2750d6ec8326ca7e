//! The control socket: local clients of this daemon's uid register caches,
//! prepare receives, submit transfers, wait on flags and read status.

use super::error::{refused, Refusal};
use super::state::{bytes_of, DeviceRank, Group, Groups, Marked, Mirrored, Pin, RankCache, Role, Share, SlotId};
use super::workers::Job;
use super::Daemon;
use crate::metrics::Metrics;
use crate::peer;
use kvwire_client::control::*;
use kvwire_client::wire::{self, WireError};
use kvwire_core::layout::{self, ModelSpec};
use kvwire_core::plan::Side;
use kvwire_core::shard::{LayoutSpec, RegionId};
use kvwire_core::tensors::{self, TensorDesc};
use kvwire_core::CacheFormat;
use kvwire_transport::device::bound::DeviceHandle;
use kvwire_transport::flags::Undeclared;
use kvwire_transport::idle::readable_now;
use kvwire_transport::{Hop, HostMem, Tag};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Most groups shared at once (each share is a few bytes, but a client
/// could make them without end).
const MAX_SHARES: usize = 4096;

/// Other uids may connect at will: their refusals are logged within a budget.
static REFUSED_CLIENTS: kvwire_transport::logbudget::LogBudget = kvwire_transport::logbudget::LogBudget::new();

thread_local! {
    /// The answer to the request this control thread is serving; none
    /// outside a request.
    static ANSWERING: RefCell<Option<Arc<Answer>>> = const { RefCell::new(None) };
    /// Work the request left to run on this thread once its answer is out.
    static AFTER_ANSWER: RefCell<Option<Job>> = const { RefCell::new(None) };
}

/// Runs `job` on this control thread once the answer to its request is
/// out, rather than on a worker woken for it: on a host whose idle cores
/// halt, that wake-up was the longest wait before a small transfer's
/// writes left. A request that comes while `job` runs waits for it, or
/// for the ticker's next look, which hands the client to a worker. Gives
/// `job` back off a control thread, or when one is left already.
pub(super) fn run_after_answer(job: Job) -> Result<(), Job> {
    if ANSWERING.with(|a| a.borrow().is_none()) {
        return Err(job);
    }
    AFTER_ANSWER.with(|j| {
        let mut j = j.borrow_mut();
        match *j {
            Some(_) => Err(job),
            None => {
                *j = Some(job);
                Ok(())
            }
        }
    })
}

/// The answer to one request, sent once, by whichever thread gets there
/// first: the control thread as its request ends, or the transfer thread
/// the request started ([`answer_early`]). On a host with few cores the
/// transfer thread, woken as a submit ends, takes the control thread's
/// core and packs: the engine's submit call then waited for the whole
/// pack (0.4 ms of 0.64 at shm 1 MiB, 0.6 ms at tcp 4 MiB). Waking it
/// only after the answer would keep it off the client's path as well, but
/// delays every transfer's start by the answer; this keeps the start.
/// Either way, on that host an engine answered early saw tcp 4 MiB
/// transfers end later (README).
pub(super) struct Answer {
    stream: Arc<UnixStream>,
    state: Mutex<Answering>,
}

#[derive(Default)]
enum Answering {
    #[default]
    Open,
    Ready(Box<Reply>),
    Sent { ok: bool },
}

impl Answer {
    /// The transfer thread's end: sends the answer if it is ready, not
    /// sent yet, and the client's socket has room for it now (a client
    /// that stopped reading holds up its control thread, as before, not a
    /// transfer thread). Sent under the lock, so it is out before the
    /// control thread answers anything later.
    pub(super) fn send(&self) {
        let mut st = self.state.lock().expect("answer lock");
        if let Answering::Ready(r) = &*st {
            match wire::try_send_unix(&self.stream, r) {
                Ok(false) => {}
                sent => *st = Answering::Sent { ok: sent.is_ok() },
            }
        }
    }

    /// The control thread's end of a request: `reply` goes unless the
    /// other thread sent the one made ready already.
    fn finish(&self, reply: &Reply, fds: &[std::os::fd::RawFd]) -> bool {
        let mut st = self.state.lock().expect("answer lock");
        match std::mem::take(&mut *st) {
            Answering::Sent { ok } => ok,
            _ => wire::send_unix(&self.stream, reply, fds).is_ok(),
        }
    }

    /// Takes back an answer made ready that no other thread will send.
    pub(super) fn withdraw(&self) {
        let mut st = self.state.lock().expect("answer lock");
        if matches!(*st, Answering::Ready(_)) {
            *st = Answering::Open;
        }
    }
}

/// Makes `reply` the answer to the request this thread serves, for the
/// thread it hands the request's work to: that thread sends it first
/// thing ([`Answer::send`]) if the control thread has not yet. Only for a
/// reply that is final: nothing after this may fail the request.
pub(super) fn answer_early(reply: &Reply) -> Option<Arc<Answer>> {
    let a = ANSWERING.with(|a| a.borrow().clone())?;
    *a.state.lock().expect("answer lock") = Answering::Ready(Box::new(reply.clone()));
    Some(a)
}

/// Takes a client off the live count when it ends.
struct Leave(Arc<AtomicU64>);

impl Drop for Leave {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One client's connection and what the daemon holds for it: served by
/// one thread at a time (not always the same one, see
/// [`run_after_answer`]), and let go when dropped, however its serving
/// ended.
struct ClientConn {
    d: Arc<Daemon>,
    s: Arc<UnixStream>,
    client: u64,
    reader: wire::UnixReader,
    // From its hello (which hands it the flag page) until it declares its
    // sleep page, every publish wakes, in case it sleeps.
    undeclared: Option<Undeclared>,
    _out: Leave,
}

impl Drop for ClientConn {
    fn drop(&mut self) {
        let (d, client) = (&self.d, self.client);
        d.sleepers.remove(client);
        self.undeclared = None;
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| d.release_client(client))).is_err() {
            tracing::error!(client, "releasing a client panicked");
        }
        if d.clients.fetch_sub(1, Ordering::AcqRel) == 1 {
            d.drop_kept();
        }
    }
}

/// A rank's memories and, for a device-resident rank, its allocation.
type RankMemory = (Vec<Arc<HostMem>>, Option<DeviceRank>);

/// Where a region is registered: (region, memory index, byte offset, length).
type Window = (RegionId, usize, u64, u64);

impl Daemon {
    pub(super) fn control_loop(self: Arc<Self>, l: UnixListener) {
        let live = Arc::new(AtomicU64::new(0));
        let refusing = Arc::new(AtomicU64::new(0));
        for s in l.incoming() {
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            let Ok(s) = s else { continue };
            if live.load(Ordering::Acquire) >= self.cfg.limits.max_clients as u64 {
                self.refuse_over_limit(s, &refusing);
                continue;
            }
            let d = self.clone();
            live.fetch_add(1, Ordering::AcqRel);
            // Counted out however its serving ends, a panic included.
            let out = Leave(live.clone());
            let spawned = std::thread::Builder::new().name("kvwired-client".into()).spawn(move || d.serve_client(s, out));
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "cannot spawn a client thread");
            }
        }
    }

    /// Tells a client past `limits.max_clients` why, in a way it can read:
    /// its first message is taken before the close (closing on it unread
    /// would reset the connection and lose the reply). A few refusals run at
    /// once, on their own threads for at most a second; past that the
    /// connection is just closed.
    fn refuse_over_limit(&self, s: UnixStream, refusing: &Arc<AtomicU64>) {
        const AT_ONCE: u64 = 16;
        if refusing.load(Ordering::Acquire) >= AT_ONCE {
            return;
        }
        refusing.fetch_add(1, Ordering::AcqRel);
        let r = Refusal::new(Code::Limit, format!("limits.max_clients {} reached", self.cfg.limits.max_clients));
        let count = refusing.clone();
        let spawned = std::thread::Builder::new().name("kvwired-refuse".into()).spawn(move || {
            let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
            let _ = wire::recv_unix(&s);
            let _ = wire::send_unix(&s, &r.reply(), &[]);
            count.fetch_sub(1, Ordering::AcqRel);
        });
        if spawned.is_err() {
            refusing.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!("cannot spawn a refusal thread");
        }
    }

    /// Refuses a client of another uid; `true` when it may go on.
    fn same_uid(&self, s: &UnixStream) -> bool {
        let creds = nix::sys::socket::getsockopt(s, nix::sys::socket::sockopt::PeerCredentials);
        let me = nix::unistd::geteuid().as_raw();
        match creds {
            Ok(c) if c.uid() == me => true,
            Ok(c) => {
                Metrics::add(&self.metrics.clients_refused, 1);
                if let Some(held_back) = REFUSED_CLIENTS.admit() {
                    tracing::warn!(uid = c.uid(), pid = c.pid(), held_back, "control client of another uid refused");
                }
                let r = Refusal::new(Code::PermissionDenied, format!("uid {} may not use this daemon (runs as uid {me})", c.uid()));
                let _ = wire::send_unix(s, &r.reply(), &[]);
                // Take the client's first message before closing, so its
                // send does not fail with a broken pipe before it reads why.
                let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
                let _ = wire::recv_unix(s);
                false
            }
            Err(e) => {
                Metrics::add(&self.metrics.clients_refused, 1);
                if let Some(held_back) = REFUSED_CLIENTS.admit() {
                    tracing::warn!(error = %e, held_back, "SO_PEERCRED failed; client refused");
                }
                false
            }
        }
    }

    fn serve_client(self: &Arc<Self>, s: UnixStream, out: Leave) {
        if !self.same_uid(&s) {
            return;
        }
        let client = self.next_client.fetch_add(1, Ordering::Relaxed);
        self.clients.fetch_add(1, Ordering::AcqRel);
        self.serve(ClientConn { d: self.clone(), s: Arc::new(s), client, reader: wire::UnixReader::new(), undeclared: None, _out: out });
    }

    /// Serves `c`'s requests until it leaves, or until the ticker handed
    /// it to a worker while this thread ran work a request left
    /// ([`run_after_answer`]).
    fn serve(self: &Arc<Self>, mut c: ClientConn) {
        let (s, client) = (c.s.clone(), c.client);
        loop {
            let (body, fds) = match c.reader.recv(&s) {
                Ok(m) => m,
                Err(WireError::Closed) => break,
                Err(e @ (WireError::TooLong(_) | WireError::Fds(_))) => {
                    let _ = wire::send_unix(&s, &Refusal::new(Code::Malformed, &e).reply(), &[]);
                    // The rest of the refused message is still unread:
                    // closing on it would reset the connection and lose the
                    // reply. Take it (briefly, bounded) before closing.
                    let _ = s.shutdown(std::net::Shutdown::Write);
                    let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
                    let _ = std::io::copy(&mut std::io::Read::take(&*s, 1 << 20), &mut std::io::sink());
                    break;
                }
                Err(e) => {
                    tracing::debug!(client, error = %e, "control connection ended");
                    break;
                }
            };
            let req: Request = match wire::parse(&body) {
                Ok(r) => r,
                Err(e) => {
                    if wire::send_unix(&s, &Refusal::new(Code::Malformed, &e).reply(), &[]).is_err() {
                        break;
                    }
                    continue;
                }
            };
            let span = tracing::debug_span!("control", client);
            let _g = span.enter();
            // Never answered: a refusal here would be read as the reply to
            // the call that follows it.
            if let Request::NotifiedQuiet { notify_ns } = &req {
                if let Err(e) = self.notified(notify_ns) {
                    tracing::warn!(client, error = %e, "notify samples dropped");
                }
                continue;
            }
            let (send_page, declaring) = (matches!(req, Request::Hello { .. }), matches!(req, Request::SleepPage));
            if send_page && c.undeclared.is_none() {
                c.undeclared = Some(self.sleepers.undeclared());
            }
            // A request that panics fails alone: the client hears so, and
            // what it holds is still let go when it leaves.
            let answer = Arc::new(Answer { stream: s.clone(), state: Mutex::default() });
            ANSWERING.with(|a| *a.borrow_mut() = Some(answer.clone()));
            let handled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.handle(client, req, fds)));
            ANSWERING.with(|a| *a.borrow_mut() = None);
            let reply = match handled {
                Ok(r) => r.unwrap_or_else(Refusal::reply),
                Err(_) => {
                    tracing::error!(client, "a control request panicked");
                    Refusal::new(Code::TransferFailed, "internal error: this request failed; the daemon's log says where").reply()
                }
            };
            if let Some(u) = c.undeclared.as_mut().filter(|_| declaring && matches!(reply, Reply::Recorded)) {
                u.declared();
            }
            let page = self.page.mem().clone();
            let fds = if send_page && !matches!(reply, Reply::Error { .. }) { vec![page.fd().as_raw_fd()] } else { vec![] };
            // Left even by a request that failed or panicked after leaving
            // it: the work fails its own transfer then, as on a worker.
            let after = AFTER_ANSWER.with(|j| j.borrow_mut().take());
            let answered = answer.finish(&reply, &fds);
            if let Some(job) = after {
                // A request already waiting is not held up behind it.
                if !answered || readable_now(&*s) {
                    if let Err(e) = self.workers.spawn("kvwired-xfer", job, |_| {}) {
                        tracing::error!(client, error = %e, "no thread for a transfer's work");
                    }
                } else {
                    // One that comes while it runs waits at most a tick:
                    // then a worker takes the client over (a stalled peer
                    // would otherwise hold its cancel until the timeout).
                    let parked = Arc::new(Mutex::new(Some(c)));
                    let (d, p) = (self.clone(), parked.clone());
                    self.ticker.add(Box::new(move || {
                        let mut p = p.lock().expect("parked client lock");
                        if !p.as_ref().is_some_and(|c| readable_now(&*c.s)) {
                            return p.is_some();
                        }
                        let (w, c) = (d.clone(), p.take().expect("parked"));
                        if let Err(e) = d.workers.spawn("kvwired-client", move || w.serve(c), |why| tracing::error!(why, "a control thread panicked")) {
                            tracing::error!(client, error = %e, "no thread for the client's next requests; its connection ends");
                        }
                        false
                    }));
                    job();
                    let back = parked.lock().expect("parked client lock").take();
                    match back {
                        Some(back) => c = back,
                        None => return,
                    }
                }
            }
            if !answered {
                break;
            }
        }
    }

    /// Client `client`'s sleep page: one memfd, sealed against shrinking
    /// (or sealable here), at least a sleep page long. Read before each
    /// wake while the client stays.
    fn sleep_page(&self, client: u64, mut fds: Vec<OwnedFd>) -> Result<(), Refusal> {
        if fds.len() != 1 {
            return Err(Refusal::new(Code::Malformed, format!("sleep_page carries one memfd, not {}", fds.len())));
        }
        let fd = fds.pop().expect("one");
        let mem = HostMem::from_file(std::fs::File::from(fd)).map_err(|e| Refusal::new(Code::BadRegion, format!("sleep page: {e}")))?;
        self.sleepers.add(client, Arc::new(mem)).map_err(|e| Refusal::new(Code::BadRegion, format!("sleep page: {e}")))
    }

    /// A client went away: revoke everything it registered.
    fn release_client(&self, client: u64) {
        let mut guard = self.groups.lock().expect("groups lock");
        let st = &mut *guard;
        for g in st.map.values_mut() {
            let gone: Vec<u32> = g.ranks.iter().filter(|(_, r)| r.client == client).map(|(k, _)| *k).collect();
            for rank in gone {
                if let Some(rc) = g.ranks.remove(&rank) {
                    self.forget_rank(&mut st.memory, &mut st.regions, &rc);
                    tracing::info!(client, rank, "client gone: its regions are revoked");
                }
            }
        }
        st.map.retain(|_, g| !g.ranks.is_empty());
        // Its shares: a share nobody is left in goes with its last member.
        for s in st.shares.values_mut() {
            s.members.remove(&client);
        }
        st.shares.retain(|_, s| !s.members.is_empty());
        drop(guard);
        // Receives it prepared and no source has offered into: nobody is
        // left to wait on them, and they would hold slots for good.
        let prepared: Vec<SlotId> = self
            .slots
            .lock()
            .expect("slots lock")
            .map
            .iter()
            .filter(|(_, s)| s.owner == client && s.state == TransferState::Prepared)
            .map(|(&slot, s)| SlotId { slot, gen: s.gen })
            .collect();
        for id in prepared {
            self.finish(id, TransferState::Cancelled, Some("its client went away before a source offered".into()));
        }
        self.discovery_changed();
    }

    fn handle(self: &Arc<Self>, client: u64, req: Request, fds: Vec<OwnedFd>) -> Result<Reply, Refusal> {
        if !matches!(req, Request::RegisterCache(_) | Request::RegisterDeviceCache(_) | Request::RegisterTensors(_) | Request::RegisterDeviceTensors(_) | Request::SleepPage) && !fds.is_empty() {
            return Err(Refusal::new(Code::Malformed, "this request carries no file descriptors"));
        }
        match req {
            Request::Hello { client: name } => {
                tracing::debug!(name, "client hello");
                Ok(Reply::Hello { node: self.cfg.node.clone(), version: peer::PEER_VERSION, slots: FLAG_SLOTS, columns: FLAG_COLUMNS, quiet_notify: true, sleep_page: true })
            }
            Request::RegisterCache(r) => self.register(client, r, fds),
            Request::RegisterDeviceCache(r) => self.register_device(client, r, fds),
            Request::RegisterTensors(r) => self.register_tensors(client, r, fds),
            Request::RegisterDeviceTensors(r) => self.register_device_tensors(client, r, fds),
            Request::ReleaseCache { group, rank } => self.release(client, &group, rank),
            Request::ShareGroup { group, token } => self.share_group(client, &group, &token),
            Request::PrepareReceive(p) => self.prepare(client, p),
            Request::Submit(s) => Ok(self.submit(client, s)),
            Request::Wait { slot, flag, timeout_ms } => self.wait(client, slot, flag, timeout_ms),
            Request::Status { slot } => self.status(client, slot),
            Request::Cancel { slot } => self.cancel(client, slot),
            Request::Produced { group, request, rank, layers } => self.produced_layers(client, &group, &request, rank, layers),
            Request::Stats => Ok(Reply::Stats { text: self.metrics_text() }),
            Request::Notified { notify_ns } | Request::NotifiedQuiet { notify_ns } => self.notified(&notify_ns),
            Request::SleepPage => self.sleep_page(client, fds).map(|()| Reply::Recorded),
        }
    }

    /// A client's waits on the mapped flag page: DESIGN's `notify` hop
    /// (flag published → seen by the waiter), which only the client sees.
    fn notified(&self, notify_ns: &[u64]) -> Result<Reply, Refusal> {
        if notify_ns.len() > MAX_NOTIFIED {
            return Err(Refusal::new(Code::BadRequest, format!("{} notify samples, at most {MAX_NOTIFIED}", notify_ns.len())));
        }
        for &ns in notify_ns {
            self.hops().record(Hop::Notify, Duration::from_nanos(ns), 0);
        }
        Ok(Reply::Recorded)
    }

    fn wait(&self, client: u64, slot: u16, flag: FlagName, timeout_ms: u64) -> Result<Reply, Refusal> {
        self.slot_access(client, slot)?;
        let tag = Tag { slot, layer: flag.column() };
        match self.page.wait(tag, Duration::from_millis(timeout_ms)) {
            Ok(d) => {
                // The control call's waiter is this thread, for the client.
                self.hops().record(Hop::Notify, d, 0);
                Ok(Reply::Waited { notify_ns: d.as_nanos() as u64 })
            }
            Err(e @ kvwire_transport::flags::WaitError::Failed { .. }) => {
                let why = self.slots.lock().expect("slots lock").map.get(&slot).and_then(|s| s.error.clone());
                Err(Refusal::new(Code::TransferFailed, format!("{e}: {}", why.unwrap_or_default())))
            }
            Err(e) => Err(Refusal::new(Code::Timeout, e)),
        }
    }

    fn status(&self, client: u64, slot: u16) -> Result<Reply, Refusal> {
        let id = self.slot_access(client, slot)?;
        let st = self.slots.lock().expect("slots lock");
        let s = st.map.get(&slot).filter(|s| s.gen == id.gen).ok_or_else(|| Refusal::new(Code::UnknownSlot, format!("no transfer in slot {slot}")))?;
        Ok(Reply::Status(TransferStatus {
            slot,
            request: s.request.clone(),
            role: if s.role == Role::Source { "source" } else { "destination" }.into(),
            state: s.state,
            error: s.error.clone(),
            layers: s.layers,
            bytes: s.bytes,
            segments: s.segments,
            reused_bytes: s.reused,
            compressed_bytes: s.compressed,
            // A destination's data plane counts per slot as writes arrive.
            wire_bytes: s.wire + if s.role == Role::Source { 0 } else { self.ep.placement().crossed_bytes(slot) },
            retransmitted_bytes: s.retransmitted,
            hops: s
                .hops
                .iter()
                .map(|(h, (ns, bytes))| HopTotal {
                    hop: (*h).into(),
                    ns: *ns,
                    bytes: *bytes,
                    ranks: s.rank_hops.range((*h, 0)..=(*h, u32::MAX)).map(|(&(_, rank), &(ns, bytes))| RankBusy { rank, ns, bytes }).collect(),
                })
                .collect(),
            marks: s.marks.iter().map(Marked::mark).collect(),
            rails: s.rails.clone(),
            staging_bytes: s.staging,
            in_place_bytes: s.in_place,
            elapsed_ns: s.elapsed.map(|d| d.as_nanos() as u64),
        }))
    }

    fn cancel(&self, client: u64, slot: u16) -> Result<Reply, Refusal> {
        let id = self.slot_access(client, slot)?;
        if !self.finish(id, TransferState::Cancelled, Some("cancelled by client".into())) {
            return Err(Refusal::new(Code::BadRequest, format!("slot {slot} already finished")));
        }
        Metrics::add(&self.metrics.cancelled, 1);
        Ok(Reply::Cancelled)
    }

    /// An engine's rank wrote layers of a request: only the client that
    /// registered that rank of the group may say so.
    fn produced_layers(&self, client: u64, group: &str, request: &str, rank: u32, layers: u16) -> Result<Reply, Refusal> {
        {
            let st = self.groups.lock().expect("groups lock");
            let g = st.access(client, group)?;
            match g.ranks.get(&rank) {
                Some(rc) if rc.client == client => {}
                Some(_) => return Err(Refusal::new(Code::PermissionDenied, format!("rank {rank} of group `{group}` was registered by another client"))),
                None => return Err(Refusal::new(Code::BadRequest, format!("group `{group}` has no rank {rank} registered"))),
            }
            if usize::from(layers) > g.model.layers.len() {
                return Err(Refusal::new(Code::BadRequest, format!("{layers} layers produced, but the model of group `{group}` has {}", g.model.layers.len())));
            }
        }
        self.produced.announce(group, request, rank, layers, Duration::from_secs(self.cfg.limits.transfer_timeout_secs))?;
        Ok(Reply::Announced)
    }

    fn register(&self, client: u64, r: RegisterCache, mut fds: Vec<OwnedFd>) -> Result<Reply, Refusal> {
        if fds.len() != 1 {
            return Err(Refusal::new(Code::Malformed, format!("register_cache needs exactly one memfd, got {}", fds.len())));
        }
        let fd = fds.remove(0);
        self.register_rank(client, r, &[], move |rank, n, total| {
            let mem = HostMem::from_file(File::from(fd)).map_err(|e| format!("memfd: {e}"))?;
            if mem.len() < total {
                return Err(format!("memfd holds {} bytes but rank {rank}'s {n} regions need {total}", mem.len()));
            }
            Ok((vec![Arc::new(mem)], None))
        })
    }

    /// A rank in the engine's own tensors: the memfds are mapped as they
    /// are, and every tensor is checked against the layout's `kv=` order.
    fn register_tensors(&self, client: u64, r: RegisterTensors, fds: Vec<OwnedFd>) -> Result<Reply, Refusal> {
        if r.tensors.is_empty() {
            return Err(Refusal::new(Code::Malformed, "register_tensors lists no tensors (a cache in one memfd of kvwire's layout is register_cache)"));
        }
        if fds.is_empty() {
            return Err(Refusal::new(Code::Malformed, "register_tensors carries no memfd: attach the memories its tensors name"));
        }
        self.register_rank(client, r.cache, &r.tensors, move |_, _, _| {
            fds.into_iter()
                .enumerate()
                .map(|(i, fd)| HostMem::from_file(File::from(fd)).map(Arc::new).map_err(|e| format!("memory {i}: {e}")))
                .collect::<Result<Vec<_>, _>>()
                .map(|mems| (mems, None))
        })
    }

    /// A rank in device memory: opened through the `[device]` backend and
    /// mirrored in host memory that the data plane registers (where a
    /// destination's bytes land; pinned at the rank's first receive).
    fn register_device(&self, client: u64, r: RegisterDeviceCache, fds: Vec<OwnedFd>) -> Result<Reply, Refusal> {
        let Some(backend) = &self.device else {
            return Err(Refusal::new(Code::BadRegion, "this daemon has no device backend: set [device] backend = \"cuda\" (or \"host\", the stand-in)"));
        };
        if fds.len() > 1 {
            return Err(Refusal::new(Code::Malformed, format!("register_device_cache takes at most one fd, got {}", fds.len())));
        }
        let (ordinal, len, ipc) = (r.ordinal, r.len, r.ipc.clone());
        let fd = fds.into_iter().next().map(File::from);
        self.register_rank(client, r.cache, &[], move |rank, _, total| {
            if len < total {
                return Err(format!("device allocation of {len} bytes but rank {rank}'s regions need {total}"));
            }
            let dev = backend.import(DeviceHandle { ordinal, len, fd, ipc }).map_err(|e| format!("device allocation: {e}"))?;
            let mirror = HostMem::new("kvwire-device-mirror", total).map(Arc::new).map_err(|e| format!("host mirror: {e}"))?;
            Ok((vec![mirror.clone()], Some(DeviceRank { pins: Default::default(), devs: vec![Mirrored::new(mirror, dev)] })))
        })
    }

    /// A rank in the engine's own tensors in device memory, each
    /// allocation opened through the `[device]` backend and mirrored in
    /// host memory of its size (pinned at the rank's first receive); the tensors are checked against the
    /// layout over the mirrors, which hold each allocation at its offsets.
    fn register_device_tensors(&self, client: u64, r: RegisterDeviceTensors, fds: Vec<OwnedFd>) -> Result<Reply, Refusal> {
        let Some(backend) = &self.device else {
            return Err(Refusal::new(Code::BadRegion, "this daemon has no device backend: set [device] backend = \"cuda\" (or \"host\", the stand-in)"));
        };
        if r.tensors.is_empty() || r.memories.is_empty() {
            return Err(Refusal::new(Code::Malformed, "register_device_tensors lists no tensors or no device memories (one allocation of kvwire's layout is register_device_cache)"));
        }
        if !fds.is_empty() && fds.len() != r.memories.len() {
            return Err(Refusal::new(Code::Malformed, format!("register_device_tensors carries {} fds for {} device memories: one per memory, in order, or none", fds.len(), r.memories.len())));
        }
        let memories = r.memories.clone();
        let mut fds = fds.into_iter().map(File::from);
        self.register_rank(client, r.cache, &r.tensors, move |_, _, _| {
            let (mut mirrors, mut devs) = (Vec::new(), Vec::new());
            for (i, m) in memories.into_iter().enumerate() {
                let dev = backend.import(DeviceHandle { ordinal: m.ordinal, len: m.len, fd: fds.next(), ipc: m.ipc }).map_err(|e| format!("device memory {i}: {e}"))?;
                let mirror = HostMem::new("kvwire-device-mirror", m.len).map(Arc::new).map_err(|e| format!("host mirror of device memory {i}: {e}"))?;
                mirrors.push(mirror.clone());
                devs.push(Mirrored::new(mirror, dev));
            }
            Ok((mirrors, Some(DeviceRank { pins: Default::default(), devs })))
        })
    }

    /// Checks a rank's registration, takes its memory from `memory(rank,
    /// regions, bytes)` (an error there is a bad region), and registers
    /// its regions: where `tensors` (or, without them, the layout) puts them.
    fn register_rank(
        &self,
        client: u64,
        r: RegisterCache,
        tensors: &[TensorDesc],
        memory: impl FnOnce(u32, usize, u64) -> Result<RankMemory, String>,
    ) -> Result<Reply, Refusal> {
        let (model, format, layout, side) = checked_registration(&r)?;
        if !tensors.is_empty() && layout.kv.is_none() {
            return Err(Refusal::new(Code::BadLayout, "engine tensors need a layout with kv= naming their order: a preset (vllm_nhd, vllm_hnd, flashinfer, flashinfer_hnd, vllm_cpu, vllm_cross) or an order word"));
        }
        let regions = side.regions(&model, r.rank);
        // Engine tensors' regions interleave: what they need is their tensors' size.
        let total = side.rank_bytes(&model, r.rank);
        let (mems, device) = memory(r.rank, regions.len(), total).map_err(refused(Code::BadRegion))?;
        let windows = windows(&side, r.rank, &regions, tensors, format, &mems)?;
        let mut st = self.groups.lock().expect("groups lock");
        st.may_register(client, &r.group)?;
        self.fits(&st, &mems, windows.len())?;
        if let Some(g) = st.map.get(&r.group) {
            if let Some(field) = mismatch(g, &model, format, &r) {
                return Err(Refusal::new(Code::Mismatch, format!("group `{}`: {field} differs from its earlier registration", r.group)));
            }
        }
        let registered = self.register_windows(&mems, &windows)?;
        let mut device = device;
        if let Some(d) = device.as_mut() {
            // Last, so a refusal above leaves no NIC registration behind.
            if let Err(e) = self.choose_device_paths(&mut d.devs) {
                for w in registered.values() {
                    self.revoke_key(w.key);
                }
                return Err(Refusal::new(Code::BadRegion, e));
            }
        }
        let n = registered.len();
        st.memory += bytes_of(&mems);
        st.regions += n;
        let g = st.map.entry(r.group.clone()).or_insert_with(|| Group {
            gen: super::state::next_group_gen(),
            model,
            format,
            layout,
            layout_text: r.layout.clone(),
            num_blocks: r.num_blocks,
            identity: r.identity.clone(),
            shard: side.shard.clone(),
            ranks: BTreeMap::new(),
        });
        g.ranks.insert(r.rank, RankCache { regions: registered, mems, client, device });
        tracing::info!(group = r.group, rank = r.rank, regions = n, bytes = total, "rank registered");
        let complete = g.complete();
        drop(st);
        self.discovery_changed();
        Ok(Reply::Registered { regions: n as u32, bytes: total, complete })
    }

    /// Refuses a registration past `limits.max_memory_bytes` or `max_regions`.
    fn fits(&self, st: &Groups, mems: &[Arc<HostMem>], regions: usize) -> Result<(), Refusal> {
        let l = &self.cfg.limits;
        if st.memory + bytes_of(mems) > l.max_memory_bytes {
            return Err(Refusal::new(Code::Limit, format!("limits.max_memory_bytes {} would be exceeded", l.max_memory_bytes)));
        }
        if st.regions + regions > l.max_regions {
            return Err(Refusal::new(Code::Limit, format!("limits.max_regions {} would be exceeded", l.max_regions)));
        }
        Ok(())
    }

    /// Registers a rank's region windows; none stays registered when one is refused.
    fn register_windows(&self, mems: &[Arc<HostMem>], windows: &[Window]) -> Result<BTreeMap<RegionId, Arc<kvwire_transport::Region>>, Refusal> {
        let mut out = BTreeMap::new();
        for &(id, mem, offset, len) in windows {
            // A cache's own windows are local: peers write only into the
            // windows granted to each transfer.
            match self.register_region(mems[mem].clone(), offset, len, None) {
                Ok(region) => {
                    out.insert(id, region);
                }
                Err(e) => {
                    for w in out.values() {
                        self.revoke_key(w.key);
                    }
                    return Err(Refusal::new(Code::BadRegion, format!("register {id:?}: {e}")));
                }
            }
        }
        Ok(out)
    }

    /// The first client to share `group` sets its token; later ones join
    /// with the same token. A group already registered can be shared only
    /// by a client holding a rank of it.
    fn share_group(&self, client: u64, group: &str, token: &str) -> Result<Reply, Refusal> {
        if token.len() < 16 {
            return Err(Refusal::new(Code::BadRequest, format!("share_group token of {} bytes; at least 16", token.len())));
        }
        let mut st = self.groups.lock().expect("groups lock");
        if let Some(s) = st.shares.get_mut(group) {
            // Constant-time: the token is a secret among the sharing clients.
            if !kvwire_transport::auth::verify(b"kvwire-group-share-v1", group, &[token.as_bytes()], &s.token) {
                return Err(Refusal::new(Code::PermissionDenied, format!("group `{group}` is shared under another token")));
            }
            s.members.insert(client);
            return Ok(Reply::Shared);
        }
        if let Some(g) = st.map.get(group) {
            if !g.ranks.values().any(|r| r.client == client) {
                return Err(Refusal::new(Code::PermissionDenied, format!("group `{group}` belongs to another client; only it can share it")));
            }
        }
        if st.shares.len() >= MAX_SHARES {
            return Err(Refusal::new(Code::Limit, format!("{MAX_SHARES} shared groups already")));
        }
        // The clients holding ranks already are members from the start.
        let mut members: std::collections::BTreeSet<u64> = st.map.get(group).map(|g| g.ranks.values().map(|r| r.client).collect()).unwrap_or_default();
        members.insert(client);
        let token = kvwire_transport::auth::mac(b"kvwire-group-share-v1", group, &[token.as_bytes()]);
        st.shares.insert(group.to_string(), Share { token, members });
        Ok(Reply::Shared)
    }

    /// Revokes a released rank's regions and takes it off the totals the
    /// limits count (`memory`, `regions`: the groups' own, under their lock).
    fn forget_rank(&self, memory: &mut u64, regions: &mut usize, rc: &RankCache) {
        for r in rc.regions.values() {
            self.revoke_key(r.key);
        }
        for d in rc.device.iter().flat_map(|d| &d.devs) {
            self.forget_path(d);
        }
        *memory -= bytes_of(&rc.mems);
        *regions -= rc.regions.len();
    }

    fn release(&self, client: u64, group: &str, rank: u32) -> Result<Reply, Refusal> {
        let mut st = self.groups.lock().expect("groups lock");
        let st = &mut *st;
        let Some(g) = st.map.get_mut(group) else { return Err(Refusal::new(Code::UnknownGroup, format!("no group `{group}`"))) };
        match g.ranks.get(&rank) {
            Some(rc) if rc.client != client => {
                return Err(Refusal::new(Code::PermissionDenied, format!("rank {rank} of `{group}` was registered by another client")))
            }
            None => return Err(Refusal::new(Code::UnknownGroup, format!("group `{group}` has no rank {rank}"))),
            Some(_) => {}
        }
        let rc = g.ranks.remove(&rank).expect("checked");
        self.forget_rank(&mut st.memory, &mut st.regions, &rc);
        if g.ranks.is_empty() {
            st.map.remove(group);
        }
        self.discovery_changed();
        Ok(Reply::Released)
    }

    fn prepare(&self, client: u64, p: PrepareReceive) -> Result<Reply, Refusal> {
        let unpinned = {
            let st = self.groups.lock().expect("groups lock");
            let g = st.access(client, &p.group)?;
            g.require_complete(&p.group)?;
            if p.prefix_tokens > p.tokens {
                return Err(Refusal::new(Code::BadRequest, format!("prefix_tokens {} exceeds tokens {}", p.prefix_tokens, p.tokens)));
            }
            Side::with_table(&g.model, &g.layout, g.format, p.tokens, p.block_table.clone(), g.num_blocks).map_err(|e| Refusal::new(Code::BadRequest, format!("destination request: {e}")))?;
            g.unpinned()
        };
        // A device-resident rank's first receive pins its mirrors (outside
        // the groups lock: pinning a large mirror takes a while). Unpinned,
        // the copies still run, from pageable memory, only slower.
        if let Some(backend) = &self.device {
            for (pins, mirrors) in unpinned {
                let mut pins = pins.lock().expect("pins lock");
                if !pins.is_empty() {
                    continue;
                }
                for m in mirrors {
                    match backend.pin(&m) {
                        Ok(pin) => pins.push(Pin::new(pin, m.len(), &self.metrics.pinned_mirror_bytes)),
                        Err(e) => tracing::warn!(group = p.group, error = %e, "cannot pin a device rank's host mirror; its copies run from pageable memory"),
                    }
                }
            }
        }
        let (dup, mine) = {
            let slots = self.slots.lock().expect("slots lock");
            let dup = slots.live(&self.live).any(|(_, s)| s.recv.as_ref().is_some_and(|r| r.group == p.group && r.request == p.request));
            (dup, slots.live(&self.live).filter(|(_, s)| s.owner == client && s.state == TransferState::Prepared).count())
        };
        if dup {
            return Err(Refusal::new(Code::BadRequest, format!("request `{}` of group `{}` is already prepared", p.request, p.group)));
        }
        let quota = self.cfg.limits.max_prepared_per_client;
        if mine >= quota {
            return Err(Refusal::new(Code::Limit, format!("limits.max_prepared_per_client {quota} reached: this client holds {mine} receives no source has offered into")));
        }
        let (request, group, source) = (p.request.clone(), p.group.clone(), p.source.clone());
        let (id, _) = self.alloc_slot(Role::Destination, &request, &group, client, Some(p))?;
        let announce = source.map(|to| {
            let told = self.announce(id, &to);
            if let Err(why) = &told {
                tracing::debug!(slot = id.slot, to, why, "receive not announced; its source will offer");
            }
            told
        });
        Ok(Reply::Prepared { slot: id.slot, announce })
    }
}

/// The model, format, layout and one-token side a registration names, or
/// what is wrong with it.
fn checked_registration(r: &RegisterCache) -> Result<(ModelSpec, CacheFormat, LayoutSpec, Side), Refusal> {
    let model = match &r.model {
        ModelSource::HfConfig(t) if !t.trim_start().starts_with('{') => {
            return Err(Refusal::new(Code::BadModel, "model: hf_config is not a config.json's text (it does not start with `{`); a path is read by the client library, not by the daemon"));
        }
        ModelSource::Builtin(n) => layout::builtin(n),
        ModelSource::HfConfig(t) => layout::from_hf_config(&r.group, t),
        ModelSource::Toml(t) => layout::from_toml_spec(&r.group, t),
    };
    let model = model.map_err(|e| Refusal::new(Code::BadModel, format!("model: {e}")))?;
    if model.layers.len() > usize::from(MAX_TRANSFER_LAYERS) {
        return Err(Refusal::new(Code::BadModel, format!("model has {} layers; at most {MAX_TRANSFER_LAYERS}", model.layers.len())));
    }
    let format = CacheFormat::parse(&r.format).map_err(|e| Refusal::new(Code::BadLayout, format!("format: {e}")))?;
    // The identity states the format the bytes are in; a cache registered
    // as another would fail every transfer's manifest later.
    match CacheFormat::parse(&r.identity.format) {
        Ok(f) if f == format => {}
        Ok(f) => return Err(Refusal::new(Code::Mismatch, format!("the identity's format is {} but the cache is registered as {}", f.id(), format.id()))),
        Err(e) => return Err(Refusal::new(Code::BadLayout, format!("identity format: {e}"))),
    }
    let layout = LayoutSpec::parse(&r.layout).map_err(|e| Refusal::new(Code::BadLayout, format!("layout: {e}")))?;
    if r.num_blocks == 0 {
        return Err(Refusal::new(Code::BadLayout, "num_blocks must be > 0"));
    }
    let side = Side::with_table(&model, &layout, format, 1, vec![0], r.num_blocks).map_err(|e| Refusal::new(Code::BadLayout, format!("layout: {e}")))?;
    if r.rank as usize >= side.shard.ranks.len() {
        return Err(Refusal::new(Code::BadLayout, format!("rank {} but layout `{}` has {} ranks", r.rank, r.layout, side.shard.ranks.len())));
    }
    Ok((model, format, layout, side))
}

/// The first field in which a registration differs from its group's earlier ones.
fn mismatch(g: &Group, model: &ModelSpec, format: CacheFormat, r: &RegisterCache) -> Option<&'static str> {
    if g.model != *model {
        Some("model")
    } else if g.format != format {
        Some("format")
    } else if g.layout_text != r.layout {
        Some("layout")
    } else if g.num_blocks != r.num_blocks {
        Some("num_blocks")
    } else if g.identity != r.identity {
        Some("identity")
    } else if g.ranks.contains_key(&r.rank) {
        Some("rank (already registered)")
    } else {
        None
    }
}

/// Where each of a rank's regions is registered: kvwire's layout back to
/// back in one memfd; an engine order where the client's tensors are (each
/// checked), or its tensors back to back in one memfd when none are listed.
fn windows(side: &Side, rank: u32, regions: &[(RegionId, u64)], tensors: &[TensorDesc], format: CacheFormat, mems: &[Arc<HostMem>]) -> Result<Vec<Window>, Refusal> {
    let Some(rt) = side.engine.get(rank as usize) else {
        let mut offset = 0;
        return Ok(regions
            .iter()
            .map(|&(id, len)| {
                offset += len;
                (id, 0, offset - len, len)
            })
            .collect());
    };
    let at = if tensors.is_empty() {
        let need: u64 = rt.tensors.iter().map(|e| e.bytes()).sum();
        if mems[0].len() < need {
            return Err(Refusal::new(Code::BadRegion, format!("memfd holds {} bytes but rank {rank}'s {} engine tensors need {need}", mems[0].len(), rt.tensors.len())));
        }
        tensors::packed_offsets(&rt.tensors)
    } else {
        let sizes: Vec<u64> = mems.iter().map(|m| m.len()).collect();
        tensors::match_tensors(tensors, &rt.tensors, format, &sizes).map_err(|e| Refusal::new(Code::BadRegion, format!("rank {rank}: {e}")))?
    };
    Ok(rt.windows.iter().map(|w| (w.id, at[w.tensor].0 as usize, at[w.tensor].1 + w.start, w.len)).collect())
}
