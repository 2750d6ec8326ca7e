//! Daemon ↔ daemon control: a TCP connection authenticated by HMAC-SHA256
//! challenge–response over the shared secret (both sides prove they hold
//! it; the secret never crosses the wire), then offer/accept of transfers.
//!
//! 1. server → `Challenge { node, version, nonce_s }`
//! 2. client → `Auth { node, nonce_c, mac = HMAC(secret, "kvwire-peer-client-v1" ‖ nonce_s ‖ nonce_c ‖ client node) }`
//! 3. server → `AuthOk { mac = HMAC(secret, "kvwire-peer-server-v1" ‖ nonce_c ‖ nonce_s ‖ server node) }` or `Refused`
//! 4. from here on, every message in either direction is sealed
//!    ([`Sealed`]): an HMAC under a key derived from the session, over a
//!    per-direction sequence number and the message, so nothing can be
//!    forged, replayed, reordered or cut out of the stream. Sealed
//!    messages are binary ([`PeerMsg::to_binary`]); the handshake's are
//!    JSON, so that a peer of another version is told by its challenge.
//!
//! Both sides derive the data-plane session of the connection from the
//! handshake ([`Credential::derive`]): the destination opens it for the
//! peer's data connections, the source proves it on each.
//!
//! Then the source sends `Offer` with its side of the plan; the destination
//! plans and stages, and answers `Accept` with its layout, block table,
//! data-plane address, staging buffer and the keys of regions granted to
//! this transfer alone; the source plans, sends `Expect` (the manifest,
//! not answered) and its bytes at once on the data plane; `Abort` fails
//! the destination's flags when the source gives up.

use kvwire_client::wire::{read_body, write_msg, WireError, MAX_MESSAGE};
pub use kvwire_core::session::msg::{PeerMsg, PEER_VERSION};
use kvwire_core::session::kind;
use kvwire_transport::auth::{self, Credential};
use kvwire_transport::idle::IdleSpin;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Why authentication failed.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// Transport-level failure.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// The other side does not hold the secret, or refused us.
    #[error("peer authentication failed: {0}")]
    Denied(String),
}

const NONCE: usize = 32;

/// Largest handshake message read before the other side proved the
/// secret: a challenge or an auth is a few hundred bytes, and an outsider
/// must not make the daemon hold more.
pub const MAX_HANDSHAKE_MESSAGE: usize = 4096;

/// Reads one handshake message, refusing a length over
/// [`MAX_HANDSHAKE_MESSAGE`] before reading its body.
fn read_handshake(r: &mut impl Read) -> Result<PeerMsg, WireError> {
    let body = read_body(r, MAX_HANDSHAKE_MESSAGE, |len| {
        WireError::Peer(format!("handshake message of {len} bytes; at most {MAX_HANDSHAKE_MESSAGE} before authentication"))
    })?;
    kvwire_client::wire::parse(&body)
}

fn nonce_of(hex: &str, what: &str) -> Result<Vec<u8>, AuthError> {
    auth::unhex(hex, NONCE).filter(|n| n.len() == NONCE).ok_or_else(|| AuthError::Denied(format!("malformed {what} nonce")))
}

/// Server side of the handshake; returns the authenticated client's node
/// name and the session's credential. On failure the caller counts the
/// refusal, then sends [`PeerMsg::Refused`] so the client's error names
/// the cause.
pub fn accept_auth(s: &mut (impl Read + Write), secret: &[u8], node: &str) -> Result<(String, Credential), AuthError> {
    let ns = auth::random_bytes::<NONCE>();
    write_msg(s, &PeerMsg::Challenge { node: node.into(), version: PEER_VERSION, nonce: auth::hex(&ns) })?;
    let (client, nc, proof) = match read_handshake(s)? {
        PeerMsg::Auth { node, nonce, mac } => (node, nonce, mac),
        other => return Err(AuthError::Denied(format!("expected auth, got {}", kind(&other)))),
    };
    // Checked before it is used anywhere, logs included: an outsider's
    // string goes nowhere unless it is a plain node name.
    if !crate::config::is_node_name(&client) {
        return Err(AuthError::Denied(format!("malformed node name ({} bytes)", client.len())));
    }
    let nc = nonce_of(&nc, "client")?;
    let proof = auth::unhex(&proof, 32).unwrap_or_default();
    if !auth::verify(secret, "kvwire-peer-client-v1", &[&ns, &nc, client.as_bytes()], &proof) {
        return Err(AuthError::Denied(format!("peer `{client}` does not hold the shared secret")));
    }
    let m = auth::mac(secret, "kvwire-peer-server-v1", &[&nc, &ns, node.as_bytes()]);
    write_msg(s, &PeerMsg::AuthOk { mac: auth::hex(&m) })?;
    let cred = Credential::derive(secret, &ns, &nc, &client, node);
    Ok((client, cred))
}

