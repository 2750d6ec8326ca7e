//! The source: a connection checks each batch against the peer's hello,
//! posts its `RDMA_WRITE`s and then the SENDs of its notes, and turns work
//! completions into batch completions through the shared ledger.

use super::shared::{RegionMr, Shared};
use super::handshake;
use super::notes::NoteRing;
use super::qp::{wc_error, Qp, WC_FLUSH, WC_SUCCESS};
use super::{chain, os_code, verbs_err, MAX_WR_BYTES, NOTES_PER_SEND, NOTE_BUF, TRANSPORT};
use crate::auth::Credential;
use crate::accept::Refusal;
use crate::ledger::Ledger;
use crate::metrics::Hop;
use crate::{Batch, BatchId, Completion, Connection, TransportError};
use crate::hello;
use kvwire_core::protocol::{self, Hello, Kind, RegionDesc, WriteNote, NOTE_LEN};
use rdma_mummy_sys::ibv_sge;
use sideway::ibverbs::queue_pair::{PostSendGuard, QueuePair, SetScatterGatherEntry, WorkRequestFlags};
use std::collections::HashMap;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One work request, validated.
enum Wr {
    /// An `RDMA_WRITE` gathering `sges` into `len` bytes of the peer's MR.
    Write { sges: Vec<ibv_sge>, rkey: u32, raddr: u64, len: u64 },
    /// A SEND of `notes[first..first + count]` of the batch.
    Notes { first: usize, count: usize },
}

impl Wr {
    /// Bytes of write notes this work request sends.
    fn note_bytes(&self) -> u64 {
        match self {
            Wr::Write { .. } => 0,
            Wr::Notes { count, .. } => (count * NOTE_LEN) as u64,
        }
    }
}

/// A batch checked and cut into work requests.
struct Planned {
    wrs: Vec<Wr>,
    notes: Vec<WriteNote>,
    /// The local regions the writes read.
    sources: Vec<Arc<RegionMr>>,
}

/// A connection initiating writes into one peer's regions.
#[derive(Debug)]
pub struct VerbsConnection {
    // Field order is drop order: destroy the QP (ending the NIC's reads of
    // source memory and of the note ring) before the in-flight batches
    // release their sources and the ring goes.
    qp: Qp,
    notes: NoteRing,
    /// Note SENDs posted so far; the next one uses slot `sent % slots`.
    /// The ring has one slot per send-queue entry and completions are
    /// reaped in order, so a slot is free again when it comes round.
    notes_sent: u64,
    /// Posted batches; each keeps its source MRs registered and mapped
    /// until its work requests completed.
    ledger: Ledger<Vec<Arc<RegionMr>>>,
    outstanding_wrs: u32,
    /// Note bytes posted (the framing of RDMA writes).
    framing: u64,
    broken: Option<String>,
    remote: Hello,
    remote_regions: HashMap<u32, RegionDesc>,
    /// The handshake socket: while it is open, the peer keeps its QP. A
    /// kept connection asks on it for the regions granted since its hello.
    stream: TcpStream,
    shared: Arc<Shared>,
}

impl VerbsConnection {
    pub(super) fn connect(shared: Arc<Shared>, peer: &str, cred: &Credential) -> Result<VerbsConnection, TransportError> {
        let stream = TcpStream::connect(peer).map_err(TransportError::io("connect handshake"))?;
        let _ = stream.set_nodelay(true);
        let mut qp = Qp::new(&shared, shared.limits.send_depth, 1, shared.info.send_sge)?;
        let notes = NoteRing::new(&shared, shared.limits.send_depth)?;
        let remote = handshake::initiate(&shared, &stream, &mut qp, cred)?;
        let remote_regions = remote.regions.iter().map(|d| (d.key, *d)).collect();
        Ok(VerbsConnection {
            qp,
            notes,
            notes_sent: 0,
            ledger: Ledger::new(shared.placement.hops().clone(), 1),
            outstanding_wrs: 0,
            framing: 0,
            broken: None,
            remote,
            remote_regions,
            stream,
            shared,
        })
    }

