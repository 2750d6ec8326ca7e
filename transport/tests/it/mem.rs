//! Host memory: sealing, bounds.

use kvwire_transport::mem::{HostMem, MemError, Streaming};
use nix::sys::memfd::{memfd_create, MFdFlags};
use std::fs::File;

#[test]
fn own_memfds_cannot_shrink_under_a_mapping() {
    let m = HostMem::new("t", 4096).unwrap();
    let f = File::from(m.fd().try_clone_to_owned().unwrap());
    assert!(f.set_len(10).is_err(), "sealed memfd shrank");
    assert!(HostMem::from_file(f).is_ok());
}

#[test]
fn foreign_memfds_get_sealed_or_refused() {
    // Sealable but unsealed: the receiver adds the shrink seal itself.
    let f = File::from(memfd_create(c"t", MFdFlags::MFD_ALLOW_SEALING).unwrap());
    f.set_len(4096).unwrap();
    let m = HostMem::from_file(f.try_clone().unwrap()).unwrap();
    assert!(f.set_len(1).is_err());
    assert_eq!(m.len(), 4096);
    // Not sealable: refused by name, nothing mapped.
    let f = File::from(memfd_create(c"t", MFdFlags::empty()).unwrap());
    f.set_len(4096).unwrap();
    let e = HostMem::from_file(f).unwrap_err();
    assert!(matches!(e, MemError::Unsealed { .. }), "{e}");
    assert!(e.to_string().contains("MFD_ALLOW_SEALING"), "{e}");
}

#[test]
fn access_is_bounds_checked() {
    let m = HostMem::new("t", 100).unwrap();
    assert!(matches!(m.write(90, &[0; 11]), Err(MemError::OutOfBounds { offset: 90, len: 11, size: 100 })));
    assert!(matches!(m.read(u64::MAX, &mut [0; 2]), Err(MemError::OutOfBounds { .. })));
    assert_eq!(HostMem::new("t", 0).unwrap_err(), MemError::Empty);
}

/// Strided runs land where a run-by-run copy puts them, whichever way
/// they are copied: rows of a size copied inline, of any other size, back
/// to back on both sides, or overlapping within one mapping.
#[test]
fn strided_runs_copy_as_run_by_run_copies_would() {
    let src = HostMem::new("src", 1 << 16).unwrap();
    let fill: Vec<u8> = (0..1u32 << 16).map(|i| (i * 7 + i / 251) as u8).collect();
    src.write(0, &fill).unwrap();
    // (src offset, src stride, dst offset, dst stride, len, count)
    let cases = [(3, 1024, 5, 256, 256, 40), (0, 256, 64, 1024, 128, 50), (17, 700, 1, 100, 100, 60), (0, 512, 0, 512, 512, 30), (9, 64, 4000, 64, 64, 1)];
    for (so, ss, d0, ds, len, count) in cases {
        let dst = HostMem::new("dst", 1 << 16).unwrap();
        src.copy_runs_to(so, ss, &dst, d0, ds, len, count).unwrap();
        let mut want = vec![0u8; 1 << 16];
        for i in 0..count {
            let (a, b) = ((so + i * ss) as usize, (d0 + i * ds) as usize);
            want[b..b + len as usize].copy_from_slice(&fill[a..a + len as usize]);
        }
        let mut got = vec![0u8; 1 << 16];
        dst.read(0, &mut got).unwrap();
        assert!(got == want, "case {:?}", (so, ss, d0, ds, len, count));
    }
    // Overlapping runs in one mapping copy one by one, in order.
    let m = HostMem::new("one", 4096).unwrap();
    m.write(0, &fill[..4096]).unwrap();
    m.copy_runs_to(0, 128, &m, 64, 128, 128, 8).unwrap();
    let mut want = fill[..4096].to_vec();
    for i in 0..8 {
        want.copy_within(i * 128..i * 128 + 128, 64 + i * 128);
    }
    let mut got = vec![0u8; 4096];
    m.read(0, &mut got).unwrap();
    assert!(got == want, "overlapping runs");
    // A span past either end is refused before any byte moves.
    assert!(src.copy_runs_to(0, 1024, &m, 0, 128, 128, 64).is_err());
}