/// Client side of the handshake; returns the authenticated server's node
/// name and the session's credential.
pub fn connect_auth(s: &mut (impl Read + Write), secret: &[u8], node: &str) -> Result<(String, Credential), AuthError> {
    let (server, version, ns) = match read_handshake(s)? {
        PeerMsg::Challenge { node, version, nonce } => (node, version, nonce),
        other => return Err(AuthError::Denied(format!("expected a challenge, got {}", kind(&other)))),
    };
    if !crate::config::is_node_name(&server) {
        return Err(AuthError::Denied(format!("malformed node name ({} bytes)", server.len())));
    }
    if version != PEER_VERSION {
        return Err(AuthError::Denied(format!("peer `{server}` speaks peer protocol {version}, this daemon {PEER_VERSION}")));
    }
    let ns = nonce_of(&ns, "server")?;
    let nc = auth::random_bytes::<NONCE>();
    let m = auth::mac(secret, "kvwire-peer-client-v1", &[&ns, &nc, node.as_bytes()]);
    write_msg(s, &PeerMsg::Auth { node: node.into(), nonce: auth::hex(&nc), mac: auth::hex(&m) })?;
    match read_handshake(s)? {
        PeerMsg::AuthOk { mac: proof } if auth::verify(secret, "kvwire-peer-server-v1", &[&nc, &ns, server.as_bytes()], &auth::unhex(&proof, 32).unwrap_or_default()) => {
            let cred = Credential::derive(secret, &ns, &nc, node, &server);
            Ok((server, cred))
        }
        PeerMsg::AuthOk { .. } => Err(AuthError::Denied(format!("peer `{server}` failed to prove the shared secret"))),
        PeerMsg::Refused { reason } => Err(AuthError::Denied(format!("peer `{server}` refused: {reason}"))),
        other => Err(AuthError::Denied(format!("expected auth_ok, got {}", kind(&other)))),
    }
}

/// Bytes of the seal after each message.
pub const SEAL_LEN: usize = 32;

/// An authenticated peer connection: every message framed as a u32
/// length, its binary form, and `HMAC(direction key, sequence ‖ body)`. Each side
/// counts the messages it sent and received, so a replayed, reordered,
/// dropped or altered message fails its check and ends the connection.
///
/// The sending half sits behind a lock shared with [`Outbox`]es, so
/// another thread may send on the connection (a destination announcing a
/// request) while its owner reads: a frame is sealed and written under
/// that lock, and the sequence stays whole.
#[derive(Debug)]
pub struct Sealed {
    stream: Arc<TcpStream>,
    // Frames are read through a buffer: a frame's length, body and seal,
    // and the frames that came with it, in one system call.
    reader: std::io::BufReader<Shared>,
    credential: Credential,
    recv_key: [u8; 32],
    received: u64,
    // Bytes of the sealed frames read (length, body, seal), for wire_bytes.
    read_bytes: u64,
    // The read timeout set on the socket, so that setting it again costs no system call.
    timeout: Option<Duration>,
    tx: Arc<Mutex<Tx>>,
    // Runs when the connection is let go: the session it proved ends with it.
    ended: Ended,
}

