//! The peer session as sans-IO state machines.
//!
//! A transfer between two daemons is one [`SourceSession`] on the sending
//! side and one entry of a [`DestinationSession`] (one per authenticated
//! peer connection) on the receiving side. They hold no sockets and read no
//! clock: the daemon hands them each message that arrived and the current
//! time, and they answer with the message to send, or with what the daemon
//! must do next (plan, stage, post writes, fail flags). Every refusal,
//! stale message and timeout is decided here, once, and tested with a
//! deterministic pair that steps both sides (core/tests/it/session.rs).
//!
//! | source phase | waits for | then |
//! |---|---|---|
//! | `Offered` | `Accept` / `Refused` | the daemon plans and calls `expect` |
//! | `Accepted` | the daemon's manifest | `Expect` is sent, and the writes are posted at once |
//! | `Moving` | its own completions (pings keep the peer told) | `moved`, or `Abort`; a failing `Verdict` ends it at once, a landed one is kept for `moved` |
//! | `Done` | the destination's `Verdict`, unless it came already: none once it published `decoder_usable`, else its reason | the transfer is done, or failed with that reason |
//!
//! | destination phase (per slot) | accepts | then |
//! |---|---|---|
//! | `Accepted` | `Expect` for that slot (answered with nothing) | the daemon checks the manifest before it publishes any flag |
//! | `Receiving` | `Abort`, `Ping` | bytes are counted by the data plane; when the slot ends the daemon pushes its `Verdict` ([`DestinationSession::judged`]) |
//!
//! The verdict is pushed, not asked for: the source's last write needs no
//! `Done` after it, and the destination's peer thread is not woken to
//! answer one. An `Abort` that crosses a verdict is answered as the
//! verdict was.
//!
//! One round trip comes before the first byte: the offer carries the
//! source's side of the plan, so the destination plans, stages and grants
//! keys before it accepts; the manifest follows without an answer, while
//! the bytes already flow, and no flag is published before it is checked.
//! None comes when the destination announced the request ahead: the
//! source starts at `Accepted` ([`SourceSession::claim`]), and the
//! destination enters the slot at `Accepted` when the claim arrives.

pub mod destination;
pub mod msg;
pub mod source;

pub use destination::{DestinationSession, DestinationStep, SlotPhase};
pub use source::{SourceEvent, SourcePhase, SourceSession};

use std::time::Duration;

/// How long each side waits for the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// A reply to a request (offer, expect) must come within this.
    pub reply: Duration,
    /// While bytes flow, a side that hears nothing for this long is gone.
    pub peer: Duration,
    /// A whole transfer, from offer to its end.
    pub transfer: Duration,
}

/// Why a session ended without success. Comparable, so tests can name the
/// exact outcome.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum SessionError {
    /// The peer refused, with its reason.
    #[error("peer refused: {0}")]
    Refused(String),
    /// The peer sent a message this phase does not accept.
    #[error("unexpected {got} while {phase}")]
    Unexpected {
        /// What the session was doing.
        phase: &'static str,
        /// The message's kind.
        got: &'static str,
    },
    /// The peer's `Accept` breaks a rule; the text names it.
    #[error("invalid accept: {0}")]
    BadAccept(String),
    /// The destination staged a buffer of another size than the schedule's.
    #[error("peer staged {got} bytes, the plan needs {want}")]
    StagingSize {
        /// The destination's size.
        got: u64,
        /// The schedule's.
        want: u64,
    },
    /// Nothing arrived within the timeout for this phase.
    #[error("silent for {}s while {phase}", waited.as_secs())]
    TimedOut {
        /// What the session was waiting for.
        phase: &'static str,
        /// The timeout that ran out.
        waited: Duration,
    },
    /// The whole transfer ran past its deadline.
    #[error("transfer ran past its {}s deadline", .0.as_secs())]
    Deadline(Duration),
    /// The daemon gave up (cancelled, planning failed, a rail failed…).
    #[error("{0}")]
    Local(String),
    /// The source aborted, with its reason.
    #[error("source aborted: {0}")]
    Aborted(String),
    /// Every byte arrived, and the destination failed the transfer (a
    /// checksum, a device copy...), with its reason.
    #[error("the destination failed the transfer: {0}")]
    Rejected(String),
    /// The daemon asked the session for a step its phase does not allow.
    #[error("{step} is not allowed while {phase}")]
    OutOfOrder {
        /// The step asked for.
        step: &'static str,
        /// The phase it was asked in.
        phase: &'static str,
    },
}

/// The most rails an `Accept` may list: rail preferences are bit masks.
pub const MAX_RAILS: usize = 64;

/// A message kind's name, for errors (never the message: it may be large).
pub fn kind(m: &msg::PeerMsg) -> &'static str {
    use msg::PeerMsg::*;
    match m {
        Challenge { .. } => "challenge",
        Auth { .. } => "auth",
        AuthOk { .. } => "auth_ok",
        Refused { .. } => "refused",
        Offer(_) => "offer",
        Accept(_) => "accept",
        Announce(_) => "announce",
        Claim(_) => "claim",
        Expect(_) => "expect",
        LayerSums(_) => "layer_sums",
        Ok => "ok",
        Abort { .. } => "abort",
        Ping => "ping",
        Pong => "pong",
        Verdict { .. } => "verdict",
    }
}
