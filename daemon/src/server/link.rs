//! The source's peer-control connection for one transfer: the pump of its
//! [`SourceSession`]. While bytes flow a heartbeat (a check on the daemon's
//! ticker) pings the destination when the session says a ping is due, so
//! the destination can tell a dead source from a slow one, and an
//! unanswered ping marks the destination lost.

use super::announce::{AnnounceBook, Heard};
use crate::config::PeerConfig;
use crate::peer::Sealed;
use kvwire_client::wire::WireError;
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
        match &self.conn.lock().expect("peer link lock").0 {
            Some(s) => self.share(s),
            None => self.frames_when_handed_back.load(Ordering::Acquire),
        }
    }

    // This transfer's share of the frames on `s` so far.
    fn share(&self, s: &Sealed) -> u64 {
        let frames = s.frame_bytes().saturating_sub(self.frames_before);
        (frames + self.ours.load(Ordering::Acquire)).saturating_sub(self.others.load(Ordering::Acquire))
    }

    /// An announcement of this transfer's request, heard before it or
    /// beside its offer: its frame counts toward this transfer.
    pub fn count_announcement(&self, bytes: u64) {
        self.ours.fetch_add(bytes, Ordering::AcqRel);
    }

    /// Sends `m` and hands the answer to the session. Announcements the
    /// destination sent meanwhile (it saw the connection idle) are booked
    /// on the way, and a verdict that came first is handed to the session
    /// too, which keeps it.
    pub fn exchange(&self, m: &PeerMsg) -> Result<SourceEvent, LinkError> {
        let mut c = self.conn.lock().expect("peer link lock");
        let (s, session) = &mut *c;
        let s = s.as_mut().ok_or_else(|| self.handed_back())?;
        s.send(m).map_err(|e| self.wire_error(e))?;
        loop {
            match self.next(s, session)? {
                Some(SourceEvent::Judged) => continue,
                // A ping's answer is read even when the verdict came
                // before it (the session keeps the verdict): the
                // connection goes back with nothing left on it.
                Some(SourceEvent::Closed) if *m == PeerMsg::Ping => continue,
                Some(ev) => return Ok(ev),
                None => return Err(LinkError::Wire(format!("peer `{}` silent for {}s", self.peer, self.peer_timeout.as_secs()))),
            }
        }
    }

    /// The next message that is not an announcement, through the session;
    /// None when the read timed out first.
    fn next(&self, s: &mut Sealed, session: &mut SourceSession) -> Result<Option<SourceEvent>, LinkError> {
        let m = loop {
            let before = s.frames_read();
            match s.recv() {
                Err(e) if e.is_timeout() => return Ok(None),
                Err(e) => return Err(self.wire_error(e)),
                Ok(PeerMsg::Announce(announce)) => {
                    let bytes = s.frames_read() - before;
                    self.others.fetch_add(bytes, Ordering::AcqRel);
                    self.book.note(&self.peer, Heard { session: self.credential.session, bytes, announce });
                }
                Ok(other) => break other,
            }
        };
        Ok(Some(session.handle(Instant::now(), m)?))
    }

    fn wire_error(&self, e: WireError) -> LinkError {
        LinkError::Wire(format!("peer `{}` went away mid-transfer: {e}", self.peer))
    }

    fn handed_back(&self) -> LinkError {
        LinkError::Wire(format!("peer `{}`: the transfer's connection was handed back", self.peer))
    }

    /// Sends `m`, which has no answer.
    pub fn send(&self, m: &PeerMsg) -> Result<(), LinkError> {
        let mut c = self.conn.lock().expect("peer link lock");
        let s = c.0.as_mut().ok_or_else(|| self.handed_back())?;
        s.send(m).map_err(|e| self.wire_error(e))
    }

    /// Seals `m` to leave with the next message sent ([`Sealed::hold`]).
    pub fn hold(&self, m: &PeerMsg) -> Result<(), LinkError> {
        let mut c = self.conn.lock().expect("peer link lock");
        let s = c.0.as_mut().ok_or_else(|| self.handed_back())?;
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

    /// Every write completed: stops the heartbeat and waits for the
    /// destination's verdict, unless it came already (pinging meanwhile,
    /// as the heartbeat did, up to the transfer's deadline). Ok with the
    /// connection, for the next transfer to the same peer, once the
    /// destination published `decoder_usable`; else why not (its own
    /// reason when it failed the transfer).
    pub fn done(&self) -> Result<Option<Sealed>, String> {
        self.end();
        let theirs = |e: SessionError| format!("peer `{}`: {e}", self.peer);
        let mut landed = self.session(|s| s.moved()).map_err(theirs)?;
        if let Some(lost) = self.lost() {
            return Err(format!("no verdict from the destination: {lost}"));
        }
        let mut c = self.conn.lock().expect("peer link lock");
        let (stream, session) = &mut *c;
        let s = stream.as_mut().ok_or_else(|| self.handed_back().to_string())?;
        // The heartbeat's last ping may have read the verdict meanwhile.
        landed |= session.landed();
        // Pings sent here and not answered yet.
        let mut unanswered = 0u32;
        while !landed {
            let Some(due) = session.poll_timeout() else {
                return Err(match session.error() {
                    Some(e) => theirs(e.clone()),
                    None => format!("peer `{}`: no verdict, and nothing left to wait for", self.peer),
                });
            };
            let _ = s.read_timeout(due.saturating_duration_since(Instant::now()).max(Duration::from_millis(1)));
            match self.next(s, session) {
                Ok(Some(SourceEvent::Alive)) => unanswered = unanswered.saturating_sub(1),
                Ok(Some(ev)) => landed = ev == SourceEvent::Closed,
                // A ping when one is due; the deadline's failure when past it.
                Ok(None) => match session.handle_timeout(Instant::now()) {
                    Ok(Some(ping)) => {
                        s.send(&ping).map_err(|e| format!("no verdict from the destination: {}", self.wire_error(e)))?;
                        unanswered += 1;
                    }
                    Ok(None) => {}
                    Err(e) => return Err(format!("no verdict from the destination: {e}")),
                },
                Err(LinkError::Session(e)) => return Err(theirs(e)),
                Err(LinkError::Wire(e)) => return Err(format!("no verdict from the destination: {e}")),
            }
        }
        // A ping that crossed the verdict: its answer follows the verdict,
        // and is read here. Left on the stream, it would meet the next
        // transfer on this connection as a message out of turn, and the
        // destination's count of this transfer's frames (which has it)
        // would not be this side's. A connection that does not answer in
        // time is not kept; the transfer has landed all the same.
        if unanswered > 0 {
            let _ = s.read_timeout(self.peer_timeout);
            while unanswered > 0 {
                match self.next(s, session) {
                    Ok(Some(SourceEvent::Alive)) => unanswered -= 1,
                    _ => break,
                }
            }
        }
        // What this transfer sent and read on it, kept for `control_bytes`.
        self.frames_when_handed_back.store(self.share(s), Ordering::Release);
        Ok(stream.take().filter(|_| unanswered == 0))
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

#[cfg(test)]
mod tests {
    use super::*;
    use kvwire_core::protocol::TransportKind;
    use kvwire_core::reuse::CacheIdentity;
    use kvwire_core::session::msg::{Accept, Expect, ManifestWire, Offer};
    use kvwire_core::session::Timeouts;

    const SLOT: u16 = 3;

    /// A source's connection and the destination's end of it, whose reads
    /// give up after 10 s.
    fn pair() -> (Sealed, Sealed) {
        let (c, s, _) = crate::peer::sealed_pair();
        s.stream().set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        (c, s)
    }

    /// A link whose transfer was accepted into `SLOT` and is moving bytes;
    /// it pings every 50 ms.
    fn moving(c: Sealed) -> PeerLink {
        let id = CacheIdentity { model_digest: "m".into(), adapter_digest: String::new(), format: "f/v1".into(), tenant: "t".into(), rope: "r".into(), position_offset: 0 };
        let offer = Offer {
            dst_group: "g".into(),
            dst_request: "r".into(),
            src_request: "r".into(),
            identity: id,
            tokens: 1,
            codec: None,
            src_layout: "l".into(),
            src_num_blocks: 1,
            src_block_table: vec![0],
        };
        let peer = Duration::from_millis(200);
        let t = Timeouts { reply: Duration::from_secs(10), peer, transfer: Duration::from_secs(30) };
        let now = Instant::now();
        let (mut session, _) = SourceSession::start(now, offer, TransportKind::Tcp, t);
        let accept = Accept {
            slot: SLOT,
            layout: "l".into(),
            format: "f/v1".into(),
            num_blocks: 1,
            block_table: vec![0],
            prefix_tokens: 0,
            data_addr: "127.0.0.1:1".into(),
            transport: "tcp".into(),
            regions: Vec::new(),
            stage_key: 0,
            stage_len: 0,
            rails: Vec::new(),
            locality: Vec::new(),
        };
        session.handle(now, PeerMsg::Accept(accept)).unwrap();
        session.expect(now, Expect { slot: SLOT, manifest: ManifestWire::from_bytes(Vec::new()), layer_sums: false }, 0).unwrap();
        let cfg = PeerConfig { name: "dst".into(), address: "127.0.0.1:1".into() };
        PeerLink::new(c, session, &cfg, peer, Arc::new(AnnounceBook::default()))
    }

    /// The destination's end: answers the first ping only after its verdict.
    fn verdict_before_pong(mut d: Sealed) -> std::thread::JoinHandle<Sealed> {
        std::thread::spawn(move || {
            assert_eq!(d.recv().unwrap(), PeerMsg::Ping);
            d.send(&PeerMsg::Verdict { slot: SLOT, error: None }).unwrap();
            d.send(&PeerMsg::Pong).unwrap();
            d
        })
    }

    #[test]
    fn a_ping_that_crossed_the_verdict_is_answered_before_the_connection_is_kept() {
        let (c, d) = pair();
        let link = moving(c);
        let dst = verdict_before_pong(d);
        // Every write completed; the verdict is late, so `done` pings.
        let kept = link.done().expect("landed").expect("kept");
        let d = dst.join().unwrap();
        assert_eq!(link.control_bytes(), d.frame_bytes(), "both sides count the ping, the verdict and the answer");
        assert!(!kept.pending().unwrap(), "the answer was read: nothing is left for the next transfer");
    }

    #[test]
    fn the_heartbeats_ping_reads_its_answer_past_the_verdict() {
        let (c, d) = pair();
        let link = moving(c);
        link.session(|s| s.moved()).unwrap();
        let dst = verdict_before_pong(d);
        assert_eq!(link.exchange(&PeerMsg::Ping), Ok(SourceEvent::Alive));
        let d = dst.join().unwrap();
        assert!(link.session(|s| s.landed()), "the verdict, read on the way, is the session's");
        assert_eq!(link.control_bytes(), d.frame_bytes());
        let c = link.conn.lock().unwrap();
        assert!(!c.0.as_ref().unwrap().pending().unwrap(), "nothing is left on the connection");
    }
}