/// What to run once when a connection is dropped (not when it moves).
#[derive(Default)]
struct Ended(Option<Box<dyn FnOnce() + Send + Sync>>);

impl Drop for Ended {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f();
        }
    }
}

impl std::fmt::Debug for Ended {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "Ended(set)" } else { "Ended" })
    }
}

#[derive(Debug)]
struct Tx {
    stream: Arc<TcpStream>,
    key: [u8; 32],
    sent: u64,
    bytes: u64,
    // Frames sealed and held back, to leave in one write with the next.
    held: Vec<u8>,
}

impl Tx {
    fn send(&mut self, m: &PeerMsg, before: impl FnOnce(u64)) -> Result<(), WireError> {
        let f = self.seal(m);
        before(f.len() as u64);
        match self.held.is_empty() {
            true => self.write(&f),
            false => {
                self.held.extend_from_slice(&f);
                self.flush()
            }
        }
    }

    fn hold(&mut self, m: &PeerMsg) {
        let f = self.seal(m);
        self.held.extend_from_slice(&f);
    }

    /// The next frame: `m` sealed under this direction's next number.
    fn seal(&mut self, m: &PeerMsg) -> Vec<u8> {
        let f = seal_frame(&self.key, self.sent, m);
        self.sent += 1;
        f
    }

    fn flush(&mut self) -> Result<(), WireError> {
        if self.held.is_empty() {
            return Ok(());
        }
        let out = std::mem::take(&mut self.held);
        self.write(&out)
    }

    fn write(&mut self, out: &[u8]) -> Result<(), WireError> {
        let io = |cause| WireError::Io { op: "send", cause };
        let mut w = &*self.stream;
        w.write_all(out).map_err(io)?;
        self.bytes += out.len() as u64;
        w.flush().map_err(io)
    }
}

/// The sending half of a [`Sealed`] connection, for a thread other than
/// the one reading it.
#[derive(Debug, Clone)]
pub struct Outbox(Arc<Mutex<Tx>>);

impl Outbox {
    /// Sends one sealed message, after those already sent, first telling
    /// `before` its size on the wire.
    pub fn send_counted(&self, m: &PeerMsg, before: impl FnOnce(u64)) -> Result<(), WireError> {
        self.0.lock().expect("peer send lock").send(m, before)
    }
}

impl Sealed {
    /// Seals `stream` under `cred`; `client` is the side that connected
    /// (each direction has its own key).
    pub fn new(stream: TcpStream, cred: Credential, client: bool) -> Sealed {
        let (c2s, s2c) = (cred.subkey("kvwire-peer-client-to-server-v1"), cred.subkey("kvwire-peer-server-to-client-v1"));
        let (send_key, recv_key) = if client { (c2s, s2c) } else { (s2c, c2s) };
        let stream = Arc::new(stream);
        let tx = Arc::new(Mutex::new(Tx { stream: stream.clone(), key: send_key, sent: 0, bytes: 0, held: Vec::new() }));
        let reader = std::io::BufReader::with_capacity(READ_BUFFER, Shared(stream.clone()));
        Sealed { stream, reader, credential: cred, recv_key, received: 0, read_bytes: 0, timeout: None, tx, ended: Ended::default() }
    }

    /// Runs `f` once, when this connection is dropped wherever that happens
    /// (not kept, lost, refused): what was kept for its session goes then.
    pub fn on_end(&mut self, f: impl FnOnce() + Send + Sync + 'static) {
        self.ended = Ended(Some(Box::new(f)));
    }

    /// Sets the socket's read timeout (as `TcpStream::set_read_timeout`),
    /// with no system call when it is set already: a transfer sets it
    /// several times over, most often to what it was.
    pub fn read_timeout(&mut self, t: Duration) -> std::io::Result<()> {
        if self.timeout != Some(t) {
            self.stream.set_read_timeout(Some(t))?;
            self.timeout = Some(t);
        }
        Ok(())
    }

    /// The read timeout this connection set on its socket, if it set one.
    pub fn read_timeout_set(&self) -> Option<Duration> {
        self.timeout
    }

