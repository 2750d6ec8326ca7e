//! The contract every backend keeps, written once. A backend's test module
//! instantiates it with `conformance_tests!(make_pair)`, where `make_pair()`
//! returns a fresh (source, destination) pair of endpoints.

use kvwire_transport::accept::Refusal;
use kvwire_transport::{Batch, Completion, Connection, Credential, Endpoint, Grant, HostMem, Placement, Region, Tag, TransportError, WriteOp};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

pub const CANARY: u8 = 0xC3;
/// Bytes of canary on each side of a destination window.
pub const GUARD: u64 = 4096;
const WAIT: Duration = Duration::from_secs(10);

/// Two endpoints. The connection is made on first use, after a case has
/// registered its regions, since a verbs peer learns regions from the hello.
pub struct Pair {
    pub src: Arc<dyn Endpoint>,
    pub dst: Arc<dyn Endpoint>,
    pub conn: Option<Box<dyn Connection>>,
}

/// The data-plane session every test connection proves.
pub fn cred() -> &'static Credential {
    static C: OnceLock<Credential> = OnceLock::new();
    C.get_or_init(Credential::random)
}

/// Opens the test session on `dst` for connections from `src`, as a
/// destination daemon does once the peer handshake authenticated `src`.
pub fn open_session(src: &dyn Endpoint, dst: &dyn Endpoint) {
    dst.registry().open_session(cred(), src.node()).expect("open the test session");
}

/// Remote writes into a region of `dst` by the test session's node, tagged
/// with `slot`. Grants name the node by its id there, which it has once
/// the session is open ([`open_session`]).
pub fn grant(dst: &dyn Endpoint, slot: u16) -> Option<Grant> {
    let s = dst.registry().session(cred().session).expect("the test session is open on the destination before it grants a window");
    Some(Grant { peer: s.peer_id, slot })
}

impl Pair {
    pub fn new(src: Arc<dyn Endpoint>, dst: Arc<dyn Endpoint>) -> Pair {
        open_session(&*src, &*dst);
        Pair { src, dst, conn: None }
    }

    pub fn conn(&mut self) -> &mut dyn Connection {
        if self.conn.is_none() {
            self.conn = Some(self.src.connect(&self.dst.local_addr(), cred()).expect("connect"));
        }
        &mut **self.conn.as_mut().expect("connected")
    }
}

/// A destination window of `len` bytes inside a canary-filled mapping,
/// open to the test session's writes tagged with `slot`.
pub struct Window {
    pub mem: Arc<HostMem>,
    pub region: Arc<Region>,
    pub len: u64,
}

impl Window {
    pub fn new(ep: &dyn Endpoint, slot: u16, len: u64) -> Window {
        let mem = Arc::new(HostMem::new("kvwire-test-dst", len + 2 * GUARD).unwrap());
        mem.write(0, &vec![CANARY; (len + 2 * GUARD) as usize]).unwrap();
        let region = ep.register(mem.clone(), GUARD, len, grant(ep, slot)).unwrap();
        Window { mem, region, len }
    }

    pub fn bytes(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len as usize];
        self.mem.read(GUARD, &mut v).unwrap();
        v
    }

    /// Every guard byte is still the canary.
    pub fn assert_guards(&self) {
        let mut g = vec![0u8; GUARD as usize];
        for at in [0, GUARD + self.len] {
            self.mem.read(at, &mut g).unwrap();
            assert!(g.iter().all(|&b| b == CANARY), "guard bytes at {at} were touched");
        }
    }
}

/// A source region filled with a pattern.
pub fn source(ep: &dyn Endpoint, len: u64, seed: u8) -> (Arc<Region>, Vec<u8>) {
    let data: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8).collect();
    let mem = Arc::new(HostMem::new("kvwire-test-src", len).unwrap());
    mem.write(0, &data).unwrap();
    (ep.register(mem, 0, len, None).unwrap(), data)
}

pub fn tag(slot: u16, layer: u16) -> Tag {
    Tag { slot, layer }
}

pub fn w(src: &Region, src_offset: u64, dst: &Region, dst_offset: u64, len: u64) -> WriteOp {
    WriteOp { src_key: src.key, src_offset, dst_key: dst.key, dst_offset, len, stride: None }
}

/// Polls until `n` completions arrived.
pub fn complete(conn: &mut dyn Connection, n: usize) -> Vec<Completion> {
    let start = Instant::now();
    let mut out = Vec::new();
    while out.len() < n {
        assert!(start.elapsed() < WAIT, "only {} of {n} completions after {WAIT:?}", out.len());
        out.extend(conn.poll(Duration::from_millis(100)).unwrap());
    }
    out
}

