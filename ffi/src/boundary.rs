//! The panic boundary every `extern "C"` function runs inside ([`guard`],
//! [`client_guard`]), the failure it turns into a result code ([`Fail`]),
//! and where a failure's message is kept for `kvw_last_error` and
//! `kvw_client_last_error`.

use crate::codes::kvw_result::{self, *};
use crate::codes::KVW_MESSAGE_MAX;
use crate::kvw_client;
#[cfg(doc)] // for the doc links
use crate::{kvw_client_last_error, kvw_last_error};
use kvwire_client::client::ClientError;
use kvwire_transport::flags::WaitError;
use std::cell::RefCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, MutexGuard};

/// Why a call failed: its code and message.
pub(crate) struct Fail {
    pub(crate) code: kvw_result,
    pub(crate) message: String,
}

impl Fail {
    pub(crate) fn new(code: kvw_result, message: impl Into<String>) -> Fail {
        Fail { code, message: message.into() }
    }
    pub(crate) fn null(what: &str) -> Fail {
        Fail::new(KVW_NULL_ARGUMENT, format!("`{what}` is NULL"))
    }
}

impl From<ClientError> for Fail {
    fn from(e: ClientError) -> Fail {
        match e {
            ClientError::Daemon { code, message } => Fail::new(kvw_result::from_daemon(code), message),
            ClientError::Wire(_) | ClientError::FlagPage(_) => Fail::new(KVW_IO, e.to_string()),
            ClientError::Unexpected(_) => Fail::new(KVW_UNEXPECTED_REPLY, e.to_string()),
            ClientError::Wait(WaitError::Timeout { .. }) => Fail::new(KVW_TIMEOUT, e.to_string()),
            ClientError::Wait(_) => Fail::new(KVW_TRANSFER_FAILED, e.to_string()),
        }
    }
}

thread_local! {
    pub(crate) static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

/// Cuts `s` to fit a [`KVW_MESSAGE_MAX`] buffer with its NUL, at a character
/// boundary.
pub(crate) fn clip(mut s: String) -> String {
    if s.len() >= KVW_MESSAGE_MAX {
        let mut end = KVW_MESSAGE_MAX - 1;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
    s
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The panic boundary of every function returning a [`kvw_result`]; a
/// failure's message is kept for [`kvw_last_error`].
pub(crate) fn guard(f: impl FnOnce() -> Result<(), Fail>) -> kvw_result {
    let (code, message) = match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => return KVW_OK,
        Ok(Err(fail)) => (fail.code, fail.message),
        Err(_) => (KVW_PANIC, "a panic inside kvwire was caught at the C boundary".to_string()),
    };
    let message = clip(message);
    let _ = catch_unwind(|| LAST_ERROR.with(|l| *l.borrow_mut() = message));
    code
}

/// [`guard`] for a call on a client: the message is also kept on the client
/// for [`kvw_client_last_error`].
pub(crate) fn client_guard(client: *const kvw_client, f: impl FnOnce(&kvw_client) -> Result<(), Fail>) -> kvw_result {
    let mut seen: Option<&kvw_client> = None;
    let code = guard(|| {
        // SAFETY: the caller passes NULL or a pointer from kvw_client_connect
        // not yet freed (the documented contract of every client function).
        let c = unsafe { client.as_ref() }.ok_or_else(|| Fail::null("client"))?;
        seen = Some(c);
        f(c)
    });
    if code != KVW_OK {
        if let Some(c) = seen {
            let message = LAST_ERROR.with(|l| l.borrow().clone());
            *lock(&c.last_error) = message;
        }
    }
    code
}
