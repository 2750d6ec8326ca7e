//! Same-host shared-memory transport: one-sided writes as pull copies
//! between memfd mappings, with a Unix stream socket for control only.
//!
//! The trust model is the TCP emulation's: the destination validates.
//! The initiator hands the memfd of each local source region it writes
//! from to the destination once per connection (SCM_RIGHTS), and then
//! sends, per write, a small request naming the source window and the
//! destination (key, offset). The destination accepts it through the
//! shared path ([`crate::accept`]): key, bounds, tag and room against
//! *its* registry at copy time — so a revoked key is refused exactly —
//! then checks the source window, copies straight from the shared source
//! mapping into the registered region ([`HostMem::copy_to`]; no data byte
//! travels through the socket), counts the range once and acks. The initiator's [`Connection::poll`]
//! turns the acks of a batch into its [`Completion`] (`source_released`):
//! once every write of the batch was answered, the destination has
//! finished reading its source ranges.
//!
//! # Messages
//!
//! Every message is a [`Header`] (40 bytes, little-endian),
//! optionally followed by a payload of `len` bytes.
//!
//! Handshake: the destination first checks the peer's credentials (the
//! socket's peer must run as this process's uid), then the shared
//! exchange of [`crate::hello`]: `Challenge`, the source's `Hello` proving
//! its data-plane session, the destination's `Hello` proving it back (or
//! `Nack` with the reason, and the connection closes). Neither hello lists
//! regions: the source learns its keys from the peer's `Accept`.
//!
//! A write request is a `Write` header with `len` = [`TRAILER_LEN`] and a
//! fixed trailer instead of data:
//!
//! | header field | meaning |
//! |---|---|
//! | tag    | (slot, layer) the bytes count toward |
//! | key    | destination region key |
//! | seq    | the initiator's write sequence number, echoed by the answer |
//! | offset | offset in the destination region |
//! | len    | [`TRAILER_LEN`] (64) |
//!
//! | trailer offset | field | type | meaning |
//! |---|---|---|---|
//! | 0  | src_key    | u32 | the initiator's key of the source region |
//! | 4  | share      | u32 | 1: this message carries the region's memfd (SCM_RIGHTS) and defines its window; 0: the key was shared before on this connection; 2: a forget (below) |
//! | 8  | win_offset | u64 | window start in the memfd (share = 1) |
//! | 16 | win_len    | u64 | window length (share = 1) |
//! | 24 | src_offset | u64 | offset of the write (its first run) in the source window |
//! | 32 | write_len  | u64 | bytes to copy (per run) |
//! | 40 | runs       | u64 | 0: one run; n ≥ 1: a strided write of n runs (below) |
//! | 48 | src_stride | u64 | distance between runs in the source window (runs ≥ 1) |
//! | 56 | dst_stride | u64 | distance between runs in the destination region (runs ≥ 1) |
//!
//! A strided write ([`crate::Stride`]) copies `runs` runs of `write_len`
//! bytes in one request: a remap's rows, never packed or unpacked. Both
//! its spans (first run to last) must lie in the source window and the
//! destination region; the destination counts it once, and refuses one
//! whose runs overlap bytes placed before other than by repeating it
//! exactly ([`crate::placement::Placement::placed_strided`]).
//!
//! A forget (`share` = 2, header key, offset and tag 0, every other
//! trailer field 0, no descriptor) says the initiator no longer writes
//! from `src_key`, shared before on this connection: the destination
//! unmaps it. It is not a write and is not answered; its `seq` is not
//! one of the initiator's write numbers.
//!
//! The destination answers every write, in order, with `Ack` (`tag`, `key`
//! and `seq` echoed, `offset` = bytes placed, len 0) or `Nack` (the same
//! echo, payload: the [`crate::accept::Refusal`]'s text, at most 4096 bytes). A malformed message, an unexpected kind, a
//! missing or surplus file descriptor, or a connection past its limits
//! closes that connection only (with a `tracing::warn!`); the endpoint
//! keeps serving the others.
//!
//! # Limits
//!
//! The destination keeps each shared source window for the life of the
//! connection, or until a forget (keys are never reused, so a cached key
//! always names the same window). Windows of one file (a rank's cache
//! memfd holds a region per layer and tensor) share one mapping of it:
//! `max_sources` caps the files a connection maps, and
//! [`KEYS_PER_SOURCE`] times it the keys. An initiator reuses a connection
//! for a later transfer after forgetting every region it shared and
//! released since (a transfer's staging buffer is registered under a key
//! of its own), while it shares at most [`MAX_KEPT_SHARES`], so a kept
//! connection pins no released memory and stays under the peer's limits. [`HostMem::from_file`] insists the memfd is sealed
//! against shrinking, so a peer cannot turn a copy into SIGBUS.

use crate::auth::{ConnectionCaps, Credential, Gate, Pass};
use crate::mem::{HostMem, STREAM_COLD};
use crate::metrics::{Hop, Hops};
use crate::placement::Placement;
use crate::registry::Registry;
use crate::accept::{self, Admitted, Incoming, Refusal};
use crate::answers::{self, Answer, End, Inbox};
use crate::hello;
use crate::ledger::{Ledger, UnknownPart};
use crate::{Batch, BatchId, Completion, Connection, Endpoint, Stride, TransportError};
use kvwire_core::protocol::{FrameError, Header, Hello, Kind, Tag, HEADER_LEN};
use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};
use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Transport name in hellos.
pub const TRANSPORT: &str = crate::TransportKind::Shm.as_str();
/// Bytes of the trailer that follows a `Write` header (see the module docs).
pub const TRAILER_LEN: u64 = 64;
/// Most file descriptors one `sendmsg` may carry (Linux `SCM_MAX_FD`).
const SCM_MAX_FD: usize = 253;
/// Read buffer of a destination connection.
const READ_BUF: usize = 64 * 1024;
/// A transfer at least this large copies its large writes past the caches
/// ([`HostMem::copy_runs_to_cold`]). A 1 MiB transfer's 256 KiB writes,
/// streamed, slowed it by a tenth: its staging is unpacked and hashed
/// right after, from the cache. A 32 MiB one's 512 KiB writes ran at 1.5x.
const COLD_TRANSFER: u64 = 8 << 20;
/// Writes that copied this much together are answered at once, not with
/// the requests queued behind them: the source refills its window while
/// those are copied. Answered only before blocking, a large transfer's
/// window (four 1 MiB slices) drained at every refill, its copies pausing
/// for the source's wake-up each time: 256 MiB went in 30.8-31.5 ms against
/// 28.4-29.7 answered this way (`kvwire bench layouts --transport shm
/// --no-verify`, same minutes). Half the default window: half the answers,
/// and the source's wake-ups, of one per 1 MiB slice.
const ANSWER_AFTER: u64 = 2 << 20;

