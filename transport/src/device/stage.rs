//! Staging schedulers for device-resident caches without GPUDirect.
//!
//! Source ([`StageOut`]): device ranges are cut into chunks; each chunk is
//! copied device → pinned host into a slot of a [`StagingRing`] on a
//! stream, and handed to the wire only once the copy's event completed.
//! While chunk i is on the wire, the copy of chunk i+1 runs. A slot is
//! reused only after the wire completion of the chunk that used it, and a
//! device range is `source_released` only when every chunk of it completed
//! on the wire.
//!
//! Destination ([`StageIn`]): every received host chunk is copied host →
//! device on a stream; a layer is `device_complete` only when it received
//! all its bytes (counted, not assumed) and every one of its copies' events
//! completed. Only then may `layer_ready(L)` be published for a
//! device-resident cache.
//!
//! Both record their hop: [`Hop::Stage`] (D2H enqueue → event seen
//! complete) and [`Hop::DeviceComplete`] (a layer's first H2D enqueue → its
//! last event seen complete).

use super::{Device, DeviceError, DeviceMem, Event, Stream};
use crate::mem::HostMem;
use crate::metrics::{Hop, Hops};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long one blocking wait inside the pump lasts before it polls the
/// other side again.
const SLICE: Duration = Duration::from_micros(50);

/// K pinned host slots of `chunk` bytes each, in one host allocation.
#[derive(Debug)]
pub struct StagingRing<P> {
    // Field order is drop order: unpin before the memory can go.
    _pin: P,
    mem: Arc<HostMem>,
    chunk: u64,
    slots: usize,
}

impl<P> StagingRing<P> {
    /// Allocates `slots × chunk` bytes of host memory and pins them with `dev`.
    pub fn new<D: Device<Pinned = P>>(dev: &D, slots: usize, chunk: u64) -> Result<StagingRing<P>, DeviceError> {
        if slots == 0 || chunk == 0 {
            return Err(DeviceError::Invalid(format!("staging ring of {slots} slots × {chunk} bytes")));
        }
        let total = chunk.checked_mul(slots as u64).ok_or_else(|| DeviceError::Invalid("staging ring size overflows".into()))?;
        let mem = Arc::new(HostMem::new("kvwire-staging", total)?);
        let pin = dev.pin(&mem)?;
        Ok(StagingRing { _pin: pin, mem, chunk, slots })
    }

    /// The host memory behind the slots (to register with the wire).
    pub fn mem(&self) -> &Arc<HostMem> {
        &self.mem
    }

    /// Bytes per slot.
    pub fn chunk(&self) -> u64 {
        self.chunk
    }

    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.slots
    }
}

/// A device range to send: part (or all) of one layer.
#[derive(Debug)]
pub struct SourceRange<M> {
    /// Layer the bytes belong to.
    pub layer: u32,
    /// Device memory holding them.
    pub mem: Arc<M>,
    /// Offset in `mem`.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// A chunk in host staging, ready for the wire.
#[derive(Debug, Clone)]
pub struct StagedChunk {
    /// Chunk number, in send order, from 0.
    pub index: usize,
    /// Index of its [`SourceRange`].
    pub range: usize,
    /// Its layer.
    pub layer: u32,
    /// Offset of the chunk inside its source range (where it goes in the
    /// destination's copy of that range).
    pub range_offset: u64,
    /// The staging memory (the wire keeps it alive while it reads).
    pub staging: Arc<HostMem>,
    /// Offset of the chunk in `staging`.
    pub staging_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// The wire's completion of one posted chunk.
pub trait WireHandle {
    /// Whether the chunk completed on the wire (its staging bytes are no
    /// longer read). Err when the wire failed it.
    fn poll(&mut self) -> Result<bool, DeviceError>;
    /// Waits up to `timeout` for completion; Ok(false) when it did not come.
    fn wait(&mut self, timeout: Duration) -> Result<bool, DeviceError>;
}

/// What [`StageOut`] did, in order (for logs and tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StageOutEvent {
    /// The device → host copy of a chunk was enqueued into a slot.
    D2hEnqueued {
        /// Chunk.
        chunk: usize,
        /// Staging slot.
        slot: usize,
    },
    /// That copy's event was seen complete: the staging bytes are valid.
    D2hComplete {
        /// Chunk.
        chunk: usize,
    },
    /// The chunk was handed to the wire.
    Posted {
        /// Chunk.
        chunk: usize,
    },
    /// The wire completed the chunk: its slot is free again.
    WireComplete {
        /// Chunk.
        chunk: usize,
        /// The slot freed.
        slot: usize,
    },
    /// Every chunk of a source range completed on the wire: the engine may
    /// overwrite that device range (`source_released`).
    SourceReleased {
        /// Index of the range.
        range: usize,
        /// Its layer.
        layer: u32,
    },
}

/// What a finished [`StageOut`] moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StageOutReport {
    /// Chunks sent.
    pub chunks: usize,
    /// Bytes sent.
    pub bytes: u64,
}