    /// Asks the peer, on the handshake stream, for the regions granted to
    /// this side's node now, and takes them in place of those it knew: a kept
    /// connection carries later transfers, whose windows the peer
    /// registered after this connection's hello. A failure ends the
    /// connection.
    fn refresh(&mut self) -> Result<(), TransportError> {
        let t = Some(self.shared.limits.handshake_timeout);
        let asked = (|| {
            self.stream.set_read_timeout(t).map_err(TransportError::io("handshake socket"))?;
            self.stream.set_write_timeout(t).map_err(TransportError::io("handshake socket"))?;
            hello::send(&mut &self.stream, &hello::control(Kind::Hello, &[]), "ask the peer for its regions")?;
            hello::read_hello(&mut &self.stream, TRANSPORT)
        })();
        let asked = asked.and_then(|h| match h.node == self.remote.node {
            true => Ok(h),
            false => Err(TransportError::Refused(format!("peer {} answered for its regions as {}", self.remote.node, hello::printable(&h.node)))),
        });
        let theirs = match asked {
            Ok(h) => h,
            Err(e) => {
                self.broken = Some(format!("asking {} for its regions: {e}", self.remote.node));
                return Err(e);
            }
        };
        self.remote_regions = theirs.regions.iter().map(|d| (d.key, *d)).collect();
        self.remote.regions = theirs.regions;
        Ok(())
    }

    /// Checks every write and turns it into work requests (the writes,
    /// then the note SENDs naming them); posts nothing.
    fn plan(&self, batch: &Batch) -> Result<Planned, TransportError> {
        if batch.writes.is_empty() {
            return Err(TransportError::Refused("empty batch: nothing to write (refused locally, nothing posted)".into()));
        }
        let mrs = self.shared.mrs.lock().expect("mr lock");
        let mut wrs = Vec::with_capacity(batch.writes.len());
        let mut sources: Vec<Arc<RegionMr>> = Vec::new();
        for (i, w) in batch.writes.iter().enumerate() {
            let dst = self.remote_regions.get(&w.dst_key);
            // The destination's own refusal texts, checked here since a
            // refused one-sided write could not be told back.
            protocol::check_write(w.dst_key, dst.map(|d| d.len), w.dst_offset, w.len).map_err(|e| {
                TransportError::Refused(format!(
                    "write {i}: {} (checked locally against peer {}'s hello; nothing posted)",
                    Refusal::from(e),
                    self.remote.node
                ))
            })?;
            let dst = dst.expect("checked by check_write");
            let Some(rkey) = dst.rkey else {
                return Err(TransportError::Refused(format!(
                    "write {i}: peer {}'s hello gives no rkey for key {:#010x}; nothing posted",
                    self.remote.node, w.dst_key
                )));
            };
            let src = mrs.get(&w.src_key).filter(|m| m.live(w.src_key, &self.shared.registry)).ok_or_else(|| {
                TransportError::Source(format!(
                    "write {i}: local key {:#010x} is not registered with VerbsEndpoint::register (or was revoked); nothing posted",
                    w.src_key
                ))
            })?;
            match w.src_offset.checked_add(w.len) {
                Some(end) if end <= src.len() => {}
                _ => {
                    return Err(TransportError::Source(format!(
                        "write {i}: {} bytes at offset {} exceed local region {:#010x} of {} bytes; nothing posted",
                        w.len, w.src_offset, w.src_key, src.len()
                    )))
                }
            }
            if !sources.iter().any(|s| Arc::ptr_eq(s, src)) {
                sources.push(src.clone());
            }
            let laddr = src.laddr() + w.src_offset;
            let raddr = dst.addr + w.dst_offset;
            let mut done = 0u64;
            while done < w.len {
                let n = (w.len - done).min(MAX_WR_BYTES);
                let sge = ibv_sge { lkey: src.mr.lkey(), addr: laddr + done, length: n as u32 };
                push_wr(&mut wrs, sge, rkey, raddr + done, self.shared.info.send_sge as usize);
                done += n;
            }
        }
        // One note per range written, however many writes it took: the
        // destination counts ranges.
        let mut notes: Vec<WriteNote> = Vec::new();
        for w in &batch.writes {
            match notes.last_mut() {
                Some(n) if n.key == w.dst_key && n.offset + n.len == w.dst_offset => n.len += w.len,
                _ => notes.push(WriteNote { tag: batch.tag, key: w.dst_key, offset: w.dst_offset, len: w.len }),
            }
        }
        for first in (0..notes.len()).step_by(NOTES_PER_SEND) {
            wrs.push(Wr::Notes { first, count: (notes.len() - first).min(NOTES_PER_SEND) });
        }
        Ok(Planned { wrs, notes, sources })
    }