/// Limits of a [`ShmEndpoint`].
#[derive(Debug, Clone)]
pub struct ShmLimits {
    /// Most source files (memfds) one peer connection may have mapped at
    /// this endpoint; its regions (windows of them) share their mapping,
    /// up to [`KEYS_PER_SOURCE`] times as many.
    pub max_sources: usize,
    /// How long a whole handshake may take.
    pub handshake_timeout: Duration,
    /// How long an authenticated connection may stay silent, and one
    /// answer take to send, before the destination closes it.
    pub idle_timeout: Duration,
    /// Caps on the listener's connections.
    pub caps: ConnectionCaps,
    /// How long a connection's thread polls for the next request before it
    /// sleeps ([`crate::idle::IdleSpin`]); zero: it sleeps at once.
    pub idle_poll: Duration,
}

impl Default for ShmLimits {
    fn default() -> Self {
        ShmLimits { max_sources: 1024, handshake_timeout: Duration::from_secs(5), idle_timeout: Duration::from_secs(300), caps: ConnectionCaps::default(), idle_poll: Duration::ZERO }
    }
}

/// Live accepted connections, so dropping the endpoint can close them.
#[derive(Debug, Default)]
struct Live {
    next: u64,
    conns: HashMap<u64, UnixStream>,
}

/// What the acceptor and the connection threads share.
#[derive(Debug)]
struct Serve {
    node: String,
    registry: Arc<Registry>,
    placement: Arc<Placement>,
    limits: ShmLimits,
    shutdown: AtomicBool,
    live: Mutex<Live>,
    gate: Arc<Gate>,
}

/// A shared-memory endpoint: listens on a Unix socket, serves peers' writes
/// into its registry, and connects to other shm endpoints on this host.
#[derive(Debug)]
pub struct ShmEndpoint {
    serve: Arc<Serve>,
    hops: Arc<Hops>,
    path: PathBuf,
    own_dir: Option<PathBuf>,
    acceptor: Mutex<Option<JoinHandle<()>>>,
}

static NEXT_SOCKET: AtomicU64 = AtomicU64::new(0);

