//! The destination: one thread per accepted connection pre-posts
//! receives into its note buffers and counts each range a received note
//! names through the shared acceptance path ([`crate::accept`]), and
//! answers its source's requests for the regions granted to its node.

use super::shared::Shared;
use super::handshake;
use super::notes::NoteRing;
use super::qp::{wc_error, Qp, Wc, WC_RECV, WC_SUCCESS};
use super::TRANSPORT;
use crate::accept::{self, Admitted, Incoming, Refusal};
use crate::auth::{Gate, Pass};
use crate::hello;
use crate::TransportError;
use kvwire_core::protocol::{Header, Kind, HEADER_LEN, NOTE_LEN};
use std::io::Read;
use std::os::fd::AsFd;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an MR whose key was revoked through the registry directly
/// stays registered at most (see [`Shared::sweep`]).
const SWEEP_EVERY: Duration = Duration::from_millis(5);

pub(super) fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    let mut children: Vec<JoinHandle<()>> = Vec::new();
    let mut last_sweep = Instant::now();
    let gate = Gate::new(shared.limits.caps);
    while !shared.stop.load(Ordering::Acquire) {
        match listener.accept() {
            Ok((stream, from)) => {
                let pass = match gate.enter() {
                    Ok(p) => p,
                    Err(why) => {
                        shared.registry.handshake_refused();
                        tracing::debug!(peer = %from, why, "verbs connection refused");
                        continue;
                    }
                };
                let s = shared.clone();
                match std::thread::Builder::new().name("kvwire-verbs-recv".into()).spawn(move || {
                    if let Err(e) = serve(&s, stream, pass) {
                        if let Some(held_back) = crate::logbudget::CONNECTIONS.admit() {
                            tracing::warn!(peer = %from, error = %e, held_back, "verbs connection ended with an error");
                        }
                    }
                }) {
                    Ok(t) => children.push(t),
                    Err(e) => tracing::warn!(error = %e, "cannot spawn verbs receive thread"),
                }
                children.retain(|t| !t.is_finished());
            }
            // Sleep until a peer connects or the next sweep is due.
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                crate::answers::ready(&listener, false, Some(SWEEP_EVERY.saturating_sub(last_sweep.elapsed())));
            }
            Err(e) => {
                tracing::warn!(error = %e, "verbs handshake accept failed");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        if last_sweep.elapsed() >= SWEEP_EVERY {
            shared.sweep();
            last_sweep = Instant::now();
        }
    }
    for t in children {
        let _ = t.join();
    }
}

/// Counts the ranges a received note buffer names, each through the
/// shared acceptance path (the NIC placed the bytes already). A refused
/// note counts nothing. A malformed note message ends the connection,
/// as a malformed frame does on every backend.
fn count_notes(shared: &Shared, peer_id: u64, ring: &NoteRing, wc: &Wc, seen_at: Instant, peer: &str) -> Result<(), TransportError> {
    for n in ring.read(wc.wr_id, wc.byte_len)? {
        let w = Incoming { tag: n.tag, key: n.key, offset: n.offset, len: n.len, stride: None };
        // The NIC placed the payload before the note came, accepted or not;
        // a range placed before (a re-sent slice) counts its payload once.
        shared.placement.crossed(n.tag.slot, NOTE_LEN as u64 + n.len);
        match accept::accept(&shared.registry, &shared.placement, peer_id, w, |_: &Admitted| Ok::<_, Refusal>(seen_at)) {
            Ok(fresh) => shared.placement.uncrossed(n.tag.slot, n.len - fresh.min(n.len)),
            Err(why) => {
                if why.foreign() {
                    shared.placement.uncrossed(n.tag.slot, NOTE_LEN as u64 + n.len);
                }
                accept::refused(&shared.placement, TRANSPORT, peer, w, &why)
            }
        }
    }
    Ok(())
}

/// Answers a source's request on the handshake stream, the only one there
/// is after the handshake: an empty `Hello` asks for the regions granted
/// to the session's node now, answered with our hello listing them. Anything
/// else ends the connection.
fn answer_regions(shared: &Shared, stream: &TcpStream, qp: &Qp, peer_id: u64, h: Header) -> Result<(), TransportError> {
    if h.kind != Kind::Hello || h.len != 0 {
        return Err(TransportError::Refused(format!(
            "after the handshake a source may only ask for its regions (an empty Hello), not send {:?} with {} bytes",
            h.kind, h.len
        )));
    }
    stream.set_nonblocking(false).map_err(TransportError::io("connection socket"))?;
    let _ = stream.set_write_timeout(Some(shared.limits.handshake_timeout));
    hello::send_hello(&mut &*stream, &shared.hello(qp, Some(peer_id)))?;
    stream.set_nonblocking(true).map_err(TransportError::io("connection socket"))
}