/// Runs `f` on `conn` on a thread of its own and waits at most `bound`
/// for what it returns: a call that stalls (never returns) fails the test,
/// saying `stalled`.
pub fn within<T: Send + 'static>(mut conn: Box<dyn Connection>, bound: Duration, stalled: &str, f: impl FnOnce(&mut dyn Connection) -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f(&mut *conn));
    });
    rx.recv_timeout(bound).unwrap_or_else(|_| panic!("{stalled}"))
}

pub fn one_segment(p: &mut Pair) {
    let dst = Window::new(&*p.dst, 1, 8192);
    let (src, data) = source(&*p.src, 8192, 7);
    p.dst.placement().expect(tag(1, 0), 8192).unwrap();
    p.conn().post(Batch { tag: tag(1, 0), writes: vec![w(&src, 0, &dst.region, 0, 8192)] }).unwrap();
    let c = complete(p.conn(), 1);
    assert_eq!(c[0].result, Ok(()));
    assert_eq!(c[0].bytes, 8192);
    p.dst.placement().wait(tag(1, 0), WAIT).unwrap();
    assert_eq!(dst.bytes(), data);
    dst.assert_guards();
}

pub fn scatter(p: &mut Pair) {
    // 64 runs of 100 bytes, reversed order and spaced at the destination.
    let dst = Window::new(&*p.dst, 2, 64 * 128);
    let (src, data) = source(&*p.src, 64 * 100, 3);
    let writes: Vec<WriteOp> = (0..64).map(|i| w(&src, i * 100, &dst.region, (63 - i) * 128, 100)).collect();
    p.dst.placement().expect(tag(2, 5), 6400).unwrap();
    p.conn().post(Batch { tag: tag(2, 5), writes }).unwrap();
    assert_eq!(complete(p.conn(), 1)[0].result, Ok(()));
    p.dst.placement().wait(tag(2, 5), WAIT).unwrap();
    let got = dst.bytes();
    let mut want = vec![CANARY; 64 * 128];
    for i in 0..64usize {
        want[(63 - i) * 128..(63 - i) * 128 + 100].copy_from_slice(&data[i * 100..i * 100 + 100]);
    }
    assert_eq!(got, want, "runs landed where the plan said, gaps untouched");
    dst.assert_guards();
}

/// Runs from one byte to several hundred KiB, back to back on the source
/// and spaced at the destination, in three batches posted before any
/// completes, one of them more runs than a single gathered send holds:
/// every byte lands where its run says, whatever a transport buffers.
pub fn mixed_run_sizes(p: &mut Pair) {
    let mut sizes: Vec<u64> = vec![1, 39, 40, 41, 4095, 4096, 8191, 8192, 8193, 32 << 10, (32 << 10) + 1, 300_000, 17, 70_000, 1 << 20];
    sizes.extend((0..600).map(|i| 1 + (i * 37) % 700));
    let gap = 64;
    let total: u64 = sizes.iter().sum();
    let dst = Window::new(&*p.dst, 4, total + gap * sizes.len() as u64);
    let (src, data) = source(&*p.src, total, 11);
    let (mut at_src, mut at_dst) = (0, 0);
    let mut runs = Vec::new();
    for &n in &sizes {
        runs.push((w(&src, at_src, &dst.region, at_dst, n), at_dst));
        at_src += n;
        at_dst += n + gap;
    }
    let batches: Vec<Vec<(WriteOp, u64)>> = vec![runs[..5].to_vec(), runs[5..15].to_vec(), runs[15..].to_vec()];
    for (layer, b) in batches.iter().enumerate() {
        p.dst.placement().expect(tag(4, layer as u16), b.iter().map(|(op, _)| op.len).sum()).unwrap();
    }
    for (layer, b) in batches.iter().enumerate() {
        p.conn().post(Batch { tag: tag(4, layer as u16), writes: b.iter().map(|(op, _)| *op).collect() }).unwrap();
    }
    assert!(complete(p.conn(), 3).iter().all(|c| c.result == Ok(())));
    for layer in 0..3 {
        p.dst.placement().wait(tag(4, layer), WAIT).unwrap();
    }
    let got = dst.bytes();
    for (op, at) in &runs {
        let (s, d) = (op.src_offset as usize, *at as usize);
        assert!(got[d..d + op.len as usize] == data[s..s + op.len as usize], "run of {} bytes at destination offset {d}", op.len);
        assert!(got[d + op.len as usize..d + op.len as usize + gap as usize].iter().all(|&b| b == CANARY), "gap after the run at {d} untouched");
    }
    dst.assert_guards();
}

