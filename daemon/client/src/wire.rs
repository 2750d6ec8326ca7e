//! Message framing for the control socket and the peer connection:
//! a little-endian u32 length, then that many bytes of JSON. On the Unix
//! control socket a message may carry file descriptors (SCM_RIGHTS), sent
//! with its first byte.

use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};
use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

/// Largest message accepted (block tables of a million blocks fit).
pub const MAX_MESSAGE: usize = 16 << 20;
/// Most descriptors one message may carry: a rank's engine tensors may each
/// live in their own memfd (one per layer); more layers than this share memfds.
pub const MAX_FDS: usize = 128;

/// Why a message could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The peer closed the connection between messages.
    #[error("connection closed")]
    Closed,
    /// A socket error. The OS error is part of the message, not a
    /// separate cause, so an error chain names it once.
    #[error("{op}: {cause}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The OS error.
        cause: std::io::Error,
    },
    /// Length beyond [`MAX_MESSAGE`].
    #[error("message of {0} bytes exceeds the {MAX_MESSAGE}-byte limit")]
    TooLong(usize),
    /// More descriptors than [`MAX_FDS`], or descriptors where none belong.
    #[error("{0}")]
    Fds(String),
    /// Not the JSON expected.
    #[error("malformed message: {0}")]
    Json(String),
    /// A peer message refused before or as it was parsed (its seal, its
    /// size before authentication, its binary form): the text says which.
    #[error("{0}")]
    Peer(String),
}

impl WireError {
    /// Whether a read timeout (SO_RCVTIMEO) ended the wait: the peer went
    /// silent, rather than away.
    pub fn is_timeout(&self) -> bool {
        matches!(self, WireError::Io { cause, .. } if matches!(cause.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut))
    }
}

fn io(op: &'static str) -> impl Fn(std::io::Error) -> WireError {
    move |cause| WireError::Io { op, cause }
}

/// Encodes `msg` as one frame.
pub fn frame<T: serde::Serialize>(msg: &T) -> Vec<u8> {
    let body = serde_json::to_vec(msg).expect("messages serialize");
    let mut out = Vec::with_capacity(body.len() + 4);
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    out
}

/// Parses a frame body.
pub fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, WireError> {
    serde_json::from_slice(body).map_err(|e| WireError::Json(e.to_string()))
}

/// Writes one frame to a byte stream (peer connections).
pub fn write_msg<T: serde::Serialize>(w: &mut impl Write, msg: &T) -> Result<(), WireError> {
    w.write_all(&frame(msg)).map_err(io("send"))?;
    w.flush().map_err(io("send"))
}

/// Reads one frame from a byte stream.
pub fn read_msg<T: serde::de::DeserializeOwned>(r: &mut impl Read) -> Result<T, WireError> {
    parse(&read_body(r, MAX_MESSAGE, WireError::TooLong)?)
}

/// Reads one frame's body: a u32 length, then that many bytes. A length
/// over `max` is refused with `too_long(length)` before anything is
/// allocated for it.
pub fn read_body(r: &mut impl Read, max: usize, too_long: impl FnOnce(usize) -> WireError) -> Result<Vec<u8>, WireError> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(WireError::Closed),
        Err(e) => return Err(io("receive")(e)),
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(too_long(len));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).map_err(io("receive"))?;
    Ok(body)
}

/// Sends one frame on a Unix socket, with `fds` attached.
pub fn send_unix<T: serde::Serialize>(s: &UnixStream, msg: &T, fds: &[RawFd]) -> Result<(), WireError> {
    send_unix_bytes(s, &frame(msg), fds)
}

/// Sends two frames on a Unix socket in one message, carrying no
/// descriptors (a reader gives descriptors to the frame that ends its
/// read, which here could be either).
pub fn send_unix_both<T: serde::Serialize, U: serde::Serialize>(s: &UnixStream, first: &T, then: &U) -> Result<(), WireError> {
    let mut bytes = frame(first);
    bytes.extend_from_slice(&frame(then));
    send_unix_bytes(s, &bytes, &[])
}

