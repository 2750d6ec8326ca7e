//! The daemon: cache groups registered by local clients, transfer slots,
//! the control socket, the peer listener, and the threads that move bytes.

use crate::config::{Config, PeerConfig, TransportKind};
use kvwire_client::control::*;
use crate::metrics::Metrics;
use crate::peer::{self, Accept, Expect, Offer, PeerMsg, PeerRegion, RailAddr, RankRails};
use kvwire_client::wire::{self, read_msg, write_msg, WireError};
use kvwire_core::layout::{self, ModelSpec};
use crate::staging;
use crate::stripe;
use kvwire_core::codec::Codec;
use kvwire_core::manifest::{checksums_at_destination, Expected, Manifest};
use kvwire_core::plan::{self, CostModel, Plan, PlanInput, Side};
use kvwire_core::reuse::{check_prefix, CacheIdentity};
use kvwire_core::shard::{LayoutSpec, RegionId, ShardMap};
use kvwire_core::CacheFormat;
use kvwire_transport::shm::{ShmEndpoint, ShmLimits};
use kvwire_transport::tcp::{TcpEndpoint, TcpLimits};
use kvwire_transport::device::bound::{Backend, BoundMem, DeviceHandle};
use kvwire_transport::device::host::HostDevice;
use kvwire_transport::verbs::{VerbsEndpoint, VerbsLimits};
use kvwire_transport::{Batch, Endpoint, FlagTable, Hop, HostMem, Hops, Placement, Region, Registry, Tag, TransportError, WriteOp};
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

struct RankCache {
    // Field order: regions (revoked on release) before the memory.
    regions: BTreeMap<RegionId, Arc<Region>>,
    mem: Arc<HostMem>,
    client: u64,
    // A device-resident rank: `mem` is this daemon's host mirror of it.
    device: Option<DeviceRank>,
}

/// A rank whose cache lives in device memory, staged through `mem`.
struct DeviceRank {
    // Field order: unpin the mirror before the allocation is let go.
    _pin: Box<dyn std::any::Any + Send + Sync>,
    dev: Arc<dyn BoundMem>,
}

struct Group {
    model: ModelSpec,
    format: CacheFormat,
    layout: LayoutSpec,
    layout_text: String,
    num_blocks: u32,
    identity: CacheIdentity,
    shard: ShardMap,
    ranks: BTreeMap<u32, RankCache>,
}

impl Group {
    fn complete(&self) -> bool {
        self.ranks.len() == self.shard.ranks.len()
    }

    /// Every registered region by (rank, region), held so a transfer keeps
    /// them alive even if their client goes away meanwhile.
    fn regions(&self) -> HashMap<(u32, RegionId), Arc<Region>> {
        self.ranks.iter().flat_map(|(rank, rc)| rc.regions.iter().map(move |(id, r)| ((*rank, *id), r.clone()))).collect()
    }

    /// The device-resident ranks and their allocations.
    fn devices(&self) -> HashMap<u32, Arc<dyn BoundMem>> {
        self.ranks.iter().filter_map(|(rank, rc)| rc.device.as_ref().map(|d| (*rank, d.dev.clone()))).collect()
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    Source,
    Destination,
}

/// A slot and the transfer in it: slots are reused, so everything a
/// transfer's threads do to its slot is checked against `gen` first and a
/// stale thread can never touch the transfer that took the slot after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct SlotId {
    slot: u16,
    gen: u64,
}

struct Slot {
    gen: u64,
    role: Role,
    request: String,
    // The group it reads or fills, and the client that made it: only
    // clients holding a rank of that group may look at or cancel it.
    group: String,
    owner: u64,
    // Destination: the region keys made for this transfer alone, revoked
    // when it ends, so a late write of it is refused and can never land
    // in blocks that were reused for another request.
    keys: Vec<u32>,
    retransmitted: u64,
    rails: Vec<RailUse>,
    state: TransferState,
    error: Option<String>,
    layers: u16,
    bytes: u64,
    segments: u64,
    reused: u64,
    wire: u64,
    hops: BTreeMap<&'static str, (u64, u64)>,
    marks: Vec<Mark>,
    // The peer daemon on the other end, once known.
    peer: String,
    started: Instant,
    elapsed: Option<Duration>,
    recv: Option<PrepareReceive>,
    stop: Arc<AtomicBool>,
}

#[derive(Default)]
struct State {
    groups: HashMap<String, Group>,
    slots: HashMap<u16, Slot>,
    next_slot: u16,
    next_gen: u64,
    memory: u64,
    regions: usize,
}

/// A running daemon.
pub struct Daemon {
    cfg: Config,
    secret: Vec<u8>,
    ep: Arc<dyn Endpoint>,
    // The page clients map. The data plane's placement publishes into its
    // own table (bytes counted); a layer reaches this page only after it
    // was also verified.
    page: FlagTable,
    state: Mutex<State>,
    /// Counters.
    pub metrics: Metrics,
    stop: AtomicBool,
    next_client: AtomicU64,
    peer_addr: String,
    // Hop histograms per peer daemon, next to the daemon-wide ones.
    peer_hops: Mutex<BTreeMap<String, Arc<Hops>>>,
    // Every data rail, `ep`'s first. Extra rails are endpoints of the same
    // transport (tcp listeners, verbs devices) sharing `ep`'s registry and
    // placement, so a key is valid on each of them and a layer's bytes
    // count the same whichever rails carried them.
    rails: Vec<RailEp>,
    // What sysfs (or the topology file) says, when a rail names a device.
    topology: Option<kvwire_core::topology::HostTopology>,
    // `[device]`: how device-resident caches are opened and copied.
    device: Option<Backend>,
    // This daemon's entry in etcd, when `[discovery]` names etcd; set at
    // the end of `start`, once every listener is bound.
    discovery: std::sync::OnceLock<crate::discovery::Discovery>,
}

struct RailEp {
    name: String,
    advertise: String,
    // Its device, for locality (None: unknown).
    device: Option<String>,
    // Extra rails' endpoints (None for rail0, which is `ep`): writes
    // arriving on one are placed through the shared registry and
    // placement, and a source connects through it to the peer's rail of
    // the same number.
    ep: Option<Arc<dyn Endpoint>>,
}

impl std::fmt::Debug for Daemon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Daemon").field("node", &self.cfg.node).finish()
    }
}

/// A source's peer-control connection while its bytes flow. A heartbeat
/// thread pings the destination, so the destination can tell a dead source
/// from a slow one, and an unanswered ping marks the destination lost.
struct PeerLink {
    stream: Mutex<TcpStream>,
    peer: String,
    timeout: Duration,
    lost: Mutex<Option<String>>,
    ended: AtomicBool,
}

impl PeerLink {
    /// One exchange; the lock keeps pings and the final message apart.
    fn call(&self, m: &PeerMsg) -> Result<PeerMsg, String> {
        let mut s = self.stream.lock().expect("peer link lock");
        write_msg(&mut *s, m).and_then(|()| read_msg::<PeerMsg>(&mut *s)).map_err(|e| match e {
            e if e.is_timeout() => {
                format!("peer `{}` silent for {}s", self.peer, self.timeout.as_secs())
            }
            e => format!("peer `{}` went away mid-transfer: {e}", self.peer),
        })
    }

    fn lost(&self) -> Option<String> {
        self.lost.lock().expect("peer link lock").clone()
    }

    /// Pings about four times per peer timeout until [`PeerLink::end`].
    fn heartbeat(&self) {
        let every = (self.timeout / 4).max(Duration::from_millis(50));
        loop {
            let next = Instant::now() + every;
            while Instant::now() < next {
                if self.ended.load(Ordering::Acquire) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20).min(every));
            }
            let why = match self.call(&PeerMsg::Ping) {
                Ok(PeerMsg::Pong) => continue,
                Ok(other) => format!("peer `{}` answered a ping with {other:?}", self.peer),
                Err(e) => e,
            };
            if !self.ended.load(Ordering::Acquire) {
                tracing::warn!(peer = self.peer, why, "peer lost");
                *self.lost.lock().expect("peer link lock") = Some(why);
            }
            return;
        }
    }

    /// Stops the heartbeat and sends the transfer's last word (`Done` or `Abort`).
    fn end(&self, m: &PeerMsg) {
        self.ended.store(true, Ordering::Release);
        if self.lost().is_none() {
            let _ = self.call(m);
        }
    }
}

fn err(code: Code, m: impl std::fmt::Display) -> Reply {
    Reply::error(code, m.to_string())
}

fn flags_placement() -> anyhow::Result<Arc<Placement>> {
    Ok(Arc::new(Placement::new(FlagTable::new(FLAG_SLOTS, MAX_TRANSFER_LAYERS)?, Arc::new(Hops::default()))))
}

impl Daemon {
    /// This daemon's node name, from its config.
    pub fn node(&self) -> &str {
        &self.cfg.node
    }

