//! The endpoint: a device port, its protection domain, the MRs of its
//! regions, and the handshake listener.

use super::active::VerbsConnection;
use super::shared::{MrMem, RegionMr, Shared};
use super::passive::accept_loop;
use super::{chain, mtu_bytes, os_code, verbs_err, VerbsInfo, VerbsLimits, HOW_TO_GET_A_DEVICE};
use crate::flags::FlagTable;
use crate::mem::HostMem;
use crate::metrics::Hops;
use crate::placement::Placement;
use crate::auth::Credential;
use crate::registry::{Grant, Region, Registry};
use crate::{Connection, Endpoint, TransportError};
use kvwire_core::protocol::RegionDesc;
use sideway::ibverbs::address::Gid;
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, PortState};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::AccessFlags;
use std::collections::HashMap;
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// A verbs endpoint: one device port, its regions, and a handshake listener.
#[derive(Debug)]
pub struct VerbsEndpoint {
    shared: Arc<Shared>,
    addr: String,
    accept: Option<JoinHandle<()>>,
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
        let dattr = ctx.query_device().map_err(|e| verbs_err("ibv_query_device", format!("{name}: {}", chain(&e))))?;
        let send_sge = u32::try_from(dattr.max_sge()).unwrap_or(1).clamp(1, super::MAX_SEND_SGE);
        let info = VerbsInfo { device: name.clone(), port, gid_index, gid: gid.raw, lid: pattr.lid(), mtu, send_sge };
        let pd = ctx.alloc_pd().map_err(|e| verbs_err("ibv_alloc_pd", format!("{name}: {}", chain(&e))))?;
        let (registry, placement) = match shared_with {
            Some(s) => s,
            None => {
                let flags = FlagTable::private(limits.slots, limits.layers)?;
                let placement = Placement::new(flags, Arc::new(Hops::default()));
                let placement = if limits.declared_only { placement.declared_only() } else { placement };
                (Arc::new(Registry::new(limits.max_regions)), Arc::new(placement))
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

    /// Registers `mem[offset..offset+len]` with the NIC and in the
    /// registry; a granted region under the MR's rkey, so its `key` is both
    /// what [`crate::WriteOp::src_key`] names locally and what peers write to.
    /// Only a granted region's MR allows remote writes: the NIC itself
    /// refuses a write into a local one, whoever sends it.
    pub fn register(&self, mem: Arc<HostMem>, offset: u64, len: u64, grant: Option<Grant>) -> Result<Arc<Region>, TransportError> {
        let mr = self.reg_mr(&mem, offset, len, grant.is_some())?;
        // A granted region is named by its rkey, so the peer's writes and
        // notes agree; a local one has no rkey worth the name (rxe gives
        // every MR without remote access rkey 0), so the registry names it.
        let region = match grant {
            Some(_) => self.shared.registry.register_with_key(mem, offset, len, mr.rkey(), grant)?,
            None => self.shared.registry.register(mem, offset, len, None)?,
        };
        self.shared.mrs.lock().expect("mr lock").insert(region.key, Arc::new(RegionMr { mr, mem: MrMem::Region(region.clone()) }));
        Ok(region)
    }

    /// Registers `region`, already in the registry this rail shares, with
    /// this rail's device too, so writes through this rail can read from
    /// it and peers of this rail can write into it (under its shared key).
    pub fn attach(&self, region: &Arc<Region>) -> Result<(), TransportError> {
        let mr = self.reg_mr(&region.mem, region.offset, region.len, region.grant.is_some())?;
        self.shared.mrs.lock().expect("mr lock").insert(region.key, Arc::new(RegionMr { mr, mem: MrMem::Region(region.clone()) }));
        // Revoked while this MR was being made: do not keep it.
        if self.shared.registry.get(region.key).is_none() {
            self.shared.mrs.lock().expect("mr lock").remove(&region.key);
            return Err(TransportError::Source(format!("region {:#010x} was revoked while being attached to {}", region.key, self.shared.info.device)));
        }
        Ok(())
    }

    /// An MR of this device over `mem[offset..offset+len]`. The caller
    /// stores it next to an `Arc` of `mem` that outlives it.
    fn reg_mr(&self, mem: &Arc<HostMem>, offset: u64, len: u64, remote: bool) -> Result<Arc<MemoryRegion>, TransportError> {
        mem.check(offset, len)?;
        if len == 0 {
            return Err(crate::mem::MemError::Empty.into());
        }
        let ptr = mem.as_ptr() as usize + offset as usize;
        let access = if remote { AccessFlags::LocalWrite | AccessFlags::RemoteWrite } else { AccessFlags::LocalWrite };
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

    /// Registers device memory with this device through its dmabuf
    /// (`ibv_reg_dmabuf_mr`, local reads only), under `key` or a key the
    /// registry reserves ([`Endpoint::register_dmabuf`]). A NIC or driver
    /// without dmabuf support refuses here, with its reason.
    pub fn register_dmabuf(&self, fd: std::os::fd::BorrowedFd<'_>, len: u64, iova: u64, key: Option<u32>) -> Result<u32, TransportError> {
        use std::os::fd::AsRawFd;
        if len == 0 {
            return Err(crate::mem::MemError::Empty.into());
        }
        let len_usize = usize::try_from(len).map_err(|_| TransportError::Unsupported(format!("a dmabuf of {len} bytes")))?;
        // SAFETY: `fd` is open for the call (borrowed); the kernel takes
        // its own reference to the dmabuf and the exporter keeps the pages
        // for the MR's life, so nothing here outlives what it names.
        let mr = unsafe { self.shared.pd.reg_dmabuf_mr(0, len_usize, iova, fd.as_raw_fd(), AccessFlags::LocalWrite) };
        let mr = mr.map_err(|e| {
            let hint = match os_code(&e) {
                Some(c) if c == nix::errno::Errno::EOPNOTSUPP as i32 || c == nix::errno::Errno::ENOSYS as i32 || c == nix::errno::Errno::EPROTONOSUPPORT as i32 => {
                    "; this device or its driver cannot register dmabufs (soft-RoCE cannot; mlx5 with a peer-memory-capable GPU driver can)"
                }
                Some(c) if c == nix::errno::Errno::EBADF as i32 || c == nix::errno::Errno::EINVAL as i32 => "; the fd is not a dmabuf of that size",
                _ => "",
            };
            verbs_err("ibv_reg_dmabuf_mr", format!("{len} bytes of device memory on {}: {}{hint}", self.shared.info.device, chain(&e)))
        })?;
        let key = match key {
            Some(k) => k,
            None => self.shared.registry.reserve()?,
        };
        self.shared.mrs.lock().expect("mr lock").insert(key, Arc::new(RegionMr { mr, mem: MrMem::Device { key, len, iova } }));
        Ok(key)
    }

    /// Registers a whole mapping, as [`VerbsEndpoint::register`].
    pub fn register_all(&self, mem: Arc<HostMem>, grant: Option<Grant>) -> Result<Arc<Region>, TransportError> {
        let len = mem.len();
        self.register(mem, 0, len, grant)
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

impl Drop for VerbsEndpoint {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

impl Endpoint for VerbsEndpoint {
    fn transport(&self) -> crate::TransportKind {
        crate::TransportKind::Verbs
    }

    fn local_addr(&self) -> String {
        self.addr.clone()
    }

    fn node(&self) -> &str {
        &self.shared.limits.node
    }

    fn registry(&self) -> &Arc<Registry> {
        &self.shared.registry
    }

    fn placement(&self) -> &Arc<Placement> {
        &self.shared.placement
    }

    fn connect(&self, peer: &str, cred: &Credential) -> Result<Box<dyn Connection>, TransportError> {
        Ok(Box::new(VerbsConnection::connect(self.shared.clone(), peer, cred)?))
    }

    fn register(&self, mem: Arc<HostMem>, offset: u64, len: u64, grant: Option<Grant>) -> Result<Arc<Region>, TransportError> {
        VerbsEndpoint::register(self, mem, offset, len, grant)
    }

    fn revoke(&self, key: u32) -> bool {
        VerbsEndpoint::revoke(self, key)
    }

    fn register_dmabuf(&self, fd: std::os::fd::BorrowedFd<'_>, len: u64, iova: u64, key: Option<u32>) -> Result<u32, TransportError> {
        VerbsEndpoint::register_dmabuf(self, fd, len, iova, key)
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
