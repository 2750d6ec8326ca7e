//! The daemon: cache groups registered by local clients, transfer slots,
//! the control socket, the peer listener, and the threads that move bytes.
//!
//! One transfer, walked through the modules: a client's `submit` arrives on
//! the control socket ([`control`]); the source ([`source`]) takes a slot
//! ([`transfers`], [`state`]), opens a peer session ([`link`], driving
//! core's `SourceSession`), plans and schedules against the destination's
//! accept, stages device memory ([`device`]), sends the manifest, packs,
//! and hands per-layer batches to the rails ([`rails`]); a streamed submit
//! instead does the manifest's checksums, staging, packing and posting one
//! layer at a time, as the engine announces each written ([`produced`]).
//! The destination
//! ([`destination`], driving core's `DestinationSession`) grants keys at
//! offer, re-plans and checks the manifest at expect, and its receive
//! thread unpacks, verifies and publishes each layer. Errors are
//! [`error::Refusal`]s, turned into a reply and an abort in one place.

mod announce;
mod control;
mod destination;
mod device;
mod error;
mod kept;
mod landing;
mod link;
mod plans;
mod produced;
mod rails;
mod ring;
mod source;
mod staging;
mod state;
mod ticker;
mod transfers;
mod workers;

use crate::config::{Config, TransportKind};
use crate::metrics::Metrics;
use kvwire_client::control::*;
use kvwire_transport::device::bound::Backend;
use kvwire_transport::device::host::HostDevice;
use kvwire_transport::shm::{ShmEndpoint, ShmLimits};
use kvwire_transport::tcp::{TcpEndpoint, TcpLimits};
use kvwire_transport::verbs::{VerbsEndpoint, VerbsLimits};
use kvwire_transport::flags::SleepBoard;
use kvwire_transport::{Endpoint, FlagTable, Hops, HostMem, Placement, Registry};
use state::{Groups, LiveSlots, Slots};
use kvwire_core::manifest::{chunks_of, Checksums, Reading};
use kvwire_core::plan::Plan;
use kvwire_core::shard::RegionId;
use kvwire_transport::Region;
use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long a source waits for the destination's answer to an offer or an expect.
const REPLY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a transfer waits for the peer connection an earlier transfer
/// to that peer is about to hand back (it is waiting for its verdict)
/// before making a new one: a new connection costs a handshake, a new
/// data-plane session and new data connections.
const PEER_CONN_WAIT: Duration = Duration::from_millis(5);

