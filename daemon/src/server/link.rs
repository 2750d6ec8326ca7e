//! The source's peer-control connection for one transfer: the pump of its
//! [`SourceSession`]. While bytes flow a heartbeat thread pings the
//! destination (when the session says a ping is due), so the destination
//! can tell a dead source from a slow one, and an unanswered ping marks the
//! destination lost.

use super::announce::{AnnounceBook, Heard};
use crate::config::PeerConfig;
use crate::peer::Sealed;
use kvwire_core::session::msg::PeerMsg;
use kvwire_core::session::{SessionError, SourceEvent, SourceSession};
use kvwire_transport::Credential;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
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
    // Set when the transfer ends here; the heartbeat waits on it, so it
    // leaves (and its worker goes back to the pool) at once, not at its
    // next look.
    ended: (Mutex<bool>, Condvar),
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
            ended: (Mutex::new(false), Condvar::new()),
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

    /// Runs `f` on the session (for steps that send nothing by themselves).
    pub fn session<T>(&self, f: impl FnOnce(&mut SourceSession) -> T) -> T {
        f(&mut self.conn.lock().expect("peer link lock").1)
    }

    /// Sets the stream's read timeout (the reply timeout, then the peer timeout while bytes flow).
    pub fn read_timeout(&self, t: Duration) {
        if let Some(s) = &self.conn.lock().expect("peer link lock").0 {
            let _ = s.stream().set_read_timeout(Some(t));
        }
    }

    /// Marks the transfer ended here and wakes the heartbeat.
    fn end(&self) {
        *self.ended.0.lock().expect("peer link lock") = true;
        self.ended.1.notify_all();
    }

    fn has_ended(&self) -> bool {
        *self.ended.0.lock().expect("peer link lock")
    }

    pub fn lost(&self) -> Option<String> {
        self.lost.lock().expect("peer link lock").clone()
    }

    /// Pings when the session says one is due, until [`PeerLink::done`] or
    /// [`PeerLink::abort`]; a failed ping or the transfer's deadline marks
    /// the destination lost.
    pub fn heartbeat(&self) {
        loop {
            let Some(due) = self.session(|s| s.poll_timeout()) else { return };
            {
                let (lock, cv) = &self.ended;
                let ended = lock.lock().expect("peer link lock");
                let (ended, _) = cv.wait_timeout_while(ended, due.saturating_duration_since(Instant::now()), |ended| !*ended).expect("peer link lock");
                if *ended {
                    return;
                }
            }
            let why = match self.session(|s| s.handle_timeout(Instant::now())) {
                Ok(None) => continue,
                Ok(Some(ping)) => match self.exchange(&ping) {
                    Ok(_) => continue,
                    Err(e) => e.to_string(),
                },
                Err(e) => format!("peer `{}`: {e}", self.peer),
            };
            if !self.has_ended() {
                tracing::warn!(peer = self.peer, why, "peer lost");
                *self.lost.lock().expect("peer link lock") = Some(why);
            }
            return;
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
