//! Who may use the data plane, and how they prove it.
//!
//! A data-plane connection belongs to a **session**: what one
//! authenticated peer-control handshake established between two daemons.
//! Both sides derive the session's key from the cluster secret and the
//! handshake's two nonces ([`Credential::derive`]); the key itself never
//! crosses the wire. The destination lists its live sessions in its
//! [`crate::Registry`]; a source proves one on every data connection
//! before the destination tells it anything (see [`crate::hello`] for the
//! exchange), and a write is then accepted only into a region granted to
//! that session and to the write's slot ([`crate::registry::Grant`]).
//!
//! Listeners also cap how many connections an outsider can hold open
//! before proving anything ([`Gate`]).

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Bytes of a session key.
pub const KEY_LEN: usize = 32;

type HmacSha256 = Hmac<Sha256>;

/// One data-plane session: its id (which the source names in its hello)
/// and its key (which neither side ever sends).
#[derive(Clone, PartialEq, Eq)]
pub struct Credential {
    /// The session's id.
    pub session: u64,
    key: [u8; KEY_LEN],
}

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key stays out of logs and panics.
        f.debug_struct("Credential").field("session", &format_args!("{:016x}", self.session)).finish_non_exhaustive()
    }
}

impl Credential {
    /// The session a peer-control handshake established: both sides call
    /// this with the same secret, nonces and names, and get the same
    /// credential. `client` is the side that connected.
    pub fn derive(secret: &[u8], server_nonce: &[u8], client_nonce: &[u8], client: &str, server: &str) -> Credential {
        let key = mac(secret, "kvwire-session-key-v1", &[server_nonce, client_nonce, client.as_bytes(), server.as_bytes()]);
        let id = mac(&key, "kvwire-session-id-v1", &[]);
        Credential { session: u64::from_le_bytes(id[..8].try_into().expect("8 bytes")), key }
    }

    /// A fresh session with a random key, for endpoints used without a
    /// peer-control handshake (benches, tests).
    pub fn random() -> Credential {
        let key = random_bytes();
        let id = random_bytes::<8>();
        Credential { session: u64::from_le_bytes(id), key }
    }

    /// The key, for MACs under it.
    pub fn key(&self) -> &[u8; KEY_LEN] {
        &self.key
    }

    /// A key for one purpose, so one session key never MACs two kinds of
    /// message (e.g. each direction of the peer-control stream).
    pub fn subkey(&self, label: &str) -> [u8; KEY_LEN] {
        mac(&self.key, label, &[])
    }
}

/// HMAC-SHA256 under `key` over `label` and each part, each part
/// length-prefixed so no two part lists give the same input.
pub fn mac(key: &[u8], label: &str, parts: &[&[u8]]) -> [u8; 32] {
    hasher(key, label, parts).finalize().into_bytes().into()
}

/// Whether `proof` is [`mac`] of the same input, compared in constant time.
pub fn verify(key: &[u8], label: &str, parts: &[&[u8]], proof: &[u8]) -> bool {
    hasher(key, label, parts).verify_slice(proof).is_ok()
}

fn hasher(key: &[u8], label: &str, parts: &[&[u8]]) -> HmacSha256 {
    let mut m = HmacSha256::new_from_slice(key).expect("HMAC takes any key length");
    m.update(label.as_bytes());
    for p in parts {
        m.update(&(p.len() as u32).to_le_bytes());
        m.update(p);
    }
    m
}

/// `N` bytes from the kernel's random source. Keys, nonces and region keys
/// come from here, so none can be guessed from another.
pub fn random_bytes<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    let mut got = 0;
    while got < N {
        // SAFETY: the buffer is valid for `N - got` bytes from `got`.
        let n = unsafe { nix::libc::getrandom(b[got..].as_mut_ptr().cast(), N - got, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            assert!(e.kind() == std::io::ErrorKind::Interrupted, "getrandom failed: {e}");
            continue;
        }
        got += n as usize;
    }
    b
}

/// Lowercase hex.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Parses lowercase or uppercase hex of at most `max` bytes.
pub fn unhex(s: &str, max: usize) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 || s.len() > 2 * max {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok()).collect()
}

/// Caps on one listener's connections: at most `unauthenticated` that have
/// not proved a session yet, and at most `total` in all. A connection past
/// either is closed at once, before anything is read from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionCaps {
    /// Connections still in their handshake.
    pub unauthenticated: usize,
    /// Connections in all.
    pub total: usize,
}

impl Default for ConnectionCaps {
    fn default() -> Self {
        ConnectionCaps { unauthenticated: 16, total: 256 }
    }
}

/// Counts a listener's connections against its [`ConnectionCaps`].
#[derive(Debug, Default)]
pub struct Gate {
    caps: ConnectionCaps,
    unauthenticated: AtomicUsize,
    total: AtomicUsize,
}

impl Gate {
    /// A gate with `caps`.
    pub fn new(caps: ConnectionCaps) -> Arc<Gate> {
        Arc::new(Gate { caps, unauthenticated: AtomicUsize::new(0), total: AtomicUsize::new(0) })
    }

