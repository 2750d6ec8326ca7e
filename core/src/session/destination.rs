//! The receiving side: one authenticated peer connection, carrying any
//! number of transfers, each in its own slot.

use super::msg::{Accept, Claim, Expect, LayerSums, Offer, PeerMsg};
use super::{kind, SessionError, Timeouts};
use std::collections::BTreeMap;
use std::time::Instant;

/// Where one slot of a destination session stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotPhase {
    /// `Accept` sent (bytes may flow already); waiting for `Expect`.
    Accepted,
    /// The manifest arrived; bytes flow.
    Receiving,
}

/// What the daemon must do with a message.
#[derive(Debug, Clone, PartialEq)]
pub enum DestinationStep {
    /// Send this and carry on (pongs, refusals of stale messages, acks).
    Reply(PeerMsg),
    /// Send nothing (a manifest that is not expected).
    Ignore,
    /// A new offer: check it, then answer with
    /// [`DestinationSession::accept`] or [`DestinationSession::refuse`].
    Offer(Box<Offer>),
    /// A claim of an announced slot: check it, then enter it with
    /// [`DestinationSession::claimed`] (nothing is sent), or answer
    /// [`DestinationSession::refuse`]'s message.
    Claim(Box<Claim>),
    /// The manifest of an accepted slot: check it before any flag of the
    /// slot is published. Nothing is sent back: a manifest that fails the
    /// check fails the slot, and the source hears it as refused writes
    /// or as the verdict.
    Expect(Box<Expect>),
    /// One layer's checksums for a slot whose manifest arrived: the layer
    /// is verified against them before its flag.
    LayerSums(Box<LayerSums>),
    /// The source aborted the slot: fail it, then send the reply.
    Aborted {
        /// The slot.
        slot: u16,
        /// The source's reason.
        reason: String,
        /// The acknowledgement to send.
        reply: PeerMsg,
    },
}

/// One peer connection's transfers, by slot.
#[derive(Debug)]
pub struct DestinationSession {
    peer: String,
    slots: BTreeMap<u16, SlotPhase>,
    // Slots whose verdict went out, and what it said: an abort that
    // crossed it is answered as it was. At most one per slot number, and
    // gone when the number is taken again.
    judged: BTreeMap<u16, Option<String>>,
    timeouts: Timeouts,
    last_heard: Instant,
}

impl DestinationSession {
    /// A session with the authenticated peer `peer`.
    pub fn new(now: Instant, peer: &str, timeouts: Timeouts) -> DestinationSession {
        DestinationSession { peer: peer.to_string(), slots: BTreeMap::new(), judged: BTreeMap::new(), timeouts, last_heard: now }
    }

    /// The slot's phase, while it is this connection's.
    pub fn slot(&self, slot: u16) -> Option<SlotPhase> {
        self.slots.get(&slot).copied()
    }

    /// A message from the source.
    pub fn handle(&mut self, now: Instant, m: PeerMsg) -> DestinationStep {
        self.last_heard = now;
        let stale = |what: &str, slot: u16| DestinationStep::Reply(PeerMsg::Refused { reason: format!("{what} for slot {slot}, which is not a transfer of this connection") });
        match m {
            PeerMsg::Offer(o) => DestinationStep::Offer(Box::new(o)),
            PeerMsg::Claim(c) if self.slots.contains_key(&c.slot) => DestinationStep::Reply(PeerMsg::Refused { reason: format!("claim for slot {}, which this connection runs already", c.slot) }),
            PeerMsg::Claim(c) => DestinationStep::Claim(Box::new(c)),
            // Never answered (the source does not read an answer): a
            // second or stale manifest is ignored.
            PeerMsg::Expect(e) => match self.slots.get_mut(&e.slot) {
                Some(p @ SlotPhase::Accepted) => {
                    *p = SlotPhase::Receiving;
                    DestinationStep::Expect(Box::new(e))
                }
                _ => DestinationStep::Ignore,
            },
            // Unanswered too: before the manifest, or for another
            // connection's slot, they are ignored, and the layer they
            // would have vouched for never verifies.
            PeerMsg::LayerSums(l) => match self.slots.get(&l.slot) {
                Some(SlotPhase::Receiving) => DestinationStep::LayerSums(Box::new(l)),
                _ => DestinationStep::Ignore,
            },
            PeerMsg::Abort { slot, reason } => match (self.slots.remove(&slot), self.judged.remove(&slot)) {
                (Some(_), _) => DestinationStep::Aborted { slot, reason, reply: PeerMsg::Ok },
                // It crossed the verdict: the source hears the verdict's word again.
                (None, Some(None)) => DestinationStep::Reply(PeerMsg::Ok),
                (None, Some(Some(reason))) => DestinationStep::Reply(PeerMsg::Refused { reason }),
                (None, None) => stale("abort", slot),
            },
            PeerMsg::Ping => DestinationStep::Reply(PeerMsg::Pong),
            other => DestinationStep::Reply(PeerMsg::Refused { reason: format!("unexpected {}", kind(&other)) }),
        }
    }