/// Several batches in one post land and complete each as its own. When a
/// later batch of the list fails its local check, the ids returned are
/// the batches that went: each completes, and nothing of the rest lands.
pub fn batches_posted_together(p: &mut Pair) {
    let dst = Window::new(&*p.dst, 9, 3 * 4096);
    let (src, data) = source(&*p.src, 3 * 4096, 9);
    let batch = |layer: u16| Batch { tag: tag(9, layer), writes: vec![w(&src, u64::from(layer) * 4096, &dst.region, u64::from(layer) * 4096, 4096)] };
    for layer in 0..3 {
        p.dst.placement().expect(tag(9, layer), 4096).unwrap();
    }
    let ids = p.conn().post_all(vec![batch(0), batch(1)]).unwrap();
    assert_eq!(ids.len(), 2);
    let done = complete(p.conn(), 2);
    assert!(ids.iter().all(|id| done.iter().any(|c| c.batch == *id && c.result == Ok(()))), "{done:?}");
    // The second batch reads past its source region.
    let bad = Batch { tag: tag(9, 3), writes: vec![w(&src, 3 * 4096 - 100, &dst.region, 0, 200)] };
    let (posted, e) = p.conn().post_all(vec![batch(2), bad]).unwrap_err();
    assert!(matches!(e, TransportError::Source(_)), "{e}");
    assert!(posted.len() <= 1, "{posted:?}");
    let done = complete(p.conn(), posted.len());
    assert!(done.iter().all(|c| c.result == Ok(())), "{done:?}");
    for layer in 0..2 {
        p.dst.placement().wait(tag(9, layer), WAIT).unwrap();
    }
    let got = dst.bytes();
    assert!(got[..2 * 4096] == data[..2 * 4096], "the batches posted together landed");
    match posted.is_empty() {
        true => {
            assert_eq!(p.dst.placement().placed_bytes(tag(9, 2)), 0, "a batch not posted placed bytes");
            assert!(got[2 * 4096..].iter().all(|&b| b == CANARY), "a batch not posted wrote");
        }
        false => {
            p.dst.placement().wait(tag(9, 2), WAIT).unwrap();
            assert!(got.len() == 3 * 4096 && dst.bytes()[2 * 4096..] == data[2 * 4096..], "the batch posted before the bad one landed");
        }
    }
    dst.assert_guards();
}

pub fn layers_publish_only_after_their_last_byte(p: &mut Pair) {
    let dst = Window::new(&*p.dst, 3, 3 * 4096);
    let (src, data) = source(&*p.src, 3 * 4096, 11);
    let pl = p.dst.placement().clone();
    // Layer 0 declared before its bytes, layer 1 after, layer 2 in between.
    pl.expect(tag(3, 0), 4096).unwrap();
    // Interleave layers: 2a 0a 1a 2b 0b 1b; check flags after each completion.
    let order = [(2, 0), (0, 0), (1, 0), (2, 1), (0, 1), (1, 1)];
    let mut done = std::collections::HashSet::new();
    for (i, &(layer, half)) in order.iter().enumerate() {
        let off = layer * 4096 + half * 2048;
        p.conn().post(Batch { tag: tag(3, layer as u16), writes: vec![w(&src, off, &dst.region, off, 2048)] }).unwrap();
        assert_eq!(complete(p.conn(), 1)[0].result, Ok(()));
        if i == 0 {
            pl.expect(tag(3, 2), 4096).unwrap();
        }
        done.insert((layer, half));
        for l in 0..3u64 {
            let complete_layer = done.contains(&(l, 0)) && done.contains(&(l, 1));
            let declared = l != 1 || i == order.len();
            if !complete_layer {
                assert!(pl.flags().ready(tag(3, l as u16)).is_none(), "layer {l} flagged before its last byte");
            } else if declared {
                pl.wait(tag(3, l as u16), WAIT).unwrap();
            }
        }
    }
    assert!(pl.flags().ready(tag(3, 1)).is_none(), "layer 1 flagged before it was declared");
    pl.expect(tag(3, 1), 4096).unwrap();
    pl.wait(tag(3, 1), WAIT).unwrap();
    assert_eq!(dst.bytes(), data);
    dst.assert_guards();
}

pub fn source_released_after_local_completion(p: &mut Pair) {
    let dst = Window::new(&*p.dst, 4, 1 << 20);
    let (src, data) = source(&*p.src, 1 << 20, 5);
    p.dst.placement().expect(tag(4, 0), 1 << 20).unwrap();
    let id = p.conn().post(Batch { tag: tag(4, 0), writes: vec![w(&src, 0, &dst.region, 0, 1 << 20)] }).unwrap();
    let c = complete(p.conn(), 1);
    assert_eq!(c[0].batch, id);
    assert_eq!(c[0].result, Ok(()));
    // Released: overwriting the source now must not change what arrived.
    src.mem.write(0, &vec![0u8; 1 << 20]).unwrap();
    p.dst.placement().wait(tag(4, 0), WAIT).unwrap();
    assert_eq!(dst.bytes(), data);
    assert_eq!(p.conn().pending(), 0);
}

