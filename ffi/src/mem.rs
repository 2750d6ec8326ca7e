//! Memory: [`kvw_mem`], the memfd-backed host buffer holding one rank's
//! cache.

use crate::args::out;
use crate::boundary::{guard, Fail};
use crate::codes::kvw_result::{self, *};
#[cfg(doc)] // for the doc links
use crate::{kvw_register_cache, kvw_release_cache};
use kvwire_transport::HostMem;
use std::panic::catch_unwind;

/// A memfd-backed, shared, zero-filled host buffer: one rank's cache, its
/// regions back to back in layout order (per held layer: K then V, or the
/// MLA latent, then any state). The engine writes it through
/// [`kvw_mem_ptr`]; [`kvw_register_cache`] hands the memfd to the daemon.
///
/// Made by [`kvw_mem_new`], freed by [`kvw_mem_free`].
#[derive(Debug)]
pub struct kvw_mem {
    pub(crate) mem: HostMem,
}

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