/// One accepted connection: handshake, then count the ranges of received
/// write notes until the peer closes the TCP stream or the endpoint stops.
fn serve(shared: &Shared, mut stream: TcpStream, mut pass: Pass) -> Result<(), TransportError> {
    stream.set_nonblocking(false).map_err(TransportError::io("handshake socket"))?;
    let _ = stream.set_nodelay(true);
    // Declared before the QP, so dropped after it: the NIC may write into
    // these buffers until the QP is destroyed.
    let ring = match NoteRing::new(shared, shared.limits.recv_depth) {
        Ok(r) => r,
        Err(e) => {
            let _ = hello::send_refusal(&mut stream, &e.to_string());
            return Err(e);
        }
    };
    let (peer, mut qp, peer_id) = handshake::answer(shared, &stream, &ring)?;
    pass.authenticated();
    stream.set_nonblocking(true).map_err(TransportError::io("connection socket"))?;
    // Empty polls since the last completion, from `idle_since`; `resting`
    // once they spun `IDLE_SPIN` and the connection sleeps between polls.
    let (mut idle, mut idle_since, mut resting) = (0u32, Instant::now(), false);
    let mut last_note = Instant::now();
    let mut last_check = Instant::now();
    let mut failed = false;
    // A request read so far on the handshake stream.
    let mut asked: Vec<u8> = Vec::with_capacity(HEADER_LEN);
    loop {
        let wcs = qp.drain()?;
        if !wcs.is_empty() {
            (idle, resting) = (0, false);
            let seen_at = Instant::now();
            let mut reposts = Vec::with_capacity(wcs.len());
            for wc in &wcs {
                if wc.status != WC_SUCCESS {
                    if !failed {
                        tracing::warn!(peer = %peer.node, error = %wc_error(wc), "verbs receive completion failed; the queue pair is in the error state");
                    }
                    failed = true;
                    continue;
                }
                if wc.opcode == WC_RECV {
                    count_notes(shared, peer_id, &ring, wc, seen_at, &peer.node)?;
                    last_note = seen_at;
                } else {
                    tracing::warn!(peer = %peer.node, opcode = wc.opcode, "unexpected receive completion (not a write note); ignored");
                }
                reposts.push(wc.wr_id as u32);
            }
            if !reposts.is_empty() && !failed {
                qp.post_recvs(&ring, reposts.into_iter())?;
            }
            // A steady stream of notes still looks at the stream now and then.
            if seen_at.duration_since(last_check) < Duration::from_millis(10) {
                continue;
            }
        } else {
            // Idle: poll the CQ alone for up to `IDLE_SPIN` (no syscalls, and
            // the clock only now and then: the next note of a batch in
            // flight usually comes within microseconds), then sleep until
            // the next completion or a byte on the stream. Yielding, and
            // reading the stream and the clock, on every empty poll cost
            // more CPU than the notes did; with soft-RoCE that CPU is what
            // moves the sources' writes.
            if idle == 0 {
                idle_since = Instant::now();
            }
            idle = idle.saturating_add(1);
            if !resting {
                if idle % 64 != 0 || idle_since.elapsed() < IDLE_SPIN {
                    std::hint::spin_loop();
                    continue;
                }
                resting = true;
            }
        }
        if shared.stop.load(Ordering::Acquire) {
            return Ok(());
        }
        let now = Instant::now();
        if now.duration_since(last_note) >= shared.limits.idle_timeout {
            tracing::debug!(peer = %peer.node, "verbs connection closed: idle");
            return Ok(());
        }
        // A kept connection's source asks on the stream for its regions
        // before a transfer's first post.
        last_check = now;
        let mut b = [0u8; HEADER_LEN];
        match stream.read(&mut b[..HEADER_LEN - asked.len()]) {
            Ok(0) => {
                // The peer closed: its writes have all completed or failed at
                // its side; take what is left in the CQ, then go.
                for wc in qp.drain()? {
                    if wc.status == WC_SUCCESS && wc.opcode == WC_RECV {
                        count_notes(shared, peer_id, &ring, &wc, Instant::now(), &peer.node)?;
                    }
                }
                return Ok(());
            }
            Ok(n) => {
                asked.extend_from_slice(&b[..n]);
                if asked.len() == HEADER_LEN {
                    let h = Header::decode(&asked, 0)?;
                    asked.clear();
                    answer_regions(shared, &stream, &qp, peer_id, h)?;
                }
                continue;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(TransportError::io("connection socket")(e)),
        }
        if resting {
            qp.rest(Some(stream.as_fd()), IDLE_TICK)?;
        }
    }
}

/// How long an idle connection polls its CQ before it sleeps on it.
const IDLE_SPIN: Duration = Duration::from_micros(50);

/// The longest an idle connection sleeps before it looks at the endpoint's
/// stop flag and its idle timeout again.
const IDLE_TICK: Duration = Duration::from_millis(20);
