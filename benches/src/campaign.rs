//! `kvwire bench campaign`: a latency and throughput sweep over transports,
//! transfer sizes and concurrency, through real endpoints, with in-run
//! baselines next to every point.
//!
//! A point is (transport, size, concurrency). For each point the campaign
//! makes fresh endpoints (so their hop histograms hold that point only),
//! runs one warm-up round through a twin pair of endpoints on the same
//! memory (pages faulted in, threads spun up, without touching the measured
//! histograms), then `iterations` timed rounds. A round is `concurrency`
//! transfers started together behind a barrier, each on its own connection
//! from the one source endpoint to the one destination endpoint, each in
//! its own thread: they share one link. A transfer is `size` bytes split
//! into `chunk`-byte writes, one batch each, with at most `depth` batches
//! outstanding; it is timed from the first post until the destination's
//! layer flag is seen (DESIGN.md `layer_ready`).
//!
//! Figures (GB/s = 1e9 bytes/s, which is exactly bytes per nanosecond):
//! - `gbps_avg`: each transfer's effective bandwidth, averaged as bytes over
//!   summed transfer time; `gbps_peak`: the fastest transfer;
//! - `gbps_aggregate`: all bytes of a round over the round's wall time
//!   (first start to last flag), summed over rounds — what the shared link
//!   carried. With concurrency 1 it equals `gbps_avg` up to rounding;
//! - `lat_ns`: per-transfer latency, min / p50 / p99 / p99.9 / max, from an
//!   hdrhistogram (3 significant digits) of every timed transfer;
//! - `payload_bytes`: `size × concurrency × iterations` (timed transfers);
//!   `wire_bytes`: that plus the framing its connections report sending and
//!   getting back for those transfers
//!   (tcp: a 40-byte header per frame and a 40-byte ack; shm: an 80-byte
//!   write request and a 40-byte ack per write; verbs: a 24-byte write
//!   note per write). Link-level headers (TCP/IP, RoCE) are not counted;
//! - `baselines`: `memcpy` always, then the transport's own raw path —
//!   `tcp socket pair` for tcp, `ib_write_bw` for verbs — each measured in
//!   this run right after the point, with the same concurrency (except
//!   `ib_write_bw`, one stream). The table's ratio is `gbps_avg` over the
//!   last baseline;
//! - `hops`: post and wire from the source endpoint's [`Hops`], place and
//!   notify from the destination's.
//!
//! Outputs: a fixed-width table (or, with `--json`, the JSONL lines),
//! `DIR/campaign.jsonl` (one `{"kind":"point",…}` object per point, and one
//! `{"kind":"skipped",…}` object per transport that could not run), and
//! three SVG plots drawn by [`crate::svg`].

use crate::{parse_size, Error};
use crate::svg::{Anchor, Frame, Scale, Stroke, Svg, PALETTE};
use anyhow::{anyhow, bail, Context};
use clap::Args;
use hdrhistogram::Histogram;
use kvwire_transport::shm::{ShmEndpoint, ShmLimits};
use kvwire_transport::tcp::{TcpEndpoint, TcpLimits};
use kvwire_transport::verbs::{VerbsEndpoint, VerbsLimits};
use kvwire_transport::{Batch, Connection, Endpoint, FlagTable, HostMem, Hop, Hops, Placement, Registry, Tag, TransportError, WriteOp};
use serde::Serialize;
use std::fmt::Write as _;
use std::io::{IsTerminal as _, Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// How long one completion or flag may take before the campaign gives up.
const TIMEOUT: Duration = Duration::from_secs(60);
/// Most transfers at once in one point.
const MAX_CONCURRENCY: u32 = 64;
/// Most timed transfers per connection and point.
const MAX_ITERATIONS: u32 = 100_000;
/// Most batches outstanding per transfer.
const MAX_DEPTH: u32 = 4096;
/// Most writes one transfer is split into.
const MAX_CHUNKS: u64 = 1 << 20;

/// Raw arguments of `kvwire bench campaign`.
#[derive(Debug, Args)]
pub struct CampaignArgs {
    /// Transports to sweep, comma-separated: tcp, shm, verbs (verbs needs an
    /// RDMA device, e.g. soft-RoCE; without one its points are skipped loudly).
    #[arg(long, value_delimiter = ',', default_value = "tcp,shm")]
    transports: Vec<String>,
    /// Transfer sizes, comma-separated (suffixes K, M, G = KiB, MiB, GiB).
    #[arg(long, value_delimiter = ',', default_value = "4K,64K,1M,16M,64M")]
    sizes: Vec<String>,
    /// Timed transfers per connection and point (after one warm-up round).
    #[arg(long, default_value_t = 5)]
    iterations: u32,
    /// Bytes per write: each transfer is split into writes of this size.
    #[arg(long, default_value = "1M")]
    chunk: String,
    /// Pipeline depth: most write batches outstanding per transfer.
    #[arg(long, default_value_t = 4)]
    depth: u32,
    /// Transfers at once sharing one link, comma-separated (1 = alone).
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    concurrency: Vec<u32>,
    /// Directory for campaign.jsonl and the SVG plots (created if missing).
    #[arg(long, default_value = "kvwire-campaign")]
    out: PathBuf,
    /// Print the JSONL lines instead of a table.
    #[arg(long)]
    json: bool,
}

/// A transport the campaign can drive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// TCP emulation of one-sided writes.
    Tcp,
    /// Same-host shared memory.
    Shm,
    /// RDMA verbs (real NIC or soft-RoCE).
    Verbs,
}

impl Transport {
    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Transport::Tcp => "tcp",
            Transport::Shm => "shm",
            Transport::Verbs => "verbs",
        }
    }
}