/// A running daemon.
pub struct Daemon {
    cfg: Config,
    secret: Vec<u8>,
    ep: Arc<dyn Endpoint>,
    // The page clients map. The data plane's placement publishes into its
    // own table (bytes counted); a layer reaches this page only after it
    // was also verified.
    page: FlagTable,
    // Where clients declare the words of `page` they sleep on.
    sleepers: Arc<SleepBoard>,
    // Lock order: groups, then slots.
    groups: Mutex<Groups>,
    slots: Mutex<Slots>,
    // Which slots hold a transfer that has not ended.
    live: LiveSlots,
    /// Counters.
    pub metrics: Metrics,
    stop: AtomicBool,
    next_client: AtomicU64,
    // Control clients connected now: with none left, nothing kept between
    // transfers (staging buffers, peer connections) is kept any longer.
    clients: AtomicU64,
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
    // Staging buffers kept faulted in between transfers.
    stage_pool: staging::StagePool,
    // Pinned staging rings of device-resident sources, kept between transfers.
    ring_pool: ring::RingPool,
    // (device, inode) of the control socket this daemon bound: shutdown
    // unlinks the path only while it is still this one.
    control_id: (u64, u64),
    // Authenticated peer-control connections kept between transfers, by
    // (peer name, address): the next transfer to that peer skips connect and
    // handshake; one the peer closed meanwhile costs a failed offer, then a
    // new connection.
    peer_conns: kept::Kept<(String, String), crate::peer::Sealed>,
    // Data-plane connections kept between transfers, by (local rail, peer's
    // rail address, data-plane session), where the transport says they are
    // reusable (tcp).
    data_conns: Arc<kept::Kept<(usize, String, u64), Box<dyn kvwire_transport::Connection>>>,
    // Threads kept for transfers' work.
    workers: workers::Workers,
    // The transfers' periodic checks (stripe watchdogs, heartbeats), on one thread.
    ticker: ticker::Ticker,
    // Transfers landing on their events' threads, by slot.
    landings: landing::Landings,
    // Layers engines announced as written, for streamed submits.
    produced: produced::Produced,
    // Destination: authenticated peer connections, where announcements go.
    outboxes: announce::Outboxes,
    // Source: announcements heard, not yet claimed.
    announcements: Arc<announce::AnnounceBook>,
    // Plans kept for requests like earlier ones: the source's against a
    // destination, the destination's at a claim or offer, and its own at
    // an announcement.
    sent_plans: plans::Plans<source::SentKey, source::Planned>,
    received_plans: plans::Plans<destination::ReceivedKey, destination::Replanned>,
    announced_plans: plans::Plans<(u64, u64, u64, Vec<u32>), Vec<u64>>,
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

/// The data plane's accounting: bytes count only toward what a transfer
/// into this daemon declared at expect, so writes under made-up tags are
/// refused before they land and leave nothing behind.
fn flags_placement() -> anyhow::Result<Arc<Placement>> {
    Ok(Arc::new(Placement::new(FlagTable::private(FLAG_SLOTS, MAX_TRANSFER_LAYERS)?, Arc::new(Hops::default())).declared_only()))
}

/// Reads `len` bytes of a mapping.
fn read_mem(mem: &HostMem, offset: u64, len: u64) -> Option<Vec<u8>> {
    let mut b = vec![0u8; len as usize];
    mem.read(offset, &mut b).ok()?;
    Some(b)
}

/// Reads runs of registered regions for the checksums straight from their
/// mappings: a remap reads hundreds of thousands of row-sized runs, and a
/// copy of each (let alone an allocation) cost more than hashing it.
struct RunReader<'a> {
    regions: &'a ByRegion<Arc<Region>>,
    // The region of the previous run: runs come region by region.
    last: Cell<Option<(RegionKey, &'a Region)>>,
}

/// A registered region of a rank.
type RegionKey = (u32, RegionId);

/// Values by (rank, region). Looked up once per segment while packing,
/// unpacking and hashing; the keys are the daemon's own small integers,
/// so a fast hasher, not SipHash (which cost as much as a 2 KiB copy).
pub(crate) type ByRegion<V> = HashMap<RegionKey, V, rustc_hash::FxBuildHasher>;

/// Bytes a [`RunReader`] hands out: a view of the mapping, or a converted copy.
enum RunBytes<'a> {
    Mapped(&'a [u8]),
    Owned(Vec<u8>),
}

impl AsRef<[u8]> for RunBytes<'_> {
    fn as_ref(&self) -> &[u8] {
        match self {
            RunBytes::Mapped(b) => b,
            RunBytes::Owned(v) => v,
        }
    }
}

impl<'a> RunReader<'a> {
    fn new(regions: &'a ByRegion<Arc<Region>>) -> RunReader<'a> {
        RunReader { regions, last: Cell::new(None) }
    }

    /// `len` bytes at `offset` of (rank, region); None outside the region.
    fn read(&self, rank: u32, region: RegionId, offset: u64, len: u64) -> Option<RunBytes<'a>> {
        let r = match self.last.get() {
            Some((k, r)) if k == (rank, region) => r,
            _ => {
                let r: &'a Region = self.regions.get(&(rank, region))?;
                self.last.set(Some(((rank, region), r)));
                r
            }
        };
        region_view(r, offset, len).map(RunBytes::Mapped)
    }
}