    /// A new connection: a pass while it fits under both caps, else
    /// which cap it hit.
    pub fn enter(self: &Arc<Gate>) -> Result<Pass, String> {
        if self.total.fetch_add(1, Ordering::AcqRel) >= self.caps.total {
            self.total.fetch_sub(1, Ordering::AcqRel);
            return Err(format!("{} connections open, the most this listener takes", self.caps.total));
        }
        if self.unauthenticated.fetch_add(1, Ordering::AcqRel) >= self.caps.unauthenticated {
            self.unauthenticated.fetch_sub(1, Ordering::AcqRel);
            self.total.fetch_sub(1, Ordering::AcqRel);
            return Err(format!("{} connections still in their handshake, the most this listener allows", self.caps.unauthenticated));
        }
        Ok(Pass { gate: self.clone(), authenticated: false })
    }

    /// Connections open now: (still unauthenticated, total).
    pub fn open(&self) -> (usize, usize) {
        (self.unauthenticated.load(Ordering::Acquire), self.total.load(Ordering::Acquire))
    }
}

/// One connection's place under a [`Gate`]; gives it back when dropped.
#[derive(Debug)]
pub struct Pass {
    gate: Arc<Gate>,
    authenticated: bool,
}

impl Pass {
    /// The connection proved its session: it no longer counts against the
    /// unauthenticated cap.
    pub fn authenticated(&mut self) {
        if !std::mem::replace(&mut self.authenticated, true) {
            self.gate.unauthenticated.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Drop for Pass {
    fn drop(&mut self) {
        self.authenticated();
        self.gate.total.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Streams whose every read and write can be bounded in time.
pub trait Timed {
    /// As the socket's own `set_read_timeout`.
    fn read_timeout(&self, t: Option<Duration>) -> std::io::Result<()>;
    /// As the socket's own `set_write_timeout`.
    fn write_timeout(&self, t: Option<Duration>) -> std::io::Result<()>;
}

impl Timed for std::net::TcpStream {
    fn read_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        self.set_read_timeout(t)
    }
    fn write_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        self.set_write_timeout(t)
    }
}

impl Timed for std::os::unix::net::UnixStream {
    fn read_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        self.set_read_timeout(t)
    }
    fn write_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        self.set_write_timeout(t)
    }
}

/// A stream whose reads and writes all end by one deadline: a peer that
/// trickles a byte at a time cannot stretch a handshake past it.
#[derive(Debug)]
pub struct Deadline<'a, S> {
    s: &'a S,
    until: Instant,
}

impl<'a, S: Timed> Deadline<'a, S> {
    /// Reads and writes of `s` that all end within `within` from now.
    pub fn new(s: &'a S, within: Duration) -> Self {
        Deadline { s, until: Instant::now() + within }
    }

    /// Another handle on the same stream and deadline (one to read, one to write).
    pub fn again(&self) -> Self {
        Deadline { s: self.s, until: self.until }
    }

    fn left(&self) -> std::io::Result<Duration> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "handshake deadline passed"));
        }
        Ok(left)
    }
}

impl<'a, S: Timed> Read for Deadline<'a, S>
where
    &'a S: Read,
{
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.s.read_timeout(Some(self.left()?))?;
        let mut s = self.s;
        s.read(buf)
    }
}

impl<'a, S: Timed> Write for Deadline<'a, S>
where
    &'a S: Write,
{
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.s.write_timeout(Some(self.left()?))?;
        let mut s = self.s;
        s.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let mut s = self.s;
        s.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_sides_derive_the_same_session_and_other_inputs_another() {
        let a = Credential::derive(b"secret", b"ns", b"nc", "src", "dst");
        assert_eq!(a, Credential::derive(b"secret", b"ns", b"nc", "src", "dst"));
        for b in [
            Credential::derive(b"other", b"ns", b"nc", "src", "dst"),
            Credential::derive(b"secret", b"nc", b"ns", "src", "dst"),
            Credential::derive(b"secret", b"ns", b"nc", "dst", "src"),
        ] {
            assert_ne!(a.key(), b.key());
            assert_ne!(a.session, b.session);
        }
        assert!(!format!("{a:?}").contains(&hex(a.key())), "Debug must not print the key");
    }

    #[test]
    fn a_proof_verifies_only_for_its_own_input() {
        let p = mac(b"k", "label", &[b"ab", b"c"]);
        assert!(verify(b"k", "label", &[b"ab", b"c"], &p));
        assert!(!verify(b"k", "label", &[b"a", b"bc"], &p), "parts are length-prefixed");
        assert!(!verify(b"k2", "label", &[b"ab", b"c"], &p));
        assert!(!verify(b"k", "label", &[b"ab", b"c"], &p[..31]));
    }

    #[test]
    fn hex_round_trips_and_refuses_junk() {
        let b = random_bytes::<32>();
        assert_eq!(unhex(&hex(&b), 32).unwrap(), b);
        assert_eq!(unhex(&hex(&b), 31), None, "longer than allowed");
        assert_eq!(unhex("zz", 1), None);
        assert_eq!(unhex("abc", 2), None);
        assert_ne!(random_bytes::<32>(), b);
    }

    #[test]
    fn the_gate_holds_both_caps_and_gives_places_back() {
        let g = Gate::new(ConnectionCaps { unauthenticated: 2, total: 3 });
        let mut a = g.enter().unwrap();
        let _b = g.enter().unwrap();
        assert!(g.enter().unwrap_err().contains("handshake"));
        a.authenticated();
        let _c = g.enter().unwrap();
        assert_eq!(g.open(), (2, 3));
        assert!(g.enter().unwrap_err().contains("3 connections open"));
        drop(a);
        assert_eq!(g.open(), (2, 2));
        let _d = g.enter().unwrap_err();
        assert_eq!(g.open(), (2, 2), "a refused entry leaves the counts as they were");
    }
}
