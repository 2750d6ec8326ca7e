//! kvwire's C ABI: what an inference engine written in C, C++ or Python
//! (over ctypes) links to talk to its host's `kvwired`.
//!
//! The conventions are rustls-ffi's (see `STYLE.md`, "A C ABI people can
//! trust"):
//!
//! - Handles are opaque: `struct kvw_client` (a connection to the local
//!   daemon) and `struct kvw_mem` (a memfd-backed host buffer holding one
//!   rank's cache). Each is made by one function and freed by one `_free`.
//! - Every function runs inside a panic boundary and returns [`KVW_PANIC`]
//!   (or a neutral value, for the few that return no result code) rather than
//!   unwinding into C.
//! - Every pointer is checked for NULL ([`KVW_NULL_ARGUMENT`]), before the
//!   function does anything else.
//! - Out-parameters are written only when the function returns [`KVW_OK`].
//! - Result codes ([`kvw_result`]) are numbered by family and match the
//!   daemon's error codes where those exist; a retired number is never
//!   reused. [`kvw_strerror`] names each one.
//! - Enumerations passed *in* from C ([`kvw_flag`]) are plain `uint32_t`s
//!   with named constants, so an out-of-range value is an error
//!   ([`KVW_INVALID_ARGUMENT`]), never undefined behaviour.
//!
//! The header, `ffi/include/kvwire.h`, is generated from this file by a
//! pinned cbindgen (see `ffi/cbindgen.toml` and `scripts/ffi-check`).

#![allow(non_camel_case_types)]

use kvwire_core::layout::{self, ModelSpec};
use kvwire_core::plan::Side;
use kvwire_core::reuse::CacheIdentity;
use kvwire_core::shard::LayoutSpec;
use kvwire_core::CacheFormat;
use kvwire_transport::flags::WaitError;
use kvwire_transport::HostMem;
use kvwire_client::client::{Client, ClientError};
use kvwire_client::control::{
    FlagName, ModelSource, PrepareReceive, RegisterCache, RegisterDeviceCache, Submit, TransferState, FLAG_SLOTS, MAX_TRANSFER_LAYERS,
};
use std::cell::RefCell;
use std::ffi::{c_char, c_int, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

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
    /// Bad block table or token counts, or a request already prepared.
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

const ALL_RESULTS: [kvw_result; 29] = [
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
    fn from_daemon(code: u32) -> kvw_result {
        match ALL_RESULTS.iter().find(|r| **r as u32 == code) {
            Some(r) if code >= 100 => *r,
            _ => KVW_UNKNOWN_DAEMON_ERROR,
        }
    }

    fn text(self) -> &'static str {
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
            KVW_BAD_REQUEST => "bad block table or token counts",
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
/// `source_released` at the source: every write from the source blocks has
/// completed; the engine may reuse or free them.
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

/// A connection to the local kvwired, with the daemon's flag page mapped.
///
/// Made by [`kvw_client_connect`], freed by [`kvw_client_free`]. A client
/// may be shared between threads: control calls (register, prepare,
/// submit, status, cancel, release) are serialized on its socket; waits
/// and ready checks read the mapped flag page and run concurrently.
pub struct kvw_client {
    client: Client,
    /// Held for one request/reply exchange on the socket.
    call: Mutex<()>,
    /// The most recent failure's message.
    last_error: Mutex<String>,
}

impl std::fmt::Debug for kvw_client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("kvw_client").field("node", &self.client.node).finish_non_exhaustive()
    }
}

/// A memfd-backed, shared, zero-filled host buffer: one rank's cache, its
/// regions back to back in layout order (per held layer: K then V, or the
/// MLA latent, then any state). The engine writes it through
/// [`kvw_mem_ptr`]; [`kvw_register_cache`] hands the memfd to the daemon.
///
/// Made by [`kvw_mem_new`], freed by [`kvw_mem_free`].
#[derive(Debug)]
pub struct kvw_mem {
    mem: HostMem,
}

/// Why a call failed: its code and message.
struct Fail {
    code: kvw_result,
    message: String,
}

