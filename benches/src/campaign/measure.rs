//! Measurement: fresh endpoint pairs, lock-step rounds of timed transfers
//! through them, and one point measured with its in-run baselines.

use super::baselines::{memcpy_baseline, socket_baseline};
use super::figures::{chunks, figures, model, Sample};
use kvwire_core::timing::union_ns;
use super::lockstep::lockstep;
use super::records::{Baseline, HopStat, Point, PointHops};
use super::settings::Settings;
use kvwire_core::protocol::TransportKind;
use anyhow::{bail, Context};
use kvwire_transport::shm::{ShmEndpoint, ShmLimits};
use kvwire_transport::tcp::{TcpEndpoint, TcpLimits};
use kvwire_transport::verbs::{VerbsEndpoint, VerbsLimits};
use kvwire_transport::{Batch, Connection, Endpoint, FlagTable, HostMem, Hop, Hops, Placement, Registry, Tag, TransportError, WriteOp};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long one completion or flag may take before the campaign gives up.
const TIMEOUT: Duration = Duration::from_secs(60);

fn placement(slots: u16) -> anyhow::Result<Arc<Placement>> {
    Ok(Arc::new(Placement::new(FlagTable::new(slots, 1)?, Arc::new(Hops::default()))))
}

/// A fresh (source, destination) endpoint pair with `slots` transfer slots.
fn pair(t: TransportKind, slots: u16) -> anyhow::Result<(Arc<dyn Endpoint>, Arc<dyn Endpoint>)> {
    let regions = 2 * usize::from(slots) + 16;
    let one = |node: &str| -> anyhow::Result<Arc<dyn Endpoint>> {
        Ok(match t {
            TransportKind::Tcp => {
                TcpEndpoint::bind(node, "127.0.0.1:0".parse()?, Arc::new(Registry::new(regions)), placement(slots)?, TcpLimits::default())?
            }
            TransportKind::Shm => ShmEndpoint::new(node, None, Arc::new(Registry::new(regions)), placement(slots)?, ShmLimits::default())?,
            TransportKind::Verbs => {
                let limits = VerbsLimits { node: node.into(), slots, layers: 1, max_regions: regions, ..VerbsLimits::default() };
                Arc::new(verbs_endpoint(limits)?)
            }
        })
    };
    Ok((one("campaign-src")?, one("campaign-dst")?))
}

pub(super) fn verbs_endpoint(limits: VerbsLimits) -> Result<VerbsEndpoint, TransportError> {
    let dev = std::env::var("KVWIRE_RDMA_DEVICE").ok();
    VerbsEndpoint::new(dev.as_deref(), 1, None, limits)
}

/// Waits for at least one completion; fails on a failed batch or a timeout.
/// Each completion ends its batch's `wire` sample (posted → seen here),
/// clipped at `end`, the transfer's end when it is already known: an ack
/// that comes back after the destination's flag was seen must not make the
/// hop outlast the transfer it belongs to.
fn reap(conn: &mut dyn Connection, posted: &mut HashMap<u64, Instant>, end: Option<Instant>, wire: &Hops, spans: &mut Vec<(Instant, Instant)>) -> anyhow::Result<usize> {
    let done = conn.poll(TIMEOUT)?;
    let seen = Instant::now();
    if done.is_empty() {
        bail!("no completion within {TIMEOUT:?} ({} batches outstanding)", conn.pending());
    }
    for c in &done {
        c.result.clone().with_context(|| format!("batch {} ({} bytes)", c.batch.0, c.bytes))?;
        if let Some(at) = posted.remove(&c.batch.0) {
            let until = end.map_or(seen, |e| e.min(seen)).max(at);
            wire.record(Hop::Wire, until - at, c.bytes);
            spans.push((at, until));
        }
    }
    Ok(done.len())
}

/// One lane of a point: a connection and the keys it writes from and into.
struct Lane {
    conn: Box<dyn Connection>,
    tag: Tag,
    src_key: u32,
    dst_key: u32,
}

/// One transfer: `size` bytes in `chunk`-byte batches, at most `depth`
/// outstanding, timed from the first post until the destination's flag is
/// seen; then every completion is drained and the slot reset for the next.
fn transfer(lane: &mut Lane, dst: &Placement, size: u64, chunk: u64, depth: u32, origin: Instant, wire: &Hops) -> anyhow::Result<Sample> {
    dst.expect(lane.tag, size)?;
    let framed = lane.conn.framing_bytes() + lane.conn.answer_bytes();
    let start = Instant::now();
    let mut outstanding = 0usize;
    let mut posted = HashMap::new();
    let mut spans = Vec::new();
    for (off, len) in chunks(size, chunk) {
        while outstanding >= depth as usize {
            outstanding -= reap(&mut *lane.conn, &mut posted, None, wire, &mut spans)?.min(outstanding);
        }
        let w = WriteOp { src_key: lane.src_key, src_offset: off, dst_key: lane.dst_key, dst_offset: off, len, stride: None };
        let id = lane.conn.post(Batch { tag: lane.tag, writes: vec![w] }).context("post")?;
        posted.insert(id.0, Instant::now());
        outstanding += 1;
    }
    let notify = dst.wait(lane.tag, TIMEOUT).context("destination flag")?;
    let end = Instant::now();
    // The campaign is the waiter: flag published → seen here.
    wire.record(Hop::Notify, notify, 0);
    while outstanding > 0 {
        outstanding -= reap(&mut *lane.conn, &mut posted, Some(end), wire, &mut spans)?.min(outstanding);
    }
    // Every write of this transfer was placed and answered: the slot is free.
    dst.reset_slot(lane.tag.slot);
    let ns = |t: Instant| u64::try_from(t.duration_since(origin).as_nanos()).unwrap_or(u64::MAX);
    let framing = lane.conn.framing_bytes() + lane.conn.answer_bytes() - framed;
    let spans: Vec<(u64, u64)> = spans.iter().map(|&(a, b)| (ns(a), ns(b))).collect();
    Ok(Sample { start_ns: ns(start), end_ns: ns(end), framing, wire_ns: union_ns(&spans) })
}