    /// Posts `wrs` as signaled work requests with `wr_id = batch`: writes
    /// as `RDMA_WRITE`, notes (from `notes`) as SENDs out of the note ring.
    ///
    /// # Safety
    /// Every write's `(lkey, laddr, len)` must lie in a live MR of this
    /// endpoint's PD, and that MR and its memory must stay registered and
    /// mapped until the completion of each work request has been polled
    /// (or the QP destroyed). The caller keeps them alive in the batch's
    /// ledger entry.
    unsafe fn post_writes(&mut self, batch: u64, wrs: &[Wr], notes: &[WriteNote]) -> Result<(), TransportError> {
        // Fill the ring slots first: the guard borrows the QP.
        let mut sends = Vec::new();
        for w in wrs {
            if let Wr::Notes { first, count } = *w {
                let slot = (self.notes_sent % u64::from(self.notes.slots)) as u32;
                self.notes_sent += 1;
                let mut b = vec![0u8; count * NOTE_LEN];
                for (n, c) in notes[first..first + count].iter().zip(b.chunks_exact_mut(NOTE_LEN)) {
                    n.encode(c);
                }
                self.notes.mem.write(u64::from(slot) * NOTE_BUF as u64, &b)?;
                sends.push((self.notes.addr(slot), b.len() as u32));
            }
        }
        let lkey = self.notes.mr.lkey();
        let mut sends = sends.into_iter();
        let mut guard = self.qp.qp.start_post_send();
        for w in wrs {
            match w {
                Wr::Write { sges, rkey, raddr, .. } => {
                    let h = guard.construct_wr(batch, WorkRequestFlags::Signaled).setup_write(*rkey, *raddr);
                    // SAFETY: the caller guarantees the local ranges stay
                    // registered and mapped until this work request's
                    // completion is polled.
                    unsafe { h.setup_sge_list(sges) };
                }
                Wr::Notes { .. } => {
                    let (addr, len) = sends.next().expect("a ring slot per note send");
                    let h = guard.construct_wr(batch, WorkRequestFlags::Signaled).setup_send();
                    // SAFETY: the slot lies in the ring's MR, which lives as
                    // long as this connection (dropped after the QP), and is
                    // not rewritten before this send completed (see
                    // `notes_sent`).
                    unsafe { h.setup_sge(lkey, addr, len) };
                }
            }
        }
        guard.post().map_err(|e| {
            let hint = match os_code(&e) {
                Some(c) if c == nix::errno::Errno::ENOMEM as i32 => "; the send queue is full (raise send_depth)",
                Some(c) if c == nix::errno::Errno::EINVAL as i32 => "; a work request was rejected (QP not in RTS, or too many SGEs)",
                _ => "",
            };
            verbs_err("ibv_post_send", format!("{} RDMA_WRITE/SEND work requests: {}{hint}", wrs.len(), chain(&e)))
        })
    }

