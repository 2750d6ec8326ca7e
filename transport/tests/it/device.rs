//! Device staging: the schedulers against the host stand-in (slow copies,
//! a slow loopback wire, injected copy failures), a client's allocation
//! imported into a run-time [`Backend`] (the stand-in), the no-driver path, and —
//! with `--features cuda` and `KVWIRE_GPU=1` — the same round trip on a real
//! GPU (scripts/gpu-check).
//!
//! Order claims are read from one event log that the stand-in's stream
//! workers, the loopback wire and the scheduler all append to; no test
//! asserts a duration.

use kvwire_transport::device::bound::{Backend, BoundMem, DeviceHandle};
use kvwire_transport::device::host::{DeviceTrace, HostDevice};
use kvwire_transport::device::stage::{LayerDst, SourceRange, StageIn, StageInEvent, StageOut, StageOutEvent, StagedChunk, StagingRing, WireHandle};
use kvwire_transport::device::{probe_cuda, Device, DeviceError, Event, Stream};
use kvwire_transport::mem::MemError;
use kvwire_transport::{Hop, Hops, HostMem};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(30);

/// One entry of the shared log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Entry {
    Dev(DeviceTrace),
    Out(StageOutEvent),
    WireStart(usize),
    WireEnd(usize),
}

#[derive(Debug, Clone, Default)]
struct Log(Arc<Mutex<Vec<Entry>>>);

impl Log {
    fn push(&self, e: Entry) {
        self.0.lock().unwrap().push(e);
    }
    fn entries(&self) -> Vec<Entry> {
        self.0.lock().unwrap().clone()
    }
    fn pos(&self, e: Entry) -> usize {
        let v = self.entries();
        v.iter().position(|x| *x == e).unwrap_or_else(|| panic!("{e:?} not in the log: {v:?}"))
    }
    fn tracer(&self) -> kvwire_transport::device::host::Tracer {
        let log = self.clone();
        Arc::new(move |t| log.push(Entry::Dev(t)))
    }
}

/// The reference content of source byte `i` of layer `layer` (independent
/// of everything under test).
fn pattern(layer: u32, i: u64) -> u8 {
    (i.wrapping_mul(31) ^ (i >> 8) ^ u64::from(layer).wrapping_mul(0x9d)) as u8
}

fn layer_bytes(layer: u32, len: u64) -> Vec<u8> {
    (0..len).map(|i| pattern(layer, i)).collect()
}

/// Completion of one chunk on the loopback wire.
#[derive(Debug, Default)]
struct Done {
    done: Mutex<bool>,
    cv: Condvar,
}

#[derive(Debug)]
struct DoneHandle(Arc<Done>);

impl WireHandle for DoneHandle {
    fn poll(&mut self) -> Result<bool, DeviceError> {
        Ok(*self.0.done.lock().unwrap())
    }
    fn wait(&mut self, timeout: Duration) -> Result<bool, DeviceError> {
        let g = self.0.done.lock().unwrap();
        let (g, _) = self.0.cv.wait_timeout_while(g, timeout, |d| !*d).unwrap();
        Ok(*g)
    }
}

struct Job {
    chunk: StagedChunk,
    dst_off: u64,
    done: Arc<Done>,
}

/// A serial "wire": one thread that, for each posted chunk, waits `delay`
/// and only then copies the staging bytes into `dst` — so a staging slot
/// overwritten while its chunk is on the wire shows up as wrong bytes.
struct LoopWire {
    tx: Option<mpsc::Sender<Job>>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Where each source range starts in `dst`.
    bases: Vec<u64>,
}

impl LoopWire {
    fn new(dst: Arc<HostMem>, bases: Vec<u64>, delay: Duration, log: Log) -> LoopWire {
        let (tx, rx) = mpsc::channel::<Job>();
        let d = dst.clone();
        let thread = std::thread::spawn(move || {
            for job in rx {
                log.push(Entry::WireStart(job.chunk.index));
                if !delay.is_zero() {
                    std::thread::sleep(delay);
                }
                job.chunk.staging.copy_to(job.chunk.staging_offset, &d, job.dst_off, job.chunk.len).unwrap();
                log.push(Entry::WireEnd(job.chunk.index));
                *job.done.done.lock().unwrap() = true;
                job.done.cv.notify_all();
            }
        });
        LoopWire { tx: Some(tx), thread: Some(thread), bases }
    }

    fn post(&self, c: &StagedChunk) -> Result<DoneHandle, DeviceError> {
        let done = Arc::new(Done::default());
        let job = Job { chunk: c.clone(), dst_off: self.bases[c.range] + c.range_offset, done: done.clone() };
        self.tx.as_ref().unwrap().send(job).map_err(|_| DeviceError::Wire("loopback wire gone".into()))?;
        Ok(DoneHandle(done))
    }
}