impl Fail {
    fn new(code: kvw_result, message: impl Into<String>) -> Fail {
        Fail { code, message: message.into() }
    }
    fn null(what: &str) -> Fail {
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
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

/// Cuts `s` to fit a [`KVW_MESSAGE_MAX`] buffer with its NUL, at a character
/// boundary.
fn clip(mut s: String) -> String {
    if s.len() >= KVW_MESSAGE_MAX {
        let mut end = KVW_MESSAGE_MAX - 1;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
    s
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The panic boundary of every function returning a [`kvw_result`]; a
/// failure's message is kept for [`kvw_last_error`].
fn guard(f: impl FnOnce() -> Result<(), Fail>) -> kvw_result {
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
fn client_guard(client: *const kvw_client, f: impl FnOnce(&kvw_client) -> Result<(), Fail>) -> kvw_result {
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

/// A NUL-terminated UTF-8 argument.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string valid for the call.
unsafe fn text<'a>(p: *const c_char, what: &str) -> Result<&'a str, Fail> {
    if p.is_null() {
        return Err(Fail::null(what));
    }
    // SAFETY: non-NULL and NUL-terminated per the caller's contract.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str().map_err(|e| Fail::new(KVW_INVALID_UTF8, format!("`{what}` is not UTF-8: {e}")))
}

/// Checks an out-parameter for NULL.
fn out<T>(p: *mut T, what: &str) -> Result<*mut T, Fail> {
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
unsafe fn table(p: *const u32, n: usize) -> Result<Vec<u32>, Fail> {
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
unsafe fn put_text(msg: &str, buf: *mut c_char, len: usize, out_len: *mut usize) -> Result<(), Fail> {
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

fn flag_name(flag: kvw_flag, layer: u32) -> Result<FlagName, Fail> {
    match flag {
        KVW_FLAG_LAYER_READY => match u16::try_from(layer) {
            Ok(l) if l < MAX_TRANSFER_LAYERS => Ok(FlagName::LayerReady(l)),
            _ => Err(Fail::new(KVW_INVALID_ARGUMENT, format!("layer {layer}: a transfer has at most {MAX_TRANSFER_LAYERS} layers"))),
        },
        KVW_FLAG_DECODER_USABLE => Ok(FlagName::DecoderUsable),
        KVW_FLAG_SOURCE_RELEASED => Ok(FlagName::SourceReleased),
        other => Err(Fail::new(KVW_INVALID_ARGUMENT, format!("unknown flag kind {other} (expected a KVW_FLAG_* constant)"))),
    }
}

fn check_slot(slot: u16) -> Result<(), Fail> {
    if slot >= FLAG_SLOTS {
        return Err(Fail::new(KVW_INVALID_ARGUMENT, format!("slot {slot}: the flag page has {FLAG_SLOTS} slots")));
    }
    Ok(())
}

/// A control request built through serde, so that fields the protocol
/// adds with defaults (options this ABI does not expose yet) need no change
/// here.
fn request<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> Result<T, Fail> {
    serde_json::from_value(v).map_err(|e| Fail::new(KVW_MALFORMED, format!("building the control request: {e}")))
}

fn model_source(json: &str) -> Result<ModelSource, Fail> {
    serde_json::from_str(json).map_err(|e| {
        Fail::new(
            KVW_INVALID_JSON,
            format!("model_json: {e} (expected {{\"builtin\": NAME}}, {{\"hf_config\": TEXT}} or {{\"toml\": TEXT}})"),
        )
    })
}

fn resolve_model(group: &str, src: &ModelSource) -> Result<ModelSpec, Fail> {
    match src {
        ModelSource::Builtin(n) => layout::builtin(n),
        ModelSource::HfConfig(t) => layout::from_hf_config(group, t),
        ModelSource::Toml(t) => layout::from_toml_spec(group, t),
    }
    .map_err(|e| Fail::new(KVW_BAD_MODEL, format!("model: {e}")))
}

// ---------------------------------------------------------------------------
// Messages

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

// ---------------------------------------------------------------------------
// Memory

/// Makes a zero-filled, shared, memfd-backed buffer of `len` bytes (sealed
/// against resizing) and writes its handle to `*out`.
///
/// The caller owns the handle and must call [`kvw_mem_free`] once, after
/// [`kvw_release_cache`] for any cache registered from it (the daemon keeps
/// its own mapping until release, so freeing earlier is memory-safe but
/// leaves the daemon writing into, or reading from, memory the engine no
/// longer sees). `len` 0 is `KVW_INVALID_ARGUMENT`.
///
/// # Safety
/// `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvw_mem_new(len: usize, out_mem: *mut *mut kvw_mem) -> kvw_result {
    guard(|| {
        let out_mem = out(out_mem, "out")?;
        if len == 0 {
            return Err(Fail::new(KVW_INVALID_ARGUMENT, "cannot make a buffer of 0 bytes"));
        }
        let mem = HostMem::new("kvwire-cache", len as u64).map_err(|e| Fail::new(KVW_IO, format!("memfd: {e}")))?;
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { *out_mem = Box::into_raw(Box::new(kvw_mem { mem })) };
        Ok(())
    })
}

/// The buffer's first byte, writable for [`kvw_mem_len`] bytes while the
/// handle lives; NULL if `mem` is NULL. The memory belongs to the handle:
/// do not free it, and do not use the pointer after [`kvw_mem_free`].
///
/// # Safety
/// `mem` is NULL or a live pointer from [`kvw_mem_new`].
#[no_mangle]
pub unsafe extern "C" fn kvw_mem_ptr(mem: *const kvw_mem) -> *mut u8 {
    catch_unwind(|| {
        // SAFETY: NULL or live, per the contract.
        unsafe { mem.as_ref() }.map_or(std::ptr::null_mut(), |m| m.mem.as_ptr())
    })
    .unwrap_or(std::ptr::null_mut())
}

/// The buffer's length in bytes; 0 if `mem` is NULL.
///
/// # Safety
/// `mem` is NULL or a live pointer from [`kvw_mem_new`].
#[no_mangle]
pub unsafe extern "C" fn kvw_mem_len(mem: *const kvw_mem) -> usize {
    catch_unwind(|| {
        // SAFETY: NULL or live, per the contract.
        unsafe { mem.as_ref() }.map_or(0, |m| m.mem.len() as usize)
    })
    .unwrap_or(0)
}

/// Unmaps and closes the buffer and frees the handle. NULL is a no-op.
/// Call it once per [`kvw_mem_new`]; the handle and every pointer from
/// [`kvw_mem_ptr`] are invalid afterwards.
///
/// # Safety
/// `mem` is NULL or a live pointer from [`kvw_mem_new`], not used again.
#[no_mangle]
pub unsafe extern "C" fn kvw_mem_free(mem: *mut kvw_mem) {
    let _ = catch_unwind(|| {
        if !mem.is_null() {
            // SAFETY: from Box::into_raw in kvw_mem_new, freed once.
            drop(unsafe { Box::from_raw(mem) });
        }
    });
}

// ---------------------------------------------------------------------------
// Layout arithmetic (no daemon)

/// How many regions rank `rank` of `layout` holds and how many bytes they
/// take back to back — the size of the [`kvw_mem`] to register for it —
/// computed locally with the daemon's own rules.
///
/// `model_json` is the model source as JSON: `{"builtin": "llama-3.1-8b"}`,
/// `{"hf_config": "<config.json text>"}` or `{"toml": "<spec text>"}`;
/// `format` a cache format id (`bf16`, `fp8_e4m3_pth/v1`, …); `layout` a
/// parallel layout (`tp=2,block=16,layout=hnd`). Every argument stays the
/// caller's; nothing is kept.
///
/// # Safety
/// Strings are NULL or NUL-terminated; out-parameters NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvw_cache_size(
    model_json: *const c_char,
    format: *const c_char,
    layout: *const c_char,
    rank: u32,
    num_blocks: u32,
    out_regions: *mut u32,
    out_bytes: *mut u64,
) -> kvw_result {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let (model_json, format, layout_s) =
            unsafe { (text(model_json, "model_json")?, text(format, "format")?, text(layout, "layout")?) };
        let (out_regions, out_bytes) = (out(out_regions, "out_regions")?, out(out_bytes, "out_bytes")?);
        let model = resolve_model("model", &model_source(model_json)?)?;
        let fmt = CacheFormat::parse(format).map_err(|e| Fail::new(KVW_BAD_LAYOUT, format!("format: {e}")))?;
        let spec = LayoutSpec::parse(layout_s).map_err(|e| Fail::new(KVW_BAD_LAYOUT, format!("layout: {e}")))?;
        if num_blocks == 0 {
            return Err(Fail::new(KVW_BAD_LAYOUT, "num_blocks must be > 0"));
        }
        let side = Side::with_table(&model, &spec, fmt, 1, vec![0], num_blocks)
            .map_err(|e| Fail::new(KVW_BAD_LAYOUT, format!("layout: {e}")))?;
        if rank as usize >= side.shard.ranks.len() {
            return Err(Fail::new(
                KVW_BAD_LAYOUT,
                format!("rank {rank} but layout `{layout_s}` has {} ranks", side.shard.ranks.len()),
            ));
        }
        let regions = side.regions(&model, rank);
        let bytes: u64 = regions.iter().map(|(_, l)| l).sum();
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe {
            *out_regions = regions.len() as u32;
            *out_bytes = bytes;
        }
        Ok(())
    })
}

// ---------------------------------------------------------------------------
// Client

/// Connects to the kvwired listening on the Unix socket `socket_path`,
/// says hello as `client_name` (for the daemon's logs) and maps the
/// daemon's flag page; writes the new handle to `*out`.
///
/// The caller owns the handle and must call [`kvw_client_free`] once. The
/// strings stay the caller's. On failure, [`kvw_last_error`] (on this
/// thread) says why.
///
/// # Safety
/// Strings are NULL or NUL-terminated; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvw_client_connect(
    socket_path: *const c_char,
    client_name: *const c_char,
    out_client: *mut *mut kvw_client,
) -> kvw_result {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let (path, name) = unsafe { (text(socket_path, "socket_path")?, text(client_name, "client_name")?) };
        let out_client = out(out_client, "out")?;
        let client = Client::connect(Path::new(path), name).map_err(Fail::from)?;
        let c = kvw_client { client, call: Mutex::new(()), last_error: Mutex::new(String::new()) };
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { *out_client = Box::into_raw(Box::new(c)) };
        Ok(())
    })
}

/// Closes the connection and unmaps the flag page. NULL is a no-op. Call it
/// once per [`kvw_client_connect`], when no other thread is using the
/// client. The daemon releases every cache this connection registered and
/// still held.
///
/// # Safety
/// `client` is NULL or a live pointer from [`kvw_client_connect`], not used
/// again.
#[no_mangle]
pub unsafe extern "C" fn kvw_client_free(client: *mut kvw_client) {
    let _ = catch_unwind(|| {
        if !client.is_null() {
            // SAFETY: from Box::into_raw in kvw_client_connect, freed once.
            drop(unsafe { Box::from_raw(client) });
        }
    });
}

/// Writes the daemon's node name (what a source names as a transfer's
/// `peer`) into `buf`, NUL-terminated, and its length into `*out_len`.
/// Everything stays the caller's.
///
/// # Safety
/// `client` is NULL or live; `buf` NULL or writable for `len` bytes;
/// `out_len` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvw_client_node(
    client: *const kvw_client,
    buf: *mut c_char,
    len: usize,
    out_len: *mut usize,
) -> kvw_result {
    client_guard(client, |c| {
        // SAFETY: forwarded caller contract.
        unsafe { put_text(&c.client.node, buf, len, out_len) }
    })
}

/// Registers rank `rank` of cache group `group`, held in `mem` (its
/// regions back to back, in layout order; [`kvw_cache_size`] says how many
/// bytes), with the daemon. The daemon maps the memfd itself.
///
/// - `model_json`: `{"builtin": NAME}`, `{"hf_config": TEXT}` or
///   `{"toml": TEXT}`.
/// - `format`: cache format id, e.g. `bf16`.
/// - `layout`: parallel layout, e.g. `tp=4,block=16,layout=nhd`.
/// - `num_blocks`: blocks per region (the engine's cache capacity).
/// - `identity_json`: what the cache holds, as JSON with every field:
///   `{"model_digest":…, "adapter_digest":…, "format":…, "tenant":…,
///   "rope":…, "position_offset":…}`.
///
/// On success writes the regions registered, their bytes, and whether every
/// rank of the group is now registered. Every argument stays the caller's;
/// keep `mem` alive until [`kvw_release_cache`] (or [`kvw_client_free`],
/// which releases it too). A bad layout is `KVW_BAD_LAYOUT` (102) with the
/// daemon's message in [`kvw_client_last_error`].
///
/// # Safety
/// `client`/`mem` are NULL or live handles; strings NULL or NUL-terminated;
/// out-parameters NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvw_register_cache(
    client: *const kvw_client,
    group: *const c_char,
    model_json: *const c_char,
    format: *const c_char,
    layout: *const c_char,
    rank: u32,
    num_blocks: u32,
    identity_json: *const c_char,
    mem: *const kvw_mem,
    out_regions: *mut u32,
    out_bytes: *mut u64,
    out_complete: *mut bool,
) -> kvw_result {
    client_guard(client, |c| {
        // SAFETY: forwarded caller contract.
        let r = unsafe { register_request(group, model_json, format, layout, rank, num_blocks, identity_json) }?;
        // SAFETY: NULL or live, per the contract.
        let mem = unsafe { mem.as_ref() }.ok_or_else(|| Fail::null("mem"))?;
        let outs = (out(out_regions, "out_regions")?, out(out_bytes, "out_bytes")?, out(out_complete, "out_complete")?);
        let done = {
            let _call = lock(&c.call);
            c.client.register(r, &mem.mem)?
        };
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { put_registered(outs, done) };
        Ok(())
    })
}

