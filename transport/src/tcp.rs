//! TCP emulation of one-sided writes, for hosts without RDMA.
//!
//! The initiator streams `Write` frames (header + data read straight from
//! its registered source region); the destination accepts each through the
//! shared path ([`crate::accept`]): key, bounds, tag and room against its
//! own registry *before* reading the payload into place, then counts the
//! range once toward (slot, layer), and answers every frame (`Ack`, or
//! `Nack` with the refusal's text). A refused frame's payload is drained
//! and discarded, so the connection stays in sync and keeps serving later
//! writes; a malformed header closes that connection only.
//!
//! A connection first proves its data-plane session ([`crate::hello`]);
//! until then the destination says nothing about its memory, reads at most
//! a few KiB, and gives up at one deadline. Its hello lists no regions:
//! a source learns the keys of its transfer's regions from the peer's
//! `Accept`, and the destination takes writes only into those.

use crate::auth::{ConnectionCaps, Credential, Gate, Pass};
use crate::metrics::{Hop, Hops};
use crate::placement::Placement;
use crate::registry::Registry;
use crate::accept::{self, Admitted, Incoming, Refusal};
use crate::answers::{self, Answer, End, Inbox};
use crate::hello;
use crate::ledger::{Ledger, UnknownPart};
use crate::{Batch, BatchId, Completion, Connection, Endpoint, TransportError};
use kvwire_core::protocol::{Header, Hello, Kind, HEADER_LEN, STRIDE_PREFIX};
use std::io::{BufRead, BufReader, BufWriter, IoSlice, IoSliceMut, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// This transport's name on the wire.
const TRANSPORT: &str = crate::TransportKind::Tcp.as_str();

/// Limits of a TCP endpoint.
#[derive(Debug, Clone, Copy)]
pub struct TcpLimits {
    /// Largest write frame payload, sent or accepted; larger writes are split.
    pub max_frame: u64,
    /// How long a whole handshake may take.
    pub handshake_timeout: Duration,
    /// How long an authenticated connection may stay silent, and how long
    /// one answer may take to send, before the destination closes it.
    pub idle_timeout: Duration,
    /// Caps on the listener's connections.
    pub caps: ConnectionCaps,
    /// How long a connection's thread polls for the next frame before it
    /// sleeps ([`crate::idle::IdleSpin`]); zero: it sleeps at once.
    pub idle_poll: Duration,
}

impl Default for TcpLimits {
    fn default() -> Self {
        TcpLimits { max_frame: 16 << 20, handshake_timeout: Duration::from_secs(5), idle_timeout: Duration::from_secs(300), caps: ConnectionCaps::default(), idle_poll: Duration::ZERO }
    }
}

/// A TCP endpoint: listens for peers that write into its regions, and
/// connects to peers to write into theirs.
#[derive(Debug)]
pub struct TcpEndpoint {
    node: String,
    addr: SocketAddr,
    registry: Arc<Registry>,
    placement: Arc<Placement>,
    hops: Arc<Hops>,
    limits: TcpLimits,
    stop: Arc<AtomicBool>,
}

impl TcpEndpoint {
    /// Binds `addr` (port 0 picks one) and starts accepting peers.
    pub fn bind(
        node: &str,
        addr: SocketAddr,
        registry: Arc<Registry>,
        placement: Arc<Placement>,
        limits: TcpLimits,
    ) -> Result<Arc<TcpEndpoint>, TransportError> {
        let listener = TcpListener::bind(addr).map_err(TransportError::io("bind"))?;
        let addr = listener.local_addr().map_err(TransportError::io("local_addr"))?;
        let hops = placement.hops().clone();
        let ep = Arc::new(TcpEndpoint {
            node: node.to_string(),
            addr,
            registry,
            placement,
            hops,
            limits,
            stop: Arc::new(AtomicBool::new(false)),
        });
        let (registry, placement, stop, node) = (ep.registry.clone(), ep.placement.clone(), ep.stop.clone(), ep.node.clone());
        std::thread::Builder::new()
            .name(format!("kvwire-tcp-accept-{}", addr.port()))
            .spawn(move || accept_loop(listener, node, registry, placement, limits, stop))
            .map_err(TransportError::io("spawn accept thread"))?;
        Ok(ep)
    }

    /// The hop histograms (shared with the placement).
    pub fn hops(&self) -> &Arc<Hops> {
        &self.hops
    }
}

impl Drop for TcpEndpoint {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
    }
}