/// Segments `segs` (plan order) in consecutive pieces of about
/// [`PIECE_BYTES`] (at least one segment each), with the bytes each piece
/// covers. Packing or unpacking a piece and hashing it next reads it while
/// it is in the CPU's cache; one pass over a whole transfer, then the
/// other, reads it from memory twice.
fn pieces<'p, S: IntoIterator<Item = usize>>(plan: &'p Plan, segs: S) -> impl Iterator<Item = (Vec<usize>, u64)> + 'p
where
    S::IntoIter: 'p,
{
    let mut segs = segs.into_iter().map(|i| (i, plan.segments.get(i).map_or(0, |s| s.bytes()))).peekable();
    std::iter::from_fn(move || {
        let (mut piece, mut bytes) = (Vec::new(), 0);
        while let Some(&(i, b)) = segs.peek() {
            if !piece.is_empty() && bytes + b > PIECE_BYTES {
                break;
            }
            (bytes, _) = (bytes + b, segs.next());
            piece.push(i);
        }
        (!piece.is_empty()).then_some((piece, bytes))
    })
}

/// The least a part of a layer takes when its segments are hashed, packed
/// or unpacked in parts side by side ([`by_chunk`]): below it a thread's
/// start costs more than the part it takes. Split into 512 KiB parts,
/// llama-3.1-8b's 1 MiB layers (256 tokens) over shm went 0.37-0.45 of
/// memcpy -> 0.23-0.28 (`kvwire bench layouts`, 3 runs each), and a
/// 1 MiB remapped transfer packed and hashed in two parts reached
/// `decoder_usable` in 0.82-0.85 ms against 0.70-0.73 in one
/// (`kvwire-soak --tokens 256`, three pairs).
const PARALLEL_BYTES: u64 = 1 << 20;

/// Cores this process may run on, read once.
fn cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Some of a layer's segments, for one thread: whole checksum chunks
/// ([`chunks_of`]), and where each starts in its region's stream, so that
/// its checksums are the layer's ([`Part::sums`]).
#[derive(Debug, Default)]
struct Part {
    segs: Vec<usize>,
    starts: Vec<(usize, u64)>,
}

impl std::ops::Deref for Part {
    type Target = [usize];
    fn deref(&self) -> &[usize] {
        &self.segs
    }
}

impl Part {
    /// All of `segs` (plan order, whole regions) on one thread.
    fn whole(segs: Vec<usize>) -> Part {
        Part { segs, starts: Vec::new() }
    }

    /// Checksums of this part's chunks, read at `side`.
    fn sums<'p>(&self, plan: &'p Plan, side: Reading) -> Checksums<'p> {
        Checksums::new(plan, side).starting_at(self.starts.iter().copied())
    }
}

/// A layer's segments `segs` (plan order, whole regions; `bytes` in all)
/// in parts of whole checksum chunks, at most one per core and one per
/// [`PARALLEL_BYTES`], of about equal bytes, each chunk's segments in plan
/// order. A region's chunks hash apart ([`chunks_of`]), so one region
/// (FlashInfer's K and V in one tensor) splits as well as several; a
/// segment longer than a chunk is a chunk of its own.
fn by_chunk(plan: &Plan, segs: Vec<usize>, bytes: u64) -> Vec<Part> {
    by_chunk_among(plan, segs, bytes, cores())
}

/// [`by_chunk`] on `cores` cores.
fn by_chunk_among(plan: &Plan, segs: Vec<usize>, bytes: u64, cores: usize) -> Vec<Part> {
    let most = cores.min(usize::try_from(bytes / PARALLEL_BYTES).unwrap_or(usize::MAX));
    if most < 2 {
        return vec![Part::whole(segs)];
    }
    let chunks = chunks_of(plan, &segs);
    let total: u128 = chunks.iter().map(|c| u128::from(c.bytes)).sum::<u128>().max(1);
    // A chunk goes to the part its middle byte falls in, the layer's bytes
    // cut into `most` equal spans: parts come out about equal.
    let mut parts: Vec<Part> = (0..most).map(|_| Part::default()).collect();
    let mut before: u128 = 0;
    for c in chunks {
        let middle = before + u128::from(c.bytes) / 2;
        let p = &mut parts[usize::try_from(middle * most as u128 / total).unwrap_or(most - 1).min(most - 1)];
        before += u128::from(c.bytes);
        p.starts.push((c.seg, c.start));
        p.segs.extend(c.segs);
    }
    parts.retain(|p| !p.segs.is_empty());
    parts
}

