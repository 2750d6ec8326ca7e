//! The ABI's numbers: result codes ([`kvw_result`]) and their texts, the
//! message size ([`KVW_MESSAGE_MAX`]), flag kinds ([`kvw_flag`]) and
//! transfer states ([`kvw_state`]).

#[cfg(doc)] // for the doc links
use crate::{kvw_client_last_error, kvw_client_node, kvw_last_error, kvw_status, kvw_strerror};

/// Result of every kvwire function that can fail.
///
/// Families: 0–99 this library's own, 100s a bad request (as the daemon
/// numbers them), 200s the peer daemon, 300s the transfer, 400s access.
/// The 100–400 numbers are the daemon's own codes, so a code read from a
/// daemon log means the same thing here. A retired number is never reused.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum kvw_result {
    /// Success.
    KVW_OK = 0,
    /// A panic inside the library was caught at the boundary; the handle
    /// involved should be freed and not used again.
    KVW_PANIC = 1,
    /// A required pointer argument was NULL.
    KVW_NULL_ARGUMENT = 2,
    /// A string argument was not valid UTF-8.
    KVW_INVALID_UTF8 = 3,
    /// An operating-system or socket error (connecting, mapping, the daemon
    /// went away).
    KVW_IO = 4,
    /// The caller's buffer cannot hold the text plus its NUL; nothing was
    /// written. A buffer of `KVW_MESSAGE_MAX` bytes always suffices.
    KVW_BUFFER_TOO_SMALL = 5,
    /// A JSON argument (model source, cache identity) did not parse.
    KVW_INVALID_JSON = 6,
    /// A numeric argument is out of range (unknown flag kind, layer or slot
    /// past the flag page, zero-length memory).
    KVW_INVALID_ARGUMENT = 7,
    /// The daemon answered something this library did not expect.
    KVW_UNEXPECTED_REPLY = 8,
    /// The daemon answered with an error code this library does not know
    /// (a newer daemon); the message says what was wrong.
    KVW_UNKNOWN_DAEMON_ERROR = 9,
    /// Malformed control message.
    KVW_MALFORMED = 100,
    /// Bad model description.
    KVW_BAD_MODEL = 101,
    /// Bad layout or cache format.
    KVW_BAD_LAYOUT = 102,
    /// The memory passed does not fit the layout.
    KVW_BAD_REGION = 103,
    /// Unknown cache group or rank.
    KVW_UNKNOWN_GROUP = 104,
    /// Unknown transfer slot.
    KVW_UNKNOWN_SLOT = 105,
    /// Not every rank of the group is registered yet.
    KVW_INCOMPLETE_GROUP = 106,
    /// Two registrations of one group disagree.
    KVW_MISMATCH = 107,
    /// A daemon limit was reached.
    KVW_LIMIT = 108,
    /// No prepared receive matches the submitted transfer.
    KVW_NOT_PREPARED = 109,
    /// A request the daemon cannot carry out as asked: block table or token
    /// counts, a plan, manifest or codec refusal, a request already prepared
    /// or a slot already finished (the client's last error names which).
    KVW_BAD_REQUEST = 110,
    /// The destination peer is not configured.
    KVW_UNKNOWN_PEER = 200,
    /// The peer cannot be reached.
    KVW_PEER_UNREACHABLE = 201,
    /// Peer authentication failed (different shared secrets).
    KVW_AUTH_FAILED = 202,
    /// The peer refused the transfer.
    KVW_PEER_REFUSED = 203,
    /// The transfer failed; its flags will never be published.
    KVW_TRANSFER_FAILED = 300,
    /// A wait timed out; the transfer may still finish.
    KVW_TIMEOUT = 301,
    /// The transfer was cancelled.
    KVW_CANCELLED = 302,
    /// The client may not do this.
    KVW_PERMISSION_DENIED = 400,
}

use kvw_result::*;

pub(crate) const ALL_RESULTS: [kvw_result; 29] = [
    KVW_OK,
    KVW_PANIC,
    KVW_NULL_ARGUMENT,
    KVW_INVALID_UTF8,
    KVW_IO,
    KVW_BUFFER_TOO_SMALL,
    KVW_INVALID_JSON,
    KVW_INVALID_ARGUMENT,
    KVW_UNEXPECTED_REPLY,
    KVW_UNKNOWN_DAEMON_ERROR,
    KVW_MALFORMED,
    KVW_BAD_MODEL,
    KVW_BAD_LAYOUT,
    KVW_BAD_REGION,
    KVW_UNKNOWN_GROUP,
    KVW_UNKNOWN_SLOT,
    KVW_INCOMPLETE_GROUP,
    KVW_MISMATCH,
    KVW_LIMIT,
    KVW_NOT_PREPARED,
    KVW_BAD_REQUEST,
    KVW_UNKNOWN_PEER,
    KVW_PEER_UNREACHABLE,
    KVW_AUTH_FAILED,
    KVW_PEER_REFUSED,
    KVW_TRANSFER_FAILED,
    KVW_TIMEOUT,
    KVW_CANCELLED,
    KVW_PERMISSION_DENIED,
];

