//! The sending side of one transfer.

use super::msg::{Accept, Claim, Expect, LayerSums, Offer, PeerMsg};
use super::{kind, SessionError, Timeouts, MAX_RAILS};
use crate::protocol::TransportKind;
use std::collections::HashSet;
use std::time::{Duration, Instant};

/// Where a source session stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourcePhase {
    /// `Offer` sent; waiting for `Accept`.
    Offered,
    /// Accepted; the daemon is planning and building the manifest.
    Accepted,
    /// `Expect` sent; writes are in flight.
    Moving,
    /// Every write completed; waiting for the destination's verdict,
    /// unless it came already.
    Done,
    /// Ended without success; `Abort` was sent where the peer had a slot.
    Failed,
}

impl SourcePhase {
    fn name(self) -> &'static str {
        match self {
            SourcePhase::Offered => "waiting for accept",
            SourcePhase::Accepted => "planning",
            SourcePhase::Moving => "moving bytes",
            SourcePhase::Done => "waiting for the verdict",
            SourcePhase::Failed => "failed",
        }
    }
}

/// What a message from the destination means for the daemon.
#[derive(Debug, Clone, PartialEq)]
pub enum SourceEvent {
    /// The destination accepted: plan against it, then call
    /// [`SourceSession::expect`] and post the writes.
    Accepted(Box<Accept>),
    /// A ping was answered.
    Alive,
    /// The destination landed the transfer (its verdict), or acknowledged
    /// an abort.
    Closed,
    /// Not an answer: the destination's verdict came before the writes
    /// completed here (kept for [`SourceSession::moved`]), or after this
    /// side failed (the abort's answer follows).
    Judged,
}

/// One transfer's source side.
#[derive(Debug)]
pub struct SourceSession {
    phase: SourcePhase,
    transport: TransportKind,
    peer_slot: Option<u16>,
    stage_len: u64,
    timeouts: Timeouts,
    started: Instant,
    waiting_since: Instant,
    last_ping: Instant,
    error: Option<SessionError>,
    // The destination's verdict said landed before every write completed here.
    landed: bool,
    // Started from an announcement: its staging buffer is an upper bound,
    // and the destination's answer to the claim comes only as a refusal.
    claimed: bool,
}

impl SourceSession {
    /// Starts a transfer: returns the session and the `Offer` to send.
    /// `transport` is this daemon's data-plane kind; the destination must
    /// speak the same.
    pub fn start(now: Instant, offer: Offer, transport: TransportKind, timeouts: Timeouts) -> (SourceSession, PeerMsg) {
        let s = SourceSession {
            phase: SourcePhase::Offered,
            transport,
            peer_slot: None,
            stage_len: 0,
            timeouts,
            started: now,
            waiting_since: now,
            last_ping: now,
            error: None,
            landed: false,
            claimed: false,
        };
        (s, PeerMsg::Offer(offer))
    }

    /// Starts a transfer into a request the destination announced: the
    /// session is at `Accepted` at once (the announcement's accept, checked
    /// as an answer would be), and the `Claim` goes out unanswered. `gen`
    /// is the announcement's.
    pub fn claim(now: Instant, accept: Accept, gen: u64, offer: Offer, transport: TransportKind, timeouts: Timeouts) -> Result<(SourceSession, PeerMsg), SessionError> {
        let (mut s, _) = SourceSession::start(now, offer.clone(), transport, timeouts);
        s.claimed = true;
        let slot = accept.slot;
        s.accepted(Box::new(accept))?;
        Ok((s, PeerMsg::Claim(Claim { slot, gen, offer })))
    }

    /// The phase.
    pub fn phase(&self) -> SourcePhase {
        self.phase
    }

    /// The destination's slot, once accepted.
    pub fn peer_slot(&self) -> Option<u16> {
        self.peer_slot
    }

    /// Whether the destination's verdict said landed.
    pub fn landed(&self) -> bool {
        self.landed
    }

    /// Why the session failed, once it has.
    pub fn error(&self) -> Option<&SessionError> {
        self.error.as_ref()
    }

