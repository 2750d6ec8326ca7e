//! Device-resident ranks: the copies between a rank's device allocation
//! and the host mirror the data plane reads and writes.

use super::ring::Ring;
use super::state::{DeviceMems, DevicePath, Mirrored, SlotId};
use super::transfers::RankSpan;
use super::Daemon;
use kvwire_core::plan::Plan;
use kvwire_transport::device::bound::{BoundMem, NicMemory};
use kvwire_transport::{Hop, Region, TransportKind};
use std::os::fd::AsFd;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

impl Daemon {
    /// Enqueues the host → device copies of what `plan` writes of one
    /// layer (its segments `segs`), from the destination's host mirrors to
    /// its device-resident ranks; [`Copies::finish`] awaits them by event
    /// (`device_complete`). The caller goes on with the next layer
    /// meanwhile. A source stages through its ring instead
    /// ([`Daemon::start_ring_copies`]).
    pub(super) fn start_device_copies(
        &self,
        plan: &Plan,
        segs: &[usize],
        layer: usize,
        regions: &super::ByRegion<Arc<Region>>,
        devices: &DeviceMems,
    ) -> Result<Copies, CopyError> {
        let mut pending = Vec::new();
        let enqueued = (|| {
            for (&rank, devs) in devices {
                // Per allocation of the rank: its copy runs.
                let mut runs: Vec<Vec<(u64, u64, u64)>> = vec![Vec::new(); devs.len()];
                for &i in segs {
                    let seg = plan.segments.at(i);
                    if seg.dst_rank != rank {
                        continue;
                    }
                    let region = seg.dst_region;
                    let r = regions.get(&(rank, region)).ok_or_else(|| CopyError { rank, layer, why: format!("no region {region:?}") })?;
                    let m = devs.iter().position(|d| Arc::ptr_eq(&d.mirror, &r.mem)).ok_or_else(|| CopyError { rank, layer, why: format!("region {region:?} lies in no mirrored allocation") })?;
                    // The mirror holds the allocation's bytes at the same
                    // offsets. A segment whose runs follow one another at
                    // the destination (a head's rows in an HND block) is
                    // one copy: the sort below then orders copies, not rows.
                    let at = r.offset + seg.dst_offset;
                    match seg.dst_contiguous() {
                        true => runs[m].push((at, at, seg.bytes())),
                        false => runs[m].extend(seg.runs().map(|(_, dof)| (r.offset + dof, r.offset + dof, seg.len))),
                    }
                }
                for (Mirrored { mirror, dev, .. }, runs) in devs.iter().zip(runs) {
                    if runs.is_empty() {
                        continue;
                    }
                    let runs = merge_runs(runs);
                    let bytes = runs.iter().map(|r| r.2).sum::<u64>();
                    let enqueued = Instant::now();
                    let ev = dev.h2d(&runs, mirror).map_err(|e| CopyError { rank, layer, why: e.to_string() })?;
                    pending.push((rank, layer, enqueued, bytes, ev));
                }
            }
            Ok(())
        })();
        if let Err(e) = enqueued {
            // Copies already enqueued still write into device memory: they end first.
            drain(pending, Duration::from_secs(self.cfg.device.copy_timeout_secs));
            return Err(e);
        }
        Ok(Copies { dir: Direction::ToDevice, pending })
    }
}

