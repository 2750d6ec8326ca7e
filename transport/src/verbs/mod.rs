//! Verbs (RDMA) transport: RC queue pairs, one-sided `RDMA_WRITE`s, each
//! batch followed by a SEND of [`WriteNote`]s naming what it wrote.
//!
//! - [`VerbsEndpoint::new`] opens an RDMA device (through `sideway`, which
//!   loads libibverbs at run time, so this builds and runs on hosts without
//!   rdma-core and fails there with [`TransportError::NoDevice`]), a
//!   protection domain, and a TCP listener for the out-of-band handshake.
//! - [`VerbsEndpoint::register`] puts a window of a [`HostMem`] in the
//!   endpoint's [`Registry`] *and* registers it with the NIC
//!   (`LOCAL_WRITE | REMOTE_WRITE`). Peers address it by the MR's rkey and
//!   the window's virtual address: the descriptors in this endpoint's
//!   [`Hello`] carry `key = rkey`, `addr = mapping + offset`.
//!   [`VerbsEndpoint::revoke`] deregisters the MR, so every later remote
//!   write to it fails at the destination NIC with a remote access error.
//! - Several devices (rails): [`VerbsEndpoint::rail`] opens another device
//!   sharing the first one's registry and placement;
//!   [`VerbsEndpoint::attach`] registers a region of the shared registry
//!   with that device too. Its hello names the region by the shared `key`
//!   and gives its own device's `rkey`, so a write names the same key on
//!   every rail and counts toward the same layer.
//! - [`Endpoint::connect`] exchanges [`Hello`]s (version, transport, regions,
//!   QPN/PSN/GID/LID/MTU) and brings an RC QP on each side to RTS. The
//!   accepting side runs one thread per connection that pre-posts receives
//!   into a registered buffer ring and polls its CQ. After a batch's
//!   writes, the source SENDs notes naming each write's (tag, key, offset,
//!   length); RC ordering places the writes before the SEND completes at
//!   the destination, which then counts each named range once with
//!   [`Placement::placed_range`]. Layer flags therefore follow counted
//!   completions, never an assumed ordering, and a slice written again
//!   after its first rail failed is not counted twice (an immediate value
//!   would carry only a tag and a length).
//! - [`Connection::post`] validates every write locally (source inside a
//!   registered local region, destination key and bounds inside the peer's
//!   descriptor, no zero length) and refuses the whole batch before posting
//!   anything; then each write becomes signaled `RDMA_WRITE` work requests
//!   (split at 1 GiB), followed by the batch's note SENDs. [`Connection::poll`] reports a batch
//!   once all its work requests completed locally; a failed work request
//!   (e.g. remote access error after a revoke) fails the batch with an
//!   actionable [`TransportError::Verbs`], and the queue pair is then in the
//!   error state: later posts on that connection are refused, reconnect.
//!
//! All verbs `unsafe` of the crate lives in this module.

use crate::flags::{monotonic_ns, FlagTable};
use crate::mem::HostMem;
use crate::metrics::{Hop, Hops};
use crate::placement::Placement;
use crate::registry::{Region, Registry};
use crate::accept::{self, Admitted, Incoming, Refusal};
use crate::hello;
use crate::ledger::Ledger;
use crate::{Batch, BatchId, Completion, Connection, Endpoint, TransportError};
use kvwire_core::protocol::{self, Hello, RegionDesc, VerbsAddr, WriteNote, NOTE_LEN};
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{
    BasicCompletionQueue, PollCompletionQueueError, WorkCompletionOperationType, WorkCompletionStatus,
};
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, Mtu, PortState};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState, SetScatterGatherEntry,
    WorkRequestFlags,
};
use sideway::ibverbs::AccessFlags;
use std::collections::HashMap;
use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Transport name in hellos.
const TRANSPORT: &str = "verbs";
/// Largest single work request; longer writes are split (rxe allows 2 GiB).
const MAX_WR_BYTES: u64 = 1 << 30;
/// Notes per SEND; a batch with more writes sends several.
const NOTES_PER_SEND: usize = 64;
/// Bytes of one note buffer (send ring slot, receive buffer).
const NOTE_BUF: usize = NOTES_PER_SEND * NOTE_LEN;
/// How to make a device, for error messages.
const HOW_TO_GET_A_DEVICE: &str = "create a soft-RoCE device with `scripts/softroce-up` or \
    `rdma link add rxe0 type rxe netdev IF` (needs the rdma_rxe kernel module), or run inside \
    `scripts/softroce-vm -- PROGRAM`";

/// Sizes and names of a [`VerbsEndpoint`].
#[derive(Debug, Clone)]
pub struct VerbsLimits {
    /// TCP address the handshake listener binds (`127.0.0.1:0` picks a port).
    pub listen: String,
    /// This endpoint's name in hellos and errors.
    pub node: String,
    /// Most regions registered at once.
    pub max_regions: usize,
    /// Transfer slots in the flag table.
    pub slots: u16,
    /// Layers per slot in the flag table.
    pub layers: u16,
    /// Send-queue depth of each connection (work requests in flight).
    pub send_depth: u32,
    /// Receives pre-posted per accepted connection (note credits), each
    /// with a buffer of its own.
    pub recv_depth: u32,
    /// Limit on each handshake read and write.
    pub handshake_timeout: Duration,
}

impl Default for VerbsLimits {
    fn default() -> Self {
        VerbsLimits {
            listen: "127.0.0.1:0".into(),
            node: "verbs".into(),
            max_regions: 1024,
            slots: 64,
            layers: 128,
            send_depth: 256,
            recv_depth: 256,
            handshake_timeout: Duration::from_secs(10),
        }
    }
}

/// The device, port and address an endpoint uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerbsInfo {
    /// Device name (e.g. `rxe0`).
    pub device: String,
    /// Port number (from 1).
    pub port: u8,
    /// GID table index used as the source GID.
    pub gid_index: u32,
    /// That GID.
    pub gid: [u8; 16],
    /// Port LID (0 on RoCE).
    pub lid: u16,
    /// Active MTU enum value (1 = 256 … 5 = 4096).
    pub mtu: u8,
}

/// A registered region together with its NIC registration.
#[derive(Debug)]
struct RegionMr {
    // Field order is drop order: deregister the MR before the region (and
    // so possibly the memory) goes away.
    mr: Arc<MemoryRegion>,
    region: Arc<Region>,
}

impl RegionMr {
    fn rdesc(&self) -> RegionDesc {
        RegionDesc { key: self.region.key, addr: self.region.desc().addr, len: self.region.len, rkey: Some(self.mr.rkey()) }
    }
}