    /// The connection's data-plane session.
    pub fn credential(&self) -> &Credential {
        &self.credential
    }

    /// The socket (for timeouts).
    pub fn stream(&self) -> &TcpStream {
        &self.stream
    }

    /// Sends one sealed message.
    pub fn send(&mut self, m: &PeerMsg) -> Result<(), WireError> {
        self.send_counted(m, |_| ())
    }

    /// Sends one sealed message, first telling `before` its size on the
    /// wire (for a count that must be final before the peer can answer).
    pub fn send_counted(&mut self, m: &PeerMsg, before: impl FnOnce(u64)) -> Result<(), WireError> {
        self.tx.lock().expect("peer send lock").send(m, before)
    }

    /// Seals one message and holds it back: it leaves with the next one
    /// sent, in the same write (or before this side waits for an answer).
    /// For a message that is never alone, such as a claim followed by its
    /// manifest.
    pub fn hold(&mut self, m: &PeerMsg) {
        self.tx.lock().expect("peer send lock").hold(m)
    }

    /// Another thread's way to send on this connection.
    pub fn outbox(&self) -> Outbox {
        Outbox(self.tx.clone())
    }

    /// Receives one message and checks its seal before parsing it.
    pub fn recv(&mut self) -> Result<PeerMsg, WireError> {
        // An answer to something held would never come.
        self.tx.lock().expect("peer send lock").flush()?;
        self.read_next()
    }

    /// The next message, read and opened (what is held already went).
    fn read_next(&mut self) -> Result<PeerMsg, WireError> {
        let mut counted = Counted { inner: &mut self.reader, n: 0 };
        let m = open_frame(&self.recv_key, self.received, &mut counted);
        self.read_bytes += counted.n;
        let m = m?;
        self.received += 1;
        Ok(m)
    }

    /// [`Sealed::recv`], polling the socket first while nothing is buffered
    /// ([`IdleSpin`]: a serving thread kept running between messages that
    /// come close together).
    pub fn recv_polling(&mut self, spin: &mut IdleSpin) -> Result<PeerMsg, WireError> {
        self.tx.lock().expect("peer send lock").flush()?;
        if !self.reader.buffer().is_empty() {
            return self.read_next();
        }
        let stream = self.stream.clone();
        spin.idle(&*stream, || self.read_next())
    }

    /// Whether bytes wait to be read (an idle connection's unsolicited
    /// messages), without blocking; an error once the peer closed it.
    pub fn pending(&self) -> std::io::Result<bool> {
        self.waiting().map(|w| w != Waiting::Nothing)
    }

    /// What waits to be read, without blocking: nothing, a whole frame
    /// (its read cannot block), or part of one; an error once the peer
    /// closed it with nothing left.
    pub fn waiting(&self) -> std::io::Result<Waiting> {
        use nix::sys::socket::{recv, MsgFlags};
        use std::os::fd::AsRawFd;
        let buffered = self.reader.buffer();
        // One peek that does not wait, leaving the socket blocking. The
        // head is enough to see a whole control frame of a few KiB.
        let mut head = [0u8; PEEK_BYTES];
        let peeked = match recv(self.stream.as_raw_fd(), &mut head, MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT) {
            Ok(0) if buffered.is_empty() => return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "closed by the peer")),
            Ok(n) => n,
            Err(nix::errno::Errno::EAGAIN) => 0,
            Err(e) => return Err(e.into()),
        };
        let have = buffered.len() + peeked;
        if have == 0 {
            return Ok(Waiting::Nothing);
        }
        let mut len = [0u8; 4];
        for (i, b) in buffered.iter().chain(&head[..peeked]).take(4).enumerate() {
            len[i] = *b;
        }
        let whole = have >= 4 && have as u64 >= 4 + u64::from(u32::from_le_bytes(len)) + SEAL_LEN as u64;
        Ok(if whole { Waiting::Whole } else { Waiting::Part })
    }

    /// Bytes of the sealed frames received so far. Cumulative.
    pub fn frames_read(&self) -> u64 {
        self.read_bytes
    }

    /// Bytes of every sealed frame sent and received on this connection so
    /// far (its handshake not included). Cumulative.
    pub fn frame_bytes(&self) -> u64 {
        self.read_bytes + self.tx.lock().expect("peer send lock").bytes
    }
}