    /// A message from the destination. An error ends the session: send the
    /// `Abort` that [`SourceSession::abort`] returns, if any.
    pub fn handle(&mut self, now: Instant, m: PeerMsg) -> Result<SourceEvent, SessionError> {
        let ev = match (self.phase, m) {
            (SourcePhase::Offered, PeerMsg::Refused { reason }) => Err(SessionError::Refused(reason)),
            (SourcePhase::Offered, PeerMsg::Accept(a)) => self.accepted(Box::new(a)),
            (SourcePhase::Moving | SourcePhase::Done, PeerMsg::Pong) => Ok(SourceEvent::Alive),
            // The destination would not honour the claim (its slot was
            // cancelled, or the claim does not fit it): it holds no slot.
            (SourcePhase::Accepted | SourcePhase::Moving, PeerMsg::Refused { reason }) if self.claimed => Err(SessionError::Refused(reason)),
            (_, PeerMsg::Verdict { slot, .. }) if Some(slot) != self.peer_slot || self.phase == SourcePhase::Offered => {
                Err(SessionError::Unexpected { phase: self.phase.name(), got: "verdict for another slot" })
            }
            // The destination's verdict: it failed there, and why.
            (SourcePhase::Accepted | SourcePhase::Moving | SourcePhase::Done, PeerMsg::Verdict { error: Some(reason), .. }) => Err(SessionError::Rejected(reason)),
            (SourcePhase::Done, PeerMsg::Verdict { error: None, .. }) => {
                self.landed = true;
                Ok(SourceEvent::Closed)
            }
            // Landed before the last completions were reaped here.
            (SourcePhase::Accepted | SourcePhase::Moving, PeerMsg::Verdict { error: None, .. }) => {
                self.landed = true;
                Ok(SourceEvent::Judged)
            }
            // Crossed this side's abort, whose answer follows.
            (SourcePhase::Failed, PeerMsg::Verdict { .. }) => Ok(SourceEvent::Judged),
            (SourcePhase::Failed, PeerMsg::Ok) => Ok(SourceEvent::Closed),
            // The answer to an `Abort`: the destination had failed it first, and why.
            (SourcePhase::Failed, PeerMsg::Refused { reason }) => Err(SessionError::Rejected(reason)),
            (phase, other) => Err(SessionError::Unexpected { phase: phase.name(), got: kind(&other) }),
        };
        self.waiting_since = now;
        ev.map_err(|e| self.fail(e))
    }

    fn accepted(&mut self, a: Box<Accept>) -> Result<SourceEvent, SessionError> {
        // The destination holds a slot from here on, valid accept or not:
        // an abort must reach it.
        self.peer_slot = Some(a.slot);
        if a.transport.parse() != Ok(self.transport) {
            return Err(SessionError::BadAccept(format!("peer speaks `{}`, this daemon `{}`", a.transport, self.transport)));
        }
        if a.rails.len() > MAX_RAILS {
            return Err(SessionError::BadAccept(format!("{} rails, at most {MAX_RAILS}", a.rails.len())));
        }
        let names: HashSet<&str> = a.rails.iter().map(|r| r.name.as_str()).collect();
        if names.len() != a.rails.len() {
            return Err(SessionError::BadAccept("two rails share a name".into()));
        }
        if let Some(p) = a.locality.iter().find(|p| p.rails.iter().any(|r| !names.contains(r.as_str()))) {
            return Err(SessionError::BadAccept(format!("rank {}'s preferred rails name a rail the accept does not list", p.rank)));
        }
        self.stage_len = a.stage_len;
        self.phase = SourcePhase::Accepted;
        Ok(SourceEvent::Accepted(a))
    }

    /// The daemon planned: returns the `Expect` to send, after which it
    /// posts the writes. `stage_bytes` is the schedule's staging size,
    /// which the destination's staging buffer must match (hold, when
    /// announced).
    pub fn expect(&mut self, now: Instant, e: Expect, stage_bytes: u64) -> Result<PeerMsg, SessionError> {
        if self.phase != SourcePhase::Accepted {
            return Err(SessionError::OutOfOrder { step: "expect", phase: self.phase.name() });
        }
        let fits = if self.claimed { stage_bytes <= self.stage_len } else { stage_bytes == self.stage_len };
        if !fits {
            return Err(self.fail(SessionError::StagingSize { got: self.stage_len, want: stage_bytes }));
        }
        self.phase = SourcePhase::Moving;
        self.waiting_since = now;
        self.last_ping = now;
        Ok(PeerMsg::Expect(e))
    }