/// Validated settings of a campaign.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// Transports, in the order given, without repeats.
    pub transports: Vec<Transport>,
    /// Transfer sizes in bytes, ascending, without repeats.
    pub sizes: Vec<u64>,
    /// Timed transfers per connection and point.
    pub iterations: u32,
    /// Bytes per write.
    pub chunk: u64,
    /// Most batches outstanding per transfer.
    pub depth: u32,
    /// Concurrency levels, ascending, without repeats.
    pub concurrency: Vec<u32>,
    /// Output directory.
    pub out: PathBuf,
    /// JSONL on stdout instead of a table.
    pub json: bool,
}

impl CampaignArgs {
    /// Step two of argument parsing: every value checked, errors naming the flag.
    pub fn settings(&self) -> anyhow::Result<Settings> {
        let mut transports = Vec::new();
        for t in self.transports.iter().map(|t| t.trim()) {
            let t = match t {
                "tcp" => Transport::Tcp,
                "shm" => Transport::Shm,
                "verbs" => Transport::Verbs,
                other => bail!("--transports: unknown transport `{other}` (expected tcp, shm or verbs)"),
            };
            if !transports.contains(&t) {
                transports.push(t);
            }
        }
        if transports.is_empty() {
            bail!("--transports: give at least one of tcp, shm, verbs");
        }
        let mut sizes = Vec::new();
        for s in &self.sizes {
            sizes.push(parse_size(s).map_err(|e| anyhow!("--sizes: {e}"))?);
        }
        sizes.sort_unstable();
        sizes.dedup();
        if sizes.is_empty() {
            bail!("--sizes: give at least one size");
        }
        if self.iterations == 0 || self.iterations > MAX_ITERATIONS {
            bail!("--iterations {}: must be 1 to {MAX_ITERATIONS}", self.iterations);
        }
        let chunk = parse_size(&self.chunk).map_err(|e| anyhow!("--chunk: {e}"))?;
        if self.depth == 0 || self.depth > MAX_DEPTH {
            bail!("--depth {}: must be 1 to {MAX_DEPTH} (write batches in flight per transfer)", self.depth);
        }
        let largest = *sizes.last().expect("at least one size");
        if largest.div_ceil(chunk) > MAX_CHUNKS {
            bail!("--chunk {chunk}: splits a {largest}-byte transfer into more than {MAX_CHUNKS} writes; use a larger chunk");
        }
        let mut concurrency = self.concurrency.clone();
        concurrency.sort_unstable();
        concurrency.dedup();
        match (concurrency.first(), concurrency.last()) {
            (None, _) => bail!("--concurrency: give at least one level"),
            (Some(0), _) => bail!("--concurrency 0: must be at least 1 (transfers at once)"),
            (_, Some(&c)) if c > MAX_CONCURRENCY => bail!("--concurrency {c}: at most {MAX_CONCURRENCY}"),
            _ => {}
        }
        Ok(Settings { transports, sizes, iterations: self.iterations, chunk, depth: self.depth, concurrency, out: self.out.clone(), json: self.json })
    }
}

// ------------------------------------------------------------------ records

/// Latency figures of a point, nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct LatNs {
    /// Fastest transfer.
    pub min: u64,
    /// Median.
    pub p50: u64,
    /// 99th percentile.
    pub p99: u64,
    /// 99.9th percentile.
    pub p999: u64,
    /// Slowest transfer.
    pub max: u64,
}

/// One in-run baseline.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Baseline {
    /// `memcpy`, `tcp socket pair` or `ib_write_bw`.
    pub name: String,
    /// Its per-stream throughput, GB/s.
    pub gbps: f64,
}

/// One hop's histogram summary over a point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct HopStat {
    /// Samples.
    pub count: u64,
    /// Total time in the hop, ns.
    pub sum_ns: u64,
    /// Median, ns.
    pub p50_ns: u64,
    /// 99th percentile, ns.
    pub p99_ns: u64,
    /// Bytes the hop handled.
    pub bytes: u64,
}

impl HopStat {
    fn of(hops: &Hops, hop: Hop) -> HopStat {
        let s = hops.summary(hop);
        HopStat { count: s.count, sum_ns: s.sum_ns, p50_ns: s.p50_ns, p99_ns: s.p99_ns, bytes: s.bytes }
    }

    /// Effective bandwidth, GB/s (bytes / total time in the hop); `None` without bytes or time.
    pub fn gbps(&self) -> Option<f64> {
        (self.bytes > 0 && self.sum_ns > 0).then(|| self.bytes as f64 / self.sum_ns as f64)
    }
}

/// The four hops a campaign point records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PointHops {
    /// CPU time to post (source).
    pub post: HopStat,
    /// Post → local completion (source).
    pub wire: HopStat,
    /// Remote completion seen → bytes counted (destination).
    pub place: HopStat,
    /// Flag published → seen (destination).
    pub notify: HopStat,
}

impl PointHops {
    /// (name, figures) in path order.
    pub fn list(&self) -> [(&'static str, HopStat); 4] {
        [("post", self.post), ("wire", self.wire), ("place", self.place), ("notify", self.notify)]
    }
}

/// One measured point: a JSONL line of campaign.jsonl.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Point {
    /// Always `point`.
    pub kind: &'static str,
    /// Transport name.
    pub transport: &'static str,
    /// Bytes per transfer.
    pub size: u64,
    /// Transfers at once.
    pub concurrency: u32,
    /// Bytes per write, as used: `min(--chunk, size)`.
    pub chunk: u64,
    /// Most batches outstanding per transfer.
    pub depth: u32,
    /// Timed transfers per connection.
    pub iterations: u32,
    /// Per-transfer effective bandwidth: bytes / summed transfer time, GB/s.
    pub gbps_avg: f64,
    /// The fastest transfer's bandwidth, GB/s.
    pub gbps_peak: f64,
    /// What the shared link carried: round bytes / round wall time, GB/s.
    pub gbps_aggregate: f64,
    /// Per-transfer latency.
    pub lat_ns: LatNs,
    /// Logical bytes of the timed transfers.
    pub payload_bytes: u64,
    /// Payload plus kvwire framing of the timed transfers.
    pub wire_bytes: u64,
    /// In-run baselines; the last is the transport's own raw path.
    pub baselines: Vec<Baseline>,
    /// Hop histograms of this point's endpoints.
    pub hops: PointHops,
}

