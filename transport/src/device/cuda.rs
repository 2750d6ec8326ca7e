//! The CUDA backend (feature `cuda`): the driver API through `cudarc`,
//! with libcuda loaded at run time.
//!
//! cudarc's loader panics when libcuda or one of its symbols is missing, so
//! [`probe`] first looks for the library and every symbol this module calls
//! (inside a panic boundary), and only then calls into it. Without a driver
//! every entry point returns [`DeviceError::NoDriver`]; nothing panics.
//!
//! Driver calls need the device's primary context current on the calling
//! thread; every method makes it current first, so handles can be used from
//! any thread.

use super::{Device, DeviceError, DeviceMem, Event, Stream};
use crate::mem::HostMem;
use cudarc::driver::result::DriverError;
use cudarc::driver::sys;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Every driver symbol this module calls (checked by [`probe`]).
const SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetPCIBusId",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemGetAddressRange_v2",
    "cuMemGetHandleForAddressRange",
    "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoH_v2",
    "cuMemcpyHtoD_v2",
    "cuStreamCreate",
    "cuStreamSynchronize",
    "cuStreamDestroy_v2",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventElapsedTime",
    "cuEventDestroy_v2",
    "cuGetErrorName",
    "cuGetErrorString",
];

fn describe(e: DriverError) -> String {
    let name = e.error_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|_| format!("{:?}", e.0));
    let text = e.error_string().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    format!("{name}: {text}")
}

fn call(name: &'static str) -> impl Fn(DriverError) -> DeviceError {
    move |e| DeviceError::Driver { call: name, message: describe(e) }
}

fn check(name: &'static str, r: sys::CUresult) -> Result<(), DeviceError> {
    r.result().map_err(call(name))
}

/// Loads libcuda and runs cuInit once per process; the outcome is kept.
/// Ok, or [`DeviceError::NoDriver`] naming why.
pub fn probe() -> Result<(), DeviceError> {
    static PROBE: OnceLock<Result<(), DeviceError>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            let loaded = std::panic::catch_unwind(|| {
                // SAFETY: is_culib_present and culib only dlopen the driver
                // library; culib is called only once the library is known
                // to open, so its loader does not panic.
                unsafe {
                    if !sys::is_culib_present() {
                        return Err("libcuda.so.1 could not be loaded (is the NVIDIA driver installed, and on the loader path?)".to_string());
                    }
                    let lib = sys::culib();
                    for s in SYMBOLS {
                        if lib.get::<*const c_void>(s.as_bytes()).is_err() {
                            return Err(format!("libcuda lacks {s}: the driver is older than CUDA 12.4"));
                        }
                    }
                }
                Ok(())
            });
            match loaded {
                Err(_) => return Err(DeviceError::NoDriver("loading libcuda panicked".into())),
                Ok(Err(why)) => return Err(DeviceError::NoDriver(why)),
                Ok(Ok(())) => {}
            }
            cudarc::driver::result::init().map_err(|e| DeviceError::NoDriver(format!("cuInit: {}", describe(e))))
        })
        .clone()
}

struct Ctx {
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
    ordinal: u32,
    pci: Option<String>,
}

// SAFETY: a CUDA context handle may be made current on, and used from, any
// thread; the driver serialises access internally.
unsafe impl Send for Ctx {}
// SAFETY: as above; Ctx has no interior state of its own.
unsafe impl Sync for Ctx {}

impl Ctx {
    fn bind(&self) -> Result<(), DeviceError> {
        // SAFETY: ctx is the retained primary context of a live device.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.ctx) })
    }
}

impl Drop for Ctx {
    fn drop(&mut self) {
        // SAFETY: releases the retain taken in CudaDevice::open, once.
        unsafe {
            let _ = sys::cuDevicePrimaryCtxRelease_v2(self.dev);
        }
    }
}

/// One CUDA device (its primary context). A clone is the same device.
#[derive(Clone)]
pub struct CudaDevice {
    ctx: Arc<Ctx>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice").field("ordinal", &self.ctx.ordinal).field("pci", &self.ctx.pci).finish()
    }
}

