//! A bounded soak of two real kvwired daemons: N clients move KV caches
//! from "soak-src" to "soak-dst" as fast as they can for S seconds, every
//! transfer remapped (TP2 NHD/16 → TP1 HND/32, shuffled block tables), and
//! every transfer checked byte for byte.
//!
//! Each client owns its groups (`src-i`, `dst-i`), registered once. Per
//! iteration it writes a new key into its source (the oracle's codes from
//! `kvwire_core::verify`, XOR the key), prepares a uniquely named receive,
//! submits, waits `decoder_usable`, and compares the destination with the
//! oracle's expectation XOR the same key (canary bytes stay canary). The key
//! changes every iteration, so a byte the transfer failed to write still holds
//! the previous key and shows. With `--check-every N` only every Nth
//! transfer writes a new key and is checked; those between move the same
//! bytes again, unchecked. With `--in-flight N` each client prepares N
//! receives, submits N transfers back to back (as an engine sending a
//! step's requests does) and only then waits for them; the N move the same
//! key into the same blocks, and are checked together. A comparison with
//! engines that time their writes and check once at the end (`kvwire bench
//! peers`) takes the client's own full rewrite and compare out of the
//! timed loop the same way: on a 2-core host that work shares the daemons'
//! cores.
//!
//! A sampler reads each daemon's VmRSS, Threads and open fds from /proc every
//! 500 ms: before any client connects, during the run, and 1 s after every
//! client has disconnected. "RSS first" is the first sample after a warm-up
//! of 20% of the run (registrations, allocator arenas, first connections).
//!
//! Judgement (exit 1, naming what failed): any transfer error or byte
//! mismatch; a daemon that died; fds or threads after the clients left not
//! equal to before they connected; fds during the run past
//! [`FDS_PER_CLIENT`] per client over before (connections kept idle must
//! stay bounded while transfers come and go); RSS growth: max RSS in the
//! last third of the run above the middle third's max by more than
//! max(16 MiB, 10%).
//! Exit 2 on bad arguments.

use kvwire_core::layout::{from_toml_spec, ModelSpec};
use kvwire_core::plan::{Buffers, Side};
use kvwire_core::reuse::CacheIdentity;
use kvwire_core::shard::LayoutSpec;
use kvwire_core::{verify, CacheFormat};
use kvwire_testkit::netns;
use kvwire_testkit::{start_daemon, start_daemon_in, DaemonProc, TempDir};
use kvwire_transport::HostMem;
use kvwire_client::client::{Client, ClientError, Submitted};
use kvwire_client::control::*;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const SECRET: &str = "kvwire-soak-shared-secret-0123456789";
const LAYERS: u64 = 4;
const KV_HEADS: u64 = 4;
const HEAD_DIM: u64 = 64;
const ELEM_BYTES: u64 = 2; // fp16
/// Payload bytes a transfer moves per token (K and V of every layer).
const BYTES_PER_TOKEN: u64 = LAYERS * KV_HEADS * HEAD_DIM * 2 * ELEM_BYTES;
const MODEL: &str = "name = \"soak\"\ndtype = \"fp16\"\n[[layers]]\nrepeat = 4\nattention = \"dense\"\nkv_heads = 4\nhead_dim = 64\n";
const SRC_LAYOUT: &str = "tp=2,block=16,layout=nhd,table=shuffle:3";
const DST_LAYOUT: &str = "tp=1,block=32,layout=hnd,table=shuffle:7";
const WAIT: Duration = Duration::from_secs(30);
const SAMPLE_EVERY: Duration = Duration::from_millis(500);
const SETTLE: Duration = Duration::from_secs(1);
/// Open fds a client may account for in a daemon at its peak, beyond a
/// fixed [`FDS_SLACK`]: its control socket and registered memfds, the
/// peer and data connections of its transfer in flight, and its share of
/// those kept idle between transfers.
const FDS_PER_CLIENT: u64 = 16;
/// And for each transfer a client has in flight beyond its first
/// (`--in-flight`): a peer and a data connection, and staging.
const FDS_PER_IN_FLIGHT: u64 = 4;
const FDS_SLACK: u64 = 32;
/// Errors kept verbatim per client (the rest are only counted).
const KEEP_ERRORS: usize = 3;
/// A client stops after this many failures in a row: its daemon is likely gone.
const GIVE_UP_AFTER: u32 = 3;

const USAGE: &str = "usage: kvwire-soak [--seconds S (30)] [--clients N (8)] [--tokens T (256)] [--transport tcp|shm|verbs (tcp)] [--netns] [--stream] [--device [--gpudirect auto|on|off]] [--check-every N (1)] [--in-flight N (1)] [--pin] [--transport-set KEY=VALUE]... [--json]";

// ------------------------------------------------------------------ arguments

/// The command line as given.
#[derive(Debug, Default)]
struct RawArgs {
    seconds: Option<String>,
    clients: Option<String>,
    tokens: Option<String>,
    transport: Option<String>,
    netns: bool,
    stream: bool,
    device: bool,
    gpudirect: Option<String>,
    check_every: Option<String>,
    in_flight: Option<String>,
    pin: bool,
    transport_set: Vec<String>,
    json: bool,
    help: bool,
}

/// What to run, validated.
#[derive(Debug, Clone)]
struct Settings {
    seconds: u64,
    clients: usize,
    tokens: u64,
    // The daemons' data plane: tcp, same-host shared memory, or verbs.
    transport: &'static str,
    netns: bool,
    stream: bool,
    // Both daemons serve device memory through the stand-in backend, and
    // every rank's cache is registered as a device allocation.
    device: bool,
    // `[device] gpudirect` of both daemons: whether the source's NIC reads
    // the (stand-in) device memory in place.
    gpudirect: String,
    // Every Nth transfer writes a new key and is checked (1: all).
    check_every: u64,
    // Transfers each client submits back to back before it waits.
    in_flight: u64,
    // Each side on CPUs of its own, as on two hosts (`pin_halves`).
    pin: bool,
    // Lines of both daemons' `[transport]` table (`key = value`), to try
    // a tuning without a rebuild.
    transport_set: Vec<String>,
    json: bool,
}