    /// A streamed layer's checksums, to send before its writes: only
    /// after `Expect`, and only for this transfer's slot.
    pub fn layer_sums(&self, layer: u16, checksums: Vec<crate::manifest::LayerChecksum>) -> Result<PeerMsg, SessionError> {
        match (self.phase, self.peer_slot) {
            (SourcePhase::Moving, Some(slot)) => Ok(PeerMsg::LayerSums(LayerSums { slot, layer, checksums })),
            (phase, _) => Err(SessionError::OutOfOrder { step: "layer sums", phase: phase.name() }),
        }
    }

    /// Every write completed: true when the destination's verdict said
    /// landed already (the transfer is done), false when the daemon must
    /// wait for it. Nothing is sent. A verdict that failed the transfer
    /// earlier is this call's error.
    pub fn moved(&mut self) -> Result<bool, SessionError> {
        match (self.phase, &self.error) {
            (SourcePhase::Moving, _) => {
                self.phase = SourcePhase::Done;
                Ok(self.landed)
            }
            (SourcePhase::Failed, Some(e)) => Err(e.clone()),
            (phase, _) => Err(SessionError::OutOfOrder { step: "moved", phase: phase.name() }),
        }
    }

    /// The daemon gives up (or the session failed): returns the `Abort` to
    /// send when the destination holds a slot for this transfer and was not
    /// told yet. Only the first failure is kept. Nothing once the
    /// destination said it landed.
    pub fn abort(&mut self, reason: &str) -> Option<PeerMsg> {
        let told = self.phase == SourcePhase::Failed && self.error.as_ref().is_some_and(|e| matches!(e, SessionError::Refused(_) | SessionError::Rejected(_)));
        if self.landed {
            return None;
        }
        self.fail(SessionError::Local(reason.to_string()));
        if told {
            return None;
        }
        self.peer_slot.map(|slot| PeerMsg::Abort { slot, reason: reason.to_string() })
    }

    /// When the daemon must call [`SourceSession::handle_timeout`] (or send a
    /// ping, while moving) at the latest.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let deadline = self.started + self.timeouts.transfer;
        match self.phase {
            SourcePhase::Offered => Some((self.waiting_since + self.timeouts.reply).min(deadline)),
            SourcePhase::Accepted => Some(deadline),
            // Waiting for the verdict, it still pings: the destination may
            // take a while to land the last layers, and must not take this
            // side's silence for its death meanwhile.
            SourcePhase::Moving | SourcePhase::Done if !(self.landed && self.phase == SourcePhase::Done) => Some((self.last_ping + self.ping_every()).min(deadline)),
            SourcePhase::Moving | SourcePhase::Done | SourcePhase::Failed => None,
        }
    }

    /// Time passed: a ping to send while moving, or the failure when a reply
    /// or the whole transfer is late (then send [`SourceSession::abort`]'s message).
    pub fn handle_timeout(&mut self, now: Instant) -> Result<Option<PeerMsg>, SessionError> {
        if self.poll_timeout().is_none() {
            return Ok(None);
        }
        if now >= self.started + self.timeouts.transfer {
            return Err(self.fail(SessionError::Deadline(self.timeouts.transfer)));
        }
        match self.phase {
            SourcePhase::Offered if now >= self.waiting_since + self.timeouts.reply => {
                let e = SessionError::TimedOut { phase: self.phase.name(), waited: self.timeouts.reply };
                Err(self.fail(e))
            }
            SourcePhase::Moving | SourcePhase::Done if now >= self.last_ping + self.ping_every() => {
                self.last_ping = now;
                Ok(Some(PeerMsg::Ping))
            }
            _ => Ok(None),
        }
    }

    /// About four pings per peer timeout, so one lost ping is not a loss.
    fn ping_every(&self) -> Duration {
        (self.timeouts.peer / 4).max(Duration::from_millis(50))
    }

    fn fail(&mut self, e: SessionError) -> SessionError {
        if self.phase != SourcePhase::Failed {
            self.phase = SourcePhase::Failed;
            self.error = Some(e.clone());
        }
        e
    }
}