impl Drop for LoopWire {
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }
}

struct Sent<M> {
    ranges: Vec<SourceRange<M>>,
    bases: Vec<u64>,
    total: u64,
}

/// Device memory holding `layers` of `layer_len` bytes each, filled with
/// the pattern, as one source range per layer.
fn source<D: Device>(dev: &D, layers: u32, layer_len: u64) -> Sent<D::Mem> {
    let mem = dev.alloc(u64::from(layers) * layer_len).unwrap();
    let mut ranges = Vec::new();
    let mut bases = Vec::new();
    for l in 0..layers {
        let off = u64::from(l) * layer_len;
        dev.write(&mem, off, &layer_bytes(l, layer_len)).unwrap();
        ranges.push(SourceRange { layer: l, mem: mem.clone(), offset: off, len: layer_len });
        bases.push(off);
    }
    Sent { ranges, bases, total: u64::from(layers) * layer_len }
}

fn check_received(dst: &HostMem, layers: u32, layer_len: u64) {
    for l in 0..layers {
        let mut got = vec![0u8; layer_len as usize];
        dst.read(u64::from(l) * layer_len, &mut got).unwrap();
        assert!(got == layer_bytes(l, layer_len), "layer {l}: received bytes differ from the device source");
    }
}

#[test]
fn stage_out_posts_a_chunk_only_after_its_copy_completed() {
    let log = Log::default();
    let dev = HostDevice::new(0).with_delay(Duration::from_millis(5)).with_tracer(log.tracer());
    let (layers, layer_len, chunk) = (2, 10_000u64, 4096u64); // 3 chunks per layer, the last partial
    let sent = source(&dev, layers, layer_len);
    let dst = Arc::new(HostMem::new("dst", sent.total).unwrap());
    let wire = LoopWire::new(dst.clone(), sent.bases.clone(), Duration::ZERO, log.clone());
    let ring = StagingRing::new(&dev, 3, chunk).unwrap();
    let hops = Arc::new(Hops::default());
    let out = StageOut::new(dev.stream().unwrap(), ring, sent.ranges, WAIT).unwrap().with_hops(hops.clone());
    let l2 = log.clone();
    let report = out
        .run(
            |c| {
                // What the wire would read now: it must already be the device bytes.
                let mut now = vec![0u8; c.len as usize];
                c.staging.read(c.staging_offset, &mut now).unwrap();
                let want: Vec<u8> = (c.range_offset..c.range_offset + c.len).map(|i| pattern(c.layer, i)).collect();
                assert!(now == want, "chunk {} handed to the wire before its device → host copy landed", c.index);
                wire.post(c)
            },
            |e| l2.push(Entry::Out(e)),
        )
        .unwrap();
    assert_eq!(report.chunks, 6);
    assert_eq!(report.bytes, 20_000);
    drop(wire);
    check_received(&dst, layers, layer_len);
    for c in 0..6 {
        assert!(log.pos(Entry::Dev(DeviceTrace::CopyEnd { id: c as u64, failed: false })) < log.pos(Entry::Out(StageOutEvent::Posted { chunk: c })));
    }
    assert_eq!(hops.summary(Hop::Stage).count, 6);
    assert_eq!(hops.summary(Hop::Stage).bytes, 20_000);
}

#[test]
fn stage_out_reuses_a_slot_only_after_the_wire_completed_its_chunk() {
    let log = Log::default();
    let dev = HostDevice::new(0).with_delay(Duration::from_millis(1)).with_tracer(log.tracer());
    let (layers, layer_len, chunk, slots) = (2, 4 * 4096u64, 4096u64, 2usize);
    let sent = source(&dev, layers, layer_len);
    let dst = Arc::new(HostMem::new("dst", sent.total).unwrap());
    // The slow wire copies at the end of its delay: an overwritten slot would corrupt dst.
    let wire = LoopWire::new(dst.clone(), sent.bases.clone(), Duration::from_millis(10), log.clone());
    let ring = StagingRing::new(&dev, slots, chunk).unwrap();
    let l2 = log.clone();
    StageOut::new(dev.stream().unwrap(), ring, sent.ranges, WAIT).unwrap().run(|c| wire.post(c), |e| l2.push(Entry::Out(e))).unwrap();
    drop(wire);
    check_received(&dst, layers, layer_len);
    // From the log: a slot's next copy is enqueued only after the wire completed its previous chunk.
    let mut owner: Vec<Option<usize>> = vec![None; slots];
    let mut wire_done = std::collections::HashSet::new();
    for e in log.entries() {
        match e {
            Entry::Out(StageOutEvent::D2hEnqueued { chunk, slot }) => {
                if let Some(prev) = owner[slot] {
                    assert!(wire_done.contains(&prev), "slot {slot} reused for chunk {chunk} while chunk {prev} was on the wire");
                }
                owner[slot] = Some(chunk);
            }
            Entry::WireEnd(c) => {
                wire_done.insert(c);
            }
            _ => {}
        }
    }
    // source_released per layer only after the last wire completion of its chunks.
    for (range, last_chunk) in [(0usize, 3usize), (1, 7)] {
        let released = log.pos(Entry::Out(StageOutEvent::SourceReleased { range, layer: range as u32 }));
        for c in last_chunk - 3..=last_chunk {
            assert!(log.pos(Entry::WireEnd(c)) < released, "range {range} released before chunk {c} left the wire");
        }
    }
}

