//! verbs backend on a real RDMA device: two endpoints on the same device
//! (two RC QPs, loopback), writing into each other's registered memory.
//!
//! These tests need a device. Without one they print `SKIPPED: …` and
//! return — unless `KVWIRE_REQUIRE_RDMA=1`, which is how the soft-RoCE VM
//! run invokes them, and then they fail loudly:
//!
//! ```text
//! cargo test -p kvwire-transport --test it --no-run   # note the binary path
//! KVWIRE_REQUIRE_RDMA=1 scripts/softroce-vm -- target/debug/deps/it-HASH verbs --test-threads=1
//! ```
//!
//! `KVWIRE_RDMA_DEVICE` and `KVWIRE_GID_INDEX` pick a device and GID
//! (default: the first device, its IPv4-mapped RoCE v2 GID).

use kvwire_core::protocol::{Header, HelloError, Kind, VerbsAddr, HEADER_LEN, PROTOCOL_VERSION};
use kvwire_transport::verbs::{VerbsEndpoint, VerbsLimits};
use kvwire_transport::{Batch, Completion, Connection, Endpoint, Hello, HostMem, Hop, Tag, TransportError, WriteOp};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

const CANARY: u8 = 0xA5;
/// Canary bytes on each side of every destination window.
const PAD: u64 = 4096;
const WAIT: Duration = Duration::from_secs(30);

fn required() -> bool {
    std::env::var("KVWIRE_REQUIRE_RDMA").as_deref() == Ok("1")
}

fn limits(node: &str) -> VerbsLimits {
    VerbsLimits { node: node.into(), ..VerbsLimits::default() }
}

/// Opens an endpoint, or says why the test is skipped (and fails when a
/// device is required).
fn endpoint(l: VerbsLimits) -> Option<VerbsEndpoint> {
    let dev = std::env::var("KVWIRE_RDMA_DEVICE").ok();
    let gid = std::env::var("KVWIRE_GID_INDEX").ok().map(|s| s.parse::<u32>().expect("KVWIRE_GID_INDEX is a number"));
    match VerbsEndpoint::new(dev.as_deref(), 1, gid, l) {
        Ok(ep) => Some(ep),
        Err(TransportError::NoDevice(msg)) => {
            if required() {
                panic!("KVWIRE_REQUIRE_RDMA=1 but there is NO RDMA DEVICE: {msg}");
            }
            let why = format!(
                "no RDMA device (run scripts/softroce-vm -- target/debug/deps/it-HASH verbs, \
                 or set one up with scripts/softroce-up): {msg}"
            );
            kvwire_testkit::skip(&kvwire_testkit::current_test(), kvwire_testkit::Need::Rdma, &why);
            None
        }
        Err(e) => panic!("opening the RDMA device failed: {e}"),
    }
}

/// Source and destination endpoints on the same device.
fn pair(src_limits: VerbsLimits) -> Option<(VerbsEndpoint, VerbsEndpoint)> {
    let src = endpoint(src_limits)?;
    let dst = endpoint(limits("dst"))?;
    // Open before any window is granted: grants name the session's node.
    crate::conformance::open_session(&src, &dst);
    let i = src.info();
    eprintln!("device {} port {} gid index {} mtu enum {}", i.device, i.port, i.gid_index, i.mtu);
    Some((src, dst))
}

/// Deterministic, position-dependent bytes (never the canary pattern everywhere).
fn pattern(len: u64, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i.wrapping_mul(31) as u8).wrapping_add(seed) ^ ((i >> 8) as u8)).collect()
}

fn source(len: u64, seed: u8) -> (Arc<HostMem>, Vec<u8>) {
    let mem = Arc::new(HostMem::new("verbs-src", len).expect("source memory"));
    let bytes = pattern(len, seed);
    mem.write(0, &bytes).expect("fill source");
    (mem, bytes)
}

/// Destination memory: `win` bytes with `PAD` canary bytes on each side.
struct Dst {
    mem: Arc<HostMem>,
    key: u32,
    rkey: u32,
    /// What every byte of `mem` must be: canary, plus what was written.
    model: Vec<u8>,
}

impl Dst {
    /// Open to the test session's writes tagged with `slot`.
    fn new(ep: &VerbsEndpoint, slot: u16, win: u64) -> Dst {
        let total = win + 2 * PAD;
        let mem = Arc::new(HostMem::new("verbs-dst", total).expect("destination memory"));
        mem.write(0, &vec![CANARY; total as usize]).expect("canary fill");
        let region = ep.register(mem.clone(), PAD, win, crate::conformance::grant(ep, slot)).expect("register destination window");
        let desc = ep.desc(region.key).expect("descriptor of a registered region");
        assert_eq!(desc.addr, mem.as_ptr() as u64 + PAD, "descriptor address is the window's address");
        assert_eq!(desc.len, win);
        Dst { mem, key: region.key, rkey: desc.key, model: vec![CANARY; total as usize] }
    }