impl Point {
    /// `gbps_avg` over the last baseline.
    pub fn ratio(&self) -> Option<f64> {
        self.baselines.last().filter(|b| b.gbps > 0.0).map(|b| self.gbps_avg / b.gbps)
    }
}

/// A transport whose points could not run, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Skipped {
    /// Always `skipped`.
    pub kind: &'static str,
    /// Transport name.
    pub transport: &'static str,
    /// Why.
    pub reason: String,
}

// ------------------------------------------------------------------ pure figures

/// One timed transfer, as nanoseconds since a common origin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// First post.
    pub start_ns: u64,
    /// Destination flag seen.
    pub end_ns: u64,
    /// Framing the connection sent and got back for this transfer's
    /// writes, as the connection reports it.
    pub framing: u64,
}

impl Sample {
    fn took(&self) -> u64 {
        self.end_ns.saturating_sub(self.start_ns).max(1)
    }
}

/// Figures of a point from its rounds (each a list of concurrent transfers of `size` bytes).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Figures {
    /// Bytes / summed transfer time, GB/s.
    pub gbps_avg: f64,
    /// Fastest transfer, GB/s.
    pub gbps_peak: f64,
    /// Round bytes / round wall time, GB/s.
    pub gbps_aggregate: f64,
    /// Latency.
    pub lat: LatNs,
}

/// Computes a point's figures. `rounds` must hold at least one transfer.
pub fn figures(size: u64, rounds: &[Vec<Sample>]) -> Figures {
    let mut hist = Histogram::<u64>::new_with_bounds(1, 3_600_000_000_000, 3).expect("valid histogram bounds");
    let (mut n, mut sum, mut fastest) = (0u64, 0u64, u64::MAX);
    let (mut round_bytes, mut round_ns) = (0u64, 0u64);
    for round in rounds.iter().filter(|r| !r.is_empty()) {
        for s in round {
            hist.saturating_record(s.took());
            n += 1;
            sum += s.took();
            fastest = fastest.min(s.took());
        }
        let first = round.iter().map(|s| s.start_ns).min().expect("non-empty");
        let last = round.iter().map(|s| s.end_ns).max().expect("non-empty");
        round_bytes += size * round.len() as u64;
        round_ns += last.saturating_sub(first).max(1);
    }
    let gb = |bytes: u64, ns: u64| if ns == 0 { 0.0 } else { bytes as f64 / ns as f64 };
    Figures {
        gbps_avg: gb(size * n, sum),
        gbps_peak: if n == 0 { 0.0 } else { gb(size, fastest) },
        gbps_aggregate: gb(round_bytes, round_ns),
        lat: LatNs {
            min: hist.min(),
            p50: hist.value_at_quantile(0.50),
            p99: hist.value_at_quantile(0.99),
            p999: hist.value_at_quantile(0.999),
            max: hist.max(),
        },
    }
}

/// The write lengths of one `size`-byte transfer split into `chunk`-byte writes.
pub fn chunks(size: u64, chunk: u64) -> impl Iterator<Item = (u64, u64)> {
    let chunk = chunk.max(1);
    (0..size.div_ceil(chunk)).map(move |i| (i * chunk, chunk.min(size - i * chunk)))
}

/// `4K`, `64M`, `1G` for whole binary units, else bytes.
pub fn size_label(n: u64) -> String {
    for (shift, unit) in [(30, 'G'), (20, 'M'), (10, 'K')] {
        if n >= 1 << shift && n % (1 << shift) == 0 {
            return format!("{}{unit}", n >> shift);
        }
    }
    n.to_string()
}

// ------------------------------------------------------------------ measurement

/// Transfers at once, in lock-step rounds: `work(state, round)` runs on one
/// thread per state, all threads released together by a barrier each
/// round. After a failure every thread stops working (but keeps meeting the
/// barrier, so none waits forever); the first error is returned.
fn lockstep<S, T, F>(states: Vec<S>, rounds: usize, work: F) -> anyhow::Result<Vec<Vec<T>>>
where
    S: Send,
    T: Send,
    F: Fn(usize, &mut S) -> anyhow::Result<T> + Sync,
{
    let barrier = Barrier::new(states.len());
    let failed = AtomicBool::new(false);
    let results: Vec<anyhow::Result<Vec<T>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = states
            .into_iter()
            .enumerate()
            .map(|(lane, mut state)| {
                let (barrier, failed, work) = (&barrier, &failed, &work);
                scope.spawn(move || {
                    let mut out = Vec::with_capacity(rounds);
                    let mut err = None;
                    for _ in 0..rounds {
                        barrier.wait();
                        if failed.load(Ordering::Acquire) {
                            continue;
                        }
                        match work(lane, &mut state) {
                            Ok(t) => out.push(t),
                            Err(e) => {
                                failed.store(true, Ordering::Release);
                                err = Some(e.context(format!("stream {lane}")));
                            }
                        }
                    }
                    err.map_or(Ok(out), Err)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow!("a campaign thread panicked")))).collect()
    });
    results.into_iter().collect()
}

fn placement(slots: u16) -> anyhow::Result<Arc<Placement>> {
    Ok(Arc::new(Placement::new(FlagTable::new(slots, 1)?, Arc::new(Hops::default()))))
}