#[test]
fn stage_out_copies_the_next_chunk_while_the_previous_is_on_the_wire() {
    let log = Log::default();
    let t = Duration::from_millis(15);
    let dev = HostDevice::new(0).with_delay(t).with_tracer(log.tracer());
    let (chunk, n) = (4096u64, 6u64);
    let sent = source(&dev, 1, n * chunk);
    let dst = Arc::new(HostMem::new("dst", sent.total).unwrap());
    let wire = LoopWire::new(dst.clone(), sent.bases.clone(), t, log.clone());
    let ring = StagingRing::new(&dev, 2, chunk).unwrap();
    let l2 = log.clone();
    StageOut::new(dev.stream().unwrap(), ring, sent.ranges, WAIT).unwrap().run(|c| wire.post(c), |e| l2.push(Entry::Out(e))).unwrap();
    drop(wire);
    check_received(&dst, 1, n * chunk);
    // Pipelined: chunk i+1's copy starts before chunk i leaves the wire
    // (sequential staging would start it only after).
    for i in 0..(n as usize - 1) {
        let next_copy = log.pos(Entry::Dev(DeviceTrace::CopyStart { id: i as u64 + 1, op: "copy_d2h" }));
        assert!(next_copy < log.pos(Entry::WireEnd(i)), "chunk {} was copied only after chunk {i} left the wire: {:?}", i + 1, log.entries());
    }
}

#[test]
fn stage_out_fails_on_a_failed_copy_and_never_releases_its_source() {
    let log = Log::default();
    let dev = HostDevice::new(0).fail_copy(2).with_tracer(log.tracer());
    let (layer_len, chunk) = (2 * 4096u64, 4096u64);
    let sent = source(&dev, 2, layer_len);
    let dst = Arc::new(HostMem::new("dst", sent.total).unwrap());
    let wire = LoopWire::new(dst, sent.bases.clone(), Duration::ZERO, log.clone());
    let ring = StagingRing::new(&dev, 2, chunk).unwrap();
    let l2 = log.clone();
    let err = StageOut::new(dev.stream().unwrap(), ring, sent.ranges, WAIT).unwrap().run(|c| wire.post(c), |e| l2.push(Entry::Out(e))).unwrap_err();
    match &err {
        DeviceError::Chunk { chunk: 2, layer: 1, source } => {
            assert!(matches!(**source, DeviceError::CopyFailed { op: "copy_d2h", len: 4096, .. }), "{source:?}")
        }
        e => panic!("expected chunk 2 of layer 1 to fail its copy, got {e:?}"),
    }
    assert!(err.to_string().starts_with("chunk 2 of layer 1: copy_d2h of 4096 bytes failed"), "{err}");
    let entries = log.entries();
    assert!(!entries.contains(&Entry::Out(StageOutEvent::Posted { chunk: 2 })));
    assert!(!entries.contains(&Entry::Out(StageOutEvent::SourceReleased { range: 1, layer: 1 })));
}

/// Received chunks of `layers` layers, `per_layer` chunks each, in a host buffer.
fn received(layers: u32, layer_len: u64) -> Arc<HostMem> {
    let host = Arc::new(HostMem::new("received", u64::from(layers) * layer_len).unwrap());
    for l in 0..layers {
        host.write(u64::from(l) * layer_len, &layer_bytes(l, layer_len)).unwrap();
    }
    host
}