fn refused(p: &mut Pair, op: WriteOp, t: Tag) -> TransportError {
    match p.conn().post(Batch { tag: t, writes: vec![op] }) {
        // Refused before sending (e.g. checked against the peer's descriptors).
        Err(e) => e,
        Ok(_) => {
            let c = complete(p.conn(), 1);
            c[0].result.clone().expect_err("the write must be refused")
        }
    }
}

/// A grant names the node, not one session: a connection proving another
/// session of the same node writes there too. Once the node's last session
/// here closes, the grant is no one's: the node back under a session
/// opened anew writes nothing there.
pub fn a_grant_is_the_nodes_not_one_sessions(p: &mut Pair) {
    let dst = Window::new(&*p.dst, 6, 4096);
    let (src, data) = source(&*p.src, 4096, 6);
    let second = Credential::random();
    p.dst.registry().open_session(&second, p.src.node()).unwrap();
    let mut conn = p.src.connect(&p.dst.local_addr(), &second).expect("connect proving the node's second session");
    p.dst.placement().expect(tag(6, 0), 4096).unwrap();
    conn.post(Batch { tag: tag(6, 0), writes: vec![w(&src, 0, &dst.region, 0, 4096)] }).unwrap();
    assert_eq!(complete(&mut *conn, 1)[0].result, Ok(()));
    p.dst.placement().wait(tag(6, 0), WAIT).unwrap();
    assert_eq!(dst.bytes(), data);
    drop(conn);
    assert_eq!(p.dst.registry().close_session(cred().session), None, "the node has another session open");
    assert!(p.dst.registry().close_session(second.session).is_some(), "its last");
    p.dst.registry().open_session(&second, p.src.node()).unwrap();
    let mut conn = p.src.connect(&p.dst.local_addr(), &second).expect("connect proving the reopened session");
    p.dst.placement().expect(tag(6, 1), 16).unwrap();
    let e = match conn.post(Batch { tag: tag(6, 1), writes: vec![w(&src, 0, &dst.region, 0, 16)] }) {
        Err(e) => e,
        Ok(_) => complete(&mut *conn, 1)[0].result.clone().expect_err("a grant to the node's old id must refuse the write"),
    };
    if p.dst.transport() != kvwire_transport::TransportKind::Verbs {
        assert!(e.to_string().ends_with(&Refusal::NotGranted(dst.region.key).to_string()), "{e}");
    }
    assert!(p.dst.placement().flags().ready(tag(6, 1)).is_none());
    assert_eq!(dst.bytes(), data);
    dst.assert_guards();
}

pub fn bad_writes_fail_alone(p: &mut Pair) {
    let dst = Window::new(&*p.dst, 5, 4096);
    let other = Window::new(&*p.dst, 5, 4096);
    let (src, data) = source(&*p.src, 4096, 9);
    let before = dst.bytes();
    let cases: Vec<(&str, WriteOp)> = vec![
        ("unknown key", WriteOp { dst_key: 0xDEAD_BEEF, ..w(&src, 0, &dst.region, 0, 16) }),
        ("out of bounds", w(&src, 0, &dst.region, 4090, 16)),
        ("offset overflow", w(&src, 0, &dst.region, u64::MAX - 4, 16)),
        ("zero length", w(&src, 0, &dst.region, 0, 0)),
    ];
    for (what, op) in cases {
        let e = refused(p, op, tag(5, 0));
        let text = e.to_string();
        assert!(!text.is_empty(), "{what}: {text}");
        assert_eq!(dst.bytes(), before, "{what}: destination changed");
        dst.assert_guards();
    }
    // Revoked region: refused, bytes unchanged.
    assert!(p.dst.revoke(dst.region.key));
    let e = refused(p, w(&src, 0, &dst.region, 0, 64), tag(5, 1));
    let text = e.to_string();
    assert!(["revoked", "unknown", "deregistered", "stale"].iter().any(|w| text.contains(w)), "{text}");
    assert_eq!(dst.bytes(), before);
    dst.assert_guards();
    if !p.dst.survives_refused_write() {
        // The connection is gone; a new one must serve the other region.
        p.conn = None;
    }
    // The other region is still served.
    p.dst.placement().expect(tag(5, 2), 4096).unwrap();
    p.conn().post(Batch { tag: tag(5, 2), writes: vec![w(&src, 0, &other.region, 0, 4096)] }).unwrap();
    assert_eq!(complete(p.conn(), 1)[0].result, Ok(()));
    p.dst.placement().wait(tag(5, 2), WAIT).unwrap();
    assert_eq!(other.bytes(), data);
    assert!(p.dst.placement().flags().ready(tag(5, 0)).is_none(), "no flag for refused bytes");
}