/// Removes what endpoints of dead processes left in `dir` (a daemon that
/// was killed, not stopped, removes nothing): in the temp directory their
/// socket directories, in a configured one their sockets. Only entries of
/// this uid, named as [`ShmEndpoint::new`] names them, whose process is
/// gone and whose socket refuses a connection (a process of another pid
/// namespace may share the directory); a directory only when it holds
/// nothing but its socket. One whose process id was taken again is left
/// alone.
fn sweep_stale(dir: &Path) {
    use std::os::unix::fs::FileTypeExt;
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let uid = nix::unistd::geteuid().as_raw();
    for e in entries.flatten() {
        let name = e.file_name();
        let Some((pid, n, is_dir)) = name.to_str().and_then(stale_name) else { continue };
        // Not followed: a link is nothing of ours.
        let Ok(m) = e.path().symlink_metadata() else { continue };
        let ours = m.uid() == uid && if is_dir { m.is_dir() } else { m.file_type().is_socket() };
        let gone = matches!(nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None), Err(nix::errno::Errno::ESRCH));
        let sock = if is_dir { e.path().join(format!("kvwire-shm-{pid}-{n}.sock")) } else { e.path() };
        let unserved = || matches!(UnixStream::connect(&sock).map_err(|e| e.kind()), Err(std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound));
        if !(ours && gone && unserved()) {
            continue;
        }
        if is_dir {
            let _ = std::fs::remove_file(&sock);
            // Fails, and keeps it, if anything else is in it.
            let _ = std::fs::remove_dir(e.path());
        } else {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// (process id, endpoint number, whether a directory) of an entry named
/// `kvwire-shm-<pid>-<n>-<8 hex digits>` (a socket directory) or
/// `kvwire-shm-<pid>-<n>.sock` (a socket).
fn stale_name(name: &str) -> Option<(i32, u64, bool)> {
    let rest = name.strip_prefix("kvwire-shm-")?;
    let (rest, is_dir) = match rest.strip_suffix(".sock") {
        Some(r) => (r, false),
        None => (rest, true),
    };
    let mut parts = rest.split('-');
    let (pid, n) = (parts.next()?.parse::<i32>().ok()?, parts.next()?.parse::<u64>().ok()?);
    let nanos_ok = match (is_dir, parts.next()) {
        (true, Some(x)) => x.len() == 8 && x.bytes().all(|b| b.is_ascii_hexdigit()),
        (false, None) => true,
        _ => false,
    };
    (pid > 0 && nanos_ok && parts.next().is_none()).then_some((pid, n, is_dir))
}

fn hello_of(node: &str) -> Hello {
    hello::ours(TRANSPORT, node, Vec::new(), None)
}

impl ShmEndpoint {
    /// A new endpoint named `node`, listening on a fresh socket in `dir`
    /// (or in a new private temporary directory, removed on drop), serving
    /// writes into `registry` and counting them in `placement`. Its
    /// connections time `post` and `wire` into the placement's [`Hops`].
    pub fn new(
        node: &str,
        dir: Option<&Path>,
        registry: Arc<Registry>,
        placement: Arc<Placement>,
        limits: ShmLimits,
    ) -> Result<Arc<ShmEndpoint>, TransportError> {
        let hops = placement.hops().clone();
        let pid = std::process::id();
        let n = NEXT_SOCKET.fetch_add(1, Ordering::Relaxed);
        let (dir, own_dir) = match dir {
            Some(d) => {
                sweep_stale(d);
                (d.to_path_buf(), None)
            }
            None => {
                sweep_stale(&std::env::temp_dir());
                let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
                let d = std::env::temp_dir().join(format!("kvwire-shm-{pid}-{n}-{nanos:08x}"));
                std::fs::DirBuilder::new().mode(0o700).create(&d).map_err(TransportError::io("create shm socket directory"))?;
                (d.clone(), Some(d))
            }
        };
        let path = dir.join(format!("kvwire-shm-{pid}-{n}.sock"));
        // sun_path holds 108 bytes including the terminating NUL.
        if path.as_os_str().len() > 107 {
            if let Some(d) = &own_dir {
                let _ = std::fs::remove_dir(d);
            }
            return Err(TransportError::Io {
                op: "bind shm socket",
                kind: std::io::ErrorKind::InvalidInput,
                message: format!("socket path {} is longer than the 107 bytes a Unix socket address holds; use a shorter directory", path.display()),
            });
        }
        let listener = match UnixListener::bind(&path) {
            Ok(l) => l,
            Err(e) => {
                if let Some(d) = &own_dir {
                    let _ = std::fs::remove_dir(d);
                }
                return Err(TransportError::io("bind shm socket")(e));
            }
        };
        let gate = Gate::new(limits.caps);
        let serve = Arc::new(Serve { node: node.into(), registry, placement, limits, shutdown: AtomicBool::new(false), live: Mutex::new(Live::default()), gate });
        let s = serve.clone();
        let acceptor = std::thread::Builder::new()
            .name("kvwire-shm-accept".into())
            .spawn(move || accept_loop(listener, s))
            .map_err(TransportError::io("spawn shm acceptor"))?;
        Ok(Arc::new(ShmEndpoint { serve, hops, path, own_dir, acceptor: Mutex::new(Some(acceptor)) }))
    }

    /// The socket path peers connect to.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Hop histograms: `post` and `wire` of this endpoint's connections,
    /// `place` and `notify` of its placement (the same [`Hops`]).
    pub fn hops(&self) -> &Arc<Hops> {
        &self.hops
    }
}

impl Drop for ShmEndpoint {
    fn drop(&mut self) {
        self.serve.shutdown.store(true, Ordering::SeqCst);
        // Wake the acceptor; it sees the flag and returns. (Should the
        // socket file be gone, the acceptor is left blocked rather than
        // joined forever; it holds no more than the registry and placement.)
        let woke = UnixStream::connect(&self.path).is_ok();
        if let Some(h) = self.acceptor.lock().map(|mut a| a.take()).unwrap_or(None) {
            if woke {
                let _ = h.join();
            }
        }
        if let Ok(live) = self.serve.live.lock() {
            for s in live.conns.values() {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
        }
        let _ = std::fs::remove_file(&self.path);
        if let Some(d) = &self.own_dir {
            let _ = std::fs::remove_dir(d);
        }
    }
}

impl Endpoint for ShmEndpoint {
    fn transport(&self) -> crate::TransportKind {
        crate::TransportKind::Shm
    }

    fn local_addr(&self) -> String {
        self.path.display().to_string()
    }

    fn node(&self) -> &str {
        &self.serve.node
    }

    fn registry(&self) -> &Arc<Registry> {
        &self.serve.registry
    }

    fn placement(&self) -> &Arc<Placement> {
        &self.serve.placement
    }

    fn connect(&self, peer: &str, cred: &Credential) -> Result<Box<dyn Connection>, TransportError> {
        Ok(Box::new(ShmConnection::connect(peer, &self.serve.node, cred, self.serve.registry.clone(), self.hops.clone(), self.serve.limits.handshake_timeout)?))
    }
}

fn accept_loop(listener: UnixListener, serve: Arc<Serve>) {
    loop {
        let accepted = listener.accept();
        if serve.shutdown.load(Ordering::SeqCst) {
            return;
        }
        let stream = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "shm accept failed");
                // EMFILE and friends: do not spin.
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let pass = match serve.gate.enter() {
            Ok(p) => p,
            Err(why) => {
                serve.registry.handshake_refused();
                tracing::debug!(why, "shm connection refused");
                continue;
            }
        };
        let id = match (stream.try_clone(), serve.live.lock()) {
            (Ok(clone), Ok(mut live)) => {
                live.next += 1;
                let id = live.next;
                live.conns.insert(id, clone);
                id
            }
            (Err(e), _) => {
                tracing::warn!(error = %e, "shm connection refused: cannot clone its socket");
                continue;
            }
            (_, Err(_)) => return,
        };
        let s = serve.clone();
        let spawned = std::thread::Builder::new().name("kvwire-shm-conn".into()).spawn(move || {
            let node = match serve_conn(stream, pass, &s) {
                Ok(node) => node,
                Err(Closing { node, reason }) if s.shutdown.load(Ordering::SeqCst) => {
                    tracing::debug!(peer = %node, %reason, "shm connection closed: endpoint shutting down");
                    node
                }
                Err(Closing { node, reason }) => {
                    if let Some(held_back) = crate::logbudget::CONNECTIONS.admit() {
                        tracing::warn!(peer = %node, %reason, held_back, "shm connection closed");
                    }
                    node
                }
            };
            tracing::debug!(peer = %node, "shm connection ended");
            if let Ok(mut live) = s.live.lock() {
                live.conns.remove(&id);
            }
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "shm connection refused: cannot spawn its thread");
            if let Ok(mut live) = serve.live.lock() {
                live.conns.remove(&id);
            }
        }
    }
}

/// Why a destination connection was closed.
#[derive(Debug)]
struct Closing {
    node: String,
    reason: String,
}

/// A source window a peer shared on one connection.
#[derive(Debug)]
struct Source {
    mem: Arc<HostMem>,
    offset: u64,
    len: u64,
}

/// Reads a Unix stream, collecting the file descriptors that arrive with it.
struct FdReader {
    sock: UnixStream,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    fds: VecDeque<OwnedFd>,
    cmsg: Vec<u8>,
    // While set, every read ends by then (the handshake).
    deadline: Option<Instant>,
}

/// How a read ended early.
#[derive(Debug)]
enum ReadEnd {
    /// The peer closed; `got` bytes of the wanted message had arrived.
    Eof { got: usize },
    /// Anything else, as a reason.
    Failed(String),
}

impl FdReader {
    fn new(sock: UnixStream) -> FdReader {
        FdReader { sock, buf: vec![0u8; READ_BUF].into_boxed_slice(), start: 0, end: 0, fds: VecDeque::new(), cmsg: nix::cmsg_space!([RawFd; SCM_MAX_FD]), deadline: None }
    }

    fn buffered(&self) -> usize {
        self.end - self.start
    }

    /// One `recvmsg` into the buffer; returns the bytes read (0 at EOF).
    fn fill(&mut self) -> Result<usize, ReadEnd> {
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        if let Some(until) = self.deadline {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ReadEnd::Failed("handshake deadline passed".into()));
            }
            let _ = self.sock.set_read_timeout(Some(left));
        }
        let fd = self.sock.as_raw_fd();
        let mut iov = [IoSliceMut::new(&mut self.buf[self.end..])];
        let (bytes, fds) = loop {
            match recvmsg::<()>(fd, &mut iov, Some(&mut self.cmsg), MsgFlags::MSG_CMSG_CLOEXEC) {
                Ok(msg) => {
                    let mut fds = Vec::new();
                    let cmsgs = msg.cmsgs().map_err(|_| ReadEnd::Failed("control data truncated (too many file descriptors at once)".into()))?;
                    for c in cmsgs {
                        if let ControlMessageOwned::ScmRights(raw) = c {
                            fds.extend(raw);
                        }
                    }
                    break (msg.bytes, fds);
                }
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => return Err(ReadEnd::Failed(format!("recvmsg: {e}"))),
            }
        };
        for raw in fds {
            // SAFETY: the kernel just installed `raw` in this process's fd
            // table for this SCM_RIGHTS message; nothing else owns it, so
            // this OwnedFd is its only owner and closes it exactly once.
            self.fds.push_back(unsafe { OwnedFd::from_raw_fd(raw) });
        }
        if self.fds.len() > SCM_MAX_FD {
            return Err(ReadEnd::Failed(format!("{} file descriptors sent without the messages that use them", self.fds.len())));
        }
        self.end += bytes;
        Ok(bytes)
    }

    /// The next `n` bytes (`n` ≤ the buffer).
    fn next_bytes(&mut self, n: usize) -> Result<&[u8], ReadEnd> {
        while self.buffered() < n {
            if self.fill()? == 0 {
                return Err(ReadEnd::Eof { got: self.buffered() });
            }
        }
        let s = self.start;
        self.start += n;
        Ok(&self.buf[s..s + n])
    }
}