fn raw_args(args: impl IntoIterator<Item = String>) -> Result<RawArgs, String> {
    let mut raw = RawArgs::default();
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        let mut value = |key: &str| it.next().ok_or_else(|| format!("{key} needs a value"));
        match a.as_str() {
            "--seconds" => raw.seconds = Some(value("--seconds")?),
            "--clients" => raw.clients = Some(value("--clients")?),
            "--tokens" => raw.tokens = Some(value("--tokens")?),
            "--transport" => raw.transport = Some(value("--transport")?),
            "--netns" => raw.netns = true,
            "--stream" => raw.stream = true,
            "--device" => raw.device = true,
            "--gpudirect" => raw.gpudirect = Some(value("--gpudirect")?),
            "--check-every" => raw.check_every = Some(value("--check-every")?),
            "--in-flight" => raw.in_flight = Some(value("--in-flight")?),
            "--pin" => raw.pin = true,
            "--transport-set" => raw.transport_set.push(value("--transport-set")?),
            "--json" => raw.json = true,
            "-h" | "--help" => raw.help = true,
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    Ok(raw)
}

fn number(key: &str, v: Option<&str>, default: u64, range: std::ops::RangeInclusive<u64>) -> Result<u64, String> {
    let n = match v {
        None => default,
        Some(s) => s.parse::<u64>().map_err(|e| format!("{key} `{s}`: {e}"))?,
    };
    if range.contains(&n) {
        Ok(n)
    } else {
        Err(format!("{key} {n} is outside {}..={}", range.start(), range.end()))
    }
}

fn settings(raw: &RawArgs) -> Result<Settings, String> {
    let clients = number("--clients", raw.clients.as_deref(), 8, 1..=64)?;
    let in_flight = number("--in-flight", raw.in_flight.as_deref(), 1, 1..=64)?;
    // A daemon runs at most 64 transfers at once by default.
    if clients * in_flight > 64 {
        return Err(format!("--clients {clients} x --in-flight {in_flight} is over the 64 transfers a daemon runs at once"));
    }
    Ok(Settings {
        // Under 3 s the thirds of the run hold too few samples to judge RSS.
        seconds: number("--seconds", raw.seconds.as_deref(), 30, 3..=3600)?,
        clients: clients as usize,
        tokens: number("--tokens", raw.tokens.as_deref(), 256, 1..=65536)?,
        transport: match (raw.transport.as_deref(), raw.netns) {
            (None | Some("tcp"), _) => "tcp",
            (Some("shm"), false) => "shm",
            // verbs: the first RDMA device (a soft-RoCE rxe0 in scripts/softroce-vm).
            (Some("verbs"), false) => "verbs",
            // Both stay on one host: the namespaces would prove nothing.
            (Some(t @ ("shm" | "verbs")), true) => return Err(format!("--transport {t} runs on one host's device or memory; --netns measures tcp between namespaces")),
            (Some(t), _) => return Err(format!("--transport `{t}`: expected tcp, shm or verbs")),
        },
        netns: raw.netns,
        stream: raw.stream,
        device: raw.device,
        gpudirect: match raw.gpudirect.as_deref() {
            None => "auto".into(),
            Some(m @ ("auto" | "on" | "off")) if raw.device => m.into(),
            Some(m @ ("auto" | "on" | "off")) => return Err(format!("--gpudirect {m} needs --device")),
            Some(m) => return Err(format!("--gpudirect `{m}`: expected auto, on or off")),
        },
        check_every: number("--check-every", raw.check_every.as_deref(), 1, 1..=1_000_000)?,
        in_flight,
        pin: raw.pin,
        transport_set: raw
            .transport_set
            .iter()
            .map(|kv| match kv.split_once('=') {
                Some((k, v)) if !k.trim().is_empty() && !v.trim().is_empty() && !kv.contains('\n') => Ok(format!("{} = {}", k.trim(), v.trim())),
                _ => Err(format!("--transport-set `{kv}`: expected KEY=VALUE, one line of the daemons' [transport] table")),
            })
            .collect::<Result<_, _>>()?,
        json: raw.json,
    })
}

// ------------------------------------------------------------------ /proc figures

/// One daemon's figures at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ProcFigures {
    rss_kib: u64,
    threads: u64,
    fds: u64,
    // User plus system CPU of all its threads, ended ones included, in
    // clock ticks (USER_HZ, 100 per second in /proc's ABI).
    cpu_ticks: u64,
}

/// /proc's clock ticks per second (USER_HZ: fixed for /proc/<pid>/stat).
const TICKS_PER_S: f64 = 100.0;

fn proc_figures(pid: u32) -> Result<ProcFigures, String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(|e| format!("/proc/{pid}/status: {e}"))?;
    let field = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
    };
    // A zombie has a status file but no VmRSS: the daemon is gone.
    let rss_kib = field("VmRSS:").ok_or_else(|| format!("pid {pid} has no VmRSS (exited?)"))?;
    let threads = field("Threads:").ok_or_else(|| format!("pid {pid}: no Threads line"))?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_err(|e| format!("/proc/{pid}/fd: {e}"))?.count() as u64;
    // utime and stime are the 14th and 15th fields; the name before them
    // sits in parentheses and may hold spaces.
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).map_err(|e| format!("/proc/{pid}/stat: {e}"))?;
    let after_name = stat.rsplit_once(')').map(|(_, rest)| rest).ok_or_else(|| format!("/proc/{pid}/stat: no command name"))?;
    let ticks: Vec<u64> = after_name.split_whitespace().skip(11).take(2).filter_map(|v| v.parse().ok()).collect();
    let [utime, stime] = ticks[..] else { return Err(format!("/proc/{pid}/stat: no utime and stime")) };
    Ok(ProcFigures { rss_kib, threads, fds, cpu_ticks: utime + stime })
}

/// `ip netns exec` execs its command without forking, so the child's pid is
/// kvwired's; this checks that rather than trusting it, since a wrapper's
/// figures would say nothing about the daemon.
fn daemon_pid(d: &DaemonProc) -> Result<u32, String> {
    let pid = d.pid();
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).map_err(|e| format!("/proc/{pid}/comm: {e}"))?;
    if comm.trim() == "kvwired" {
        Ok(pid)
    } else {
        Err(format!("pid {pid} is `{}`, not kvwired", comm.trim()))
    }
}