pub fn local_source_checked_before_sending(p: &mut Pair) {
    let dst = Window::new(&*p.dst, 6, 4096);
    let (src, _) = source(&*p.src, 4096, 1);
    let e = p.conn().post(Batch { tag: tag(6, 0), writes: vec![w(&src, 4000, &dst.region, 0, 200)] }).unwrap_err();
    assert!(matches!(e, TransportError::Source(_)), "{e}");
    let e = p
        .conn()
        .post(Batch { tag: tag(6, 0), writes: vec![WriteOp { src_key: 0x1234_5678, ..w(&src, 0, &dst.region, 0, 8) }] })
        .unwrap_err();
    assert!(matches!(e, TransportError::Source(_)), "{e}");
    assert_eq!(p.dst.placement().placed_bytes(tag(6, 0)), 0);
}

/// More bytes than a layer declared never publish its flag. Emulated
/// transports refuse before placing; RDMA learns of it only at the
/// destination's completion, after the bytes landed.
pub fn overrun_never_publishes(p: &mut Pair) {
    let dst = Window::new(&*p.dst, 7, 4096);
    let (src, _) = source(&*p.src, 4096, 2);
    p.dst.placement().expect(tag(7, 0), 1024).unwrap();
    match p.conn().post(Batch { tag: tag(7, 0), writes: vec![w(&src, 0, &dst.region, 0, 2048)] }) {
        Err(e) => assert!(e.to_string().contains("expected"), "{e}"),
        Ok(_) => {
            if let Err(e) = &complete(p.conn(), 1)[0].result {
                assert!(e.to_string().contains("expected"), "{e}");
            }
        }
    }
    std::thread::sleep(Duration::from_millis(50));
    assert!(p.dst.placement().flags().ready(tag(7, 0)).is_none());
}

