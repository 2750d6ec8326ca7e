use crate::boundary::{clip, Fail};
use crate::codes::kvw_result::{self, *};
use crate::codes::ALL_RESULTS;
use crate::transfer::flag_name;
use crate::*;
use std::ffi::{c_char, CStr};
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
