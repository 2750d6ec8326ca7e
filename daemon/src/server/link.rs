//! The source's peer-control connection for one transfer: the pump of its
//! [`SourceSession`]. While bytes flow a heartbeat (a check on the daemon's
//! ticker) pings the destination when the session says a ping is due, so
//! the destination can tell a dead source from a slow one, and an
//! unanswered ping marks the destination lost.

use super::announce::{AnnounceBook, Heard};
use crate::config::PeerConfig;
use crate::peer::Sealed;
use kvwire_core::session::msg::PeerMsg;
use kvwire_core::session::{SessionError, SourceEvent, SourceSession};
use kvwire_transport::Credential;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, TryLockError};
use std::time::{Duration, Instant};

/// Why an exchange with the destination failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum LinkError {
    /// The connection failed or the destination went quiet.
    #[error("{0}")]
    Wire(String),
    /// The session refused the answer (a refusal, a wrong size, a message out of turn).
    #[error(transparent)]
    Session(#[from] SessionError),
}

pub(super) struct PeerLink {
    // One lock for the stream and the session: a ping and the final
    // message never interleave on the wire. The stream is taken out when
    // the transfer ends well, to serve the next transfer to this peer.
    conn: Mutex<(Option<Sealed>, SourceSession)>,
    /// The connection's data-plane session, which every data connection proves.
    pub credential: Credential,
    pub peer: String,
    /// The peer's control address.
    pub addr: String,
    peer_timeout: Duration,
    lost: Mutex<Option<String>>,
    // Set when the transfer ends here: the heartbeat's next look is its last.
    ended: AtomicBool,
    // A ping is out, on a worker, waiting for its answer.
    pinging: AtomicBool,
    // The connection's frame bytes when this transfer took it, and the
    // transfer's share once it handed the connection back.
    frames_before: u64,
    frames_when_handed_back: AtomicU64,
    // Where announcements the destination sends meanwhile go. Their frames
    // count toward the transfers they announce, not this one's (`others`),
    // and one this transfer claimed or crossed counts here (`ours`).
    book: Arc<AnnounceBook>,
    others: AtomicU64,
    ours: AtomicU64,
}

impl PeerLink {
    pub fn new(stream: Sealed, session: SourceSession, peer: &PeerConfig, peer_timeout: Duration, book: Arc<AnnounceBook>) -> PeerLink {
        let credential = stream.credential().clone();
        let frames_before = stream.frame_bytes();
        PeerLink {
            conn: Mutex::new((Some(stream), session)),
            credential,
            peer: peer.name.clone(),
            addr: peer.address.clone(),
            peer_timeout,
            lost: Mutex::new(None),
            ended: AtomicBool::new(false),
            pinging: AtomicBool::new(false),
            frames_before,
            frames_when_handed_back: AtomicU64::new(0),
            book,
            others: AtomicU64::new(0),
            ours: AtomicU64::new(0),
        }
    }

    /// Bytes of this transfer's control messages both ways (offer,
    /// accept, manifest, layer checksums, pings, done, verdict, abort), as
    /// sealed frames on the wire.
    pub fn control_bytes(&self) -> u64 {
        let frames = match &self.conn.lock().expect("peer link lock").0 {
            Some(s) => s.frame_bytes().saturating_sub(self.frames_before),
            None => return self.frames_when_handed_back.load(Ordering::Acquire),
        };
        (frames + self.ours.load(Ordering::Acquire)).saturating_sub(self.others.load(Ordering::Acquire))
    }

    /// An announcement of this transfer's request, heard before it or
    /// beside its offer: its frame counts toward this transfer.
    pub fn count_announcement(&self, bytes: u64) {
        self.ours.fetch_add(bytes, Ordering::AcqRel);
    }

    /// Sends `m` and hands the answer to the session. Announcements the
    /// destination sent meanwhile (it saw the connection idle) are booked
    /// on the way.
    pub fn exchange(&self, m: &PeerMsg) -> Result<SourceEvent, LinkError> {
        let mut c = self.conn.lock().expect("peer link lock");
        let (s, session) = &mut *c;
        let s = s.as_mut().ok_or_else(|| LinkError::Wire(format!("peer `{}`: the transfer's connection was handed back", self.peer)))?;
        let answer = s.send(m).and_then(|()| loop {
            let before = s.frames_read();
            match s.recv()? {
                PeerMsg::Announce(announce) => {
                    let bytes = s.frames_read() - before;
                    self.others.fetch_add(bytes, Ordering::AcqRel);
                    self.book.note(&self.peer, Heard { session: self.credential.session, bytes, announce });
                }
                other => break Ok(other),
            }
        });
        let answer = answer.map_err(|e| match e {
            e if e.is_timeout() => LinkError::Wire(format!("peer `{}` silent for {}s", self.peer, self.peer_timeout.as_secs())),
            e => LinkError::Wire(format!("peer `{}` went away mid-transfer: {e}", self.peer)),
        })?;
        Ok(session.handle(Instant::now(), answer)?)
    }

    /// Sends `m`, which has no answer.
    pub fn send(&self, m: &PeerMsg) -> Result<(), LinkError> {
        let mut c = self.conn.lock().expect("peer link lock");
        let s = c.0.as_mut().ok_or_else(|| LinkError::Wire(format!("peer `{}`: the transfer's connection was handed back", self.peer)))?;
        s.send(m).map_err(|e| LinkError::Wire(format!("peer `{}` went away mid-transfer: {e}", self.peer)))
    }