/// Rows copied cold (from 256 KiB of them on) or through a `Streaming`
/// (any number) land byte for byte like rows
/// copied one by one: streamed where each destination row is whole lines
/// starting a line, plainly where a row or the stride is not (odd row
/// sizes, a destination off a line); the bytes between the rows are
/// untouched.
#[test]
fn cold_rows_land_exactly_streamed_or_not() {
    use kvwire_transport::mem::STREAM_COLD;
    const N: usize = 6 << 20;
    let (src, fill) = filled(N, 29, 4091);
    // (src offset, src stride, dst offset, dst stride, len): a tp8 -> tp2
    // remap's 256-byte rows a kilobyte apart, a source off alignment, rows
    // of odd lengths or strides, and a destination off a line.
    let cases = [(0, 256, 0, 1024, 256), (3, 192, 128, 512, 192), (0, 300, 0, 1024, 300), (0, 256, 64, 1000, 256), (0, 128, 32, 1024, 128), (5, 512, 4096, 2048, 512)];
    // Just past the cold threshold; and a few rows, or a range shorter than
    // a line, copied through a `Streaming`.
    let cold = |len: usize| (STREAM_COLD / len + 1) as u64;
    let runs = cases.iter().map(|&c| (c, cold(c.4), false)).chain(cases.iter().map(|&c| (c, 3, true))).chain([((9, 40, 70, 40, 40), 1, true), ((0, 64, 0, 64, 64), 2, true)]);
    for ((so, ss, d0, ds, len), count, streamed) in runs {
        let (so, ss, d0, ds, len) = (so as u64, ss as u64, d0 as u64, ds as u64, len as u64);
        assert!(so + (count - 1) * ss + len <= N as u64 && d0 + (count - 1) * ds + len <= N as u64);
        let dst = HostMem::new("dst", N as u64).unwrap();
        dst.write(0, &vec![0xCD; N]).unwrap();
        match streamed {
            true => Streaming::new().copy_runs(&src, so, ss, &dst, d0, ds, len, count).unwrap(),
            false => src.copy_runs_to_cold(so, ss, &dst, d0, ds, len, count).unwrap(),
        }
        let mut want = vec![0xCDu8; N];
        for i in 0..count {
            let (a, b) = ((so + i * ss) as usize, (d0 + i * ds) as usize);
            want[b..b + len as usize].copy_from_slice(&fill[a..a + len as usize]);
        }
        let mut got = vec![0u8; N];
        dst.read(0, &mut got).unwrap();
        assert!(got == want, "case {:?}", (so, ss, d0, ds, len, count));
    }
}

/// Many copies through one `Streaming`, fenced once as it drops, land
/// byte for byte: a remap's unpack, segments of 16 rows of 128 bytes from
/// staging into shuffled blocks, whole segments and runs apart alike.
#[test]
fn copies_through_one_streaming_land_exactly() {
    const N: usize = 1 << 20;
    const SEG: usize = 16 * 128;
    let (src, fill) = filled(N, 31, 4099);
    let dst = HostMem::new("dst", 2 * N as u64).unwrap();
    dst.write(0, &vec![0xEE; 2 * N]).unwrap();
    let mut want = vec![0xEEu8; 2 * N];
    // Segment k goes to block (k * 37) % 512: runs back to back for even k,
    // 256 bytes apart (a 128-byte hole after each row) for odd k.
    let s = Streaming::new();
    for k in 0..N / SEG {
        let (from, block) = (k * SEG, (k * 37) % (N / SEG));
        let gap = if k % 2 == 0 { 128 } else { 256 };
        let to = block * 2 * SEG;
        s.copy_runs(&src, from as u64, 128, &dst, to as u64, gap, 128, 16).unwrap();
        for r in 0..16 {
            want[to + r * gap as usize..][..128].copy_from_slice(&fill[from + r * 128..][..128]);
        }
    }
    drop(s);
    let mut got = vec![0u8; 2 * N];
    dst.read(0, &mut got).unwrap();
    assert!(got == want);
}