/// A fresh (source, destination) endpoint pair with `slots` transfer slots.
fn pair(t: Transport, slots: u16) -> anyhow::Result<(Arc<dyn Endpoint>, Arc<dyn Endpoint>)> {
    let regions = 2 * usize::from(slots) + 16;
    let one = |node: &str| -> anyhow::Result<Arc<dyn Endpoint>> {
        Ok(match t {
            Transport::Tcp => {
                TcpEndpoint::bind(node, "127.0.0.1:0".parse()?, Arc::new(Registry::new(regions)), placement(slots)?, TcpLimits::default())?
            }
            Transport::Shm => ShmEndpoint::new(node, None, Arc::new(Registry::new(regions)), placement(slots)?, ShmLimits::default())?,
            Transport::Verbs => {
                let limits = VerbsLimits { node: node.into(), slots, layers: 1, max_regions: regions, ..VerbsLimits::default() };
                Arc::new(verbs_endpoint(limits)?)
            }
        })
    };
    Ok((one("campaign-src")?, one("campaign-dst")?))
}

fn verbs_endpoint(limits: VerbsLimits) -> Result<VerbsEndpoint, TransportError> {
    let dev = std::env::var("KVWIRE_RDMA_DEVICE").ok();
    VerbsEndpoint::new(dev.as_deref(), 1, None, limits)
}

/// Waits for at least one completion; fails on a failed batch or a timeout.
fn reap(conn: &mut dyn Connection) -> anyhow::Result<usize> {
    let done = conn.poll(TIMEOUT)?;
    if done.is_empty() {
        bail!("no completion within {TIMEOUT:?} ({} batches outstanding)", conn.pending());
    }
    for c in &done {
        c.result.clone().with_context(|| format!("batch {} ({} bytes)", c.batch.0, c.bytes))?;
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
fn transfer(lane: &mut Lane, dst: &Placement, size: u64, chunk: u64, depth: u32, origin: Instant) -> anyhow::Result<Sample> {
    dst.expect(lane.tag, size)?;
    let framed = lane.conn.framing_bytes() + lane.conn.answer_bytes();
    let start = Instant::now();
    let mut outstanding = 0usize;
    for (off, len) in chunks(size, chunk) {
        while outstanding >= depth as usize {
            outstanding -= reap(&mut *lane.conn)?.min(outstanding);
        }
        let w = WriteOp { src_key: lane.src_key, src_offset: off, dst_key: lane.dst_key, dst_offset: off, len };
        lane.conn.post(Batch { tag: lane.tag, writes: vec![w] }).context("post")?;
        outstanding += 1;
    }
    dst.wait(lane.tag, TIMEOUT).context("destination flag")?;
    let end = Instant::now();
    while outstanding > 0 {
        outstanding -= reap(&mut *lane.conn)?.min(outstanding);
    }
    // Every write of this transfer was placed and answered: the slot is free.
    dst.reset_slot(lane.tag.slot);
    let ns = |t: Instant| u64::try_from(t.duration_since(origin).as_nanos()).unwrap_or(u64::MAX);
    let framing = lane.conn.framing_bytes() + lane.conn.answer_bytes() - framed;
    Ok(Sample { start_ns: ns(start), end_ns: ns(end), framing })
}

/// Registers one source and one destination region per lane, connects one
/// connection per lane (after registering: a verbs peer learns regions from
/// the hello), and runs `rounds` lock-step rounds.
fn run_rounds(src: &dyn Endpoint, dst: &dyn Endpoint, mem: &[(Arc<HostMem>, Arc<HostMem>)], s: &Settings, size: u64, rounds: usize) -> anyhow::Result<Vec<Vec<Sample>>> {
    let mut lanes = Vec::with_capacity(mem.len());
    for (i, (a, b)) in mem.iter().enumerate() {
        let sr = src.register(a.clone(), 0, size).context("register source region")?;
        let dr = dst.register(b.clone(), 0, size).context("register destination region")?;
        lanes.push((i, sr.key, dr.key));
    }
    let mut states = Vec::with_capacity(lanes.len());
    for (i, src_key, dst_key) in lanes {
        let conn = src.connect(&dst.local_addr()).with_context(|| format!("connect to {}", dst.local_addr()))?;
        states.push(Lane { conn, tag: Tag { slot: i as u16, layer: 0 }, src_key, dst_key });
    }
    let origin = Instant::now();
    let placement = dst.placement();
    let by_lane = lockstep(states, rounds, |_, lane| transfer(lane, placement, size, s.chunk, s.depth, origin))?;
    Ok((0..rounds).map(|r| by_lane.iter().map(|l| l[r]).collect()).collect())
}

/// Measures one point.
fn measure(t: Transport, size: u64, c: u32, s: &Settings) -> anyhow::Result<Point> {
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
        run_rounds(&*src, &*dst, &mem, s, size, 1).context("warm-up")?;
    }
    let (src, dst) = pair(t, slots).context("endpoints")?;
    let rounds = run_rounds(&*src, &*dst, &mem, s, size, s.iterations as usize)?;
    let (sh, dh) = (src.placement().hops(), dst.placement().hops());
    let hops = PointHops { post: HopStat::of(sh, Hop::Post), wire: HopStat::of(sh, Hop::Wire), place: HopStat::of(dh, Hop::Place), notify: HopStat::of(dh, Hop::Notify) };
    drop((src, dst, mem));
    let f = figures(size, &rounds);
    let mut baselines = vec![Baseline { name: "memcpy".into(), gbps: memcpy_baseline(size, c, s.iterations).context("memcpy baseline")? }];
    match t {
        Transport::Tcp => {
            baselines.push(Baseline { name: "tcp socket pair".into(), gbps: socket_baseline(size, c, s.iterations).context("tcp socket pair baseline")? })
        }
        Transport::Shm => {}
        Transport::Verbs => {
            let r = crate::baseline::transport("verbs", size, s.iterations).context("ib_write_bw baseline (needs perftest)")?;
            baselines.push(Baseline { name: "ib_write_bw".into(), gbps: r.baseline_gbps });
        }
    }
    let transfers = u64::from(c) * u64::from(s.iterations);
    Ok(Point {
        kind: "point",
        transport: t.name(),
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
    })
}

/// Per-stream GB/s of a lock-step baseline: bytes over summed stream time.
fn per_stream_gbps(size: u64, samples: &[Vec<Duration>]) -> f64 {
    let timed: Vec<Duration> = samples.iter().flat_map(|l| l.iter().skip(1)).copied().collect();
    let ns: u128 = timed.iter().map(|d| d.as_nanos().max(1)).sum();
    if ns == 0 {
        0.0
    } else {
        (size as f64 * timed.len() as f64) / ns as f64
    }
}

/// `c` threads at once, each copying `size` bytes between two mappings of
/// its own; one warm-up round, then `iters`.
fn memcpy_baseline(size: u64, c: u32, iters: u32) -> anyhow::Result<f64> {
    let pattern = vec![0x5Au8; size as usize];
    let mut states = Vec::with_capacity(c as usize);
    for _ in 0..c {
        let a = HostMem::new("kvwire-campaign-memcpy-a", size)?;
        a.write(0, &pattern)?;
        states.push((a, HostMem::new("kvwire-campaign-memcpy-b", size)?));
    }
    drop(pattern);
    let samples = lockstep(states, iters as usize + 1, |_, (a, b)| {
        let start = Instant::now();
        a.copy_to(0, b, 0, size)?;
        Ok(start.elapsed())
    })?;
    Ok(per_stream_gbps(size, &samples))
}

/// `c` plain TCP socket pairs on loopback at once, each streaming `size`
/// bytes to a receiver that reads every byte into a buffer and answers one
/// byte; timed until that answer. One warm-up round, then `iters`.
fn socket_baseline(size: u64, c: u32, iters: u32) -> anyhow::Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let mut senders = Vec::with_capacity(c as usize);
    let mut receivers = Vec::with_capacity(c as usize);
    for _ in 0..c {
        let s = TcpStream::connect(addr)?;
        s.set_nodelay(true)?;
        let (r, _) = listener.accept()?;
        r.set_nodelay(true)?;
        let rounds = iters + 1;
        receivers.push(std::thread::spawn(move || -> std::io::Result<()> {
            let mut r = r;
            let mut buf = vec![0u8; size as usize];
            for _ in 0..rounds {
                r.read_exact(&mut buf)?;
                r.write_all(&[1])?;
            }
            Ok(())
        }));
        senders.push(s);
    }
    let data = vec![0x5Au8; size as usize];
    let samples = lockstep(senders, iters as usize + 1, |_, s| {
        let mut ack = [0u8; 1];
        let start = Instant::now();
        s.write_all(&data)?;
        s.read_exact(&mut ack)?;
        Ok(start.elapsed())
    });
    // On failure the senders are dropped by now, so every receiver ends.
    for r in receivers {
        r.join().map_err(|_| anyhow!("baseline receiver panicked"))??;
    }
    Ok(per_stream_gbps(size, &samples?))
}

