//! A stand-in device for hosts without a GPU: device memory is a
//! [`HostMem`], and each stream is a worker thread that runs its queue in
//! order, as a CUDA stream does. Copies really happen later, on the worker
//! (optionally after a delay), and an event completes only once the worker
//! reached it — so a caller that reads early reads stale bytes, and the
//! tests can tell.
//!
//! Failure injection: [`HostDevice::fail_copy`] makes the n-th copy (counted
//! over the whole device, from 0) fail when the worker runs it. As with
//! CUDA's sticky errors, the stream is poisoned: later copies on it are
//! skipped and every later event reports the failure.

use super::{Device, DeviceError, DeviceMem, Event, Stream};
use crate::mem::HostMem;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What a stand-in stream's worker did, in the order it did it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceTrace {
    /// The worker started copy `id` (ids count copies over the device, from 0).
    CopyStart {
        /// Copy id.
        id: u64,
        /// `copy_d2h` or `copy_h2d`.
        op: &'static str,
    },
    /// The worker finished copy `id` (bytes are in place).
    CopyEnd {
        /// Copy id.
        id: u64,
        /// Whether it failed (injected).
        failed: bool,
    },
    /// The worker reached an event: it is complete from now on.
    EventComplete,
}

/// Called by the worker threads for every [`DeviceTrace`].
pub type Tracer = Arc<dyn Fn(DeviceTrace) + Send + Sync>;

/// Stand-in device memory.
#[derive(Debug)]
pub struct HostDeviceMem {
    // Shared: a NIC may register it to read it in place (the stand-in's GPUDirect).
    mem: Arc<HostMem>,
    ordinal: u32,
}

impl HostDeviceMem {
    /// The host memory that plays device memory.
    pub fn host(&self) -> &HostMem {
        &self.mem
    }
}

impl DeviceMem for HostDeviceMem {
    fn len(&self) -> u64 {
        self.mem.len()
    }
    fn ordinal(&self) -> u32 {
        self.ordinal
    }
    fn pci_bus_id(&self) -> Option<&str> {
        None
    }
    fn host_mem(&self) -> Option<&Arc<HostMem>> {
        Some(&self.mem)
    }
}

struct Shared {
    delay: Duration,
    fail_copy: Option<u64>,
    next_copy: AtomicU64,
    tracer: Option<Tracer>,
}

/// A stand-in device. See the module docs. A clone is the same device: it
/// shares the copy count and the injected failure.
#[derive(Clone)]
pub struct HostDevice {
    ordinal: u32,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for HostDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostDevice")
            .field("ordinal", &self.ordinal)
            .field("delay", &self.shared.delay)
            .field("fail_copy", &self.shared.fail_copy)
            .finish()
    }
}

impl HostDevice {
    /// A stand-in device with no delay and no injected failure.
    pub fn new(ordinal: u32) -> HostDevice {
        HostDevice::build(ordinal, Duration::ZERO, None, None)
    }

    fn build(ordinal: u32, delay: Duration, fail_copy: Option<u64>, tracer: Option<Tracer>) -> HostDevice {
        HostDevice { ordinal, shared: Arc::new(Shared { delay, fail_copy, next_copy: AtomicU64::new(0), tracer }) }
    }

    /// Every copy sleeps `delay` on its worker before moving bytes.
    pub fn with_delay(self, delay: Duration) -> HostDevice {
        HostDevice::build(self.ordinal, delay, self.shared.fail_copy, self.shared.tracer.clone())
    }

    /// The `n`-th copy of this device (from 0) fails on its worker.
    pub fn fail_copy(self, n: u64) -> HostDevice {
        HostDevice::build(self.ordinal, self.shared.delay, Some(n), self.shared.tracer.clone())
    }

    /// Reports what the workers do to `tracer`.
    pub fn with_tracer(self, tracer: Tracer) -> HostDevice {
        HostDevice::build(self.ordinal, self.shared.delay, self.shared.fail_copy, Some(tracer))
    }