impl CudaDevice {
    /// Opens device `ordinal`. Without a driver: [`DeviceError::NoDriver`].
    pub fn open(ordinal: u32) -> Result<CudaDevice, DeviceError> {
        probe()?;
        let count = cudarc::driver::result::device::get_count().map_err(call("cuDeviceGetCount"))?;
        if i64::from(ordinal) >= i64::from(count) {
            return Err(DeviceError::NoDevice { ordinal, count: count.max(0) as u32 });
        }
        let dev = cudarc::driver::result::device::get(ordinal as i32).map_err(call("cuDeviceGet"))?;
        let mut buf = [0 as std::ffi::c_char; 32];
        // SAFETY: buf is writable for its stated length; dev came from cuDeviceGet.
        let pci = unsafe { sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, dev) }
            .result()
            .ok()
            // SAFETY: the driver NUL-terminates within the buffer on success.
            .map(|()| unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().to_lowercase());
        // SAFETY: dev came from cuDeviceGet; released in Ctx::drop.
        let ctx = unsafe { cudarc::driver::result::primary_ctx::retain(dev) }.map_err(call("cuDevicePrimaryCtxRetain"))?;
        let ctx = Arc::new(Ctx { dev, ctx, ordinal, pci });
        ctx.bind()?;
        Ok(CudaDevice { ctx })
    }

    /// Opens another process's allocation from its CUDA IPC handle (the 64
    /// bytes [`export`] returns) on this device, for `len` bytes from its
    /// start; closed with cuIpcCloseMemHandle on drop. `len` may not exceed
    /// the allocation.
    pub fn import_ipc(&self, handle: &[u8], len: u64) -> Result<Arc<CudaMem>, DeviceError> {
        let mut raw = sys::CUipcMemHandle { reserved: [0; sys::CU_IPC_HANDLE_SIZE as usize] };
        if handle.len() != raw.reserved.len() {
            return Err(DeviceError::Invalid(format!("CUDA IPC handle has {} bytes, expected {}", handle.len(), raw.reserved.len())));
        }
        if len == 0 {
            return Err(DeviceError::Invalid("cannot import 0 bytes of device memory".into()));
        }
        for (r, b) in raw.reserved.iter_mut().zip(handle) {
            *r = std::ffi::c_char::from_ne_bytes([*b]);
        }
        self.ctx.bind()?;
        let mut ptr: sys::CUdeviceptr = 0;
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as std::ffi::c_uint;
        // SAFETY: ptr is writable; the handle is passed by value; this device's context is current.
        check("cuIpcOpenMemHandle", unsafe { sys::cuIpcOpenMemHandle_v2(&mut ptr, raw, flags) })?;
        // From here on, dropping `mem` closes the mapping.
        let mem = CudaMem { ptr, len, ctx: self.ctx.clone(), imported: true };
        let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: both out-pointers are writable; ptr was just mapped in this context.
        check("cuMemGetAddressRange", unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) })?;
        let avail = (base + size as u64).saturating_sub(ptr);
        if len > avail {
            return Err(DeviceError::Invalid(format!("handle says {len} bytes but the imported allocation has {avail}")));
        }
        Ok(Arc::new(mem))
    }
}

/// What a client hands its daemon for `mem`: the allocation's dmabuf fd (for
/// GPUDirect registration; None when the driver refuses it, e.g. without
/// dmabuf support, or a length that is not a multiple of the host page
/// size) and its 64-byte CUDA IPC handle (for [`CudaDevice::import_ipc`]).
pub fn export(mem: &CudaMem) -> Result<(Option<std::fs::File>, Vec<u8>), DeviceError> {
    if mem.imported {
        return Err(DeviceError::Invalid("memory imported from another process cannot be exported again".into()));
    }
    mem.ctx.bind()?;
    let mut raw = sys::CUipcMemHandle { reserved: [0; sys::CU_IPC_HANDLE_SIZE as usize] };
    // SAFETY: raw is writable; ptr is the base of a live cuMemAlloc allocation in this context.
    check("cuIpcGetMemHandle", unsafe { sys::cuIpcGetMemHandle(&mut raw, mem.ptr) })?;
    let ipc = raw.reserved.iter().map(|c| c.to_ne_bytes()[0]).collect();
    let mut fd: std::ffi::c_int = -1;
    let kind = sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD;
    // SAFETY: for DMA_BUF_FD the handle is an int, which fd is; the range is the whole live allocation.
    let dmabuf = match unsafe { sys::cuMemGetHandleForAddressRange((&mut fd as *mut std::ffi::c_int).cast(), mem.ptr, mem.len as usize, kind, 0) } {
        // SAFETY: on success the driver returns a new fd that nothing else owns.
        sys::CUresult::CUDA_SUCCESS => Some(unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) }),
        e => {
            // Optional: without it the daemon stages through host memory.
            tracing::info!(len = mem.len, error = %describe(DriverError(e)), "no dmabuf for device memory; GPUDirect registration unavailable");
            None
        }
    };
    Ok((dmabuf, ipc))
}

