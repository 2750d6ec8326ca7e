//! What an outsider or a misbehaving local client can do to one real
//! kvwired, and what it must not be able to: each test runs the daemon,
//! does the hostile thing, and judges the outcome (fds back to where they
//! were, the reason named, the next client served).

use kvwire_client::client::Client;
use kvwire_testkit::{start_daemon, TempDir};
use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
use std::io::{IoSlice, Read};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

const SECRET: &str = "a-secret-of-at-least-16-bytes";

/// Open descriptors of process `pid`.
fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0)
}

/// Waits (bounded) until `pid` holds `want` descriptors; returns the last count.
fn settle(pid: u32, want: usize) -> usize {
    let mut n = fds(pid);
    for _ in 0..200 {
        if n == want {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
        n = fds(pid);
    }
    n
}

#[test]
fn a_control_message_with_too_many_fds_leaks_none_of_them() {
    let dir = TempDir::new("hostile-fds");
    let d = start_daemon(dir.path(), "h", SECRET, &[], "");
    // A client connected first, so the count below is of a serving daemon.
    let c = Client::connect(&d.socket, "first").unwrap();
    let before = fds(d.pid());
    let files: Vec<std::fs::File> = (0..12).map(|_| std::fs::File::open("/dev/null").unwrap()).collect();
    let raw: Vec<RawFd> = files.iter().map(|f| f.as_raw_fd()).collect();
    for round in 0..5 {
        let s = UnixStream::connect(&d.socket).unwrap();
        let body = br#"{"op":"stats"}"#;
        let mut frame = (body.len() as u32).to_le_bytes().to_vec();
        frame.extend_from_slice(body);
        let iov = [IoSlice::new(&frame)];
        sendmsg::<()>(s.as_raw_fd(), &iov, &[ControlMessage::ScmRights(&raw)], MsgFlags::empty(), None).unwrap();
        // The daemon answers with the reason (or closes), and drops them all.
        let mut len = [0u8; 4];
        let _ = (&s).read_exact(&mut len);
        let mut reply = vec![0u8; u32::from_le_bytes(len) as usize];
        let _ = (&s).read_exact(&mut reply);
        let reply = String::from_utf8_lossy(&reply).into_owned();
        assert!(reply.contains("descriptors"), "round {round}: {reply}");
    }
    // Every refused message's descriptors were closed; the connections too.
    let after = settle(d.pid(), before);
    assert_eq!(after, before, "descriptors held after refusing 5 messages of 12 fds");
    // And the daemon still serves.
    assert!(c.stats().unwrap().contains("kvwire_"));
    assert!(Client::connect(&d.socket, "next").is_ok());
}