    /// Seals `m` to leave with the next message sent ([`Sealed::hold`]).
    pub fn hold(&self, m: &PeerMsg) -> Result<(), LinkError> {
        let mut c = self.conn.lock().expect("peer link lock");
        let s = c.0.as_mut().ok_or_else(|| LinkError::Wire(format!("peer `{}`: the transfer's connection was handed back", self.peer)))?;
        s.hold(m);
        Ok(())
    }

    /// Runs `f` on the session (for steps that send nothing by themselves).
    pub fn session<T>(&self, f: impl FnOnce(&mut SourceSession) -> T) -> T {
        f(&mut self.conn.lock().expect("peer link lock").1)
    }

    /// Sets the stream's read timeout (the reply timeout, then the peer timeout while bytes flow).
    pub fn read_timeout(&self, t: Duration) {
        if let Some(s) = &mut self.conn.lock().expect("peer link lock").0 {
            let _ = s.read_timeout(t);
        }
    }

    /// Marks the transfer ended here: the heartbeat stops.
    fn end(&self) {
        self.ended.store(true, Ordering::Release);
    }

    fn has_ended(&self) -> bool {
        self.ended.load(Ordering::Acquire)
    }

    pub fn lost(&self) -> Option<String> {
        self.lost.lock().expect("peer link lock").clone()
    }

    /// One look of the heartbeat, run every tick until [`PeerLink::done`]
    /// or [`PeerLink::abort`] (then false): a ping the session says is due
    /// goes out on a worker (`spawn`), as it waits for its answer; a failed
    /// ping or the transfer's deadline marks the destination lost. Never
    /// waits: while an exchange or a send holds the stream, it looks again
    /// next tick.
    pub fn heartbeat(self: &Arc<Self>, spawn: &dyn Fn(Box<dyn FnOnce() + Send>) -> std::io::Result<()>) -> bool {
        if self.has_ended() || self.lost().is_some() {
            return false;
        }
        if self.pinging.load(Ordering::Acquire) {
            return true;
        }
        let step = match self.conn.try_lock() {
            // The session has ended (done or failed): nothing is due any more.
            Ok(c) if c.1.poll_timeout().is_none() => return false,
            Ok(mut c) => c.1.handle_timeout(Instant::now()),
            Err(TryLockError::WouldBlock) => return true,
            Err(TryLockError::Poisoned(_)) => panic!("peer link lock poisoned"),
        };
        match step {
            Ok(None) => true,
            Ok(Some(ping)) => {
                self.pinging.store(true, Ordering::Release);
                let me = self.clone();
                let sent = spawn(Box::new(move || {
                    // Ended meanwhile: `Done` or `Abort` speaks for this side now.
                    if !me.has_ended() {
                        if let Err(e) = me.exchange(&ping) {
                            me.mark_lost(e.to_string());
                        }
                    }
                    me.pinging.store(false, Ordering::Release);
                }));
                match sent {
                    Ok(()) => true,
                    Err(e) => {
                        self.mark_lost(format!("cannot start a ping: {e}"));
                        false
                    }
                }
            }
            Err(e) => {
                self.mark_lost(format!("peer `{}`: {e}", self.peer));
                false
            }
        }
    }

    fn mark_lost(&self, why: String) {
        if !self.has_ended() {
            tracing::warn!(peer = self.peer, why, "peer lost");
            *self.lost.lock().expect("peer link lock") = Some(why);
        }
    }

    /// Every write completed: stops the heartbeat, sends `Done` and waits
    /// up to `verdict` for the destination's verdict. Ok with the
    /// connection, for the next transfer to the same peer, once the
    /// destination published `decoder_usable`; else why not (its own
    /// reason when it failed the transfer).
    pub fn done(&self, verdict: Duration) -> Result<Option<Sealed>, String> {
        self.end();
        let m = self.session(|s| s.moved()).map_err(|e| e.to_string())?;
        if let Some(lost) = self.lost() {
            return Err(format!("no verdict from the destination: {lost}"));
        }
        self.read_timeout(verdict);
        match self.exchange(&m) {
            Ok(SourceEvent::Closed) => {
                // What this transfer sent and read on it, kept for `control_bytes`.
                self.frames_when_handed_back.store(self.control_bytes(), Ordering::Release);
                Ok(self.conn.lock().expect("peer link lock").0.take())
            }
            Ok(other) => Err(format!("peer `{}` answered done with {other:?}", self.peer)),
            Err(LinkError::Session(e)) => Err(format!("peer `{}`: {e}", self.peer)),
            Err(LinkError::Wire(e)) => Err(format!("no verdict from the destination: {e}")),
        }
    }

    /// The transfer failed here: stops the heartbeat and sends `Abort` when
    /// the destination holds a slot and was not told already.
    /// Returns the destination's own reason when it had failed the
    /// transfer first (its refusals of the source's writes then only
    /// echo that).
    pub fn abort(&self, reason: &str) -> Option<String> {
        self.end();
        let m = self.session(|s| s.abort(reason))?;
        if self.lost().is_some() {
            return None;
        }
        match self.exchange(&m) {
            Err(LinkError::Session(SessionError::Rejected(theirs))) => Some(theirs),
            _ => None,
        }
    }
}