    /// Processes completions available now; returns how many there were.
    fn reap(&mut self) -> Result<usize, TransportError> {
        let wcs = match self.qp.drain() {
            Ok(w) => w,
            Err(e) => {
                self.broken.get_or_insert_with(|| e.to_string());
                return Err(e);
            }
        };
        for wc in &wcs {
            self.outstanding_wrs = self.outstanding_wrs.saturating_sub(1);
            if wc.status != WC_SUCCESS {
                // A flush only echoes an earlier failure: keep the first real cause.
                let msg = wc_error(wc);
                if self.broken.as_deref().is_none_or(|m| m.starts_with("flushed") && wc.status != WC_FLUSH) {
                    self.broken = Some(msg);
                }
            }
            let result = if wc.status == WC_SUCCESS { Ok(()) } else { Err(verbs_err("RDMA_WRITE/SEND completion", wc_error(wc))) };
            // A flush only echoes an earlier failure: a real cause replaces it.
            let echo = |old: &TransportError| wc.status != WC_FLUSH && matches!(old, TransportError::Verbs { message, .. } if message.starts_with("flushed"));
            self.ledger.part_done(BatchId(wc.wr_id), result, echo, Instant::now());
        }
        Ok(wcs.len())
    }

    /// Waits (reaping) until `need` send-queue entries are free.
    fn wait_room(&mut self, need: u32, deadline: Instant) -> Result<(), TransportError> {
        let depth = self.shared.limits.send_depth;
        let mut idle = 0u32;
        while self.outstanding_wrs + need > depth {
            if self.reap()? == 0 {
                if Instant::now() >= deadline {
                    return Err(verbs_err(
                        "ibv_poll_cq",
                        format!("send queue full ({} of {depth} in flight) and no completion for 60 s: the peer stopped acknowledging", self.outstanding_wrs),
                    ));
                }
                idle += 1;
                self.idle(idle, deadline)?;
            } else {
                idle = 0;
            }
        }
        Ok(())
    }

    /// After `idle` empty polls: spins, then yields (a write usually
    /// completes within microseconds), then sleeps on the CQ's completion
    /// channel until the next completion or `deadline`. Several
    /// connections polling on few cores starved each other and, with
    /// soft-RoCE, the kernel work that completes their writes.
    fn idle(&mut self, idle: u32, deadline: Instant) -> Result<(), TransportError> {
        if idle < 100 {
            std::hint::spin_loop();
        } else if idle < 300 {
            std::thread::yield_now();
        } else {
            self.qp.rest(None, deadline.saturating_duration_since(Instant::now()))?;
        }
        Ok(())
    }
}

/// Appends a write of `sge` to the peer's `raddr`: one more SGE of the
/// last write when it continues that one at the peer (within the device's
/// SGEs and `MAX_WR_BYTES`), or that SGE grown when it also continues it
/// locally; else a work request of its own.
fn push_wr(wrs: &mut Vec<Wr>, sge: ibv_sge, rkey: u32, raddr: u64, max_sge: usize) {
    if let Some(Wr::Write { sges, rkey: k, raddr: at, len }) = wrs.last_mut() {
        if *k == rkey && *at + *len == raddr && *len + u64::from(sge.length) <= MAX_WR_BYTES {
            let last = sges.last_mut().expect("a write gathers at least one SGE");
            if last.lkey == sge.lkey && last.addr + u64::from(last.length) == sge.addr {
                last.length += sge.length;
                *len += u64::from(sge.length);
                return;
            }
            if sges.len() < max_sge {
                sges.push(sge);
                *len += u64::from(sge.length);
                return;
            }
        }
    }
    wrs.push(Wr::Write { sges: vec![sge], rkey, raddr, len: u64::from(sge.length) });
}

impl Connection for VerbsConnection {
    fn remote(&self) -> &Hello {
        &self.remote
    }

