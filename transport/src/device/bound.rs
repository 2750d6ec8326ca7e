//! A client's device allocation as its daemon holds it: imported from a
//! [`DeviceHandle`] and bound to a stream of the daemon's own, behind
//! object-safe traits, on a backend chosen at run time ([`Backend::open`]).
//!
//! The [`Device`] traits have associated types, so code that picks its
//! backend from config cannot name them; [`BoundMem`] and [`EventWait`]
//! erase them, with one generic implementation for every backend.

#[cfg(feature = "cuda")]
use super::cuda::CudaDevice;
use super::host::HostDevice;
use super::{Device, DeviceError, DeviceMem, Event, Stream};
use crate::mem::{HostMem, MemError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How a client hands a device allocation to its daemon.
#[derive(Debug)]
pub struct DeviceHandle {
    /// Device ordinal the allocation lives on.
    pub ordinal: u32,
    /// Bytes.
    pub len: u64,
    /// Stand-in backend: the memfd that plays the device memory (the daemon maps it).
    /// CUDA: the allocation's dmabuf fd (cuMemGetHandleForAddressRange, for GPUDirect
    /// registration with ibv_reg_dmabuf_mr); may be None.
    pub fd: Option<std::fs::File>,
    /// CUDA: the CUDA IPC handle bytes (cuIpcGetMemHandle, 64 bytes) the daemon opens
    /// with cuIpcOpenMemHandle for its staging copies. None for the stand-in.
    pub ipc: Option<Vec<u8>>,
}

/// How a NIC can read an allocation in place (GPUDirect), where it can.
#[derive(Debug, Clone)]
pub enum NicMemory {
    /// The stand-in: its device memory is host memory, registered as it is.
    Host(Arc<HostMem>),
    /// CUDA: the allocation's dmabuf (for `ibv_reg_dmabuf_mr`) and the
    /// device address the registration's writes name.
    Dmabuf {
        /// The dmabuf fd the client exported (offset 0 is the allocation's start).
        fd: Arc<std::os::fd::OwnedFd>,
        /// The allocation's device address, used as the MR's iova.
        iova: u64,
        /// Bytes.
        len: u64,
    },
}

/// Waits for the copies enqueued before it (one recorded event).
pub trait EventWait: Send + Sync + std::fmt::Debug {
    /// Whether every copy enqueued before the event finished. Err when one
    /// of them failed (the stream is poisoned from then on).
    fn query(&self) -> Result<bool, DeviceError>;
    /// Waits up to `timeout` for [`EventWait::query`] to be true.
    fn wait(&self, timeout: Duration) -> Result<(), DeviceError>;
    /// When the stream reached the event, where the backend knows it
    /// ([`super::Event::completed_at`]).
    fn completed_at(&self) -> Option<std::time::Instant>;
    /// How long the copies held the stream, from the stream reaching them
    /// to their end, where the backend times it
    /// ([`super::Event::elapsed_since`]); `None` before they completed.
    fn busy(&self) -> Option<Duration>;
}

/// An imported allocation bound to one stream of its device: object-safe.
pub trait BoundMem: Send + Sync + std::fmt::Debug {
    /// Bytes.
    fn len(&self) -> u64;
    /// Never true: empty allocations are refused.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Ordinal of the device that holds it.
    fn ordinal(&self) -> u32;
    /// PCI address of that device, when known (never for the stand-in).
    fn pci_bus_id(&self) -> Option<String>;
    /// Enqueues device → host copies of `runs` = (device offset, host offset, len), in
    /// order on this allocation's stream, then records an event. Returns at once.
    /// Every run is bounds-checked (both sides) before anything is enqueued.
    /// `host` should be pinned ([`Backend::pin`]) for the copies to be true DMA.
    /// A failure after the checks (a driver call, a closed stream) may leave
    /// earlier runs enqueued: treat the allocation as failed.
    fn d2h(&self, runs: &[(u64, u64, u64)], host: &Arc<HostMem>) -> Result<Box<dyn EventWait>, DeviceError>;
    /// Host → device, as `d2h` (runs = (device offset, host offset, len)).
    fn h2d(&self, runs: &[(u64, u64, u64)], host: &Arc<HostMem>) -> Result<Box<dyn EventWait>, DeviceError>;
    /// What a NIC registers to read this allocation in place, or why
    /// nothing can be (CUDA without a dmabuf from the client).
    fn nic(&self) -> Result<NicMemory, String>;
    /// Synchronous read for setup and checks (tests, the demo). It does not
    /// wait for enqueued copies: wait for their event first.
    fn read(&self, off: u64, out: &mut [u8]) -> Result<(), DeviceError>;
    /// Synchronous write for setup and checks, as [`BoundMem::read`].
    fn write(&self, off: u64, data: &[u8]) -> Result<(), DeviceError>;
}

/// The events recorded before and after a batch of copies, of any
/// backend. `Event` is not `Sync`, hence the mutex.
#[derive(Debug)]
struct Waiter<E>(Mutex<(E, E)>);

impl<E: Event> EventWait for Waiter<E> {
    fn query(&self) -> Result<bool, DeviceError> {
        self.0.lock().expect("event lock").1.query()
    }
    fn wait(&self, timeout: Duration) -> Result<(), DeviceError> {
        self.0.lock().expect("event lock").1.synchronize(timeout)
    }
    fn completed_at(&self) -> Option<std::time::Instant> {
        self.0.lock().expect("event lock").1.completed_at()
    }
    fn busy(&self) -> Option<Duration> {
        let events = self.0.lock().expect("event lock");
        events.1.elapsed_since(&events.0)
    }
}

/// Imported memory of any backend with its own stream.
#[derive(Debug)]
struct Bound<D: Device> {
    // Field order: the stream drops first, and waits for its copies.
    stream: Mutex<D::Stream>,
    mem: Arc<D::Mem>,
    dev: D,
    /// The dmabuf the client exported for the allocation, kept for a NIC to register.
    dmabuf: Option<Arc<std::os::fd::OwnedFd>>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Dir {
    D2h,
    H2d,
}

impl<D: Device> Bound<D> {
    fn new(dev: D, mem: Arc<D::Mem>) -> Result<Bound<D>, DeviceError> {
        Ok(Bound { stream: Mutex::new(dev.stream()?), mem, dev, dmabuf: None })
    }

    /// Checks every run, then enqueues them all between two events: the
    /// first says when the stream reached them, the last when they ended.
    fn copies(&self, dir: Dir, runs: &[(u64, u64, u64)], host: &Arc<HostMem>) -> Result<Waiter<<D::Stream as Stream>::Event>, DeviceError> {
        for &(dev_off, host_off, len) in runs {
            self.mem.check(dev_off, len)?;
            host.check(host_off, len)?;
        }
        if dir == Dir::D2h && !host.writable() {
            return Err(MemError::ReadOnly.into());
        }
        // Held until the event is recorded, so no other caller's copies fall between.
        let stream = self.stream.lock().expect("bound stream lock");
        let start = stream.record()?;
        for &(dev_off, host_off, len) in runs {
            match dir {
                Dir::D2h => stream.copy_d2h(&self.mem, dev_off, host, host_off, len)?,
                Dir::H2d => stream.copy_h2d(host, host_off, &self.mem, dev_off, len)?,
            }
        }
        Ok(Waiter(Mutex::new((start, stream.record()?))))
    }
}

impl<D> BoundMem for Bound<D>
where
    D: Device + 'static,
    <D::Stream as Stream>::Event: 'static,
{
    fn len(&self) -> u64 {
        self.mem.len()
    }
    fn ordinal(&self) -> u32 {
        self.mem.ordinal()
    }
    fn pci_bus_id(&self) -> Option<String> {
        self.mem.pci_bus_id().map(str::to_owned)
    }
    fn d2h(&self, runs: &[(u64, u64, u64)], host: &Arc<HostMem>) -> Result<Box<dyn EventWait>, DeviceError> {
        Ok(Box::new(self.copies(Dir::D2h, runs, host)?))
    }
    fn h2d(&self, runs: &[(u64, u64, u64)], host: &Arc<HostMem>) -> Result<Box<dyn EventWait>, DeviceError> {
        Ok(Box::new(self.copies(Dir::H2d, runs, host)?))
    }
    fn nic(&self) -> Result<NicMemory, String> {
        if let Some(host) = self.mem.host_mem() {
            return Ok(NicMemory::Host(host.clone()));
        }
        match (&self.dmabuf, self.mem.device_addr()) {
            (Some(fd), Some(iova)) => Ok(NicMemory::Dmabuf { fd: fd.clone(), iova, len: self.mem.len() }),
            _ => Err("the client handed over no dmabuf for this allocation (its driver refused cuMemGetHandleForAddressRange)".into()),
        }
    }
    fn read(&self, off: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        self.dev.read(&self.mem, off, out)
    }
    fn write(&self, off: u64, data: &[u8]) -> Result<(), DeviceError> {
        self.dev.write(&self.mem, off, data)
    }
}

/// A device backend chosen at run time.
#[derive(Debug)]
pub enum Backend {
    /// The stand-in: device memory is a memfd the client shares.
    Host(HostDevice),
    /// A CUDA device.
    #[cfg(feature = "cuda")]
    Cuda(CudaDevice),
}

impl Backend {
    /// `kind` = "host" (the stand-in) or "cuda". "cuda" without the feature: DeviceError::NotBuilt;
    /// without a driver: NoDriver (never a panic). Anything else: DeviceError::Invalid naming the kind.
    pub fn open(kind: &str, ordinal: u32) -> Result<Backend, DeviceError> {
        match kind {
            "host" => Ok(Backend::Host(HostDevice::new(ordinal))),
            #[cfg(feature = "cuda")]
            "cuda" => Ok(Backend::Cuda(CudaDevice::open(ordinal)?)),
            #[cfg(not(feature = "cuda"))]
            "cuda" => Err(DeviceError::NotBuilt("kvwire-transport was built without the `cuda` feature")),
            _ => Err(DeviceError::Invalid(format!("unknown device backend {kind:?}: expected \"host\" or \"cuda\""))),
        }
    }

    /// "host" or "cuda", as [`Backend::open`] takes it.
    pub fn kind(&self) -> &'static str {
        match self {
            Backend::Host(_) => "host",
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => "cuda",
        }
    }

    fn ordinal(&self) -> u32 {
        match self {
            Backend::Host(d) => d.ordinal(),
            #[cfg(feature = "cuda")]
            Backend::Cuda(d) => d.ordinal(),
        }
    }

    /// Opens a client's allocation (stand-in: maps `fd` with HostMem::from_file and checks
    /// its length equals `len`; CUDA: cuIpcOpenMemHandle(ipc) with
    /// CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, closed with cuIpcCloseMemHandle on drop) and
    /// binds it to a new stream of this backend. A handle missing what the backend needs,
    /// a wrong length, an ordinal other than this device's: DeviceError::Invalid with a
    /// message naming what was wrong.
    ///
    /// CUDA keeps `fd` (the dmabuf) for a NIC to register ([`BoundMem::nic`]).
    pub fn import(&self, h: DeviceHandle) -> Result<Arc<dyn BoundMem>, DeviceError> {
        let ordinal = self.ordinal();
        if h.ordinal != ordinal {
            return Err(DeviceError::Invalid(format!("handle is for device {} but this {} backend is device {ordinal}", h.ordinal, self.kind())));
        }
        if h.len == 0 {
            return Err(DeviceError::Invalid("handle has a length of 0 bytes".into()));
        }
        let bound: Arc<dyn BoundMem> = match self {
            Backend::Host(dev) => {
                let fd = h.fd.ok_or_else(|| DeviceError::Invalid("the host stand-in needs the memfd that plays the device memory, and the handle has no fd".into()))?;
                let mem = HostMem::from_file(fd)?;
                if mem.len() != h.len {
                    return Err(DeviceError::Invalid(format!("handle says {} bytes but its memfd has {}", h.len, mem.len())));
                }
                Arc::new(Bound::new(dev.clone(), dev.import_mem(mem))?)
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(dev) => {
                let ipc = h.ipc.ok_or_else(|| DeviceError::Invalid("CUDA import needs the allocation's IPC handle, and the handle has none".into()))?;
                let mut bound = Bound::new(dev.clone(), dev.import_ipc(&ipc, h.len)?)?;
                bound.dmabuf = h.fd.map(|f| Arc::new(std::os::fd::OwnedFd::from(f)));
                Arc::new(bound)
            }
        };
        tracing::debug!(backend = self.kind(), ordinal, len = h.len, "device allocation imported");
        Ok(bound)
    }

    /// Pins a host mirror for true async DMA (CUDA: cuMemHostRegister; stand-in: nothing).
    /// The returned guard unpins on drop.
    pub fn pin(&self, mem: &Arc<HostMem>) -> Result<Box<dyn std::any::Any + Send + Sync>, DeviceError> {
        match self {
            Backend::Host(dev) => {
                dev.pin(mem)?;
                Ok(Box::new(()))
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(dev) => Ok(Box::new(dev.pin(mem)?)),
        }
    }
}