impl Daemon {
    /// Copies layer `layer`'s source footprint into its slot of `ring`:
    /// device → host copies enqueued on each device-resident allocation's
    /// stream (awaited by [`Copies::finish`]), and a host-resident rank's
    /// bytes copied here and now.
    pub(super) fn start_ring_copies(&self, ring: &Ring, layer: usize) -> Result<Copies, CopyError> {
        let base = ring.region.offset + ring.base(layer);
        let sources = &ring.sources;
        // Per source: its copy's runs (device offset, ring offset, len).
        let mut runs: Vec<Vec<(u64, u64, u64)>> = vec![Vec::new(); sources.len()];
        for e in &ring.layout.layers[layer].extents {
            let src = &sources[e.src];
            match src.dev {
                Some(_) => runs[e.src].push((e.from, base + e.at, e.len)),
                None => src.mem.copy_to(e.from, &ring.region.mem, base + e.at, e.len).map_err(|err| CopyError { rank: src.rank, layer, why: format!("host rank into the ring: {err}") })?,
            }
        }
        let mut pending = Vec::new();
        for (src, runs) in sources.iter().zip(runs) {
            let Some(dev) = src.dev.as_ref().filter(|_| !runs.is_empty()) else { continue };
            let bytes = runs.iter().map(|r| r.2).sum::<u64>();
            let enqueued = Instant::now();
            match dev.d2h(&runs, &ring.region.mem) {
                Ok(ev) => pending.push((src.rank, layer, enqueued, bytes, ev)),
                Err(e) => {
                    // Copies already enqueued still write into the ring: they end first.
                    drain(pending, Duration::from_secs(self.cfg.device.copy_timeout_secs));
                    return Err(CopyError { rank: src.rank, layer, why: e.to_string() });
                }
            }
        }
        Ok(Copies { dir: Direction::ToHost, pending })
    }
}

/// Waits for copies that are no longer wanted, after one failed: they
/// still read or write host memory the caller is about to hand back.
fn drain(pending: impl IntoIterator<Item = Pending>, timeout: Duration) {
    for (.., ev) in pending {
        let _ = ev.wait(timeout);
    }
}

/// One enqueued copy: its rank, layer, enqueue time, bytes, and event.
type Pending = (u32, usize, Instant, u64, Box<dyn kvwire_transport::device::bound::EventWait>);

/// Device copies enqueued and not yet awaited.
pub(super) struct Copies {
    dir: Direction,
    pending: Vec<Pending>,
}

impl Copies {
    /// Whether every copy ended (or failed: [`Copies::finish`] says how),
    /// without waiting.
    pub fn ended(&self) -> bool {
        self.pending.iter().all(|(.., ev)| ev.query().unwrap_or(true))
    }

    /// Waits for every copy, their outcome unread: a transfer that failed
    /// leaves nothing writing into memory the engine gets back.
    pub fn drain(self, d: &Daemon) {
        drain(self.pending, Duration::from_secs(d.cfg.device.copy_timeout_secs));
    }

    /// Waits for every copy's event, then records the hop: the time the
    /// copies held each rank's stream, from their enqueue or the stream's
    /// previous copies' end (`free_at`, per rank, kept across calls),
    /// whichever is later, to their end. Returns when the last ended. An
    /// end is when the stream reached it where the backend says so (the
    /// stand-in), else that start plus how long the backend timed the
    /// copies (CUDA's events), else when it was seen: a ring's copies are
    /// awaited only after the previous layer's writes, long after they ended.
    pub fn finish(self, d: &Daemon, id: SlotId, free_at: &mut HashMap<u32, Instant>) -> Result<Instant, CopyError> {
        let Copies { dir, pending } = self;
        let timeout = Duration::from_secs(d.cfg.device.copy_timeout_secs);
        let hop = match dir {
            Direction::ToHost => Hop::Stage,
            Direction::ToDevice => Hop::DeviceComplete,
        };
        let mut spans = Vec::with_capacity(pending.len());
        let mut last = None::<Instant>;
        let mut pending = pending.into_iter();
        while let Some((rank, layer, enqueued, bytes, ev)) = pending.next() {
            if let Err(e) = ev.wait(timeout) {
                // The others still copy into host memory the caller is about to reuse: they end first.
                drain(pending, timeout);
                return Err(CopyError { rank, layer, why: e.to_string() });
            }
            let start = free_at.get(&rank).map_or(enqueued, |&t| t.max(enqueued));
            let done = ev.completed_at().or_else(|| ev.busy().map(|b| start + b)).unwrap_or_else(Instant::now);
            let from = start.min(done);
            spans.push(RankSpan { rank, from, done, bytes });
            free_at.insert(rank, done);
            last = Some(last.map_or(done, |l| l.max(done)));
        }
        // The ranks' streams ran side by side: the hop's time is their union.
        d.slot_hop_spans(id, hop, &spans);
        Ok(last.unwrap_or_else(Instant::now))
    }
}