    /// The daemon accepted an offer into `a.slot`: returns the message to send.
    pub fn accept(&mut self, a: Accept) -> PeerMsg {
        self.judged.remove(&a.slot);
        self.slots.insert(a.slot, SlotPhase::Accepted);
        PeerMsg::Accept(a)
    }

    /// The daemon honoured a claim of `slot`: its manifest comes next,
    /// and nothing is sent.
    pub fn claimed(&mut self, slot: u16) {
        self.judged.remove(&slot);
        self.slots.insert(slot, SlotPhase::Accepted);
    }

    /// The daemon pushed `slot`'s verdict ([`PeerMsg::Verdict`] with
    /// `error`, built by [`DestinationSession::verdict`]): the slot is no
    /// longer this connection's, so no timeout waits on it, and an abort
    /// that crossed the verdict is answered with it. False when the slot
    /// was not this connection's (an abort took it first).
    pub fn judged(&mut self, slot: u16, error: Option<String>) -> bool {
        let ours = self.slots.remove(&slot).is_some();
        if ours {
            self.judged.insert(slot, error);
        }
        ours
    }

    /// The verdict on `slot`, to push as it ends here: landed (`error`
    /// None) or failed, and why.
    pub fn verdict(slot: u16, error: Option<String>) -> PeerMsg {
        PeerMsg::Verdict { slot, error }
    }

    /// The daemon refused an offer or a claim (no slot was taken).
    pub fn refuse(&mut self, reason: String) -> PeerMsg {
        PeerMsg::Refused { reason }
    }

    /// When the daemon must call [`DestinationSession::handle_timeout`]:
    /// a receiving slot waits at most the peer timeout between messages (the
    /// source pings), an accepted one a reply timeout, and an idle
    /// connection the transfer timeout.
    pub fn poll_timeout(&self) -> Instant {
        self.last_heard + self.wait()
    }

    fn wait(&self) -> std::time::Duration {
        if self.slots.values().any(|p| *p == SlotPhase::Receiving) {
            self.timeouts.peer
        } else if !self.slots.is_empty() {
            self.timeouts.reply
        } else {
            self.timeouts.transfer
        }
    }

    /// Nothing arrived until `now`: when past [`DestinationSession::poll_timeout`],
    /// the reason the connection ends; the daemon closes it and fails
    /// [`DestinationSession::closed`]'s slots with that reason.
    pub fn handle_timeout(&self, now: Instant) -> Option<SessionError> {
        if now < self.poll_timeout() {
            return None;
        }
        let phase = if self.slots.is_empty() { "idle" } else { "receiving" };
        Some(SessionError::TimedOut { phase, waited: self.wait() })
    }

    /// The connection ended (closed, broken, or timed out): the slots that
    /// were still running, which the daemon fails. A source that ends its
    /// connection before their verdicts will write no more.
    pub fn closed(&mut self) -> Vec<u16> {
        self.judged.clear();
        std::mem::take(&mut self.slots).into_keys().collect()
    }

    /// The authenticated peer's node name.
    pub fn peer(&self) -> &str {
        &self.peer
    }
}