#[test]
fn stage_in_reports_device_complete_only_after_every_copy_of_the_layer_landed() {
    let log = Log::default();
    let dev = HostDevice::new(0).with_delay(Duration::from_millis(3)).with_tracer(log.tracer());
    let (layers, layer_len, chunk) = (2u32, 3 * 4096u64, 4096u64);
    let host = received(layers, layer_len);
    let devmem = dev.alloc(u64::from(layers) * layer_len).unwrap();
    let dsts = (0..layers).map(|l| LayerDst { layer: l, mem: devmem.clone(), offset: u64::from(l) * layer_len, len: layer_len }).collect();
    let hops = Arc::new(Hops::default());
    let mut sin = StageIn::new(dev.stream().unwrap(), dsts).unwrap().with_hops(hops.clone());
    // Layer 0 gets two of its three chunks, layer 1 all three.
    let mut receipts = Vec::new();
    for (l, k) in [(0u32, 0u64), (1, 0), (0, 1), (1, 1), (1, 2)] {
        receipts.push(sin.receive(l, &host, u64::from(l) * layer_len + k * chunk, k * chunk, chunk).unwrap());
    }
    let mut complete = Vec::new();
    let mut released = 0;
    let check_layer = |l: u32| {
        let mut got = vec![0u8; layer_len as usize];
        dev.read(&devmem, u64::from(l) * layer_len, &mut got).unwrap();
        assert!(got == layer_bytes(l, layer_len), "layer {l} reported device_complete before its bytes were in device memory");
    };
    while released < receipts.len() {
        for e in sin.wait(WAIT).unwrap() {
            match e {
                StageInEvent::HostReleased { .. } => released += 1,
                StageInEvent::DeviceComplete { layer, .. } => {
                    check_layer(layer);
                    complete.push(layer);
                }
            }
        }
    }
    assert_eq!(complete, vec![1], "layer 0 is missing a chunk and must not be device_complete");
    assert!(!sin.all_complete());
    // Overfilling is refused; the last chunk completes layer 0.
    assert!(matches!(sin.receive(0, &host, 0, 0, 3 * chunk), Err(DeviceError::Invalid(_))));
    sin.receive(0, &host, 2 * chunk, 2 * chunk, chunk).unwrap();
    while !sin.all_complete() {
        for e in sin.wait(WAIT).unwrap() {
            if let StageInEvent::DeviceComplete { layer, .. } = e {
                check_layer(layer);
                complete.push(layer);
            }
        }
    }
    assert_eq!(complete, vec![1, 0]);
    assert_eq!(hops.summary(Hop::DeviceComplete).count, 2);
    assert_eq!(hops.summary(Hop::DeviceComplete).bytes, 2 * layer_len);
    assert_eq!(hops.summary(Hop::Place).count, 0, "device_complete has its own histogram, not place's");
    // Every copy ended (in the stand-in's own trace) before its layer was reported.
    let ends = log.entries().iter().filter(|e| matches!(e, Entry::Dev(DeviceTrace::CopyEnd { failed: false, .. }))).count();
    assert_eq!(ends, 6);
}

#[test]
fn stage_in_fails_on_a_failed_copy_and_never_reports_device_complete() {
    let dev = HostDevice::new(0).fail_copy(1);
    let (layer_len, chunk) = (2 * 4096u64, 4096u64);
    let host = received(1, layer_len);
    let devmem = dev.alloc(layer_len).unwrap();
    let mut sin = StageIn::new(dev.stream().unwrap(), vec![LayerDst { layer: 7, mem: devmem, offset: 0, len: layer_len }]).unwrap();
    sin.receive(7, &host, 0, 0, chunk).unwrap();
    sin.receive(7, &host, chunk, chunk, chunk).unwrap();
    let mut seen = Vec::new();
    let err = loop {
        match sin.wait(WAIT) {
            Ok(evs) => seen.extend(evs),
            Err(e) => break e,
        }
    };
    assert!(!seen.iter().any(|e| matches!(e, StageInEvent::DeviceComplete { .. })), "{seen:?}");
    match &err {
        DeviceError::Layer { layer: 7, source } => assert!(matches!(**source, DeviceError::CopyFailed { op: "copy_h2d", .. }), "{source:?}"),
        e => panic!("expected layer 7's copy to fail, got {e:?}"),
    }
    assert_eq!(sin.poll().unwrap_err(), err, "a failed StageIn stays failed");
    assert_eq!(sin.receive(7, &host, 0, 0, chunk).unwrap_err(), err);
    assert!(!sin.all_complete());
}

