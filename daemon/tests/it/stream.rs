//! Streamed submits: the source's engine writes its cache layer by layer
//! and says so (`produced`); two real daemons move each layer only once
//! every source rank reading it has said it is written, and the
//! destination publishes it before the next one exists.

use crate::daemons::{identity_of, model, read_back, register, side, Side_, DST, SRC, WAIT};
use kvwire_client::client::{Client, ClientError};
use kvwire_client::control::*;
use kvwire_core::plan::Buffers;
use kvwire_core::verify;
use kvwire_testkit::{counter, start_daemon, DaemonProc, TempDir};
use std::time::Duration;

const SECRET: &str = "a-secret-of-at-least-16-bytes";

struct Pair {
    _dir: TempDir,
    _a: DaemonProc,
    _b: DaemonProc,
    ca: Client,
    cb: Client,
    a_socket: std::path::PathBuf,
}

fn pair(name: &str) -> Pair {
    let dir = TempDir::new(name);
    let b = start_daemon(dir.path(), "b", SECRET, &[], "");
    let a = start_daemon(dir.path(), "a", SECRET, &[("b", &b.peer)], "");
    let ca = Client::connect(&a.socket, "prefill").unwrap();
    let cb = Client::connect(&b.socket, "decode").unwrap();
    let a_socket = a.socket.clone();
    Pair { _dir: dir, _a: a, _b: b, ca, cb, a_socket }
}

/// Both sides of a `tokens`-long request registered: the source's cache
/// filled (`filled`) or still empty, the destination's all canary; and the
/// bytes the source's engine computes.
fn sides(p: &Pair, tokens: u64, filled: bool) -> (Side_, Side_, Buffers) {
    let (ss, ds) = (side(SRC, tokens), side(DST, tokens));
    let bytes = verify::fill_source(&model(), &ss, tokens);
    let src = register(&p.ca, "prefill", SRC, &ss, filled.then_some(&bytes), identity_of("toy-digest", "t1"));
    let dst = register(&p.cb, "decode", DST, &ds, None, identity_of("toy-digest", "t1"));
    for m in &dst.mems {
        m.write(0, &vec![verify::CANARY; m.len() as usize]).unwrap();
    }
    (src, dst, bytes)
}

fn prepare(p: &Pair, dst: &Side_, request: &str, tokens: u64) -> u16 {
    p.cb.prepare(PrepareReceive { group: "decode".into(), request: request.into(), block_table: dst.side.block_table.clone(), tokens, prefix_tokens: 0, source: None }).unwrap()
}

/// The engine's forward pass reaching layer `layer` on `rank`: its bytes
/// land in the source memfd (which held none of them until now).
fn write_layer(src: &Side_, bytes: &Buffers, rank: u32, layer: u32) {
    let mut off = 0;
    for (id, len) in src.side.regions(&model(), rank) {
        if id.layer == layer {
            src.mems[rank as usize].write(off, &bytes.ranks[rank as usize][&id]).unwrap();
        }
        off += len;
    }
}

fn streamed(request: &str, src: &Side_, tokens: u64) -> Submit {
    Submit {
        request: request.into(),
        group: "prefill".into(),
        block_table: src.side.block_table.clone(),
        tokens,
        peer: "b".into(),
        dst_group: "decode".into(),
        dst_request: request.into(),
        codec: None,
        stream: true,
    }
}