/// Waits until `tag` has `bytes` counted (a verbs destination counts
/// when a note arrives, after the source's completion); then checks it
/// stays there.
pub fn wait_placed(pl: &Placement, t: Tag, bytes: u64) {
    let start = Instant::now();
    while pl.placed_bytes(t) < bytes {
        assert!(start.elapsed() < WAIT, "only {} of {bytes} bytes counted", pl.placed_bytes(t));
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(pl.placed_bytes(t), bytes, "counted more than the distinct bytes written");
}

/// Writes `op` under `t` and waits for its batch; Ok when it was placed.
pub fn post_one(p: &mut Pair, op: WriteOp, t: Tag) -> Result<(), TransportError> {
    let id = p.conn().post(Batch { tag: t, writes: vec![op] })?;
    let c = complete(p.conn(), 1);
    assert_eq!(c[0].batch, id);
    c[0].result.clone()
}

/// Writes `op` under `t`, which the destination refuses: the refusal.
pub fn post_one_err(p: &mut Pair, op: WriteOp, t: Tag) -> TransportError {
    post_one(p, op, t).expect_err("the write was accepted")
}

/// The one counting rule: a range that lands twice (a slice re-sent on
/// another rail) counts once, whether repeated whole or overlapping, and
/// repeating it after the layer published changes nothing.
pub fn a_range_written_twice_counts_once(p: &mut Pair) {
    let dst = Window::new(&*p.dst, 8, 8192);
    let (src, data) = source(&*p.src, 8192, 13);
    let pl = p.dst.placement().clone();
    let t = tag(8, 0);
    pl.expect(t, 8192).unwrap();
    post_one(p, w(&src, 0, &dst.region, 0, 4096), t).unwrap();
    wait_placed(&pl, t, 4096);
    // The same range again, and one overlapping its second half: 2048 new bytes.
    p.conn().post(Batch { tag: t, writes: vec![w(&src, 0, &dst.region, 0, 4096), w(&src, 2048, &dst.region, 2048, 4096)] }).unwrap();
    assert_eq!(complete(p.conn(), 1)[0].result, Ok(()));
    wait_placed(&pl, t, 6144);
    assert!(pl.flags().ready(t).is_none(), "6144 distinct bytes of 8192 must not publish");
    post_one(p, w(&src, 4096, &dst.region, 4096, 4096), t).unwrap();
    pl.wait(t, WAIT).unwrap();
    wait_placed(&pl, t, 8192);
    // After the flag: a whole re-send is still accepted and adds nothing.
    post_one(p, w(&src, 0, &dst.region, 0, 8192), t).unwrap();
    let fence = tag(8, 1);
    pl.expect(fence, 16).unwrap();
    post_one(p, w(&src, 0, &dst.region, 0, 16), fence).unwrap();
    pl.wait(fence, WAIT).unwrap();
    assert_eq!(pl.placed_bytes(t), 8192);
    assert_eq!(dst.bytes(), data);
    dst.assert_guards();
    // What crossed for the slot counts each payload byte once, and every
    // write's framing and answer: 6 writes, 8192 + 16 distinct bytes.
    let per_write = match p.dst.transport() {
        kvwire_transport::TransportKind::Tcp => 40 + 40,
        kvwire_transport::TransportKind::Shm => 104 + 40,
        kvwire_transport::TransportKind::Verbs => 24,
    };
    assert_eq!(pl.crossed_bytes(8), 8192 + 16 + 6 * per_write);
}

/// Unknown key, out of bounds, zero length and a tag outside the flag
/// table are refused by the shared acceptance path on every backend: the
/// reason the source gets is the destination's [`Refusal`] text (verbs
/// checks key and bounds before posting, with the same texts, and cannot
/// hear back about a tag: its note is refused at the destination), no
/// byte is counted, and the connection serves the next write.
pub fn refusals_are_the_shared_ones(p: &mut Pair) {
    let dst = Window::new(&*p.dst, 10, 4096);
    let (src, _) = source(&*p.src, 4096, 14);
    // A region of this side (local only) and one granted to slot 9.
    let local = p.dst.register(Arc::new(HostMem::new("kvwire-test-local", 4096).unwrap()), 0, 4096, None).unwrap();
    let slot9 = Window::new(&*p.dst, 9, 4096);
    let pl = p.dst.placement().clone();
    let key = dst.region.key;
    let no_tag = tag(10, u16::MAX);
    let verbs = p.dst.transport() == kvwire_transport::TransportKind::Verbs;
    let cases = [
        (WriteOp { dst_key: 0xDEAD_BEEF, ..w(&src, 0, &dst.region, 0, 16) }, tag(10, 0), Refusal::UnknownKey(0xDEAD_BEEF)),
        (w(&src, 0, &dst.region, 4090, 16), tag(10, 1), Refusal::OutOfBounds { key, offset: 4090, len: 16, region_len: 4096 }),
        (w(&src, 0, &dst.region, 0, 0), tag(10, 2), Refusal::ZeroLength),
        (w(&src, 0, &dst.region, 0, 16), no_tag, Refusal::UnknownTag { slot: 10, layer: u16::MAX }),
        // Verbs never learns the key of a region not granted to its
        // session, so its own check refuses it as unknown; the NIC would
        // refuse it too (the MR allows no remote write).
        (w(&src, 0, &local, 0, 16), tag(10, 3), if verbs { Refusal::UnknownKey(local.key) } else { Refusal::NotGranted(local.key) }),
        (w(&src, 0, &slot9.region, 0, 16), tag(10, 4), Refusal::OtherSlot { key: slot9.region.key, slot: 10, granted: 9 }),
    ];
    let refusals = |reason: &str| pl.refusals().by_reason().find(|(r, _)| *r == reason).map(|(_, n)| n).expect("a reason");
    for (i, (op, t, want)) in cases.into_iter().enumerate() {
        let before = dst.bytes();
        let before9 = slot9.bytes();
        let counted_before = refusals(want.reason());
        let mut sent = true;
        let answered = match p.conn().post(Batch { tag: t, writes: vec![op] }) {
            Err(TransportError::Refused(text)) => {
                assert!(text.contains(&want.to_string()), "refused before sending, not as {want:?}: {text}");
                sent = false;
                true
            }
            Err(e) => panic!("{want:?}: {e}"),
            Ok(_) => match complete(p.conn(), 1).remove(0).result {
                Err(e) => {
                    assert_eq!(e, TransportError::Refused(want.to_string()));
                    true
                }
                Ok(()) => {
                    // A one-sided write completes before its note is refused.
                    assert!(verbs, "only a one-sided write may complete unrefused: {want:?}");
                    assert!(matches!(want, Refusal::UnknownTag { .. } | Refusal::OtherSlot { .. }), "{want:?}");
                    false
                }
            },
        };
        if answered {
            assert_eq!(dst.bytes(), before, "{want:?}: a refused write touched the destination");
            assert_eq!(slot9.bytes(), before9, "{want:?}: a refused write touched slot 9's region");
        }
        // A later good write on the same connection is counted, so the
        // destination has handled the refused one by then: it counted nothing.
        let fence = tag(10, 8 + i as u16);
        pl.expect(fence, 64).unwrap();
        post_one(p, w(&src, 0, &dst.region, 1024, 64), fence).unwrap();
        pl.wait(fence, WAIT).unwrap();
        assert_eq!(pl.placed_bytes(t), 0, "{want:?}: counted");
        // The destination counts each refusal it made under its reason.
        assert_eq!(refusals(want.reason()), counted_before + u64::from(sent), "{want:?}");
    }
    let mut b = vec![0u8; 4096];
    local.mem.read(0, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 0), "a write reached the local region");
    dst.assert_guards();
}

