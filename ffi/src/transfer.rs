//! Transfers: prepare, submit, wait on and read flags, status, cancel,
//! release.

use crate::args::{out, put_text, request, table, text};
use crate::boundary::{client_guard, lock, Fail};
use crate::codes::kvw_result::{self, *};
use crate::codes::*;
#[cfg(doc)] // for the doc links
use crate::kvw_mem;
use crate::kvw_client;
use kvwire_client::client::ClientError;
use kvwire_client::control::{FlagName, PrepareReceive, Submit, TransferState, FLAG_SLOTS, MAX_TRANSFER_LAYERS};
use kvwire_transport::flags::WaitError;
use std::ffi::{c_char, c_int};
use std::time::Duration;

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
    // SAFETY: forwarded caller contract; no source, no announcement.
    unsafe { kvw_prepare_receive_from(client, group, request, block_table, n, tokens, prefix_tokens, std::ptr::null(), out_slot, std::ptr::null_mut()) }
}

/// As [`kvw_prepare_receive`], for a request that daemon `source` (its
/// node name; NULL for none) will fill: this daemon announces the receive
/// to it ahead, so its submit starts writing with no round trip to ask
/// where the bytes go. Best effort: writes 1 to `out_announced` when
/// `source` was told, 0 when not (it had no connection here yet, the
/// request is above `transport.announce_max_bytes`; the daemon logs why),
/// and the transfer then starts with the source's offer as usual.
///
/// # Safety
/// As [`kvw_prepare_receive`]; `source` NULL or NUL-terminated;
/// `out_announced` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvw_prepare_receive_from(
    client: *const kvw_client,
    group: *const c_char,
    request: *const c_char,
    block_table: *const u32,
    n: usize,
    tokens: u64,
    prefix_tokens: u64,
    source: *const c_char,
    out_slot: *mut u16,
    out_announced: *mut c_int,
) -> kvw_result {
    client_guard(client, |c| {
        // SAFETY: forwarded caller contract.
        let (group, request, block_table) =
            unsafe { (text(group, "group")?, text(request, "request")?, table(block_table, n)?) };
        // SAFETY: NULL or NUL-terminated per the contract.
        let source = if source.is_null() { None } else { Some(unsafe { text(source, "source")? }) };
        let out_slot = out(out_slot, "out_slot")?;
        let p: PrepareReceive = self::request(serde_json::json!({
            "group": group,
            "request": request,
            "block_table": block_table,
            "tokens": tokens,
            "prefix_tokens": prefix_tokens,
            "source": source,
        }))?;
        let (slot, told) = {
            let _call = lock(&c.call);
            c.client.prepare_announced(p)?
        };
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { *out_slot = slot };
        if !out_announced.is_null() {
            // SAFETY: non-NULL, writable per the contract.
            unsafe { *out_announced = c_int::from(matches!(told, Some(Ok(())))) };
        }
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
    // SAFETY: forwarded caller contract.
    unsafe { submit(client, request, group, block_table, n, tokens, peer, dst_group, dst_request, out_slot, out_peer_slot, false) }
}

/// [`kvw_submit`] for a request whose layers the engine is still writing:
/// returns once the destination accepted, and moves layer L once every
/// source rank that holds part of it called [`kvw_produced`] with more
/// than L layers (before or after this call). A layer's bytes must not
/// change after it was announced, until `source_released`.
///
/// # Safety
/// As [`kvw_submit`].
#[no_mangle]
pub unsafe extern "C" fn kvw_submit_streamed(
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
    // SAFETY: forwarded caller contract.
    unsafe { submit(client, request, group, block_table, n, tokens, peer, dst_group, dst_request, out_slot, out_peer_slot, true) }
}

/// Says layers `0..layers` of request `request` (as its submit names it)
/// are written on rank `rank` of group `group`: a streamed submit moves
/// them. Only the client that registered that rank may say so; counts
/// only grow. `KVW_BAD_REQUEST` for a rank the group does not have or
/// more layers than its model.
///
/// # Safety
/// `client` NULL or live; strings NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvw_produced(client: *const kvw_client, group: *const c_char, request: *const c_char, rank: u32, layers: u16) -> kvw_result {
    client_guard(client, |c| {
        // SAFETY: forwarded caller contract.
        let (group, request) = unsafe { (text(group, "group")?, text(request, "request")?) };
        let _call = lock(&c.call);
        c.client.produced(group, request, rank, layers)?;
        Ok(())
    })
}

#[allow(clippy::too_many_arguments)] // kvw_submit's arguments
unsafe fn submit(
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
    stream: bool,
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
            stream,
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
/// daemon. Polls while recent waits were short ([`crate::kvw_client_set_wait_spin`]),
/// then sleeps in short steps. On success writes the
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

/// Writes the daemon's full status of the transfer in `slot` as JSON into
/// `buf`, NUL-terminated, and its length into `*out_len`, with a round trip
/// to the daemon: `state`, `error` (why it failed), `layers`, `bytes`,
/// `reused_bytes`, `compressed_bytes` (the payload after packing and any
/// codec), `wire_bytes` (what crossed the link, as this side counted it),
/// `elapsed_ns`, the per-hop busy times (`hops`) and the lifetime boundaries this side reached (`marks`: each a
/// `name` such as `layer_ready(3)` or `decoder_usable`, and `at_ns` since
/// this side started the transfer). `KVW_BUFFER_TOO_SMALL` (its message
/// names the size needed) when `len` cannot hold it; nothing is written
/// then. Everything stays the caller's.
///
/// # Safety
/// `client` NULL or live; `buf` NULL or writable for `len` bytes;
/// `out_len` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvw_status_json(
    client: *const kvw_client,
    slot: u16,
    buf: *mut c_char,
    len: usize,
    out_len: *mut usize,
) -> kvw_result {
    client_guard(client, |c| {
        let s = {
            let _call = lock(&c.call);
            c.client.status(slot)?
        };
        let json = serde_json::to_string(&s).map_err(|e| Fail::new(KVW_UNEXPECTED_REPLY, format!("status of slot {slot} as JSON: {e}")))?;
        // SAFETY: forwarded caller contract.
        unsafe { put_text(&json, buf, len, out_len) }
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

/// Shares group `group` among the clients that present `token` (16 bytes
/// at least): each process registering ranks of one group calls this with
/// the same token before `kvw_register_cache`.
/// The first caller owns the group; another token is
/// `KVW_PERMISSION_DENIED`. A group nobody shared belongs to the client
/// that registered its first rank. The strings stay the caller's.
///
/// # Safety
/// `client` NULL or live; `group` and `token` NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvw_share_group(client: *const kvw_client, group: *const c_char, token: *const c_char) -> kvw_result {
    client_guard(client, |c| {
        // SAFETY: forwarded caller contract.
        let group = unsafe { text(group, "group")? };
        // SAFETY: forwarded caller contract.
        let token = unsafe { text(token, "token")? };
        let _call = lock(&c.call);
        c.client.share_group(group, token)?;
        Ok(())
    })
}

pub(crate) fn flag_name(flag: kvw_flag, layer: u32) -> Result<FlagName, Fail> {
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

pub(crate) fn check_slot(slot: u16) -> Result<(), Fail> {
    if slot >= FLAG_SLOTS {
        return Err(Fail::new(KVW_INVALID_ARGUMENT, format!("slot {slot}: the flag page has {FLAG_SLOTS} slots")));
    }
    Ok(())
}