#[test]
fn host_stream_event_completes_only_after_prior_copies() {
    // The stand-in itself: an enqueued copy has not happened yet; the event after it has.
    let dev = HostDevice::new(0).with_delay(Duration::from_millis(20));
    let mem = dev.alloc(4096).unwrap();
    dev.write(&mem, 0, &[7u8; 4096]).unwrap();
    let host = Arc::new(HostMem::new("h", 4096).unwrap());
    let s = dev.stream().unwrap();
    s.copy_d2h(&mem, 0, &host, 0, 4096).unwrap();
    let ev = s.record().unwrap();
    if !ev.query().unwrap() {
        let mut b = [0u8; 1];
        host.read(0, &mut b).unwrap();
        // Either still zero, or the copy raced ahead — then the event must complete.
        assert!(b[0] == 0 || ev.synchronize(WAIT).is_ok());
    }
    ev.synchronize(WAIT).unwrap();
    let mut all = vec![0u8; 4096];
    host.read(0, &mut all).unwrap();
    assert!(all.iter().all(|&b| b == 7));
    assert!(matches!(s.copy_d2h(&mem, 4000, &host, 0, 200), Err(DeviceError::OutOfBounds { offset: 4000, len: 200, size: 4096 })));
}

#[test]
fn no_cuda_driver_is_a_clear_error() {
    match probe_cuda() {
        Ok(()) => kvwire_testkit::skip("no_cuda_driver_is_a_clear_error", kvwire_testkit::Need::NoGpu, "a CUDA driver is present on this host"),
        Err(e @ DeviceError::NoDriver(_)) if cfg!(feature = "cuda") => {
            assert!(e.to_string().starts_with("no CUDA driver: "), "{e}");
            #[cfg(feature = "cuda")]
            assert_eq!(kvwire_transport::device::cuda::CudaDevice::open(0).unwrap_err(), e);
        }
        Err(e @ DeviceError::NotBuilt(_)) if !cfg!(feature = "cuda") => {
            assert!(e.to_string().contains("`cuda` feature"), "{e}");
        }
        Err(e) => panic!("probing CUDA gave an unclear error: {e:?}"),
    }
}

/// Bytes and seconds of one staged round trip.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the seconds are printed by the GPU run
struct RoundTrip {
    bytes: u64,
    out_s: f64,
    in_s: f64,
}

/// Device → staging → loopback wire → host → device, then compares the
/// destination device bytes with the source.
fn round_trip<D: Device>(dev: &D, layers: u32, layer_len: u64, chunk: u64, slots: usize) -> RoundTrip {
    let sent = source(dev, layers, layer_len);
    let recv = Arc::new(HostMem::new("received", sent.total).unwrap());
    let _recv_pin = dev.pin(&recv).unwrap();
    let log = Log::default();
    let wire = LoopWire::new(recv.clone(), sent.bases.clone(), Duration::ZERO, log);
    let ring = StagingRing::new(dev, slots, chunk).unwrap();
    let t0 = Instant::now();
    let report = StageOut::new(dev.stream().unwrap(), ring, sent.ranges, WAIT).unwrap().run(|c| wire.post(c), |_| {}).unwrap();
    let out_s = t0.elapsed().as_secs_f64();
    assert_eq!(report.bytes, sent.total);
    drop(wire);

    let dst = dev.alloc(sent.total).unwrap();
    let dsts = (0..layers).map(|l| LayerDst { layer: l, mem: dst.clone(), offset: u64::from(l) * layer_len, len: layer_len }).collect();
    let mut sin = StageIn::new(dev.stream().unwrap(), dsts).unwrap();
    let t1 = Instant::now();
    for l in 0..layers {
        let mut off = 0;
        while off < layer_len {
            let len = chunk.min(layer_len - off);
            sin.receive(l, &recv, u64::from(l) * layer_len + off, off, len).unwrap();
            off += len;
        }
    }
    while !sin.all_complete() {
        sin.wait(WAIT).unwrap();
    }
    let in_s = t1.elapsed().as_secs_f64();
    for l in 0..layers {
        let mut got = vec![0u8; layer_len as usize];
        dev.read(&dst, u64::from(l) * layer_len, &mut got).unwrap();
        assert!(got == layer_bytes(l, layer_len), "layer {l}: destination device bytes differ from the source");
    }
    RoundTrip { bytes: sent.total, out_s, in_s }
}

#[test]
fn host_stand_in_round_trip_reconstructs_the_source() {
    let dev = HostDevice::new(0);
    let rt = round_trip(&dev, 3, 100_000, 16 * 1024, 3);
    assert_eq!(rt.bytes, 300_000);
}