/// Device memory from cuMemAlloc, freed on drop; or another process's,
/// opened with cuIpcOpenMemHandle and closed on drop.
pub struct CudaMem {
    ptr: sys::CUdeviceptr,
    len: u64,
    ctx: Arc<Ctx>,
    imported: bool,
}

impl std::fmt::Debug for CudaMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaMem")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("ordinal", &self.ctx.ordinal)
            .field("imported", &self.imported)
            .finish()
    }
}

impl CudaMem {
    /// The device address (for dmabuf export and verbs registration).
    pub fn as_raw(&self) -> sys::CUdeviceptr {
        self.ptr
    }
}

impl DeviceMem for CudaMem {
    fn len(&self) -> u64 {
        self.len
    }
    fn ordinal(&self) -> u32 {
        self.ctx.ordinal
    }
    fn pci_bus_id(&self) -> Option<&str> {
        self.ctx.pci.as_deref()
    }
    fn device_addr(&self) -> Option<u64> {
        Some(self.ptr)
    }
}

impl Drop for CudaMem {
    fn drop(&mut self) {
        // SAFETY: ptr came from cuMemAlloc or cuIpcOpenMemHandle in this
        // context and is released once, by its matching call; every stream
        // that copied from or into it held an Arc to it until its copies
        // completed, so no copy is outstanding.
        unsafe {
            if self.ctx.bind().is_ok() {
                let _ = if self.imported { sys::cuIpcCloseMemHandle(self.ptr) } else { sys::cuMemFree_v2(self.ptr) };
            }
        }
    }
}

/// Host memory registered with cuMemHostRegister; unregistered on drop.
pub struct CudaPinned {
    // Keeps the mapping alive while it is registered.
    mem: Arc<HostMem>,
    ctx: Arc<Ctx>,
}

impl std::fmt::Debug for CudaPinned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaPinned").field("len", &self.mem.len()).finish()
    }
}

impl Drop for CudaPinned {
    fn drop(&mut self) {
        // SAFETY: the range was registered by CudaDevice::pin and is unregistered once.
        unsafe {
            if self.ctx.bind().is_ok() {
                let _ = sys::cuMemHostUnregister(self.mem.as_ptr().cast());
            }
        }
    }
}

type Keep = Box<dyn std::any::Any + Send + Sync>;

struct StreamInner {
    raw: sys::CUstream,
    ctx: Arc<Ctx>,
    /// Buffers of enqueued copies, with the copy's sequence number: kept
    /// alive until an event after them is seen complete.
    keep: Mutex<Vec<(u64, Keep)>>,
    seq: Mutex<u64>,
}

// SAFETY: CUstream handles may be used from any thread with the context current.
unsafe impl Send for StreamInner {}
// SAFETY: as above; the Rust-side state is behind mutexes.
unsafe impl Sync for StreamInner {}

impl StreamInner {
    fn release_through(&self, seq: u64) {
        self.keep.lock().expect("stream keep lock").retain(|(s, _)| *s > seq);
    }
}

impl Drop for StreamInner {
    fn drop(&mut self) {
        // SAFETY: the stream is live until here; waiting for it before
        // dropping `keep` keeps every buffer of its copies alive until they ended.
        unsafe {
            if self.ctx.bind().is_ok() {
                let _ = sys::cuStreamSynchronize(self.raw);
                let _ = sys::cuStreamDestroy_v2(self.raw);
            }
        }
    }
}

/// A CUDA stream (non-blocking).
pub struct CudaStream(Arc<StreamInner>);