#[test]
fn a_streamed_transfer_publishes_each_layer_before_the_next_is_written() {
    let p = pair("stream");
    let tokens = 100;
    // The source registers an empty cache: the engine has computed nothing yet.
    let (src, dst, bytes) = sides(&p, tokens, false);
    let ds = &dst.side;
    let slot = prepare(&p, &dst, "s1", tokens);
    // The submit returns once the destination accepted: nothing is written yet.
    let sub = p.ca.submit(streamed("s1", &src, tokens)).unwrap();
    assert_eq!(sub.peer_slot, slot);
    let ranks = src.side.shard.ranks.len() as u32;
    for layer in 0..4u16 {
        for rank in 0..ranks {
            write_layer(&src, &bytes, rank, layer.into());
            if rank + 1 < ranks {
                p.ca.produced("prefill", "s1", rank, layer + 1).unwrap();
            }
        }
        // Every destination rank reads every source rank here: with one rank
        // silent, the layer does not move.
        std::thread::sleep(Duration::from_millis(100));
        assert!(!p.cb.ready(slot, FlagName::LayerReady(layer)), "layer {layer} published before rank {} said it was written", ranks - 1);
        p.ca.produced("prefill", "s1", ranks - 1, layer + 1).unwrap();
        p.cb.wait(slot, FlagName::LayerReady(layer), WAIT).unwrap();
        // The next layer does not exist yet, and is not published.
        if layer < 3 {
            assert!(!p.cb.ready(slot, FlagName::LayerReady(layer + 1)));
        }
    }
    p.cb.wait(slot, FlagName::DecoderUsable, WAIT).unwrap();
    p.ca.wait(sub.slot, FlagName::SourceReleased, WAIT).unwrap();
    p.ca.wait(sub.slot, FlagName::DecoderUsable, WAIT).unwrap();
    assert!(read_back(&dst) == verify::expected_destination(&model(), ds, tokens, 0), "destination bytes differ from the independent expectation");
    let st = p.ca.status(sub.slot).unwrap();
    assert_eq!(st.state, TransferState::Done);
    let names: Vec<&str> = st.marks.iter().map(|m| m.name.as_str()).collect();
    for layer in 0..4 {
        assert!(names.contains(&format!("produced({layer})").as_str()), "{names:?}");
    }
    assert_eq!(names.iter().filter(|n| **n == "posting").count(), 1, "{names:?}");
    assert_eq!(st.bytes, sub.bytes);
    assert_eq!(p.cb.status(slot).unwrap().state, TransferState::Done);
}

#[test]
fn layers_may_be_announced_before_the_submit_and_only_by_their_rank_s_client() {
    let p = pair("stream-early");
    let tokens = 40;
    let (src, dst, _) = sides(&p, tokens, true);
    let intruder = Client::connect(&p.a_socket, "intruder").unwrap();
    let refused = |r: Result<(), ClientError>, code: Code, needle: &str| match r {
        Err(ClientError::Daemon { code: c, message }) => {
            assert_eq!(c, code as u32, "{message}");
            assert!(message.contains(needle), "{message}");
        }
        other => panic!("expected {code:?}, got {other:?}"),
    };
    refused(intruder.produced("prefill", "s2", 0, 4), Code::PermissionDenied, "registered by another client");
    refused(p.ca.produced("prefill", "s2", 9, 4), Code::BadRequest, "no rank 9");
    refused(p.ca.produced("prefill", "s2", 0, 5), Code::BadRequest, "the model of group `prefill` has 4");
    refused(p.ca.produced("nope", "s2", 0, 1), Code::UnknownGroup, "no group `nope`");
    // Every rank had written everything before the submit: it all moves at once.
    for rank in 0..src.side.shard.ranks.len() as u32 {
        p.ca.produced("prefill", "s2", rank, 4).unwrap();
    }
    let slot = prepare(&p, &dst, "s2", tokens);
    let sub = p.ca.submit(streamed("s2", &src, tokens)).unwrap();
    p.cb.wait(slot, FlagName::DecoderUsable, WAIT).unwrap();
    p.ca.wait(sub.slot, FlagName::DecoderUsable, WAIT).unwrap();
    assert!(read_back(&dst) == verify::expected_destination(&model(), &dst.side, tokens, 0), "destination bytes differ");
}