// ------------------------------------------------------------------ run

/// Runs the campaign and renders it into `out`.
pub fn run(a: CampaignArgs, out: &mut String) -> Result<(), Error> {
    let s = a.settings().map_err(Error::BadInput)?;
    std::fs::create_dir_all(&s.out).with_context(|| format!("--out {}: cannot create the directory", s.out.display())).map_err(Error::BadInput)?;
    let jsonl_path = s.out.join("campaign.jsonl");
    let mut jsonl = std::fs::File::create(&jsonl_path).with_context(|| format!("--out: cannot write {}", jsonl_path.display())).map_err(Error::BadInput)?;
    let mut line = |v: &dyn erased::Line, out: &mut String| -> Result<(), Error> {
        let text = v.to_line();
        writeln!(jsonl, "{text}").and_then(|()| jsonl.flush()).with_context(|| format!("write {}", jsonl_path.display())).map_err(Error::Failed)?;
        if s.json {
            out.push_str(&text);
            out.push('\n');
        }
        Ok(())
    };
    let progress = std::io::stderr().is_terminal();
    let mut points = Vec::new();
    let mut skipped = Vec::new();
    let total = s.transports.len() * s.sizes.len() * s.concurrency.len();
    let mut done = 0;
    for &t in &s.transports {
        if t == Transport::Verbs {
            match verbs_endpoint(VerbsLimits { node: "campaign-probe".into(), slots: 1, layers: 1, ..VerbsLimits::default() }) {
                Ok(_) => {}
                Err(TransportError::NoDevice(why)) => {
                    let n = s.sizes.len() * s.concurrency.len();
                    eprintln!("kvwire: WARNING: SKIPPING all {n} verbs points: no RDMA device: {why}");
                    let sk = Skipped { kind: "skipped", transport: t.name(), reason: format!("no RDMA device: {why}") };
                    line(&sk, out)?;
                    skipped.push(sk);
                    done += n;
                    continue;
                }
                Err(e) => return Err(Error::Failed(anyhow!(e).context("verbs endpoint"))),
            }
        }
        for &size in &s.sizes {
            for &c in &s.concurrency {
                done += 1;
                if progress {
                    eprintln!("kvwire: campaign point {done}/{total}: {} {} conc {c}", t.name(), size_label(size));
                }
                let p = measure(t, size, c, &s)
                    .with_context(|| format!("{} {} bytes, concurrency {c}", t.name(), size))
                    .map_err(Error::Failed)?;
                line(&p, out)?;
                points.push(p);
            }
        }
    }
    let plots = [
        ("throughput_vs_size.svg", throughput_svg(&points)),
        ("hop_latency.svg", hop_latency_svg(&points)),
        ("hop_ceiling.svg", hop_ceiling_svg(&points)),
    ];
    for (name, doc) in &plots {
        let p = s.out.join(name);
        std::fs::write(&p, doc).with_context(|| format!("write {}", p.display())).map_err(Error::Failed)?;
    }
    if !s.json {
        render_table(&s, &points, &skipped, out);
        let names: Vec<&str> = plots.iter().map(|(n, _)| *n).collect();
        let _ = writeln!(out, "wrote campaign.jsonl and {} in {}", names.join(", "), s.out.display());
    }
    Ok(())
}

