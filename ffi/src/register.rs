//! Registering a rank's cache, in host memory ([`kvw_register_cache`]),
//! device memory ([`kvw_register_device_cache`]), or the engine's own
//! tensors in memfds it owns ([`kvw_register_tensors`]).

use crate::args::{model_source, out, request, text};
use crate::boundary::{client_guard, lock, Fail};
use crate::codes::kvw_result::{self, *};
#[cfg(doc)] // for the doc links
use crate::{kvw_cache_size, kvw_client_free, kvw_client_last_error, kvw_release_cache};
use crate::{kvw_client, kvw_mem};
use kvwire_client::control::{DeviceMemory, RegisterCache, RegisterDeviceCache, RegisterDeviceTensors, RegisterTensors};
use kvwire_core::tensors::TensorDesc;
use kvwire_core::reuse::CacheIdentity;
use std::ffi::{c_char, c_int};

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

/// Registers rank `rank` of cache group `group` as the engine's own
/// tensors, mapped by the daemon where they are (no copy). The layout must
/// name their order with `kv=` (a preset: `vllm_nhd`, `vllm_hnd`,
/// `flashinfer`, `flashinfer_hnd`, `vllm_cpu`, `vllm_cross`, or an order
/// word), and padded views their padding with `pad=` (elements after each
/// step of an axis: `pad=b256:t64`); `num_blocks` is the blocks each tensor
/// holds.
///
/// - `tensors_json`: a JSON list, one object per tensor: `{"memory": I,
///   "offset": BYTES, "dtype": "bf16", "shape": [...], "strides": [...]
///   (in elements), "role": "k"|"v"|"kv"|"kv_packed"|"latent" (an MLA
///   layer's latent), "layers": [FIRST,
///   END)}`; `memory` indexes `fds`.
/// - `fds`, `n_fds`: the memfds the tensors live in (shareable memory the
///   engine allocated), at most 128.
///
/// The other arguments and the outputs are those of [`kvw_register_cache`].
/// The descriptors stay the caller's (the daemon maps its own copies); keep
/// the memory alive until [`kvw_release_cache`]. A tensor that does not
/// match the layout, reaches past its memfd, overlaps another or has
/// another dtype than `format` is `KVW_BAD_REGION` (103), named in
/// [`kvw_client_last_error`].
///
/// # Safety
/// As [`kvw_register_cache`]; `fds` readable for `n_fds` ints, each an
/// open descriptor (NULL allowed when `n_fds` is 0).
#[no_mangle]
pub unsafe extern "C" fn kvw_register_tensors(
    client: *const kvw_client,
    group: *const c_char,
    model_json: *const c_char,
    format: *const c_char,
    layout: *const c_char,
    rank: u32,
    num_blocks: u32,
    identity_json: *const c_char,
    tensors_json: *const c_char,
    fds: *const c_int,
    n_fds: usize,
    out_regions: *mut u32,
    out_bytes: *mut u64,
    out_complete: *mut bool,
) -> kvw_result {
    let request = (group, model_json, format, layout, rank, num_blocks, identity_json);
    // SAFETY: forwarded caller contract.
    unsafe { register_engine_tensors(client, request, tensors_json, None, (fds, n_fds), (out_regions, out_bytes, out_complete)) }
}

/// Registers rank `rank` of cache group `group` as the engine's own
/// tensors in device memory, each tensor in a device allocation of its
/// own (vLLM's per-layer GPU tensors), as [`kvw_register_tensors`] does for
/// host memory, with `memory` indexing `memories_json`. The daemon needs a
/// `[device]` backend; it stages each allocation through a host mirror.
///
/// - `memories_json`: a JSON list, one object per allocation:
///   `{"ordinal": N, "len": BYTES, "ipc": [64 bytes of the CUDA IPC
///   handle] or null}`.
/// - `fds`, `n_fds`: none, or one per allocation in order: the stand-in
///   backend's memfds, or CUDA dmabuf fds.
///
/// The other arguments, the outputs and the errors are those of
/// [`kvw_register_tensors`]; no device backend is `KVW_BAD_REGION` (103).
///
/// # Safety
/// As [`kvw_register_tensors`].
#[no_mangle]
pub unsafe extern "C" fn kvw_register_device_tensors(
    client: *const kvw_client,
    group: *const c_char,
    model_json: *const c_char,
    format: *const c_char,
    layout: *const c_char,
    rank: u32,
    num_blocks: u32,
    identity_json: *const c_char,
    tensors_json: *const c_char,
    memories_json: *const c_char,
    fds: *const c_int,
    n_fds: usize,
    out_regions: *mut u32,
    out_bytes: *mut u64,
    out_complete: *mut bool,
) -> kvw_result {
    let request = (group, model_json, format, layout, rank, num_blocks, identity_json);
    // SAFETY: forwarded caller contract.
    unsafe { register_engine_tensors(client, request, tensors_json, Some(memories_json), (fds, n_fds), (out_regions, out_bytes, out_complete)) }
}