#[derive(Debug, Clone, Copy)]
struct Plan {
    range: usize,
    layer: u32,
    range_offset: u64,
    len: u64,
}

fn chunk_error(chunk: usize, layer: u32, e: DeviceError) -> DeviceError {
    DeviceError::Chunk { chunk, layer, source: Box::new(e) }
}

/// The source side's staging scheduler. See the module docs.
#[derive(Debug)]
pub struct StageOut<S: Stream, P> {
    // Field order: the stream (which waits for its copies) goes before the ring.
    stream: S,
    ring: StagingRing<P>,
    ranges: Vec<SourceRange<S::Mem>>,
    hops: Option<Arc<Hops>>,
    timeout: Duration,
}

impl<S: Stream, P> StageOut<S, P> {
    /// A scheduler copying `ranges` through `ring` on `stream`. `timeout`
    /// bounds how long it waits without any progress.
    pub fn new(stream: S, ring: StagingRing<P>, ranges: Vec<SourceRange<S::Mem>>, timeout: Duration) -> Result<StageOut<S, P>, DeviceError> {
        for (i, r) in ranges.iter().enumerate() {
            if r.len == 0 {
                return Err(DeviceError::Invalid(format!("source range {i} (layer {}) is empty", r.layer)));
            }
            r.mem.check(r.offset, r.len)?;
        }
        Ok(StageOut { stream, ring, ranges, hops: None, timeout })
    }

    /// Records `stage` into `hops`.
    pub fn with_hops(mut self, hops: Arc<Hops>) -> Self {
        self.hops = Some(hops);
        self
    }

