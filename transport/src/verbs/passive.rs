//! The destination: one thread per accepted connection pre-posts
//! receives into its note buffers and counts each range a received note
//! names through the shared acceptance path ([`crate::accept`]).

use super::shared::Shared;
use super::handshake;
use super::notes::NoteRing;
use super::qp::{wc_error, Wc, WC_RECV, WC_SUCCESS};
use super::TRANSPORT;
use crate::accept::{self, Admitted, Incoming, Refusal};
use crate::auth::{Gate, Pass};
use crate::hello;
use crate::TransportError;
use kvwire_core::protocol::NOTE_LEN;
use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

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
                        tracing::debug!(peer = %from, why, "verbs connection refused");
                        continue;
                    }
                };
                let s = shared.clone();
                match std::thread::Builder::new().name("kvwire-verbs-recv".into()).spawn(move || {
                    if let Err(e) = serve(&s, stream, pass) {
                        tracing::warn!(peer = %from, error = %e, "verbs connection ended with an error");
                    }
                }) {
                    Ok(t) => children.push(t),
                    Err(e) => tracing::warn!(error = %e, "cannot spawn verbs receive thread"),
                }
                children.retain(|t| !t.is_finished());
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(2)),
            Err(e) => {
                tracing::warn!(error = %e, "verbs handshake accept failed");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        if last_sweep.elapsed() >= Duration::from_millis(5) {
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
fn count_notes(shared: &Shared, session: u64, ring: &NoteRing, wc: &Wc, seen_at: Instant, peer: &str) -> Result<(), TransportError> {
    for n in ring.read(wc.wr_id, wc.byte_len)? {
        let w = Incoming { tag: n.tag, key: n.key, offset: n.offset, len: n.len };
        // The NIC placed the payload before the note came, accepted or not;
        // a range placed before (a re-sent slice) counts its payload once.
        shared.placement.crossed(n.tag.slot, NOTE_LEN as u64 + n.len);
        match accept::accept(&shared.registry, &shared.placement, session, w, |_: &Admitted| Ok::<_, Refusal>(seen_at)) {
            Ok(fresh) => shared.placement.uncrossed(n.tag.slot, n.len - fresh.min(n.len)),
            Err(why) => {
                if why.foreign() {
                    shared.placement.uncrossed(n.tag.slot, NOTE_LEN as u64 + n.len);
                }
                accept::log_refusal(TRANSPORT, peer, w, &why)
            }
        }
    }
    Ok(())
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
    let (peer, mut qp, session) = handshake::answer(shared, &stream, &ring)?;
    pass.authenticated();
    stream.set_nonblocking(true).map_err(TransportError::io("connection socket"))?;
    let mut idle = 0u32;
    let mut last_note = Instant::now();
    let mut last_check = Instant::now();
    let mut failed = false;
    loop {
        let wcs = qp.drain()?;
        let seen_at = Instant::now();
        let mut reposts = Vec::new();
        for wc in &wcs {
            if wc.status != WC_SUCCESS {
                if !failed {
                    tracing::warn!(peer = %peer.node, error = %wc_error(wc), "verbs receive completion failed; the queue pair is in the error state");
                }
                failed = true;
                continue;
            }
            if wc.opcode == WC_RECV {
                count_notes(shared, session, &ring, wc, seen_at, &peer.node)?;
                last_note = seen_at;
            } else {
                tracing::warn!(peer = %peer.node, opcode = wc.opcode, "unexpected receive completion (not a write note); ignored");
            }
            reposts.push(wc.wr_id as u32);
        }
        if !reposts.is_empty() && !failed {
            qp.post_recvs(&ring, reposts.into_iter())?;
        }
        if wcs.is_empty() {
            idle = idle.saturating_add(1);
            if idle > 200 {
                std::thread::sleep(Duration::from_micros(if idle > 5000 { 500 } else { 50 }));
            } else {
                std::thread::yield_now();
            }
        } else {
            idle = 0;
        }
        if shared.stop.load(Ordering::Acquire) {
            return Ok(());
        }
        if last_note.elapsed() >= shared.limits.idle_timeout {
            tracing::debug!(peer = %peer.node, "verbs connection closed: idle");
            return Ok(());
        }
        if last_check.elapsed() >= Duration::from_millis(10) {
            last_check = Instant::now();
            let mut b = [0u8; 64];
            match stream.read(&mut b) {
                Ok(0) => {
                    // The peer closed: its writes have all completed or failed at
                    // its side; take what is left in the CQ, then go.
                    for wc in qp.drain()? {
                        if wc.status == WC_SUCCESS && wc.opcode == WC_RECV {
                            count_notes(shared, session, &ring, &wc, Instant::now(), &peer.node)?;
                        }
                    }
                    return Ok(());
                }
                Ok(_) => {} // nothing is sent after the handshake; ignore
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(TransportError::io("connection socket")(e)),
            }
        }
    }
}
