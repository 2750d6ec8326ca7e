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
    let bytes = frame(msg);
    let mut sent = 0;
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

/// Reads exactly `buf.len()` bytes, collecting any descriptors that arrive.
fn recv_exact(s: &UnixStream, buf: &mut [u8], fds: &mut Vec<OwnedFd>, first: bool) -> Result<(), WireError> {
    let mut got = 0;
    while got < buf.len() {
        // Room for as many descriptors as the kernel passes in one message
        // (SCM_MAX_FD): a message with too many is then never truncated, so
        // every descriptor it brought is adopted below and closed with it.
        let mut space = CmsgSpace([0; CMSG_BYTES]);
        let mut iov = [IoSliceMut::new(&mut buf[got..])];
        let msg = recvmsg::<()>(s.as_raw_fd(), &mut iov, Some(&mut space.0), MsgFlags::MSG_CMSG_CLOEXEC)
            .map_err(|e| WireError::Io { op: "recvmsg", cause: e.into() })?;
        for c in msg.cmsgs().map_err(|e| WireError::Io { op: "recvmsg", cause: e.into() })? {
            if let ControlMessageOwned::ScmRights(raw) = c {
                for fd in raw {
                    // SAFETY: the kernel just installed `fd` in this process
                    // for this message; nothing else owns it.
                    fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                }
            }
        }
        if msg.flags.contains(MsgFlags::MSG_CTRUNC) || fds.len() > MAX_FDS {
            return Err(WireError::Fds(format!("more than {MAX_FDS} descriptors in one message")));
        }
        if msg.bytes == 0 {
            return Err(if first && got == 0 { WireError::Closed } else { WireError::Io { op: "recvmsg", cause: std::io::ErrorKind::UnexpectedEof.into() } });
        }
        got += msg.bytes;
    }
    Ok(())
}

/// Receives one frame from a Unix socket, with the descriptors it carried.
pub fn recv_unix(s: &UnixStream) -> Result<(Vec<u8>, Vec<OwnedFd>), WireError> {
    let mut fds = Vec::new();
    let mut len = [0u8; 4];
    recv_exact(s, &mut len, &mut fds, true)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_MESSAGE {
        return Err(WireError::TooLong(len));
    }
    let mut body = vec![0u8; len];
    recv_exact(s, &mut body, &mut fds, false)?;
    if fds.len() > MAX_FDS {
        return Err(WireError::Fds(format!("{} descriptors, at most {MAX_FDS}", fds.len())));
    }
    Ok((body, fds))
}