/// Registers rank `rank` of cache group `group` held in device (GPU)
/// memory: `len` bytes on device `ordinal`, handed over by its CUDA IPC
/// handle (`ipc_handle`, `ipc_len` = 64 bytes, from `cuIpcGetMemHandle`)
/// and, when the driver exports one, its dmabuf `fd` (-1 for none). The
/// daemon must run a `[device]` backend; it stages the cache through pinned
/// host memory of its own. With the daemon's `host` stand-in backend, `fd`
/// is a memfd playing the device memory and there is no IPC handle
/// (`ipc_handle` NULL, `ipc_len` 0). The other arguments and the outputs
/// are those of [`kvw_register_cache`]. `fd` and the handle stay the
/// caller's; keep the allocation alive until [`kvw_release_cache`]. A
/// daemon without a device backend answers `KVW_BAD_REGION` (103) naming
/// the setting.
///
/// # Safety
/// As [`kvw_register_cache`]; `ipc_handle` readable for `ipc_len` bytes
/// (NULL allowed when `ipc_len` is 0); `fd` -1 or an open descriptor.
#[no_mangle]
pub unsafe extern "C" fn kvw_register_device_cache(
    client: *const kvw_client,
    group: *const c_char,
    model_json: *const c_char,
    format: *const c_char,
    layout: *const c_char,
    rank: u32,
    num_blocks: u32,
    identity_json: *const c_char,
    ordinal: u32,
    len: u64,
    fd: c_int,
    ipc_handle: *const u8,
    ipc_len: usize,
    out_regions: *mut u32,
    out_bytes: *mut u64,
    out_complete: *mut bool,
) -> kvw_result {
    client_guard(client, |c| {
        // SAFETY: forwarded caller contract.
        let cache = unsafe { register_request(group, model_json, format, layout, rank, num_blocks, identity_json) }?;
        let ipc = match (ipc_handle.is_null(), ipc_len) {
            (_, 0) => None,
            (true, _) => return Err(Fail::null("ipc_handle")),
            // SAFETY: readable for ipc_len bytes, per the contract.
            (false, n) => Some(unsafe { std::slice::from_raw_parts(ipc_handle, n) }.to_vec()),
        };
        if fd < -1 {
            return Err(Fail::new(KVW_INVALID_ARGUMENT, format!("fd {fd}: -1 for none, or an open descriptor")));
        }
        // SAFETY: an open descriptor per the contract, borrowed for this call only.
        let fd = (fd >= 0).then(|| unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) });
        let outs = (out(out_regions, "out_regions")?, out(out_bytes, "out_bytes")?, out(out_complete, "out_complete")?);
        let done = {
            let _call = lock(&c.call);
            c.client.register_device(RegisterDeviceCache { cache, ordinal, len, ipc }, fd)?
        };
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { put_registered(outs, done) };
        Ok(())
    })
}