/// A device copy that failed: its rank, layer, and the backend's reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("rank {rank} layer {layer}: {why}")]
pub(super) struct CopyError {
    pub rank: u32,
    pub layer: usize,
    pub why: String,
}

/// Which way a [`Copies`] copied: its hop.
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

impl Daemon {
    /// Chooses each allocation's path at the source ([`DevicePath`]), as
    /// `[device] gpudirect` says. With `on`, a refusal is an error (and
    /// what this call registered is let go); else the allocation stages,
    /// and why is logged and reported.
    pub(super) fn choose_device_paths(&self, devs: &mut [Mirrored]) -> Result<(), String> {
        for i in 0..devs.len() {
            match self.device_path(&devs[i].dev) {
                Ok(path) => devs[i].path = path,
                Err(why) => {
                    for d in &devs[..i] {
                        self.forget_path(d);
                    }
                    return Err(format!("device memory {i}: [device] gpudirect = \"on\" but the NIC cannot read it in place: {why}"));
                }
            }
        }
        Ok(())
    }

    /// One allocation's path; Err only with `gpudirect = "on"`.
    fn device_path(&self, dev: &Arc<dyn BoundMem>) -> Result<DevicePath, String> {
        let mode = self.cfg.device.gpudirect.as_str();
        if mode == "off" {
            return Ok(DevicePath::Staged { why: "[device] gpudirect = \"off\"".into() });
        }
        let kind = self.ep.transport();
        let rails = || self.rails.iter().filter_map(|r| r.ep.as_ref());
        let devices = || self.rails.iter().map(|r| r.device.as_deref().unwrap_or(r.name.as_str())).collect::<Vec<_>>().join(", ");
        let attempt = match dev.nic() {
            Err(why) => Err(why),
            // The stand-in's memory is host memory: any transport reads
            // it, but `auto` goes in place only where a real device's could.
            Ok(NicMemory::Host(_)) if mode == "auto" && kind != TransportKind::Verbs => {
                Err(format!("the {} transport reads memory through a host mapping; `auto` reads device memory in place on verbs only", kind.as_str()))
            }
            Ok(NicMemory::Host(mem)) => {
                let len = mem.len();
                self.register_region(mem, 0, len, None).map(|r| (r.key, format!("the stand-in's host memory, registered with the {} data plane", kind.as_str()))).map_err(|e| e.to_string())
            }
            Ok(NicMemory::Dmabuf { fd, iova, len }) => self.ep.register_dmabuf(fd.as_fd(), len, iova, None).map_err(|e| e.to_string()).and_then(|key| {
                for r in rails() {
                    if let Err(e) = r.register_dmabuf(fd.as_fd(), len, iova, Some(key)) {
                        self.revoke_key(key);
                        return Err(e.to_string());
                    }
                }
                Ok((key, format!("ibv_reg_dmabuf_mr on {}", devices())))
            }),
        };
        match attempt {
            Ok((key, how)) => {
                tracing::info!(ordinal = dev.ordinal(), len = dev.len(), how, "device memory read in place by the NIC (GPUDirect)");
                Ok(DevicePath::Direct { key, how })
            }
            Err(why) if mode == "on" => Err(why),
            Err(why) => {
                // On verbs a refusal is news; elsewhere it is the transport's nature.
                match kind {
                    TransportKind::Verbs => tracing::warn!(ordinal = dev.ordinal(), len = dev.len(), why, "device memory staged through the ring: the NIC cannot read it in place"),
                    _ => tracing::info!(ordinal = dev.ordinal(), len = dev.len(), why, "device memory staged through the ring"),
                }
                Ok(DevicePath::Staged { why })
            }
        }
    }

    /// Lets an allocation's in-place registration go.
    pub(super) fn forget_path(&self, d: &Mirrored) {
        if let Some(key) = d.path.key() {
            self.revoke_key(key);
        }
    }
}
