//! Arguments from C: strings, out-parameters, block tables, text written
//! back into the caller's buffer, and JSON arguments turned into control
//! requests.

use crate::boundary::Fail;
use crate::codes::kvw_result::*;
use kvwire_client::control::ModelSource;
use std::ffi::{c_char, CStr};

/// A NUL-terminated UTF-8 argument.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string valid for the call.
pub(crate) unsafe fn text<'a>(p: *const c_char, what: &str) -> Result<&'a str, Fail> {
    if p.is_null() {
        return Err(Fail::null(what));
    }
    // SAFETY: non-NULL and NUL-terminated per the caller's contract.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str().map_err(|e| Fail::new(KVW_INVALID_UTF8, format!("`{what}` is not UTF-8: {e}")))
}

/// Checks an out-parameter for NULL.
pub(crate) fn out<T>(p: *mut T, what: &str) -> Result<*mut T, Fail> {
    if p.is_null() {
        Err(Fail::null(what))
    } else {
        Ok(p)
    }
}

/// A block table argument: `n` ids at `p` (`p` may be NULL only when `n` is 0).
///
/// # Safety
/// `p` points to `n` readable `uint32_t`s when non-NULL.
pub(crate) unsafe fn table(p: *const u32, n: usize) -> Result<Vec<u32>, Fail> {
    if n == 0 {
        return Ok(Vec::new());
    }
    if p.is_null() {
        return Err(Fail::null("block_table"));
    }
    // SAFETY: non-NULL, `n` elements per the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts(p, n) }.to_vec())
}

/// Writes `msg` and a NUL into `buf` (`len` bytes) and its byte length
/// (without the NUL) into `out_len`.
///
/// # Safety
/// `buf` is NULL or writable for `len` bytes; `out_len` is NULL or writable.
pub(crate) unsafe fn put_text(msg: &str, buf: *mut c_char, len: usize, out_len: *mut usize) -> Result<(), Fail> {
    if buf.is_null() {
        return Err(Fail::null("buf"));
    }
    let out_len = out(out_len, "out_len")?;
    if len < msg.len() + 1 {
        return Err(Fail::new(
            KVW_BUFFER_TOO_SMALL,
            format!("the text needs {} bytes with its NUL; the buffer has {len}", msg.len() + 1),
        ));
    }
    // SAFETY: `buf` holds `len >= msg.len() + 1` bytes per the caller's
    // contract; the source is a distinct Rust string.
    unsafe {
        std::ptr::copy_nonoverlapping(msg.as_ptr(), buf.cast::<u8>(), msg.len());
        *buf.add(msg.len()) = 0;
        *out_len = msg.len();
    }
    Ok(())
}

/// A control request built through serde, so that fields the protocol
/// adds with defaults (options this ABI does not expose yet) need no change
/// here.
pub(crate) fn request<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> Result<T, Fail> {
    serde_json::from_value(v).map_err(|e| Fail::new(KVW_MALFORMED, format!("building the control request: {e}")))
}

/// The model argument; an `hf_config` or `toml` value may be the document's text or a path to it.
pub(crate) fn model_source(json: &str) -> Result<ModelSource, Fail> {
    let source: ModelSource = serde_json::from_str(json).map_err(|e| {
        Fail::new(
            KVW_INVALID_JSON,
            format!("model_json: {e} (expected {{\"builtin\": NAME}}, {{\"hf_config\": TEXT or PATH}} or {{\"toml\": TEXT or PATH}})"),
        )
    })?;
    source.read_path().map_err(|e| Fail::new(KVW_BAD_MODEL, format!("model_json: {e}")))
}
