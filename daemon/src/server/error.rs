//! The daemon's one error type for what a request or a peer is refused:
//! a numbered code and a message. It becomes a client's `Reply::Error`, or
//! a transfer's failure and the peer's `Abort`, in one place each
//! (`Refusal::reply`, and the source's and destination's `fail`).

use kvwire_client::control::{Code, Reply};

/// A refused request, or a transfer that failed, with its code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub(crate) struct Refusal {
    /// The numbered code the client sees.
    pub code: Code,
    /// What went wrong, for a person.
    pub message: String,
}

impl Refusal {
    pub fn new(code: Code, message: impl std::fmt::Display) -> Refusal {
        Refusal { code, message: message.to_string() }
    }

    /// The client's reply.
    pub fn reply(self) -> Reply {
        Reply::error(self.code, self.message)
    }
}

/// `Refusal::new(code, e)` as a closure, for `map_err`.
pub(crate) fn refused<E: std::fmt::Display>(code: Code) -> impl Fn(E) -> Refusal {
    move |e| Refusal::new(code, e)
}