    /// Runs the pipeline to the end. `post` hands a staged chunk to the
    /// wire and returns its completion; `on_event` sees every step.
    ///
    /// On return, Ok or Err, the stream was dropped, which waits for its
    /// copies: nothing reads the device ranges any more. On Err the ranges
    /// not reported `SourceReleased` were not fully sent.
    pub fn run<W, F, E>(self, mut post: F, mut on_event: E) -> Result<StageOutReport, DeviceError>
    where
        W: WireHandle,
        F: FnMut(&StagedChunk) -> Result<W, DeviceError>,
        E: FnMut(StageOutEvent),
    {
        let StageOut { stream, ring, ranges, hops, timeout } = self;
        let chunk = ring.chunk;
        let plans: Vec<Plan> = ranges
            .iter()
            .enumerate()
            .flat_map(|(i, r)| {
                let n = r.len.div_ceil(chunk);
                (0..n).map(move |k| Plan { range: i, layer: r.layer, range_offset: k * chunk, len: (r.len - k * chunk).min(chunk) })
            })
            .collect();
        let mut left_in_range: Vec<usize> = vec![0; ranges.len()];
        for p in &plans {
            left_in_range[p.range] += 1;
        }
        let mut free: VecDeque<usize> = (0..ring.slots).collect();
        let mut staging: VecDeque<(usize, usize, S::Event, Instant)> = VecDeque::new();
        let mut wire: Vec<(usize, usize, W)> = Vec::new();
        let (mut next, mut done, mut bytes) = (0usize, 0usize, 0u64);
        let mut last_progress = Instant::now();

        while done < plans.len() {
            let mut progress = false;
            // Enqueue device → host copies into every free slot.
            while next < plans.len() {
                let Some(&slot) = free.front() else { break };
                let p = plans[next];
                let r = &ranges[p.range];
                let enqueued = Instant::now();
                stream
                    .copy_d2h(&r.mem, r.offset + p.range_offset, &ring.mem, slot as u64 * chunk, p.len)
                    .and_then(|()| stream.record())
                    .map(|ev| staging.push_back((next, slot, ev, enqueued)))
                    .map_err(|e| chunk_error(next, p.layer, e))?;
                free.pop_front();
                on_event(StageOutEvent::D2hEnqueued { chunk: next, slot });
                next += 1;
                progress = true;
            }
            // Post, in order, every chunk whose copy completed.
            while let Some((c, slot, ev, enqueued)) = staging.front() {
                let (c, slot) = (*c, *slot);
                let p = plans[c];
                if !ev.query().map_err(|e| chunk_error(c, p.layer, e))? {
                    break;
                }
                if let Some(h) = &hops {
                    h.record(Hop::Stage, enqueued.elapsed(), p.len);
                }
                staging.pop_front();
                on_event(StageOutEvent::D2hComplete { chunk: c });
                let staged = StagedChunk {
                    index: c,
                    range: p.range,
                    layer: p.layer,
                    range_offset: p.range_offset,
                    staging: ring.mem.clone(),
                    staging_offset: slot as u64 * chunk,
                    len: p.len,
                };
                let handle = post(&staged).map_err(|e| chunk_error(c, p.layer, e))?;
                on_event(StageOutEvent::Posted { chunk: c });
                wire.push((c, slot, handle));
                progress = true;
            }
            // Collect wire completions (in any order).
            let mut i = 0;
            while i < wire.len() {
                let (c, slot, h) = &mut wire[i];
                let (c, slot) = (*c, *slot);
                let p = plans[c];
                if !h.poll().map_err(|e| chunk_error(c, p.layer, e))? {
                    i += 1;
                    continue;
                }
                wire.swap_remove(i);
                free.push_back(slot);
                on_event(StageOutEvent::WireComplete { chunk: c, slot });
                left_in_range[p.range] -= 1;
                if left_in_range[p.range] == 0 {
                    on_event(StageOutEvent::SourceReleased { range: p.range, layer: p.layer });
                }
                done += 1;
                bytes += p.len;
                progress = true;
            }
            if progress {
                last_progress = Instant::now();
                continue;
            }
            if last_progress.elapsed() > timeout {
                let what = match (staging.front(), wire.first()) {
                    (Some((c, ..)), _) => format!("the device → host copy of chunk {c}"),
                    (None, Some((c, ..))) => format!("the wire completion of chunk {c}"),
                    (None, None) => "nothing (scheduler stalled)".into(),
                };
                return Err(DeviceError::Timeout { what, after: timeout });
            }
            // Block briefly on the oldest outstanding work, then poll all again.
            if let Some((c, _, ev, _)) = staging.front() {
                if wire.is_empty() {
                    match ev.synchronize(SLICE) {
                        Ok(()) | Err(DeviceError::Timeout { .. }) => {}
                        Err(e) => return Err(chunk_error(*c, plans[*c].layer, e)),
                    }
                    continue;
                }
            }
            if let Some((c, _, h)) = wire.first_mut() {
                let c = *c;
                h.wait(SLICE).map_err(|e| chunk_error(c, plans[c].layer, e))?;
            }
        }
        drop(stream);
        Ok(StageOutReport { chunks: plans.len(), bytes })
    }
}

/// A destination layer in device memory.
#[derive(Debug)]
pub struct LayerDst<M> {
    /// The layer.
    pub layer: u32,
    /// Device memory that receives it.
    pub mem: Arc<M>,
    /// Offset of the layer in `mem`.
    pub offset: u64,
    /// Bytes the layer must receive.
    pub len: u64,
}

/// Identifies one received chunk handed to [`StageIn::receive`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Receipt(pub u64);

/// What [`StageIn`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StageInEvent {
    /// The host → device copy of a received chunk completed: its host
    /// buffer may be reused.
    HostReleased {
        /// The chunk.
        receipt: Receipt,
    },
    /// Every byte of the layer is in device memory (`device_complete`):
    /// `layer_ready(L)` may now be published.
    DeviceComplete {
        /// The layer.
        layer: u32,
        /// First host → device enqueue of the layer → last copy seen complete.
        took: Duration,
    },
}

#[derive(Debug)]
struct LayerState {
    received: u64,
    outstanding: usize,
    first: Option<Instant>,
    complete: bool,
}

/// The destination side's staging scheduler. See the module docs.
#[derive(Debug)]
pub struct StageIn<S: Stream> {
    stream: S,
    layers: Vec<LayerDst<S::Mem>>,
    state: Vec<LayerState>,
    pending: VecDeque<(Receipt, usize, S::Event)>,
    next: u64,
    hops: Option<Arc<Hops>>,
    failed: Option<DeviceError>,
}