/// Buffered reads for the shared frame reader (the handshake).
impl Read for FdReader {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        if self.buffered() == 0 {
            match self.fill() {
                Ok(_) => {}
                Err(ReadEnd::Eof { .. }) => return Ok(0),
                Err(ReadEnd::Failed(why)) => return Err(std::io::Error::other(why)),
            }
        }
        let n = out.len().min(self.buffered());
        out[..n].copy_from_slice(&self.buf[self.start..self.start + n]);
        self.start += n;
        Ok(n)
    }
}

/// Serves one accepted connection; returns the peer's node name when it
/// closed cleanly.
fn serve_conn(stream: UnixStream, mut pass: Pass, serve: &Serve) -> Result<String, Closing> {
    let mut node = String::from("?");
    let closing = |node: &str, reason: String| Closing { node: node.into(), reason };
    // Only this uid's processes: the socket's directory may be shared.
    let uid = nix::sys::socket::getsockopt(&stream, nix::sys::socket::sockopt::PeerCredentials).map(|c| c.uid());
    let ours = nix::unistd::geteuid().as_raw();
    match uid {
        Ok(u) if u == ours => {}
        Ok(u) => return Err(closing(&node, format!("peer process runs as uid {u}, not this daemon's {ours}"))),
        Err(e) => return Err(closing(&node, format!("cannot read the peer's credentials: {e}"))),
    }
    let writer = stream.try_clone().map_err(|e| closing(&node, format!("clone socket: {e}")))?;
    let mut rd = FdReader::new(stream);
    rd.deadline = Some(Instant::now() + serve.limits.handshake_timeout);
    // Writes are admitted for the node that proved the session (grants name it).
    let peer_id = {
        let mut out = hello::Deadline::new(&writer, serve.limits.handshake_timeout);
        let proven = hello::challenge(&mut rd, &mut out, TRANSPORT, &serve.registry).map_err(|e| closing(&node, format!("handshake refused: {e}")))?;
        node = proven.hello.node.clone();
        // Proven: out of the unauthenticated count before the initiator
        // can read our hello and open another connection.
        pass.authenticated();
        hello::send_hello(&mut out, &hello::prove(TRANSPORT, &proven, hello_of(&serve.node))).map_err(|e| closing(&node, e.to_string()))?;
        proven.session.peer_id
    };
    rd.deadline = None;
    let idle = Some(serve.limits.idle_timeout);
    let _ = rd.sock.set_read_timeout(idle);
    let _ = writer.set_write_timeout(idle);
    let mut out = Answers::new(writer);

    let mut sources: HashMap<u32, Source> = HashMap::new();
    // Mappings by file (device, inode), while a window of it is shared.
    let mut files: HashMap<(u64, u64), Weak<HostMem>> = HashMap::new();
    let mut spin = crate::idle::IdleSpin::new(serve.limits.idle_poll);
    loop {
        // Answer everything processed so far before blocking for more.
        let waits = rd.buffered() < HEADER_LEN + TRAILER_LEN as usize;
        if waits {
            if let Err(e) = out.flush() {
                return Err(closing(&node, format!("send answers: {e}")));
            }
        }
        let next = match waits {
            true => spin.idle(out.out.get_ref(), || read_header(&mut rd, TRAILER_LEN)),
            false => read_header(&mut rd, TRAILER_LEN),
        };
        let h = match next {
            Ok(h) => h,
            Err(Either::End(ReadEnd::Eof { got: 0 })) => {
                return if rd.fds.is_empty() { Ok(node) } else { Err(closing(&node, "file descriptors sent without their messages".into())) }
            }
            Err(e) => return Err(closing(&node, e.to_string())),
        };
        if h.kind != Kind::Write || h.len != TRAILER_LEN {
            return Err(closing(&node, format!("expected a Write frame with a {TRAILER_LEN}-byte trailer, got {:?} with {} bytes", h.kind, h.len)));
        }
        let t = rd.next_bytes(TRAILER_LEN as usize).map_err(|e| closing(&node, read_end(e, "write trailer")))?;
        let u32_at = |i: usize| u32::from_le_bytes(t[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(t[i..i + 8].try_into().expect("8 bytes"));
        let (src_key, share, win_offset, win_len, src_offset, len) = (u32_at(0), u32_at(4), u64_at(8), u64_at(16), u64_at(24), u64_at(32));
        let (runs, src_stride, dst_stride) = (u64_at(40), u64_at(48), u64_at(56));

        if share == 2 {
            if h.key != 0 || h.offset != 0 || h.tag != (Tag { slot: 0, layer: 0 }) || (win_offset, win_len, src_offset, len, runs, src_stride, dst_stride) != (0, 0, 0, 0, 0, 0, 0) {
                return Err(closing(&node, format!("forget of source {src_key:#010x} carries write fields")));
            }
            if sources.remove(&src_key).is_none() {
                return Err(closing(&node, format!("forget of source {src_key:#010x}, which this connection never shared")));
            }
            continue;
        }
        if runs == 0 && (src_stride, dst_stride) != (0, 0) {
            return Err(closing(&node, format!("write {} carries strides but no runs", h.seq)));
        }
        let mut refused: Option<Refusal> = None;
        match share {
            0 => {}
            1 => {
                let Some(fd) = rd.fds.pop_front() else {
                    return Err(closing(&node, format!("write {} shares source {src_key:#010x} but no file descriptor came with it", h.seq)));
                };
                if !sources.contains_key(&src_key) && sources.len() >= serve.limits.max_sources.saturating_mul(KEYS_PER_SOURCE) {
                    return Err(closing(&node, format!("more than {} source regions shared on one connection", serve.limits.max_sources * KEYS_PER_SOURCE)));
                }
                let file = File::from(fd);
                let id = file.metadata().map(|m| (m.dev(), m.ino())).ok();
                files.retain(|_, m| m.strong_count() > 0);
                let mapped = match id.and_then(|id| files.get(&id)).and_then(Weak::upgrade) {
                    Some(mem) => Ok(mem),
                    None if files.len() >= serve.limits.max_sources => {
                        return Err(closing(&node, format!("more than {} source files mapped on one connection", serve.limits.max_sources)));
                    }
                    None => HostMem::from_file(file).map(Arc::new).inspect(|mem| {
                        if let Some(id) = id {
                            files.insert(id, Arc::downgrade(mem));
                        }
                    }),
                };
                match mapped {
                    Ok(mem) => match mem.check(win_offset, win_len) {
                        Ok(()) => {
                            sources.insert(src_key, Source { mem, offset: win_offset, len: win_len });
                        }
                        Err(e) => refused = Some(Refusal::SourceUnusable { key: src_key, reason: format!("window {e}") }),
                    },
                    Err(e) => refused = Some(Refusal::SourceUnusable { key: src_key, reason: format!("cannot map the shared file: {e}") }),
                }
            }
            s => return Err(closing(&node, format!("write {}: share field {s} is neither 0, 1 nor 2", h.seq))),
        }

        let w = Incoming { tag: h.tag, key: h.key, offset: h.offset, len, stride: (runs > 0).then_some((runs, dst_stride)) };
        let bytes = w.bytes();
        // The request, the payload and an Ack, counted before the write can
        // complete a flag; a refusal takes back what did not move, and a
        // foreign write all of it.
        serve.placement.crossed(h.tag.slot, 2 * HEADER_LEN as u64 + TRAILER_LEN + bytes);
        let mut copied = false;
        let result = match refused {
            Some(r) => Err(r),
            None => place(serve, peer_id, &sources, w, src_key, src_offset, src_stride, &mut copied),
        };
        if let Err(why) = &result {
            accept::refused(&serve.placement, TRANSPORT, &node, w, why);
        }
        let answer = hello::answer(h.tag, h.key, h.seq, result.as_ref().map(|_| bytes));
        match result {
            // Payload counts once: a range placed before adds only its request and answer.
            Ok(fresh) => serve.placement.uncrossed(h.tag.slot, bytes - fresh.min(bytes)),
            Err(why) if why.foreign() => serve.placement.uncrossed(h.tag.slot, 2 * HEADER_LEN as u64 + TRAILER_LEN + bytes),
            Err(_) => {
                serve.placement.crossed(h.tag.slot, answer.len() as u64);
                serve.placement.uncrossed(h.tag.slot, HEADER_LEN as u64 + if copied { 0 } else { bytes });
            }
        }
        out.answer(&answer, if copied { bytes } else { 0 }).map_err(|e| closing(&node, format!("send answer: {e}")))?;
    }
}

/// A destination connection's answers, buffered: they leave together
/// before it blocks for more requests, or once the writes they answer
/// copied [`ANSWER_AFTER`] bytes.
struct Answers<W: Write> {
    out: std::io::BufWriter<W>,
    // Bytes copied by the writes whose answers wait in `out`.
    unanswered: u64,
}

impl<W: Write> Answers<W> {
    fn new(w: W) -> Self {
        Answers { out: std::io::BufWriter::new(w), unanswered: 0 }
    }

    /// Sends every answer queued.
    fn flush(&mut self) -> std::io::Result<()> {
        self.unanswered = 0;
        self.out.flush()
    }

    /// Queues `answer` to a write that copied `copied` bytes (0: refused).
    fn answer(&mut self, answer: &[u8], copied: u64) -> std::io::Result<()> {
        self.out.write_all(answer)?;
        self.unanswered += copied;
        match self.unanswered >= ANSWER_AFTER {
            true => self.flush(),
            false => Ok(()),
        }
    }
}

/// Accepts one write: the shared checks, then a copy from the shared
/// source (step 5 of [`accept`]), then the count.
/// `copied` says whether the payload was copied, even if then refused.
#[allow(clippy::too_many_arguments)] // the write, and where its bytes come from
fn place(serve: &Serve, peer_id: u64, sources: &HashMap<u32, Source>, w: Incoming, src_key: u32, src_offset: u64, src_stride: u64, copied: &mut bool) -> Result<u64, Refusal> {
    accept::accept(&serve.registry, &serve.placement, peer_id, w, |a: &Admitted| {
        let src = sources.get(&src_key).ok_or(Refusal::SourceNotShared(src_key))?;
        let (runs, dst_stride) = w.stride.unwrap_or((1, 0));
        let span = Stride::span(runs, src_stride, w.len);
        match span.and_then(|s| src_offset.checked_add(s)) {
            Some(end) if end <= src.len => {}
            _ => return Err(Refusal::SourceOutOfBounds { key: src_key, offset: src_offset, len: span.unwrap_or(u64::MAX), region_len: src.len }),
        }
        // A large transfer's bytes are not read again before its layers
        // complete: streamed past the caches. A small one's are, at once.
        let copy = match w.len.saturating_mul(runs) >= STREAM_COLD as u64 && serve.placement.slot_expected(w.tag.slot) >= COLD_TRANSFER {
            true => HostMem::copy_runs_to_cold,
            false => HostMem::copy_runs_to,
        };
        copy(&src.mem, src.offset + src_offset, src_stride, &a.region().mem, a.mem_offset(), dst_stride, w.len, runs)
            .map_err(|e| Refusal::SourceUnusable { key: src_key, reason: format!("copy: {e}") })?;
        *copied = true;
        Ok(Instant::now())
    })
}

/// A header read that failed: the stream ended or the header was bad.
#[derive(Debug)]
enum Either {
    End(ReadEnd),
    Frame(FrameError),
}

impl std::fmt::Display for Either {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Either::End(ReadEnd::Eof { got }) => write!(f, "peer closed after {got} of {HEADER_LEN} header bytes"),
            Either::End(ReadEnd::Failed(r)) => f.write_str(r),
            Either::Frame(e) => write!(f, "{e}"),
        }
    }
}