impl std::fmt::Debug for CudaStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaStream").field("ordinal", &self.0.ctx.ordinal).finish()
    }
}

impl CudaStream {
    fn enqueued(&self, keep: Keep) {
        let seq = *self.0.seq.lock().expect("stream seq lock");
        self.0.keep.lock().expect("stream keep lock").push((seq, keep));
    }
}

impl Stream for CudaStream {
    type Mem = CudaMem;
    type Event = CudaEvent;

    fn copy_d2h(&self, src: &Arc<CudaMem>, src_off: u64, dst: &Arc<HostMem>, dst_off: u64, len: u64) -> Result<(), DeviceError> {
        src.check(src_off, len)?;
        dst.check(dst_off, len)?;
        if !dst.writable() {
            return Err(DeviceError::Mem(crate::mem::MemError::ReadOnly));
        }
        self.0.ctx.bind()?;
        // SAFETY: both ranges are in bounds (checked); the stream holds Arcs
        // to both buffers (below) until an event after the copy completed.
        check("cuMemcpyDtoHAsync", unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.as_ptr().add(dst_off as usize).cast(), src.ptr + src_off, len as usize, self.0.raw)
        })?;
        self.enqueued(Box::new((src.clone(), dst.clone())));
        Ok(())
    }

    fn copy_h2d(&self, src: &Arc<HostMem>, src_off: u64, dst: &Arc<CudaMem>, dst_off: u64, len: u64) -> Result<(), DeviceError> {
        src.check(src_off, len)?;
        dst.check(dst_off, len)?;
        self.0.ctx.bind()?;
        // SAFETY: as in copy_d2h.
        check("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst.ptr + dst_off, src.as_ptr().add(src_off as usize).cast_const().cast(), len as usize, self.0.raw)
        })?;
        self.enqueued(Box::new((src.clone(), dst.clone())));
        Ok(())
    }

    fn record(&self) -> Result<CudaEvent, DeviceError> {
        self.0.ctx.bind()?;
        // Timed: the hops report how long copies held the stream (elapsed_since).
        let raw = cudarc::driver::result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(call("cuEventCreate"))?;
        // Destroys `raw` should recording fail.
        let mut event = CudaEvent { raw, stream: self.0.clone(), seq: 0 };
        let mut seq = self.0.seq.lock().expect("stream seq lock");
        // SAFETY: raw was just created, the stream is live.
        check("cuEventRecord", unsafe { sys::cuEventRecord(event.raw, self.0.raw) })?;
        event.seq = *seq;
        *seq += 1;
        Ok(event)
    }
}

/// A CUDA event recorded on a [`CudaStream`].
pub struct CudaEvent {
    raw: sys::CUevent,
    stream: Arc<StreamInner>,
    seq: u64,
}

// SAFETY: event handles may be queried from any thread with the context current.
unsafe impl Send for CudaEvent {}

impl std::fmt::Debug for CudaEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaEvent").field("seq", &self.seq).finish()
    }
}

impl Event for CudaEvent {
    fn query(&self) -> Result<bool, DeviceError> {
        self.stream.ctx.bind()?;
        // SAFETY: raw is a live event (destroyed only in Drop).
        match unsafe { sys::cuEventQuery(self.raw) } {
            sys::CUresult::CUDA_SUCCESS => {
                self.stream.release_through(self.seq);
                Ok(true)
            }
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => Err(call("cuEventQuery")(DriverError(e))),
        }
    }

    fn synchronize(&self, timeout: Duration) -> Result<(), DeviceError> {
        // cuEventSynchronize cannot time out: poll, yielding, then sleeping.
        let start = Instant::now();
        loop {
            if self.query()? {
                return Ok(());
            }
            let waited = start.elapsed();
            if waited >= timeout {
                return Err(DeviceError::Timeout { what: "CUDA event".into(), after: timeout });
            }
            if waited < Duration::from_micros(100) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }

    fn elapsed_since(&self, start: &CudaEvent) -> Option<Duration> {
        self.stream.ctx.bind().ok()?;
        let mut ms = 0f32;
        // SAFETY: both are live timed events; NOT_READY (either still pending) is an Err here.
        unsafe { sys::cuEventElapsedTime(&mut ms, start.raw, self.raw) }.result().ok()?;
        Some(Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3))
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        // SAFETY: destroyed once; the driver frees it when complete if it is not yet.
        unsafe {
            if self.stream.ctx.bind().is_ok() {
                let _ = sys::cuEventDestroy_v2(self.raw);
            }
        }
    }
}