    /// Records that `src[src_off..+len]` lands at window offset `dst_off`.
    fn apply(&mut self, src: &[u8], w: &WriteOp) {
        let (s, d, n) = (w.src_offset as usize, (PAD + w.dst_offset) as usize, w.len as usize);
        self.model[d..d + n].copy_from_slice(&src[s..s + n]);
    }

    /// Byte-for-byte comparison of the whole mapping (window and canaries).
    fn check(&self, what: &str) {
        let mut got = vec![0u8; self.model.len()];
        self.mem.read(0, &mut got).expect("read destination");
        if let Some(i) = (0..got.len()).find(|&i| got[i] != self.model[i]) {
            let zone = if (i as u64) < PAD || i as u64 >= got.len() as u64 - PAD { "canary" } else { "window" };
            panic!(
                "{what}: destination byte {i} ({zone}, window offset {}) is {:#04x}, expected {:#04x}",
                i as i64 - PAD as i64,
                got[i],
                self.model[i]
            );
        }
    }
}

/// Posts `w` alone under `tag` on `conn` and checks it landed in `d`
/// ([`batch_lands`]) and every byte of `d` (`what` names it).
fn write_lands(conn: &mut dyn Connection, dst_ep: &VerbsEndpoint, d: &mut Dst, sbytes: &[u8], tag: Tag, w: WriteOp, what: &str) {
    batch_lands(conn, dst_ep, tag, &[w]);
    d.apply(sbytes, &w);
    d.check(what);
}

/// A connection from `src` to `dst`, once `dst` has the test session open
/// for `src`, as a destination daemon does after the peer handshake.
fn connect(src: &VerbsEndpoint, dst: &VerbsEndpoint) -> Result<Box<dyn Connection>, TransportError> {
    crate::conformance::open_session(src, dst);
    src.connect(&dst.local_addr(), crate::conformance::cred())
}

/// Polls until `n` completions arrived.
fn wait_completions(conn: &mut dyn Connection, n: usize) -> Vec<Completion> {
    let start = Instant::now();
    let mut out = Vec::new();
    while out.len() < n {
        assert!(start.elapsed() < WAIT, "only {} of {n} completions after {WAIT:?}", out.len());
        out.extend(conn.poll(Duration::from_millis(100)).expect("poll"));
    }
    assert_eq!(out.len(), n, "more completions than batches");
    out
}

fn ok(c: &Completion) {
    if let Err(e) = &c.result {
        panic!("batch {:?} ({:?}) failed: {e}", c.batch, c.tag);
    }
}

