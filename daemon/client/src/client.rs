//! A client of the local kvwired: what an engine worker links (directly, or
//! through the C ABI). Waiting for flags reads the mapped flag page — no
//! round trip.

use crate::control::*;
use crate::wire::{self, WireError};
use kvwire_transport::flags::{SleepDecl, WaitError};
use kvwire_transport::{FlagTable, HostMem, Tag};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Why a client call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The socket failed or the daemon went away. (Named in the message,
    /// not as a cause: an error chain would print it twice.)
    #[error("daemon connection: {0}")]
    Wire(WireError),
    /// The daemon answered with an error.
    #[error("daemon error {code}: {message}")]
    Daemon {
        /// Numbered code ([`Code`]).
        code: u32,
        /// Message.
        message: String,
    },
    /// The daemon answered something unexpected.
    #[error("unexpected reply: {0}")]
    Unexpected(String),
    /// A flag wait ended without the flag.
    #[error(transparent)]
    Wait(#[from] WaitError),
    /// The flag page could not be mapped.
    #[error("flag page: {0}")]
    FlagPage(String),
}

impl From<WireError> for ClientError {
    fn from(e: WireError) -> ClientError {
        ClientError::Wire(e)
    }
}

/// A transfer the daemon accepted ([`Client::submit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Submitted {
    /// This daemon's slot: wait on its `source_released` before reusing the
    /// source blocks.
    pub slot: u16,
    /// The destination daemon's slot, where its `layer_ready` and
    /// `decoder_usable` flags appear (the slot its prepare returned).
    pub peer_slot: u16,
    /// Bytes the plan moves.
    pub bytes: u64,
    /// Segments of the plan.
    pub segments: u64,
}

/// A connection to the local daemon.
#[derive(Debug)]
pub struct Client {
    sock: UnixStream,
    // Replies are read through a buffer: a reply's length and body in one read.
    reader: Mutex<wire::UnixReader>,
    /// The daemon's node name.
    pub node: String,
    flags: FlagTable,
    /// `notify` samples of waits on the mapped page not yet sent: they go
    /// with the next call (or at drop), never on the wait's own path.
    notified: Mutex<Vec<u64>>,
    /// The daemon takes them unanswered ([`Request::NotifiedQuiet`]).
    quiet_notify: bool,
    spin: WaitSpin,
}

/// How long a wait (on the flag page, or for a reply to a call) polls
/// before it sleeps: one window, and each kind of wait's last length. A thread
/// asleep on an idle core is woken by an interrupt that must first bring
/// the core out of its halt: measured on a 2-vCPU VM, 17-31 µs against
/// 1-2 µs for a core that was busy, a sixth of a 64 KiB transfer's
/// latency. Polling pays only when the flag comes soon, so the window
/// follows the waits, as a kernel's halt polling does: after a wait no
/// longer than the window, the next polls for up to the window; after a
/// longer one, it sleeps at once.
#[derive(Debug)]
struct WaitSpin {
    max_ns: AtomicU64,
    // The last wait of each kind ([`Wait`]), in ns.
    last_ns: [AtomicU64; 2],
}

/// A kind of wait, each followed by its own window ([`WaitSpin`]).
#[derive(Debug, Clone, Copy)]
enum Wait {
    Flag,
    Reply,
}

/// [`WaitSpin`]'s window unless [`Client::set_wait_spin`] says otherwise.
/// kvwire-soak 64 KiB tcp, 1 client: p50 0.18-0.19 ms sleeping at once,
/// 0.15 polling up to 100 or 200 µs; at 1 MiB (waits of 0.7 ms, which
/// then sleep at once) level.
pub const WAIT_SPIN: Duration = Duration::from_micros(200);

impl WaitSpin {
    fn new(max: Duration) -> WaitSpin {
        WaitSpin { max_ns: AtomicU64::new(nanos(max)), last_ns: [AtomicU64::new(0), AtomicU64::new(0)] }
    }

    fn window(&self, w: Wait) -> Duration {
        let max = self.max_ns.load(Ordering::Relaxed);
        Duration::from_nanos(if self.last_ns[w as usize].load(Ordering::Relaxed) <= max { max } else { 0 })
    }