/// What the endpoint's threads share.
#[derive(Debug)]
struct Shared {
    // Field order is drop order: MRs before the PD and the context they live in
    // (the MRs also hold the PD through an Arc), and before the registry that
    // keeps the memory alive.
    mrs: Mutex<HashMap<u32, Arc<RegionMr>>>,
    pd: Arc<ProtectionDomain>,
    ctx: Arc<DeviceContext>,
    registry: Arc<Registry>,
    placement: Arc<Placement>,
    info: VerbsInfo,
    limits: VerbsLimits,
    stop: AtomicBool,
}

/// A verbs endpoint: one device port, its regions, and a handshake listener.
#[derive(Debug)]
pub struct VerbsEndpoint {
    shared: Arc<Shared>,
    addr: String,
    accept: Option<JoinHandle<()>>,
}

fn verbs_err(verb: &'static str, message: impl Into<String>) -> TransportError {
    TransportError::Verbs { verb, message: message.into() }
}

/// `error: cause: cause…` — sideway's errors keep the OS error as a source.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = c.source();
    }
    s
}

/// The OS error number behind a sideway error. Its error kinds are
/// `#[error(transparent)]`, which hides the `io::Error` from `source()`, so
/// read the number from the text the chain ends with, "(os error N)".
fn os_code(e: &(dyn std::error::Error + 'static)) -> Option<i32> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cur {
        if let Some(io) = c.downcast_ref::<std::io::Error>() {
            return io.raw_os_error();
        }
        cur = c.source();
    }
    let text = chain(e);
    let at = text.rfind("(os error ")? + "(os error ".len();
    text[at..].split(')').next()?.parse().ok()
}

fn mtu_bytes(mtu: u8) -> u32 {
    128u32 << mtu.min(5)
}

/// Picks the source GID: the IPv4-mapped RoCE v2 entry when there is one
/// (what connects on soft-RoCE), else the first non-zero entry.
fn pick_gid(ctx: &DeviceContext, dev: &str, port: u8, table_len: i32) -> Result<(u32, Gid), TransportError> {
    let mut first: Option<(u32, Gid)> = None;
    let mut v4_any: Option<(u32, Gid)> = None;
    for i in 0..table_len.max(0) as u32 {
        let Ok(gid) = ctx.query_gid(port, i) else { continue };
        if gid.is_zero() {
            continue;
        }
        first.get_or_insert((i, gid));
        let v4_mapped = gid.raw[..10].iter().all(|&b| b == 0) && gid.raw[10] == 0xff && gid.raw[11] == 0xff;
        if v4_mapped {
            let ty = std::fs::read_to_string(format!("/sys/class/infiniband/{dev}/ports/{port}/gid_attrs/types/{i}"))
                .unwrap_or_default();
            if ty.trim().eq_ignore_ascii_case("RoCE v2") {
                return Ok((i, gid));
            }
            v4_any.get_or_insert((i, gid));
        }
    }
    v4_any.or(first).ok_or_else(|| {
        verbs_err(
            "ibv_query_gid",
            format!("{dev} port {port} has no GID: give its netdev an IP address (soft-RoCE needs an IPv4 address for the RoCE v2 GID)"),
        )
    })
}

impl VerbsEndpoint {
    /// Opens `device` (or the first device) at `port`, using GID `gid_index`
    /// (or the IPv4-mapped RoCE v2 GID), and starts the handshake listener.
    pub fn new(device: Option<&str>, port: u8, gid_index: Option<u32>, limits: VerbsLimits) -> Result<VerbsEndpoint, TransportError> {
        Self::open(device, port, gid_index, limits, None)
    }

    /// Another device as a rail of this endpoint: it shares this endpoint's
    /// registry and placement, listens on `listen`, and serves the regions
    /// [`VerbsEndpoint::attach`]ed to it. Register on the first endpoint
    /// only (its rkeys are the shared keys), then attach to each rail.
    pub fn rail(&self, device: Option<&str>, port: u8, gid_index: Option<u32>, listen: &str) -> Result<VerbsEndpoint, TransportError> {
        let limits = VerbsLimits { listen: listen.into(), ..self.shared.limits.clone() };
        let shared = (self.shared.registry.clone(), self.shared.placement.clone());
        Self::open(device, port, gid_index, limits, Some(shared))
    }