/// Serializing the two kinds of JSONL line through one closure.
mod erased {
    pub trait Line {
        fn to_line(&self) -> String;
    }
    impl<T: serde::Serialize> Line for T {
        fn to_line(&self) -> String {
            serde_json::to_string(self).expect("campaign records serialize")
        }
    }
}

// ------------------------------------------------------------------ table

/// The fixed-width table, perftest / Mooncake-bench style.
pub fn render_table(s: &Settings, points: &[Point], skipped: &[Skipped], out: &mut String) {
    let _ = writeln!(
        out,
        "kvwire bench campaign: chunk {}, depth {}, {} iterations per point after 1 warm-up round; latency = first post -> destination flag seen",
        size_label(s.chunk),
        s.depth,
        s.iterations
    );
    let _ = writeln!(
        out,
        "{:<9} {:>6} {:>4} {:>5} {:>9} {:>9} {:>9} {:>10} {:>10} {:>10} {:>10} {:>10} {:>15} {:>9} {:>6}",
        "transport", "size", "conc", "iters", "GB/s avg", "GB/s peak", "GB/s agg", "min µs", "p50 µs", "p99 µs", "p99.9 µs", "max µs", "baseline", "base GB/s", "ratio"
    );
    let us = |ns: u64| format!("{:.1}", ns as f64 / 1e3);
    for p in points {
        let base = p.baselines.last();
        let _ = writeln!(
            out,
            "{:<9} {:>6} {:>4} {:>5} {:>9.3} {:>9.3} {:>9.3} {:>10} {:>10} {:>10} {:>10} {:>10} {:>15} {:>9.3} {:>6}",
            p.transport,
            size_label(p.size),
            p.concurrency,
            p.iterations,
            p.gbps_avg,
            p.gbps_peak,
            p.gbps_aggregate,
            us(p.lat_ns.min),
            us(p.lat_ns.p50),
            us(p.lat_ns.p99),
            us(p.lat_ns.p999),
            us(p.lat_ns.max),
            base.map_or("-", |b| b.name.as_str()),
            base.map_or(0.0, |b| b.gbps),
            p.ratio().map_or("-".into(), |r| format!("{r:.3}"))
        );
    }
    for sk in skipped {
        let _ = writeln!(out, "{:<9} SKIPPED: {}", sk.transport, sk.reason);
    }
    let _ = writeln!(
        out,
        "GB/s = 1e9 bytes/s. avg: each transfer's effective bandwidth (bytes / summed transfer time); peak: fastest transfer; \
         agg: all bytes of a round / that round's wall time."
    );
    let _ = writeln!(
        out,
        "conc c: c transfers at once sharing one link (c connections from one source endpoint to one destination, one thread each). \
         A duration measured alone (conc 1) must not be subtracted from a latency budget that runs under contention: \
         read the row with the concurrency the budget runs at."
    );
    let _ = writeln!(
        out,
        "baseline: measured in this run right after its point, same concurrency (ib_write_bw: one stream); ratio = GB/s avg / baseline. \
         memcpy is in campaign.jsonl for every point."
    );
}

// ------------------------------------------------------------------ plots

const W: f64 = 900.0;
const H: f64 = 520.0;

fn decade_label(v: f64) -> String {
    let e = v.log10().round() as i32;
    if e >= 0 {
        format!("{v:.0}")
    } else {
        format!("{v:.*}", (-e) as usize)
    }
}

fn series_label(p: &Point) -> String {
    format!("{} c={}", p.transport, p.concurrency)
}

fn empty_note(svg: &mut Svg, f: &Frame) {
    svg.text((f.left + f.right) / 2.0, (f.top + f.bottom) / 2.0, "no points measured", 14.0, Anchor::Middle, 0.0);
}

fn legend(svg: &mut Svg, x: f64, y: f64, items: &[(String, &str, bool)]) {
    for (i, (label, color, dashed)) in items.iter().enumerate() {
        let yy = y + i as f64 * 18.0;
        let stroke = if *dashed { Stroke::dashed(color, 2.0) } else { Stroke::solid(color, 2.0) };
        svg.line((x, yy), (x + 26.0, yy), stroke);
        svg.text(x + 32.0, yy + 4.0, label, 11.0, Anchor::Start, 0.0);
    }
}