/// `work` on each of `parts`, the first on this thread and the others on
/// threads of their own; the results in the parts' order. A panic in a
/// part is this thread's.
fn side_by_side<T: Send>(parts: &[Part], work: impl Fn(&Part) -> T + Sync) -> Vec<T> {
    let Some((first, rest)) = parts.split_first() else { return Vec::new() };
    if rest.is_empty() {
        return vec![work(first)];
    }
    std::thread::scope(|s| {
        let work = &work;
        let others: Vec<_> = rest.iter().map(|p| s.spawn(move || work(p))).collect();
        let mut out = vec![work(first)];
        for h in others {
            out.push(h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)));
        }
        out
    })
}

/// `work` on each part of a layer's segments `segs` (plan order, `bytes`
/// in all; [`by_chunk`]), the parts side by side ([`side_by_side`]): the
/// parts' results in order, or the first error.
fn in_parts<T: Send, E: Send>(plan: &Plan, segs: Vec<usize>, bytes: u64, work: impl Fn(&Part) -> Result<T, E> + Sync) -> Result<Vec<T>, E> {
    side_by_side(&by_chunk(plan, segs, bytes), work).into_iter().collect()
}

/// A quarter of a core's L2 on the machines we measure on: the piece, the
/// source rows it gathers and the hash's own state fit in it together.
const PIECE_BYTES: u64 = 256 << 10;