    fn open(
        device: Option<&str>,
        port: u8,
        gid_index: Option<u32>,
        limits: VerbsLimits,
        shared_with: Option<(Arc<Registry>, Arc<Placement>)>,
    ) -> Result<VerbsEndpoint, TransportError> {
        let list = DeviceList::new().map_err(|e| {
            let why = match os_code(&e) {
                Some(c) if c == nix::errno::Errno::EOPNOTSUPP as i32 => {
                    "libibverbs.so.1 could not be loaded (install rdma-core's libibverbs1 and ibverbs-providers)".to_string()
                }
                Some(c) if c == nix::errno::Errno::ENOSYS as i32 => {
                    "this kernel has no RDMA support (no ib_uverbs / RDMA devices)".to_string()
                }
                _ => format!("ibv_get_device_list failed: {}", chain(&e)),
            };
            TransportError::NoDevice(format!("{why}; {HOW_TO_GET_A_DEVICE}"))
        })?;
        let names: Vec<String> = list.iter().map(|d| d.name()).collect();
        let dev = match device {
            Some(want) => list.iter().find(|d| d.name() == want).ok_or_else(|| {
                TransportError::NoDevice(if names.is_empty() {
                    format!("no RDMA devices at all (wanted {want}); {HOW_TO_GET_A_DEVICE}")
                } else {
                    format!("device {want} not found; present: {}", names.join(", "))
                })
            })?,
            None => list.iter().next().ok_or_else(|| {
                TransportError::NoDevice(format!(
                    "libibverbs lists no RDMA devices (is the provider library, e.g. librxe, installed?); {HOW_TO_GET_A_DEVICE}"
                ))
            })?,
        };
        let name = dev.name();
        let ctx = dev.open().map_err(|e| verbs_err("ibv_open_device", format!("{name}: {}", chain(&e))))?;
        drop(list);
        let pattr = ctx.query_port(port).map_err(|e| {
            verbs_err("ibv_query_port", format!("{name} port {port}: {} (ports are numbered from 1)", chain(&e)))
        })?;
        if pattr.port_state() != PortState::Active {
            return Err(verbs_err(
                "ibv_query_port",
                format!(
                    "{name} port {port} is {:?}, not Active: bring its netdev up (`ip link set IF up`) and give it an address",
                    pattr.port_state()
                ),
            ));
        }
        let (gid_index, gid) = match gid_index {
            Some(i) => {
                let gid = ctx.query_gid(port, i).map_err(|e| {
                    verbs_err("ibv_query_gid", format!("{name} port {port} GID index {i}: {} (see `ibv_devinfo -v`)", chain(&e)))
                })?;
                if gid.is_zero() {
                    return Err(verbs_err(
                        "ibv_query_gid",
                        format!("{name} port {port} GID index {i} is empty; on soft-RoCE index 1 is the IPv4-mapped RoCE v2 GID while the netdev has an IPv4 address"),
                    ));
                }
                (i, gid)
            }
            None => pick_gid(&ctx, &name, port, pattr.gid_tbl_len())?,
        };
        let mtu = pattr.active_mtu() as u32 as u8;
        let info = VerbsInfo { device: name.clone(), port, gid_index, gid: gid.raw, lid: pattr.lid(), mtu };
        let pd = ctx.alloc_pd().map_err(|e| verbs_err("ibv_alloc_pd", format!("{name}: {}", chain(&e))))?;
        let (registry, placement) = match shared_with {
            Some(s) => s,
            None => {
                let flags = FlagTable::new(limits.slots, limits.layers)?;
                (Arc::new(Registry::new(limits.max_regions)), Arc::new(Placement::new(flags, Arc::new(Hops::default()))))
            }
        };
        let listener = TcpListener::bind(&limits.listen).map_err(TransportError::io("bind handshake listener"))?;
        let addr = listener.local_addr().map_err(TransportError::io("handshake listener address"))?.to_string();
        listener.set_nonblocking(true).map_err(TransportError::io("handshake listener nonblocking"))?;
        tracing::debug!(device = %name, port, gid_index, mtu = mtu_bytes(mtu), %addr, "verbs endpoint up");
        let shared = Arc::new(Shared {
            mrs: Mutex::new(HashMap::new()),
            pd,
            ctx,
            registry,
            placement,
            info,
            limits,
            stop: AtomicBool::new(false),
        });
        let s = shared.clone();
        let accept = std::thread::Builder::new()
            .name("kvwire-verbs-accept".into())
            .spawn(move || accept_loop(s, listener))
            .map_err(TransportError::io("spawn accept thread"))?;
        Ok(VerbsEndpoint { shared, addr, accept: Some(accept) })
    }

    /// The device, port, GID and MTU in use.
    pub fn info(&self) -> &VerbsInfo {
        &self.shared.info
    }

    /// Registers `mem[offset..offset+len]` with the NIC (local and remote
    /// write) and in the registry under the MR's rkey, so the region's `key`
    /// is both what [`crate::WriteOp::src_key`] names locally and what
    /// peers write to.
    pub fn register(&self, mem: Arc<HostMem>, offset: u64, len: u64) -> Result<Arc<Region>, TransportError> {
        let mr = self.reg_mr(&mem, offset, len)?;
        let region = self.shared.registry.register_with_key(mem, offset, len, mr.rkey())?;
        self.shared.mrs.lock().expect("mr lock").insert(region.key, Arc::new(RegionMr { mr, region: region.clone() }));
        Ok(region)
    }

    /// Registers `region`, already in the registry this rail shares, with
    /// this rail's device too, so writes through this rail can read from
    /// it and peers of this rail can write into it (under its shared key).
    pub fn attach(&self, region: &Arc<Region>) -> Result<(), TransportError> {
        let mr = self.reg_mr(&region.mem, region.offset, region.len)?;
        self.shared.mrs.lock().expect("mr lock").insert(region.key, Arc::new(RegionMr { mr, region: region.clone() }));
        // Revoked while this MR was being made: do not keep it.
        if self.shared.registry.get(region.key).is_none() {
            self.shared.mrs.lock().expect("mr lock").remove(&region.key);
            return Err(TransportError::Source(format!("region {:#010x} was revoked while being attached to {}", region.key, self.shared.info.device)));
        }
        Ok(())
    }

    /// An MR of this device over `mem[offset..offset+len]`. The caller
    /// stores it next to an `Arc` of `mem` that outlives it.
    fn reg_mr(&self, mem: &Arc<HostMem>, offset: u64, len: u64) -> Result<Arc<MemoryRegion>, TransportError> {
        mem.check(offset, len)?;
        if len == 0 {
            return Err(crate::mem::MemError::Empty.into());
        }
        let ptr = mem.as_ptr() as usize + offset as usize;
        let access = AccessFlags::LocalWrite | AccessFlags::RemoteWrite;
        // SAFETY: `ptr..ptr+len` is inside the live mapping of `mem`
        // (checked above). Callers store the MR in a `RegionMr` whose field
        // order drops the MR before the `Arc<Region>` holding the mapping,
        // and on their error paths the MR is dropped while they still hold
        // `mem`, so the NIC never holds a registration of unmapped memory.
        let mr = unsafe { self.shared.pd.reg_mr(ptr, len as usize, access) };
        let mr = match mr {
            Ok(mr) => mr,
            Err(e) => {
                let hint = match os_code(&e) {
                    Some(c) if c == nix::errno::Errno::ENOMEM as i32 => {
                        "; raise the locked-memory limit (`ulimit -l unlimited`) or register less"
                    }
                    Some(c) if c == nix::errno::Errno::EFAULT as i32 => "; the address range is not mapped",
                    _ => "",
                };
                return Err(verbs_err("ibv_reg_mr", format!("{len} bytes at {ptr:#x} on {}: {}{hint}", self.shared.info.device, chain(&e))));
            }
        };
        Ok(mr)
    }

    /// Registers a whole mapping, as [`VerbsEndpoint::register`].
    pub fn register_all(&self, mem: Arc<HostMem>) -> Result<Arc<Region>, TransportError> {
        let len = mem.len();
        self.register(mem, 0, len)
    }

    /// What a peer uses to write into the region of local `key`: its
    /// address, length and the MR's rkey.
    pub fn desc(&self, key: u32) -> Option<RegionDesc> {
        self.shared.mrs.lock().expect("mr lock").get(&key).map(|m| m.rdesc())
    }

    /// Revokes `key`: removes it from the registry and deregisters its MR,
    /// so every later remote write to it fails with a remote access error.
    /// (A source region still read by an in-flight batch of this endpoint
    /// stays registered until that batch completes.) Returns whether it
    /// was registered.
    pub fn revoke(&self, key: u32) -> bool {
        let in_registry = self.shared.registry.revoke(key);
        let mr = self.shared.mrs.lock().expect("mr lock").remove(&key);
        in_registry || mr.is_some()
    }
}