    /// Makes existing host memory (a memfd another process handed over) this
    /// device's memory, as a daemon imports a client's allocation.
    pub fn import_mem(&self, mem: HostMem) -> Arc<HostDeviceMem> {
        Arc::new(HostDeviceMem { mem: Arc::new(mem), ordinal: self.ordinal })
    }
}

impl Device for HostDevice {
    type Mem = HostDeviceMem;
    type Stream = HostStream;
    type Pinned = ();

    fn ordinal(&self) -> u32 {
        self.ordinal
    }
    fn pci_bus_id(&self) -> Option<&str> {
        None
    }
    fn alloc(&self, len: u64) -> Result<Arc<HostDeviceMem>, DeviceError> {
        Ok(Arc::new(HostDeviceMem { mem: Arc::new(HostMem::new("kvwire-host-device", len)?), ordinal: self.ordinal }))
    }
    fn stream(&self) -> Result<HostStream, DeviceError> {
        HostStream::spawn(self.shared.clone())
    }
    fn pin(&self, _mem: &Arc<HostMem>) -> Result<(), DeviceError> {
        Ok(())
    }
    fn write(&self, dst: &HostDeviceMem, dst_off: u64, data: &[u8]) -> Result<(), DeviceError> {
        dst.check(dst_off, data.len() as u64)?;
        Ok(dst.mem.write(dst_off, data)?)
    }
    fn read(&self, src: &HostDeviceMem, src_off: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        src.check(src_off, out.len() as u64)?;
        Ok(src.mem.read(src_off, out)?)
    }
    fn copy_d2h_sync(&self, src: &HostDeviceMem, src_off: u64, dst: &HostMem, dst_off: u64, len: u64) -> Result<(), DeviceError> {
        src.check(src_off, len)?;
        Ok(src.mem.copy_to(src_off, dst, dst_off, len)?)
    }
    fn copy_h2d_sync(&self, src: &HostMem, src_off: u64, dst: &HostDeviceMem, dst_off: u64, len: u64) -> Result<(), DeviceError> {
        dst.check(dst_off, len)?;
        Ok(src.copy_to(src_off, &dst.mem, dst_off, len)?)
    }
}

/// Completion state of one stand-in event.
#[derive(Debug, Default)]
struct EventState {
    done: Mutex<Option<Result<(), DeviceError>>>,
    cv: Condvar,
    // When the stream reached it.
    at: std::sync::OnceLock<Instant>,
}

/// An event of a [`HostStream`].
#[derive(Debug, Clone)]
pub struct HostEvent(Arc<EventState>);

impl Event for HostEvent {
    fn query(&self) -> Result<bool, DeviceError> {
        match &*self.0.done.lock().expect("event lock") {
            None => Ok(false),
            Some(Ok(())) => Ok(true),
            Some(Err(e)) => Err(e.clone()),
        }
    }

    fn synchronize(&self, timeout: Duration) -> Result<(), DeviceError> {
        let deadline = Instant::now() + timeout;
        let mut done = self.0.done.lock().expect("event lock");
        loop {
            if let Some(r) = &*done {
                return r.clone();
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(DeviceError::Timeout { what: "stream event".into(), after: timeout });
            }
            done = self.0.cv.wait_timeout(done, deadline - now).expect("event lock").0;
        }
    }

    fn completed_at(&self) -> Option<Instant> {
        self.0.at.get().copied()
    }
}

enum Op {
    Copy { id: u64, op: &'static str, len: u64, fail: bool, run: Box<dyn FnOnce() -> Result<(), DeviceError> + Send> },
    Record(Arc<EventState>),
}

/// A stand-in stream: a worker thread running its queue in order.
pub struct HostStream {
    // Field order: close the queue, then join the worker.
    tx: Option<mpsc::Sender<Op>>,
    worker: Option<JoinHandle<()>>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for HostStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostStream").finish_non_exhaustive()
    }
}