/// Registers one source and one destination region per lane, connects one
/// connection per lane (after registering: a verbs peer learns regions from
/// the hello), and runs `rounds` lock-step rounds.
fn run_rounds(
    src: &dyn Endpoint,
    dst: &dyn Endpoint,
    mem: &[(Arc<HostMem>, Arc<HostMem>)],
    s: &Settings,
    size: u64,
    rounds: usize,
    wire: &Hops,
) -> anyhow::Result<Vec<Vec<Sample>>> {
    let cred = crate::baseline::session(src, dst)?;
    let peer = crate::baseline::granted_node(dst, &cred)?;
    let mut lanes = Vec::with_capacity(mem.len());
    for (i, (a, b)) in mem.iter().enumerate() {
        let sr = src.register(a.clone(), 0, size, None).context("register source region")?;
        let grant = kvwire_transport::Grant { peer, slot: i as u16 };
        let dr = dst.register(b.clone(), 0, size, Some(grant)).context("register destination region")?;
        lanes.push((i, sr.key, dr.key));
    }
    let mut states = Vec::with_capacity(lanes.len());
    for (i, src_key, dst_key) in lanes {
        let conn = src.connect(&dst.local_addr(), &cred).with_context(|| format!("connect to {}", dst.local_addr()))?;
        states.push(Lane { conn, tag: Tag { slot: i as u16, layer: 0 }, src_key, dst_key });
    }
    let origin = Instant::now();
    let placement = dst.placement();
    let by_lane = lockstep(states, rounds, |_, lane| transfer(lane, placement, size, s.chunk, s.depth, origin, wire))?;
    Ok((0..rounds).map(|r| by_lane.iter().map(|l| l[r]).collect()).collect())
}

/// Measures one point.
pub(super) fn measure(t: TransportKind, size: u64, c: u32, s: &Settings) -> anyhow::Result<Point> {
    let mut mem = Vec::with_capacity(c as usize);
    let pattern = vec![0x5Au8; size as usize];
    for _ in 0..c {
        let a = Arc::new(HostMem::new("kvwire-campaign-src", size)?);
        a.write(0, &pattern)?;
        mem.push((a, Arc::new(HostMem::new("kvwire-campaign-dst", size)?)));
    }
    drop(pattern);
    let slots = c as u16;
    {
        // Warm-up through a twin pair on the same memory: the measured
        // endpoints' histograms then hold timed transfers only.
        let (src, dst) = pair(t, slots).context("warm-up endpoints")?;
        run_rounds(&*src, &*dst, &mem, s, size, 1, &Hops::default()).context("warm-up")?;
    }
    let (src, dst) = pair(t, slots).context("endpoints")?;
    // `wire` as the campaign sees it, each sample inside its transfer (the
    // transport's own ends at the ack), and `notify`, the campaign waiting.
    let wire = Hops::default();
    let rounds = run_rounds(&*src, &*dst, &mem, s, size, s.iterations as usize, &wire)?;
    let (sh, dh) = (src.placement().hops(), dst.placement().hops());
    let hops = PointHops { post: HopStat::of(sh, Hop::Post), wire: HopStat::of(&wire, Hop::Wire), place: HopStat::of(dh, Hop::Place), notify: HopStat::of(&wire, Hop::Notify) };
    drop((src, dst, mem));
    let f = figures(size, &rounds);
    let model = model(size, s.chunk.min(size), &rounds, &hops);
    let mut baselines = vec![Baseline { name: "memcpy".into(), gbps: memcpy_baseline(size, c, s.iterations).context("memcpy baseline")? }];
    match t {
        TransportKind::Tcp => {
            baselines.push(Baseline { name: "tcp socket pair".into(), gbps: socket_baseline(size, c, s.iterations).context("tcp socket pair baseline")? })
        }
        TransportKind::Shm => {}
        TransportKind::Verbs => {
            let gbps = crate::baseline::ib_write_bw_aggregate(size, s.iterations, c).context("ib_write_bw baseline (needs perftest)")?;
            baselines.push(Baseline { name: "ib_write_bw".into(), gbps });
        }
    }
    let transfers = u64::from(c) * u64::from(s.iterations);
    Ok(Point {
        kind: "point",
        transport: t.as_str(),
        size,
        concurrency: c,
        chunk: s.chunk.min(size),
        depth: s.depth,
        iterations: s.iterations,
        gbps_avg: f.gbps_avg,
        gbps_peak: f.gbps_peak,
        gbps_aggregate: f.gbps_aggregate,
        lat_ns: f.lat,
        payload_bytes: size * transfers,
        wire_bytes: size * transfers + rounds.iter().flatten().map(|x| x.framing).sum::<u64>(),
        baselines,
        hops,
        model,
    })
}