/// The real GPU: runs only with `--features cuda`, `KVWIRE_GPU=1` and a
/// driver that opens; otherwise says why it is skipped (and with
/// `KVWIRE_GPU=1`, a driver that does not open fails the test).
#[test]
fn gpu_staging_round_trip_and_bandwidth() {
    const NAME: &str = "gpu_staging_round_trip_and_bandwidth";
    if std::env::var("KVWIRE_GPU").as_deref() != Ok("1") {
        kvwire_testkit::skip(NAME, kvwire_testkit::Need::Gpu, "KVWIRE_GPU=1 is not set (scripts/gpu-check sets it)");
        return;
    }
    #[cfg(not(feature = "cuda"))]
    panic!("KVWIRE_GPU=1 but {NAME} was built without `--features cuda`");
    #[cfg(feature = "cuda")]
    gpu::round_trip_and_bandwidth();
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use kvwire_transport::device::cuda::CudaDevice;

    pub fn round_trip_and_bandwidth() {
        let dev = CudaDevice::open(0).unwrap_or_else(|e| panic!("KVWIRE_GPU=1 but the CUDA device does not open: {e}"));
        eprintln!("GPU 0 at PCI {}", dev.pci_bus_id().unwrap_or("?"));
        let (layers, layer_len, chunk, slots) = (4u32, 64u64 << 20, 8u64 << 20, 4usize);
        let rt = round_trip(&dev, layers, layer_len, chunk, slots);
        let gb = rt.bytes as f64 / 1e9;

        // Baseline: synchronous cuMemcpyDtoH/HtoD of the same size, pinned host memory, same run.
        let src = dev.alloc(rt.bytes).unwrap();
        let host = Arc::new(HostMem::new("baseline", rt.bytes).unwrap());
        let _pin = dev.pin(&host).unwrap();
        dev.copy_h2d_sync(&host, 0, &src, 0, rt.bytes).unwrap(); // warm-up
        let t = Instant::now();
        dev.copy_d2h_sync(&src, 0, &host, 0, rt.bytes).unwrap();
        let d2h_sync = t.elapsed().as_secs_f64();
        let t = Instant::now();
        dev.copy_h2d_sync(&host, 0, &src, 0, rt.bytes).unwrap();
        let h2d_sync = t.elapsed().as_secs_f64();

        println!(
            "D2H staged (chunk {} MiB × {slots} slots, loopback memcpy wire): {:.2} GB/s; cuMemcpyDtoH: {:.2} GB/s; ratio {:.2}",
            chunk >> 20,
            gb / rt.out_s,
            gb / d2h_sync,
            d2h_sync / rt.out_s
        );
        println!("H2D staged (chunk {} MiB): {:.2} GB/s; cuMemcpyHtoD: {:.2} GB/s; ratio {:.2}", chunk >> 20, gb / rt.in_s, gb / h2d_sync, h2d_sync / rt.in_s);
    }
}

/// A client's allocation as the stand-in plays it: a memfd holding
/// `pattern(9, i)`, and the handle that passes a duplicate of its fd.
fn client_alloc(len: u64) -> (HostMem, DeviceHandle) {
    let mem = HostMem::new("client-device", len).unwrap();
    mem.write(0, &layer_bytes(9, len)).unwrap();
    let fd = std::fs::File::from(mem.fd().try_clone_to_owned().unwrap());
    (mem, DeviceHandle { ordinal: 0, len, fd: Some(fd), ipc: None })
}

fn contents(mem: &HostMem) -> Vec<u8> {
    let mut v = vec![0u8; mem.len() as usize];
    mem.read(0, &mut v).unwrap();
    v
}

fn bound_contents(b: &dyn BoundMem) -> Vec<u8> {
    let mut v = vec![0u8; b.len() as usize];
    b.read(0, &mut v).unwrap();
    v
}

/// Applies `runs` = (device offset, host offset, len) to plain vectors: the reference model.
fn apply(runs: &[(u64, u64, u64)], dev: &mut [u8], host: &mut [u8], d2h: bool) {
    for &(d, h, n) in runs {
        let (d, h, n) = (d as usize, h as usize, n as usize);
        if d2h {
            host[h..h + n].copy_from_slice(&dev[d..d + n]);
        } else {
            dev[d..d + n].copy_from_slice(&host[h..h + n]);
        }
    }
}

#[test]
fn bound_mem_moves_exactly_the_scattered_runs_both_ways() {
    let backend = Backend::open("host", 0).unwrap();
    assert_eq!(backend.kind(), "host");
    let (client, h) = client_alloc(65_536);
    let bound = backend.import(h).unwrap();
    assert_eq!((bound.len(), bound.ordinal(), bound.pci_bus_id()), (65_536, 0, None));
    let mirror = Arc::new(HostMem::new("mirror", 32_768).unwrap());
    let _pin = backend.pin(&mirror).unwrap();
    let mut dev = layer_bytes(9, 65_536);
    let mut host = vec![0u8; 32_768];

    // The last run ends exactly at the end of the allocation.
    let out = [(100, 0, 1000), (40_000, 5000, 3000), (7, 20_000, 1), (65_000, 30_000, 536)];
    bound.d2h(&out, &mirror).unwrap().wait(WAIT).unwrap();
    apply(&out, &mut dev, &mut host, true);
    assert!(contents(&mirror) == host, "host mirror differs from the runs copied out");

    let back = [(50_000, 0, 1000), (1, 5000, 3000), (60_000, 20_000, 1)];
    let ev = bound.h2d(&back, &mirror).unwrap();
    ev.wait(WAIT).unwrap();
    assert!(ev.query().unwrap());
    apply(&back, &mut dev, &mut host, false);
    // Through the daemon's mapping, and through the client's own: the same pages.
    assert!(bound_contents(&*bound) == dev, "device bytes differ from the runs copied in");
    assert!(contents(&client) == dev, "the client does not see the bytes copied into its allocation");
}