    fn waited(&self, w: Wait, d: Duration) {
        self.last_ns[w as usize].store(nanos(d), Ordering::Relaxed);
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Client {
    /// Connects and maps the daemon's flag page.
    pub fn connect(path: &Path, name: &str) -> Result<Client, ClientError> {
        let sock = UnixStream::connect(path).map_err(|e| WireError::Io { op: "connect", cause: e })?;
        wire::send_unix(&sock, &Request::Hello { client: name.into() }, &[])?;
        let mut reader = wire::UnixReader::new();
        let (body, mut fds) = reader.recv(&sock)?;
        let (node, slots, columns, quiet_notify, sleep_page) = match wire::parse::<Reply>(&body)? {
            Reply::Hello { node, slots, columns, quiet_notify, sleep_page, .. } => (node, slots, columns, quiet_notify, sleep_page),
            Reply::Error { code, message } => return Err(ClientError::Daemon { code, message }),
            other => return Err(ClientError::Unexpected(format!("{other:?}"))),
        };
        let fd = fds.pop().ok_or_else(|| ClientError::FlagPage("hello reply carried no flag page".into()))?;
        let mem = HostMem::from_file_read_only(std::fs::File::from(fd)).map_err(|e| ClientError::FlagPage(e.to_string()))?;
        let mem = Arc::new(mem);
        // This process's waits declare the word they sleep on, so the
        // daemon wakes only words someone sleeps on. Where it cannot
        // (an older daemon, no memfd), every publish wakes.
        let decl = sleep_page.then(SleepDecl::new).and_then(Result::ok);
        let declared = match decl {
            Some(d) => {
                wire::send_unix(&sock, &Request::SleepPage, &[d.mem().fd().as_raw_fd()])?;
                let (body, _) = reader.recv(&sock)?;
                matches!(wire::parse::<Reply>(&body)?, Reply::Recorded).then_some(d)
            }
            None => None,
        };
        let flags = match declared {
            Some(d) => FlagTable::from_mem_declaring(mem, slots, columns, Arc::new(d)),
            None => FlagTable::from_mem(mem, slots, columns),
        }
        .map_err(|e| ClientError::FlagPage(e.to_string()))?;
        Ok(Client { sock, reader: Mutex::new(reader), node, flags, notified: Mutex::new(Vec::new()), quiet_notify, spin: WaitSpin::new(WAIT_SPIN) })
    }

    /// One request, one reply. `notify` samples waiting to go are sent
    /// with it, pipelined: the request pays no extra round trip. Taken
    /// unanswered, they go just behind it, so the daemon answers the
    /// request before it reads them; answered, just ahead.
    pub fn call(&self, req: &Request, fds: &[std::os::fd::RawFd]) -> Result<Reply, ClientError> {
        let notify_ns = std::mem::take(&mut *self.notified.lock().expect("notified lock"));
        if notify_ns.is_empty() {
            return self.call_now(req, fds);
        }
        if self.quiet_notify {
            let notified = Request::NotifiedQuiet { notify_ns };
            match fds.is_empty() {
                // One message for both (one system call here and there).
                true => wire::send_unix_both(&self.sock, req, &notified)?,
                false => {
                    wire::send_unix(&self.sock, req, fds)?;
                    wire::send_unix(&self.sock, &notified, &[])?;
                }
            }
            return self.reply();
        }
        wire::send_unix(&self.sock, &Request::Notified { notify_ns }, &[])?;
        wire::send_unix(&self.sock, req, fds)?;
        // Recorded, or an older daemon's refusal of a request it does not
        // know: either way the samples are done with.
        self.recv()?;
        self.reply()
    }

    /// Sends the `notify` samples of earlier waits now. A daemon that does
    /// not take them (an older one) is not an error: they are dropped.
    pub fn send_notified(&self) -> Result<(), ClientError> {
        let notify_ns = std::mem::take(&mut *self.notified.lock().expect("notified lock"));
        if notify_ns.is_empty() {
            return Ok(());
        }
        if self.quiet_notify {
            return Ok(wire::send_unix(&self.sock, &Request::NotifiedQuiet { notify_ns }, &[])?);
        }
        match self.call_now(&Request::Notified { notify_ns }, &[]) {
            Ok(_) | Err(ClientError::Daemon { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn call_now(&self, req: &Request, fds: &[std::os::fd::RawFd]) -> Result<Reply, ClientError> {
        wire::send_unix(&self.sock, req, fds)?;
        self.reply()
    }

    fn recv(&self) -> Result<(Vec<u8>, Vec<std::os::fd::OwnedFd>), WireError> {
        let mut reader = self.reader.lock().expect("reader lock");
        if reader.buffered() > 0 {
            return reader.recv(&self.sock);
        }
        // Nothing here yet: poll the socket first, as a flag wait polls its word.
        let started = Instant::now();
        kvwire_transport::idle::poll_readable(&self.sock, self.spin.window(Wait::Reply));
        let got = reader.recv(&self.sock);
        self.spin.waited(Wait::Reply, started.elapsed());
        got
    }

    fn reply(&self) -> Result<Reply, ClientError> {
        let (body, _) = self.recv()?;
        match wire::parse::<Reply>(&body)? {
            Reply::Error { code, message } => Err(ClientError::Daemon { code, message }),
            r => Ok(r),
        }
    }

    /// Registers one rank's cache held in `mem` (regions back to back, in layout order).
    pub fn register(&self, r: RegisterCache, mem: &HostMem) -> Result<(u32, u64, bool), ClientError> {
        match self.call(&Request::RegisterCache(r), &[mem.fd().as_raw_fd()])? {
            Reply::Registered { regions, bytes, complete } => Ok((regions, bytes, complete)),
            other => Err(ClientError::Unexpected(format!("{other:?}"))),
        }
    }

    /// Registers one rank's cache held in the engine's own tensors; `mems`
    /// are the memories (memfds) the tensors' `memory` indices name, in order.
    pub fn register_tensors(&self, r: RegisterTensors, mems: &[std::os::fd::BorrowedFd<'_>]) -> Result<(u32, u64, bool), ClientError> {
        let fds: Vec<_> = mems.iter().map(|f| f.as_raw_fd()).collect();
        match self.call(&Request::RegisterTensors(r), &fds)? {
            Reply::Registered { regions, bytes, complete } => Ok((regions, bytes, complete)),
            other => Err(ClientError::Unexpected(format!("{other:?}"))),
        }
    }

    /// Registers one rank's cache held in the engine's own tensors in
    /// device memory; `fds` travel with it, one per allocation in order
    /// (the stand-in backend's memfds, or CUDA dmabuf fds), or none.
    pub fn register_device_tensors(&self, r: RegisterDeviceTensors, fds: &[std::os::fd::BorrowedFd<'_>]) -> Result<(u32, u64, bool), ClientError> {
        let fds: Vec<_> = fds.iter().map(|f| f.as_raw_fd()).collect();
        match self.call(&Request::RegisterDeviceTensors(r), &fds)? {
            Reply::Registered { regions, bytes, complete } => Ok((regions, bytes, complete)),
            other => Err(ClientError::Unexpected(format!("{other:?}"))),
        }
    }

    /// Registers one rank's cache held in device memory; `fd` travels with
    /// it: the stand-in backend's memfd, or a CUDA allocation's dmabuf fd.
    pub fn register_device(&self, r: RegisterDeviceCache, fd: Option<std::os::fd::BorrowedFd<'_>>) -> Result<(u32, u64, bool), ClientError> {
        let fds: Vec<_> = fd.iter().map(|f| f.as_raw_fd()).collect();
        match self.call(&Request::RegisterDeviceCache(r), &fds)? {
            Reply::Registered { regions, bytes, complete } => Ok((regions, bytes, complete)),
            other => Err(ClientError::Unexpected(format!("{other:?}"))),
        }
    }

    /// Prepares to receive; returns the slot whose flags to wait on.
    pub fn prepare(&self, p: PrepareReceive) -> Result<u16, ClientError> {
        self.prepare_announced(p).map(|(slot, _)| slot)
    }

    /// Prepares to receive; returns the slot, and, when the prepare named
    /// a source, whether that source was told ahead or why not.
    pub fn prepare_announced(&self, p: PrepareReceive) -> Result<(u16, Option<Result<(), String>>), ClientError> {
        match self.call(&Request::PrepareReceive(p), &[])? {
            Reply::Prepared { slot, announce } => Ok((slot, announce)),
            other => Err(ClientError::Unexpected(format!("{other:?}"))),
        }
    }

    /// Submits a transfer; the daemon has planned it and started moving.
    pub fn submit(&self, s: Submit) -> Result<Submitted, ClientError> {
        match self.call(&Request::Submit(s), &[])? {
            Reply::Submitted { slot, peer_slot, bytes, segments } => Ok(Submitted { slot, peer_slot, bytes, segments }),
            other => Err(ClientError::Unexpected(format!("{other:?}"))),
        }
    }

    /// Waits on the mapped flag page; returns the notify hop, which the
    /// daemon records in its `notify` histogram (sent with the next call).
    pub fn wait(&self, slot: u16, flag: FlagName, timeout: Duration) -> Result<Duration, ClientError> {
        let started = Instant::now();
        let waited = self.flags.wait_spinning(Tag { slot, layer: flag.column() }, timeout, self.spin.window(Wait::Flag));
        self.spin.waited(Wait::Flag, started.elapsed());
        let d = waited?;
        let full = {
            let mut n = self.notified.lock().expect("notified lock");
            n.push(nanos(d));
            n.len() >= MAX_NOTIFIED
        };
        // Rare (that many waits and no other call): this wait pays the trip.
        if full {
            self.send_notified()?;
        }
        Ok(d)
    }

    /// The longest a [`Client::wait`] polls the flag page, and a call polls
    /// for its reply, before it sleeps (each polls only while its kind of
    /// wait has been that short; [`WAIT_SPIN`] unless set). Zero: every
    /// wait sleeps at once.
    pub fn set_wait_spin(&self, max: Duration) {
        self.spin.max_ns.store(nanos(max), Ordering::Relaxed);
    }

    /// The flag, read from the page without waiting.
    pub fn ready(&self, slot: u16, flag: FlagName) -> bool {
        self.flags.ready(Tag { slot, layer: flag.column() }).is_some()
    }

    /// A transfer's state.
    pub fn status(&self, slot: u16) -> Result<TransferStatus, ClientError> {
        match self.call(&Request::Status { slot }, &[])? {
            Reply::Status(s) => Ok(s),
            other => Err(ClientError::Unexpected(format!("{other:?}"))),
        }
    }

    /// Cancels a transfer.
    pub fn cancel(&self, slot: u16) -> Result<(), ClientError> {
        self.call(&Request::Cancel { slot }, &[]).map(|_| ())
    }

    /// Says layers `0..layers` of `request` on `rank` of `group` are
    /// written: a streamed submit moves them (see [`Request::Produced`]).
    pub fn produced(&self, group: &str, request: &str, rank: u32, layers: u16) -> Result<(), ClientError> {
        self.call(&Request::Produced { group: group.into(), request: request.into(), rank, layers }, &[]).map(|_| ())
    }

    /// Joins (or creates) the sharing of `group` under `token`, before
    /// registering a rank of a group other clients register ranks of.
    pub fn share_group(&self, group: &str, token: &str) -> Result<(), ClientError> {
        self.call(&Request::ShareGroup { group: group.into(), token: token.into() }, &[]).map(|_| ())
    }

    /// Releases a rank's cache.
    pub fn release(&self, group: &str, rank: u32) -> Result<(), ClientError> {
        self.call(&Request::ReleaseCache { group: group.into(), rank }, &[]).map(|_| ())
    }

    /// The daemon's Prometheus text.
    pub fn stats(&self) -> Result<String, ClientError> {
        match self.call(&Request::Stats, &[])? {
            Reply::Stats { text } => Ok(text),
            other => Err(ClientError::Unexpected(format!("{other:?}"))),
        }
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        // Best effort: the daemon may be gone already.
        let _ = self.send_notified();
    }
}

#[cfg(test)]
mod tests {
    use super::{Wait, WaitSpin, WAIT_SPIN};
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    #[test]
    fn a_wait_polls_only_after_waits_no_longer_than_the_window() {
        let s = WaitSpin::new(WAIT_SPIN);
        assert_eq!(s.window(Wait::Flag), WAIT_SPIN, "the first wait polls");
        s.waited(Wait::Flag, WAIT_SPIN / 2);
        assert_eq!(s.window(Wait::Flag), WAIT_SPIN);
        s.waited(Wait::Flag, WAIT_SPIN * 3);
        assert_eq!(s.window(Wait::Flag), Duration::ZERO, "after a long wait the next sleeps at once");
        assert_eq!(s.window(Wait::Reply), WAIT_SPIN, "each kind of wait follows its own");
        s.waited(Wait::Flag, WAIT_SPIN);
        assert_eq!(s.window(Wait::Flag), WAIT_SPIN, "a short one brings polling back");
        s.max_ns.store(0, Ordering::Relaxed);
        s.waited(Wait::Flag, Duration::ZERO);
        assert_eq!(s.window(Wait::Flag), Duration::ZERO, "a zero window never polls");
        assert_eq!(s.window(Wait::Reply), Duration::ZERO, "one window for both kinds");
    }
}
