//! Polling a connection for its next message before a read sleeps on it.

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

/// A connection's serving thread polls its socket before it sleeps on it,
/// for up to a window, while the connection's last idle gap was no longer
/// than the window: a thread asleep on an idle core is woken by an
/// interrupt that costs the sender a VM exit and the woken core tens of
/// microseconds to come out of its halt on a virtual machine, against a
/// poll's one. Gaps of a few microseconds (the next segment of a write
/// still on its way) do not count as idle: after a transfer, the gap
/// before the next one decides. After a gap longer than the window the
/// next read sleeps at once, so an idle connection costs no CPU.
///
/// Worth it only on cores the daemon has to itself (`cpus`): on a core it
/// shares with the sending side, the poller takes time from the thread it
/// waits for.
#[derive(Debug, Clone)]
pub struct IdleSpin {
    window: Duration,
    last_idle: Duration,
}

/// Shorter waits are a message still arriving, not idleness.
const STILL_ARRIVING: Duration = Duration::from_micros(20);

impl IdleSpin {
    /// Polls for up to `window` (zero: never).
    pub fn new(window: Duration) -> IdleSpin {
        IdleSpin { window, last_idle: Duration::ZERO }
    }

    /// Whether the next wait polls first.
    pub fn polls(&self) -> bool {
        !self.window.is_zero() && self.last_idle <= self.window
    }

    /// Runs `read`, which blocks until `s` has input, after polling `s`
    /// for it (yielding the core between looks) if [`IdleSpin::polls`];
    /// notes how long the connection was idle.
    pub fn idle<T>(&mut self, s: impl AsFd, read: impl FnOnce() -> T) -> T {
        // Never polls: no gap to time (the default, unpinned).
        if self.window.is_zero() {
            return read();
        }
        let started = Instant::now();
        if self.polls() {
            poll_readable(&s, self.window);
        }
        let r = read();
        self.waited(started.elapsed());
        r
    }

    /// Notes a wait of `d` for input.
    pub fn waited(&mut self, d: Duration) {
        if d > STILL_ARRIVING {
            self.last_idle = d;
        }
    }
}

/// Polls `s` for input, yielding the core between looks, until it is
/// readable or `window` passed.
pub fn poll_readable(s: impl AsFd, window: Duration) {
    let started = Instant::now();
    while started.elapsed() < window && !readable_now(&s) {
        std::thread::yield_now();
    }
}

/// Whether `s` has input (or an error or hang-up to read) now, without
/// waiting.
pub fn readable_now(s: impl AsFd) -> bool {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let mut fds = [PollFd::new(s.as_fd(), PollFlags::POLLIN)];
    !matches!(poll(&mut fds, PollTimeout::ZERO), Ok(0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::net::UnixStream;

    #[test]
    fn a_long_gap_stops_the_polling_and_a_short_one_brings_it_back() {
        let mut s = IdleSpin::new(Duration::from_micros(200));
        assert!(s.polls());
        s.waited(Duration::from_millis(5));
        assert!(!s.polls(), "after a gap past the window the next wait sleeps at once");
        // A segment still arriving says nothing about the gaps.
        s.waited(Duration::from_micros(5));
        assert!(!s.polls());
        s.waited(Duration::from_micros(150));
        assert!(s.polls());
        assert!(!IdleSpin::new(Duration::ZERO).polls(), "a zero window never polls");
    }

    #[test]
    fn input_already_there_is_read_at_once() {
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(b"x").unwrap();
        let mut s = IdleSpin::new(Duration::from_secs(3600));
        let got = s.idle(&b, || {
            let mut buf = [0u8; 1];
            std::io::Read::read(&mut &b, &mut buf).unwrap();
            buf[0]
        });
        assert_eq!(got, b'x');
    }
}