/// The cache registration both register calls send.
///
/// # Safety
/// Strings NULL or NUL-terminated.
unsafe fn register_request(
    group: *const c_char,
    model_json: *const c_char,
    format: *const c_char,
    layout: *const c_char,
    rank: u32,
    num_blocks: u32,
    identity_json: *const c_char,
) -> Result<RegisterCache, Fail> {
    // SAFETY: forwarded caller contract.
    let (group, model_json, format, layout, identity_json) = unsafe {
        (
            text(group, "group")?,
            text(model_json, "model_json")?,
            text(format, "format")?,
            text(layout, "layout")?,
            text(identity_json, "identity_json")?,
        )
    };
    let model = model_source(model_json)?;
    let identity: CacheIdentity = serde_json::from_str(identity_json).map_err(|e| {
        Fail::new(KVW_INVALID_JSON, format!("identity_json: {e} (fields: model_digest, adapter_digest, format, tenant, rope, position_offset)"))
    })?;
    request(serde_json::json!({
        "group": group,
        "model": model,
        "format": format,
        "layout": layout,
        "rank": rank,
        "num_blocks": num_blocks,
        "identity": identity,
    }))
}

/// Writes a registration's outcome.
///
/// # Safety
/// Each pointer non-NULL and writable.
unsafe fn put_registered((regions, bytes, complete): (*mut u32, *mut u64, *mut bool), done: (u32, u64, bool)) {
    // SAFETY: per the contract.
    unsafe {
        *regions = done.0;
        *bytes = done.1;
        *complete = done.2;
    }
}