    /// Starts the data plane and binds every listener; threads serve until [`Daemon::shutdown`].
    pub fn start(cfg: Config) -> anyhow::Result<Arc<Daemon>> {
        cfg.validate()?;
        let secret = cfg.secret()?;
        let t = &cfg.transport;
        // Clients register at most `max_regions`; each transfer into this
        // host adds its own keys for the same regions (`Slot::keys`), so the
        // data plane holds several times that.
        let keys = cfg.limits.max_regions.saturating_mul(4);
        // Kept to open the other devices as its rails.
        let mut verbs: Option<Arc<VerbsEndpoint>> = None;
        let ep: Arc<dyn Endpoint> = match t.kind {
            TransportKind::Tcp => {
                let reg = Arc::new(Registry::new(keys));
                TcpEndpoint::bind(&cfg.node, t.tcp_listen.parse()?, reg, flags_placement()?, TcpLimits::default())?
            }
            TransportKind::Shm => {
                let reg = Arc::new(Registry::new(keys));
                ShmEndpoint::new(&cfg.node, t.shm_dir.as_deref(), reg, flags_placement()?, ShmLimits::default())?
            }
            TransportKind::Verbs => {
                let limits = VerbsLimits {
                    listen: t.verbs_listen.clone(),
                    node: cfg.node.clone(),
                    max_regions: keys,
                    slots: FLAG_SLOTS,
                    layers: MAX_TRANSFER_LAYERS,
                    ..VerbsLimits::default()
                };
                let v = Arc::new(VerbsEndpoint::new(t.verbs_device.as_deref(), t.verbs_port, t.verbs_gid_index, limits)?);
                verbs = Some(v.clone());
                v
            }
        };
        let mut rails = vec![RailEp {
            name: "rail0".into(),
            advertise: match (&t.tcp_advertise, t.kind) {
                (Some(a), TransportKind::Tcp) => a.clone(),
                _ => ep.local_addr(),
            },
            // With several verbs rails, each one's device is its RDMA
            // device unless named otherwise (one rail needs no locality).
            device: t.device.clone().or_else(|| verbs.as_ref().filter(|_| !cfg.rails.is_empty()).map(|v| v.info().device.clone())),
            ep: None,
        }];
        for r in &cfg.rails {
            let (extra, device): (Arc<dyn Endpoint>, Option<String>) = match &verbs {
                Some(v) => {
                    let rail = v
                        .rail(r.verbs_device.as_deref(), r.verbs_port, r.verbs_gid_index, &r.verbs_listen)
                        .map_err(|e| anyhow::anyhow!("rails `{}` verbs_device {}: {e}", r.name, r.verbs_device.as_deref().unwrap_or("?")))?;
                    let device = r.device.clone().unwrap_or_else(|| rail.info().device.clone());
                    (Arc::new(rail), Some(device))
                }
                None => {
                    let listen = r.tcp_listen.parse().map_err(|e| anyhow::anyhow!("rails `{}` tcp_listen {}: {e}", r.name, r.tcp_listen))?;
                    let extra = TcpEndpoint::bind(&cfg.node, listen, ep.registry().clone(), ep.placement().clone(), TcpLimits::default())
                        .map_err(|e| anyhow::anyhow!("rails `{}` tcp_listen {}: {e}", r.name, r.tcp_listen))?;
                    (extra, r.device.clone())
                }
            };
            let advertise = r.tcp_advertise.clone().unwrap_or_else(|| extra.local_addr());
            rails.push(RailEp { name: r.name.clone(), advertise, device, ep: Some(extra) });
        }
        // Locality: only when a rail names its device. A device or file that
        // does not match this host stops the daemon, named.
        let topology = if rails.iter().any(|r| r.device.is_some()) || t.topology_file.is_some() {
            let topo = kvwire_transport::topology::discover(std::path::Path::new("/"), t.topology_file.as_deref())?;
            for r in &rails {
                if let Some(dev) = &r.device {
                    if topo.rail_device(dev).is_none() {
                        let names: Vec<&str> = topo.devices.iter().filter(|d| d.can_be_rail()).map(|d| d.name.as_str()).collect();
                        anyhow::bail!("rail `{}` device `{dev}`: no such RDMA device or netdev on this host (there are: {})", r.name, names.join(", "));
                    }
                }
            }
            Some(topo)
        } else {
            None
        };
        let dc = &cfg.device;
        let device = match dc.backend.as_str() {
            "none" => None,
            "host" => {
                let mut d = HostDevice::new(dc.ordinal).with_delay(Duration::from_millis(dc.standin_delay_ms));
                if let Some(n) = dc.standin_fail_copy {
                    d = d.fail_copy(n);
                }
                Some(Backend::Host(d))
            }
            kind => Some(Backend::open(kind, cfg.device.ordinal).map_err(|e| anyhow::anyhow!("device.backend `{kind}`: {e}"))?),
        };
        let peer_listener = TcpListener::bind(&cfg.peer_listen).map_err(|e| anyhow::anyhow!("peer_listen {}: {e}", cfg.peer_listen))?;
        let peer_addr = peer_listener.local_addr()?.to_string();
        let _ = std::fs::remove_file(&cfg.control_socket);
        if let Some(dir) = cfg.control_socket.parent() {
            std::fs::create_dir_all(dir).ok();
        }
        let control = UnixListener::bind(&cfg.control_socket)
            .map_err(|e| anyhow::anyhow!("control_socket {}: {e}", cfg.control_socket.display()))?;
        std::fs::set_permissions(&cfg.control_socket, std::fs::Permissions::from_mode(0o600))?;
        let metrics_listener = if cfg.metrics_listen.is_empty() {
            None
        } else {
            Some(TcpListener::bind(&cfg.metrics_listen).map_err(|e| anyhow::anyhow!("metrics_listen {}: {e}", cfg.metrics_listen))?)
        };
        let d = Arc::new(Daemon {
            cfg,
            secret,
            ep,
            page: FlagTable::new(FLAG_SLOTS, FLAG_COLUMNS)?,
            state: Mutex::new(State::default()),
            metrics: Metrics::default(),
            stop: AtomicBool::new(false),
            next_client: AtomicU64::new(1),
            peer_addr,
            peer_hops: Mutex::new(BTreeMap::new()),
            rails,
            topology,
            device,
            discovery: std::sync::OnceLock::new(),
        });
        let dd = d.clone();
        std::thread::Builder::new().name("kvwired-control".into()).spawn(move || dd.control_loop(control))?;
        let dd = d.clone();
        std::thread::Builder::new().name("kvwired-peers".into()).spawn(move || dd.peer_loop(peer_listener))?;
        if let Some(l) = metrics_listener {
            let dd = d.clone();
            std::thread::Builder::new().name("kvwired-metrics".into()).spawn(move || dd.metrics_loop(l))?;
        }
        tracing::info!(node = d.cfg.node, transport = d.ep.transport(), data = d.ep.local_addr(), peer = d.peer_addr, "kvwired started");
        if !d.cfg.discovery.etcd.is_empty() {
            use crate::discovery::{Discovery, Entry, Serves};
            let data = d.rails.iter().map(|r| r.advertise.clone()).collect();
            let me = Entry::for_daemon(&d.cfg, &d.peer_addr, d.ep.transport(), data);
            // Weak: what the entry says it serves is read from the groups
            // without keeping the daemon alive.
            let weak = Arc::downgrade(&d);
            let serves = move || {
                weak.upgrade().map_or_else(Serves::default, |d| Serves::of(d.state.lock().expect("state lock").groups.values().map(|g| &g.identity)))
            };
            let _ = d.discovery.set(Discovery::start(&d.cfg.discovery, me, serves)?);
        }
        Ok(d)
    }

    /// The peer listener's bound address.
    pub fn peer_addr(&self) -> &str {
        &self.peer_addr
    }

    /// The data plane's address.
    pub fn data_addr(&self) -> String {
        self.ep.local_addr()
    }

    /// Stops accepting; in-flight transfers fail their flags. First revokes
    /// the etcd lease, so peers stop finding this daemon at once.
    pub fn shutdown(&self) {
        if let Some(d) = self.discovery.get() {
            d.shutdown();
        }
        self.stop.store(true, Ordering::Release);
        let _ = UnixStream::connect(&self.cfg.control_socket);
        let _ = TcpStream::connect(&self.peer_addr);
        let _ = std::fs::remove_file(&self.cfg.control_socket);
    }

    fn hops(&self) -> &Arc<Hops> {
        self.ep.placement().hops()
    }

    /// Prometheus text of every counter and hop histogram.
    pub fn metrics_text(&self) -> String {
        let per_peer: Vec<(String, Arc<Hops>)> =
            self.peer_hops.lock().expect("peer hops lock").iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        self.metrics.render(&self.cfg.node, self.hops(), &per_peer)
    }

    // ------------------------------------------------------------ control