/// Copies streamed past the caches land byte for byte like small ones,
/// whatever the alignment of either side and whatever is left over after
/// the last whole line or block of pages; the bytes around the destination
/// range are untouched. Cold copies stream from 256 KiB, any copy from 16 MiB.
#[test]
fn streamed_copies_land_exactly_at_any_alignment() {
    use kvwire_transport::mem::STREAM_COLD;
    const N: usize = 3 << 20;
    let (src, fill) = filled(N, 13, 4093);
    let cold = STREAM_COLD;
    // (src offset, dst offset, len): aligned, odd heads, a tail short of a
    // line, of a block, exactly whole blocks, and just under/over the threshold.
    let cases = [(0, 0, 1 << 20), (3, 5, (1 << 20) + 7), (64, 1, (2 << 20) + 16384 * 3 + 100), (4095, 4097, cold), (1, 0, cold - 1), (7, 63, cold + 63), (0, 64, 2 << 20)];
    for (so, d0, len) in cases {
        for runs in [1, 4] {
            let dst = HostMem::new("dst", N as u64).unwrap();
            dst.write(0, &vec![0xAB; N]).unwrap();
            // Back-to-back runs take the same path as one range.
            let run = len / runs;
            src.copy_runs_to_cold(so as u64, run as u64, &dst, d0 as u64, run as u64, run as u64, runs as u64).unwrap();
            let mut want = vec![0xABu8; N];
            want[d0..d0 + run * runs].copy_from_slice(&fill[so..so + run * runs]);
            let mut got = vec![0u8; N];
            dst.read(0, &mut got).unwrap();
            assert!(got == want, "{:?}", (so, d0, len, runs));
        }
    }
    // Past 16 MiB any copy streams.
    const BIG: usize = (16 << 20) + 4096 + 5;
    let (a, b) = (HostMem::new("a", BIG as u64 + 8).unwrap(), HostMem::new("b", BIG as u64 + 8).unwrap());
    let fill: Vec<u8> = (0..BIG as u32 + 8).map(|i| (i * 31 + i / 65521) as u8).collect();
    a.write(0, &fill).unwrap();
    a.copy_to(3, &b, 1, BIG as u64).unwrap();
    let mut got = vec![0u8; BIG + 8];
    b.read(0, &mut got).unwrap();
    assert!(got[1..1 + BIG] == fill[3..3 + BIG] && got[0] == 0 && got[1 + BIG..].iter().all(|&x| x == 0), "16 MiB copy");
    // Overlapping ranges in one mapping still copy as memmove does.
    let m = HostMem::new("one", N as u64).unwrap();
    let fill: Vec<u8> = (0..N as u32).map(|i| (i * 13 + i / 4093) as u8).collect();
    m.write(0, &fill).unwrap();
    m.copy_to(0, &m, 4096 + 3, 1 << 20).unwrap();
    let mut want = fill.clone();
    want.copy_within(0..1 << 20, 4096 + 3);
    let mut got = vec![0u8; N];
    m.read(0, &mut got).unwrap();
    assert!(got == want, "overlapping copy");
}

#[test]
fn a_page_for_readers_is_written_only_by_its_creator() {
    use kvwire_transport::{FlagTable, Tag};
    use std::sync::Arc;
    use std::time::Duration;
    let page = FlagTable::new(2, 4).unwrap();
    let fd = || File::from(page.mem().fd().try_clone_to_owned().unwrap());
    // Another process holding the fd can neither map it writable nor write it.
    assert!(matches!(HostMem::from_file(fd()), Err(MemError::Os { op: "mmap", .. })));
    assert!(std::io::Write::write_all(&mut fd(), &[1; 8]).is_err(), "write(2) to a future-write-sealed memfd");
    let reader = FlagTable::from_mem(Arc::new(HostMem::from_file_read_only(fd()).unwrap()), 2, 4).unwrap();
    let tag = Tag { slot: 1, layer: 2 };
    // A reader's publish is refused, not a fault; the creator's is seen.
    assert!(!reader.publish(tag));
    assert!(reader.ready(tag).is_none());
    assert!(page.publish(tag));
    assert!(reader.wait(tag, Duration::from_secs(1)).is_ok());
    assert_eq!(reader.mem().write(0, &[0; 8]), Err(MemError::ReadOnly));
}