/// Prepares destination group `group` to receive request `request` into
/// the blocks `block_table[0..n]` (block ids in position order, shared by
/// every rank of the group), `tokens` long, of which the first
/// `prefix_tokens` are already held here. Writes the slot whose
/// `layer_ready`/`decoder_usable` flags to wait on.
///
/// From now the blocks belong to the transfer: the engine must not write or
/// reuse them until `decoder_usable` (or until it cancels the slot and the
/// wait reports `KVW_CANCELLED`). Every argument stays the caller's.
///
/// # Safety
/// `client` NULL or live; strings NULL or NUL-terminated; `block_table`
/// readable for `n` ids (NULL allowed when `n` is 0); `out_slot` NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn kvw_prepare_receive(
    client: *const kvw_client,
    group: *const c_char,
    request: *const c_char,
    block_table: *const u32,
    n: usize,
    tokens: u64,
    prefix_tokens: u64,
    out_slot: *mut u16,
) -> kvw_result {
    client_guard(client, |c| {
        // SAFETY: forwarded caller contract.
        let (group, request, block_table) =
            unsafe { (text(group, "group")?, text(request, "request")?, table(block_table, n)?) };
        let out_slot = out(out_slot, "out_slot")?;
        let p: PrepareReceive = self::request(serde_json::json!({
            "group": group,
            "request": request,
            "block_table": block_table,
            "tokens": tokens,
            "prefix_tokens": prefix_tokens,
        }))?;
        let slot = {
            let _call = lock(&c.call);
            c.client.prepare(p)?
        };
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { *out_slot = slot };
        Ok(())
    })
}

