//! The client handle: [`kvw_client`], a connection to the local kvwired.

use crate::args::{out, put_text, text};
use crate::boundary::{client_guard, guard, Fail};
use crate::codes::kvw_result;
#[cfg(doc)] // for the doc links
use crate::kvw_last_error;
use kvwire_client::client::Client;
use std::ffi::c_char;
use std::panic::catch_unwind;
use std::path::Path;
use std::sync::Mutex;

/// A connection to the local kvwired, with the daemon's flag page mapped.
///
/// Made by [`kvw_client_connect`], freed by [`kvw_client_free`]. A client
/// may be shared between threads: control calls (register, prepare,
/// submit, status, cancel, release) are serialized on its socket; waits
/// and ready checks read the mapped flag page and run concurrently.
pub struct kvw_client {
    pub(crate) client: Client,
    /// Held for one request/reply exchange on the socket.
    pub(crate) call: Mutex<()>,
    /// The most recent failure's message.
    pub(crate) last_error: Mutex<String>,
}

impl std::fmt::Debug for kvw_client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("kvw_client").field("node", &self.client.node).finish_non_exhaustive()
    }
}

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

/// Sets the longest a [`crate::kvw_wait`] on this client polls the flag
/// page, and a call on it polls for the daemon's reply, before it sleeps,
/// in microseconds (0: every wait sleeps at once; the default is 200). Each
/// polls only while this client's waits of its kind have been that short,
/// yielding the core to any thread that wants it: a thread asleep on an
/// idle core wakes only once the core leaves its halt, tens of
/// microseconds on a virtual machine.
///
/// # Safety
/// `client` is NULL or live.
#[no_mangle]
pub unsafe extern "C" fn kvw_client_set_wait_spin(client: *const kvw_client, micros: u32) -> kvw_result {
    client_guard(client, |c| {
        c.client.set_wait_spin(std::time::Duration::from_micros(u64::from(micros)));
        Ok(())
    })
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