fn read_end(e: ReadEnd, what: &str) -> String {
    match e {
        ReadEnd::Eof { got } => format!("truncated {what}: peer closed after {got} bytes"),
        ReadEnd::Failed(r) => r,
    }
}

fn read_header(rd: &mut FdReader, max_write: u64) -> Result<Header, Either> {
    let b = rd.next_bytes(HEADER_LEN).map_err(Either::End)?;
    Header::decode(b, max_write).map_err(Either::Frame)
}

/// Appends one request, a header and its trailer as the module docs lay
/// them out: a write (`share` 0 or 1) or a forget (2).
fn push_request(buf: &mut Vec<u8>, h: Header, src_key: u32, share: u32, (win_offset, win_len): (u64, u64), src_offset: u64, len: u64, stride: Option<Stride>) {
    buf.extend_from_slice(&h.encode());
    buf.extend_from_slice(&src_key.to_le_bytes());
    buf.extend_from_slice(&share.to_le_bytes());
    let s = stride.unwrap_or(Stride { count: 0, src: 0, dst: 0 });
    for v in [win_offset, win_len, src_offset, len, s.count, s.src, s.dst] {
        buf.extend_from_slice(&v.to_le_bytes());
    }
}

/// Write requests and the memfds one `sendmsg` carries with them.
type Piece = (Vec<u8>, Vec<RawFd>);