/// Starts moving request `request` (`tokens` long, in the blocks
/// `block_table[0..n]` of local group `group`) to the request `dst_request`
/// that daemon `peer` prepared in its group `dst_group`. Writes this
/// daemon's slot (wait on its `source_released`) and the peer's slot (the
/// destination's `layer_ready`/`decoder_usable`, which equals the slot its
/// prepare returned).
///
/// The engine must not write, free or reuse the source blocks until
/// `source_released`. Every argument stays the caller's.
///
/// # Safety
/// `client` NULL or live; strings NULL or NUL-terminated; `block_table`
/// readable for `n` ids (NULL allowed when `n` is 0); out-parameters NULL
/// or writable.
#[no_mangle]
pub unsafe extern "C" fn kvw_submit(
    client: *const kvw_client,
    request: *const c_char,
    group: *const c_char,
    block_table: *const u32,
    n: usize,
    tokens: u64,
    peer: *const c_char,
    dst_group: *const c_char,
    dst_request: *const c_char,
    out_slot: *mut u16,
    out_peer_slot: *mut u16,
) -> kvw_result {
    client_guard(client, |c| {
        // SAFETY: forwarded caller contract.
        let (request, group, block_table, peer, dst_group, dst_request) = unsafe {
            (
                text(request, "request")?,
                text(group, "group")?,
                table(block_table, n)?,
                text(peer, "peer")?,
                text(dst_group, "dst_group")?,
                text(dst_request, "dst_request")?,
            )
        };
        let out_slot = out(out_slot, "out_slot")?;
        let out_peer_slot = out(out_peer_slot, "out_peer_slot")?;
        let s = Submit {
            request: request.into(),
            group: group.into(),
            block_table,
            tokens,
            peer: peer.into(),
            dst_group: dst_group.into(),
            dst_request: dst_request.into(),
            codec: None,
        };
        let submitted = {
            let _call = lock(&c.call);
            c.client.submit(s)?
        };
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe {
            *out_slot = submitted.slot;
            *out_peer_slot = submitted.peer_slot;
        }
        Ok(())
    })
}

/// Blocks the calling thread until flag `flag` (a `KVW_FLAG_*`; `layer`
/// names the layer for `KVW_FLAG_LAYER_READY` and is ignored otherwise) of
/// `slot` is published, reading the mapped flag page — no round trip to the
/// daemon. Spins briefly, then sleeps in short steps. On success writes the
/// nanoseconds from publish to seen (the notify hop).
///
/// Fails with `KVW_TIMEOUT` after `timeout_ms` (the transfer may still
/// finish; wait again), `KVW_CANCELLED` if the slot was cancelled, or
/// `KVW_TRANSFER_FAILED` (message: why) if the flag will never come.
///
/// # Safety
/// `client` NULL or live; `out_notify_ns` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvw_wait(
    client: *const kvw_client,
    slot: u16,
    flag: kvw_flag,
    layer: u32,
    timeout_ms: u64,
    out_notify_ns: *mut u64,
) -> kvw_result {
    client_guard(client, |c| {
        let out_notify_ns = out(out_notify_ns, "out_notify_ns")?;
        let name = flag_name(flag, layer)?;
        check_slot(slot)?;
        match c.client.wait(slot, name, Duration::from_millis(timeout_ms)) {
            Ok(d) => {
                // SAFETY: checked non-NULL; writable per the contract.
                unsafe { *out_notify_ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX) };
                Ok(())
            }
            Err(e @ ClientError::Wait(WaitError::Failed { .. })) => {
                // Ask the daemon why (one round trip, on the failure path only).
                let status = {
                    let _call = lock(&c.call);
                    c.client.status(slot)
                };
                Err(match status {
                    Ok(s) if s.state == TransferState::Cancelled => {
                        Fail::new(KVW_CANCELLED, format!("{e}: {}", s.error.unwrap_or_else(|| "cancelled".into())))
                    }
                    Ok(s) => Fail::new(KVW_TRANSFER_FAILED, format!("{e}: {}", s.error.unwrap_or_default())),
                    Err(_) => Fail::from(e),
                })
            }
            Err(e) => Err(Fail::from(e)),
        }
    })
}