impl kvw_result {
    /// The code for a daemon's numbered error.
    pub(crate) fn from_daemon(code: u32) -> kvw_result {
        match ALL_RESULTS.iter().find(|r| **r as u32 == code) {
            Some(r) if code >= 100 => *r,
            _ => KVW_UNKNOWN_DAEMON_ERROR,
        }
    }

    pub(crate) fn text(self) -> &'static str {
        match self {
            KVW_OK => "success",
            KVW_PANIC => "a panic inside kvwire was caught",
            KVW_NULL_ARGUMENT => "a required pointer argument was NULL",
            KVW_INVALID_UTF8 => "a string argument was not valid UTF-8",
            KVW_IO => "operating-system or daemon connection error",
            KVW_BUFFER_TOO_SMALL => "the buffer is too small for the text and its NUL",
            KVW_INVALID_JSON => "a JSON argument did not parse",
            KVW_INVALID_ARGUMENT => "an argument is out of range",
            KVW_UNEXPECTED_REPLY => "the daemon answered something unexpected",
            KVW_UNKNOWN_DAEMON_ERROR => "the daemon answered with an error code this library does not know",
            KVW_MALFORMED => "malformed control message",
            KVW_BAD_MODEL => "bad model description",
            KVW_BAD_LAYOUT => "bad layout or cache format",
            KVW_BAD_REGION => "the memory passed does not fit the layout",
            KVW_UNKNOWN_GROUP => "unknown cache group or rank",
            KVW_UNKNOWN_SLOT => "unknown transfer slot",
            KVW_INCOMPLETE_GROUP => "not every rank of the cache group is registered",
            KVW_MISMATCH => "two registrations of one cache group disagree",
            KVW_LIMIT => "a daemon limit was reached",
            KVW_NOT_PREPARED => "no prepared receive matches",
            KVW_BAD_REQUEST => "bad request: block table, token counts, plan, manifest or codec refused it, or the slot already finished (the client's last error names which)",
            KVW_UNKNOWN_PEER => "the peer is not configured",
            KVW_PEER_UNREACHABLE => "the peer cannot be reached",
            KVW_AUTH_FAILED => "peer authentication failed",
            KVW_PEER_REFUSED => "the peer refused the transfer",
            KVW_TRANSFER_FAILED => "the transfer failed",
            KVW_TIMEOUT => "the wait timed out",
            KVW_CANCELLED => "the transfer was cancelled",
            KVW_PERMISSION_DENIED => "permission denied",
        }
    }
}

/// Bytes of a buffer that always holds any text this library returns
/// ([`kvw_strerror`], [`kvw_client_last_error`], [`kvw_last_error`],
/// [`kvw_client_node`]), its NUL included. Longer daemon messages are cut to
/// fit.
pub const KVW_MESSAGE_MAX: usize = 1024;

/// Which flag of a transfer slot to wait on or read: one of the
/// `KVW_FLAG_*` constants. (A `uint32_t`, not a C enum, so that a stray
/// value is [`KVW_INVALID_ARGUMENT`] rather than undefined behaviour.)
pub type kvw_flag = u32;
/// `layer_ready(layer)` at the destination: every byte of `layer` is in
/// place. Pass the layer number as the `layer` argument.
pub const KVW_FLAG_LAYER_READY: kvw_flag = 0;
/// `decoder_usable` at the destination: every layer ready and the request's
/// metadata committed; the decoder may use the blocks.
pub const KVW_FLAG_DECODER_USABLE: kvw_flag = 1;
/// `source_released` at the source: nothing of the transfer reads the
/// source blocks any more (every write from them completed; from device
/// memory, every copy into the daemon's staging ring did); the engine may
/// reuse or free them.
pub const KVW_FLAG_SOURCE_RELEASED: kvw_flag = 2;

/// A transfer's state, as [`kvw_status`] reports it: one of the
/// `KVW_STATE_*` constants.
pub type kvw_state = u32;
/// Prepared, waiting for the source.
pub const KVW_STATE_PREPARED: kvw_state = 0;
/// Bytes moving.
pub const KVW_STATE_RUNNING: kvw_state = 1;
/// Finished: every flag published.
pub const KVW_STATE_DONE: kvw_state = 2;
/// Failed.
pub const KVW_STATE_FAILED: kvw_state = 3;
/// Cancelled by a client.
pub const KVW_STATE_CANCELLED: kvw_state = 4;