/// Most source regions a connection may have shared and still be kept
/// for another transfer: a tp8 llama-70B's caches are 8 x 80 x 2 regions,
/// written from in place by strided writes, and well under the keys a
/// peer with the default `max_sources` accepts.
pub const MAX_KEPT_SHARES: usize = 4096;

/// Keys a destination accepts per mapped source file (`max_sources`).
pub const KEYS_PER_SOURCE: usize = 64;

/// The initiating side of an shm connection.
#[derive(Debug)]
pub struct ShmConnection {
    stream: UnixStream,
    remote: Hello,
    registry: Arc<Registry>,
    hops: Arc<Hops>,
    /// Source keys whose memfd the peer already holds, and the region each
    /// named when shared (weakly: a kept connection pins no memory here).
    shared: HashMap<u32, Weak<crate::Region>>,
    next_seq: u64,
    ledger: Ledger,
    // Answers read and not yet taken: the socket is non-blocking, and its
    // owner reads them itself ([`crate::answers`]).
    inbox: Inbox,
    closed: Option<String>,
    framing: u64,
    answers: u64,
}

impl ShmConnection {
    fn connect(peer: &str, node: &str, cred: &Credential, registry: Arc<Registry>, hops: Arc<Hops>, timeout: Duration) -> Result<ShmConnection, TransportError> {
        let stream = UnixStream::connect(peer).map_err(TransportError::io("connect to shm peer"))?;
        let hs = hello::Deadline::new(&stream, timeout);
        let remote = hello::initiate(&mut hs.again(), &mut hs.again(), TRANSPORT, cred, hello_of(node))?;
        stream.set_read_timeout(None).map_err(TransportError::io("clear shm timeout"))?;
        stream.set_write_timeout(None).map_err(TransportError::io("clear shm timeout"))?;
        stream.set_nonblocking(true).map_err(TransportError::io("set shm socket nonblocking"))?;
        Ok(ShmConnection {
            stream,
            remote,
            registry,
            ledger: Ledger::new(hops.clone(), 0),
            hops,
            shared: HashMap::new(),
            next_seq: 0,
            inbox: Inbox::default(),
            closed: None,
            framing: 0,
            answers: 0,
        })
    }