impl Shared {
    /// Deregisters MRs whose key was revoked through the registry directly.
    fn sweep(&self) {
        let mut mrs = self.mrs.lock().expect("mr lock");
        mrs.retain(|key, _| self.registry.get(*key).is_some());
    }

    fn descs(&self) -> Vec<RegionDesc> {
        self.sweep();
        let mut v: Vec<RegionDesc> = self.mrs.lock().expect("mr lock").values().map(|m| m.rdesc()).collect();
        v.sort_by_key(|d| d.key);
        v
    }

    fn hello(&self, qp: &Qp) -> Hello {
        let qp = VerbsAddr { qpn: qp.qp.qp_number(), psn: qp.psn, gid: self.info.gid, lid: self.info.lid, mtu: self.info.mtu };
        hello::ours(TRANSPORT, &self.limits.node, self.descs(), Some(qp))
    }
}

impl Drop for VerbsEndpoint {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

impl Endpoint for VerbsEndpoint {
    fn transport(&self) -> &'static str {
        TRANSPORT
    }

    fn local_addr(&self) -> String {
        self.addr.clone()
    }

    fn registry(&self) -> &Arc<Registry> {
        &self.shared.registry
    }

    fn placement(&self) -> &Arc<Placement> {
        &self.shared.placement
    }

    fn connect(&self, peer: &str) -> Result<Box<dyn Connection>, TransportError> {
        Ok(Box::new(VerbsConnection::connect(self.shared.clone(), peer)?))
    }

    fn register(&self, mem: Arc<HostMem>, offset: u64, len: u64) -> Result<Arc<Region>, TransportError> {
        VerbsEndpoint::register(self, mem, offset, len)
    }

    fn revoke(&self, key: u32) -> bool {
        VerbsEndpoint::revoke(self, key)
    }

    fn attach(&self, region: &Arc<Region>) -> Result<(), TransportError> {
        VerbsEndpoint::attach(self, region)
    }

    /// A refused remote write moves the RC queue pair to the error state;
    /// writes refused locally (checked against the peer's descriptors
    /// before posting) leave it serving.
    fn survives_refused_write(&self) -> bool {
        false
    }
}

// ------------------------------------------------------------------ handshake

fn peer_verbs(hello: &Hello) -> Result<VerbsAddr, TransportError> {
    let v = hello.verbs.ok_or_else(|| {
        TransportError::Refused(format!("peer {} sent a verbs hello without queue-pair data (qpn, psn, gid)", hello.node))
    })?;
    if !(1..=5).contains(&v.mtu) {
        return Err(TransportError::Refused(format!("peer {} sent MTU enum {} (valid: 1 = 256 … 5 = 4096)", hello.node, v.mtu)));
    }
    Ok(v)
}

// ------------------------------------------------------------------ queue pairs

/// One RC queue pair with its own CQ (send and receive share it).
struct Qp {
    // Field order is drop order: destroy the QP (which stops the NIC's work
    // on it) before its CQ; the QP also holds the CQ and PD alive itself.
    qp: BasicQueuePair,
    cq: Arc<BasicCompletionQueue>,
    psn: u32,
}

impl std::fmt::Debug for Qp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qp").field("qpn", &self.qp.qp_number()).field("psn", &self.psn).finish()
    }
}

impl Qp {
    /// A new RC QP in INIT.
    fn new(shared: &Shared, send_depth: u32, recv_depth: u32) -> Result<Qp, TransportError> {
        let dev = &shared.info.device;
        let cq = shared
            .ctx
            .create_cq_builder()
            .setup_cqe(send_depth + recv_depth + 1)
            .build()
            .map_err(|e| verbs_err("ibv_create_cq", format!("{dev}, {} entries: {}", send_depth + recv_depth + 1, chain(&e))))?;
        let qp = shared
            .pd
            .create_qp_builder()
            .setup_send_cq(cq.clone())
            .setup_recv_cq(cq.clone())
            .setup_max_send_wr(send_depth.max(1))
            .setup_max_recv_wr(recv_depth.max(1))
            .setup_max_send_sge(1)
            .setup_max_recv_sge(1)
            .build()
            .map_err(|e| {
                verbs_err(
                    "ibv_create_qp",
                    format!("{dev}: RC QP with {send_depth} send / {recv_depth} receive entries: {} (lower send_depth/recv_depth?)", chain(&e)),
                )
            })?;
        let psn = (monotonic_ns() as u32 ^ (monotonic_ns() >> 20) as u32) & 0x00FF_FFFF;
        let mut q = Qp { qp, cq, psn };
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(shared.info.port)
            .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteWrite);
        q.modify(&attr, "RESET→INIT", format!("port {} / pkey index 0 / access LOCAL_WRITE|REMOTE_WRITE", shared.info.port))?;
        Ok(q)
    }

    fn modify(&mut self, attr: &QueuePairAttribute, step: &str, attrs: String) -> Result<(), TransportError> {
        self.qp.modify(attr).map_err(|e| {
            let hint = match os_code(&e) {
                Some(c) if c == nix::errno::Errno::ETIMEDOUT as i32 || c == nix::errno::Errno::ENETUNREACH as i32 => {
                    "; the destination GID has no route: check both sides use a GID of an interface that is up and addressed (soft-RoCE: the IPv4-mapped GID, index 1)"
                }
                Some(c) if c == nix::errno::Errno::EINVAL as i32 => {
                    "; the device rejected one of these attributes for this state (a GID index missing from the table, an MTU above the port's, or a wrong state)"
                }
                _ => "",
            };
            verbs_err("ibv_modify_qp", format!("QP {:#x} {step} with {attrs}: {}{hint}", self.qp.qp_number(), chain(&e)))
        })
    }

    /// INIT → RTR → RTS against the peer's address.
    fn connect(&mut self, shared: &Shared, peer: &VerbsAddr) -> Result<(), TransportError> {
        let info = &shared.info;
        let mtu = info.mtu.min(peer.mtu);
        let gid = Gid { raw: peer.gid };
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(Mtu::from(u32::from(mtu)))
            .setup_dest_qp_num(peer.qpn)
            .setup_rq_psn(peer.psn)
            .setup_max_dest_read_atomic(0)
            .setup_min_rnr_timer(1);
        let mut ah = AddressHandleAttribute::new();
        ah.setup_dest_lid(peer.lid)
            .setup_port(info.port)
            .setup_service_level(0)
            .setup_grh_src_gid_index(info.gid_index as u8)
            .setup_grh_dest_gid(&gid)
            .setup_grh_hop_limit(64);
        attr.setup_address_vector(&ah);
        self.modify(
            &attr,
            "INIT→RTR",
            format!(
                "path MTU {} / dest QPN {:#x} / rq PSN {:#x} / port {} / source GID index {} / dest GID {gid} / dest LID {}",
                mtu_bytes(mtu),
                peer.qpn,
                peer.psn,
                info.port,
                info.gid_index,
                peer.lid
            ),
        )?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(self.psn)
            .setup_timeout(14)
            .setup_retry_cnt(7)
            .setup_rnr_retry(7)
            .setup_max_read_atomic(0);
        self.modify(&attr, "RTR→RTS", format!("sq PSN {:#x} / timeout 14 / retry 7 / rnr retry 7", self.psn))
    }

    /// Posts a receive into each of `slots` of `ring` (`wr_id` = slot).
    fn post_recvs(&mut self, ring: &NoteRing, slots: impl Iterator<Item = u32>) -> Result<(), TransportError> {
        let mut guard = self.qp.start_post_recv();
        let mut n = 0;
        for slot in slots {
            // SAFETY: the slot lies inside the ring's MR; `serve` declares
            // the ring before the QP, so it is dropped after the QP and the
            // NIC never writes into freed memory.
            unsafe { guard.construct_wr(u64::from(slot)).setup_sge(ring.mr.lkey(), ring.addr(slot), NOTE_BUF as u32) };
            n += 1;
        }
        guard.post().map_err(|e| verbs_err("ibv_post_recv", format!("{n} receives: {}", chain(&e))))
    }

    /// Completions available now, copied out of the CQ.
    fn drain(&self) -> Result<Vec<Wc>, TransportError> {
        match self.cq.start_poll() {
            Ok(poller) => Ok(poller
                .map(|wc| Wc { wr_id: wc.wr_id(), status: wc.status(), opcode: wc.opcode(), vendor_err: wc.vendor_err(), byte_len: wc.byte_len() })
                .collect()),
            Err(PollCompletionQueueError::CompletionQueueEmpty) => Ok(Vec::new()),
            Err(e) => Err(verbs_err("ibv_poll_cq", chain(&e))),
        }
    }
}