/// What a connection reports as its framing is what its protocol puts on
/// the link per write (module docs): a 40-byte header per TCP frame, a
/// 40-byte header and 40-byte trailer per shm request, a 24-byte note per
/// range a verbs batch writes (its writes that continue one another at the
/// destination share one); each TCP and shm write is answered by a 40-byte
/// `Ack`.
/// The destination counts the same bytes for the slot the writes name:
/// framing, payload and answers; for a refused write, its `Nack`, and
/// its payload only where it crossed (TCP reads it off the socket, shm
/// never copies it).
pub fn framing_bytes_are_what_the_connection_sent(p: &mut Pair) {
    use kvwire_transport::TransportKind;
    let dst = Window::new(&*p.dst, 12, 4096);
    let (src, _) = source(&*p.src, 4096, 15);
    let (framing0, answers0) = (p.conn().framing_bytes(), p.conn().answer_bytes());
    let crossed0 = p.dst.placement().crossed_bytes(12);
    // Three writes, back to back at the destination: one range.
    let writes = (0..3).map(|i| w(&src, i * 1000, &dst.region, i * 1000, 1000)).collect();
    p.conn().post(Batch { tag: tag(12, 0), writes }).unwrap();
    assert_eq!(complete(p.conn(), 1)[0].result, Ok(()));
    let (framing, per_answer) = match p.dst.transport() {
        TransportKind::Tcp => (3 * 40, 40),
        TransportKind::Shm => (3 * (40 + 64), 40),
        TransportKind::Verbs => (24, 0),
    };
    assert_eq!(p.conn().framing_bytes() - framing0, framing);
    assert_eq!(p.conn().answer_bytes() - answers0, 3 * per_answer);
    // A verbs source completes locally; its notes reach the destination after.
    let want = framing + 3 * (per_answer + 1000);
    let start = Instant::now();
    while p.dst.placement().crossed_bytes(12) - crossed0 < want && start.elapsed() < WAIT {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(p.dst.placement().crossed_bytes(12) - crossed0, want, "the destination's count for the slot");
    if p.dst.transport() == TransportKind::Verbs {
        // Its source refuses what the destination would, before posting.
        return;
    }
    // Past the region's end: refused by name, and counted for the slot,
    // whose transfer sent it: its request, its Nack, and its payload
    // where that crossed.
    let (framing0, answers0, crossed0) = (p.conn().framing_bytes(), p.conn().answer_bytes(), p.dst.placement().crossed_bytes(12));
    p.conn().post(Batch { tag: tag(12, 0), writes: vec![w(&src, 0, &dst.region, 4000, 1000)] }).unwrap();
    assert!(complete(p.conn(), 1)[0].result.is_err());
    let nack = p.conn().answer_bytes() - answers0;
    assert!(nack > 40, "a Nack carries its reason: {nack} bytes");
    let payload = if p.dst.transport() == TransportKind::Tcp { 1000 } else { 0 };
    assert_eq!(p.dst.placement().crossed_bytes(12) - crossed0, p.conn().framing_bytes() - framing0 + nack + payload);
    // Slot 13 is not the region's: a write there is not slot 13's to make,
    // and counts toward no slot.
    let (slot12, slot13) = (p.dst.placement().crossed_bytes(12), p.dst.placement().crossed_bytes(13));
    p.conn().post(Batch { tag: tag(13, 0), writes: vec![w(&src, 0, &dst.region, 0, 1000)] }).unwrap();
    assert!(complete(p.conn(), 1)[0].result.is_err());
    assert_eq!((p.dst.placement().crossed_bytes(12), p.dst.placement().crossed_bytes(13)), (slot12, slot13));
}

/// A strided write (shm, tcp): a remap's rows, `count` runs read `src`
/// apart and written `dst` apart by one write, counted once. A write whose runs
/// overlap bytes placed before (other than an exact repeat), and a plain
/// write into a strided write's runs, are refused by name; the rows
/// between its runs stay free for the other strided writes.
pub fn strided_writes(p: &mut Pair) {
    use kvwire_transport::Stride;
    // Two interleaved strided writes fill 16 rows of 64 bytes: even rows
    // from the first half of the source, odd rows from the second.
    let (rows, row) = (16u64, 64u64);
    let dst = Window::new(&*p.dst, 9, rows * row);
    let (src, data) = source(&*p.src, rows * row, 21);
    let pl = p.dst.placement().clone();
    let t = tag(9, 0);
    let half = rows / 2 * row;
    let runs = |count: u64, every: u64, src_at: u64, dst_at: u64| WriteOp { stride: Some(Stride { count, src: row, dst: every }), ..w(&src, src_at, &dst.region, dst_at, row) };
    let strided = |src_at: u64, dst_at: u64| runs(rows / 2, 2 * row, src_at, dst_at);
    pl.expect(t, rows * row).unwrap();
    let before = dst.bytes();

    p.conn().post(Batch { tag: t, writes: vec![strided(0, 0)] }).unwrap();
    assert_eq!(complete(p.conn(), 1)[0].result, Ok(()));
    wait_placed(&pl, t, half);
    assert!(pl.flags().ready(t).is_none(), "half the rows must not publish");
    // The same write again adds nothing.
    p.conn().post(Batch { tag: t, writes: vec![strided(0, 0)] }).unwrap();
    assert_eq!(complete(p.conn(), 1)[0].result, Ok(()));
    // Overlapping what landed: another shape at its offset, the same shape
    // shifted one run, a plain write over one of its runs or across two rows.
    for (bad, says) in [
        (runs(rows / 4, 3 * row, 0, 0), "overlaps the runs"),
        (strided(0, 2 * row), "exceeds region"),
        (runs(rows / 2 - 1, 2 * row, 0, 2 * row), "overlaps the runs"),
        (w(&src, 0, &dst.region, 4 * row, row), "overlaps the runs"),
        (w(&src, 0, &dst.region, row / 2, row), "overlaps the runs"),
        // Runs that overlap one another.
        (runs(4, row / 2, 0, 0), "overlap one another"),
    ] {
        let err = post_one_err(p, bad, t);
        assert!(matches!(&err, TransportError::Refused(m) if m.contains(says)), "{err}");
    }
    assert_eq!(pl.placed_bytes(t), half);
    p.conn().post(Batch { tag: t, writes: vec![strided(half, row)] }).unwrap();
    assert_eq!(complete(p.conn(), 1)[0].result, Ok(()));
    pl.wait(t, WAIT).unwrap();
    assert_eq!(pl.placed_bytes(t), rows * row);
    let mut want = before;
    for r in 0..rows {
        let from = if r % 2 == 0 { r / 2 * row } else { half + r / 2 * row };
        want[(r * row) as usize..((r + 1) * row) as usize].copy_from_slice(&data[from as usize..(from + row) as usize]);
    }
    assert!(dst.bytes() == want, "rows landed out of place");
    dst.assert_guards();

    // A plain row placed first: a strided write over it is refused.
    let t2 = tag(9, 1);
    pl.expect(t2, rows * row).unwrap();
    post_one(p, w(&src, 0, &dst.region, 3 * row, row), t2).unwrap();
    let err = post_one_err(p, strided(half, row), t2);
    assert!(matches!(&err, TransportError::Refused(m) if m.contains("overlaps the runs")), "{err}");
    assert_eq!(pl.placed_bytes(t2), row);

    // A source span past the region is refused before anything is sent.
    let far = WriteOp { stride: Some(Stride { count: rows, src: 2 * row, dst: row }), ..w(&src, 0, &dst.region, 0, row) };
    assert!(matches!(p.conn().post(Batch { tag: t, writes: vec![far] }), Err(TransportError::Source(_))));
}

/// Instantiates every conformance case for a backend. `optional` backends
/// need a device: their `make()` returns `Option<Pair>`, `None` (having said
/// why) when there is none.
#[macro_export]
macro_rules! conformance_tests {
    ($make:path) => {
        $crate::conformance_tests!(@each (|| Some($make())));
    };
    (optional $make:path) => {
        $crate::conformance_tests!(@each (|| $make()));
    };
    (@each $make:tt) => {
        $crate::conformance_tests!(@case $make, one_segment, scatter, mixed_run_sizes, batches_posted_together, layers_publish_only_after_their_last_byte,
            source_released_after_local_completion, bad_writes_fail_alone, local_source_checked_before_sending,
            overrun_never_publishes, a_range_written_twice_counts_once, refusals_are_the_shared_ones,
            framing_bytes_are_what_the_connection_sent, a_grant_is_the_nodes_not_one_sessions);
    };
    (@case $make:tt, $($case:ident),*) => {
        $(
            #[test]
            fn $case() {
                let make: fn() -> Option<$crate::conformance::Pair> = $make;
                if let Some(mut p) = make() {
                    $crate::conformance::$case(&mut p);
                }
            }
        )*
    };
}