#[test]
fn bound_mem_refuses_an_out_of_bounds_run_before_enqueuing_any() {
    let backend = Backend::open("host", 0).unwrap();
    let (_client, h) = client_alloc(65_536);
    let bound = backend.import(h).unwrap();
    let mirror = Arc::new(HostMem::new("mirror", 4096).unwrap());

    // Each list starts with a valid run: had it been enqueued, it would run before the next event.
    let dev_oob = DeviceError::OutOfBounds { offset: 65_500, len: 100, size: 65_536 };
    assert_eq!(bound.d2h(&[(0, 0, 100), (65_500, 200, 100)], &mirror).unwrap_err(), dev_oob);
    let host_oob = DeviceError::Mem(MemError::OutOfBounds { offset: 4000, len: 100, size: 4096 });
    assert_eq!(bound.d2h(&[(0, 0, 100), (200, 4000, 100)], &mirror).unwrap_err(), host_oob);
    let wrap = DeviceError::OutOfBounds { offset: u64::MAX, len: 2, size: 65_536 };
    assert_eq!(bound.d2h(&[(0, 0, 100), (u64::MAX, 0, 2)], &mirror).unwrap_err(), wrap);
    bound.d2h(&[(1000, 1000, 10)], &mirror).unwrap().wait(WAIT).unwrap();
    let mut want = vec![0u8; 4096];
    want[1000..1010].copy_from_slice(&layer_bytes(9, 1010)[1000..]);
    assert!(contents(&mirror) == want, "a refused d2h moved bytes");

    let src = Arc::new(HostMem::new("src", 4096).unwrap());
    src.write(0, &[0xab; 4096]).unwrap();
    let dev_oob = DeviceError::OutOfBounds { offset: 65_536, len: 1, size: 65_536 };
    assert_eq!(bound.h2d(&[(0, 0, 100), (65_536, 0, 1)], &src).unwrap_err(), dev_oob);
    let host_oob = DeviceError::Mem(MemError::OutOfBounds { offset: 4090, len: 10, size: 4096 });
    assert_eq!(bound.h2d(&[(0, 0, 100), (100, 4090, 10)], &src).unwrap_err(), host_oob);
    bound.h2d(&[(2000, 0, 1)], &src).unwrap().wait(WAIT).unwrap();
    let mut want = layer_bytes(9, 65_536);
    want[2000] = 0xab;
    assert!(bound_contents(&*bound) == want, "a refused h2d moved bytes");

    // Device → host into a mirror this process maps read-only.
    let ro = HostMem::new("ro", 4096).unwrap();
    let ro = Arc::new(HostMem::from_file_read_only(std::fs::File::from(ro.fd().try_clone_to_owned().unwrap())).unwrap());
    assert_eq!(bound.d2h(&[(0, 0, 1)], &ro).unwrap_err(), DeviceError::Mem(MemError::ReadOnly));
}

#[test]
fn bound_import_refuses_a_handle_that_does_not_fit() {
    let backend = Backend::open("host", 0).unwrap();
    let invalid = |h: DeviceHandle| match backend.import(h) {
        Err(DeviceError::Invalid(m)) => m,
        other => panic!("expected an invalid handle, got {other:?}"),
    };

    let (_c, mut h) = client_alloc(4096);
    h.len = 8192;
    assert_eq!(invalid(h), "handle says 8192 bytes but its memfd has 4096");
    let (_c, mut h) = client_alloc(4096);
    h.fd = None;
    assert_eq!(invalid(h), "the host stand-in needs the memfd that plays the device memory, and the handle has no fd");
    let (_c, mut h) = client_alloc(4096);
    h.ordinal = 1;
    assert_eq!(invalid(h), "handle is for device 1 but this host backend is device 0");
    let (_c, h) = client_alloc(4096);
    let other = Backend::open("host", 3).unwrap();
    assert_eq!(other.import(h).unwrap_err(), DeviceError::Invalid("handle is for device 0 but this host backend is device 3".into()));
    let (_c, mut h) = client_alloc(4096);
    h.len = 0;
    assert_eq!(invalid(h), "handle has a length of 0 bytes");

    // A file that cannot be sealed against shrinking is not mapped.
    let h = DeviceHandle { ordinal: 0, len: 4096, fd: Some(std::fs::File::open("/dev/null").unwrap()), ipc: None };
    assert!(matches!(backend.import(h), Err(DeviceError::Mem(MemError::Unsealed { .. }))));
}