/// Reads flag `flag` (`layer` as in [`kvw_wait`]) of `slot` from the mapped
/// page without waiting; writes `true` if published.
///
/// # Safety
/// `client` NULL or live; `out_ready` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvw_is_ready(
    client: *const kvw_client,
    slot: u16,
    flag: kvw_flag,
    layer: u32,
    out_ready: *mut bool,
) -> kvw_result {
    client_guard(client, |c| {
        let out_ready = out(out_ready, "out_ready")?;
        let name = flag_name(flag, layer)?;
        check_slot(slot)?;
        let ready = c.client.ready(slot, name);
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { *out_ready = ready };
        Ok(())
    })
}

/// Writes the state of the transfer in `slot` (a `KVW_STATE_*`), with a
/// round trip to the daemon. A failed transfer's reason is not returned
/// here; a wait on its flags gives it.
///
/// # Safety
/// `client` NULL or live; `out_state` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvw_status(client: *const kvw_client, slot: u16, out_state: *mut kvw_state) -> kvw_result {
    client_guard(client, |c| {
        let out_state = out(out_state, "out_state")?;
        let s = {
            let _call = lock(&c.call);
            c.client.status(slot)?
        };
        let state = match s.state {
            TransferState::Prepared => KVW_STATE_PREPARED,
            TransferState::Running => KVW_STATE_RUNNING,
            TransferState::Done => KVW_STATE_DONE,
            TransferState::Failed => KVW_STATE_FAILED,
            TransferState::Cancelled => KVW_STATE_CANCELLED,
        };
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { *out_state = state };
        Ok(())
    })
}

/// Cancels the transfer in `slot` (either side): its unpublished flags fail,
/// so waiters return `KVW_CANCELLED`. A destination's blocks return to the
/// engine once the cancel is answered; a source's once its waits end.
/// `KVW_BAD_REQUEST` if the transfer already finished.
///
/// # Safety
/// `client` NULL or live.
#[no_mangle]
pub unsafe extern "C" fn kvw_cancel(client: *const kvw_client, slot: u16) -> kvw_result {
    client_guard(client, |c| {
        let _call = lock(&c.call);
        c.client.cancel(slot)?;
        Ok(())
    })
}