/// Throughput (GB/s avg) against transfer size, log–log; one solid line per
/// transport and concurrency, baselines dashed.
pub fn throughput_svg(points: &[Point]) -> String {
    let mut svg = Svg::new(W, H, "kvwire campaign: throughput vs transfer size");
    svg.text(W / 2.0, 24.0, "Throughput vs transfer size (per-transfer GB/s avg; baselines dashed)", 15.0, Anchor::Middle, 0.0);
    let (left, right, top, bottom) = (80.0, W - 250.0, 50.0, H - 60.0);
    let sizes: Vec<f64> = dedup_sorted(points.iter().map(|p| p.size as f64));
    let rates = points.iter().flat_map(|p| std::iter::once(p.gbps_avg).chain(p.baselines.iter().map(|b| b.gbps))).filter(|v| *v > 0.0);
    let (lo, hi) = min_max(rates).unwrap_or((0.1, 10.0));
    let (xlo, xhi) = min_max(sizes.iter().copied()).unwrap_or((1024.0, 1048576.0));
    let f = Frame { x: Scale::log(xlo, xhi, left, right), y: Scale::log(lo, hi, bottom, top), left, right, top, bottom };
    f.axes(&mut svg, &sizes, &f.y.ticks(), "transfer size (bytes, log scale)", "GB/s (log scale)", &|v| size_label(v as u64), &decade_label);
    if points.is_empty() {
        empty_note(&mut svg, &f);
        return svg.finish();
    }
    let mut items = Vec::new();
    let mut color = 0;
    // Solid: one line per (transport, concurrency).
    for key in dedup_keys(points.iter().map(series_label)) {
        let c = PALETTE[color % PALETTE.len()];
        color += 1;
        let pts: Vec<(f64, f64)> = points.iter().filter(|p| series_label(p) == key).map(|p| (f.x.at(p.size as f64), f.y.at(p.gbps_avg))).collect();
        svg.path(&pts, Stroke::solid(c, 2.0));
        for (x, y) in &pts {
            svg.circle(*x, *y, 3.5, c);
        }
        items.push((key, c, false));
    }
    // Dashed: one line per (baseline, concurrency), averaged over the points that carry it.
    let keys = dedup_keys(points.iter().flat_map(|p| p.baselines.iter().map(move |b| format!("{} c={}", b.name, p.concurrency))));
    for key in keys {
        let c = PALETTE[color % PALETTE.len()];
        color += 1;
        let mut pts = Vec::new();
        for &size in &sizes {
            let vals: Vec<f64> = points
                .iter()
                .filter(|p| p.size as f64 == size)
                .flat_map(|p| p.baselines.iter().filter(|b| format!("{} c={}", b.name, p.concurrency) == key).map(|b| b.gbps))
                .collect();
            if !vals.is_empty() {
                pts.push((f.x.at(size), f.y.at(vals.iter().sum::<f64>() / vals.len() as f64)));
            }
        }
        svg.path(&pts, Stroke::dashed(c, 1.5));
        if pts.len() == 1 {
            let (x, y) = pts[0];
            svg.line((x - 10.0, y), (x + 10.0, y), Stroke::dashed(c, 1.5));
        }
        items.push((format!("baseline {key}"), c, true));
    }
    legend(&mut svg, right + 20.0, top + 10.0, &items);
    svg.finish()
}

/// Points at the largest size, one group each (transport × concurrency).
fn largest(points: &[Point]) -> (u64, Vec<&Point>) {
    let size = points.iter().map(|p| p.size).max().unwrap_or(0);
    (size, points.iter().filter(|p| p.size == size).collect())
}

/// Per-hop p50 and p99 bars (log µs) per transport and concurrency at the largest size.
pub fn hop_latency_svg(points: &[Point]) -> String {
    let (size, group) = largest(points);
    let mut svg = Svg::new(W, H, "kvwire campaign: per-hop latency");
    svg.text(W / 2.0, 24.0, &format!("Per-hop latency at {} per transfer (p50 and p99 of each hop's histogram)", size_label(size)), 15.0, Anchor::Middle, 0.0);
    let (left, right, top, bottom) = (80.0, W - 120.0, 50.0, H - 80.0);
    let vals = group.iter().flat_map(|p| p.hops.list().into_iter().filter(|(_, h)| h.count > 0).flat_map(|(_, h)| [h.p50_ns, h.p99_ns])).map(|ns| ns as f64 / 1e3);
    let (lo, hi) = min_max(vals.filter(|v| *v > 0.0)).unwrap_or((0.1, 1000.0));
    let f = Frame { x: Scale::linear(0.0, 1.0, left, right), y: Scale::log(lo, hi, bottom, top), left, right, top, bottom };
    f.axes(&mut svg, &[], &f.y.ticks(), "", "latency, µs (log scale)", &|_| String::new(), &decade_label);
    if group.is_empty() {
        empty_note(&mut svg, &f);
        return svg.finish();
    }
    let (p50c, p99c) = (PALETTE[0], PALETTE[4]);
    let gw = (right - left) / group.len() as f64;
    let bw = gw * 0.8 / 8.0;
    for (g, p) in group.iter().enumerate() {
        let gx = left + g as f64 * gw + gw * 0.1;
        for (i, (name, h)) in p.hops.list().into_iter().enumerate() {
            let x = gx + i as f64 * 2.0 * bw;
            if h.count > 0 {
                for (j, (ns, color)) in [(h.p50_ns, p50c), (h.p99_ns, p99c)].into_iter().enumerate() {
                    let y = f.y.at((ns as f64 / 1e3).max(f.y.range().0));
                    svg.rect(x + j as f64 * bw, y, bw * 0.95, bottom - y, color);
                }
            } else {
                svg.text(x + bw, bottom - 4.0, "n/a", 9.0, Anchor::Middle, 0.0);
            }
            svg.text(x + bw, bottom + 13.0, name, 10.0, Anchor::Middle, 0.0);
        }
        svg.text(left + g as f64 * gw + gw / 2.0, bottom + 30.0, &series_label(p), 12.0, Anchor::Middle, 0.0);
    }
    svg.rect(right + 15.0, top + 10.0, 12.0, 12.0, p50c);
    svg.text(right + 32.0, top + 20.0, "p50", 11.0, Anchor::Start, 0.0);
    svg.rect(right + 15.0, top + 30.0, 12.0, 12.0, p99c);
    svg.text(right + 32.0, top + 40.0, "p99", 11.0, Anchor::Start, 0.0);
    svg.text(
        left,
        H - 20.0,
        "post, wire: source endpoint; place, notify: destination. wire is per batch (one chunk), post -> local completion.",
        11.0,
        Anchor::Start,
        0.0,
    );
    svg.finish()
}