impl<S: Stream> StageIn<S> {
    /// A scheduler copying received chunks into `layers` on `stream`.
    pub fn new(stream: S, layers: Vec<LayerDst<S::Mem>>) -> Result<StageIn<S>, DeviceError> {
        for l in &layers {
            l.mem.check(l.offset, l.len)?;
            if layers.iter().filter(|o| o.layer == l.layer).count() > 1 {
                return Err(DeviceError::Invalid(format!("layer {} given twice", l.layer)));
            }
        }
        let state = layers.iter().map(|_| LayerState { received: 0, outstanding: 0, first: None, complete: false }).collect();
        Ok(StageIn { stream, layers, state, pending: VecDeque::new(), next: 0, hops: None, failed: None })
    }

    /// Records `device_complete` into `hops`.
    pub fn with_hops(mut self, hops: Arc<Hops>) -> Self {
        self.hops = Some(hops);
        self
    }

    /// The first failure, once there was one: every later call returns it.
    pub fn failed(&self) -> Option<&DeviceError> {
        self.failed.as_ref()
    }

    /// A received chunk: `len` bytes at `host_off` in `host`, which belong
    /// at `layer_off` inside `layer`. Enqueues the host → device copy; the
    /// host buffer must stay untouched until [`StageInEvent::HostReleased`].
    pub fn receive(&mut self, layer: u32, host: &Arc<HostMem>, host_off: u64, layer_off: u64, len: u64) -> Result<Receipt, DeviceError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let li = self.layers.iter().position(|l| l.layer == layer).ok_or_else(|| DeviceError::Invalid(format!("layer {layer} is not expected")))?;
        let l = &self.layers[li];
        let st = &mut self.state[li];
        if len == 0 || layer_off.checked_add(len).is_none_or(|end| end > l.len) {
            return Err(DeviceError::Invalid(format!("{len} bytes at {layer_off} fall outside layer {layer}'s {} bytes", l.len)));
        }
        if st.received + len > l.len {
            return Err(DeviceError::Invalid(format!("layer {layer} would receive {} of its {} bytes", st.received + len, l.len)));
        }
        let enqueued = Instant::now();
        self.stream.copy_h2d(host, host_off, &l.mem, l.offset + layer_off, len)?;
        let ev = self.stream.record()?;
        st.first.get_or_insert(enqueued);
        st.received += len;
        st.outstanding += 1;
        let r = Receipt(self.next);
        self.next += 1;
        self.pending.push_back((r, li, ev));
        Ok(r)
    }

    /// Reports what completed since the last call, without blocking.
    pub fn poll(&mut self) -> Result<Vec<StageInEvent>, DeviceError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let mut out = Vec::new();
        // A stream runs in order: the first incomplete event ends the scan.
        while let Some((r, li, ev)) = self.pending.front() {
            let (r, li) = (*r, *li);
            match ev.query() {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => {
                    let e = DeviceError::Layer { layer: self.layers[li].layer, source: Box::new(e) };
                    self.failed = Some(e.clone());
                    return Err(e);
                }
            }
            self.pending.pop_front();
            out.push(StageInEvent::HostReleased { receipt: r });
            let l = &self.layers[li];
            let st = &mut self.state[li];
            st.outstanding -= 1;
            if st.outstanding == 0 && st.received == l.len && !st.complete {
                st.complete = true;
                let took = st.first.map(|t| t.elapsed()).unwrap_or_default();
                if let Some(h) = &self.hops {
                    h.record(Hop::DeviceComplete, took, l.len);
                }
                out.push(StageInEvent::DeviceComplete { layer: l.layer, took });
            }
        }
        Ok(out)
    }

    /// Like [`StageIn::poll`], but waits up to `timeout` for at least one
    /// event while copies are outstanding.
    pub fn wait(&mut self, timeout: Duration) -> Result<Vec<StageInEvent>, DeviceError> {
        let out = self.poll()?;
        if !out.is_empty() {
            return Ok(out);
        }
        if let Some((_, li, ev)) = self.pending.front() {
            match ev.synchronize(timeout) {
                Ok(()) | Err(DeviceError::Timeout { .. }) => {}
                Err(e) => {
                    let e = DeviceError::Layer { layer: self.layers[*li].layer, source: Box::new(e) };
                    self.failed = Some(e.clone());
                    return Err(e);
                }
            }
        }
        self.poll()
    }

    /// Whether every layer is device_complete.
    pub fn all_complete(&self) -> bool {
        self.state.iter().all(|s| s.complete)
    }
}