/// A sample of both daemons (src, dst) at `at` after the clients started.
#[derive(Debug, Clone, Copy)]
struct Sample {
    at: Duration,
    figs: [ProcFigures; 2],
}

// ------------------------------------------------------------------ the fixture

/// What every client shares: the model, both sides, and the oracle's bytes
/// (per rank, regions back to back as registered).
#[derive(Debug)]
struct Fixture {
    model: ModelSpec,
    src: Side,
    dst: Side,
    src_codes: Vec<Vec<u8>>,
    dst_expect: Vec<Vec<u8>>,
    identity: CacheIdentity,
    tokens: u64,
    // Streamed submits: every layer announced by each source rank right
    // after the submit, as an engine whose forward ended then would.
    stream: bool,
    device: bool,
}

fn flatten(model: &ModelSpec, side: &Side, bufs: &Buffers) -> Vec<Vec<u8>> {
    (0..side.shard.ranks.len() as u32)
        .map(|r| side.regions(model, r).iter().flat_map(|(id, _)| bufs.ranks[r as usize][id].iter().copied()).collect())
        .collect()
}

fn fixture(tokens: u64, stream: bool, device: bool) -> Result<Fixture, String> {
    let model = from_toml_spec("soak", MODEL).map_err(|e| format!("model spec: {e}"))?;
    let fmt = CacheFormat::parse("fp16").map_err(|e| e.to_string())?;
    let side = |l: &str| -> Result<Side, String> {
        let spec = LayoutSpec::parse(l).map_err(|e| format!("layout `{l}`: {e}"))?;
        Side::new(&model, &spec, fmt, tokens).map_err(|e| format!("layout `{l}`: {e}"))
    };
    let (src, dst) = (side(SRC_LAYOUT)?, side(DST_LAYOUT)?);
    let src_codes = flatten(&model, &src, &verify::fill_source(&model, &src, tokens));
    let dst_expect = flatten(&model, &dst, &verify::expected_destination(&model, &dst, tokens, 0));
    let identity = CacheIdentity {
        model_digest: "soak".into(),
        adapter_digest: String::new(),
        format: "fp16/v1".into(),
        tenant: "soak".into(),
        rope: "theta=10000".into(),
        position_offset: 0,
    };
    Ok(Fixture { model, src, dst, src_codes, dst_expect, identity, tokens, stream, device })
}

// ------------------------------------------------------------------ clients

/// Why one transfer (or a client's set-up) failed.
#[derive(Debug, thiserror::Error)]
enum SoakError {
    /// A daemon refused or failed.
    #[error("{step}: {source}{}", .why.as_deref().map(|w| format!(" (daemon says: {w})")).unwrap_or_default())]
    Daemon {
        /// What was being done.
        step: &'static str,
        /// The error.
        source: ClientError,
        /// The transfer's own error, from its status, when there is one.
        why: Option<String>,
    },
    /// The destination does not hold what the oracle says.
    #[error("destination bytes differ: {count} bytes, first at rank {rank} offset {offset} (got {got:#04x}, want {want:#04x})")]
    Mismatch {
        /// Differing bytes.
        count: u64,
        /// Rank of the first.
        rank: usize,
        /// Its offset in the rank's memfd.
        offset: usize,
        /// What it held.
        got: u8,
        /// What it should have held.
        want: u8,
    },
    /// The daemon reported another size than the independent formula.
    #[error("submit reported {got} bytes, the model needs {want}")]
    Bytes {
        /// Reported.
        got: u64,
        /// Layers × KV heads × head_dim × (K, V) × element size × tokens.
        want: u64,
    },
    /// Local set-up failed.
    #[error("{0}")]
    Setup(String),
}

fn step(step: &'static str) -> impl Fn(ClientError) -> SoakError {
    move |source| SoakError::Daemon { step, source, why: None }
}

/// What one client did.
#[derive(Debug, Default)]
struct Tally {
    latencies: Vec<Duration>,
    // How long each submit call held its caller (the engine's thread).
    submits: Vec<Duration>,
    bytes: u64,
    // Transfers checked byte for byte (all but those `--check-every` skips).
    checked: u64,
    errors: u64,
    mismatches: u64,
    kept: Vec<String>,
}

/// One client's connections and memory; dropped when it leaves.
struct Session<'a> {
    fx: &'a Fixture,
    ca: Client,
    cb: Client,
    src_group: String,
    dst_group: String,
    src_mems: Vec<HostMem>,
    dst_mems: Vec<HostMem>,
    scratch: Vec<u8>,
    // The destination image a transfer must leave (`check`).
    want: Vec<u8>,
}

fn register(c: &Client, fx: &Fixture, group: &str, layout: &str, side: &Side) -> Result<Vec<HostMem>, SoakError> {
    let ranks = side.shard.ranks.len() as u32;
    let mut mems = Vec::new();
    for rank in 0..ranks {
        let total: u64 = side.regions(&fx.model, rank).iter().map(|(_, l)| l).sum();
        let mem = HostMem::new("kvwire-soak", total).map_err(|e| SoakError::Setup(format!("memfd: {e}")))?;
        let r = RegisterCache {
            group: group.into(),
            model: ModelSource::Toml(MODEL.into()),
            format: "fp16".into(),
            layout: layout.into(),
            rank,
            num_blocks: side.num_blocks,
            identity: fx.identity.clone(),
        };
        // The stand-in's device memory is the memfd itself: the soak writes
        // and checks it as it does host memory.
        let registered = match fx.device {
            true => c.register_device(RegisterDeviceCache { cache: r, ordinal: 0, len: mem.len(), ipc: None }, Some(mem.fd())).map_err(step("register_device"))?,
            false => c.register(r, &mem).map_err(step("register"))?,
        };
        let (_, bytes, complete) = registered;
        if bytes != total || complete != (rank + 1 == ranks) {
            return Err(SoakError::Setup(format!("{group} rank {rank}: registered {bytes} bytes (complete {complete}), expected {total}")));
        }
        mems.push(mem);
    }
    Ok(mems)
}