/// Hop ceilings (an analogy): each hop's effective bandwidth as a roof, the
/// transfer's achieved rate as a marker, per transport and concurrency at the largest size.
pub fn hop_ceiling_svg(points: &[Point]) -> String {
    let (size, group) = largest(points);
    let mut svg = Svg::new(W, H, "kvwire campaign: hop ceilings (an analogy)");
    svg.text(W / 2.0, 22.0, &format!("Hop ceilings at {} per transfer: an analogy to a roofline, not a transfer simulator", size_label(size)), 15.0, Anchor::Middle, 0.0);
    svg.text(W / 2.0, 40.0, "roof: a hop's effective bandwidth = bytes / total time in the hop; marker: the achieved rate (GB/s avg)", 11.0, Anchor::Middle, 0.0);
    let (left, right, top, bottom) = (80.0, W - 40.0, 60.0, H - 90.0);
    let rates = group.iter().flat_map(|p| p.hops.list().into_iter().filter_map(|(_, h)| h.gbps()).chain([p.gbps_avg])).filter(|v| *v > 0.0);
    let (lo, hi) = min_max(rates).unwrap_or((0.1, 10.0));
    let f = Frame { x: Scale::linear(0.0, 1.0, left, right), y: Scale::log(lo, hi, bottom, top), left, right, top, bottom };
    f.axes(&mut svg, &[], &f.y.ticks(), "", "GB/s (log scale)", &|_| String::new(), &decade_label);
    if group.is_empty() {
        empty_note(&mut svg, &f);
        return svg.finish();
    }
    let gw = (right - left) / group.len() as f64;
    let mut notes = Vec::new();
    for (g, p) in group.iter().enumerate() {
        let (x0, x1) = (left + g as f64 * gw + gw * 0.08, left + (g + 1) as f64 * gw - gw * 0.08);
        let roofs: Vec<(&str, f64)> = p.hops.list().into_iter().filter_map(|(n, h)| h.gbps().map(|r| (n, r))).collect();
        let lowest = roofs.iter().map(|r| r.1).fold(f64::INFINITY, f64::min);
        for (name, rate) in &roofs {
            let y = f.y.at(*rate);
            let bound = *rate == lowest;
            let stroke = if bound { Stroke::solid(PALETTE[1], 3.0) } else { Stroke::solid(PALETTE[0], 2.0) };
            svg.line((x0, y), (x1, y), stroke);
            svg.text(x1, y - 4.0, &format!("{name} {rate:.3} GB/s{}", if bound { " (lowest)" } else { "" }), 10.0, Anchor::End, 0.0);
        }
        // Roof labels sit above their lines at the right; the marker's label below it at the left.
        let y = f.y.at(p.gbps_avg);
        svg.circle(x0 + 10.0, y, 6.0, PALETTE[2]);
        svg.text(x0, y + 19.0, &format!("achieved {:.3} GB/s", p.gbps_avg), 10.0, Anchor::Start, 0.0);
        svg.text((x0 + x1) / 2.0, bottom + 18.0, &series_label(p), 12.0, Anchor::Middle, 0.0);
        if lowest.is_finite() && p.gbps_avg > lowest {
            notes.push(series_label(p));
        }
    }
    let mut text = String::new();
    if !notes.is_empty() {
        text = format!(
            "Above the lowest roof: {}. A hop's time can overlap other hops (wire runs from post to the ack sent after \
             placement; batches in flight and concurrent transfers overlap), so bytes / summed hop time understates it. ",
            notes.join(", ")
        );
    }
    text.push_str("An analogy, not a simulator: the lowest roof names the hop to look at first.");
    for (i, l) in wrap(&text, 150).iter().enumerate() {
        svg.text(left, H - 56.0 + i as f64 * 14.0, l, 10.0, Anchor::Start, 0.0);
    }
    svg.finish()
}

/// Splits `text` at spaces into lines of at most `width` characters (longer words stay whole).
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    let mut cur = String::new();
    for word in text.split_whitespace() {
        if !cur.is_empty() && cur.chars().count() + 1 + word.chars().count() > width {
            lines.push(std::mem::take(&mut cur));
        }
        if !cur.is_empty() {
            cur.push(' ');
        }
        cur.push_str(word);
    }
    if !cur.is_empty() {
        lines.push(cur);
    }
    lines
}

fn min_max(vals: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    vals.filter(|v| v.is_finite()).fold(None, |acc, v| match acc {
        None => Some((v, v)),
        Some((lo, hi)) => Some((lo.min(v), hi.max(v))),
    })
}

fn dedup_sorted(vals: impl Iterator<Item = f64>) -> Vec<f64> {
    let mut v: Vec<f64> = vals.collect();
    v.sort_by(f64::total_cmp);
    v.dedup();
    v
}

/// Keys in first-seen order, without repeats.
fn dedup_keys(keys: impl Iterator<Item = String>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for k in keys {
        if !out.contains(&k) {
            out.push(k);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(start_ns: u64, end_ns: u64) -> Sample {
        Sample { start_ns, end_ns, framing: 0 }
    }

    #[test]
    fn figures_from_hand_derived_rounds() {
        // 1000-byte transfers. Round 1: two at once, 0..100 and 10..210 ns;
        // round 2: 1000..1050 and 1000..1100.
        // Latencies 100, 200, 50, 100: sum 450 → avg 4000/450 GB/s; fastest 50 → 20 GB/s.
        // Round walls 210 and 100 ns carry 2000 bytes each → 4000/310 GB/s.
        let rounds = vec![vec![sample(0, 100), sample(10, 210)], vec![sample(1000, 1050), sample(1000, 1100)]];
        let f = figures(1000, &rounds);
        assert!((f.gbps_avg - 4000.0 / 450.0).abs() < 1e-12);
        assert!((f.gbps_peak - 20.0).abs() < 1e-12);
        assert!((f.gbps_aggregate - 4000.0 / 310.0).abs() < 1e-12);
        // Small values are exact in an hdrhistogram with 3 significant digits.
        assert_eq!(f.lat, LatNs { min: 50, p50: 100, p99: 200, p999: 200, max: 200 });
    }

    #[test]
    fn chunks_cover_the_transfer_once() {
        let c: Vec<_> = chunks(10, 4).collect();
        assert_eq!(c, vec![(0, 4), (4, 4), (8, 2)]);
        assert_eq!(chunks(4, 16).collect::<Vec<_>>(), vec![(0, 4)]);
    }

    #[test]
    fn size_labels() {
        assert_eq!(size_label(4096), "4K");
        assert_eq!(size_label(64 << 20), "64M");
        assert_eq!(size_label(1 << 30), "1G");
        assert_eq!(size_label(1000), "1000");
    }
}