#[test]
fn backend_open_names_what_is_missing() {
    match probe_cuda() {
        Ok(()) => kvwire_testkit::skip(
            "backend_open_names_what_is_missing (its no-driver half)",
            kvwire_testkit::Need::NoGpu,
            "a CUDA driver is present",
        ),
        // The same reason the probe gives: NotBuilt without the feature, NoDriver without a driver.
        Err(e) => assert_eq!(Backend::open("cuda", 0).unwrap_err(), e),
    }
    let e = Backend::open("tpu", 0).unwrap_err();
    assert_eq!(e, DeviceError::Invalid("unknown device backend \"tpu\": expected \"host\" or \"cuda\"".into()));
}

/// Holds the stand-in's copies at their start until opened.
#[derive(Debug, Clone, Default)]
struct Gate(Arc<(Mutex<bool>, Condvar)>);

impl Gate {
    fn open(&self) {
        *self.0 .0.lock().unwrap() = true;
        self.0 .1.notify_all();
    }
    fn pass(&self) {
        let g = self.0 .0.lock().unwrap();
        drop(self.0 .1.wait_while(g, |open| !*open).unwrap());
    }
}

/// Opens the gate on drop, so a failing test does not leave a worker (and the stream's drop) blocked.
struct OpenOnDrop(Gate);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.open();
    }
}

#[test]
fn bound_event_completes_only_after_every_copy_ran() {
    let (log, gate) = (Log::default(), Gate::default());
    let (l, g) = (log.clone(), gate.clone());
    let tracer: kvwire_transport::device::host::Tracer = Arc::new(move |t| {
        l.push(Entry::Dev(t));
        if matches!(t, DeviceTrace::CopyStart { .. }) {
            g.pass();
        }
    });
    let backend = Backend::Host(HostDevice::new(0).with_tracer(tracer));
    let (_client, h) = client_alloc(8192);
    let bound = backend.import(h).unwrap();
    let mirror = Arc::new(HostMem::new("mirror", 8192).unwrap());
    let _open = OpenOnDrop(gate.clone());

    let runs = [(0, 4096, 100), (5000, 0, 2000), (8191, 8191, 1)];
    let ev = bound.d2h(&runs, &mirror).unwrap();
    // The worker is held at the start of the first copy.
    assert!(!ev.query().unwrap());
    assert!(matches!(ev.wait(Duration::from_millis(20)), Err(DeviceError::Timeout { .. })));
    assert!(contents(&mirror).iter().all(|&b| b == 0), "bytes moved before the copies ran");
    gate.open();
    ev.wait(WAIT).unwrap();
    let (mut dev, mut host) = (layer_bytes(9, 8192), vec![0u8; 8192]);
    apply(&runs, &mut dev, &mut host, true);
    assert!(contents(&mirror) == host);
    // Two events: one the stream reaches before the copies (their start,
    // for the backend's timing), one after them all (what is awaited).
    let entries = log.entries();
    let events: Vec<usize> = (0..entries.len()).filter(|&i| entries[i] == Entry::Dev(DeviceTrace::EventComplete)).collect();
    assert_eq!(events.len(), 2, "{entries:?}");
    for id in 0..3 {
        let end = log.pos(Entry::Dev(DeviceTrace::CopyEnd { id, failed: false }));
        assert!(events[0] < end && end < events[1], "copy {id} ran outside its events: {entries:?}");
    }
}

#[test]
fn bound_event_reports_a_failed_copy_never_completion() {
    let backend = Backend::Host(HostDevice::new(0).fail_copy(1));
    let (_client, h) = client_alloc(8192);
    let bound = backend.import(h).unwrap();
    let mirror = Arc::new(HostMem::new("mirror", 8192).unwrap());
    let ev = bound.d2h(&[(0, 0, 10), (10, 10, 10), (20, 20, 10)], &mirror).unwrap();
    let e = ev.wait(WAIT).unwrap_err();
    assert_eq!(e, DeviceError::CopyFailed { op: "copy_d2h", len: 10, message: "injected failure of copy 1".into() });
    assert_eq!(ev.query().unwrap_err(), e);
    // Poisoned: a later event on the same stream reports it too.
    assert_eq!(bound.d2h(&[(0, 0, 1)], &mirror).unwrap().wait(WAIT).unwrap_err(), e);
}