impl<'a> Session<'a> {
    fn open(i: usize, fx: &'a Fixture, src: &DaemonProc, dst: &DaemonProc) -> Result<Session<'a>, SoakError> {
        let ca = Client::connect(&src.socket, &format!("soak-{i}")).map_err(step("connect soak-src"))?;
        let cb = Client::connect(&dst.socket, &format!("soak-{i}")).map_err(step("connect soak-dst"))?;
        let (src_group, dst_group) = (format!("src-{i}"), format!("dst-{i}"));
        let src_mems = register(&ca, fx, &src_group, SRC_LAYOUT, &fx.src)?;
        let dst_mems = register(&cb, fx, &dst_group, DST_LAYOUT, &fx.dst)?;
        for m in &dst_mems {
            m.write(0, &vec![verify::CANARY; m.len() as usize]).map_err(|e| SoakError::Setup(e.to_string()))?;
        }
        Ok(Session { fx, ca, cb, src_group, dst_group, src_mems, dst_mems, scratch: Vec::new(), want: Vec::new() })
    }

    /// `n` transfers under `key`, submitted back to back (requests
    /// `{request}-0..n`); returns each one's submit → `decoder_usable`
    /// seen and how long its submit call took. With `checked` the source
    /// is written under `key` first and the destination compared after
    /// all `n` landed; without, the source holds the last checked key.
    fn transfers(&mut self, request: &str, key: u8, checked: bool, n: u64) -> Result<Vec<(Duration, Duration)>, SoakError> {
        let fx = self.fx;
        // The previous transfers' source_released was seen: the daemon no longer reads these pages.
        for (mem, codes) in self.src_mems.iter().zip(&fx.src_codes).filter(|_| checked) {
            self.scratch.clear();
            self.scratch.extend(codes.iter().map(|b| b ^ key));
            mem.write(0, &self.scratch).map_err(|e| SoakError::Setup(e.to_string()))?;
        }
        let names: Vec<String> = (0..n).map(|k| if n == 1 { request.to_string() } else { format!("{request}-{k}") }).collect();
        let want = BYTES_PER_TOKEN * fx.tokens;
        // Destination slots prepared, and per submit: its source slot, when it began, how long the call took.
        let (mut prepared, mut submitted): (Vec<u16>, Vec<(u16, Instant, Duration)>) = (Vec::new(), Vec::new());
        let run = (|| -> Result<Vec<(Duration, Duration)>, SoakError> {
            for name in &names {
                let p = PrepareReceive {
                    group: self.dst_group.clone(),
                    request: name.clone(),
                    block_table: fx.dst.block_table.clone(),
                    tokens: fx.tokens,
                    prefix_tokens: 0,
                    source: Some(self.ca.node.clone()),
                };
                prepared.push(self.cb.prepare(p).map_err(step("prepare"))?);
            }
            for name in &names {
                let started = Instant::now();
                let answer = self.ca.submit(Submit {
                    request: format!("{name}-src"),
                    group: self.src_group.clone(),
                    block_table: fx.src.block_table.clone(),
                    tokens: fx.tokens,
                    peer: "soak-dst".into(),
                    dst_group: self.dst_group.clone(),
                    dst_request: name.clone(),
                    codec: None,
                    stream: fx.stream,
                });
                let submit_call = started.elapsed();
                let Submitted { slot: sslot, bytes, .. } = answer.map_err(|e| SoakError::Daemon { step: "submit", source: e, why: None })?;
                submitted.push((sslot, started, submit_call));
                if bytes != want {
                    return Err(SoakError::Bytes { got: bytes, want });
                }
                if fx.stream {
                    for rank in 0..fx.src.shard.ranks.len() as u32 {
                        self.ca.produced(&self.src_group, &format!("{name}-src"), rank, LAYERS as u16).map_err(|e| SoakError::Daemon { step: "produced", source: e, why: None })?;
                    }
                }
            }
            let mut took = Vec::with_capacity(submitted.len());
            for (&slot, &(_, started, submit_call)) in prepared.iter().zip(&submitted) {
                if let Err(e) = self.cb.wait(slot, FlagName::DecoderUsable, WAIT) {
                    let why = self.cb.status(slot).ok().and_then(|s| s.error);
                    return Err(SoakError::Daemon { step: "wait decoder_usable", source: e, why });
                }
                took.push((started.elapsed(), submit_call));
            }
            for &(sslot, _, _) in &submitted {
                if let Err(e) = self.ca.wait(sslot, FlagName::SourceReleased, WAIT) {
                    let why = self.ca.status(sslot).ok().and_then(|s| s.error);
                    return Err(SoakError::Daemon { step: "wait source_released", source: e, why });
                }
            }
            Ok(took)
        })();
        let took = match run {
            Ok(took) => took,
            Err(e) => {
                // Otherwise their slots stay live for ever and the daemons run out of slots.
                for slot in prepared {
                    let _ = self.cb.cancel(slot);
                }
                for (sslot, _, _) in submitted {
                    let _ = self.ca.cancel(sslot);
                }
                return Err(e);
            }
        };
        if checked {
            self.check(key)?;
        }
        Ok(took)
    }

    /// Every destination byte against the oracle under `key`.
    fn check(&mut self, key: u8) -> Result<(), SoakError> {
        let mut first = None;
        let mut count = 0u64;
        for (rank, (mem, expect)) in self.dst_mems.iter().zip(&self.fx.dst_expect).enumerate() {
            self.scratch.resize(mem.len() as usize, 0);
            mem.read(0, &mut self.scratch).map_err(|e| SoakError::Setup(e.to_string()))?;
            // The whole image under `key` first, compared in one go: the
            // clients share the daemons' 2 cores, and a byte-at-a-time check
            // took a third of them at 1 MiB. The byte walk below only runs
            // to say where an image differs.
            self.want.clear();
            self.want.extend(expect.iter().map(|&e| if e == verify::CANARY { e } else { e ^ key }));
            if self.scratch.len() == self.want.len() && self.scratch == self.want {
                continue;
            }
            for (offset, (&got, &want)) in self.scratch.iter().zip(&self.want).enumerate() {
                if got != want {
                    count += 1;
                    first.get_or_insert((rank, offset, got, want));
                }
            }
        }
        match first {
            None => Ok(()),
            Some((rank, offset, got, want)) => Err(SoakError::Mismatch { count, rank, offset, got, want }),
        }
    }
}

fn client(i: usize, fx: &Fixture, src: &DaemonProc, dst: &DaemonProc, deadline: Instant, (check_every, in_flight): (u64, u64)) -> Tally {
    let mut t = Tally::default();
    let fail = |t: &mut Tally, e: SoakError| {
        t.errors += 1;
        if matches!(e, SoakError::Mismatch { .. }) {
            t.mismatches += 1;
        }
        if t.kept.len() < KEEP_ERRORS {
            t.kept.push(format!("client {i}: {e}"));
        }
    };
    let mut s = match Session::open(i, fx, src, dst) {
        Ok(s) => s,
        Err(e) => {
            fail(&mut t, e);
            return t;
        }
    };
    let mut in_a_row = 0;
    let mut iter = 0u64;
    while Instant::now() < deadline && in_a_row < GIVE_UP_AFTER {
        // Never 0 (the source codes unchanged), and never the previous
        // checked iteration's key.
        let checked = iter % check_every == 0;
        let key = ((i as u64 * 37 + iter / check_every) % 255 + 1) as u8;
        match s.transfers(&format!("soak-{i}-{iter}"), key, checked, in_flight) {
            Ok(done) => {
                for (took, submit_call) in done {
                    t.latencies.push(took);
                    t.submits.push(submit_call);
                    t.bytes += BYTES_PER_TOKEN * fx.tokens;
                    t.checked += u64::from(checked);
                }
                in_a_row = 0;
            }
            Err(e) => {
                // A mismatch says nothing about whether the daemons still serve: keep going.
                if !matches!(e, SoakError::Mismatch { .. }) {
                    in_a_row += 1;
                }
                fail(&mut t, e);
            }
        }
        iter += 1;
    }
    t
}

// ------------------------------------------------------------------ the run

/// One daemon's figures over the run.
#[derive(Debug)]
struct DaemonReport {
    name: &'static str,
    pid: u32,
    before: ProcFigures,
    after: ProcFigures,
    peak_fds: u64,
    peak_threads: u64,
    rss_first_kib: u64,
    rss_last_kib: u64,
    rss_max_kib: u64,
    rss_mid_max_kib: Option<u64>,
    rss_late_max_kib: Option<u64>,
    // What its own stats say at the end of the run.
    counted: Counted,
}

/// What a daemon's own stats say, for the report.
#[derive(Debug, Default)]
struct Counted {
    // Busy seconds per hop over the whole run, from the daemon's own
    // histograms, in the order it lists them.
    hops: Vec<(String, f64)>,
    // How its transfers began (`kvwire_starts_total`): announced,
    // claimed, offered.
    starts: Vec<(String, u64)>,
    // Connections its transfers used, opened or kept ("peer opened", ...).
    connections: Vec<(String, u64)>,
}

impl DaemonReport {
    /// CPU µs the daemon spent per transfer, all threads, over the run
    /// (setup and settling included, so an upper bound).
    fn cpu_us_per(&self, transfers: u64) -> f64 {
        self.after.cpu_ticks.saturating_sub(self.before.cpu_ticks) as f64 / TICKS_PER_S * 1e6 / transfers.max(1) as f64
    }
}

#[derive(Debug)]
struct Report {
    settings: Settings,
    elapsed: Duration,
    transfers: u64,
    checked: u64,
    errors: u64,
    mismatches: u64,
    kept: Vec<String>,
    latencies: Vec<Duration>,
    submits: Vec<Duration>,
    bytes: u64,
    per_client: (u64, u64),
    daemons: Vec<DaemonReport>,
    sampling: Option<String>,
    // With --pin: the source's CPUs and the destination's.
    pinned: Option<(String, String)>,
}

/// Each side on CPUs of its own, as on two hosts ([`kvwire_bench::cpu_halves`]):
/// the source daemon and this process (both sides' engines) on the first
/// half, the destination daemon on the second. Moves this thread, and so
/// the engines' threads it starts, to the first half; returns both halves
/// as CPU lists.
fn pin_halves() -> Result<(String, String), String> {
    let (src, dst) = kvwire_bench::cpu_halves().map_err(|e| format!("--pin: {e}"))?;
    kvwire_transport::topology::run_on_cpus(&src).map_err(|e| format!("--pin: {e}"))?;
    Ok((kvwire_bench::cpu_list(&src), kvwire_bench::cpu_list(&dst)))
}

fn soak(s: &Settings) -> Result<Report, String> {
    let fx = fixture(s.tokens, s.stream, s.device)?;
    let device = if s.device { format!("[device]\nbackend = \"host\"\ngpudirect = \"{}\"\n", s.gpudirect) } else { String::new() };
    // tcp is the daemons' default (and --netns sets its listen address).
    let mut transport = if s.transport == "tcp" { Vec::new() } else { vec![format!("kind = \"{}\"", s.transport)] };
    transport.extend(s.transport_set.iter().cloned());
    let transport = if transport.is_empty() { String::new() } else { format!("[transport]\n{}\n", transport.join("\n")) };
    let extra = &format!("{device}{transport}");
    let pinned = if s.pin { Some(pin_halves()?) } else { None };
    // Top-level keys go before the tables.
    let (src_extra, dst_extra) = match &pinned {
        Some((src, dst)) => (format!("cpus = \"{src}\"\n{extra}"), format!("cpus = \"{dst}\"\n{extra}")),
        None => (extra.clone(), extra.clone()),
    };
    let (src_extra, dst_extra) = (src_extra.as_str(), dst_extra.as_str());
    // The daemons' configs, secrets and sockets; removed on drop.
    let tmp = TempDir::try_new("soak")?;
    let dir = tmp.path();
    // Declared before the daemons, so dropped after them: they die before their namespaces.
    let link = if s.netns { Some(netns::Link::new("soak")?) } else { None };
    let (dst, src) = match &link {
        Some(l) => {
            let dst = start_daemon_in(Some(&l.a.name), &l.a.ip, dir, "soak-dst", SECRET, &[], dst_extra);
            let src = start_daemon_in(Some(&l.b.name), &l.b.ip, dir, "soak-src", SECRET, &[("soak-dst", &dst.peer)], src_extra);
            (dst, src)
        }
        None => {
            let dst = start_daemon(dir, "soak-dst", SECRET, &[], dst_extra);
            let src = start_daemon(dir, "soak-src", SECRET, &[("soak-dst", &dst.peer)], src_extra);
            (dst, src)
        }
    };
    let pids = [daemon_pid(&src)?, daemon_pid(&dst)?];
    let sample = || -> Result<[ProcFigures; 2], String> { Ok([proc_figures(pids[0])?, proc_figures(pids[1])?]) };
    // "ready" is printed once the listeners are bound; let the daemon's other threads start.
    std::thread::sleep(Duration::from_millis(300));
    let before = sample()?;

    let samples = Mutex::new(Vec::<Sample>::new());
    let sampling_failed = Mutex::new(None::<String>);
    let stop = AtomicBool::new(false);
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs(s.seconds);
    let (tallies, after) = std::thread::scope(|sc| {
        sc.spawn(|| {
            let mut next = t0;
            while !stop.load(Ordering::Acquire) {
                if Instant::now() >= next {
                    match sample() {
                        Ok(figs) => samples.lock().expect("samples").push(Sample { at: t0.elapsed(), figs }),
                        Err(e) => {
                            sampling_failed.lock().expect("sampling").get_or_insert(format!("at {:.1} s: {e}", t0.elapsed().as_secs_f64()));
                        }
                    }
                    next += SAMPLE_EVERY;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        let hs: Vec<_> = (0..s.clients).map(|i| sc.spawn({
            let (fx, src, dst, pace) = (&fx, &src, &dst, (s.check_every, s.in_flight));
            move || client(i, fx, src, dst, deadline, pace)
        })).collect();
        let tallies: Vec<Tally> = hs.into_iter().map(|h| h.join().expect("client thread")).collect();
        // Every client connection is closed now; give the daemons time to notice and clean up.
        std::thread::sleep(SETTLE);
        let after = sample();
        stop.store(true, Ordering::Release);
        (tallies, after)
    });
    let stats = [&src, &dst].map(daemon_stats);
    let elapsed = deadline.saturating_duration_since(t0).max(Duration::from_millis(1));
    let after = after?;
    let samples = samples.into_inner().expect("samples");
    let run: Vec<&Sample> = samples.iter().filter(|x| x.at <= elapsed).collect();

    let daemons = [("soak-src", 0), ("soak-dst", 1)]
        .into_iter()
        .zip(stats)
        .map(|((name, d), counted)| {
            let secs = elapsed.as_secs_f64();
            let rss_in = |lo: f64, hi: f64| run.iter().filter(|x| (lo..=hi).contains(&x.at.as_secs_f64())).map(|x| x.figs[d].rss_kib).max();
            let warm: Vec<u64> = run.iter().filter(|x| x.at.as_secs_f64() >= 0.2 * secs).map(|x| x.figs[d].rss_kib).collect();
            DaemonReport {
                name,
                pid: pids[d],
                before: before[d],
                after: after[d],
                peak_fds: run.iter().map(|x| x.figs[d].fds).max().unwrap_or(0),
                peak_threads: run.iter().map(|x| x.figs[d].threads).max().unwrap_or(0),
                rss_first_kib: warm.first().copied().unwrap_or(0),
                rss_last_kib: warm.last().copied().unwrap_or(0),
                rss_max_kib: warm.iter().copied().max().unwrap_or(0),
                rss_mid_max_kib: rss_in(secs / 3.0, 2.0 * secs / 3.0),
                rss_late_max_kib: rss_in(2.0 * secs / 3.0, secs),
                counted,
            }
        })
        .collect();

    let mut latencies: Vec<Duration> = tallies.iter().flat_map(|t| t.latencies.iter().copied()).collect();
    latencies.sort_unstable();
    let mut submits: Vec<Duration> = tallies.iter().flat_map(|t| t.submits.iter().copied()).collect();
    submits.sort_unstable();
    let counts = tallies.iter().map(|t| t.latencies.len() as u64);
    let report = Report {
        settings: s.clone(),
        elapsed,
        transfers: latencies.len() as u64,
        checked: tallies.iter().map(|t| t.checked).sum(),
        errors: tallies.iter().map(|t| t.errors).sum(),
        mismatches: tallies.iter().map(|t| t.mismatches).sum(),
        kept: tallies.iter().flat_map(|t| t.kept.iter().cloned()).collect(),
        bytes: tallies.iter().map(|t| t.bytes).sum(),
        per_client: (counts.clone().min().unwrap_or(0), counts.max().unwrap_or(0)),
        latencies,
        submits,
        daemons,
        sampling: sampling_failed.into_inner().expect("sampling"),
        pinned,
    };
    Ok(report)
}

/// A daemon's busy seconds per hop so far (hops without samples left out),
/// how its transfers began and the connections they used; empty when its
/// stats cannot be read, which the report then shows.
fn daemon_stats(d: &DaemonProc) -> Counted {
    let Ok(c) = Client::connect(&d.socket, "soak-stats") else { return Default::default() };
    let Ok(text) = c.stats() else { return Default::default() };
    match kvwire_client::promtext::Stats::from_text(&text) {
        Ok(st) => Counted {
            hops: st.hops.into_iter().filter(|h| h.count > 0).map(|h| (h.hop, h.sum_seconds)).collect(),
            starts: st.starts.into_iter().map(|h| (h.how, h.count)).collect(),
            connections: st.connections.into_iter().map(|c| (format!("{} {}", c.kind, c.how), c.count)).collect(),
        },
        Err(_) => Default::default(),
    }
}

// ------------------------------------------------------------------ judgement and output

/// Nearest-rank percentile of sorted values.
fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = (p * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// One verdict: passed or not, and why.
#[derive(Debug)]
struct Verdict {
    ok: bool,
    what: String,
}

fn judge(r: &Report) -> Vec<Verdict> {
    let mut v = Vec::new();
    let mut say = |ok: bool, what: String| v.push(Verdict { ok, what });
    say(
        r.errors == 0 && r.transfers > 0,
        match r.checked == r.transfers {
            true => format!("transfers: {} exact, {} errors ({} byte mismatches)", r.transfers, r.errors, r.mismatches),
            false => format!("transfers: {}, {} checked exact (one in {}), {} errors ({} byte mismatches)", r.transfers, r.checked, r.settings.check_every, r.errors, r.mismatches),
        },
    );
    if let Some(e) = &r.sampling {
        say(false, format!("daemon figures unreadable during the run {e}"));
    }
    for d in &r.daemons {
        // Exact equality: every per-client and per-transfer fd (control
        // socket, memfds, peer and data connections) must be closed once
        // the clients have gone and the transfers have finished.
        say(d.after.fds == d.before.fds, format!("{} fds: {} before clients connected, {} after they left", d.name, d.before.fds, d.after.fds));
        let allowed = d.before.fds + (FDS_PER_CLIENT + FDS_PER_IN_FLIGHT * (r.settings.in_flight - 1)) * r.settings.clients as u64 + FDS_SLACK;
        say(d.peak_fds <= allowed, format!("{} fds during the run: peak {}, allowed up to {allowed}", d.name, d.peak_fds));
        say(
            d.after.threads == d.before.threads,
            format!("{} threads: {} before clients connected, {} after they left", d.name, d.before.threads, d.after.threads),
        );
        match (d.rss_mid_max_kib, d.rss_late_max_kib) {
            (Some(mid), Some(late)) => {
                // A destination's staging pool keeps one more buffer for
                // a client whose next transfer was prepared before its last
                // one's buffer was back (bounded by the pool, not a leak):
                // a step of one payload per client (and the allocator's
                // slack), which at 16 MiB and above may first come late in
                // a run.
                let payload_kib = (BYTES_PER_TOKEN * r.settings.tokens).div_ceil(1 << 20) * 1024;
                let allowed = mid + (16 * 1024).max(mid / 10).max(payload_kib * r.settings.clients as u64 + 4096);
                say(
                    late <= allowed,
                    format!(
                        "{} RSS: last third max {:.1} MiB, middle third max {:.1} MiB (allowed up to {:.1} MiB)",
                        d.name,
                        mib(late),
                        mib(mid),
                        mib(allowed)
                    ),
                );
            }
            _ => say(false, format!("{} RSS: no samples in the middle or last third (the clients stopped early)", d.name)),
        }
    }
    v
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn json_str(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn print_json(r: &Report, verdicts: &[Verdict]) {
    let secs = r.elapsed.as_secs_f64();
    let figs = |f: &ProcFigures| format!("{{\"rss_kib\":{},\"fds\":{},\"threads\":{},\"cpu_ticks\":{}}}", f.rss_kib, f.fds, f.threads, f.cpu_ticks);
    let opt = |v: Option<u64>| v.map_or("null".to_string(), |v| v.to_string());
    let daemons: Vec<String> = r
        .daemons
        .iter()
        .map(|d| {
            let hops: Vec<String> = d.counted.hops.iter().map(|(h, s)| format!("{}:{:.6}", json_str(h), s)).collect();
            let starts: Vec<String> = d.counted.starts.iter().map(|(h, n)| format!("{}:{n}", json_str(h))).collect();
            let connections: Vec<String> = d.counted.connections.iter().map(|(h, n)| format!("{}:{n}", json_str(h))).collect();
            format!(
                "{{\"name\":{},\"pid\":{},\"before\":{},\"after\":{},\"peak_fds\":{},\"peak_threads\":{},\"rss_kib\":{{\"first\":{},\"last\":{},\"max\":{},\"middle_third_max\":{},\"last_third_max\":{}}},\"busy_seconds\":{{{}}},\"starts\":{{{}}},\"connections\":{{{}}},\"cpu_us_per_transfer\":{:.1}}}",
                json_str(d.name),
                d.pid,
                figs(&d.before),
                figs(&d.after),
                d.peak_fds,
                d.peak_threads,
                d.rss_first_kib,
                d.rss_last_kib,
                d.rss_max_kib,
                opt(d.rss_mid_max_kib),
                opt(d.rss_late_max_kib),
                hops.join(","),
                starts.join(","),
                connections.join(","),
                d.cpu_us_per(r.transfers)
            )
        })
        .collect();
    let judgement: Vec<String> = verdicts.iter().map(|v| format!("{{\"ok\":{},\"what\":{}}}", v.ok, json_str(&v.what))).collect();
    let errors: Vec<String> = r.kept.iter().map(|e| json_str(e)).collect();
    println!(
        "{{\"seconds\":{},\"clients\":{},\"tokens\":{},\"transport\":\"{}\",\"netns\":{},\"stream\":{},\"in_flight\":{},\"pinned\":{},\"device\":{},\"gpudirect\":\"{}\",\"src_layout\":{},\"dst_layout\":{},\"transfers\":{},\"checked\":{},\"errors\":{},\"mismatches\":{},\"transfers_per_s\":{:.3},\"per_client_min\":{},\"per_client_max\":{},\"latency_ms\":{{\"p50\":{:.3},\"p99\":{:.3},\"max\":{:.3}}},\"submit_call_ms\":{{\"p50\":{:.3},\"p99\":{:.3}}},\"bytes\":{},\"gb_per_s\":{:.4},\"daemons\":[{}],\"first_errors\":[{}],\"judgement\":[{}],\"ok\":{}}}",
        r.settings.seconds,
        r.settings.clients,
        r.settings.tokens,
        r.settings.transport,
        r.settings.netns,
        r.settings.stream,
        r.settings.in_flight,
        r.pinned.as_ref().map_or("null".to_string(), |(a, b)| json_str(&format!("{a}|{b}"))),
        r.settings.device,
        r.settings.gpudirect,
        json_str(SRC_LAYOUT),
        json_str(DST_LAYOUT),
        r.transfers,
        r.checked,
        r.errors,
        r.mismatches,
        r.transfers as f64 / secs,
        r.per_client.0,
        r.per_client.1,
        ms(percentile(&r.latencies, 0.50)),
        ms(percentile(&r.latencies, 0.99)),
        ms(r.latencies.last().copied().unwrap_or_default()),
        ms(percentile(&r.submits, 0.50)),
        ms(percentile(&r.submits, 0.99)),
        r.bytes,
        r.bytes as f64 / secs / 1e9,
        daemons.join(","),
        errors.join(","),
        judgement.join(","),
        verdicts.iter().all(|v| v.ok)
    );
}

fn print_text(r: &Report, verdicts: &[Verdict]) {
    let s = &r.settings;
    let secs = r.elapsed.as_secs_f64();
    println!(
        "kvwire-soak: {} s, {} clients, {} tokens, {}; {SRC_LAYOUT} -> {DST_LAYOUT}, fp16, {LAYERS} layers x {KV_HEADS} kv heads x {HEAD_DIM}",
        s.seconds,
        s.clients,
        s.tokens,
        match (s.netns, s.transport) {
            (true, _) => "tcp between two network namespaces (veth)",
            (false, "shm") => "shm (same-host shared memory)",
            (false, "verbs") => "verbs (the host's first RDMA device)",
            (false, _) => "tcp on loopback",
        }
    );
    if s.stream {
        println!("streamed submits: every layer announced right after the submit");
    }
    if s.in_flight > 1 {
        println!("{} transfers in flight per client: submitted back to back, then waited for", s.in_flight);
    }
    if let Some((src, dst)) = &r.pinned {
        println!("pinned as on two hosts: the source daemon and the engines on CPUs {src}, the destination daemon on CPUs {dst}");
    }
    if s.device {
        println!("caches registered as device memory (the stand-in backend's), gpudirect {}", s.gpudirect);
    }
    println!(
        "transfers {}  errors {}  {:.1}/s  (per client {}..{})",
        r.transfers,
        r.errors,
        r.transfers as f64 / secs,
        r.per_client.0,
        r.per_client.1
    );
    println!(
        "latency submit -> decoder_usable: p50 {:.3} ms  p99 {:.3} ms  max {:.3} ms",
        ms(percentile(&r.latencies, 0.50)),
        ms(percentile(&r.latencies, 0.99)),
        ms(r.latencies.last().copied().unwrap_or_default())
    );
    println!("submit call (the engine's thread held): p50 {:.3} ms  p99 {:.3} ms", ms(percentile(&r.submits, 0.50)), ms(percentile(&r.submits, 0.99)));
    println!("bytes moved {} ({:.3} GB/s)", r.bytes, r.bytes as f64 / secs / 1e9);
    for e in &r.kept {
        println!("  error: {e}");
    }
    // Where a transfer's time went, per side: each hop's busy time over
    // the run, per transfer.
    for d in &r.daemons {
        let per: Vec<String> = d.counted.hops.iter().map(|(h, s)| format!("{h} {:.1}", s * 1e6 / r.transfers.max(1) as f64)).collect();
        println!("{:<9} busy us per transfer: {}", d.name, if per.is_empty() { "(stats unreadable)".into() } else { per.join(", ") });
    }
    // What each side cost in CPU, beside the latency: on 2 cores a
    // transfer bound by CPU shows here, one bound by waits does not.
    let cpu: Vec<String> = r.daemons.iter().map(|d| format!("{} {:.0}", d.name, d.cpu_us_per(r.transfers))).collect();
    println!("cpu us per transfer (all threads): {}", cpu.join(", "));
    println!("{}", kvwire_bench::host_conditions());
    // Whether receives were announced and claimed (no round trip) or offered.
    for d in &r.daemons {
        let starts: Vec<String> = d.counted.starts.iter().map(|(how, n)| format!("{how} {n}")).collect();
        println!("{:<9} transfers began: {}", d.name, if starts.is_empty() { "(stats unreadable)".into() } else { starts.join(", ") });
    }
    // Whether transfers found a kept connection or opened one.
    for d in r.daemons.iter().filter(|d| d.counted.connections.iter().any(|(_, n)| *n > 0)) {
        let conns: Vec<String> = d.counted.connections.iter().map(|(how, n)| format!("{how} {n}")).collect();
        println!("{:<9} connections: {}", d.name, conns.join(", "));
    }
    println!(
        "{:<9} {:>7}  {:>24}  {:>22}  {:>26}",
        "daemon", "pid", "RSS MiB first/last/max", "fds before/peak/after", "threads before/peak/after"
    );
    for d in &r.daemons {
        println!(
            "{:<9} {:>7}  {:>24}  {:>22}  {:>26}",
            d.name,
            d.pid,
            format!("{:.1}/{:.1}/{:.1}", mib(d.rss_first_kib), mib(d.rss_last_kib), mib(d.rss_max_kib)),
            format!("{}/{}/{}", d.before.fds, d.peak_fds, d.after.fds),
            format!("{}/{}/{}", d.before.threads, d.peak_threads, d.after.threads)
        );
    }
    println!("judgement:");
    for v in verdicts {
        println!("  {}  {}", if v.ok { "ok  " } else { "FAIL" }, v.what);
    }
}

fn main() -> ExitCode {
    let parsed = raw_args(std::env::args().skip(1)).and_then(|raw| if raw.help { Err(String::new()) } else { settings(&raw) });
    let s = match parsed {
        Ok(s) => s,
        Err(e) if e.is_empty() => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("kvwire-soak: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    if s.netns && !netns::available() {
        eprintln!("kvwire-soak: --netns needs root and iproute2");
        return ExitCode::from(2);
    }
    let report = match soak(&s) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvwire-soak: {e}");
            return ExitCode::from(1);
        }
    };
    let verdicts = judge(&report);
    if s.json {
        print_json(&report, &verdicts);
    } else {
        print_text(&report, &verdicts);
    }
    let failed: Vec<&str> = verdicts.iter().filter(|v| !v.ok).map(|v| v.what.as_str()).collect();
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        eprintln!("kvwire-soak: FAILED: {}", failed.join("; "));
        ExitCode::from(1)
    }
}