impl HostStream {
    fn spawn(shared: Arc<Shared>) -> Result<HostStream, DeviceError> {
        let (tx, rx) = mpsc::channel::<Op>();
        let s = shared.clone();
        let worker = std::thread::Builder::new()
            .name("kvwire-host-stream".into())
            .spawn(move || run_worker(&s, rx))
            .map_err(|e| DeviceError::Driver { call: "spawn stream worker", message: e.to_string() })?;
        Ok(HostStream { tx: Some(tx), worker: Some(worker), shared })
    }

    fn enqueue(&self, op: &'static str, len: u64, run: Box<dyn FnOnce() -> Result<(), DeviceError> + Send>) -> Result<(), DeviceError> {
        let id = self.shared.next_copy.fetch_add(1, Ordering::Relaxed);
        let fail = self.shared.fail_copy == Some(id);
        self.tx.as_ref().ok_or(DeviceError::StreamClosed)?.send(Op::Copy { id, op, len, fail, run }).map_err(|_| DeviceError::StreamClosed)
    }
}

fn run_worker(shared: &Shared, rx: mpsc::Receiver<Op>) {
    let trace = |t| {
        if let Some(f) = &shared.tracer {
            f(t)
        }
    };
    let mut poisoned: Option<DeviceError> = None;
    for op in rx {
        match op {
            Op::Copy { id, op, len, fail, run } => {
                if poisoned.is_some() {
                    continue;
                }
                trace(DeviceTrace::CopyStart { id, op });
                if !shared.delay.is_zero() {
                    std::thread::sleep(shared.delay);
                }
                let r = if fail {
                    Err(DeviceError::CopyFailed { op, len, message: format!("injected failure of copy {id}") })
                } else {
                    run().map_err(|e| DeviceError::CopyFailed { op, len, message: e.to_string() })
                };
                trace(DeviceTrace::CopyEnd { id, failed: r.is_err() });
                poisoned = r.err();
            }
            Op::Record(ev) => {
                let result = match &poisoned {
                    None => Ok(()),
                    Some(e) => Err(e.clone()),
                };
                if result.is_ok() {
                    trace(DeviceTrace::EventComplete);
                }
                let _ = ev.at.set(Instant::now());
                *ev.done.lock().expect("event lock") = Some(result);
                ev.cv.notify_all();
            }
        }
    }
}

impl Stream for HostStream {
    type Mem = HostDeviceMem;
    type Event = HostEvent;

    fn copy_d2h(&self, src: &Arc<HostDeviceMem>, src_off: u64, dst: &Arc<HostMem>, dst_off: u64, len: u64) -> Result<(), DeviceError> {
        src.check(src_off, len)?;
        dst.check(dst_off, len)?;
        let (src, dst) = (src.clone(), dst.clone());
        self.enqueue("copy_d2h", len, Box::new(move || Ok(src.mem.copy_to(src_off, &dst, dst_off, len)?)))
    }

    fn copy_h2d(&self, src: &Arc<HostMem>, src_off: u64, dst: &Arc<HostDeviceMem>, dst_off: u64, len: u64) -> Result<(), DeviceError> {
        src.check(src_off, len)?;
        dst.check(dst_off, len)?;
        let (src, dst) = (src.clone(), dst.clone());
        self.enqueue("copy_h2d", len, Box::new(move || Ok(src.copy_to(src_off, &dst.mem, dst_off, len)?)))
    }

    fn record(&self) -> Result<HostEvent, DeviceError> {
        let ev = Arc::new(EventState::default());
        self.tx.as_ref().ok_or(DeviceError::StreamClosed)?.send(Op::Record(ev.clone())).map_err(|_| DeviceError::StreamClosed)?;
        Ok(HostEvent(ev))
    }
}

impl Drop for HostStream {
    /// Waits for the queued work, as destroying a CUDA stream lets its work finish.
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}