/// Unregisters rank `rank` of group `group`: the daemon revokes its regions
/// and closes its mapping. After it, the [`kvw_mem`] may be freed or reused
/// freely. The string stays the caller's.
///
/// # Safety
/// `client` NULL or live; `group` NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvw_release_cache(client: *const kvw_client, group: *const c_char, rank: u32) -> kvw_result {
    client_guard(client, |c| {
        // SAFETY: forwarded caller contract.
        let group = unsafe { text(group, "group")? };
        let _call = lock(&c.call);
        c.client.release(group, rank)?;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ptr::{null, null_mut};

    fn strerror(code: u32) -> String {
        let mut buf = [0 as c_char; KVW_MESSAGE_MAX];
        let mut n = 0usize;
        // SAFETY: a live buffer of KVW_MESSAGE_MAX bytes and a live usize.
        assert_eq!(unsafe { kvw_strerror(code, buf.as_mut_ptr(), buf.len(), &mut n) }, KVW_OK);
        // SAFETY: NUL-terminated by kvw_strerror.
        unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().unwrap().to_string()
    }

    #[test]
    fn every_code_has_a_distinct_text_and_daemon_codes_match() {
        let texts: std::collections::HashSet<_> = ALL_RESULTS.iter().map(|r| strerror(*r as u32)).collect();
        assert_eq!(texts.len(), ALL_RESULTS.len());
        assert_eq!(strerror(12345), "unknown kvwire result code");
        use kvwire_client::control::Code;
        for (code, want) in [
            (Code::Malformed, KVW_MALFORMED),
            (Code::BadLayout, KVW_BAD_LAYOUT),
            (Code::BadRequest, KVW_BAD_REQUEST),
            (Code::UnknownPeer, KVW_UNKNOWN_PEER),
            (Code::PeerRefused, KVW_PEER_REFUSED),
            (Code::TransferFailed, KVW_TRANSFER_FAILED),
            (Code::Cancelled, KVW_CANCELLED),
            (Code::PermissionDenied, KVW_PERMISSION_DENIED),
        ] {
            assert_eq!(kvw_result::from_daemon(code as u32), want);
        }
        assert_eq!(kvw_result::from_daemon(2), KVW_UNKNOWN_DAEMON_ERROR);
        assert_eq!(kvw_result::from_daemon(999), KVW_UNKNOWN_DAEMON_ERROR);
    }

    #[test]
    fn null_arguments_and_small_buffers_write_nothing() {
        let mut buf = [7 as c_char; 4];
        let mut n = 99usize;
        // SAFETY: NULLs and live buffers only.
        unsafe {
            assert_eq!(kvw_strerror(0, null_mut(), 10, &mut n), KVW_NULL_ARGUMENT);
            assert_eq!(kvw_strerror(0, buf.as_mut_ptr(), buf.len(), &mut n), KVW_BUFFER_TOO_SMALL);
            assert_eq!((buf, n), ([7; 4], 99));
            let mut c: *mut kvw_client = null_mut();
            assert_eq!(kvw_client_connect(null(), c"x".as_ptr(), &mut c), KVW_NULL_ARGUMENT);
            assert!(c.is_null());
            let mut big = [0 as c_char; KVW_MESSAGE_MAX];
            assert_eq!(kvw_last_error(big.as_mut_ptr(), big.len(), &mut n), KVW_OK);
            assert_eq!(CStr::from_ptr(big.as_ptr()).to_str().unwrap(), "`socket_path` is NULL");
            let bad = [0xffu8 as c_char, 0];
            assert_eq!(kvw_client_connect(bad.as_ptr(), c"x".as_ptr(), &mut c), KVW_INVALID_UTF8);
            assert_eq!(kvw_client_connect(c"/nonexistent/kvw.sock".as_ptr(), c"x".as_ptr(), &mut c), KVW_IO);
            assert!(c.is_null());
            let mut ready = false;
            assert_eq!(kvw_is_ready(null(), 0, KVW_FLAG_DECODER_USABLE, 0, &mut ready), KVW_NULL_ARGUMENT);
            assert_eq!(kvw_mem_ptr(null()), null_mut());
            assert_eq!(kvw_mem_len(null()), 0);
            kvw_mem_free(null_mut());
            kvw_client_free(null_mut());
        }
    }

    #[test]
    fn memory_and_cache_size() {
        // SAFETY: handles from kvw_mem_new, freed once.
        unsafe {
            let mut m: *mut kvw_mem = null_mut();
            assert_eq!(kvw_mem_new(0, &mut m), KVW_INVALID_ARGUMENT);
            assert_eq!(kvw_mem_new(4096, &mut m), KVW_OK);
            assert_eq!(kvw_mem_len(m), 4096);
            *kvw_mem_ptr(m).add(4095) = 1;
            kvw_mem_free(m);
            let model = c"{\"toml\":\"name = \\\"toy\\\"\\ndtype = \\\"bf16\\\"\\n[[layers]]\\nrepeat = 4\\nattention = \\\"dense\\\"\\nkv_heads = 4\\nhead_dim = 16\\n\"}";
            let (mut regions, mut bytes) = (0u32, 0u64);
            let r = kvw_cache_size(model.as_ptr(), c"bf16".as_ptr(), c"tp=2,block=16".as_ptr(), 1, 10, &mut regions, &mut bytes);
            assert_eq!(r, KVW_OK);
            // 4 layers × K,V; 2 heads × 16 dims × 2 bytes per row; 16 rows a block; 10 blocks.
            assert_eq!((regions, bytes), (8, 8 * 10 * 16 * 2 * 16 * 2));
            let r = kvw_cache_size(model.as_ptr(), c"bf16".as_ptr(), c"tp=3".as_ptr(), 0, 10, &mut regions, &mut bytes);
            assert_eq!(r, KVW_BAD_LAYOUT);
            let r = kvw_cache_size(c"{\"nope\":1}".as_ptr(), c"bf16".as_ptr(), c"tp=1".as_ptr(), 0, 10, &mut regions, &mut bytes);
            assert_eq!(r, KVW_INVALID_JSON);
            let mut ns = 0u64;
            assert_eq!(kvw_wait(null(), 0, 9, 0, 0, &mut ns), KVW_NULL_ARGUMENT);
        }
        assert!(matches!(flag_name(9, 0), Err(Fail { code: KVW_INVALID_ARGUMENT, .. })));
        assert!(matches!(flag_name(KVW_FLAG_LAYER_READY, 256), Err(Fail { code: KVW_INVALID_ARGUMENT, .. })));
    }

    #[test]
    fn long_messages_are_clipped_at_a_char_boundary() {
        let s = clip("é".repeat(KVW_MESSAGE_MAX));
        assert!(s.len() < KVW_MESSAGE_MAX && s.len() >= KVW_MESSAGE_MAX - 2);
    }
}