/// A real dmabuf over `mem` (a sealed memfd), through the kernel's
/// udmabuf driver, where it has one.
fn udmabuf(mem: &HostMem) -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::{AsRawFd, FromRawFd};
    #[repr(C)]
    struct Create {
        memfd: u32,
        flags: u32,
        offset: u64,
        size: u64,
    }
    nix::ioctl_write_ptr!(udmabuf_create, b'u', 0x42, Create);
    let dev = std::fs::OpenOptions::new().read(true).write(true).open("/dev/udmabuf").ok()?;
    let arg = Create { memfd: mem.fd().as_raw_fd() as u32, flags: 0, offset: 0, size: mem.len() };
    // SAFETY: `arg` is the driver's struct, alive for the call; the fd it
    // returns is new and ours.
    let fd = unsafe { udmabuf_create(dev.as_raw_fd(), &arg) }.ok()?;
    Some(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

#[test]
fn verbs_dmabuf_registration_is_a_real_call_whose_refusal_names_the_verb() {
    let Some(ep) = endpoint(limits("dmabuf")) else { return };
    let mem = HostMem::new("dmabuf", 1 << 16).unwrap();
    let dmabuf = udmabuf(&mem);
    let what = if dmabuf.is_some() { "a udmabuf" } else { "a memfd (no /dev/udmabuf on this kernel)" };
    let fd = dmabuf.as_ref().map_or(mem.fd(), |f| std::os::fd::AsFd::as_fd(f));
    match ep.register_dmabuf(fd, mem.len(), 0x7f00_0000_0000, None) {
        // A device that registers dmabufs: the key is reserved until revoked.
        Ok(key) => {
            eprintln!("{} registered {what} as key {key:#010x}", ep.info().device);
            assert!(ep.registry().is_reserved(key));
            assert!(ep.revoke(key) && !ep.registry().is_reserved(key) && !ep.revoke(key));
        }
        // soft-RoCE cannot: the refusal names the verb and the device, and
        // nothing is reserved.
        Err(e) => {
            let t = e.to_string();
            eprintln!("{} refused {what}: {t}", ep.info().device);
            assert!(t.contains("ibv_reg_dmabuf_mr") && t.contains(&ep.info().device), "{t}");
        }
    }
    // Plain regions still register beside it.
    ep.register_all(Arc::new(HostMem::new("after", 4096).unwrap()), None).expect("a region after the dmabuf attempt");
}

#[test]
fn verbs_no_device_or_unknown_device_is_a_clear_error() {
    // Runs everywhere: on a host without RDMA the message must say how to get
    // a device; with a device, asking for a missing one names the ones present.
    match VerbsEndpoint::new(Some("kvwire-no-such-dev"), 1, None, limits("x")) {
        Ok(_) => panic!("a device named kvwire-no-such-dev opened"),
        Err(TransportError::NoDevice(msg)) => {
            eprintln!("error: {msg}");
            assert!(
                msg.contains("rdma link add") || msg.contains("not found; present:"),
                "the no-device message must say how to create one or list devices: {msg}"
            );
            if required() {
                assert!(msg.contains("not found; present:"), "KVWIRE_REQUIRE_RDMA=1 but no device is present: {msg}");
            }
        }
        Err(e) => panic!("expected NoDevice, got {e}"),
    }
}

#[test]
fn verbs_one_segment_write() {
    let Some((src, dst_ep)) = pair(limits("src")) else { return };
    let (smem, sbytes) = source(64 * 1024, 7);
    let sreg = src.register_all(smem, None).expect("register source");
    let mut dst = Dst::new(&dst_ep, 1, 16 * 1024);
    let mut conn = connect(&src, &dst_ep).expect("connect");
    assert_eq!(conn.remote().transport, "verbs");
    assert!(conn.remote().regions.iter().any(|d| d.key == dst.rkey), "peer hello lists the region by rkey");

    let tag = Tag { slot: 1, layer: 0 };
    let w = WriteOp { src_key: sreg.key, src_offset: 100, dst_key: dst.rkey, dst_offset: 300, len: 4096, stride: None };
    dst_ep.placement().expect(tag, w.len).expect("expect");
    let id = conn.post(Batch { tag, writes: vec![w] }).expect("post");
    let c = wait_completions(conn.as_mut(), 1);
    assert_eq!(c[0].batch, id);
    assert_eq!(c[0].bytes, 4096);
    ok(&c[0]);
    dst_ep.placement().wait(tag, WAIT).expect("layer flag");
    assert_eq!(dst_ep.placement().placed_bytes(tag), 4096);
    dst.apply(&sbytes, &w);
    dst.check("one-segment write");
}

#[test]
fn verbs_scatter_write_of_many_segments() {
    // A small send queue, so the 600 writes are posted in several chunks.
    let Some((src, dst_ep)) = pair(VerbsLimits { send_depth: 64, ..limits("src") }) else { return };
    let (smem, sbytes) = source(1 << 20, 3);
    let sreg = src.register_all(smem, None).expect("register source");
    let mut dst = Dst::new(&dst_ep, 2, 2 << 20);
    let mut conn = connect(&src, &dst_ep).expect("connect");

    // Segments of varied length at scattered, non-overlapping destination
    // offsets, posted in a permuted order.
    let mut lcg = 0x2545_F491_4F6C_DD1Du64;
    let mut next = |m: u64| {
        lcg = lcg.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (lcg >> 33) % m
    };
    let mut writes = Vec::new();
    let mut dst_at = 0u64;
    for _ in 0..600 {
        let len = 1 + next(3000);
        let src_offset = next((1 << 20) - len);
        dst_at += next(64); // gaps stay canary
        writes.push(WriteOp { src_key: sreg.key, src_offset, dst_key: dst.rkey, dst_offset: dst_at, len, stride: None });
        dst_at += len;
    }
    assert!(dst_at <= 2 << 20);
    for i in (1..writes.len()).rev() {
        let j = next(i as u64 + 1) as usize;
        writes.swap(i, j);
    }
    batch_lands(conn.as_mut(), &dst_ep, Tag { slot: 2, layer: 5 }, &writes);
    for w in &writes {
        dst.apply(&sbytes, w);
    }
    dst.check("scatter write");
}

/// Posts `writes` as one batch under `tag`; checks it completed with every
/// byte, and the destination placed them all and raised the layer's flag.
fn batch_lands(conn: &mut dyn Connection, dst_ep: &VerbsEndpoint, tag: Tag, writes: &[WriteOp]) {
    let total: u64 = writes.iter().map(|w| w.len).sum();
    dst_ep.placement().expect(tag, total).expect("expect");
    conn.post(Batch { tag, writes: writes.to_vec() }).expect("post");
    let c = wait_completions(conn, 1);
    ok(&c[0]);
    assert_eq!(c[0].bytes, total);
    dst_ep.placement().wait(tag, WAIT).expect("layer flag");
    assert_eq!(dst_ep.placement().placed_bytes(tag), total);
}

#[test]
fn verbs_writes_that_continue_at_the_peer_gather_into_few_work_requests() {
    let Some((src, dst_ep)) = pair(limits("src")) else { return };
    let sge = src.info().send_sge;
    assert!(sge > 1, "{} gathers {sge} SGE per write", src.info().device);
    let (amem, abytes) = source(1 << 20, 5);
    let (bmem, bbytes) = source(1 << 20, 9);
    let a = src.register_all(amem, None).expect("register source a");
    let b = src.register_all(bmem, None).expect("register source b");
    let mut dst = Dst::new(&dst_ep, 3, 1 << 20);
    let mut conn = connect(&src, &dst_ep).expect("connect");
    // Pieces back to back at the peer, read alternately from two regions at
    // scattered offsets: more pieces than one work request gathers.
    let n = 3 * u64::from(sge) + 1;
    let mut writes = Vec::new();
    let mut at = 4096u64;
    for i in 0..n {
        let len = 512 + 97 * i;
        let (key, src_offset) = if i % 2 == 0 { (a.key, (i * 7919) % ((1 << 20) - len)) } else { (b.key, (i * 104_729) % ((1 << 20) - len)) };
        writes.push(WriteOp { src_key: key, src_offset, dst_key: dst.rkey, dst_offset: at, len, stride: None });
        at += len;
    }
    batch_lands(conn.as_mut(), &dst_ep, Tag { slot: 3, layer: 1 }, &writes);
    for w in &writes {
        dst.apply(if w.src_key == a.key { &abytes } else { &bbytes }, w);
    }
    dst.check("gathered writes");
    // One note names the range they covered, not one per write.
    assert_eq!(conn.framing_bytes(), kvwire_core::protocol::NOTE_LEN as u64);
}

#[test]
fn verbs_layer_flags_only_after_the_last_byte() {
    let Some((src, dst_ep)) = pair(limits("src")) else { return };
    let (smem, sbytes) = source(256 * 1024, 11);
    let sreg = src.register_all(smem, None).expect("register source");
    let layer_len = 48 * 1024u64;
    let layers = 4u16;
    let mut dst = Dst::new(&dst_ep, 3, layer_len * u64::from(layers));
    let mut conn = connect(&src, &dst_ep).expect("connect");
    let slot = 3;

    // Each layer: three batches of unequal size; the last one is held back.
    let mut held = Vec::new();
    let mut posted = 0usize;
    for layer in [3u16, 1, 0, 2] {
        let tag = Tag { slot, layer };
        dst_ep.placement().expect(tag, layer_len).expect("expect");
        let base = u64::from(layer) * layer_len;
        let cuts = [0, 10_000, 30_000, layer_len];
        let mut batches: Vec<Batch> = (0..3)
            .map(|k| {
                let (a, b) = (cuts[k], cuts[k + 1]);
                // Two writes per batch, second half first.
                let mid = a + (b - a) / 2;
                let w = |from: u64, to: u64| WriteOp {
                    src_key: sreg.key,
                    src_offset: (base + from) % (200 * 1024),
                    dst_key: dst.rkey,
                    dst_offset: base + from,
                    len: to - from,
                    stride: None,
                };
                Batch { tag, writes: vec![w(mid, b), w(a, mid)] }
            })
            .collect();
        held.push(batches.pop().expect("three batches"));
        for b in batches.into_iter().rev() {
            for w in &b.writes {
                dst.apply(&sbytes, w);
            }
            conn.post(b).expect("post");
            posted += 1;
        }
    }
    for c in wait_completions(conn.as_mut(), posted) {
        ok(&c);
    }
    // Every posted byte has completed locally (RC: it is in destination
    // memory); give the destination's poller time to count it.
    std::thread::sleep(Duration::from_millis(200));
    for b in &held {
        let t = b.tag;
        assert_eq!(dst_ep.placement().placed_bytes(t), layer_len - b.bytes(), "layer {} counted bytes", t.layer);
        assert_eq!(dst_ep.placement().flags().ready(t), None, "layer {} flag published before its last byte", t.layer);
    }
    dst.check("before the held batches");

    // Release the held batches one by one: only that layer becomes ready.
    for (i, b) in held.clone().into_iter().enumerate() {
        let t = b.tag;
        for w in &b.writes {
            dst.apply(&sbytes, w);
        }
        conn.post(b).expect("post held batch");
        ok(&wait_completions(conn.as_mut(), 1)[0]);
        dst_ep.placement().wait(t, WAIT).expect("layer flag after its last batch");
        assert_eq!(dst_ep.placement().placed_bytes(t), layer_len);
        for later in &held[i + 1..] {
            assert_eq!(dst_ep.placement().flags().ready(later.tag), None, "layer {} ready too early", later.tag.layer);
        }
    }
    dst.check("all layers");
}

#[test]
fn verbs_source_released_only_after_local_completion() {
    let Some((src, dst_ep)) = pair(limits("src")) else { return };
    let (smem, sbytes) = source(1 << 20, 5);
    let sreg = src.register_all(smem.clone(), None).expect("register source");
    let mut dst = Dst::new(&dst_ep, 4, 1 << 20);
    let mut conn = connect(&src, &dst_ep).expect("connect");
    let hops = src.placement().hops().clone();
    let (wire0, post0) = (hops.summary(Hop::Wire).count, hops.summary(Hop::Post).count);
    let wire_bytes0 = hops.summary(Hop::Wire).bytes;

    let tag = Tag { slot: 4, layer: 0 };
    let w = WriteOp { src_key: sreg.key, src_offset: 0, dst_key: dst.rkey, dst_offset: 0, len: 1 << 20, stride: None };
    dst_ep.placement().expect(tag, w.len).expect("expect");
    let id = conn.post(Batch { tag, writes: vec![w] }).expect("post");
    // Posted is not complete: the batch is pending until poll reports it.
    assert_eq!(conn.pending(), 1);
    assert_eq!(hops.summary(Hop::Wire).count, wire0, "no wire sample before the completion is polled");
    assert_eq!(hops.summary(Hop::Post).count, post0 + 1);
    let c = wait_completions(conn.as_mut(), 1);
    assert_eq!(c[0].batch, id);
    ok(&c[0]);
    assert_eq!(conn.pending(), 0);
    assert_eq!(hops.summary(Hop::Wire).count, wire0 + 1);
    assert_eq!(hops.summary(Hop::Wire).bytes - wire_bytes0, 1 << 20);

    // source_released: the NIC is done reading, so overwriting the source now
    // must not change what the destination holds.
    dst.apply(&sbytes, &w);
    smem.write(0, &vec![0u8; 1 << 20]).expect("overwrite source");
    dst_ep.placement().wait(tag, WAIT).expect("layer flag");
    std::thread::sleep(Duration::from_millis(50));
    dst.check("after the source was overwritten");
    assert!(conn.poll(Duration::from_millis(10)).expect("poll").is_empty(), "a batch completes exactly once");
}

#[test]
fn verbs_bad_writes_are_refused_locally_before_posting() {
    let Some((src, dst_ep)) = pair(limits("src")) else { return };
    let (smem, sbytes) = source(64 * 1024, 9);
    let sreg = src.register_all(smem, None).expect("register source");
    let mut dst = Dst::new(&dst_ep, 5, 8192);
    let mut conn = connect(&src, &dst_ep).expect("connect");
    let tag = Tag { slot: 5, layer: 1 };
    let good = WriteOp { src_key: sreg.key, src_offset: 0, dst_key: dst.rkey, dst_offset: 0, len: 1024, stride: None };
    let unknown_rkey = dst.rkey.wrapping_add(0x1234_5678);
    type Case = (&'static str, WriteOp, fn(&TransportError) -> bool);
    let cases: Vec<Case> = vec![
        ("unknown remote key", WriteOp { dst_key: unknown_rkey, ..good }, |e| {
            matches!(e, TransportError::Refused(m) if m.contains("unknown or revoked remote key"))
        }),
        ("destination past the end", WriteOp { dst_offset: 8000, len: 1024, ..good }, |e| {
            matches!(e, TransportError::Refused(m) if m.contains("exceeds region"))
        }),
        ("destination offset overflow", WriteOp { dst_offset: u64::MAX - 10, ..good }, |e| {
            matches!(e, TransportError::Refused(m) if m.contains("exceeds region"))
        }),
        ("zero length", WriteOp { len: 0, ..good }, |e| matches!(e, TransportError::Refused(m) if m.contains("zero-length"))),
        ("unknown source key", WriteOp { src_key: sreg.key ^ 0x5a5a, ..good }, |e| {
            matches!(e, TransportError::Source(m) if m.contains("not registered"))
        }),
        ("source past the end", WriteOp { src_offset: 64 * 1024 - 10, ..good }, |e| {
            matches!(e, TransportError::Source(m) if m.contains("exceed local region"))
        }),
    ];
    for (what, bad, want) in cases {
        // The good write first: the whole batch must be refused, nothing posted.
        let err = conn.post(Batch { tag, writes: vec![good, bad] }).expect_err(what);
        eprintln!("{what}: {err}");
        assert!(want(&err), "{what}: unexpected error {err:?}");
        assert_eq!(conn.pending(), 0, "{what}: something was posted");
    }
    assert!(conn.post(Batch { tag, writes: vec![] }).is_err(), "an empty batch is refused");
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(dst_ep.placement().placed_bytes(tag), 0, "refused batches placed bytes");
    dst.check("after refused batches");

    // The connection still serves a good batch.
    write_lands(conn.as_mut(), &dst_ep, &mut dst, &sbytes, tag, good, "good write after refusals");
}

#[test]
fn verbs_write_after_revoke_fails_and_leaves_the_destination_untouched() {
    let Some((src, dst_ep)) = pair(limits("src")) else { return };
    let (smem, sbytes) = source(64 * 1024, 13);
    let sreg = src.register_all(smem, None).expect("register source");
    let revoked = Dst::new(&dst_ep, 6, 16 * 1024);
    let mut other = Dst::new(&dst_ep, 6, 16 * 1024);
    let mut conn = connect(&src, &dst_ep).expect("connect");
    assert!(conn.remote().regions.iter().any(|d| d.key == revoked.rkey));

    // The destination fences the region after the handshake advertised it.
    assert!(dst_ep.revoke(revoked.key));
    assert!(dst_ep.desc(revoked.key).is_none());
    let tag = Tag { slot: 6, layer: 0 };
    let w = WriteOp { src_key: sreg.key, src_offset: 0, dst_key: revoked.rkey, dst_offset: 0, len: 8192, stride: None };
    conn.post(Batch { tag, writes: vec![w] }).expect("post (the key was valid at handshake time)");
    let c = wait_completions(conn.as_mut(), 1);
    match &c[0].result {
        Err(TransportError::Verbs { message, .. }) => {
            eprintln!("completion error: {}", c[0].result.as_ref().unwrap_err());
            assert!(message.contains("remote access error"), "not an actionable remote-access error: {message}");
        }
        other => panic!("write to a revoked region completed with {other:?}"),
    }
    std::thread::sleep(Duration::from_millis(100));
    revoked.check("revoked region");
    assert_eq!(dst_ep.placement().placed_bytes(tag), 0, "bytes counted for a refused write");
    assert_eq!(dst_ep.placement().flags().ready(tag), None);

    // That QP is in the error state: the connection says so and refuses.
    let again = conn.post(Batch { tag, writes: vec![WriteOp { dst_key: other.rkey, ..w }] }).expect_err("post on a failed QP");
    assert!(again.to_string().contains("reconnect"), "{again}");

    // The endpoint keeps serving: a new connection writes into the other region,
    // and no longer sees the revoked one.
    let mut conn2 = connect(&src, &dst_ep).expect("reconnect");
    assert!(!conn2.remote().regions.iter().any(|d| d.key == revoked.rkey), "revoked region still advertised");
    let err = conn2.post(Batch { tag, writes: vec![w] }).expect_err("revoked key refused locally on a new connection");
    assert!(matches!(err, TransportError::Refused(_)), "{err:?}");
    let tag2 = Tag { slot: 6, layer: 1 };
    let w2 = WriteOp { src_key: sreg.key, src_offset: 500, dst_key: other.rkey, dst_offset: 1000, len: 8192, stride: None };
    write_lands(conn2.as_mut(), &dst_ep, &mut other, &sbytes, tag2, w2, "other region");
    revoked.check("revoked region, at the end");
}

fn send_frame(s: &mut TcpStream, kind: Kind, payload: &[u8]) {
    let h = Header { kind, tag: Tag { slot: 0, layer: 0 }, key: 0, seq: 0, offset: 0, len: payload.len() as u64 };
    s.write_all(&h.encode()).expect("send header");
    s.write_all(payload).expect("send payload");
}

fn recv_frame(s: &mut TcpStream) -> (Header, Vec<u8>) {
    let mut hb = [0u8; HEADER_LEN];
    s.read_exact(&mut hb).expect("frame header");
    let h = Header::decode(&hb, 0).expect("valid header");
    let mut p = vec![0u8; h.len as usize];
    s.read_exact(&mut p).expect("frame payload");
    (h, p)
}

fn fake_hello(version: u32, transport: &str) -> Hello {
    Hello {
        version,
        transport: transport.into(),
        node: "impostor".into(),
        regions: vec![],
        verbs: Some(VerbsAddr { qpn: 0x42, psn: 1, gid: [0; 16], lid: 0, mtu: 3 }),
        session: None,
        nonce: String::new(),
        proof: String::new(),
    }
}

#[test]
fn verbs_handshake_refuses_another_protocol_version() {
    let Some(ep) = endpoint(limits("ep")) else { return };

    // A client speaking version 999 (or another transport) gets a Nack that says why.
    for (hello, want) in [(fake_hello(999, "verbs"), "protocol version 999"), (fake_hello(PROTOCOL_VERSION, "tcp"), "transport `tcp`")] {
        let mut s = TcpStream::connect(ep.local_addr()).expect("connect");
        s.set_read_timeout(Some(WAIT)).expect("timeout");
        assert_eq!(recv_frame(&mut s).0.kind, Kind::Challenge);
        send_frame(&mut s, Kind::Hello, &hello.encode());
        let (h, p) = recv_frame(&mut s);
        let msg = String::from_utf8_lossy(&p);
        eprintln!("server answered {:?}: {msg}", h.kind);
        assert_eq!(h.kind, Kind::Nack, "{msg}");
        assert!(msg.contains(want), "Nack does not say `{want}`: {msg}");
    }

    // A server answering with version 999: connect fails with the version error.
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr").to_string();
    let server = std::thread::spawn(move || {
        let (mut s, _) = l.accept().expect("accept");
        send_frame(&mut s, Kind::Challenge, &[1u8; 32]);
        let (h, p) = recv_frame(&mut s);
        assert_eq!(h.kind, Kind::Hello);
        let theirs = Hello::decode(&p, "verbs").expect("the endpoint's hello is valid");
        assert!(theirs.verbs.is_some(), "a verbs hello carries QP data");
        send_frame(&mut s, Kind::Hello, &fake_hello(999, "verbs").encode());
    });
    let err = ep.connect(&addr, crate::conformance::cred()).map(|_| ()).expect_err("connect to a version-999 peer");
    server.join().expect("fake server");
    eprintln!("connect error: {err}");
    assert_eq!(
        err,
        TransportError::Hello(HelloError::Version { node: "impostor".into(), theirs: 999, ours: PROTOCOL_VERSION })
    );

    // And the endpoint still serves a real peer afterwards.
    let Some(other) = endpoint(limits("other")) else { return };
    let conn = connect(&other, &ep).expect("real peer connects after the refusals");
    assert_eq!(conn.remote().node, "ep");
}

/// The shared contract, on two QPs of the same device.
fn conformance_pair() -> Option<crate::conformance::Pair> {
    let (src, dst) = pair(limits("src"))?;
    Some(crate::conformance::Pair::new(Arc::new(src), Arc::new(dst)))
}

mod contract {
    crate::conformance_tests!(optional super::conformance_pair);
}

/// A second device as a rail of `ep`: `KVWIRE_RDMA_DEVICE2` (default
/// `rxe1`, what `scripts/softroce-vm -n two` makes). Skipped without one,
/// unless `KVWIRE_REQUIRE_RDMA_RAILS=1`.
fn second_rail(ep: &VerbsEndpoint) -> Option<VerbsEndpoint> {
    let dev = std::env::var("KVWIRE_RDMA_DEVICE2").unwrap_or_else(|_| "rxe1".into());
    match ep.rail(Some(&dev), 1, None, "127.0.0.1:0") {
        Ok(r) => Some(r),
        Err(TransportError::NoDevice(msg)) => {
            if std::env::var("KVWIRE_REQUIRE_RDMA_RAILS").as_deref() == Ok("1") {
                panic!("KVWIRE_REQUIRE_RDMA_RAILS=1 but there is no second RDMA device: {msg}");
            }
            let why = format!("no second RDMA device (run scripts/softroce-vm -n two): {msg}");
            kvwire_testkit::skip(&kvwire_testkit::current_test(), kvwire_testkit::Need::Rdma, &why);
            None
        }
        Err(e) => panic!("opening the second RDMA device failed: {e}"),
    }
}

#[test]
fn verbs_rails_share_keys_and_count_a_range_written_twice_once() {
    let Some((src, dst_ep)) = pair(limits("src")) else { return };
    let Some(src1) = second_rail(&src) else { return };
    let dst1 = second_rail(&dst_ep).expect("second rail of the destination");
    assert_ne!(src.info().device, src1.info().device, "the rail is another device");
    let len = 256 * 1024u64;
    let (smem, sbytes) = source(len, 21);
    let sreg = src.register_all(smem, None).expect("register source");
    src1.attach(&sreg).expect("attach source to rail 1");
    let mut dst = Dst::new(&dst_ep, 4, len);
    let dreg = dst_ep.registry().get(dst.key).expect("destination region");
    dst1.attach(&dreg).expect("attach destination to rail 1");
    // One key on both rails, each rail's own rkey.
    let d0 = dst_ep.desc(dst.key).expect("rail 0 descriptor");
    let d1 = dst1.desc(dst.key).expect("rail 1 descriptor");
    assert_eq!((d0.key, d1.key), (dst.key, dst.key));
    assert_eq!((d0.addr, d0.len), (d1.addr, d1.len));
    assert!(d1.rkey.is_some() && d0.rkey.is_some());

    let tag = Tag { slot: 4, layer: 2 };
    dst_ep.placement().expect(tag, len).expect("expect");
    let mut c0 = connect(&src, &dst_ep).expect("connect rail 0");
    let mut c1 = connect(&src1, &dst1).expect("connect rail 1");
    assert!(c1.remote().regions.iter().any(|d| d.key == dst.key && d.rkey == d1.rkey), "rail 1's hello: shared key, own rkey");
    // Rail 0 carries the first half; then rail 1 carries everything, as
    // when a slice is sent again after its first rail failed midway.
    let w = |from: u64, n: u64| WriteOp { src_key: sreg.key, src_offset: from, dst_key: dst.key, dst_offset: from, len: n, stride: None };
    c0.post(Batch { tag, writes: vec![w(0, len / 2)] }).expect("post on rail 0");
    ok(&wait_completions(c0.as_mut(), 1)[0]);
    let start = Instant::now();
    while dst_ep.placement().placed_bytes(tag) < len / 2 {
        assert!(start.elapsed() < WAIT, "rail 0's note never counted");
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(dst_ep.placement().flags().ready(tag).is_none(), "half a layer must not publish");
    c1.post(Batch { tag, writes: vec![w(0, len / 4), w(len / 4, len - len / 4)] }).expect("post on rail 1");
    ok(&wait_completions(c1.as_mut(), 1)[0]);
    dst_ep.placement().wait(tag, WAIT).expect("layer flag");
    assert_eq!(dst_ep.placement().placed_bytes(tag), len, "each byte counted once, whichever rails carried it");
    dst.apply(&sbytes, &w(0, len));
    dst.check("two rails, a range written twice");

    // Revoking through the shared registry and on the rail fences rail 1 too.
    assert!(dst_ep.revoke(dst.key));
    dst1.revoke(dst.key);
    assert!(dst1.desc(dst.key).is_none(), "the rail deregistered its MR");
}

#[test]
fn verbs_a_kept_connection_asks_for_the_regions_granted_after_its_hello() {
    // A kept connection carries later transfers, whose windows the
    // destination grants after this connection's hello: a write to a key
    // the hello did not list asks the peer on the handshake stream.
    let Some((src, dst_ep)) = pair(limits("src")) else { return };
    let (smem, sbytes) = source(64 * 1024, 21);
    let sreg = src.register_all(smem, None).expect("register source");
    let mut conn = connect(&src, &dst_ep).expect("connect");
    for (i, slot) in [7u16, 8, 9].into_iter().enumerate() {
        let mut d = Dst::new(&dst_ep, slot, 16 * 1024);
        assert!(!conn.remote().regions.iter().any(|r| r.key == d.rkey), "transfer {i}: granted after the hello");
        let tag = Tag { slot, layer: 0 };
        let w = WriteOp { src_key: sreg.key, src_offset: 100 * i as u64, dst_key: d.rkey, dst_offset: 64, len: 8192, stride: None };
        write_lands(conn.as_mut(), &dst_ep, &mut d, &sbytes, tag, w, "window granted after the hello");
        assert!(conn.reusable(), "transfer {i}: open, nothing outstanding");
        // The transfer ends: its window is revoked, the connection kept.
        assert!(dst_ep.revoke(d.key));
    }
    // A key the peer never granted is still refused here, by name, after asking.
    let w = WriteOp { src_key: sreg.key, src_offset: 0, dst_key: 0x5eed, dst_offset: 0, len: 64, stride: None };
    let err = conn.post(Batch { tag: Tag { slot: 7, layer: 1 }, writes: vec![w] }).expect_err("a key never granted");
    assert!(matches!(&err, TransportError::Refused(m) if m.contains("0x00005eed")), "{err:?}");
    assert!(conn.reusable(), "a refusal before posting leaves the connection usable");
}

#[test]
fn verbs_after_the_handshake_only_a_request_for_regions_is_answered() {
    let Some((src, dst_ep)) = pair(limits("src")) else { return };
    let d = Dst::new(&dst_ep, 3, 4096);
    // A real connection, for the destination's QP address (a raw client's
    // QP points at a QP number that never answers: its handshake still
    // completes, and nothing here sends over it).
    let real = connect(&src, &dst_ep).expect("connect");
    let theirs = real.remote().verbs.expect("a verbs hello carries QP data");
    let raw = || {
        let mut s = TcpStream::connect(dst_ep.local_addr()).expect("connect");
        s.set_read_timeout(Some(WAIT)).expect("timeout");
        let mut w = s.try_clone().expect("clone");
        let ours = Hello {
            version: PROTOCOL_VERSION,
            transport: "verbs".into(),
            node: "src".into(),
            regions: vec![],
            verbs: Some(VerbsAddr { qpn: 0x42, psn: 1, ..theirs }),
            session: None,
            nonce: String::new(),
            proof: String::new(),
        };
        let hello = kvwire_transport::hello::initiate(&mut s, &mut w, "verbs", crate::conformance::cred(), ours).expect("raw handshake");
        assert!(hello.regions.iter().any(|r| r.key == d.rkey));
        s
    };
    // An empty Hello asks for the regions: our hello comes back, listing them.
    let mut s = raw();
    send_frame(&mut s, Kind::Hello, &[]);
    let (h, p) = recv_frame(&mut s);
    assert_eq!(h.kind, Kind::Hello);
    let listed = Hello::decode(&p, "verbs").expect("a hello");
    assert!(listed.regions.iter().any(|r| r.key == d.rkey), "{listed:?}");
    // Anything else ends that connection: a Hello with a payload, a write, half a header then more.
    for bad in [
        [Header { kind: Kind::Hello, tag: Tag { slot: 0, layer: 0 }, key: 0, seq: 0, offset: 0, len: 8 }.encode().as_slice(), &[0u8; 8]].concat(),
        Header { kind: Kind::Write, tag: Tag { slot: 3, layer: 0 }, key: d.rkey, seq: 0, offset: 0, len: 16 }.encode().to_vec(),
        vec![0xFF; HEADER_LEN],
    ] {
        let mut s = raw();
        s.write_all(&bad).expect("send");
        // Closed, with nothing answered (a reset when it left bytes unread).
        let mut rest = Vec::new();
        match s.read_to_end(&mut rest) {
            Ok(0) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            other => panic!("the destination answered {other:?}: {rest:?}"),
        }
    }
    // The endpoint still serves the real connection.
    drop(real);
    let mut conn = connect(&src, &dst_ep).expect("reconnect");
    let (smem, _) = source(4096, 3);
    let sreg = src.register_all(smem, None).expect("register source");
    let tag = Tag { slot: 3, layer: 0 };
    dst_ep.placement().expect(tag, 256).expect("expect");
    conn.post(Batch { tag, writes: vec![WriteOp { src_key: sreg.key, src_offset: 0, dst_key: d.rkey, dst_offset: 0, len: 256, stride: None }] }).expect("post");
    ok(&wait_completions(conn.as_mut(), 1)[0]);
}
