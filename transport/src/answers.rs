//! The initiator's side of a stream transport's answers (tcp, shm): read
//! by the connection's owner itself from a non-blocking socket, in `poll`
//! and while a write waits for room, so no thread is woken per answer and
//! none is kept per connection.

use crate::TransportError;
use kvwire_core::protocol::{Header, Kind, HEADER_LEN};
use std::io::Read;
use std::os::fd::{AsFd, AsRawFd};
use std::time::{Duration, Instant};

/// What an answer from the destination says.
pub(crate) enum Answer {
    /// Write `seq` placed (or refused, with the reason), answered at `at`
    /// in `bytes` on the link.
    Placed { seq: u64, refused: Option<String>, at: Instant, bytes: u64 },
    /// The stream carried something that is not an answer.
    Garbled(TransportError),
}

/// How the answer stream ended.
#[derive(Debug)]
pub(crate) enum End {
    /// The destination closed it.
    Closed,
    /// Reading it failed.
    Failed(std::io::Error),
}

/// Answer bytes read per system call at most (an `Ack` is a bare header).
const READ: usize = 16 << 10;

/// Answer bytes read and not yet taken (the last answer may be partial),
/// and how the stream ended once it did.
pub(crate) struct Inbox {
    bytes: Vec<u8>,
    buf: Box<[u8]>,
    // Seen and not yet handed on (`ended` stays set: nothing more is read).
    end: Option<End>,
    ended: bool,
}

impl std::fmt::Debug for Inbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inbox").field("bytes", &self.bytes.len()).finish()
    }
}

impl Default for Inbox {
    fn default() -> Inbox {
        Inbox { bytes: Vec::new(), buf: vec![0u8; READ].into_boxed_slice(), end: None, ended: false }
    }
}

impl Inbox {
    /// Reads the answers that arrived on non-blocking `s`, without
    /// waiting, when `read` (the connection is open) and the stream has
    /// not ended. While a write waits for room (`applying` false) nothing
    /// is handed on, as the answers' batches are not sealed yet, and an
    /// ended stream is shut so that write fails at once rather than waking
    /// again. Otherwise: every whole answer read so far, in order, and how
    /// the stream ended, once.
    pub fn pump<S: AsFd>(&mut self, s: &S, read: bool, applying: bool) -> (Vec<Answer>, Option<End>)
    where
        for<'a> &'a S: Read,
    {
        if read && !self.ended {
            self.end = self.read_from(s);
            self.ended = self.end.is_some();
        }
        if !applying {
            if self.end.is_some() {
                let _ = nix::sys::socket::shutdown(s.as_fd().as_raw_fd(), nix::sys::socket::Shutdown::Both);
            }
            return (Vec::new(), None);
        }
        let mut answers = Vec::new();
        let mut at = 0;
        while let Some((a, used)) = parse(&self.bytes[at..]) {
            at += used;
            answers.push(a);
        }
        self.bytes.drain(..at);
        (answers, self.end.take())
    }

    /// Reads what arrived on `s`; how the stream ended, if it did.
    fn read_from(&mut self, mut s: impl Read) -> Option<End> {
        loop {
            match s.read(&mut self.buf) {
                Ok(0) => return Some(End::Closed),
                Ok(n) => {
                    self.bytes.extend_from_slice(&self.buf[..n]);
                    if n < self.buf.len() {
                        return None;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return None,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Some(End::Failed(e)),
            }
        }
    }
}

/// The first whole answer in `b`, and the bytes it took; None while it is
/// not all there.
fn parse(b: &[u8]) -> Option<(Answer, usize)> {
    if b.len() < HEADER_LEN {
        return None;
    }
    let h = match Header::decode(&b[..HEADER_LEN], 0) {
        Ok(h) => h,
        Err(e) => return Some((Answer::Garbled(e.into()), b.len())),
    };
    let end = HEADER_LEN + h.len as usize;
    if b.len() < end {
        return None;
    }
    let a = match h.kind {
        Kind::Ack | Kind::Nack => Answer::Placed {
            seq: h.seq,
            refused: (h.kind == Kind::Nack).then(|| String::from_utf8_lossy(&b[HEADER_LEN..end]).into_owned()),
            at: Instant::now(),
            bytes: end as u64,
        },
        k => Answer::Garbled(TransportError::Refused(format!("unexpected {k:?} frame from destination"))),
    };
    Some((a, end))
}

/// Waits until `s` is readable (or, with `write`, writable too), for at
/// most `timeout` (None: no limit); true when it is.
pub(crate) fn ready(s: impl AsFd, write: bool, timeout: Option<Duration>) -> bool {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let flags = if write { PollFlags::POLLIN | PollFlags::POLLOUT } else { PollFlags::POLLIN };
    let t = timeout.map_or(PollTimeout::NONE, poll_timeout);
    let mut fds = [PollFd::new(s.as_fd(), flags)];
    matches!(poll(&mut fds, t), Ok(n) if n > 0)
}

/// `t` as poll(2)'s millisecond timeout, rounded up: a wait of under a
/// millisecond is a wait, not a spin.
pub(crate) fn poll_timeout(t: Duration) -> nix::poll::PollTimeout {
    nix::poll::PollTimeout::try_from(t.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32).unwrap_or(nix::poll::PollTimeout::MAX)
}