    fn apply(&mut self, a: Answer) {
        match a {
            Answer::Placed { seq, refused, at, bytes } => {
                self.answers += bytes;
                if let Err(UnknownPart(seq)) = self.ledger.answer(seq, refused.map_or(Ok(()), |r| Err(TransportError::Refused(r))), at) {
                    self.close(format!("peer answered write {seq}, which is not outstanding"));
                }
            }
            Answer::Garbled(e) => self.close(e.to_string()),
        }
    }

    /// Fails every outstanding batch: the peer is gone, or the stream
    /// lost sync.
    fn close(&mut self, reason: String) {
        if self.closed.is_some() {
            return;
        }
        let pending = self.ledger.waiting();
        if pending > 0 {
            tracing::warn!(peer = %self.remote.node, %reason, pending, "shm connection closed with batches outstanding");
        }
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        self.ledger.close(|pending| TransportError::PeerClosed { pending });
        self.closed = Some(reason);
    }

    /// Reads the answers that arrived, without waiting, and applies them;
    /// while requests wait for room (`apply` false) only reads them
    /// ([`Inbox::pump`]). An answer stream that ended while they waited
    /// closes the connection here, once their batch is accounted for by
    /// the failed request.
    fn drain(&mut self, apply: bool) {
        let (answers, end) = self.inbox.pump(&self.stream, self.closed.is_none(), apply);
        answers.into_iter().for_each(|a| self.apply(a));
        match end {
            Some(End::Closed) => self.close("the peer closed the connection".into()),
            Some(End::Failed(e)) => self.close(format!("receive answer: {e}")),
            None => {}
        }
    }

    /// Checks every source first: a refused post sends nothing.
    fn sources(&self, batch: &Batch) -> Result<Vec<Arc<crate::Region>>, TransportError> {
        let mut srcs = Vec::with_capacity(batch.writes.len());
        for w in &batch.writes {
            let region = self.registry.get(w.src_key).ok_or_else(|| TransportError::Source(format!("no local region has key {:#010x}", w.src_key)))?;
            match w.src_span().and_then(|s| w.src_offset.checked_add(s)) {
                Some(end) if end <= region.len && w.count() > 0 => {}
                _ => {
                    return Err(TransportError::Source(format!(
                        "read of {} x {} bytes from offset {} exceeds local region {:#010x} of {} bytes",
                        w.count(),
                        w.len,
                        w.src_offset,
                        w.src_key,
                        region.len
                    )))
                }
            }
            srcs.push(region);
        }
        Ok(srcs)
    }

    /// Adds the write requests of `batch` (parts of `id`) to `pieces`, each
    /// piece carrying at most SCM_MAX_FD memfds, and the source keys they
    /// share to `newly`.
    fn requests(&mut self, pieces: &mut Vec<Piece>, newly: &mut HashMap<u32, Weak<crate::Region>>, id: BatchId, batch: &Batch, srcs: &[Arc<crate::Region>]) {
        if pieces.is_empty() {
            pieces.push((Vec::new(), Vec::new()));
        }
        for (w, region) in batch.writes.iter().zip(srcs) {
            let share = !self.shared.contains_key(&w.src_key) && newly.insert(w.src_key, Arc::downgrade(region)).is_none();
            if share && pieces.last().is_some_and(|p| p.1.len() == SCM_MAX_FD) {
                pieces.push((Vec::new(), Vec::new()));
            }
            let piece = pieces.last_mut().expect("one piece");
            let seq = self.next_seq;
            self.next_seq += 1;
            let h = Header { kind: Kind::Write, tag: batch.tag, key: w.dst_key, seq, offset: w.dst_offset, len: TRAILER_LEN };
            let window = if share { (region.offset, region.len) } else { (0, 0) };
            push_request(&mut piece.0, h, w.src_key, u32::from(share), window, w.src_offset, w.len, w.stride);
            if share {
                piece.1.push(region.mem.fd().as_raw_fd());
            }
            self.ledger.part(id, seq);
        }
    }

    /// Tells the peer to unmap `keys` (regions shared here and released
    /// since) and forgets them; a failure closes the connection.
    fn forget(&mut self, keys: &[u32]) -> Result<(), TransportError> {
        let mut buf = Vec::with_capacity(keys.len() * (HEADER_LEN + TRAILER_LEN as usize));
        let h = Header { kind: Kind::Write, tag: Tag { slot: 0, layer: 0 }, key: 0, seq: 0, offset: 0, len: TRAILER_LEN };
        for &k in keys {
            push_request(&mut buf, h, k, 2, (0, 0), 0, 0, None);
        }
        if let Err(e) = self.send(&buf, &[]) {
            self.close(e.to_string());
            return Err(e);
        }
        self.framing += buf.len() as u64;
        keys.iter().for_each(|k| {
            self.shared.remove(k);
        });
        Ok(())
    }