/// Registered note buffers: a source's send ring, a destination's
/// receive buffers (one per pre-posted receive).
struct NoteRing {
    // Field order is drop order: the MR before the memory it covers.
    mr: Arc<MemoryRegion>,
    mem: HostMem,
    slots: u32,
}

impl std::fmt::Debug for NoteRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NoteRing").field("slots", &self.slots).finish()
    }
}

impl NoteRing {
    fn new(shared: &Shared, slots: u32) -> Result<NoteRing, TransportError> {
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

    fn addr(&self, slot: u32) -> u64 {
        self.mem.as_ptr() as u64 + u64::from(slot) * NOTE_BUF as u64
    }

    /// The notes a completed receive left in `slot`.
    fn read(&self, slot: u64, len: u32) -> Result<Vec<WriteNote>, TransportError> {
        if slot >= u64::from(self.slots) || len as usize > NOTE_BUF {
            return Err(TransportError::Refused(format!("receive completion for slot {slot} with {len} bytes is outside the note buffers")));
        }
        let mut b = vec![0u8; len as usize];
        self.mem.read(slot * NOTE_BUF as u64, &mut b)?;
        Ok(WriteNote::decode_all(&b)?)
    }
}

#[derive(Debug, Clone, Copy)]
struct Wc {
    wr_id: u64,
    status: u32,
    opcode: u32,
    vendor_err: u32,
    byte_len: u32,
}

const WC_SUCCESS: u32 = WorkCompletionStatus::Success as u32;
const WC_REM_ACCESS: u32 = WorkCompletionStatus::RemoteAccessError as u32;
const WC_FLUSH: u32 = WorkCompletionStatus::WorkRequestFlushedError as u32;
const WC_RETRY_EXC: u32 = WorkCompletionStatus::RetryCounterExceededError as u32;
const WC_RNR_RETRY_EXC: u32 = WorkCompletionStatus::ResponderNotReadyRetryCounterExceededError as u32;
const WC_LOC_QP_OP: u32 = WorkCompletionStatus::LocalQueuePairOperationError as u32;
const WC_LOC_PROT: u32 = WorkCompletionStatus::LocalProtectionError as u32;
const WC_LOC_LEN: u32 = WorkCompletionStatus::LocalLengthError as u32;
const WC_REM_INV_REQ: u32 = WorkCompletionStatus::RemoteInvalidRequestError as u32;
const WC_REM_OP: u32 = WorkCompletionStatus::RemoteOperationError as u32;
const WC_RECV: u32 = WorkCompletionOperationType::Receive as u32;

/// What a failed completion means, and what to do about it.
fn wc_error(wc: &Wc) -> String {
    let what = match wc.status {
        WC_REM_ACCESS => "remote access error: the destination NIC refused the write — its region was revoked \
                          (MR deregistered), the rkey is stale, or the write falls outside the registered window",
        WC_FLUSH => "flushed: the queue pair had already entered the error state after an earlier failure; reconnect",
        WC_RETRY_EXC => "transport retry counter exceeded: no acknowledgement from the peer (peer gone, its QP \
                         destroyed, or unreachable with this GID/netdev)",
        WC_RNR_RETRY_EXC => "receiver not ready: the destination had no receive posted for a write note",
        WC_LOC_QP_OP => "local QP operation error: the device could not send the work request (its netdev is down, \
                         or has no route to the peer's GID)",
        WC_LOC_PROT => "local protection error: the source range is not covered by a local MR (source region deregistered?)",
        WC_LOC_LEN => "local length error: the work request is longer than the device allows",
        WC_REM_INV_REQ => "remote invalid request: the destination rejected the request (length beyond its limit, or RDMA write not enabled on its QP)",
        WC_REM_OP => "remote operation error: the destination could not complete the write (its receive queue or QP failed)",
        _ => "work request failed",
    };
    format!("{what} (ibv_wc_status {}, vendor error {:#x})", wc.status, wc.vendor_err)
}

// ------------------------------------------------------------------ passive side

fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    let mut children: Vec<JoinHandle<()>> = Vec::new();
    let mut last_sweep = Instant::now();
    while !shared.stop.load(Ordering::Acquire) {
        match listener.accept() {
            Ok((stream, from)) => {
                let s = shared.clone();
                match std::thread::Builder::new().name("kvwire-verbs-recv".into()).spawn(move || {
                    if let Err(e) = serve(&s, stream) {
                        tracing::warn!(peer = %from, error = %e, "verbs connection ended with an error");
                    }
                }) {
                    Ok(t) => children.push(t),
                    Err(e) => tracing::warn!(error = %e, "cannot spawn verbs receive thread"),
                }
                children.retain(|t| !t.is_finished());
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(2)),
            Err(e) => {
                tracing::warn!(error = %e, "verbs handshake accept failed");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        if last_sweep.elapsed() >= Duration::from_millis(5) {
            shared.sweep();
            last_sweep = Instant::now();
        }
    }
    for t in children {
        let _ = t.join();
    }
}

/// Counts the ranges a received note buffer names, each through the
/// shared acceptance path (the NIC placed the bytes already). A refused
/// note counts nothing. A malformed note message ends the connection,
/// as a malformed frame does on every backend.
fn count_notes(shared: &Shared, ring: &NoteRing, wc: &Wc, seen_at: Instant, peer: &str) -> Result<(), TransportError> {
    for n in ring.read(wc.wr_id, wc.byte_len)? {
        let w = Incoming { tag: n.tag, key: n.key, offset: n.offset, len: n.len };
        if let Err(why) = accept::accept(&shared.registry, &shared.placement, w, |_: &Admitted| Ok::<_, Refusal>(seen_at)) {
            accept::log_refusal(TRANSPORT, peer, w, &why);
        }
    }
    Ok(())
}

/// One accepted connection: handshake, then count the ranges of received
/// write notes until the peer closes the TCP stream or the endpoint stops.
fn serve(shared: &Shared, mut stream: TcpStream) -> Result<(), TransportError> {
    let t = Some(shared.limits.handshake_timeout);
    stream.set_nonblocking(false).map_err(TransportError::io("handshake socket"))?;
    stream.set_read_timeout(t).map_err(TransportError::io("handshake socket"))?;
    stream.set_write_timeout(t).map_err(TransportError::io("handshake socket"))?;
    let _ = stream.set_nodelay(true);
    // Declared before the QP, so dropped after it: the NIC may write into
    // these buffers until the QP is destroyed.
    let ring = match NoteRing::new(shared, shared.limits.recv_depth) {
        Ok(r) => r,
        Err(e) => {
            let _ = hello::send_refusal(&mut stream, &e.to_string());
            return Err(e);
        }
    };
    let setup = (|| {
        let peer = hello::read_hello(&mut stream, TRANSPORT)?;
        let pv = peer_verbs(&peer)?;
        let mut qp = Qp::new(shared, 1, ring.slots)?;
        qp.post_recvs(&ring, 0..ring.slots)?;
        // RTR before answering, so the peer's first write finds us ready.
        qp.connect(shared, &pv)?;
        Ok::<_, TransportError>((peer, qp))
    })();
    let (peer, mut qp) = match setup {
        Ok(x) => x,
        Err(e) => {
            let _ = hello::send_refusal(&mut stream, &e.to_string());
            return Err(e);
        }
    };
    hello::send_hello(&mut stream, &shared.hello(&qp))?;
    stream.set_nonblocking(true).map_err(TransportError::io("connection socket"))?;
    let mut idle = 0u32;
    let mut last_check = Instant::now();
    let mut failed = false;
    loop {
        let wcs = qp.drain()?;
        let seen_at = Instant::now();
        let mut reposts = Vec::new();
        for wc in &wcs {
            if wc.status != WC_SUCCESS {
                if !failed {
                    tracing::warn!(peer = %peer.node, error = %wc_error(wc), "verbs receive completion failed; the queue pair is in the error state");
                }
                failed = true;
                continue;
            }
            if wc.opcode == WC_RECV {
                count_notes(shared, &ring, wc, seen_at, &peer.node)?;
            } else {
                tracing::warn!(peer = %peer.node, opcode = wc.opcode, "unexpected receive completion (not a write note); ignored");
            }
            reposts.push(wc.wr_id as u32);
        }
        if !reposts.is_empty() && !failed {
            qp.post_recvs(&ring, reposts.into_iter())?;
        }
        if wcs.is_empty() {
            idle = idle.saturating_add(1);
            if idle > 200 {
                std::thread::sleep(Duration::from_micros(if idle > 5000 { 500 } else { 50 }));
            } else {
                std::thread::yield_now();
            }
        } else {
            idle = 0;
        }
        if shared.stop.load(Ordering::Acquire) {
            return Ok(());
        }
        if last_check.elapsed() >= Duration::from_millis(10) {
            last_check = Instant::now();
            let mut b = [0u8; 64];
            match stream.read(&mut b) {
                Ok(0) => {
                    // The peer closed: its writes have all completed or failed at
                    // its side; take what is left in the CQ, then go.
                    for wc in qp.drain()? {
                        if wc.status == WC_SUCCESS && wc.opcode == WC_RECV {
                            count_notes(shared, &ring, &wc, Instant::now(), &peer.node)?;
                        }
                    }
                    return Ok(());
                }
                Ok(_) => {} // nothing is sent after the handshake; ignore
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(TransportError::io("connection socket")(e)),
            }
        }
    }
}

// ------------------------------------------------------------------ active side

/// One work request, validated.
#[derive(Debug, Clone, Copy)]
enum Wr {
    /// An `RDMA_WRITE` of local bytes into the peer's MR.
    Write { lkey: u32, laddr: u64, rkey: u32, raddr: u64, len: u32 },
    /// A SEND of `notes[first..first + count]` of the batch.
    Notes { first: usize, count: usize },
}

impl Wr {
    /// Bytes of write notes this work request sends.
    fn note_bytes(&self) -> u64 {
        match *self {
            Wr::Write { .. } => 0,
            Wr::Notes { count, .. } => (count * NOTE_LEN) as u64,
        }
    }
}

/// A batch checked and cut into work requests.
struct Planned {
    wrs: Vec<Wr>,
    notes: Vec<WriteNote>,
    /// The local regions the writes read.
    sources: Vec<Arc<RegionMr>>,
}

/// A connection initiating writes into one peer's regions.
#[derive(Debug)]
pub struct VerbsConnection {
    // Field order is drop order: destroy the QP (ending the NIC's reads of
    // source memory and of the note ring) before the in-flight batches
    // release their sources and the ring goes.
    qp: Qp,
    notes: NoteRing,
    /// Note SENDs posted so far; the next one uses slot `sent % slots`.
    /// The ring has one slot per send-queue entry and completions are
    /// reaped in order, so a slot is free again when it comes round.
    notes_sent: u64,
    /// Posted batches; each keeps its source MRs registered and mapped
    /// until its work requests completed.
    ledger: Ledger<Vec<Arc<RegionMr>>>,
    outstanding_wrs: u32,
    /// Note bytes posted (the framing of RDMA writes).
    framing: u64,
    broken: Option<String>,
    remote: Hello,
    remote_regions: HashMap<u32, RegionDesc>,
    /// The handshake socket: while it is open, the peer keeps its QP.
    _stream: TcpStream,
    shared: Arc<Shared>,
}

impl VerbsConnection {
    fn connect(shared: Arc<Shared>, peer: &str) -> Result<VerbsConnection, TransportError> {
        let mut stream = TcpStream::connect(peer).map_err(TransportError::io("connect handshake"))?;
        let t = Some(shared.limits.handshake_timeout);
        stream.set_read_timeout(t).map_err(TransportError::io("handshake socket"))?;
        stream.set_write_timeout(t).map_err(TransportError::io("handshake socket"))?;
        let _ = stream.set_nodelay(true);
        let mut qp = Qp::new(&shared, shared.limits.send_depth, 1)?;
        let notes = NoteRing::new(&shared, shared.limits.send_depth)?;
        hello::send_hello(&mut stream, &shared.hello(&qp))?;
        let remote = hello::read_hello(&mut stream, TRANSPORT)?;
        let pv = peer_verbs(&remote)?;
        qp.connect(&shared, &pv)?;
        let remote_regions = remote.regions.iter().map(|d| (d.key, *d)).collect();
        Ok(VerbsConnection {
            qp,
            notes,
            notes_sent: 0,
            ledger: Ledger::new(shared.placement.hops().clone(), 1),
            outstanding_wrs: 0,
            framing: 0,
            broken: None,
            remote,
            remote_regions,
            _stream: stream,
            shared,
        })
    }

    /// Checks every write and turns it into work requests (the writes,
    /// then the note SENDs naming them); posts nothing.
    fn plan(&self, batch: &Batch) -> Result<Planned, TransportError> {
        if batch.writes.is_empty() {
            return Err(TransportError::Refused("empty batch: nothing to write (refused locally, nothing posted)".into()));
        }
        let mrs = self.shared.mrs.lock().expect("mr lock");
        let mut wrs = Vec::with_capacity(batch.writes.len());
        let mut sources: Vec<Arc<RegionMr>> = Vec::new();
        for (i, w) in batch.writes.iter().enumerate() {
            let dst = self.remote_regions.get(&w.dst_key);
            // The destination's own refusal texts, checked here since a
            // refused one-sided write could not be told back.
            protocol::check_write(w.dst_key, dst.map(|d| d.len), w.dst_offset, w.len).map_err(|e| {
                TransportError::Refused(format!(
                    "write {i}: {} (checked locally against peer {}'s hello; nothing posted)",
                    Refusal::from(e),
                    self.remote.node
                ))
            })?;
            let dst = dst.expect("checked by check_write");
            let Some(rkey) = dst.rkey else {
                return Err(TransportError::Refused(format!(
                    "write {i}: peer {}'s hello gives no rkey for key {:#010x}; nothing posted",
                    self.remote.node, w.dst_key
                )));
            };
            let src = mrs.get(&w.src_key).filter(|_| self.shared.registry.get(w.src_key).is_some()).ok_or_else(|| {
                TransportError::Source(format!(
                    "write {i}: local key {:#010x} is not registered with VerbsEndpoint::register (or was revoked); nothing posted",
                    w.src_key
                ))
            })?;
            match w.src_offset.checked_add(w.len) {
                Some(end) if end <= src.region.len => {}
                _ => {
                    return Err(TransportError::Source(format!(
                        "write {i}: {} bytes at offset {} exceed local region {:#010x} of {} bytes; nothing posted",
                        w.len, w.src_offset, w.src_key, src.region.len
                    )))
                }
            }
            if !sources.iter().any(|s| Arc::ptr_eq(s, src)) {
                sources.push(src.clone());
            }
            let laddr = src.region.desc().addr + w.src_offset;
            let raddr = dst.addr + w.dst_offset;
            let mut done = 0u64;
            while done < w.len {
                let n = (w.len - done).min(MAX_WR_BYTES);
                wrs.push(Wr::Write { lkey: src.mr.lkey(), laddr: laddr + done, rkey, raddr: raddr + done, len: n as u32 });
                done += n;
            }
        }
        let notes: Vec<WriteNote> =
            batch.writes.iter().map(|w| WriteNote { tag: batch.tag, key: w.dst_key, offset: w.dst_offset, len: w.len }).collect();
        for first in (0..notes.len()).step_by(NOTES_PER_SEND) {
            wrs.push(Wr::Notes { first, count: (notes.len() - first).min(NOTES_PER_SEND) });
        }
        Ok(Planned { wrs, notes, sources })
    }

    /// Posts `wrs` as signaled work requests with `wr_id = batch`: writes
    /// as `RDMA_WRITE`, notes (from `notes`) as SENDs out of the note ring.
    ///
    /// # Safety
    /// Every write's `(lkey, laddr, len)` must lie in a live MR of this
    /// endpoint's PD, and that MR and its memory must stay registered and
    /// mapped until the completion of each work request has been polled
    /// (or the QP destroyed). The caller keeps them alive in the batch's
    /// ledger entry.
    unsafe fn post_writes(&mut self, batch: u64, wrs: &[Wr], notes: &[WriteNote]) -> Result<(), TransportError> {
        // Fill the ring slots first: the guard borrows the QP.
        let mut sends = Vec::new();
        for w in wrs {
            if let Wr::Notes { first, count } = *w {
                let slot = (self.notes_sent % u64::from(self.notes.slots)) as u32;
                self.notes_sent += 1;
                let mut b = vec![0u8; count * NOTE_LEN];
                for (n, c) in notes[first..first + count].iter().zip(b.chunks_exact_mut(NOTE_LEN)) {
                    n.encode(c);
                }
                self.notes.mem.write(u64::from(slot) * NOTE_BUF as u64, &b)?;
                sends.push((self.notes.addr(slot), b.len() as u32));
            }
        }
        let lkey = self.notes.mr.lkey();
        let mut sends = sends.into_iter();
        let mut guard = self.qp.qp.start_post_send();
        for w in wrs {
            match *w {
                Wr::Write { lkey, laddr, rkey, raddr, len } => {
                    let h = guard.construct_wr(batch, WorkRequestFlags::Signaled).setup_write(rkey, raddr);
                    // SAFETY: the caller guarantees the local range stays
                    // registered and mapped until this work request's
                    // completion is polled.
                    unsafe { h.setup_sge(lkey, laddr, len) };
                }
                Wr::Notes { .. } => {
                    let (addr, len) = sends.next().expect("a ring slot per note send");
                    let h = guard.construct_wr(batch, WorkRequestFlags::Signaled).setup_send();
                    // SAFETY: the slot lies in the ring's MR, which lives as
                    // long as this connection (dropped after the QP), and is
                    // not rewritten before this send completed (see
                    // `notes_sent`).
                    unsafe { h.setup_sge(lkey, addr, len) };
                }
            }
        }
        guard.post().map_err(|e| {
            let hint = match os_code(&e) {
                Some(c) if c == nix::errno::Errno::ENOMEM as i32 => "; the send queue is full (raise send_depth)",
                Some(c) if c == nix::errno::Errno::EINVAL as i32 => "; a work request was rejected (QP not in RTS, or too many SGEs)",
                _ => "",
            };
            verbs_err("ibv_post_send", format!("{} RDMA_WRITE/SEND work requests: {}{hint}", wrs.len(), chain(&e)))
        })
    }

    /// Processes completions available now; returns how many there were.
    fn reap(&mut self) -> Result<usize, TransportError> {
        let wcs = match self.qp.drain() {
            Ok(w) => w,
            Err(e) => {
                self.broken.get_or_insert_with(|| e.to_string());
                return Err(e);
            }
        };
        for wc in &wcs {
            self.outstanding_wrs = self.outstanding_wrs.saturating_sub(1);
            if wc.status != WC_SUCCESS {
                // A flush only echoes an earlier failure: keep the first real cause.
                let msg = wc_error(wc);
                if self.broken.as_deref().is_none_or(|m| m.starts_with("flushed") && wc.status != WC_FLUSH) {
                    self.broken = Some(msg);
                }
            }
            let result = if wc.status == WC_SUCCESS { Ok(()) } else { Err(verbs_err("RDMA_WRITE/SEND completion", wc_error(wc))) };
            // A flush only echoes an earlier failure: a real cause replaces it.
            let echo = |old: &TransportError| wc.status != WC_FLUSH && matches!(old, TransportError::Verbs { message, .. } if message.starts_with("flushed"));
            self.ledger.part_done(BatchId(wc.wr_id), result, echo, Instant::now());
        }
        Ok(wcs.len())
    }

    /// Waits (reaping) until `need` send-queue entries are free.
    fn wait_room(&mut self, need: u32, deadline: Instant) -> Result<(), TransportError> {
        let depth = self.shared.limits.send_depth;
        let mut idle = 0u32;
        while self.outstanding_wrs + need > depth {
            if self.reap()? == 0 {
                if Instant::now() >= deadline {
                    return Err(verbs_err(
                        "ibv_poll_cq",
                        format!("send queue full ({} of {depth} in flight) and no completion for 60 s: the peer stopped acknowledging", self.outstanding_wrs),
                    ));
                }
                idle += 1;
                backoff(idle);
            } else {
                idle = 0;
            }
        }
        Ok(())
    }
}

fn backoff(idle: u32) {
    if idle < 100 {
        std::hint::spin_loop();
    } else if idle < 300 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(20));
    }
}