/// What [`Sealed::waiting`] saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waiting {
    /// Nothing to read.
    Nothing,
    /// At least one whole frame.
    Whole,
    /// Part of a frame, the rest still on its way.
    Part,
}

/// Bytes [`Sealed::waiting`] peeks at: an announcement is 1-2 KiB.
const PEEK_BYTES: usize = 4 << 10;

/// Bytes a connection reads ahead: several control frames (a claim and
/// its manifest are about 3 KiB); a larger one's body bypasses it.
const READ_BUFFER: usize = 16 << 10;

/// The socket as a reader owned beside its other handles.
#[derive(Debug)]
struct Shared(Arc<TcpStream>);

impl Read for Shared {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        (&*self.0).read(buf)
    }
}

/// A reader that counts what it read.
struct Counted<'a, R> {
    inner: &'a mut R,
    n: u64,
}

impl<R: Read> Read for Counted<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.n += n as u64;
        Ok(n)
    }
}

/// Message number `seq` of a direction whose key is `key`, as it goes on
/// the wire: length, binary form ([`PeerMsg::to_binary`]), seal.
pub fn seal_frame(key: &[u8; 32], seq: u64, m: &PeerMsg) -> Vec<u8> {
    let body = m.to_binary();
    let mut out = Vec::with_capacity(4 + body.len() + SEAL_LEN);
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    let seal = auth::mac(key, "kvwire-peer-frame-v1", &[&seq.to_le_bytes(), &body]);
    out.extend_from_slice(&seal);
    out
}

/// Reads message number `seq` of a direction whose key is `key`; its seal
/// is checked before a byte of it is parsed.
pub fn open_frame(key: &[u8; 32], seq: u64, r: &mut impl Read) -> Result<PeerMsg, WireError> {
    let (body, seal) = read_sealed(r)?;
    if !auth::verify(key, "kvwire-peer-frame-v1", &[&seq.to_le_bytes(), &body], &seal) {
        return Err(WireError::Peer(format!("message {seq} fails its seal: forged, replayed or out of order")));
    }
    PeerMsg::from_binary(&body).map_err(WireError::Peer)
}

/// Reads one sealed frame: its body and its seal, unchecked.
fn read_sealed(r: &mut impl Read) -> Result<(Vec<u8>, [u8; SEAL_LEN]), WireError> {
    let body = read_body(r, MAX_MESSAGE, WireError::TooLong)?;
    let mut seal = [0u8; SEAL_LEN];
    r.read_exact(&mut seal).map_err(|cause| WireError::Io { op: "receive", cause })?;
    Ok((body, seal))
}

/// A sealed connection over loopback, for tests: the connecting side,
/// the accepting side, and the connecting side's raw socket.
#[cfg(test)]
pub(crate) fn sealed_pair() -> (Sealed, Sealed, TcpStream) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (s, _) = l.accept().unwrap();
    let raw = c.try_clone().unwrap();
    let cred = Credential::derive(b"secret", b"ns", b"nc", "a", "b");
    (Sealed::new(c, cred.clone(), true), Sealed::new(s, cred, false), raw)
}

#[cfg(test)]
mod tests {
    use super::sealed_pair as pair;
    use super::*;