/// Sends one frame on a Unix socket, carrying no descriptors, unless
/// the socket has no room for any of it now: then nothing is sent and the
/// answer is `false`. A frame begun is finished, waiting if it must.
pub fn try_send_unix<T: serde::Serialize>(s: &UnixStream, msg: &T) -> Result<bool, WireError> {
    let bytes = frame(msg);
    let iov = [IoSlice::new(&bytes)];
    match sendmsg::<()>(s.as_raw_fd(), &iov, &[], MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT, None) {
        Ok(n) => send_unix_from(s, &bytes, &[], n).map(|()| true),
        Err(nix::errno::Errno::EAGAIN) => Ok(false),
        Err(e) => Err(WireError::Io { op: "sendmsg", cause: e.into() }),
    }
}

fn send_unix_bytes(s: &UnixStream, bytes: &[u8], fds: &[RawFd]) -> Result<(), WireError> {
    send_unix_from(s, bytes, fds, 0)
}

/// Sends `bytes` from offset `sent` on; `fds` go with the first byte.
fn send_unix_from(s: &UnixStream, bytes: &[u8], fds: &[RawFd], mut sent: usize) -> Result<(), WireError> {
    while sent < bytes.len() {
        let iov = [IoSlice::new(&bytes[sent..])];
        let cmsg = [ControlMessage::ScmRights(fds)];
        let cmsgs: &[ControlMessage<'_>] = if sent == 0 && !fds.is_empty() { &cmsg } else { &[] };
        let n = sendmsg::<()>(s.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None)
            .map_err(|e| WireError::Io { op: "sendmsg", cause: e.into() })?;
        sent += n;
    }
    Ok(())
}

/// The most descriptors Linux passes in one message.
const SCM_MAX_FD: usize = 253;

/// Room for that many descriptors' control message, aligned as a
/// `cmsghdr`. On the stack: allocated per read it was over 1 KiB, a size
/// that made the allocator consolidate its free lists at every message.
#[repr(C, align(8))]
struct CmsgSpace([u8; CMSG_BYTES]);

const CMSG_BYTES: usize = nix::sys::socket::cmsg_space::<[RawFd; SCM_MAX_FD]>();

/// Reads frames from a Unix socket through a buffer: a frame's length and
/// body, and what was sent right behind it, come in one system call
/// rather than two or more per frame.
///
/// Descriptors belong to the frame that holds the last byte of the read
/// that brought them. The kernel hands descriptors over with the bytes of
/// the send they came with and ends that read there, and a sender attaches
/// them to the first send of its frame.
#[derive(Debug)]
pub struct UnixReader {
    buf: Vec<u8>,
    // Unread bytes are buf[start..end].
    start: usize,
    end: usize,
    // Stream offset of buf[0].
    base: u64,
    // Descriptors not yet handed out, with the stream offset of the last
    // byte of the read that brought them.
    fds: Vec<(u64, OwnedFd)>,
    // Reads only what the frame in hand still needs, never past it.
    exact: bool,
}

/// Room a reader starts with: a request, and what follows it, in one read.
const READ_ROOM: usize = 16 << 10;

impl UnixReader {
    /// Bytes read and not yet handed out.
    pub fn buffered(&self) -> usize {
        self.end - self.start
    }

    /// A reader of a connection that it alone reads from now on.
    pub fn new() -> UnixReader {
        UnixReader { buf: vec![0; READ_ROOM], start: 0, end: 0, base: 0, fds: Vec::new(), exact: false }
    }

    /// A reader that never takes bytes past the frame it returns, for a
    /// connection read once here and then elsewhere.
    fn exact() -> UnixReader {
        UnixReader { buf: Vec::new(), exact: true, ..UnixReader::new() }
    }

    /// The next frame, with the descriptors it carried.
    pub fn recv(&mut self, s: &UnixStream) -> Result<(Vec<u8>, Vec<OwnedFd>), WireError> {
        self.fill(s, 4)?;
        let len = u32::from_le_bytes(self.buf[self.start..self.start + 4].try_into().expect("four bytes")) as usize;
        if len > MAX_MESSAGE {
            return Err(WireError::TooLong(len));
        }
        self.fill(s, 4 + len)?;
        let body = self.buf[self.start + 4..self.start + 4 + len].to_vec();
        self.start += 4 + len;
        let last = self.base + self.start as u64 - 1;
        let mut fds = Vec::new();
        if !self.fds.is_empty() {
            let later;
            (fds, later) = std::mem::take(&mut self.fds).into_iter().partition(|(at, _)| *at <= last);
            self.fds = later;
        }
        if self.start == self.end {
            self.base += self.end as u64;
            (self.start, self.end) = (0, 0);
            // A large frame's room goes with it.
            if self.buf.len() > READ_ROOM && !self.exact {
                self.buf = vec![0; READ_ROOM];
            }
        }
        if fds.len() > MAX_FDS {
            return Err(WireError::Fds(format!("{} descriptors, at most {MAX_FDS}", fds.len())));
        }
        Ok((body, fds.into_iter().map(|(_, fd)| fd).collect()))
    }

    /// Reads until `want` unread bytes are buffered.
    fn fill(&mut self, s: &UnixStream, want: usize) -> Result<(), WireError> {
        if self.start + want > self.buf.len() {
            // Unread bytes to the front, then room for the whole frame.
            self.buf.copy_within(self.start..self.end, 0);
            self.base += self.start as u64;
            (self.start, self.end) = (0, self.end - self.start);
            if want > self.buf.len() {
                self.buf.resize(want, 0);
            }
        }
        while self.end - self.start < want {
            let room = match self.exact {
                true => self.start + want,
                false => self.buf.len(),
            };
            // Room for as many descriptors as the kernel passes in one
            // message (SCM_MAX_FD): a message with too many is then never
            // truncated, so every descriptor it brought is adopted below
            // and closed with it.
            let mut space = CmsgSpace([0; CMSG_BYTES]);
            let mut iov = [IoSliceMut::new(&mut self.buf[self.end..room])];
            let msg = recvmsg::<()>(s.as_raw_fd(), &mut iov, Some(&mut space.0), MsgFlags::MSG_CMSG_CLOEXEC)
                .map_err(|e| WireError::Io { op: "recvmsg", cause: e.into() })?;
            let last = self.base + (self.end + msg.bytes) as u64;
            for c in msg.cmsgs().map_err(|e| WireError::Io { op: "recvmsg", cause: e.into() })? {
                if let ControlMessageOwned::ScmRights(raw) = c {
                    for fd in raw {
                        // SAFETY: the kernel just installed `fd` in this process
                        // for this message; nothing else owns it.
                        self.fds.push((last.saturating_sub(1), unsafe { OwnedFd::from_raw_fd(fd) }));
                    }
                }
            }
            // Only the frame in hand and the one behind it hold any: more
            // than twice the most one may carry is refused outright.
            if msg.flags.contains(MsgFlags::MSG_CTRUNC) || self.fds.len() > 2 * MAX_FDS {
                return Err(WireError::Fds(format!("more than {MAX_FDS} descriptors in one message")));
            }
            if msg.bytes == 0 {
                return Err(match self.start == self.end {
                    true => WireError::Closed,
                    false => WireError::Io { op: "recvmsg", cause: std::io::ErrorKind::UnexpectedEof.into() },
                });
            }
            self.end += msg.bytes;
        }
        Ok(())
    }
}

impl Default for UnixReader {
    fn default() -> UnixReader {
        UnixReader::new()
    }
}

/// Receives one frame from a Unix socket, with the descriptors it carried,
/// reading nothing past it.
pub fn recv_unix(s: &UnixStream) -> Result<(Vec<u8>, Vec<OwnedFd>), WireError> {
    UnixReader::exact().recv(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn memfd(name: &str) -> OwnedFd {
        let f = nix::sys::memfd::memfd_create(name, nix::sys::memfd::MFdFlags::MFD_CLOEXEC).unwrap();
        OwnedFd::from(f)
    }

    fn same_file(a: &OwnedFd, b: &OwnedFd) -> bool {
        let (x, y) = (nix::sys::stat::fstat(a).unwrap(), nix::sys::stat::fstat(b).unwrap());
        (x.st_dev, x.st_ino) == (y.st_dev, y.st_ino)
    }

    #[test]
    fn frames_sent_back_to_back_come_in_one_read_each_with_its_own_descriptors() {
        let (a, b) = UnixStream::pair().unwrap();
        let (f1, f2) = (memfd("one"), memfd("two"));
        send_unix(&a, &"first", &[]).unwrap();
        send_unix(&a, &"second", &[f1.as_raw_fd(), f2.as_raw_fd()]).unwrap();
        send_unix(&a, &"third", &[]).unwrap();
        let mut r = UnixReader::new();
        let (body, fds) = r.recv(&b).unwrap();
        assert_eq!((parse::<String>(&body).unwrap(), fds.len()), ("first".into(), 0));
        let (body, fds) = r.recv(&b).unwrap();
        assert_eq!(parse::<String>(&body).unwrap(), "second");
        assert!(fds.len() == 2 && same_file(&fds[0], &f1) && same_file(&fds[1], &f2));
        let (body, fds) = r.recv(&b).unwrap();
        assert_eq!((parse::<String>(&body).unwrap(), fds.len()), ("third".into(), 0));
        // The end between frames is a close.
        drop(a);
        assert!(matches!(r.recv(&b), Err(WireError::Closed)));
    }

    #[test]
    fn a_frame_larger_than_the_room_is_read_whole_and_the_next_after_it() {
        let (a, b) = UnixStream::pair().unwrap();
        let big = "x".repeat(3 * READ_ROOM + 5);
        let writer = {
            let (a, big) = (a.try_clone().unwrap(), big.clone());
            std::thread::spawn(move || {
                send_unix(&a, &big, &[]).unwrap();
                send_unix(&a, &"after", &[]).unwrap();
            })
        };
        let mut r = UnixReader::new();
        assert_eq!(parse::<String>(&r.recv(&b).unwrap().0).unwrap(), big);
        assert_eq!(parse::<String>(&r.recv(&b).unwrap().0).unwrap(), "after");
        writer.join().unwrap();
    }

    #[test]
    fn two_frames_sent_as_one_message_are_read_as_two() {
        let (a, b) = UnixStream::pair().unwrap();
        send_unix_both(&a, &"request", &"samples").unwrap();
        let mut r = UnixReader::new();
        assert_eq!(parse::<String>(&r.recv(&b).unwrap().0).unwrap(), "request");
        assert_eq!(parse::<String>(&r.recv(&b).unwrap().0).unwrap(), "samples");
    }

    #[test]
    fn one_frame_read_alone_leaves_the_next_on_the_socket() {
        let (a, b) = UnixStream::pair().unwrap();
        send_unix(&a, &"first", &[]).unwrap();
        send_unix(&a, &"second", &[]).unwrap();
        assert_eq!(parse::<String>(&recv_unix(&b).unwrap().0).unwrap(), "first");
        assert_eq!(parse::<String>(&UnixReader::new().recv(&b).unwrap().0).unwrap(), "second");
    }

    #[test]
    fn a_cut_frame_and_an_overlong_length_are_errors_naming_what_was_wrong() {
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(&10u32.to_le_bytes()).unwrap();
        a.write_all(b"abc").unwrap();
        drop(a);
        let e = UnixReader::new().recv(&b).unwrap_err();
        assert!(matches!(&e, WireError::Io { op: "recvmsg", cause } if cause.kind() == std::io::ErrorKind::UnexpectedEof), "{e}");
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(&((MAX_MESSAGE + 1) as u32).to_le_bytes()).unwrap();
        assert!(matches!(UnixReader::new().recv(&b), Err(WireError::TooLong(n)) if n == MAX_MESSAGE + 1));
    }

    #[test]
    fn a_try_send_to_a_full_socket_sends_nothing_and_a_later_one_goes_whole() {
        let (a, b) = UnixStream::pair().unwrap();
        // Fill a's way to b with frames until no more fit now.
        let mut queued = 0;
        while try_send_unix(&a, &"filler").unwrap() {
            queued += 1;
            assert!(queued < 1_000_000, "the socket never filled");
        }
        assert!(queued > 0);
        let mut r = UnixReader::new();
        for _ in 0..queued {
            assert_eq!(parse::<String>(&r.recv(&b).unwrap().0).unwrap(), "filler");
        }
        // Nothing of the refused frame went: the next read is the next frame.
        assert!(try_send_unix(&a, &"after").unwrap());
        assert_eq!(parse::<String>(&r.recv(&b).unwrap().0).unwrap(), "after");
    }
}