impl Connection for VerbsConnection {
    fn remote(&self) -> &Hello {
        &self.remote
    }

    fn post(&mut self, batch: Batch) -> Result<BatchId, TransportError> {
        if let Some(why) = &self.broken {
            return Err(verbs_err(
                "ibv_post_send",
                format!("connection to {} is unusable, its queue pair failed earlier ({why}); reconnect", self.remote.node),
            ));
        }
        let Planned { wrs, notes, sources } = self.plan(&batch)?;
        let start = Instant::now();
        let id = self.ledger.begin(batch.tag, batch.bytes(), start, sources);
        let depth = self.shared.limits.send_depth.max(1);
        let deadline = start + Duration::from_secs(60);
        let mut post_time = Duration::ZERO;
        let mut at = 0usize;
        let mut failure: Option<TransportError> = None;
        while at < wrs.len() {
            let n = (wrs.len() - at).min(depth as usize);
            if let Err(e) = self.wait_room(n as u32, deadline) {
                failure = Some(e);
                break;
            }
            if let Some(why) = &self.broken {
                failure = Some(verbs_err("ibv_post_send", format!("queue pair failed while posting: {why}")));
                break;
            }
            let t = Instant::now();
            // SAFETY: `plan` found every local range inside a registered MR,
            // and the batch's ledger entry (opened above, dropped only after
            // every work request of it completed; the ledger is dropped after
            // the QP) holds those MRs and their memory.
            let r = unsafe { self.post_writes(id.0, &wrs[at..at + n], &notes) };
            post_time += t.elapsed();
            match r {
                Ok(()) => {
                    self.outstanding_wrs += n as u32;
                    self.ledger.parts(id, n as u64);
                    self.framing += wrs[at..at + n].iter().map(Wr::note_bytes).sum::<u64>();
                    at += n;
                }
                Err(e) => {
                    // Some of these may have been posted; their completions can
                    // no longer be attributed, so the connection is done.
                    self.broken = Some(e.to_string());
                    failure = Some(e);
                    break;
                }
            }
        }
        self.shared.placement.hops().record(Hop::Post, post_time, batch.bytes());
        match failure {
            None => {
                self.ledger.seal(id, None);
                Ok(id)
            }
            Some(e) if at == 0 && self.broken.is_none() => {
                // Nothing of this batch reached the QP.
                self.ledger.withdraw(id);
                Err(e)
            }
            // Part of it is posted: report through a failed completion, once
            // the posted part has completed (or at once, if the QP is gone).
            Some(e) if self.broken.is_some() => {
                self.ledger.fail_now(id, e);
                Ok(id)
            }
            Some(e) => {
                self.ledger.seal(id, Some(e));
                Ok(id)
            }
        }
    }

    fn poll(&mut self, timeout: Duration) -> Result<Vec<Completion>, TransportError> {
        let deadline = Instant::now() + timeout;
        let mut idle = 0u32;
        loop {
            if !self.ledger.has_done() && self.ledger.waiting() > 0 {
                self.reap()?;
            }
            if self.ledger.has_done() || self.ledger.waiting() == 0 || Instant::now() >= deadline {
                return Ok(self.ledger.take_done());
            }
            idle += 1;
            backoff(idle);
        }
    }

    fn pending(&self) -> usize {
        self.ledger.pending()
    }

    /// The write notes: [`NOTE_LEN`] bytes per write, SENT after the
    /// batch's RDMA writes. (The NIC's own headers are not counted.)
    fn framing_bytes(&self) -> u64 {
        self.framing
    }
}