    fn post(&mut self, batch: Batch) -> Result<BatchId, TransportError> {
        batch.unstrided("verbs")?;
        if let Some(why) = &self.broken {
            return Err(verbs_err(
                "ibv_post_send",
                format!("connection to {} is unusable, its queue pair failed earlier ({why}); reconnect", self.remote.node),
            ));
        }
        // A key the last hello did not list: a region granted since, when
        // this connection is kept from an earlier transfer.
        if batch.writes.iter().any(|w| !self.remote_regions.contains_key(&w.dst_key)) {
            self.refresh()?;
        }
        let Planned { wrs, notes, sources } = self.plan(&batch)?;
        let start = Instant::now();
        let id = self.ledger.begin(batch.tag, batch.bytes(), start, sources);
        let depth = self.shared.limits.send_depth.max(1);
        let deadline = start + Duration::from_secs(60);
        let mut post_time = Duration::ZERO;
        let mut at = 0usize;
        let mut failure: Option<TransportError> = None;
        while at < wrs.len() {
            let n = (wrs.len() - at).min(depth as usize);
            if let Err(e) = self.wait_room(n as u32, deadline) {
                failure = Some(e);
                break;
            }
            if let Some(why) = &self.broken {
                failure = Some(verbs_err("ibv_post_send", format!("queue pair failed while posting: {why}")));
                break;
            }
            let t = Instant::now();
            // SAFETY: `plan` found every local range inside a registered MR,
            // and the batch's ledger entry (opened above, dropped only after
            // every work request of it completed; the ledger is dropped after
            // the QP) holds those MRs and their memory.
            let r = unsafe { self.post_writes(id.0, &wrs[at..at + n], &notes) };
            post_time += t.elapsed();
            match r {
                Ok(()) => {
                    self.outstanding_wrs += n as u32;
                    self.ledger.parts(id, n as u64);
                    self.framing += wrs[at..at + n].iter().map(Wr::note_bytes).sum::<u64>();
                    at += n;
                }
                Err(e) => {
                    // Some of these may have been posted; their completions can
                    // no longer be attributed, so the connection is done.
                    self.broken = Some(e.to_string());
                    failure = Some(e);
                    break;
                }
            }
        }
        self.shared.placement.hops().record_batch(Hop::Post, post_time, batch.bytes());
        match failure {
            None => {
                self.ledger.seal(id, None);
                Ok(id)
            }
            Some(e) if at == 0 && self.broken.is_none() => {
                // Nothing of this batch reached the QP.
                self.ledger.withdraw(id);
                Err(e)
            }
            // Part of it is posted: report through a failed completion, once
            // the posted part has completed (or at once, if the QP is gone).
            Some(e) if self.broken.is_some() => {
                self.ledger.fail_now(id, e);
                Ok(id)
            }
            Some(e) => {
                self.ledger.seal(id, Some(e));
                Ok(id)
            }
        }
    }

    fn poll(&mut self, timeout: Duration) -> Result<Vec<Completion>, TransportError> {
        let deadline = Instant::now() + timeout;
        let mut idle = 0u32;
        loop {
            if !self.ledger.has_done() && self.ledger.waiting() > 0 {
                self.reap()?;
            }
            if self.ledger.has_done() || self.ledger.waiting() == 0 || Instant::now() >= deadline {
                return Ok(self.ledger.take_done());
            }
            idle += 1;
            self.idle(idle, deadline)?;
        }
    }

    fn pending(&self) -> usize {
        self.ledger.pending()
    }

    /// Open, and every work request completed. The peer's regions are
    /// asked for again when a later transfer writes to one it has not
    /// listed (see `refresh`).
    fn reusable(&mut self) -> bool {
        if self.broken.is_none() && self.outstanding_wrs > 0 {
            let _ = self.reap();
        }
        // The peer sends nothing unasked on the handshake stream: readable
        // now means it closed (idle, or gone), and with it its QP.
        if self.broken.is_none() && crate::answers::ready(&self.stream, false, Some(Duration::ZERO)) {
            self.broken = Some(format!("{} closed the connection", self.remote.node));
        }
        self.broken.is_none() && self.outstanding_wrs == 0 && self.ledger.pending() == 0
    }

    /// The write notes: [`NOTE_LEN`] bytes per range written, SENT after the
    /// batch's RDMA writes. (The NIC's own headers are not counted.)
    fn framing_bytes(&self) -> u64 {
        self.framing
    }
}