/// `len` bytes at `offset` of `r`'s window, in place; None outside it.
fn region_view(r: &Region, offset: u64, len: u64) -> Option<&[u8]> {
    if offset.checked_add(len)? > r.len {
        return None;
    }
    r.mem.check(r.offset + offset, len).ok()?;
    // SAFETY: the range lies inside the region's live mapping (checked
    // above), which `r` keeps alive while the view is borrowed. Whoever
    // else maps it (the engine) may write these pages meanwhile, as it may
    // while `HostMem::read` copies them; a checksum over them then differs
    // and the transfer fails, which is the point of it.
    Some(unsafe { std::slice::from_raw_parts(r.mem.as_ptr().add((r.offset + offset) as usize), len as usize) })
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
        let (ep, verbs) = open_endpoint(&cfg)?;
        // `post` and `wire` are timed per transfer, over all its batches
        // and rails (`rails.rs`).
        ep.placement().hops().link_per_transfer();
        let rails = open_rails(&cfg, &ep, verbs.as_ref())?;
        let topology = open_topology(&cfg, &rails)?;
        let device = open_device(&cfg)?;
        let peer_listener = TcpListener::bind(&cfg.peer_listen).map_err(|e| anyhow::anyhow!("peer_listen {}: {e}", cfg.peer_listen))?;
        let peer_addr = peer_listener.local_addr()?.to_string();
        let (control, control_id) = claim_control_socket(&cfg.control_socket)?;
        let metrics_listener = if cfg.metrics_listen.is_empty() {
            None
        } else {
            Some(TcpListener::bind(&cfg.metrics_listen).map_err(|e| anyhow::anyhow!("metrics_listen {}: {e}", cfg.metrics_listen))?)
        };
        let stage_pool = staging::StagePool::new(cfg.limits.staging_pool_bytes);
        let ring_pool = ring::RingPool::new(cfg.limits.staging_pool_bytes);
        // Every rail's endpoint shares the first one's registry.
        let metrics = Metrics { data_refused: ep.registry().handshakes_refused().clone(), ..Metrics::default() };
        let kept = cfg.limits.peer_connections_kept;
        let sleepers = Arc::new(SleepBoard::default());
        let d = Arc::new(Daemon {
            cfg,
            secret,
            ep,
            page: FlagTable::shared(FLAG_SLOTS, FLAG_COLUMNS, sleepers.clone())?,
            sleepers,
            groups: Mutex::new(Groups::default()),
            slots: Mutex::new(Slots::default()),
            live: LiveSlots::default(),
            metrics,
            stop: AtomicBool::new(false),
            next_client: AtomicU64::new(1),
            clients: AtomicU64::new(0),
            peer_addr,
            peer_hops: Mutex::new(BTreeMap::new()),
            rails,
            topology,
            device,
            stage_pool,
            ring_pool,
            control_id,
            // `limits.peer_connections_kept` (default 8): at 4, 8 engines
            // submitting to one peer at once opened a new peer connection
            // (handshakes, data connections) for about one transfer in twelve.
            peer_conns: kept::Kept::new(kept),
            data_conns: Arc::new(kept::Kept::new(kept)),
            workers: workers::Workers::default(),
            ticker: ticker::Ticker::start("kvwired-tick")?,
            landings: Default::default(),
            produced: produced::Produced::default(),
            outboxes: announce::Outboxes::default(),
            announcements: Arc::default(),
            sent_plans: plans::Plans::new(),
            received_plans: plans::Plans::new(),
            announced_plans: plans::Plans::new(),
            discovery: std::sync::OnceLock::new(),
        });
        // Weak: the data plane's threads hold the placement, and through
        // this the daemon, only while a layer's landing runs there.
        let weak = Arc::downgrade(&d);
        d.ep.placement().on_complete(Box::new(move |tag| {
            if let Some(d) = weak.upgrade() {
                d.layer_placed(tag);
            }
        }));
        let dd = d.clone();
        std::thread::Builder::new().name("kvwired-control".into()).spawn(move || dd.control_loop(control))?;
        let dd = d.clone();
        std::thread::Builder::new().name("kvwired-peers".into()).spawn(move || dd.peer_loop(peer_listener))?;
        if let Some(l) = metrics_listener {
            let dd = d.clone();
            std::thread::Builder::new().name("kvwired-metrics".into()).spawn(move || dd.metrics_loop(l))?;
        }
        tracing::info!(node = d.cfg.node, transport = d.ep.transport().as_str(), data = d.ep.local_addr(), peer = d.peer_addr, "kvwired started");
        if !d.cfg.discovery.etcd.is_empty() {
            use crate::discovery::{Discovery, Entry, Serves};
            let data = d.rails.iter().map(|r| r.advertise.clone()).collect();
            let me = Entry::for_daemon(&d.cfg, &d.peer_addr, d.ep.transport(), data);
            // Weak: what the entry says it serves is read from the groups
            // without keeping the daemon alive.
            let weak = Arc::downgrade(&d);
            let serves = move || {
                weak.upgrade().map_or_else(Serves::default, |d| Serves::of(d.groups.lock().expect("groups lock").map.values().map(|g| &g.identity)))
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
        if file_id(&self.cfg.control_socket) == Some(self.control_id) {
            let _ = std::fs::remove_file(&self.cfg.control_socket);
        }
    }

    fn hops(&self) -> &Arc<Hops> {
        self.ep.placement().hops()
    }

    /// Prometheus text of every counter and hop histogram.
    pub fn metrics_text(&self) -> String {
        let per_peer: Vec<(String, Arc<Hops>)> =
            self.peer_hops.lock().expect("peer hops lock").iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        let mut text = self.metrics.render(&self.cfg.node, self.hops(), &per_peer);
        text.push_str(&crate::metrics::writes_refused(&self.cfg.node, self.ep.placement().refusals().by_reason()));
        let groups = self.groups.lock().expect("groups lock");
        let mut rows = Vec::new();
        for (name, g) in &groups.map {
            for (rank, rc) in &g.ranks {
                for (memory, m) in rc.device.iter().flat_map(|d| d.devs.iter().enumerate()) {
                    let (direct, detail) = match &m.path {
                        state::DevicePath::Direct { how, .. } => (true, how.as_str()),
                        state::DevicePath::Staged { why } => (false, why.as_str()),
                    };
                    rows.push(crate::metrics::DeviceMemoryRow { group: name, rank: *rank, memory, direct, detail });
                }
            }
        }
        rows.sort_by_key(|r| (r.group, r.rank, r.memory));
        text.push_str(&crate::metrics::device_memory(&self.cfg.node, &rows));
        text
    }

    /// Whether anything should be kept for a next transfer: some client is
    /// still connected.
    fn keeping(&self) -> bool {
        self.clients.load(Ordering::Acquire) > 0
    }

    /// The last client left: lets go of what was kept between transfers.
    fn drop_kept(&self) {
        self.peer_conns.clear();
        self.data_conns.clear();
        for r in self.stage_pool.clear() {
            self.revoke_key(r.key);
        }
        self.ring_pool.clear();
        self.workers.shrink();
    }

    /// What this daemon serves changed: its etcd entry is rewritten.
    fn discovery_changed(&self) {
        if let Some(d) = self.discovery.get() {
            d.changed()
        }
    }

    /// Serves each scrape on its own short-lived thread with read and write
    /// deadlines, at most a few at once: an idle or slow connection holds
    /// only itself, never the next scraper.
    fn metrics_loop(self: Arc<Self>, l: TcpListener) {
        const AT_ONCE: u64 = 8;
        let live = Arc::new(AtomicU64::new(0));
        for s in l.incoming() {
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            let Ok(s) = s else { continue };
            if live.load(Ordering::Acquire) >= AT_ONCE {
                continue; // Dropped: closed at once.
            }
            live.fetch_add(1, Ordering::AcqRel);
            let (d, live) = (self.clone(), live.clone());
            let spawned = std::thread::Builder::new().name("kvwired-scrape".into()).spawn(move || {
                d.serve_scrape(s);
                live.fetch_sub(1, Ordering::AcqRel);
            });
            if spawned.is_err() {
                tracing::warn!("cannot spawn a metrics thread");
            }
        }
    }

    fn serve_scrape(&self, mut s: TcpStream) {
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        let _ = s.set_write_timeout(Some(Duration::from_secs(2)));
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

/// The first rail's endpoint, and the verbs endpoint behind it, if verbs.
type FirstRail = (Arc<dyn Endpoint>, Option<Arc<VerbsEndpoint>>);

/// The data plane's first rail, and the verbs endpoint that opens the
/// other devices as rails.
fn open_endpoint(cfg: &Config) -> anyhow::Result<FirstRail> {
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
            TcpEndpoint::bind(&cfg.node, t.tcp_listen.parse()?, reg, flags_placement()?, TcpLimits { idle_poll: cfg.idle_poll(), ..TcpLimits::default() })?
        }
        TransportKind::Shm => {
            let reg = Arc::new(Registry::new(keys));
            ShmEndpoint::new(&cfg.node, t.shm_dir.as_deref(), reg, flags_placement()?, ShmLimits { idle_poll: cfg.idle_poll(), ..ShmLimits::default() })?
        }
        TransportKind::Verbs => {
            let limits = VerbsLimits {
                listen: t.verbs_listen.clone(),
                node: cfg.node.clone(),
                max_regions: keys,
                slots: FLAG_SLOTS,
                layers: MAX_TRANSFER_LAYERS,
                declared_only: true,
                ..VerbsLimits::default()
            };
            let v = Arc::new(VerbsEndpoint::new(t.verbs_device.as_deref(), t.verbs_port, t.verbs_gid_index, limits)?);
            verbs = Some(v.clone());
            v
        }
    };
    Ok((ep, verbs))
}

/// Every data rail, `ep`'s first.
fn open_rails(cfg: &Config, ep: &Arc<dyn Endpoint>, verbs: Option<&Arc<VerbsEndpoint>>) -> anyhow::Result<Vec<RailEp>> {
    let t = &cfg.transport;
    let mut rails = vec![RailEp {
        name: "rail0".into(),
        advertise: match (&t.tcp_advertise, t.kind) {
            (Some(a), TransportKind::Tcp) => a.clone(),
            _ => ep.local_addr(),
        },
        // With several verbs rails, each one's device is its RDMA
        // device unless named otherwise (one rail needs no locality).
        device: t.device.clone().or_else(|| verbs.filter(|_| !cfg.rails.is_empty()).map(|v| v.info().device.clone())),
        ep: None,
    }];
    for r in &cfg.rails {
        let (extra, device): (Arc<dyn Endpoint>, Option<String>) = match verbs {
            Some(v) => {
                let rail = v
                    .rail(r.verbs_device.as_deref(), r.verbs_port, r.verbs_gid_index, &r.verbs_listen)
                    .map_err(|e| anyhow::anyhow!("rails `{}` verbs_device {}: {e}", r.name, r.verbs_device.as_deref().unwrap_or("?")))?;
                let device = r.device.clone().unwrap_or_else(|| rail.info().device.clone());
                (Arc::new(rail), Some(device))
            }
            None => {
                let listen = r.tcp_listen.parse().map_err(|e| anyhow::anyhow!("rails `{}` tcp_listen {}: {e}", r.name, r.tcp_listen))?;
                let extra = TcpEndpoint::bind(&cfg.node, listen, ep.registry().clone(), ep.placement().clone(), TcpLimits { idle_poll: cfg.idle_poll(), ..TcpLimits::default() })
                    .map_err(|e| anyhow::anyhow!("rails `{}` tcp_listen {}: {e}", r.name, r.tcp_listen))?;
                (extra, r.device.clone())
            }
        };
        let advertise = r.tcp_advertise.clone().unwrap_or_else(|| extra.local_addr());
        rails.push(RailEp { name: r.name.clone(), advertise, device, ep: Some(extra) });
    }
    Ok(rails)
}

/// The host's topology, when a rail names its device or a topology file
/// is given; a device or file that does not match this host stops the daemon, named.
fn open_topology(cfg: &Config, rails: &[RailEp]) -> anyhow::Result<Option<kvwire_core::topology::HostTopology>> {
    let t = &cfg.transport;
    // Locality: only when a rail names its device. A device or file that
    // does not match this host stops the daemon, named.
    let topology = if rails.iter().any(|r| r.device.is_some()) || t.topology_file.is_some() {
        let topo = kvwire_transport::topology::discover(std::path::Path::new("/"), t.topology_file.as_deref())?;
        for r in rails {
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
    Ok(topology)
}

/// The `[device]` backend for device-resident caches.
fn open_device(cfg: &Config) -> anyhow::Result<Option<Backend>> {
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
    Ok(device)
}

/// (device, inode) of `path` itself (not what a symlink points to).
fn file_id(path: &std::path::Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// Binds the control socket at `path`. A socket another daemon still
/// serves, and anything that is not a socket, are refused by name; a stale
/// socket (nothing answers on it) is replaced.
fn claim_control_socket(path: &std::path::Path) -> anyhow::Result<(UnixListener, (u64, u64))> {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            if UnixStream::connect(path).is_ok() {
                anyhow::bail!("control_socket {}: another kvwired is serving it", path.display());
            }
            std::fs::remove_file(path).map_err(|e| anyhow::anyhow!("control_socket {}: cannot replace the stale socket: {e}", path.display()))?;
        }
        Ok(_) => anyhow::bail!("control_socket {}: exists and is not a socket; refusing to replace it", path.display()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => anyhow::bail!("control_socket {}: {e}", path.display()),
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).ok();
    }
    let l = UnixListener::bind(path).map_err(|e| anyhow::anyhow!("control_socket {}: {e}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    let id = file_id(path).ok_or_else(|| anyhow::anyhow!("control_socket {}: gone right after bind", path.display()))?;
    Ok((l, id))
}

#[cfg(test)]
mod tests {
    use super::{by_chunk_among, side_by_side, Part};
    use kvwire_core::format::CacheFormat;
    use kvwire_core::layout::{from_toml_spec, Tensor};
    use kvwire_core::manifest::{checksums_at_source, read_buffers, LayerChecksum, Reading, CHECKSUM_CHUNK};
    use kvwire_core::plan::{build, CostModel, PlanInput, Side};
    use kvwire_core::shard::LayoutSpec;
    use kvwire_core::verify::fill_source;

    #[test]
    fn a_layer_splits_into_parts_of_whole_chunks_whose_checksums_are_the_layers_even_for_one_region() {
        // One layer, 8 heads of 128 fp32, 1100 tokens: TP4 NHD/16 -> TP2
        // HND/32 gives each destination region 2,252,800 bytes in 16 KiB
        // segments (a block of one head), three checksum chunks.
        let model = from_toml_spec("one", "[[layers]]\nattention = \"dense\"\nkv_heads = 8\nhead_dim = 128\n").unwrap();
        let fp32 = CacheFormat::parse("fp32").unwrap();
        let side = |l: &str| Side::new(&model, &LayoutSpec::parse(l).unwrap(), fp32, 1100).unwrap();
        let (src, dst) = (side("tp=4,block=16"), side("tp=2,layout=hnd,block=32"));
        let plan = build(&PlanInput { model: &model, tokens: 1100, prefix_tokens: 0, src: &src, dst: &dst, cost: CostModel::default() }).unwrap();
        let bufs = fill_source(&model, &src, 1100);
        let all: Vec<usize> = (0..plan.segments.len()).collect();
        let whole = checksums_at_source(&plan, read_buffers(&bufs), |_, _| true).unwrap();
        assert_eq!(whole.len(), 2 * 2 * 3);
        let one_region: Vec<usize> = all.iter().copied().filter(|&i| {
            let s = plan.segments.at(i);
            s.dst_rank == 1 && s.dst_region.tensor == Tensor::V
        }).collect();
        for (segs, cores, parts) in [(all.clone(), 16, 8), (all.clone(), 3, 3), (all.clone(), 1, 1), (one_region, 16, 2)] {
            let bytes: u64 = segs.iter().map(|&i| plan.segments.at(i).bytes()).sum();
            let split = by_chunk_among(&plan, segs.clone(), bytes, cores);
            // At most a part per core and per MiB, none empty, every segment in one.
            assert_eq!(split.len(), parts, "{cores} cores, {bytes} bytes");
            // About equal: within two chunks of each other.
            let sizes: Vec<u64> = split.iter().map(|p| p.iter().map(|&i| plan.segments.at(i).bytes()).sum()).collect();
            assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 2 * CHECKSUM_CHUNK, "{sizes:?}");
            assert!(split.iter().all(|p| !p.is_empty()));
            let mut seen: Vec<usize> = split.iter().flat_map(|p| p.iter().copied()).collect();
            seen.sort_unstable();
            assert_eq!(seen, { let mut s = segs.clone(); s.sort_unstable(); s });
            // Hashed side by side, the parts' checksums are the layer's.
            let mut sums: Vec<LayerChecksum> = side_by_side(&split, |p: &Part| {
                let mut sums = p.sums(&plan, Reading::Source);
                sums.add(p.iter().copied(), read_buffers(&bufs), |_| None::<&[u8]>).unwrap();
                sums.finish()
            })
            .concat();
            sums.sort_unstable_by_key(LayerChecksum::key);
            let want: Vec<LayerChecksum> = whole.iter().filter(|c| segs.iter().any(|&i| {
                let s = plan.segments.at(i);
                (s.dst_rank, s.dst_region.tensor) == (c.dst_rank, c.tensor)
            })).copied().collect();
            assert_eq!(sums, want, "{cores} cores");
        }
    }
}
