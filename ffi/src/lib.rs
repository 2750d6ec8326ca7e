//! kvwire's C ABI: what an inference engine written in C, C++ or Python
//! (over ctypes) links to talk to its host's `kvwired`.
//!
//! The conventions are rustls-ffi's (see `STYLE.md`, "A C ABI people can
//! trust"):
//!
//! - Handles are opaque: `struct kvw_client` (a connection to the local
//!   daemon) and `struct kvw_mem` (a memfd-backed host buffer holding one
//!   rank's cache). Each is made by one function and freed by one `_free`.
//! - Every function runs inside a panic boundary and returns
//!   [`KVW_PANIC`](kvw_result::KVW_PANIC) (or a neutral value, for the few
//!   that return no result code) rather than unwinding into C.
//! - Every pointer is checked for NULL
//!   ([`KVW_NULL_ARGUMENT`](kvw_result::KVW_NULL_ARGUMENT)), before the
//!   function does anything else.
//! - Out-parameters are written only when the function returns
//!   [`KVW_OK`](kvw_result::KVW_OK).
//! - Result codes ([`kvw_result`]) are numbered by family and match the
//!   daemon's error codes where those exist; a retired number is never
//!   reused. [`kvw_strerror`] names each one.
//! - Enumerations passed *in* from C ([`kvw_flag`]) are plain `uint32_t`s
//!   with named constants, so an out-of-range value is an error
//!   ([`KVW_INVALID_ARGUMENT`](kvw_result::KVW_INVALID_ARGUMENT)), never
//!   undefined behaviour.
//!
//! Modules: `codes` (the ABI's numbers), `boundary` (the panic boundary and
//! the failure messages it keeps), `args` (arguments from C), then the
//! functions by area: `message`, `mem`, `layout`, `client`, `register`,
//! `transfer`. Every public item is re-exported here.
//!
//! The header, `ffi/include/kvwire.h`, is generated from this crate by a
//! pinned cbindgen (see `ffi/cbindgen.toml` and `scripts/ffi-check`). It
//! follows the order in which cbindgen meets the items: `codes` first, then
//! the functions' modules in the order declared below; keep that order, or
//! the header reorders.

#![allow(non_camel_case_types)]

// cbindgen meets the items in this order, and the header keeps it (see above).
mod args;
mod boundary;
mod codes;
mod message;
mod mem;
mod layout;
mod client;
mod register;
mod transfer;
#[cfg(test)]
mod tests;

pub use client::{kvw_client, kvw_client_connect, kvw_client_free, kvw_client_node, kvw_client_set_wait_spin};
pub use codes::{
    kvw_flag, kvw_result, kvw_state, KVW_FLAG_DECODER_USABLE, KVW_FLAG_LAYER_READY, KVW_FLAG_SOURCE_RELEASED, KVW_MESSAGE_MAX,
    KVW_STATE_CANCELLED, KVW_STATE_DONE, KVW_STATE_FAILED, KVW_STATE_PREPARED, KVW_STATE_RUNNING,
};
pub use layout::kvw_cache_size;
pub use mem::{kvw_mem, kvw_mem_free, kvw_mem_len, kvw_mem_new, kvw_mem_ptr};
pub use message::{kvw_client_last_error, kvw_last_error, kvw_strerror};
pub use register::{kvw_register_cache, kvw_register_device_cache, kvw_register_tensors};
pub use transfer::{kvw_cancel, kvw_is_ready, kvw_prepare_receive, kvw_prepare_receive_from, kvw_release_cache, kvw_share_group, kvw_produced, kvw_status, kvw_status_json, kvw_submit, kvw_submit_streamed, kvw_wait};