    /// Sends `buf` with `fds` attached to its first byte. While the socket
    /// has no room the answers that arrive meanwhile are read: a peer
    /// blocked on sending them would stop reading these requests.
    fn send(&mut self, buf: &[u8], fds: &[RawFd]) -> Result<(), TransportError> {
        let fd = self.stream.as_raw_fd();
        let mut sent = 0;
        while sent < buf.len() {
            let rights = [ControlMessage::ScmRights(fds)];
            let cmsgs: &[ControlMessage] = if sent == 0 && !fds.is_empty() { &rights } else { &[] };
            match sendmsg::<()>(fd, &[IoSlice::new(&buf[sent..])], cmsgs, MsgFlags::MSG_NOSIGNAL, None) {
                Ok(n) => sent += n,
                Err(nix::errno::Errno::EINTR) => continue,
                Err(nix::errno::Errno::EAGAIN) => {
                    answers::ready(&self.stream, true, None);
                    self.drain(false);
                }
                Err(e) => return Err(TransportError::Io { op: "send shm write requests", kind: std::io::Error::from(e).kind(), message: e.to_string() }),
            }
        }
        Ok(())
    }
}

impl Drop for ShmConnection {
    fn drop(&mut self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}

impl Connection for ShmConnection {
    fn remote(&self) -> &Hello {
        &self.remote
    }

    fn post(&mut self, batch: Batch) -> Result<BatchId, TransportError> {
        self.post_all(vec![batch]).map(|ids| ids[0]).map_err(|(_, e)| e)
    }

    /// Every batch is checked before any goes; then all their requests
    /// leave together, in one message unless they share more memfds than
    /// one carries (one wake-up of the peer, whose answers then come
    /// together too).
    fn post_all(&mut self, batches: Vec<Batch>) -> Result<Vec<BatchId>, (Vec<BatchId>, TransportError)> {
        let started = Instant::now();
        self.drain(true);
        if self.closed.is_some() {
            return Err((Vec::new(), TransportError::PeerClosed { pending: self.ledger.waiting() }));
        }
        let srcs = batches.iter().map(|b| self.sources(b)).collect::<Result<Vec<_>, _>>().map_err(|e| (Vec::new(), e))?;
        let (mut pieces, mut newly) = (Vec::new(), HashMap::new());
        let mut ids = Vec::with_capacity(batches.len());
        for (b, srcs) in batches.iter().zip(&srcs) {
            let id = self.ledger.begin(b.tag, b.bytes(), started, ());
            self.requests(&mut pieces, &mut newly, id, b, srcs);
            ids.push(id);
        }
        // `srcs` keeps every shared memfd open until sent.
        for (buf, fds) in &pieces {
            if let Err(e) = self.send(buf, fds) {
                // The peer is gone (`send` waits out a full socket; a Unix socket fails no other way):
                // it reads none of these batches' sources any more.
                ids.iter().for_each(|&id| self.ledger.withdraw(id));
                self.close(e.to_string());
                return Err((Vec::new(), e));
            }
            self.framing += buf.len() as u64;
        }
        ids.iter().for_each(|&id| self.ledger.seal(id, None));
        self.shared.extend(newly);
        self.hops.record_batch(Hop::Post, started.elapsed(), batches.iter().map(Batch::bytes).sum());
        Ok(ids)
    }

    fn poll(&mut self, timeout: Duration) -> Result<Vec<Completion>, TransportError> {
        let deadline = Instant::now() + timeout;
        loop {
            self.drain(true);
            if self.ledger.has_done() || self.ledger.waiting() == 0 {
                return Ok(self.ledger.take_done());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(Vec::new());
            }
            answers::ready(&self.stream, false, Some(left));
        }
    }

    /// Batches posted whose completion [`Connection::poll`] has not yet returned.
    fn pending(&self) -> usize {
        self.ledger.pending()
    }

    /// Open and nothing outstanding, once the peer was told to forget
    /// every region shared here that is no longer registered under the key
    /// it was shared by (a transfer's staging buffer), and while it maps at
    /// most [`MAX_KEPT_SHARES`]. Kept, the next transfer reuses the peer's
    /// mappings of the same caches instead of a handshake, a memfd
    /// hand-over and a fresh mapping to fault in.
    fn reusable(&mut self) -> bool {
        self.drain(true);
        if self.closed.is_some() || self.ledger.pending() != 0 {
            return false;
        }
        let current = |k: u32, was: &Weak<crate::Region>| self.registry.get(k).is_some_and(|r| std::ptr::eq(Arc::as_ptr(&r), was.as_ptr()));
        let released: Vec<u32> = self.shared.iter().filter(|&(&k, was)| !current(k, was)).map(|(&k, _)| k).collect();
        if !released.is_empty() && self.forget(&released).is_err() {
            return false;
        }
        self.shared.len() <= MAX_KEPT_SHARES
    }

    /// A header and a trailer per write request.
    fn framing_bytes(&self) -> u64 {
        self.framing
    }

    /// An `Ack` header per write; a `Nack` header and its reason.
    fn answer_bytes(&self) -> u64 {
        self.answers
    }
}

#[cfg(test)]
mod tests {
    use super::{Answers, ANSWER_AFTER};

    #[test]
    fn answers_leave_once_their_writes_copied_enough_or_when_flushed() {
        let mut a = Answers::new(Vec::new());
        let sent = |a: &Answers<Vec<u8>>| a.out.get_ref().len();
        // Small writes wait for the ones behind them.
        a.answer(&[1; 40], 64 << 10).unwrap();
        a.answer(&[2; 40], 0).unwrap();
        assert_eq!(sent(&a), 0);
        // Together with this one they copied enough: all three leave.
        a.answer(&[3; 40], ANSWER_AFTER - (64 << 10)).unwrap();
        assert_eq!(sent(&a), 120);
        // The count starts again: a refused write copied nothing.
        a.answer(&[4; 40], ANSWER_AFTER - 1).unwrap();
        a.answer(&[5; 40], 0).unwrap();
        assert_eq!(sent(&a), 120);
        // Before blocking, whatever is queued leaves, and the count restarts.
        a.flush().unwrap();
        assert_eq!(sent(&a), 200);
        a.answer(&[6; 40], 1).unwrap();
        assert_eq!(sent(&a), 200);
        a.answer(&[7; 40], ANSWER_AFTER).unwrap();
        assert_eq!(a.out.get_ref()[200..], [[6u8; 40], [7u8; 40]].concat()[..]);
    }
}