    fn control_loop(self: Arc<Self>, l: UnixListener) {
        let live = Arc::new(AtomicU64::new(0));
        for s in l.incoming() {
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            let Ok(s) = s else { continue };
            if live.load(Ordering::Acquire) >= self.cfg.limits.max_clients as u64 {
                let _ = wire::send_unix(&s, &err(Code::Limit, format!("at most {} clients", self.cfg.limits.max_clients)), &[]);
                continue;
            }
            let d = self.clone();
            let live = live.clone();
            live.fetch_add(1, Ordering::AcqRel);
            let spawned = std::thread::Builder::new().name("kvwired-client".into()).spawn(move || {
                d.serve_client(s);
                live.fetch_sub(1, Ordering::AcqRel);
            });
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "cannot spawn a client thread");
            }
        }
    }

    fn serve_client(self: &Arc<Self>, s: UnixStream) {
        let creds = nix::sys::socket::getsockopt(&s, nix::sys::socket::sockopt::PeerCredentials);
        let me = nix::unistd::geteuid().as_raw();
        match creds {
            Ok(c) if c.uid() == me => {}
            Ok(c) => {
                Metrics::add(&self.metrics.clients_refused, 1);
                tracing::warn!(uid = c.uid(), pid = c.pid(), "control client of another uid refused");
                let _ = wire::send_unix(&s, &err(Code::PermissionDenied, format!("uid {} may not use this daemon (runs as uid {me})", c.uid())), &[]);
                // Take the client's first message before closing, so its
                // send does not fail with a broken pipe before it reads why.
                let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
                let _ = wire::recv_unix(&s);
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, "SO_PEERCRED failed; client refused");
                return;
            }
        }
        let client = self.next_client.fetch_add(1, Ordering::Relaxed);
        loop {
            let (body, fds) = match wire::recv_unix(&s) {
                Ok(m) => m,
                Err(WireError::Closed) => break,
                Err(e @ (WireError::TooLong(_) | WireError::Fds(_))) => {
                    let _ = wire::send_unix(&s, &err(Code::Malformed, &e), &[]);
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
                    if wire::send_unix(&s, &err(Code::Malformed, &e), &[]).is_err() {
                        break;
                    }
                    continue;
                }
            };
            let span = tracing::debug_span!("control", client);
            let _g = span.enter();
            let (reply, send_flag_page) = self.handle(client, req, fds);
            let page = self.page.mem().clone();
            let fds = if send_flag_page { vec![page.fd().as_raw_fd()] } else { vec![] };
            if wire::send_unix(&s, &reply, &fds).is_err() {
                break;
            }
        }
        self.release_client(client);
    }

    /// A client went away: revoke everything it registered.
    fn release_client(&self, client: u64) {
        let mut st = self.state.lock().expect("state lock");
        let st = &mut *st;
        for g in st.groups.values_mut() {
            let gone: Vec<u32> = g.ranks.iter().filter(|(_, r)| r.client == client).map(|(k, _)| *k).collect();
            for rank in gone {
                if let Some(rc) = g.ranks.remove(&rank) {
                    for r in rc.regions.values() {
                        self.revoke_key(r.key);
                    }
                    st.memory -= rc.mem.len();
                    st.regions -= rc.regions.len();
                    tracing::info!(client, rank, "client gone: its regions are revoked");
                }
            }
        }
        st.groups.retain(|_, g| !g.ranks.is_empty());
        if let Some(d) = self.discovery.get() { d.changed() }
    }

    fn handle(self: &Arc<Self>, client: u64, req: Request, fds: Vec<std::os::fd::OwnedFd>) -> (Reply, bool) {
        if !matches!(req, Request::RegisterCache(_) | Request::RegisterDeviceCache(_)) && !fds.is_empty() {
            return (err(Code::Malformed, "this request carries no file descriptors"), false);
        }
        match req {
            Request::Hello { client: name } => {
                tracing::debug!(name, "client hello");
                let r = Reply::Hello { node: self.cfg.node.clone(), version: peer::PEER_VERSION, slots: FLAG_SLOTS, columns: FLAG_COLUMNS };
                (r, true)
            }
            Request::RegisterCache(r) => (self.register(client, r, fds), false),
            Request::RegisterDeviceCache(r) => (self.register_device(client, r, fds), false),
            Request::ReleaseCache { group, rank } => (self.release(client, &group, rank), false),
            Request::PrepareReceive(p) => (self.prepare(client, p), false),
            Request::Submit(s) => (self.submit(client, s), false),
            Request::Wait { slot, flag, timeout_ms } => {
                if let Err(r) = slot_access(&self.state.lock().expect("state lock"), client, slot) {
                    return (*r, false);
                }
                let tag = Tag { slot, layer: flag.column() };
                match self.page.wait(tag, Duration::from_millis(timeout_ms)) {
                    Ok(d) => (Reply::Waited { notify_ns: d.as_nanos() as u64 }, false),
                    Err(e @ kvwire_transport::flags::WaitError::Failed { .. }) => {
                        let why = self.state.lock().expect("state lock").slots.get(&slot).and_then(|s| s.error.clone());
                        (err(Code::TransferFailed, format!("{e}: {}", why.unwrap_or_default())), false)
                    }
                    Err(e) => (err(Code::Timeout, e), false),
                }
            }
            Request::Status { slot } => {
                let st = self.state.lock().expect("state lock");
                if let Err(r) = slot_access(&st, client, slot) {
                    return (*r, false);
                }
                match st.slots.get(&slot) {
                    Some(s) => (
                        Reply::Status(TransferStatus {
                            slot,
                            request: s.request.clone(),
                            role: if s.role == Role::Source { "source" } else { "destination" }.into(),
                            state: s.state,
                            error: s.error.clone(),
                            layers: s.layers,
                            bytes: s.bytes,
                            segments: s.segments,
                            reused_bytes: s.reused,
                            wire_bytes: s.wire,
                            retransmitted_bytes: s.retransmitted,
                            hops: s.hops.iter().map(|(h, (ns, bytes))| HopTotal { hop: (*h).into(), ns: *ns, bytes: *bytes }).collect(),
                            marks: s.marks.clone(),
                            rails: s.rails.clone(),
                            elapsed_ns: s.elapsed.map(|d| d.as_nanos() as u64),
                        }),
                        false,
                    ),
                    None => (err(Code::UnknownSlot, format!("no transfer in slot {slot}")), false),
                }
            }
            Request::Cancel { slot } => {
                let id = {
                    let st = self.state.lock().expect("state lock");
                    if let Err(r) = slot_access(&st, client, slot) {
                        return (*r, false);
                    }
                    SlotId { slot, gen: st.slots[&slot].gen }
                };
                if self.finish(id, TransferState::Cancelled, Some("cancelled by client".into())) {
                    Metrics::add(&self.metrics.cancelled, 1);
                    (Reply::Cancelled, false)
                } else {
                    (err(Code::BadRequest, format!("slot {slot} already finished")), false)
                }
            }
            Request::Stats => (Reply::Stats { text: self.metrics_text() }, false),
        }
    }

    fn register(&self, client: u64, r: RegisterCache, mut fds: Vec<std::os::fd::OwnedFd>) -> Reply {
        if fds.len() != 1 {
            return err(Code::Malformed, format!("register_cache needs exactly one memfd, got {}", fds.len()));
        }
        let fd = fds.remove(0);
        self.register_rank(client, r, move |rank, n, total| {
            let mem = HostMem::from_file(File::from(fd)).map_err(|e| format!("memfd: {e}"))?;
            if mem.len() < total {
                return Err(format!("memfd holds {} bytes but rank {rank}'s {n} regions need {total}", mem.len()));
            }
            Ok((Arc::new(mem), None))
        })
    }

    /// A rank in device memory: opened through the `[device]` backend and
    /// mirrored in pinned host memory that the data plane registers.
    fn register_device(&self, client: u64, r: RegisterDeviceCache, fds: Vec<std::os::fd::OwnedFd>) -> Reply {
        let Some(backend) = &self.device else {
            return err(Code::BadRegion, "this daemon has no device backend: set [device] backend = \"cuda\" (or \"host\", the stand-in)");
        };
        if fds.len() > 1 {
            return err(Code::Malformed, format!("register_device_cache takes at most one fd, got {}", fds.len()));
        }
        let (ordinal, len, ipc) = (r.ordinal, r.len, r.ipc.clone());
        let fd = fds.into_iter().next().map(File::from);
        self.register_rank(client, r.cache, move |rank, _, total| {
            if len < total {
                return Err(format!("device allocation of {len} bytes but rank {rank}'s regions need {total}"));
            }
            let dev = backend.import(DeviceHandle { ordinal, len, fd, ipc }).map_err(|e| format!("device allocation: {e}"))?;
            let mirror = HostMem::new("kvwire-device-mirror", total).map(Arc::new).map_err(|e| format!("host mirror: {e}"))?;
            let pin = backend.pin(&mirror).map_err(|e| format!("pinning the host mirror: {e}"))?;
            Ok((mirror, Some(DeviceRank { _pin: pin, dev })))
        })
    }

    /// Checks a rank's registration, takes its memory from `memory(rank,
    /// regions, bytes)` (an error there is a bad region), and registers
    /// its regions.
    fn register_rank(
        &self,
        client: u64,
        r: RegisterCache,
        memory: impl FnOnce(u32, usize, u64) -> Result<(Arc<HostMem>, Option<DeviceRank>), String>,
    ) -> Reply {
        let model = match &r.model {
            ModelSource::Builtin(n) => layout::builtin(n),
            ModelSource::HfConfig(t) => layout::from_hf_config(&r.group, t),
            ModelSource::Toml(t) => layout::from_toml_spec(&r.group, t),
        };
        let model = match model {
            Ok(m) => m,
            Err(e) => return err(Code::BadModel, format!("model: {e}")),
        };
        if model.layers.len() > usize::from(MAX_TRANSFER_LAYERS) {
            return err(Code::BadModel, format!("model has {} layers; at most {MAX_TRANSFER_LAYERS}", model.layers.len()));
        }
        let format = match CacheFormat::parse(&r.format) {
            Ok(f) => f,
            Err(e) => return err(Code::BadLayout, format!("format: {e}")),
        };
        let layout = match LayoutSpec::parse(&r.layout) {
            Ok(l) => l,
            Err(e) => return err(Code::BadLayout, format!("layout: {e}")),
        };
        if r.num_blocks == 0 {
            return err(Code::BadLayout, "num_blocks must be > 0");
        }
        let side = match Side::with_table(&model, &layout, format, 1, vec![0], r.num_blocks) {
            Ok(s) => s,
            Err(e) => return err(Code::BadLayout, format!("layout: {e}")),
        };
        if r.rank as usize >= side.shard.ranks.len() {
            return err(Code::BadLayout, format!("rank {} but layout `{}` has {} ranks", r.rank, r.layout, side.shard.ranks.len()));
        }
        let regions = side.regions(&model, r.rank);
        let total: u64 = regions.iter().map(|(_, l)| l).sum();
        let (mem, device) = match memory(r.rank, regions.len(), total) {
            Ok(x) => x,
            Err(e) => return err(Code::BadRegion, e),
        };
        let mut st = self.state.lock().expect("state lock");
        if st.memory + mem.len() > self.cfg.limits.max_memory_bytes {
            return err(Code::Limit, format!("limits.max_memory_bytes {} would be exceeded", self.cfg.limits.max_memory_bytes));
        }
        if st.regions + regions.len() > self.cfg.limits.max_regions {
            return err(Code::Limit, format!("limits.max_regions {} would be exceeded", self.cfg.limits.max_regions));
        }
        if let Some(g) = st.groups.get(&r.group) {
            let mismatch = if g.model != model {
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
            };
            if let Some(field) = mismatch {
                return err(Code::Mismatch, format!("group `{}`: {field} differs from its earlier registration", r.group));
            }
        }
        let mut windows = BTreeMap::new();
        let mut offset = 0;
        for (id, len) in &regions {
            match self.register_region(mem.clone(), offset, *len) {
                Ok(region) => {
                    windows.insert(*id, region);
                }
                Err(e) => {
                    for w in windows.values() {
                        self.revoke_key(w.key);
                    }
                    return err(Code::BadRegion, format!("register {id:?}: {e}"));
                }
            }
            offset += len;
        }
        let n = windows.len();
        st.memory += mem.len();
        st.regions += n;
        let g = st.groups.entry(r.group.clone()).or_insert_with(|| Group {
            model,
            format,
            layout,
            layout_text: r.layout.clone(),
            num_blocks: r.num_blocks,
            identity: r.identity.clone(),
            shard: side.shard.clone(),
            ranks: BTreeMap::new(),
        });
        g.ranks.insert(r.rank, RankCache { regions: windows, mem, client, device });
        tracing::info!(group = r.group, rank = r.rank, regions = n, bytes = total, "rank registered");
        if let Some(d) = self.discovery.get() { d.changed() }
        Reply::Registered { regions: n as u32, bytes: total, complete: g.complete() }
    }

    fn release(&self, client: u64, group: &str, rank: u32) -> Reply {
        let mut st = self.state.lock().expect("state lock");
        let st = &mut *st;
        let Some(g) = st.groups.get_mut(group) else { return err(Code::UnknownGroup, format!("no group `{group}`")) };
        match g.ranks.get(&rank) {
            Some(rc) if rc.client != client => return err(Code::PermissionDenied, format!("rank {rank} of `{group}` was registered by another client")),
            None => return err(Code::UnknownGroup, format!("group `{group}` has no rank {rank}")),
            Some(_) => {}
        }
        let rc = g.ranks.remove(&rank).expect("checked");
        for r in rc.regions.values() {
            self.revoke_key(r.key);
        }
        st.memory -= rc.mem.len();
        st.regions -= rc.regions.len();
        if g.ranks.is_empty() {
            st.groups.remove(group);
        }
        if let Some(d) = self.discovery.get() { d.changed() }
        Reply::Released
    }

    /// Takes a free slot: the oldest finished one, so a late write for an
    /// old transfer is least likely to meet a reused slot.
    fn alloc_slot(&self, st: &mut State, role: Role, request: &str, group: &str, owner: u64, recv: Option<PrepareReceive>) -> Result<(SlotId, Arc<AtomicBool>), Box<Reply>> {
        let live = st.slots.values().filter(|s| running(s.state)).count();
        if live >= self.cfg.limits.max_inflight_transfers {
            return Err(Box::new(err(Code::Limit, format!("limits.max_inflight_transfers {} reached", self.cfg.limits.max_inflight_transfers))));
        }
        for i in 0..FLAG_SLOTS {
            let slot = (st.next_slot + i) % FLAG_SLOTS;
            if st.slots.get(&slot).is_none_or(|s| !running(s.state)) {
                st.next_slot = (slot + 1) % FLAG_SLOTS;
                st.next_gen += 1;
                let gen = st.next_gen;
                // The old transfer's keys were revoked when it ended, so no
                // late write of it can count toward the new one.
                self.ep.placement().reset_slot(slot);
                self.page.clear_slot(slot);
                let stop = Arc::new(AtomicBool::new(false));
                st.slots.insert(
                    slot,
                    Slot {
                        gen,
                        role,
                        request: request.to_string(),
                        group: group.to_string(),
                        owner,
                        keys: Vec::new(),
                        retransmitted: 0,
                        rails: Vec::new(),
                        state: if role == Role::Source { TransferState::Running } else { TransferState::Prepared },
                        error: None,
                        layers: 0,
                        bytes: 0,
                        segments: 0,
                        reused: 0,
                        wire: 0,
                        hops: BTreeMap::new(),
                        peer: String::new(),
                        marks: vec![Mark { name: "enqueued".into(), at_ns: 0 }],
                        started: Instant::now(),
                        elapsed: None,
                        recv,
                        stop: stop.clone(),
                    },
                );
                return Ok((SlotId { slot, gen }, stop));
            }
        }
        Err(Box::new(err(Code::Limit, "no free flag slot")))
    }

    /// Ends transfer `id` (if it still runs): records the outcome, stops its
    /// threads, fails its flags unless done, and revokes its keys. Returns
    /// whether this call ended it.
    fn finish(&self, id: SlotId, state: TransferState, error: Option<String>) -> bool {
        let mut st = self.state.lock().expect("state lock");
        let Some(s) = st.slots.get_mut(&id.slot).filter(|s| s.gen == id.gen && running(s.state)) else { return false };
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
        // Under the state lock: the slot cannot be taken again before its
        // keys are gone and its flags failed.
        for key in std::mem::take(&mut s.keys) {
            self.revoke_key(key);
        }
        if state != TransferState::Done {
            self.fail_flags(id.slot);
        }
        true
    }

    /// Publishes `column` of transfer `id` on the clients' page, if it still runs.
    fn publish(&self, id: SlotId, column: u16) -> bool {
        let st = self.state.lock().expect("state lock");
        let current = st.slots.get(&id.slot).is_some_and(|s| s.gen == id.gen && running(s.state));
        current && self.page.publish(Tag { slot: id.slot, layer: column })
    }

    /// Adds `took` to the slot's `hop` total, and to the daemon's histogram.
    fn slot_hop(&self, id: SlotId, hop: Hop, took: Duration, bytes: u64) {
        self.hops().record(hop, took, bytes);
        let mut st = self.state.lock().expect("state lock");
        if let Some(s) = st.slots.get_mut(&id.slot).filter(|s| s.gen == id.gen) {
            let e = s.hops.entry(hop.name()).or_default();
            e.0 += took.as_nanos() as u64;
            e.1 += bytes;
            if !s.peer.is_empty() {
                let h = self.peer_hops.lock().expect("peer hops lock").entry(s.peer.clone()).or_default().clone();
                h.record(hop, took, bytes);
            }
        }
    }

    /// Records that transfer `id` reached boundary `name` now.
    fn slot_mark(&self, id: SlotId, name: String) {
        let mut st = self.state.lock().expect("state lock");
        if let Some(s) = st.slots.get_mut(&id.slot).filter(|s| s.gen == id.gen) {
            let at_ns = s.started.elapsed().as_nanos() as u64;
            s.marks.push(Mark { name, at_ns });
        }
    }

    /// Fails every flag of `slot`, internal and client-visible: waiters stop at once.
    fn fail_flags(&self, slot: u16) {
        self.ep.placement().fail_slot(slot, MAX_TRANSFER_LAYERS);
        for layer in 0..FLAG_COLUMNS {
            self.page.fail(Tag { slot, layer });
        }
    }

    fn prepare(&self, client: u64, p: PrepareReceive) -> Reply {
        let mut st = self.state.lock().expect("state lock");
        let g = match group_access(&st, client, &p.group) {
            Ok(g) => g,
            Err(r) => return *r,
        };
        if !g.complete() {
            return err(Code::IncompleteGroup, format!("group `{}` has {} of {} ranks registered", p.group, g.ranks.len(), g.shard.ranks.len()));
        }
        if p.prefix_tokens > p.tokens {
            return err(Code::BadRequest, format!("prefix_tokens {} exceeds tokens {}", p.prefix_tokens, p.tokens));
        }
        if let Err(e) = Side::with_table(&g.model, &g.layout, g.format, p.tokens, p.block_table.clone(), g.num_blocks) {
            return err(Code::BadRequest, e);
        }
        let dup = st.slots.values().any(|s| {
            matches!(s.state, TransferState::Prepared | TransferState::Running)
                && s.recv.as_ref().is_some_and(|r| r.group == p.group && r.request == p.request)
        });
        if dup {
            return err(Code::BadRequest, format!("request `{}` of group `{}` is already prepared", p.request, p.group));
        }
        let (request, group) = (p.request.clone(), p.group.clone());
        match self.alloc_slot(&mut st, Role::Destination, &request, &group, client, Some(p)) {
            Ok((id, _)) => Reply::Prepared { slot: id.slot },
            Err(r) => *r,
        }
    }

    // ------------------------------------------------------------ source side

    fn submit(self: &Arc<Self>, client: u64, s: Submit) -> Reply {
        let codec = match s.codec.as_deref().map(Codec::parse).transpose() {
            Ok(c) => c,
            Err(e) => return err(Code::BadRequest, e),
        };
        let peer = match self.resolve_peer(&s.peer) {
            Ok(p) => p,
            Err(r) => return *r,
        };
        // Snapshot what planning needs; the regions stay registered (Arc) while we use them.
        let (model, format, layout, layout_text, identity, num_blocks, src_keys, src_devices) = {
            let st = self.state.lock().expect("state lock");
            let g = match group_access(&st, client, &s.group) {
                Ok(g) => g,
                Err(r) => return *r,
            };
            if !g.complete() {
                return err(Code::IncompleteGroup, format!("group `{}` has {} of {} ranks registered", s.group, g.ranks.len(), g.shard.ranks.len()));
            }
            (g.model.clone(), g.format, g.layout.clone(), g.layout_text.clone(), g.identity.clone(), g.num_blocks, g.regions(), g.devices())
        };
        let src = match Side::with_table(&model, &layout, format, s.tokens, s.block_table.clone(), num_blocks) {
            Ok(x) => x,
            Err(e) => return err(Code::BadRequest, e),
        };
        let (id, stop) = {
            let mut st = self.state.lock().expect("state lock");
            match self.alloc_slot(&mut st, Role::Source, &s.request, &s.group, client, None) {
                Ok(x) => x,
                Err(r) => return *r,
            }
        };
        let slot = id.slot;
        let fail = |code: Code, m: String| {
            self.finish(id, TransferState::Failed, Some(m.clone()));
            err(code, m)
        };
        // Offer → accept.
        let connected = peer
            .address
            .parse()
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{e}")))
            .and_then(|a| TcpStream::connect_timeout(&a, Duration::from_secs(self.cfg.limits.peer_timeout_secs)));
        let mut pc = match connected {
            Ok(c) => c,
            Err(e) => return fail(Code::PeerUnreachable, format!("peer `{}` at {}: {e}", peer.name, peer.address)),
        };
        let _ = pc.set_read_timeout(Some(Duration::from_secs(30)));
        match peer::connect_auth(&mut pc, &self.secret, &self.cfg.node) {
            Ok(name) if name == peer.name => {
                if let Some(sl) = self.state.lock().expect("state lock").slots.get_mut(&slot) {
                    sl.peer = name;
                }
            }
            Ok(name) => return fail(Code::AuthFailed, format!("peer at {} is `{name}`, not `{}`", peer.address, peer.name)),
            Err(e) => return fail(Code::AuthFailed, e.to_string()),
        }
        let identity_src = identity.clone();
        let offer = Offer {
            dst_group: s.dst_group.clone(),
            dst_request: s.dst_request.clone(),
            src_request: s.request.clone(),
            identity,
            tokens: s.tokens,
            codec: s.codec.clone(),
        };
        let accept = match write_msg(&mut pc, &PeerMsg::Offer(offer)).and_then(|()| read_msg::<PeerMsg>(&mut pc)) {
            Ok(PeerMsg::Accept(a)) => a,
            Ok(PeerMsg::Refused { reason }) => return fail(Code::PeerRefused, format!("peer `{}` refused: {reason}", peer.name)),
            Ok(other) => return fail(Code::PeerRefused, format!("unexpected peer reply {other:?}")),
            Err(e) => return fail(Code::PeerUnreachable, format!("peer `{}`: {e}", peer.name)),
        };
        if accept.transport != self.ep.transport() {
            return fail(Code::PeerRefused, format!("peer speaks `{}`, this daemon `{}`", accept.transport, self.ep.transport()));
        }
        // Plan against the destination's layout.
        let planned = (|| -> anyhow::Result<_> {
            let dst_format = CacheFormat::parse(&accept.format)?;
            let dst_layout = LayoutSpec::parse(&accept.layout)?;
            let dst = Side::with_table(&model, &dst_layout, dst_format, s.tokens, accept.block_table.clone(), accept.num_blocks)?;
            let plan = plan::build(&PlanInput {
                model: &model,
                tokens: s.tokens,
                prefix_tokens: accept.prefix_tokens,
                src: &src,
                dst: &dst,
                cost: CostModel::default(),
            })?;
            Ok(plan)
        })();
        let plan = match planned {
            Ok(p) => p,
            Err(e) => {
                let _ = write_msg(&mut pc, &PeerMsg::Abort { slot: accept.slot, reason: format!("planning failed: {e:#}") });
                return fail(Code::BadRequest, format!("planning failed: {e:#}"));
            }
        };
        let n_layers = model.layers.len();
        let staged = match staging::layout(&model, &format, &plan, codec) {
            Ok(x) => x,
            Err(e) => {
                let _ = write_msg(&mut pc, &PeerMsg::Abort { slot: accept.slot, reason: e.clone() });
                return fail(Code::BadRequest, e);
            }
        };
        // A device-resident source is copied into its host mirror first:
        // the manifest's checksums, packing and the wire all read the mirror.
        if !src_devices.is_empty() {
            let staged_out = self.device_copies(id, Direction::ToHost, &plan, &src_keys, &src_devices, 0..n_layers);
            if let Err(e) = staged_out {
                let _ = write_msg(&mut pc, &PeerMsg::Abort { slot: accept.slot, reason: format!("device staging: {e}") });
                return fail(Code::TransferFailed, format!("device → host staging: {e}"));
            }
        }
        let dim_of = |region: RegionId| {
            model.layers[region.layer as usize].tensors().iter().find(|t| t.tensor == region.tensor).map_or(0, |t| t.dim) as usize
        };
        // The manifest: identity, shapes, maps, positions, and checksums of
        // what the destination must hold — the source bytes, or with a codec
        // the source bytes as the destination will decode them.
        let manifest = {
            let elem = codec.and_then(|c| c.element_bytes(&format).ok()).unwrap_or(0);
            let read = |rank: u32, region: RegionId, offset: u64, len: u64| -> Option<Vec<u8>> {
                let r = src_keys.get(&(rank, region))?;
                let raw = staging::read(&r.mem, r.offset + offset, len)?;
                Some(match codec {
                    Some(_) => {
                        let dim = dim_of(region);
                        kvwire_core::codec::decode_rows(&kvwire_core::codec::encode_rows(&raw, elem, dim), elem, dim)
                    }
                    None => raw,
                })
            };
            let dst_side = Side::with_table(
                &model,
                &LayoutSpec::parse(&accept.layout).expect("parsed above"),
                CacheFormat::parse(&accept.format).expect("parsed above"),
                s.tokens,
                accept.block_table.clone(),
                accept.num_blocks,
            )
            .expect("built above");
            let started = Instant::now();
            // With checksums off, the manifest still carries every identity
            // claim; hashing no segments leaves its checksum list empty.
            let unhashed;
            let hashed = if self.cfg.verify_checksums {
                &plan
            } else {
                unhashed = Plan { segments: vec![], counters: plan.counters.clone(), ..plan };
                &unhashed
            };
            let m = Manifest::for_plan(&identity_src, &model, &src, &dst_side, hashed, &s.dst_request, read);
            match m {
                Ok(m) => {
                    if self.cfg.verify_checksums {
                        self.slot_hop(id, Hop::Verify, started.elapsed(), plan.counters.total_bytes_moved);
                    }
                    m
                }
                Err(e) => {
                    let _ = write_msg(&mut pc, &PeerMsg::Abort { slot: accept.slot, reason: format!("manifest: {e}") });
                    return fail(Code::BadRequest, format!("manifest: {e}"));
                }
            }
        };
        let expect = Expect {
            slot: accept.slot,
            src_layout: layout_text.clone(),
            src_num_blocks: num_blocks,
            src_block_table: s.block_table.clone(),
            manifest: manifest.to_json(),
            codec: s.codec.clone(),
        };
        Metrics::add(&self.metrics.wire_bytes, expect.manifest.len() as u64);
        let (dst_stage_key, dst_stage_len) = match write_msg(&mut pc, &PeerMsg::Expect(expect)).and_then(|()| read_msg::<PeerMsg>(&mut pc)) {
            Ok(PeerMsg::Staging { key, len }) => (key, len),
            Ok(PeerMsg::Refused { reason }) => return fail(Code::PeerRefused, format!("peer `{}` refused the transfer: {reason}", peer.name)),
            Ok(other) => return fail(Code::PeerRefused, format!("unexpected peer reply {other:?}")),
            Err(e) => return fail(Code::PeerUnreachable, format!("peer `{}`: {e}", peer.name)),
        };
        // From here the destination waits for bytes: keep it told that this
        // side is alive, and learn at once if it is not.
        let peer_timeout = Duration::from_secs(self.cfg.limits.peer_timeout_secs);
        let _ = pc.set_read_timeout(Some(peer_timeout));
        let link = Arc::new(PeerLink { stream: Mutex::new(pc), peer: peer.name.clone(), timeout: peer_timeout, lost: Mutex::new(None), ended: AtomicBool::new(false) });
        let beat = link.clone();
        if let Err(e) = std::thread::Builder::new().name(format!("kvwired-beat-{slot}")).spawn(move || beat.heartbeat()) {
            link.end(&PeerMsg::Abort { slot: accept.slot, reason: "source could not start its heartbeat".into() });
            return fail(Code::TransferFailed, format!("cannot start the heartbeat thread: {e}"));
        }
        let stage_total = staging::total(&staged);
        if dst_stage_len != stage_total {
            link.end(&PeerMsg::Abort { slot: accept.slot, reason: "staging size differs".into() });
            return fail(Code::PeerRefused, format!("peer staged {dst_stage_len} bytes, the plan needs {stage_total}"));
        }
        // Pack (and encode) the staged segments into one registered buffer.
        let started = Instant::now();
        let src_stage = if stage_total > 0 {
            let packed = (|| -> Result<Arc<Region>, String> {
                let mem = Arc::new(HostMem::new("kvwire-stage", stage_total).map_err(|e| e.to_string())?);
                for st in &staged {
                    let seg = &plan.segments[st.seg];
                    let r = src_keys.get(&(seg.src_rank, seg.src_region)).ok_or("source region missing")?;
                    let bytes = staging::pack(seg, st, &format, codec, |o, l| staging::read(&r.mem, r.offset + o, l)).ok_or("cannot read a packed source run")?;
                    mem.write(st.offset, &bytes).map_err(|e| e.to_string())?;
                }
                self.register_region(mem, 0, stage_total).map_err(|e| e.to_string())
            })();
            match packed {
                Ok(r) => Some(r),
                Err(e) => {
                    link.end(&PeerMsg::Abort { slot: accept.slot, reason: format!("pack: {e}") });
                    return fail(Code::TransferFailed, format!("pack: {e}"));
                }
            }
        } else {
            None
        };
        if stage_total > 0 {
            self.slot_hop(id, Hop::Pack, started.elapsed(), stage_total);
        }
        let dst_keys: HashMap<(u32, RegionId), (u32, u64)> = accept.regions.iter().map(|r| ((r.rank, r.region), (r.key, r.len))).collect();
        let staged_at: HashMap<usize, &staging::Staged> = staged.iter().map(|st| (st.seg, st)).collect();
        // Writes per layer, checked against what both sides registered.
        let mut batches: Vec<Batch> = (0..n_layers).map(|l| Batch { tag: Tag { slot: accept.slot, layer: l as u16 }, writes: vec![] }).collect();
        for (i, seg) in plan.segments.iter().enumerate() {
            let b = &mut batches[seg.dst_region.layer as usize];
            if let (Some(st), Some(stage)) = (staged_at.get(&i), &src_stage) {
                b.writes.push(WriteOp { src_key: stage.key, src_offset: st.offset, dst_key: dst_stage_key, dst_offset: st.offset, len: st.size });
                continue;
            }
            let (Some(sr), Some(&(dk, _))) = (src_keys.get(&(seg.src_rank, seg.src_region)), dst_keys.get(&(seg.dst_rank, seg.dst_region))) else {
                if let Some(stage) = &src_stage {
                    self.revoke_key(stage.key);
                }
                link.end(&PeerMsg::Abort { slot: accept.slot, reason: "region missing".into() });
                return fail(Code::PeerRefused, format!("no region for src rank {} / dst rank {} {:?}", seg.src_rank, seg.dst_rank, seg.dst_region));
            };
            for (so, dof) in seg.runs() {
                b.writes.push(WriteOp { src_key: sr.key, src_offset: so, dst_key: dk, dst_offset: dof, len: seg.len });
            }
        }
        let wire: u64 = batches.iter().map(Batch::bytes).sum();
        let c = &plan.counters;
        {
            let mut st = self.state.lock().expect("state lock");
            if let Some(sl) = st.slots.get_mut(&slot) {
                sl.layers = n_layers as u16;
                sl.bytes = c.total_bytes_moved;
                sl.segments = c.segments;
                sl.reused = c.reused_bytes;
                sl.wire = wire;
            }
        }
        Metrics::add(&self.metrics.reused_bytes, c.reused_bytes);
        let payload = c.total_bytes_moved;
        let reply = Reply::Submitted { slot, peer_slot: accept.slot, bytes: c.total_bytes_moved, segments: c.segments };
        let d = self.clone();
        // Which rails each destination rank prefers, as a bit per rail, and
        // the rank of each destination key.
        let prefer: HashMap<u32, u64> = accept
            .locality
            .iter()
            .map(|p| (p.rank, accept.rails.iter().enumerate().filter(|(_, r)| p.rails.contains(&r.name)).fold(0u64, |m, (i, _)| m | 1 << i)))
            .collect();
        let key_rank: HashMap<u32, u32> = accept.regions.iter().map(|r| (r.key, r.rank)).collect();
        let prefer = (prefer, key_rank);
        // A peer of an older build names one rail: its data address.
        let rails = if accept.rails.is_empty() { vec![RailAddr { name: "rail0".into(), addr: accept.data_addr.clone() }] } else { accept.rails.clone() };
        let peer_slot = accept.slot;
        let (link2, peer_slot2) = (link.clone(), peer_slot);
        let spawned = std::thread::Builder::new().name(format!("kvwired-xfer-{slot}")).spawn(move || {
            let span = tracing::info_span!("transfer", slot, request = s.request, peer = peer.name);
            let _g = span.enter();
            let result = d.move_bytes(id, &rails, &prefer, batches, &stop, &link);
            if let Some(stage) = &src_stage {
                d.revoke_key(stage.key);
            }
            match result {
                Ok((bytes, writes)) => {
                    Metrics::add(&d.metrics.payload_bytes, payload);
                    if codec.is_some() {
                        Metrics::add(&d.metrics.compressed_bytes, stage_total);
                    }
                    let framing = if d.ep.transport() == "verbs" { 0 } else { writes * 2 * kvwire_core::protocol::HEADER_LEN as u64 };
                    Metrics::add(&d.metrics.wire_bytes, bytes + framing);
                    d.publish(id, SOURCE_RELEASED);
                    d.slot_mark(id, "source_released".into());
                    d.finish(id, TransferState::Done, None);
                    link.end(&PeerMsg::Done { slot: peer_slot });
                    tracing::info!(bytes, writes, "source released");
                }
                Err(e) => {
                    tracing::warn!(error = %e, "transfer failed");
                    link.end(&PeerMsg::Abort { slot: peer_slot, reason: e.clone() });
                    d.finish(id, TransferState::Failed, Some(e));
                }
            }
        });
        if let Err(e) = spawned {
            link2.end(&PeerMsg::Abort { slot: peer_slot2, reason: "source could not start its transfer thread".into() });
            return fail(Code::TransferFailed, format!("cannot start the transfer thread: {e}"));
        }
        reply
    }

    /// Copies what `plan` moves of `layers` between device-resident ranks
    /// and their host mirrors: the source side of each segment to the
    /// host (`stage`), or its destination side to the device
    /// (`device_complete`). Each rank's layers are enqueued in order on its
    /// stream, then awaited by event; a layer's hop time is the time its
    /// copies held the stream (from its enqueue or the previous layer's
    /// completion, whichever is later, to its own completion).
    fn device_copies(
        &self,
        id: SlotId,
        dir: Direction,
        plan: &plan::Plan,
        regions: &HashMap<(u32, RegionId), Arc<Region>>,
        devices: &HashMap<u32, Arc<dyn BoundMem>>,
        layers: std::ops::Range<usize>,
    ) -> Result<(), String> {
        let timeout = Duration::from_secs(self.cfg.device.copy_timeout_secs);
        let mut pending = Vec::new();
        for layer in layers {
            for (&rank, dev) in devices {
                let mut runs: Vec<(u64, u64, u64)> = Vec::new();
                let mut mirror = None;
                for seg in &plan.segments {
                    let (seg_rank, region) = match dir {
                        Direction::ToHost => (seg.src_rank, seg.src_region),
                        Direction::ToDevice => (seg.dst_rank, seg.dst_region),
                    };
                    if seg_rank != rank || region.layer as usize != layer {
                        continue;
                    }
                    let r = regions.get(&(rank, region)).ok_or_else(|| format!("rank {rank} has no region {region:?}"))?;
                    mirror.get_or_insert_with(|| r.mem.clone());
                    for (so, dof) in seg.runs() {
                        let at = r.offset + if dir == Direction::ToHost { so } else { dof };
                        // The mirror holds the allocation's bytes at the same offsets.
                        runs.push((at, at, seg.len));
                    }
                }
                let Some(mirror) = mirror else { continue };
                let runs = merge_runs(runs);
                let bytes = runs.iter().map(|r| r.2).sum::<u64>();
                let enqueued = Instant::now();
                let ev = match dir {
                    Direction::ToHost => dev.d2h(&runs, &mirror),
                    Direction::ToDevice => dev.h2d(&runs, &mirror),
                }
                .map_err(|e| format!("rank {rank} layer {layer}: {e}"))?;
                pending.push((rank, layer, enqueued, bytes, ev));
            }
        }
        let hop = match dir {
            Direction::ToHost => Hop::Stage,
            Direction::ToDevice => Hop::DeviceComplete,
        };
        let mut free_at: HashMap<u32, Instant> = HashMap::new();
        for (rank, layer, enqueued, bytes, ev) in pending {
            ev.wait(timeout).map_err(|e| format!("rank {rank} layer {layer}: {e}"))?;
            let done = Instant::now();
            let from = free_at.get(&rank).map_or(enqueued, |&t| t.max(enqueued));
            self.slot_hop(id, hop, done.saturating_duration_since(from), bytes);
            free_at.insert(rank, done);
        }
        Ok(())
    }

    /// Registers a window on the data plane and with every rail's device.
    /// Nothing stays registered when one of them refuses.
    fn register_region(&self, mem: Arc<HostMem>, offset: u64, len: u64) -> Result<Arc<Region>, TransportError> {
        let region = self.ep.register(mem, offset, len)?;
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
    fn revoke_key(&self, key: u32) -> bool {
        let was = self.ep.revoke(key);
        for r in self.rails.iter().filter_map(|r| r.ep.as_ref()) {
            r.revoke(key);
        }
        was
    }

    /// Per rank of `g`, the rails closest to its memory, where some are
    /// closer than others (host memory: by NUMA node, read from the pages).
    fn rank_rails(&self, g: &Group) -> Vec<RankRails> {
        let Some(topo) = &self.topology else { return Vec::new() };
        let devices: Vec<&str> = self.rails.iter().map(|r| r.device.as_deref().unwrap_or("")).collect();
        let mut out = Vec::new();
        for (rank, rc) in &g.ranks {
            // GPU memory goes by its device's PCI address (the rail on its
            // PCIe switch first); host memory, or a device whose address is
            // unknown, by the NUMA node of the pages the NIC reads.
            let gpu = rc.device.as_ref().and_then(|d| d.dev.pci_bus_id()).and_then(|p| p.parse().ok());
            let mem = match gpu {
                Some(pci) => kvwire_core::topology::MemPlace::Gpu { pci },
                None => {
                    // The client's pages are in this mapping only once touched here:
                    // a read maps the page the client placed (shared memfd).
                    let _ = rc.mem.read(0, &mut [0u8; 1]);
                    kvwire_core::topology::MemPlace::Host { numa: kvwire_transport::topology::numa_node_of(rc.mem.as_ptr()) }
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

    /// Where peer `name` listens: the static `[[peers]]` list, then etcd
    /// (one lookup, at most `discovery::CALL_TIMEOUT`).
    fn resolve_peer(&self, name: &str) -> Result<PeerConfig, Box<Reply>> {
        if let Some(p) = self.cfg.peers.iter().find(|p| p.name == name) {
            return Ok(p.clone());
        }
        let Some(disc) = self.discovery.get() else {
            return Err(Box::new(err(Code::UnknownPeer, format!("peer `{name}` is not configured"))));
        };
        let (etcd, ours) = (disc.endpoints(), self.ep.transport());
        match disc.lookup(name) {
            Ok(Some(e)) if e.version != peer::PEER_VERSION => Err(Box::new(err(
                Code::PeerRefused,
                format!("peer `{name}` (etcd at {etcd}) speaks peer protocol v{}, this daemon v{}", e.version, peer::PEER_VERSION),
            ))),
            Ok(Some(e)) if e.transport != ours => {
                Err(Box::new(err(Code::PeerRefused, format!("peer `{name}` (etcd at {etcd}) speaks `{}`, this daemon `{ours}`", e.transport))))
            }
            Ok(Some(e)) => Ok(PeerConfig { name: e.name, address: e.peer }),
            Ok(None) => Err(Box::new(err(Code::UnknownPeer, format!("peer `{name}` is not configured and not registered in etcd at {etcd}")))),
            Err(e) => Err(Box::new(err(Code::UnknownPeer, format!("peer `{name}` is not configured, and etcd cannot say where it is: {e}")))),
        }
    }

    /// Sends every batch, cut into slices striped across the destination's
    /// rails (`stripe`), until each completed at least once; records per
    /// rail what it carried and what was sent again, either way.
    fn move_bytes(
        &self,
        id: SlotId,
        rails: &[RailAddr],
        prefer: &(HashMap<u32, u64>, HashMap<u32, u32>),
        batches: Vec<Batch>,
        stop: &AtomicBool,
        link: &PeerLink,
    ) -> Result<(u64, u64), String> {
        // Setup ends at the first post, on whichever rail: handshake,
        // planning, manifest, packing, data-plane connect.
        let posting = std::sync::Once::new();
        let t = &self.cfg.transport;
        let (rank_mask, key_rank) = prefer;
        // Staging buffers and unknown keys group as u32::MAX: no preference.
        let rank_of = |w: &WriteOp| key_rank.get(&w.dst_key).copied().unwrap_or(u32::MAX);
        let slices = stripe::cut(batches, t.slice_bytes, rank_of);
        let masks: Vec<u64> = slices.iter().map(|b| b.writes.first().and_then(|w| rank_mask.get(&rank_of(w))).copied().unwrap_or(0)).collect();
        let settings = stripe::Settings {
            window: 4,
            stall: Duration::from_millis(t.rail_stall_ms),
            deadline: Instant::now() + Duration::from_secs(self.cfg.limits.transfer_timeout_secs),
        };
        let interrupted = || -> Option<String> {
            if stop.load(Ordering::Acquire) {
                return Some("cancelled".into());
            }
            link.lost()
        };
        // The peer's rail i from our rail i (the same fabric, for verbs: a
        // QP can only reach what its own device reaches); with fewer rails
        // here, ours are reused in turn.
        let connect = |i: usize, rail: &RailAddr| {
            let local = &self.rails[i % self.rails.len()];
            local.ep.as_ref().unwrap_or(&self.ep).connect(&rail.addr)
        };
        // This transfer's share of each rail's in-flight gauge: what it
        // still holds when it ends comes off the gauge, and only that (other
        // transfers may be using the same rails).
        let inflight: Mutex<HashMap<(String, String), u64>> = Mutex::new(HashMap::new());
        let event = |rail: &RailAddr, e: stripe::RailEvent<'_>| {
            // The transfer's status shows its rails while it runs.
            if let Some(s) = self.state.lock().expect("state lock").slots.get_mut(&id.slot).filter(|s| s.gen == id.gen) {
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
                    stripe::RailEvent::Starting => posting.call_once(|| {
                        let at_ns = s.started.elapsed().as_nanos() as u64;
                        s.marks.push(Mark { name: "posting".into(), at_ns });
                    }),
                    stripe::RailEvent::Posted => {}
                    stripe::RailEvent::Completed(bytes) => {
                        r.bytes += bytes;
                        r.slices += 1;
                    }
                    stripe::RailEvent::Failed(resent, why) => {
                        r.retransmitted_bytes += resent;
                        r.failed = Some(why.to_string());
                    }
                }
            }
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
        };
        let (outcome, result) = stripe::run(&slices, &masks, rails, &connect, &settings, &interrupted, &event);
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
        if let Some(s) = self.state.lock().expect("state lock").slots.get_mut(&id.slot).filter(|s| s.gen == id.gen) {
            s.retransmitted = outcome.retransmitted;
            s.rails = outcome.rails.clone();
        }
        result.map_err(|e| format!("peer `{}`: {e}", link.peer))?;
        // `wire` per transfer: the links' busy span, first post to last
        // completion (slices overlap, so per-slice times would double count).
        self.slot_hop(id, Hop::Post, outcome.post_time, outcome.bytes);
        self.slot_hop(id, Hop::Wire, outcome.wire, outcome.bytes);
        Ok((outcome.bytes, outcome.writes))
    }

    // ------------------------------------------------------------ destination side

    fn peer_loop(self: Arc<Self>, l: TcpListener) {
        for s in l.incoming() {
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            let Ok(s) = s else { continue };
            let d = self.clone();
            let _ = std::thread::Builder::new().name("kvwired-peer".into()).spawn(move || d.serve_peer(s));
        }
    }

    fn serve_peer(self: &Arc<Self>, mut s: TcpStream) {
        let from = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
        let peer = match peer::accept_auth(&mut s, &self.secret, &self.cfg.node) {
            Ok(p) => p,
            Err(e) => {
                Metrics::add(&self.metrics.peers_refused, 1);
                tracing::warn!(from, error = %e, "peer refused");
                let _ = write_msg(&mut s, &PeerMsg::Refused { reason: "authentication failed: wrong shared secret or protocol".into() });
                return;
            }
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(self.cfg.limits.transfer_timeout_secs)));
        // Transfers accepted on this connection: its messages may name only
        // these, and those still running when it ends fail then.
        let mut mine: HashMap<u16, SlotId> = HashMap::new();
        let ended = loop {
            let msg = match read_msg::<PeerMsg>(&mut s) {
                Ok(m) => m,
                Err(WireError::Closed) => break format!("peer `{peer}` went away mid-transfer"),
                Err(e) if e.is_timeout() => {
                    break format!("peer `{peer}` silent for {}s", self.cfg.limits.peer_timeout_secs)
                }
                Err(e) => break format!("peer `{peer}` connection failed mid-transfer: {e}"),
            };
            let reply = match msg {
                PeerMsg::Offer(o) => {
                    let (reply, id) = self.offer(&peer, o);
                    if let Some(id) = id {
                        mine.insert(id.slot, id);
                    }
                    reply
                }
                PeerMsg::Expect(e) => match mine.get(&e.slot).copied() {
                    Some(id) => {
                        let reply = self.expect(id, e);
                        if matches!(reply, PeerMsg::Staging { .. }) {
                            // Bytes flow now; the source pings while they do.
                            let _ = s.set_read_timeout(Some(Duration::from_secs(self.cfg.limits.peer_timeout_secs)));
                        }
                        reply
                    }
                    None => PeerMsg::Refused { reason: format!("slot {} is not a transfer of this connection", e.slot) },
                },
                PeerMsg::Abort { slot, reason } => match mine.remove(&slot) {
                    Some(id) => {
                        tracing::warn!(peer, slot, reason, "source aborted");
                        self.finish(id, TransferState::Failed, Some(format!("source aborted: {reason}")));
                        PeerMsg::Ok
                    }
                    None => PeerMsg::Refused { reason: format!("slot {slot} is not a transfer of this connection") },
                },
                PeerMsg::Done { slot } => match mine.remove(&slot) {
                    Some(_) => PeerMsg::Ok,
                    None => PeerMsg::Refused { reason: format!("slot {slot} is not a transfer of this connection") },
                },
                PeerMsg::Ping => PeerMsg::Pong,
                other => PeerMsg::Refused { reason: format!("unexpected {other:?}") },
            };
            if let Err(e) = write_msg(&mut s, &reply) {
                break format!("peer `{peer}` connection failed mid-transfer: {e}");
            }
        };
        // A source that ends its connection without `Done` will write no
        // more: what has not arrived never will.
        for id in mine.into_values() {
            if self.finish(id, TransferState::Failed, Some(ended.clone())) {
                tracing::warn!(peer, slot = id.slot, why = ended, "transfer failed: its source is gone");
            }
        }
    }

    fn offer(&self, peer: &str, o: Offer) -> (PeerMsg, Option<SlotId>) {
        let mut st = self.state.lock().expect("state lock");
        let refused = |reason: String| (PeerMsg::Refused { reason }, None);
        let Some(g) = st.groups.get(&o.dst_group) else { return refused(format!("no group `{}` on {}", o.dst_group, self.cfg.node)) };
        let found = st.slots.iter().find(|(_, s)| {
            s.state == TransferState::Prepared && s.recv.as_ref().is_some_and(|r| r.group == o.dst_group && r.request == o.dst_request)
        });
        let Some((&slot, sl)) = found else {
            return refused(format!("request `{}` of group `{}` is not prepared on {}", o.dst_request, o.dst_group, self.cfg.node));
        };
        let recv = sl.recv.clone().expect("prepared slots hold their receive");
        let id = SlotId { slot, gen: sl.gen };
        if o.tokens != recv.tokens {
            return refused(format!("offer has {} tokens, the prepared request {}", o.tokens, recv.tokens));
        }
        // The source must hold the cache this side was registered for; the
        // reuse check names the first field that differs.
        if let Err(e) = check_prefix(&g.identity, &o.identity, recv.prefix_tokens, recv.tokens) {
            return refused(e.to_string());
        }
        // Keys for this transfer alone (see `Slot::keys`).
        let mut regions = Vec::new();
        let mut keys = Vec::new();
        for (rank, rc) in &g.ranks {
            for (region, r) in &rc.regions {
                match self.register_region(r.mem.clone(), r.offset, r.len) {
                    Ok(w) => {
                        keys.push(w.key);
                        regions.push(PeerRegion { rank: *rank, region: *region, key: w.key, len: w.len });
                    }
                    Err(e) => {
                        for k in keys {
                            self.revoke_key(k);
                        }
                        return refused(format!("{} cannot register the transfer's regions: {e}", self.cfg.node));
                    }
                }
            }
        }
        let accept = Accept {
            slot,
            layout: g.layout_text.clone(),
            format: g.format.id(),
            num_blocks: g.num_blocks,
            block_table: recv.block_table.clone(),
            prefix_tokens: recv.prefix_tokens,
            data_addr: self.rails[0].advertise.clone(),
            rails: self.rails.iter().map(|r| RailAddr { name: r.name.clone(), addr: r.advertise.clone() }).collect(),
            locality: self.rank_rails(g),
            transport: self.ep.transport().into(),
            regions,
        };
        if let Some(sl) = st.slots.get_mut(&slot) {
            sl.state = TransferState::Running;
            sl.keys = keys;
            sl.started = Instant::now();
            sl.marks = vec![Mark { name: "enqueued".into(), at_ns: 0 }];
            sl.peer = peer.to_string();
        }
        tracing::info!(peer, slot, request = o.dst_request, src_request = o.src_request, "transfer accepted");
        (PeerMsg::Accept(accept), Some(id))
    }

    /// Recomputes the plan from the source's side and this side's
    /// registration, checks the manifest field by field, and only then
    /// expects bytes; a watcher verifies each layer and publishes it.
    fn expect(self: &Arc<Self>, id: SlotId, e: Expect) -> PeerMsg {
        let slot = id.slot;
        let refuse = |d: &Daemon, reason: String| {
            d.finish(id, TransferState::Failed, Some(reason.clone()));
            PeerMsg::Refused { reason }
        };
        let prepared = {
            let st = self.state.lock().expect("state lock");
            let Some(sl) = st.slots.get(&slot).filter(|s| s.gen == id.gen && s.role == Role::Destination && s.state == TransferState::Running) else {
                return PeerMsg::Refused { reason: format!("slot {slot} is not receiving") };
            };
            let recv = sl.recv.clone().expect("destination slots hold their receive");
            let Some(g) = st.groups.get(&recv.group) else { return PeerMsg::Refused { reason: format!("group `{}` is gone", recv.group) } };
            (recv, g.model.clone(), g.format, g.layout.clone(), g.num_blocks, g.identity.clone(), g.regions(), g.devices())
        };
        let (recv, model, format, layout, num_blocks, identity, regions, devices) = prepared;
        let manifest = match Manifest::from_json(e.manifest.as_bytes()) {
            Ok(m) => m,
            Err(err) => return refuse(self, format!("manifest: {err}")),
        };
        let planned = (|| -> anyhow::Result<_> {
            let dst = Side::with_table(&model, &layout, format, recv.tokens, recv.block_table.clone(), num_blocks)?;
            let src_layout = LayoutSpec::parse(&e.src_layout)?;
            let src = Side::with_table(&model, &src_layout, format, recv.tokens, e.src_block_table.clone(), e.src_num_blocks)?;
            let plan = plan::build(&PlanInput { model: &model, tokens: recv.tokens, prefix_tokens: recv.prefix_tokens, src: &src, dst: &dst, cost: CostModel::default() })?;
            Ok((dst, plan))
        })();
        let (dst, plan) = match planned {
            Ok(x) => x,
            Err(err) => return refuse(self, format!("source plan: {err:#}")),
        };
        // Identity, shapes, maps and positions, before any flag can be published.
        let expected = match Expected::new(&identity, &model, &dst, &recv.request, recv.tokens, recv.prefix_tokens) {
            Ok(x) => x,
            Err(err) => return refuse(self, format!("registration: {err}")),
        };
        if let Err(err) = manifest.check(&expected) {
            return refuse(self, err.to_string());
        }
        let verify = self.cfg.verify_checksums;
        if verify && manifest.checksums.is_empty() && plan.counters.total_bytes_moved > 0 {
            return refuse(self, "this daemon verifies checksums and the manifest carries none".into());
        }
        let codec = match e.codec.as_deref().map(Codec::parse).transpose() {
            Ok(c) => c,
            Err(err) => return refuse(self, err.to_string()),
        };
        let staged = match staging::layout(&model, &format, &plan, codec) {
            Ok(x) => x,
            Err(err) => return refuse(self, err),
        };
        let stage_total = staging::total(&staged);
        // Staged segments land in one buffer and are unpacked per layer.
        let stage = if stage_total > 0 {
            let made = HostMem::new("kvwire-stage", stage_total)
                .map_err(|e| e.to_string())
                .and_then(|m| self.register_region(Arc::new(m), 0, stage_total).map_err(|e| e.to_string()));
            match made {
                Ok(r) => Some(r),
                Err(err) => return refuse(self, format!("staging: {err}")),
            }
        } else {
            None
        };
        let n = model.layers.len();
        let mut per_layer = vec![0u64; n];
        let mut staged_layer: Vec<Vec<staging::Staged>> = vec![Vec::new(); n];
        let mut wire = 0;
        for st in &staged {
            let layer = plan.segments[st.seg].dst_region.layer as usize;
            staged_layer[layer].push(*st);
        }
        let staged_segs: std::collections::HashSet<usize> = staged.iter().map(|st| st.seg).collect();
        for (i, seg) in plan.segments.iter().enumerate() {
            if !staged_segs.contains(&i) {
                per_layer[seg.dst_region.layer as usize] += seg.bytes();
                wire += seg.bytes();
            }
        }
        for (layer, sts) in staged_layer.iter().enumerate() {
            let b: u64 = sts.iter().map(|st| st.size).sum();
            per_layer[layer] += b;
            wire += b;
        }
        {
            let mut st = self.state.lock().expect("state lock");
            if let Some(sl) = st.slots.get_mut(&slot) {
                sl.layers = n as u16;
                sl.bytes = plan.counters.total_bytes_moved;
                sl.segments = plan.counters.segments;
                sl.reused = plan.counters.reused_bytes;
                sl.wire = wire;
            }
        }
        Metrics::add(&self.metrics.received_bytes, plan.counters.total_bytes_moved);
        for (l, &bytes) in per_layer.iter().enumerate() {
            if let Err(err) = self.ep.placement().expect(Tag { slot, layer: l as u16 }, bytes) {
                return refuse(self, err.to_string());
            }
        }
        let reply = PeerMsg::Staging { key: stage.as_ref().map_or(0, |r| r.key), len: stage_total };
        let d = self.clone();
        let timeout = Duration::from_secs(self.cfg.limits.transfer_timeout_secs);
        let spawned = std::thread::Builder::new().name(format!("kvwired-recv-{slot}")).spawn(move || {
            let span = tracing::info_span!("receive", slot, request = recv.request);
            let _g = span.enter();
            let start = Instant::now();
            for (layer, &layer_bytes) in per_layer.iter().enumerate() {
                let tag = Tag { slot, layer: layer as u16 };
                let left = timeout.saturating_sub(start.elapsed());
                if let Err(err) = d.ep.placement().wait(tag, left) {
                    d.finish(id, TransferState::Failed, Some(err.to_string()));
                    d.drop_stage(&stage);
                    return;
                }
                d.slot_mark(id, format!("host_received({layer})"));
                // Unpack (and decode) this layer's staged segments into place.
                let t = Instant::now();
                for st in &staged_layer[layer] {
                    let seg = &plan.segments[st.seg];
                    let placed = (|| -> Option<()> {
                        let stage = stage.as_ref()?;
                        let bytes = staging::read(&stage.mem, st.offset, st.size)?;
                        let data = staging::unpack(&bytes, st, &format, codec)?;
                        let r = regions.get(&(seg.dst_rank, seg.dst_region))?;
                        for (k, (_, dof)) in seg.runs().enumerate() {
                            let run = data.get(k * seg.len as usize..(k + 1) * seg.len as usize)?;
                            r.mem.write(r.offset + dof, run).ok()?;
                        }
                        Some(())
                    })();
                    if placed.is_none() {
                        d.finish(id, TransferState::Failed, Some(format!("unpack of layer {layer} failed")));
                        d.drop_stage(&stage);
                        return;
                    }
                }
                if !staged_layer[layer].is_empty() {
                    d.slot_hop(id, Hop::Unpack, t.elapsed(), staged_layer[layer].iter().map(|st| plan.segments[st.seg].bytes()).sum());
                }
                if verify && layer_bytes > 0 {
                    let t = Instant::now();
                    let read = |rank: u32, region: RegionId, offset: u64, len: u64| {
                        let r = regions.get(&(rank, region))?;
                        staging::read(&r.mem, r.offset + offset, len)
                    };
                    let this_layer = |_, l: u32| l as usize == layer;
                    let checked = checksums_at_destination(&plan, read, this_layer)
                        .and_then(|rec| manifest.verify_checksums_of(&rec, this_layer));
                    d.slot_hop(id, Hop::Verify, t.elapsed(), layer_bytes);
                    if let Err(err) = checked {
                        tracing::warn!(layer, error = %err, "verification failed; no flag for this layer");
                        d.finish(id, TransferState::Failed, Some(err.to_string()));
                        d.drop_stage(&stage);
                        return;
                    }
                }
                // A device-resident cache is usable only once this layer's
                // host → device copies completed (their event, not their enqueue).
                if !devices.is_empty() {
                    if let Err(err) = d.device_copies(id, Direction::ToDevice, &plan, &regions, &devices, layer..layer + 1) {
                        d.finish(id, TransferState::Failed, Some(format!("host → device copy: {err}")));
                        d.drop_stage(&stage);
                        return;
                    }
                    d.slot_mark(id, format!("device_complete({layer})"));
                }
                d.publish(id, tag.layer);
                d.slot_mark(id, format!("layer_ready({layer})"));
            }
            d.drop_stage(&stage);
            d.publish(id, DECODER_USABLE);
            d.slot_mark(id, "decoder_usable".into());
            d.finish(id, TransferState::Done, None);
            tracing::info!(elapsed_ms = start.elapsed().as_millis() as u64, "decoder usable");
        });
        if let Err(err) = spawned {
            return refuse(self, format!("cannot start the receive thread: {err}"));
        }
        reply
    }

    /// Revokes a transfer's staging buffer: late writes to it fail.
    fn drop_stage(&self, stage: &Option<Arc<Region>>) {
        if let Some(r) = stage {
            self.revoke_key(r.key);
        }
    }

    // ------------------------------------------------------------ metrics

    fn metrics_loop(self: Arc<Self>, l: TcpListener) {
        for s in l.incoming() {
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            let Ok(mut s) = s else { continue };
            let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
            let mut buf = [0u8; 1024];
            let n = std::io::Read::read(&mut s, &mut buf).unwrap_or(0);
            let req = String::from_utf8_lossy(&buf[..n]);
            let (status, body) = if req.starts_with("GET /metrics") {
                ("200 OK", self.metrics_text())
            } else {
                ("404 Not Found", "try GET /metrics\n".to_string())
            };
            let resp = format!(
                "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = std::io::Write::write_all(&mut s, resp.as_bytes());
        }
    }
}

fn running(state: TransferState) -> bool {
    matches!(state, TransferState::Prepared | TransferState::Running)
}

/// Group `name`, if `client` holds a rank of it: a client touches only
/// the caches it registered (ranks of one group may come from several
/// clients, one per process).
fn group_access<'a>(st: &'a State, client: u64, name: &str) -> Result<&'a Group, Box<Reply>> {
    let Some(g) = st.groups.get(name) else { return Err(Box::new(err(Code::UnknownGroup, format!("no group `{name}`")))) };
    if !g.ranks.values().any(|r| r.client == client) {
        return Err(Box::new(err(Code::PermissionDenied, format!("group `{name}` was registered by another client"))));
    }
    Ok(g)
}