#[test]
fn a_private_table_wakes_its_own_sleeping_waiters_and_skips_the_wake_for_none() {
    use kvwire_transport::flags::WaitError;
    use kvwire_transport::{FlagTable, Tag};
    use std::time::Duration;
    // A table only this process waits on counts its sleepers: a publish
    // with none asleep makes no wake-up call, and one with sleepers wakes
    // them. Waiters here are past their spins long before the publish.
    let table = FlagTable::private(2, 4).unwrap();
    let (ready, failed, early) = (Tag { slot: 0, layer: 1 }, Tag { slot: 1, layer: 3 }, Tag { slot: 1, layer: 0 });
    assert!(table.publish(early));
    assert!(table.wait(early, Duration::from_secs(1)).is_ok(), "published before anyone waited");
    std::thread::scope(|s| {
        let a = s.spawn(|| table.wait(ready, Duration::from_secs(30)));
        let b = s.spawn(|| table.wait(failed, Duration::from_secs(30)));
        std::thread::sleep(Duration::from_millis(200));
        assert!(table.publish(ready));
        table.fail(failed);
        assert!(a.join().unwrap().is_ok());
        assert_eq!(b.join().unwrap(), Err(WaitError::Failed { slot: 1, layer: 3 }));
    });
}

#[test]
fn a_reader_asleep_on_a_flag_is_woken_by_its_publish_and_by_its_failure() {
    use kvwire_transport::flags::WaitError;
    use kvwire_transport::{FlagTable, Tag};
    use std::sync::Arc;
    use std::time::Duration;
    let page = FlagTable::new(2, 4).unwrap();
    let fd = File::from(page.mem().fd().try_clone_to_owned().unwrap());
    let reader = FlagTable::from_mem(Arc::new(HostMem::from_file_read_only(fd).unwrap()), 2, 4).unwrap();
    let (ready, failed) = (Tag { slot: 0, layer: 1 }, Tag { slot: 1, layer: 3 });
    std::thread::scope(|s| {
        // Both waiters are past their spins and asleep in the kernel long
        // before the creator acts; the generous bound only keeps a broken
        // wake-up from hanging the suite.
        let a = s.spawn(|| reader.wait(ready, Duration::from_secs(30)));
        let b = s.spawn(|| reader.wait(failed, Duration::from_secs(30)));
        std::thread::sleep(Duration::from_millis(200));
        assert!(page.publish(ready));
        page.fail(failed);
        assert!(a.join().unwrap().is_ok());
        assert_eq!(b.join().unwrap(), Err(WaitError::Failed { slot: 1, layer: 3 }));
    });
    // A publish never leaves the low half of its word at zero (waiters sleep on it).
    let word = |t: Tag| {
        let mut b = [0u8; 8];
        page.mem().read((u64::from(t.slot) * 4 + u64::from(t.layer)) * 8, &mut b).unwrap();
        u64::from_le_bytes(b)
    };
    assert_ne!(word(ready) as u32, 0);
}

#[test]
fn a_flag_wait_error_names_the_flag_not_its_column() {
    use kvwire_transport::flags::{WaitError, LAYER_COLUMNS};
    use std::time::Duration;
    let waited = Duration::from_millis(5);
    let timeout = |layer| WaitError::Timeout { slot: 7, layer, waited }.to_string();
    assert_eq!(timeout(3), "layer_ready(3) of transfer slot 7 not ready after 5ms");
    assert_eq!(timeout(LAYER_COLUMNS), "decoder_usable of transfer slot 7 not ready after 5ms");
    assert_eq!(timeout(LAYER_COLUMNS + 1), "source_released of transfer slot 7 not ready after 5ms");
    assert_eq!(WaitError::Failed { slot: 2, layer: LAYER_COLUMNS }.to_string(), "transfer slot 2 failed (decoder_usable will never be ready)");
}

/// A mapping of `n` bytes holding a pattern no copy at a wrong offset
/// reproduces, and the pattern.
fn filled(n: usize, mul: u32, div: u32) -> (HostMem, Vec<u8>) {
    let m = HostMem::new("src", n as u64).unwrap();
    let fill: Vec<u8> = (0..n as u32).map(|i| (i * mul + i / div) as u8).collect();
    m.write(0, &fill).unwrap();
    (m, fill)
}