    #[test]
    fn waiting_tells_nothing_from_part_of_a_frame_from_whole_frames() {
        let (mut a, mut b, mut raw) = pair();
        let settle = |b: &Sealed, want: Waiting| {
            let t = std::time::Instant::now();
            while b.waiting().unwrap() != want && t.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(1));
            }
            b.waiting().unwrap()
        };
        assert_eq!(b.waiting().unwrap(), Waiting::Nothing);
        a.send(&PeerMsg::Ping).unwrap();
        a.send(&PeerMsg::Pong).unwrap();
        assert_eq!(settle(&b, Waiting::Whole), Waiting::Whole);
        assert_eq!(b.recv().unwrap(), PeerMsg::Ping);
        // The second frame came in the same read: whole, from the buffer.
        assert_eq!(b.waiting().unwrap(), Waiting::Whole);
        assert_eq!(b.recv().unwrap(), PeerMsg::Pong);
        assert_eq!(b.waiting().unwrap(), Waiting::Nothing);
        // A frame whose length came and whose body did not: part of one.
        raw.write_all(&100u32.to_le_bytes()).unwrap();
        raw.write_all(b"{").unwrap();
        assert_eq!(settle(&b, Waiting::Part), Waiting::Part);
        drop((a, raw));
        // Closed with bytes left: those are still to read.
        assert_eq!(b.waiting().unwrap(), Waiting::Part);
    }

    #[test]
    fn the_end_hook_runs_once_when_the_connection_is_dropped_not_when_it_moves() {
        use std::sync::atomic::{AtomicU32, Ordering};
        let (mut a, _b, _raw) = pair();
        let ran = Arc::new(AtomicU32::new(0));
        let r = ran.clone();
        a.on_end(move || {
            r.fetch_add(1, Ordering::SeqCst);
        });
        let moved = vec![a];
        assert_eq!(ran.load(Ordering::SeqCst), 0, "moved, still open");
        drop(moved);
        assert_eq!(ran.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn sealed_messages_pass_and_forged_or_replayed_ones_do_not() {
        let (mut a, mut b, mut raw) = pair();
        a.send(&PeerMsg::Ping).unwrap();
        b.send(&PeerMsg::Pong).unwrap();
        assert_eq!(b.recv().unwrap(), PeerMsg::Ping);
        assert_eq!(a.recv().unwrap(), PeerMsg::Pong);
        // A frame written around the seal: valid framing, no valid seal.
        let body = serde_json::to_vec(&PeerMsg::Ping).unwrap();
        raw.write_all(&(body.len() as u32).to_le_bytes()).unwrap();
        raw.write_all(&body).unwrap();
        raw.write_all(&[0u8; SEAL_LEN]).unwrap();
        assert_eq!(b.recv().unwrap_err().to_string(), "message 1 fails its seal: forged, replayed or out of order");
    }

    #[test]
    fn a_sealed_message_that_does_not_parse_is_named_once() {
        let (a, mut b, _raw) = pair();
        // Sealed with the sender's key at its next place in the stream, but
        // not a message: the refusal says so, without a second prefix.
        let body = [15u8];
        let key = a.tx.lock().unwrap().key;
        let mut s = a.stream.try_clone().unwrap();
        s.write_all(&(body.len() as u32).to_le_bytes()).unwrap();
        s.write_all(&body).unwrap();
        s.write_all(&auth::mac(&key, "kvwire-peer-frame-v1", &[&0u64.to_le_bytes(), &body])).unwrap();
        let e = b.recv().unwrap_err().to_string();
        assert!(e.starts_with("malformed peer message: "), "{e}");
        assert!(!e.contains("malformed message"), "{e}");
    }

    #[test]
    fn a_message_sealed_for_one_place_in_the_stream_fails_at_another() {
        let (mut a, mut b, _raw) = pair();
        // The second message's seal covers sequence 1: replaying the first
        // one's bytes there fails.
        let body = serde_json::to_vec(&PeerMsg::Ping).unwrap();
        let first = auth::mac(&a.tx.lock().unwrap().key, "kvwire-peer-frame-v1", &[&0u64.to_le_bytes(), &body]);
        a.send(&PeerMsg::Ping).unwrap();
        assert_eq!(b.recv().unwrap(), PeerMsg::Ping);
        let mut s = a.stream.try_clone().unwrap();
        s.write_all(&(body.len() as u32).to_le_bytes()).unwrap();
        s.write_all(&body).unwrap();
        s.write_all(&first).unwrap();
        assert!(b.recv().is_err(), "a replayed message was accepted");
    }
}