/// Refuses a slot request from a client that neither made the transfer nor
/// holds a rank of its group.
fn slot_access(st: &State, client: u64, slot: u16) -> Result<(), Box<Reply>> {
    match st.slots.get(&slot) {
        None => Err(Box::new(err(Code::UnknownSlot, format!("no transfer in slot {slot}")))),
        Some(s) if s.owner == client || group_access(st, client, &s.group).is_ok() => Ok(()),
        Some(s) => Err(Box::new(err(Code::PermissionDenied, format!("slot {slot} is a transfer of group `{}`, which this client holds no rank of", s.group)))),
    }
}

/// Which way [`Daemon::device_copies`] copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    ToHost,
    ToDevice,
}

/// Sorts copy runs (device offset, host offset, len) and joins the ones
/// that continue each other on both sides: fewer, larger copies.
fn merge_runs(mut runs: Vec<(u64, u64, u64)>) -> Vec<(u64, u64, u64)> {
    runs.sort_unstable();
    let mut out: Vec<(u64, u64, u64)> = Vec::with_capacity(runs.len());
    for r in runs {
        match out.last_mut() {
            Some(last) if last.0 + last.2 == r.0 && last.1 + last.2 == r.1 => last.2 += r.2,
            _ => out.push(r),
        }
    }
    out
}