impl Device for CudaDevice {
    type Mem = CudaMem;
    type Stream = CudaStream;
    type Pinned = CudaPinned;

    fn ordinal(&self) -> u32 {
        self.ctx.ordinal
    }

    fn pci_bus_id(&self) -> Option<&str> {
        self.ctx.pci.as_deref()
    }

    fn alloc(&self, len: u64) -> Result<Arc<CudaMem>, DeviceError> {
        if len == 0 {
            return Err(DeviceError::Invalid("cannot allocate 0 bytes of device memory".into()));
        }
        self.ctx.bind()?;
        // SAFETY: allocates in the current (this device's) context; freed in CudaMem::drop.
        let ptr = unsafe { cudarc::driver::result::malloc_sync(len as usize) }.map_err(call("cuMemAlloc"))?;
        Ok(Arc::new(CudaMem { ptr, len, ctx: self.ctx.clone(), imported: false }))
    }

    fn stream(&self) -> Result<CudaStream, DeviceError> {
        self.ctx.bind()?;
        let raw = cudarc::driver::result::stream::create(cudarc::driver::result::stream::StreamKind::NonBlocking).map_err(call("cuStreamCreate"))?;
        Ok(CudaStream(Arc::new(StreamInner { raw, ctx: self.ctx.clone(), keep: Mutex::new(Vec::new()), seq: Mutex::new(0) })))
    }

    fn pin(&self, mem: &Arc<HostMem>) -> Result<CudaPinned, DeviceError> {
        self.ctx.bind()?;
        // SAFETY: the whole live mapping is registered; CudaPinned keeps it
        // alive and unregisters it before it can be unmapped.
        check("cuMemHostRegister", unsafe { sys::cuMemHostRegister_v2(mem.as_ptr().cast(), mem.len() as usize, sys::CU_MEMHOSTREGISTER_PORTABLE) })?;
        Ok(CudaPinned { mem: mem.clone(), ctx: self.ctx.clone() })
    }

    fn write(&self, dst: &CudaMem, dst_off: u64, data: &[u8]) -> Result<(), DeviceError> {
        dst.check(dst_off, data.len() as u64)?;
        self.ctx.bind()?;
        // SAFETY: in bounds (checked); synchronous, so `data` outlives the copy.
        check("cuMemcpyHtoD", unsafe { sys::cuMemcpyHtoD_v2(dst.ptr + dst_off, data.as_ptr().cast(), data.len()) })
    }

    fn read(&self, src: &CudaMem, src_off: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        src.check(src_off, out.len() as u64)?;
        self.ctx.bind()?;
        // SAFETY: as in write.
        check("cuMemcpyDtoH", unsafe { sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), src.ptr + src_off, out.len()) })
    }

    fn copy_d2h_sync(&self, src: &CudaMem, src_off: u64, dst: &HostMem, dst_off: u64, len: u64) -> Result<(), DeviceError> {
        src.check(src_off, len)?;
        dst.check(dst_off, len)?;
        self.ctx.bind()?;
        // SAFETY: both in bounds (checked); synchronous.
        check("cuMemcpyDtoH", unsafe { sys::cuMemcpyDtoH_v2(dst.as_ptr().add(dst_off as usize).cast(), src.ptr + src_off, len as usize) })
    }

    fn copy_h2d_sync(&self, src: &HostMem, src_off: u64, dst: &CudaMem, dst_off: u64, len: u64) -> Result<(), DeviceError> {
        src.check(src_off, len)?;
        dst.check(dst_off, len)?;
        self.ctx.bind()?;
        // SAFETY: both in bounds (checked); synchronous.
        check("cuMemcpyHtoD", unsafe { sys::cuMemcpyHtoD_v2(dst.ptr + dst_off, src.as_ptr().add(src_off as usize).cast_const().cast(), len as usize) })
    }
}
