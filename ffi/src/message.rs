//! Messages: the text of a result code and the most recent failure's
//! message, per thread and per client.

use crate::args::put_text;
use crate::boundary::{guard, lock, Fail, LAST_ERROR};
use crate::codes::kvw_result::{self, *};
use crate::codes::ALL_RESULTS;
use crate::kvw_client;
#[cfg(doc)] // for the doc links
use crate::kvw_client_connect;
use std::ffi::c_char;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Writes the text naming result `code` (any `uint32_t`; unknown codes get
/// a generic text) into `buf`, NUL-terminated, and its length without the
/// NUL into `*out_len`.
///
/// `buf` (`len` bytes) and `out_len` are the caller's; nothing is kept.
/// Returns `KVW_BUFFER_TOO_SMALL`, writing nothing, when the text and its NUL
/// do not fit; `KVW_MESSAGE_MAX` bytes always do.
///
/// # Safety
/// `buf` is NULL or writable for `len` bytes; `out_len` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvw_strerror(code: u32, buf: *mut c_char, len: usize, out_len: *mut usize) -> kvw_result {
    guard(|| {
        let msg = match ALL_RESULTS.iter().find(|r| **r as u32 == code) {
            Some(r) => r.text(),
            None => "unknown kvwire result code",
        };
        // SAFETY: forwarded caller contract.
        unsafe { put_text(msg, buf, len, out_len) }
    })
}

/// Writes the message of the most recent failed call made *on this thread*
/// (any function, including [`kvw_client_connect`], which has no client to
/// keep it on) into `buf`, NUL-terminated, and its length into `*out_len`.
/// Empty if no call on this thread has failed. A successful call does not
/// clear it; a failure of this function does not replace it.
///
/// `buf` (`len` bytes) and `out_len` are the caller's; nothing is kept.
///
/// # Safety
/// `buf` is NULL or writable for `len` bytes; `out_len` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvw_last_error(buf: *mut c_char, len: usize, out_len: *mut usize) -> kvw_result {
    let msg = catch_unwind(|| LAST_ERROR.with(|l| l.borrow().clone())).unwrap_or_default();
    match catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: forwarded caller contract.
        unsafe { put_text(&msg, buf, len, out_len) }
    })) {
        Ok(Ok(())) => KVW_OK,
        Ok(Err(f)) => f.code,
        Err(_) => KVW_PANIC,
    }
}

/// Writes the message of the most recent failed call on `client` (from any
/// thread) into `buf`, NUL-terminated, and its length into `*out_len`: for a
/// daemon error, the daemon's own message naming what was wrong. Empty if
/// no call on this client has failed. A successful call does not clear it;
/// a failure of this function does not replace it.
///
/// `client` stays the caller's; `buf` (`len` bytes) and `out_len` are the
/// caller's; nothing is kept.
///
/// # Safety
/// `client` is NULL or a live pointer from [`kvw_client_connect`]; `buf` is
/// NULL or writable for `len` bytes; `out_len` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvw_client_last_error(
    client: *const kvw_client,
    buf: *mut c_char,
    len: usize,
    out_len: *mut usize,
) -> kvw_result {
    guard(|| {
        // SAFETY: NULL or live, per the contract.
        let c = unsafe { client.as_ref() }.ok_or_else(|| Fail::null("client"))?;
        let msg = lock(&c.last_error).clone();
        // SAFETY: forwarded caller contract.
        unsafe { put_text(&msg, buf, len, out_len) }
    })
}