/// The arguments of [`register_request`].
type RequestArgs = (*const c_char, *const c_char, *const c_char, *const c_char, u32, u32, *const c_char);

/// Both engine-tensor registrations: in host memfds, or with
/// `memories_json` in device allocations.
///
/// # Safety
/// As [`kvw_register_device_tensors`].
unsafe fn register_engine_tensors(
    client: *const kvw_client,
    (group, model_json, format, layout, rank, num_blocks, identity_json): RequestArgs,
    tensors_json: *const c_char,
    memories_json: Option<*const c_char>,
    (fds, n_fds): (*const c_int, usize),
    (out_regions, out_bytes, out_complete): (*mut u32, *mut u64, *mut bool),
) -> kvw_result {
    client_guard(client, |c| {
        // SAFETY: forwarded caller contract.
        let cache = unsafe { register_request(group, model_json, format, layout, rank, num_blocks, identity_json) }?;
        // SAFETY: NULL or NUL-terminated, per the contract.
        let tensors_json = unsafe { text(tensors_json, "tensors_json") }?;
        let tensors: Vec<TensorDesc> = serde_json::from_str(tensors_json).map_err(|e| {
            Fail::new(KVW_INVALID_JSON, format!("tensors_json: {e} (a list of {{memory, offset, dtype, shape, strides, role, layers}})"))
        })?;
        let memories: Option<Vec<DeviceMemory>> = match memories_json {
            None => None,
            Some(json) => {
                // SAFETY: NULL or NUL-terminated, per the contract.
                let json = unsafe { text(json, "memories_json") }?;
                Some(serde_json::from_str(json).map_err(|e| Fail::new(KVW_INVALID_JSON, format!("memories_json: {e} (a list of {{ordinal, len, ipc}})")))?)
            }
        };
        // SAFETY: forwarded caller contract.
        let borrowed = unsafe { borrowed_fds(fds, n_fds) }?;
        let outs = (out(out_regions, "out_regions")?, out(out_bytes, "out_bytes")?, out(out_complete, "out_complete")?);
        let done = {
            let _call = lock(&c.call);
            match memories {
                None => c.client.register_tensors(RegisterTensors { cache, tensors }, &borrowed)?,
                Some(memories) => c.client.register_device_tensors(RegisterDeviceTensors { cache, tensors, memories }, &borrowed)?,
            }
        };
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { put_registered(outs, done) };
        Ok(())
    })
}

/// The `n_fds` descriptors at `fds`, borrowed for one call: at most
/// [`kvwire_client::wire::MAX_FDS`], each open (NULL allowed when none).
///
/// # Safety
/// `fds` readable for `n_fds` ints, each an open descriptor for the call.
unsafe fn borrowed_fds<'a>(fds: *const c_int, n_fds: usize) -> Result<Vec<std::os::fd::BorrowedFd<'a>>, Fail> {
    if n_fds > kvwire_client::wire::MAX_FDS {
        return Err(Fail::new(KVW_INVALID_ARGUMENT, format!("{n_fds} fds; at most {}", kvwire_client::wire::MAX_FDS)));
    }
    let raw: &[c_int] = match (fds.is_null(), n_fds) {
        (_, 0) => &[],
        (true, _) => return Err(Fail::null("fds")),
        // SAFETY: readable for n_fds ints, per the contract.
        (false, n) => unsafe { std::slice::from_raw_parts(fds, n) },
    };
    if let Some(bad) = raw.iter().find(|&&fd| fd < 0) {
        return Err(Fail::new(KVW_INVALID_ARGUMENT, format!("fd {bad} is not an open descriptor")));
    }
    // SAFETY: open descriptors per the contract, borrowed for this call only.
    Ok(raw.iter().map(|&fd| unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) }).collect())
}

/// The cache registration the register calls send.
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