fn hello(node: &str) -> Hello {
    // Writes go by key and offset, and a source learns its keys from the
    // peer's `Accept`: neither side lists regions or addresses here.
    hello::ours(TRANSPORT, node, Vec::new(), None)
}

fn read_header(s: &mut impl Read, max_frame: u64, op: &'static str) -> Result<Header, TransportError> {
    let mut b = [0u8; HEADER_LEN];
    s.read_exact(&mut b).map_err(TransportError::io(op))?;
    Ok(Header::decode(&b, max_frame)?)
}

fn accept_loop(
    listener: TcpListener,
    node: String,
    registry: Arc<Registry>,
    placement: Arc<Placement>,
    limits: TcpLimits,
    stop: Arc<AtomicBool>,
) {
    let gate = Gate::new(limits.caps);
    for stream in listener.incoming() {
        if stop.load(Ordering::Acquire) {
            return;
        }
        let Ok(stream) = stream else { continue };
        let pass = match gate.enter() {
            Ok(p) => p,
            Err(why) => {
                registry.handshake_refused();
                tracing::debug!(peer = ?stream.peer_addr().ok(), why, "tcp connection refused");
                continue;
            }
        };
        let (node, registry, placement) = (node.clone(), registry.clone(), placement.clone());
        let spawned = std::thread::Builder::new().name("kvwire-tcp-recv".into()).spawn(move || {
            let peer = stream.peer_addr().map(|a| a.to_string()).unwrap_or_default();
            match serve(stream, pass, &node, &registry, &placement, limits) {
                Ok(()) => {}
                Err(TransportError::Io { kind: std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut, .. }) => {
                    tracing::debug!(peer, "tcp peer connection closed: idle")
                }
                Err(e) => {
                    if let Some(held_back) = crate::logbudget::CONNECTIONS.admit() {
                        tracing::warn!(peer, error = %e, held_back, "tcp peer connection closed")
                    }
                }
            }
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot spawn a receiver thread");
        }
    }
}

/// Serves one initiating peer until it closes.
fn serve(stream: TcpStream, mut pass: Pass, node: &str, registry: &Registry, placement: &Placement, limits: TcpLimits) -> Result<(), TransportError> {
    stream.set_nodelay(true).map_err(TransportError::io("set_nodelay"))?;
    let mut hs = hello::Deadline::new(&stream, limits.handshake_timeout);
    let proven = hello::challenge(&mut hs.again(), &mut hs.again(), TRANSPORT, registry)?;
    // The peer proved itself in the challenge. Leave the unauthenticated
    // count before answering: once the initiator reads our hello it may
    // open more connections, and they must find this place free.
    pass.authenticated();
    hello::send_hello(&mut hs, &hello::prove(TRANSPORT, &proven, hello(node)))?;
    // Writes are admitted for the node that proved the session (grants name it).
    let (peer, session, peer_id) = (proven.hello, proven.session.credential.session, proven.session.peer_id);
    stream.set_read_timeout(Some(limits.idle_timeout)).map_err(TransportError::io("set timeout"))?;
    stream.set_write_timeout(Some(limits.idle_timeout)).map_err(TransportError::io("set timeout"))?;
    tracing::debug!(peer = peer.node, session = format_args!("{session:016x}"), "tcp peer connected");
    // Buffered both ways: headers of frames that arrived together are read
    // from memory, and their answers leave together, flushed only when no
    // further frame is already here (the source is waiting for them then).
    // Small on purpose: payload that lands in this buffer with a header is
    // copied twice, and the rest of a large payload is read straight into
    // its region (`read_runs`).
    let mut reader = BufReader::with_capacity(RECV_BUFFER, stream.try_clone().map_err(TransportError::io("clone socket"))?);
    let mut acks = BufWriter::new(stream);
    let mut discard = vec![0u8; 64 << 10];
    let mut spin = crate::idle::IdleSpin::new(limits.idle_poll);
    loop {
        let next = match reader.buffer().is_empty() {
            true => spin.idle(acks.get_ref(), || read_header(&mut reader, limits.max_frame, "receive frame")),
            false => read_header(&mut reader, limits.max_frame, "receive frame"),
        };
        let h = match next {
            Ok(h) => h,
            Err(TransportError::Io { kind: std::io::ErrorKind::UnexpectedEof, .. }) => return Ok(()),
            Err(e) => return Err(e),
        };
        // A strided write's runs: their count and distance, then their bytes.
        let (w, payload) = match h.kind {
            Kind::Write => (Incoming { tag: h.tag, key: h.key, offset: h.offset, len: h.len, stride: None }, h.len),
            Kind::StridedWrite => {
                let mut prefix = [0u8; STRIDE_PREFIX];
                reader.read_exact(&mut prefix).map_err(TransportError::io("receive strided write"))?;
                let (runs, stride) = (u64::from_le_bytes(prefix[..8].try_into().expect("8 bytes")), u64::from_le_bytes(prefix[8..].try_into().expect("8 bytes")));
                let payload = h.len.checked_sub(STRIDE_PREFIX as u64).filter(|p| runs > 0 && p % runs == 0).ok_or_else(|| {
                    TransportError::Refused(format!("strided write {} of {} bytes cannot hold {runs} equal runs after its prefix", h.seq, h.len))
                })?;
                (Incoming { tag: h.tag, key: h.key, offset: h.offset, len: payload / runs, stride: Some((runs, stride)) }, payload)
            }
            k => return Err(TransportError::Refused(format!("unexpected {k:?} frame from initiator"))),
        };
        // The frame and its payload cross whatever becomes of them, and an
        // accepted write's answer is a bare header: counted before the
        // write can complete a flag. A foreign write is taken back whole.
        placement.crossed(h.tag.slot, 2 * HEADER_LEN as u64 + h.len);
        let mut payload_read = false;
        let result = accept::accept(registry, placement, peer_id, w, |a: &Admitted| {
            payload_read = true;
            let (runs, stride) = w.stride.unwrap_or((1, 0));
            // SAFETY: each run lies inside the write's span, which lies
            // inside the region's live mapping (admit checked it against
            // the registry; the region Arc keeps the mapping alive), and
            // the runs lie apart (admit refused a strided write whose runs
            // overlap), so no two slices alias. The bytes are not counted
            // as placed yet, so no reader may look at them (flags are the
            // only licence to read); a plan sends two writes to one byte
            // only when a slice is re-sent after a rail failed, and then
            // with the same bytes. The slices live only for this read.
            let run = |i: u64| unsafe { std::slice::from_raw_parts_mut(a.region().mem.as_ptr().add((a.mem_offset() + i * stride) as usize), w.len as usize) };
            let read = match runs {
                1 => read_runs(&mut reader, &mut [run(0)]),
                _ => read_runs(&mut reader, &mut (0..runs).map(run).collect::<Vec<_>>()),
            };
            read.map_err(|e| Served::Closed(TransportError::io("receive write payload")(e)))?;
            Ok(Instant::now())
        });
        let answer = match result {
            Ok(placed) => {
                // A range that landed before (a slice re-sent on another
                // rail) crossed again, but wire_bytes counts payload once.
                placement.uncrossed(h.tag.slot, payload - placed.min(payload));
                hello::answer(h.tag, h.key, h.seq, Ok(placed))
            }
            Err(Served::Closed(e)) => return Err(e),
            Err(Served::Refused(why)) => {
                accept::refused(placement, TRANSPORT, &peer.node, w, &why);
                if !payload_read {
                    drain(&mut reader, payload, &mut discard)?;
                }
                let nack = hello::answer(h.tag, h.key, h.seq, Err(&why));
                match why.foreign() {
                    true => placement.uncrossed(h.tag.slot, 2 * HEADER_LEN as u64 + h.len),
                    false => placement.crossed(h.tag.slot, nack.len() as u64 - HEADER_LEN as u64),
                }
                nack
            }
        };
        acks.write_all(&answer).map_err(TransportError::io("send answer"))?;
        if reader.buffer().is_empty() {
            acks.flush().map_err(TransportError::io("send answer"))?;
        }
    }
}

/// The receive buffer: frame headers and small payloads arrive through it,
/// several per system call.
const RECV_BUFFER: usize = 32 << 10;

/// Fills a write's runs (one, or a strided write's), in order: from what
/// is buffered, then, for a large remainder, straight from the socket into
/// all of them at once (one vectored read, not a read a run, nor a copy
/// through the buffer, which costs a second copy).
fn read_runs(reader: &mut BufReader<TcpStream>, runs: &mut [&mut [u8]]) -> std::io::Result<()> {
    let mut first = 0;
    while first < runs.len() && !reader.buffer().is_empty() {
        let have = reader.buffer().len().min(runs[first].len());
        runs[first][..have].copy_from_slice(&reader.buffer()[..have]);
        reader.consume(have);
        let rest = std::mem::take(&mut runs[first]);
        runs[first] = &mut rest[have..];
        if runs[first].is_empty() {
            first += 1;
        }
    }
    let left: usize = runs[first..].iter().map(|r| r.len()).sum();
    if left < RECV_BUFFER / 4 {
        // Small: through the buffer, which takes the frames after it too.
        return runs[first..].iter_mut().try_for_each(|r| reader.read_exact(r));
    }
    // The buffer is empty here (a run was left to fill), so no buffered byte is skipped.
    // These reads sleep between segments even where the connection polls
    // between frames: polling here too (daemons on cores of their own,
    // 1 MiB remapped transfers) halved the receive calls per transfer
    // (11 to 6) but tripled the destination's context switches, each
    // yield a switch to its other threads; p50 0.60-0.69 ms over sixteen
    // runs against 0.63-0.69 over nine without, alternating: within this
    // host's noise, so not done.
    if let [one] = &mut runs[first..] {
        return reader.get_mut().read_exact(one);
    }
    let mut bufs: Vec<IoSliceMut<'_>> = runs[first..].iter_mut().map(|r| IoSliceMut::new(r)).collect();
    let mut bufs = &mut bufs[..];
    while !bufs.is_empty() {
        match reader.get_mut().read_vectored(bufs) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => IoSliceMut::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// How serving one write frame ended, when not placed and counted.
enum Served {
    /// The write was refused; the connection goes on.
    Refused(Refusal),
    /// The connection is unusable.
    Closed(TransportError),
}

impl From<Refusal> for Served {
    fn from(r: Refusal) -> Served {
        Served::Refused(r)
    }
}

fn drain(r: &mut impl Read, mut len: u64, buf: &mut [u8]) -> Result<(), TransportError> {
    while len > 0 {
        let n = len.min(buf.len() as u64) as usize;
        r.read_exact(&mut buf[..n]).map_err(TransportError::io("drain refused payload"))?;
        len -= n as u64;
    }
    Ok(())
}

impl Endpoint for TcpEndpoint {
    fn transport(&self) -> crate::TransportKind {
        crate::TransportKind::Tcp
    }

    fn local_addr(&self) -> String {
        self.addr.to_string()
    }

    fn node(&self) -> &str {
        &self.node
    }

    fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    fn placement(&self) -> &Arc<Placement> {
        &self.placement
    }

    fn connect(&self, peer: &str, cred: &Credential) -> Result<Box<dyn Connection>, TransportError> {
        Ok(Box::new(TcpConnection::open(peer, &self.node, cred, self.registry.clone(), self.hops.clone(), self.limits)?))
    }
}

/// An initiating TCP connection.
pub struct TcpConnection {
    remote: Hello,
    // Shared with the interrupter, which needs no socket of its own.
    stream: Arc<TcpStream>,
    registry: Arc<Registry>,
    hops: Arc<Hops>,
    max_frame: u64,
    // Answers read and not yet taken: the socket is non-blocking, and its
    // owner reads them itself ([`crate::answers`]).
    inbox: Inbox,
    next_seq: u64,
    ledger: Ledger,
    closed: Option<TransportError>,
    framing: u64,
    answers: u64,
    // The kernel's retransmit count as last read, while nothing was sent
    // since: a kept connection's count at a transfer's start is its count
    // at the last one's end, with no system call.
    retransmitted: std::cell::Cell<Option<u64>>,
    // The answers were read to an empty socket with none awaited, and
    // nothing was posted since: the reusable() that follows needs no read.
    drained: bool,
}

impl std::fmt::Debug for TcpConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpConnection").field("remote", &self.remote.node).field("pending", &self.ledger.pending()).finish()
    }
}

impl TcpConnection {
    fn open(peer: &str, node: &str, cred: &Credential, registry: Arc<Registry>, hops: Arc<Hops>, limits: TcpLimits) -> Result<TcpConnection, TransportError> {
        let stream = TcpStream::connect(peer).map_err(TransportError::io("connect"))?;
        stream.set_nodelay(true).map_err(TransportError::io("set_nodelay"))?;
        let hs = hello::Deadline::new(&stream, limits.handshake_timeout);
        let remote = hello::initiate(&mut hs.again(), &mut hs.again(), TRANSPORT, cred, hello(node))?;
        stream.set_read_timeout(None).map_err(TransportError::io("set timeout"))?;
        stream.set_write_timeout(None).map_err(TransportError::io("set timeout"))?;
        stream.set_nonblocking(true).map_err(TransportError::io("set nonblocking"))?;
        Ok(TcpConnection {
            remote,
            stream: Arc::new(stream),
            ledger: Ledger::new(hops.clone(), 1),
            registry,
            hops,
            max_frame: limits.max_frame,
            inbox: Inbox::default(),
            next_seq: 1,
            closed: None,
            framing: 0,
            answers: 0,
            retransmitted: std::cell::Cell::new(None),
            drained: false,
        })
    }

    fn apply(&mut self, a: Answer) {
        match a {
            Answer::Placed { seq, refused, at, bytes } => {
                self.answers += bytes;
                if let Err(UnknownPart(seq)) = self.ledger.answer(seq, refused.map_or(Ok(()), |r| Err(TransportError::Refused(r))), at) {
                    self.close(TransportError::Refused(format!("destination answered write {seq}, which is not outstanding")));
                }
            }
            Answer::Garbled(e) => self.close(e),
        }
    }

    /// Reads the answers that arrived, without waiting, and applies them;
    /// while writes wait for room (`apply` false) only reads them
    /// ([`Inbox::pump`]). An answer stream that ended while they waited
    /// closes the connection here, once their batches are accounted for
    /// by the failed write.
    fn read_answers(&mut self, apply: bool) {
        let (answers, end) = self.inbox.pump(&*self.stream, self.closed.is_none(), apply);
        answers.into_iter().for_each(|a| self.apply(a));
        match end {
            Some(End::Closed) => {
                let pending = self.ledger.waiting();
                self.close(TransportError::PeerClosed { pending });
            }
            Some(End::Failed(e)) => self.close(TransportError::io("receive answer")(e)),
            None => {}
        }
    }

    /// Fails every outstanding batch: the peer is gone, or the stream
    /// lost sync (then the socket is shut so the peer sees it too).
    fn close(&mut self, why: TransportError) {
        if self.closed.is_some() {
            return;
        }
        let pending = self.ledger.waiting();
        tracing::warn!(error = %why, pending, "destination closed the connection");
        let _ = self.stream.shutdown(Shutdown::Both);
        self.closed = Some(TransportError::PeerClosed { pending });
        self.ledger.close(|pending| TransportError::PeerClosed { pending });
    }

    /// Checks every source window first, so a bad batch sends nothing.
    fn sources(&self, batch: &Batch) -> Result<Vec<Arc<crate::Region>>, TransportError> {
        let mut sources = Vec::with_capacity(batch.writes.len());
        for w in &batch.writes {
            let region = self.registry.get(w.src_key).ok_or_else(|| {
                TransportError::Source(format!("source key {:#010x} is not registered here", w.src_key))
            })?;
            match w.src_span().and_then(|s| w.src_offset.checked_add(s)) {
                Some(end) if end <= region.len && w.count() > 0 => {}
                _ => {
                    return Err(TransportError::Source(format!(
                        "source window of {} x {} bytes at {} exceeds region {:#010x} of {} bytes",
                        w.count(),
                        w.len,
                        w.src_offset,
                        w.src_key,
                        region.len
                    )))
                }
            }
            if w.stride.is_some() && (w.len == 0 || w.len > self.max_frame) {
                return Err(TransportError::Unsupported(format!("a strided write's runs of {} bytes: each must be 1 to {} (a frame)", w.len, self.max_frame)));
            }
            sources.push(region);
        }
        Ok(sources)
    }

    /// Streams the frames of each batch (already checked) as parts of its
    /// id, headers and payloads gathered straight from the regions: one
    /// system call for many frames, and no copy into a send buffer.
    fn send_frames(&mut self, posts: &[(BatchId, &Batch, Vec<Arc<crate::Region>>)]) -> std::io::Result<()> {
        let mut heads: Vec<Head> = Vec::with_capacity(posts.iter().map(|p| p.1.writes.len()).sum());
        let mut data: Vec<&[u8]> = Vec::with_capacity(heads.capacity());
        for (id, batch, sources) in posts {
            self.frames_of(*id, batch, sources, &mut heads, &mut data);
        }
        // Each gathered write carries whole frames and at most GATHER_SLICES slices.
        let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(GATHER_SLICES);
        let mut rest = &data[..];
        for (head, used, n) in &heads {
            let (runs, after) = rest.split_at(*n);
            rest = after;
            if !slices.is_empty() && slices.len() + 1 + n > GATHER_SLICES {
                self.write_gathered(&mut slices)?;
                slices.clear();
            }
            slices.push(IoSlice::new(&head[..*used]));
            slices.extend(runs.iter().map(|d| IoSlice::new(d)));
        }
        if !slices.is_empty() {
            self.write_gathered(&mut slices)?;
        }
        Ok(())
    }

    /// `write_all` for a list of slices. While the socket has no room the
    /// answers that arrive meanwhile are read: a destination blocked on
    /// sending them would stop reading these writes.
    fn write_gathered(&mut self, mut bufs: &mut [IoSlice<'_>]) -> std::io::Result<()> {
        IoSlice::advance_slices(&mut bufs, 0);
        while !bufs.is_empty() {
            match (&*self.stream).write_vectored(bufs) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => IoSlice::advance_slices(&mut bufs, n),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    answers::ready(&self.stream, true, None);
                    self.read_answers(false);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Appends the frames of `batch`, as parts of `id`: each one's header
    /// (and a strided write's prefix) to `heads`, its payload's slices to
    /// `data`, in frame order.
    fn frames_of<'a>(&mut self, id: BatchId, batch: &Batch, sources: &'a [Arc<crate::Region>], heads: &mut Vec<Head>, data: &mut Vec<&'a [u8]>) {
        for (w, region) in batch.writes.iter().zip(sources) {
            // SAFETY (both slices below): the range is inside the source
            // region's live mapping (checked by `sources`; the caller holds
            // the regions until this returns), and the caller must not
            // modify a posted source range before its completion (the
            // `source_released` contract).
            let at = |off: u64, n: u64| unsafe { std::slice::from_raw_parts(region.mem.as_ptr().add((region.offset + w.src_offset + off) as usize), n as usize) };
            if let Some(s) = w.stride {
                // As many whole runs per frame as fit (`sources` checked one does).
                let per = (self.max_frame / w.len).clamp(1, GATHER_SLICES as u64 - 1);
                let mut first = 0;
                while first < s.count {
                    let n = (s.count - first).min(per);
                    let seq = self.next_seq;
                    self.next_seq += 1;
                    let h = Header { kind: Kind::StridedWrite, tag: batch.tag, key: w.dst_key, seq, offset: w.dst_offset + first * s.dst, len: STRIDE_PREFIX as u64 + n * w.len };
                    let mut head = [0u8; HEAD_MAX];
                    head[..HEADER_LEN].copy_from_slice(&h.encode());
                    head[HEADER_LEN..HEADER_LEN + 8].copy_from_slice(&n.to_le_bytes());
                    head[HEADER_LEN + 8..HEAD_MAX].copy_from_slice(&s.dst.to_le_bytes());
                    heads.push((head, HEAD_MAX, n as usize));
                    data.extend((first..first + n).map(|i| at(i * s.src, w.len)));
                    self.framing += HEAD_MAX as u64;
                    self.ledger.part(id, seq);
                    first += n;
                }
                continue;
            }
            // Zero-length writes still go out: the destination refuses them by name.
            let mut done = 0;
            loop {
                let n = (w.len - done).min(self.max_frame);
                let seq = self.next_seq;
                self.next_seq += 1;
                let h = Header { kind: Kind::Write, tag: batch.tag, key: w.dst_key, seq, offset: w.dst_offset + done, len: n };
                let mut head = [0u8; HEAD_MAX];
                head[..HEADER_LEN].copy_from_slice(&h.encode());
                heads.push((head, HEADER_LEN, 1));
                data.push(at(done, n));
                self.framing += HEADER_LEN as u64;
                self.ledger.part(id, seq);
                done += n;
                if done >= w.len {
                    break;
                }
            }
        }
    }
}

/// Slices per gathered write: a frame's header and its payload's (a
/// strided write's runs each), well under `IOV_MAX` (1024).
const GATHER_SLICES: usize = 512;

/// A frame's header, and a strided write's prefix after it.
const HEAD_MAX: usize = HEADER_LEN + STRIDE_PREFIX;

/// A frame's head bytes, how many of them are used, and how many payload
/// slices follow it (one, or a strided write's runs): no allocation per frame.
type Head = ([u8; HEAD_MAX], usize, usize);

impl Connection for TcpConnection {
    fn remote(&self) -> &Hello {
        &self.remote
    }

    fn post(&mut self, batch: Batch) -> Result<BatchId, TransportError> {
        self.post_all(vec![batch]).map(|ids| ids[0]).map_err(|(_, e)| e)
    }

    /// Every batch is checked before any goes; then all of them leave in
    /// gathered writes together.
    fn post_all(&mut self, batches: Vec<Batch>) -> Result<Vec<BatchId>, (Vec<BatchId>, TransportError)> {
        if let Some(e) = &self.closed {
            return Err((Vec::new(), e.clone()));
        }
        let start = Instant::now();
        self.drained = false;
        self.retransmitted.set(None);
        let sources = batches.iter().map(|b| self.sources(b)).collect::<Result<Vec<_>, _>>().map_err(|e| (Vec::new(), e))?;
        let posts: Vec<_> = batches.iter().zip(sources).map(|(b, s)| (self.ledger.begin(b.tag, b.bytes(), start, ()), b, s)).collect();
        if let Err(e) = self.send_frames(&posts) {
            // Whatever was already sent is answered; the rest never will be.
            posts.iter().for_each(|p| self.ledger.withdraw(p.0));
            self.closed = Some(TransportError::io("send write")(e));
            return Err((Vec::new(), self.closed.clone().expect("just set")));
        }
        posts.iter().for_each(|p| self.ledger.seal(p.0, None));
        self.hops.record_batch(Hop::Post, start.elapsed(), batches.iter().map(Batch::bytes).sum());
        Ok(posts.into_iter().map(|p| p.0).collect())
    }

    fn poll(&mut self, timeout: Duration) -> Result<Vec<Completion>, TransportError> {
        let deadline = Instant::now() + timeout;
        loop {
            self.read_answers(true);
            if self.ledger.has_done() || self.ledger.waiting() == 0 {
                self.drained = self.ledger.waiting() == 0;
                return Ok(self.ledger.take_done());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(Vec::new());
            }
            answers::ready(&self.stream, false, Some(left));
        }
    }

    fn pending(&self) -> usize {
        self.ledger.pending()
    }

    fn retransmitted_bytes(&self) -> u64 {
        if let Some(n) = self.retransmitted.get() {
            return n;
        }
        let n = tcp_bytes_retrans(&self.stream).unwrap_or(0);
        self.retransmitted.set(Some(n));
        n
    }

    /// The destination checks every write's key itself, and this side holds
    /// nothing of the peer's but its address. Read for a close or a stray
    /// answer, unless the answers were just read to the end (a transfer
    /// that ended here, before its connection is kept; it is read again
    /// when the next transfer takes it).
    fn reusable(&mut self) -> bool {
        if !std::mem::take(&mut self.drained) {
            self.read_answers(true);
        }
        self.closed.is_none() && self.ledger.pending() == 0
    }

    /// A header per write frame.
    fn framing_bytes(&self) -> u64 {
        self.framing
    }

    /// An `Ack` header per frame; a `Nack` header and its reason.
    fn answer_bytes(&self) -> u64 {
        self.answers
    }

    fn interrupter(&self) -> Option<Box<dyn Fn() + Send + Sync>> {
        let s = self.stream.clone();
        Some(Box::new(move || {
            let _ = s.shutdown(Shutdown::Both);
        }))
    }
}

/// The kernel's count of bytes this socket retransmitted (TCP_INFO,
/// Linux ≥ 4.19); None where the kernel does not report it.
fn tcp_bytes_retrans(s: &TcpStream) -> Option<u64> {
    use nix::libc;
    use std::os::fd::AsRawFd;
    let mut info = std::mem::MaybeUninit::<libc::tcp_info>::zeroed();
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: the buffer is a zeroed tcp_info and `len` its size; the
    // kernel writes at most `len` bytes and reports how many it wrote.
    let rc = unsafe { libc::getsockopt(s.as_raw_fd(), libc::IPPROTO_TCP, libc::TCP_INFO, info.as_mut_ptr().cast(), &mut len) };
    if rc != 0 {
        return None;
    }
    // SAFETY: zero-initialised, and every field is a plain integer.
    let info = unsafe { info.assume_init() };
    let end = std::mem::offset_of!(libc::tcp_info, tcpi_bytes_retrans) + std::mem::size_of::<u64>();
    (len as usize >= end).then_some(info.tcpi_bytes_retrans)
}

impl Drop for TcpConnection {
    fn drop(&mut self) {
        if self.ledger.waiting() > 0 {
            // Abandoned with writes outstanding (a failed rail): reset, so
            // the kernel drops what it still holds instead of delivering it
            // later, after the writes were re-sent elsewhere. The close
            // resets; shutting the write side would flush first.
            let _ = nix::sys::socket::setsockopt(&self.stream, nix::sys::socket::sockopt::Linger, &nix::libc::linger { l_onoff: 1, l_linger: 0 });
            return;
        }
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}