#[test]
fn a_streamed_transfer_cancelled_while_waiting_for_a_layer_fails_both_sides_after_what_arrived() {
    let p = pair("stream-cancel");
    let tokens = 40;
    let (src, dst, _) = sides(&p, tokens, true);
    let slot = prepare(&p, &dst, "s3", tokens);
    let sub = p.ca.submit(streamed("s3", &src, tokens)).unwrap();
    for rank in 0..src.side.shard.ranks.len() as u32 {
        p.ca.produced("prefill", "s3", rank, 2).unwrap();
    }
    p.cb.wait(slot, FlagName::LayerReady(1), WAIT).unwrap();
    // ... and the source has the answers for them: it counts the writes
    // the destination answered, and a cancel stops it reading answers.
    let deadline = std::time::Instant::now() + WAIT;
    while p.ca.status(sub.slot).unwrap().rails.iter().map(|r| r.bytes).sum::<u64>() < sub.bytes / 2 {
        assert!(std::time::Instant::now() < deadline, "the source never heard layers 0 and 1 answered");
        std::thread::sleep(Duration::from_millis(5));
    }
    // The engine gives up on the request before layer 2.
    p.ca.cancel(sub.slot).unwrap();
    match p.cb.wait(slot, FlagName::DecoderUsable, WAIT) {
        Err(ClientError::Wait(e)) => assert!(e.to_string().contains("cancelled") || e.to_string().contains("fail"), "{e}"),
        other => panic!("the destination should fail, got {other:?}"),
    }
    let st = p.cb.status(slot).unwrap();
    assert_eq!(st.state, TransferState::Failed);
    assert!(st.error.as_deref().unwrap_or("").contains("cancelled"), "{:?}", st.error);
    assert!(!p.cb.ready(slot, FlagName::LayerReady(2)));
    assert_eq!(p.ca.status(sub.slot).unwrap().state, TransferState::Cancelled);
    // The failed transfer still counts what crossed the link: layers 0 and 1
    // (half of the request's payload, the toy model's layers being equal) and
    // their framing, and not the layers it never sent.
    let wire = || {
        let text = p.ca.stats().unwrap();
        let line = text.lines().find(|l| l.starts_with("kvwire_wire_bytes_total{")).expect("a wire_bytes line").to_string();
        line.rsplit(' ').next().unwrap().parse::<u64>().unwrap()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while wire() < sub.bytes / 2 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let counted = wire();
    assert!(counted >= sub.bytes / 2 && counted < sub.bytes, "wire_bytes_total {counted} for a transfer cancelled after 2 of 4 layers of {} payload bytes", sub.bytes);
}

/// A claim on a connection the announcement did not come on: the source
/// books the announcement while taking the connection it came on for
/// another transfer (streamed, so it keeps it), and claims on the other
/// connection it keeps. The destination accepts it (the keys are the
/// node's), and the bytes and both sides' counts come out exact.
#[test]
fn an_announcement_booked_on_a_busy_connection_is_claimed_on_another() {
    let p = pair("stream-cross-claim");
    let tokens = 40;
    let (src, dst, _) = sides(&p, tokens, true);
    let ranks = src.side.shard.ranks.len() as u32;
    let count = |stats: &str, name: &str, how: &str| counter(stats, name, "a", &format!("how=\"{how}\""));
    // A streamed transfer holds its peer connection until its engine says
    // every layer is written.
    let hold = |request: &str| {
        let slot = prepare(&p, &dst, request, tokens);
        (slot, p.ca.submit(streamed(request, &src, tokens)).unwrap().slot)
    };
    let release = |request: &str, (slot, sslot): (u16, u16)| {
        for rank in 0..ranks {
            p.ca.produced("prefill", request, rank, 4).unwrap();
        }
        p.cb.wait(slot, FlagName::DecoderUsable, WAIT).unwrap();
        p.ca.wait(sslot, FlagName::DecoderUsable, WAIT).unwrap();
        // Back in the source's pool once its verdict was read.
        let deadline = std::time::Instant::now() + WAIT;
        while p.ca.status(sslot).unwrap().state != TransferState::Done {
            assert!(std::time::Instant::now() < deadline, "{request} never ended at the source");
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    // Two connections, X then Y, each held by a transfer; X comes back
    // first, so Y is the source's most recently kept.
    let s1 = hold("x1");
    let s2 = hold("y1");
    release("x1", s1);
    release("y1", s2);
    assert_eq!(count(&p.ca.stats().unwrap(), "kvwire_peer_connections_total", "opened"), 2);
    // Announced on the newest idle connection here: Y.
    let prep = PrepareReceive { group: "decode".into(), request: "rb".into(), block_table: dst.side.block_table.clone(), tokens, prefix_tokens: 0, source: Some("a".into()) };
    let (slot, told) = p.cb.prepare_announced(prep).unwrap();
    assert_eq!(told, Some(Ok(())));
    // The next submit reads it on the way and takes Y for itself (no
    // announcement of its own: the most recently kept), and holds it.
    let t = hold("t1");
    // `rb` claims on X.
    let claimed = count(&p.ca.stats().unwrap(), "kvwire_starts_total", "claimed");
    let sub = p.ca.submit(streamed("rb", &src, tokens)).unwrap();
    for rank in 0..ranks {
        p.ca.produced("prefill", "rb", rank, 4).unwrap();
    }
    p.cb.wait(slot, FlagName::DecoderUsable, WAIT).unwrap();
    p.ca.wait(sub.slot, FlagName::DecoderUsable, WAIT).unwrap();
    assert!(read_back(&dst) == verify::expected_destination(&model(), &dst.side, tokens, 0), "destination bytes differ");
    let stats = p.ca.stats().unwrap();
    assert_eq!(count(&stats, "kvwire_starts_total", "claimed"), claimed + 1, "rb did not claim");
    assert_eq!(count(&stats, "kvwire_peer_connections_total", "opened"), 2, "rb opened a connection: it did not claim on X");
    assert_eq!(p.ca.status(sub.slot).unwrap().wire_bytes, p.cb.status(slot).unwrap().wire_bytes, "both sides count the same crossing, the announcement included");
    release("t1", t);
}
