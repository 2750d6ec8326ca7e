//! Host memory that can be registered: an mmap'd memfd, so the same pages
//! can be passed to another process (SCM_RIGHTS) or a NIC.
//!
//! The bytes are shared with remote writers and other processes, so Rust
//! never holds a `&[u8]` or `&mut [u8]` into them: every access is a raw
//! copy ([`HostMem::write`], [`HostMem::read`]), and whoever reads must
//! first observe the completion flag that covers the range.

use memmap2::{MmapOptions, MmapRaw};
use nix::fcntl::{fcntl, FcntlArg, SealFlag};
use nix::sys::memfd::{memfd_create, MFdFlags};
use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd};

/// Why host memory could not be made or touched.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum MemError {
    /// A system call failed.
    #[error("{op}: {errno}")]
    Os {
        /// What was being done.
        op: &'static str,
        /// The OS error.
        errno: nix::errno::Errno,
    },
    /// An access past the end of the mapping.
    #[error("access of {len} bytes at offset {offset} exceeds {size}-byte mapping")]
    OutOfBounds {
        /// Offset.
        offset: u64,
        /// Length.
        len: u64,
        /// Mapping size.
        size: u64,
    },
    /// A shared file that may shrink under its mapping.
    #[error("shared file cannot be sealed against shrinking ({errno}); create it with memfd_create(MFD_ALLOW_SEALING)")]
    Unsealed {
        /// Why sealing failed.
        errno: nix::errno::Errno,
    },
    /// Zero-sized memory cannot be registered.
    #[error("cannot map 0 bytes")]
    Empty,
    /// A write into memory this process maps read-only.
    #[error("memory is mapped read-only here")]
    ReadOnly,
}

/// A shared, mapped memfd.
#[derive(Debug)]
pub struct HostMem {
    // Field order is drop order: unmap before closing the file.
    map: MmapRaw,
    file: File,
    len: u64,
    writable: bool,
}

fn os(op: &'static str) -> impl Fn(std::io::Error) -> MemError {
    move |e| MemError::Os { op, errno: nix::errno::Errno::from_raw(e.raw_os_error().unwrap_or(0)) }
}

impl HostMem {
    /// A new zero-filled memfd of `len` bytes, mapped read-write and shared.
    pub fn new(name: &str, len: u64) -> Result<HostMem, MemError> {
        HostMem::create(name, len, SealFlag::empty())
    }

    /// Like [`HostMem::new`], but once this mapping exists no one can ever
    /// write the file again except through it: other processes that get
    /// the fd can only map it read-only (F_SEAL_FUTURE_WRITE). For pages a
    /// daemon publishes to its clients.
    pub fn new_for_readers(name: &str, len: u64) -> Result<HostMem, MemError> {
        HostMem::create(name, len, SealFlag::F_SEAL_FUTURE_WRITE)
    }

    fn create(name: &str, len: u64, extra: SealFlag) -> Result<HostMem, MemError> {
        if len == 0 {
            return Err(MemError::Empty);
        }
        let cname = std::ffi::CString::new(name).unwrap_or_else(|_| c"kvwire".into());
        let fd = memfd_create(cname.as_c_str(), MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING)
            .map_err(|errno| MemError::Os { op: "memfd_create", errno })?;
        let file = File::from(fd);
        file.set_len(len).map_err(os("ftruncate"))?;
        // A fixed size, so whoever maps this file (a peer, the daemon) can
        // never be made to fault by it shrinking under the mapping. The
        // mapping comes first: a future-write seal allows only mappings
        // that already exist to write.
        let mem = HostMem::map(file, len, true)?;
        fcntl(&mem.file, FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL | extra))
            .map_err(|errno| MemError::Os { op: "fcntl(F_ADD_SEALS)", errno })?;
        Ok(mem)
    }

    /// Maps a memfd received from another process (SCM_RIGHTS). The file
    /// must be sealed against shrinking — or let this side add that seal —
    /// since a file that shrinks under a mapping turns a copy into SIGBUS.
    pub fn from_file(file: File) -> Result<HostMem, MemError> {
        let len = HostMem::sealed_len(&file)?;
        HostMem::map(file, len, true)
    }

    /// [`HostMem::from_file`], mapped read-only: writes through it fail.
    pub fn from_file_read_only(file: File) -> Result<HostMem, MemError> {
        let len = HostMem::sealed_len(&file)?;
        HostMem::map(file, len, false)
    }

    fn sealed_len(file: &File) -> Result<u64, MemError> {
        let seals = fcntl(file, FcntlArg::F_GET_SEALS).map_err(|errno| MemError::Unsealed { errno })?;
        if seals & SealFlag::F_SEAL_SHRINK.bits() == 0 {
            fcntl(file, FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_SHRINK)).map_err(|errno| MemError::Unsealed { errno })?;
        }
        let len = file.metadata().map_err(os("fstat"))?.len();
        if len == 0 {
            return Err(MemError::Empty);
        }
        Ok(len)
    }

    fn map(file: File, len: u64, writable: bool) -> Result<HostMem, MemError> {
        let size = usize::try_from(len).map_err(|_| MemError::OutOfBounds { offset: 0, len, size: usize::MAX as u64 })?;
        let opts = MmapOptions::new().len(size).to_owned();
        let map = if writable { opts.map_raw(&file) } else { opts.map_raw_read_only(&file) }.map_err(os("mmap"))?;
        Ok(HostMem { map, file, len, writable })
    }

    /// Whether this process may write through the mapping.
    pub fn writable(&self) -> bool {
        self.writable
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Never true: empty memory cannot be made.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Base address of the mapping, for NIC registration and raw copies.
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// The memfd, to pass to another process.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// Checks `offset..offset+len` lies inside the mapping.
    pub fn check(&self, offset: u64, len: u64) -> Result<(), MemError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(MemError::OutOfBounds { offset, len, size: self.len }),
        }
    }

    /// Copies `data` into the mapping at `offset`.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), MemError> {
        self.check(offset, data.len() as u64)?;
        if !self.writable {
            return Err(MemError::ReadOnly);
        }
        // SAFETY: the range is inside the live mapping (checked above), the
        // source is a distinct Rust slice, and no Rust reference into the
        // mapping exists (see module docs); concurrent writers to the same
        // bytes are a protocol error the placement counters detect.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.as_ptr().add(offset as usize), data.len()) };
        Ok(())
    }

    /// Copies `out.len()` bytes from the mapping at `offset` into `out`.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), MemError> {
        self.check(offset, out.len() as u64)?;
        // SAFETY: as in `write`, with the roles of source and destination swapped.
        unsafe { std::ptr::copy_nonoverlapping(self.as_ptr().add(offset as usize), out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// Copies `count` runs of `len` bytes, `stride` apart here and
    /// `dst_stride` apart in `dst`: a strided write's rows in one call.
    #[allow(clippy::too_many_arguments)] // both sides' offsets and strides
    pub fn copy_runs_to(&self, offset: u64, stride: u64, dst: &HostMem, dst_offset: u64, dst_stride: u64, len: u64, count: u64) -> Result<(), MemError> {
        self.copy_runs(offset, stride, dst, dst_offset, dst_stride, len, count, STREAM_ALWAYS, true)
    }

    /// [`HostMem::copy_runs_to`] for bytes nobody reads again soon (part of
    /// a transfer larger than the caches): from [`STREAM_COLD`] bytes on,
    /// back-to-back runs are streamed past the caches.
    #[allow(clippy::too_many_arguments)] // both sides' offsets and strides
    pub fn copy_runs_to_cold(&self, offset: u64, stride: u64, dst: &HostMem, dst_offset: u64, dst_stride: u64, len: u64, count: u64) -> Result<(), MemError> {
        self.copy_runs(offset, stride, dst, dst_offset, dst_stride, len, count, STREAM_COLD, true)
    }

    /// The copy behind every `copy_runs_to*`: streamed from `stream_from`
    /// bytes on; with `fence` false, streamed stores are left unordered
    /// ([`Streaming`] fences them).
    #[allow(clippy::too_many_arguments)] // both sides' offsets and strides, when to stream, and whether to fence
    fn copy_runs(&self, offset: u64, stride: u64, dst: &HostMem, dst_offset: u64, dst_stride: u64, len: u64, count: u64, stream_from: usize, fence: bool) -> Result<(), MemError> {
        if count == 0 {
            return Ok(());
        }
        let span = |step: u64| crate::Stride::span(count, step, len).ok_or(MemError::OutOfBounds { offset, len: u64::MAX, size: self.len() });
        let (src_span, dst_span) = (span(stride)?, span(dst_stride)?);
        self.check(offset, src_span)?;
        dst.check(dst_offset, dst_span)?;
        if !dst.writable {
            return Err(MemError::ReadOnly);
        }
        let (from, to) = (self.as_ptr().wrapping_add(offset as usize), dst.as_ptr().wrapping_add(dst_offset as usize));
        let apart = from as usize + src_span as usize <= to as usize || to as usize + dst_span as usize <= from as usize;
        // SAFETY (all copies below): every run lies inside its span, which
        // was checked to be inside a live mapping. Runs back to back on
        // both sides are one range each; `copy` tolerates overlap (runs
        // that overlap go one by one, in order).
        if apart && (count == 1 || (stride == len && dst_stride == len)) {
            unsafe { copy_apart(from, to, (len * count) as usize, stream_from, fence) };
            return Ok(());
        }
        if count == 1 {
            unsafe { std::ptr::copy(from, to, len as usize) };
            return Ok(());
        }
        let (count, stride, dst_stride) = (count as usize, stride as usize, dst_stride as usize);
        // Rows of whole lines, into lines of their own, past the caches too
        // (a remap's destination rows, at a copy this large).
        #[cfg(target_arch = "x86_64")]
        if apart && len as usize * count >= stream_from && stream::rows_fit(to, dst_stride, len as usize) {
            // SAFETY: as below.
            unsafe { stream::rows(from, stride, to, dst_stride, len as usize, count, fence) };
            return Ok(());
        }
        // A remap's rows are a head's elements: 64 to 512 bytes. Copied at
        // a size known here, each is a few vector moves, not a call of
        // memmove; disjoint spans make that sound.
        match (apart, len) {
            (true, 64) => unsafe { copy_rows::<64>(from, stride, to, dst_stride, count) },
            (true, 128) => unsafe { copy_rows::<128>(from, stride, to, dst_stride, count) },
            (true, 256) => unsafe { copy_rows::<256>(from, stride, to, dst_stride, count) },
            (true, 512) => unsafe { copy_rows::<512>(from, stride, to, dst_stride, count) },
            _ => {
                for i in 0..count {
                    unsafe { std::ptr::copy(from.add(i * stride), to.add(i * dst_stride), len as usize) };
                }
            }
        }
        Ok(())
    }

    /// Copies `len` bytes within or between mappings.
    pub fn copy_to(&self, offset: u64, dst: &HostMem, dst_offset: u64, len: u64) -> Result<(), MemError> {
        self.check(offset, len)?;
        dst.check(dst_offset, len)?;
        if !dst.writable {
            return Err(MemError::ReadOnly);
        }
        let (from, to, n) = (self.as_ptr().wrapping_add(offset as usize), dst.as_ptr().wrapping_add(dst_offset as usize), len as usize);
        // SAFETY: both ranges are inside live mappings (checked); `copy`
        // tolerates overlap when both are the same mapping.
        match from as usize + n <= to as usize || to as usize + n <= from as usize {
            true => unsafe { copy_apart(from, to, n, STREAM_ALWAYS, true) },
            false => unsafe { std::ptr::copy(from, to, n) },
        }
        Ok(())
    }
}

/// A copy this large streams past the caches (non-temporal stores): it
/// cannot stay in them, and glibc streams only past a threshold sized from
/// the whole last-level cache (190 MiB on this project's test host), so
/// below it every written line is first read for ownership.
const STREAM_ALWAYS: usize = 16 << 20;

/// A copy this large, of bytes nobody reads again soon, streams too. A
/// transfer larger than the caches moves in writes of 256 KiB to 1 MiB,
/// and these copied at 0.6x of one whole-buffer copy (7.2 against 11.6
/// GB/s measured in C on the test host; streamed from four pages in turn,
/// 11.8). Bytes read again at once (a small transfer's staging, unpacked
/// and hashed next; the same buffer copied over and over) stay faster in
/// the cache: they are not streamed.
pub const STREAM_COLD: usize = 256 * 1024;

/// Copies `len` bytes between ranges that do not overlap, streaming from
/// `stream_from` bytes on.
///
/// # Safety
/// `len` bytes must be readable at `from` and writable at `to`, and the two
/// ranges must not overlap.
#[inline]
unsafe fn copy_apart(from: *const u8, to: *mut u8, len: usize, stream_from: usize, fence: bool) {
    #[cfg(target_arch = "x86_64")]
    if len >= stream_from {
        // SAFETY: per the function's contract.
        return unsafe { stream::copy(from, to, len, fence) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (stream_from, fence);
    // SAFETY: per the function's contract.
    unsafe { std::ptr::copy_nonoverlapping(from, to, len) }
}

/// Copies of bytes nobody reads again soon (a remap's unpacked rows),
/// streamed past the caches however few bytes each moves (rows where each
/// is whole lines starting a line), with one fence for all of them, when
/// this drops: until then their stores are unordered with what follows.
/// A fence per copy cost a remap's unpack half its time: a 16 MiB
/// transfer's 8192 rows of 2 KiB each, unpacked in 1.9 ms per transfer
/// against 0.8 (kvwire-soak, same minutes). Not `Send`: a fence orders the
/// stores of the thread that issues it.
#[derive(Debug)]
pub struct Streaming(std::marker::PhantomData<*const ()>);

impl Streaming {
    /// No copy yet.
    #[allow(clippy::new_without_default)] // a fence's scope, made where it starts
    pub fn new() -> Streaming {
        Streaming(std::marker::PhantomData)
    }

    /// `src`'s runs into `dst`, laid out as [`HostMem::copy_runs_to`] lays
    /// them out, streamed whatever their size.
    #[allow(clippy::too_many_arguments)] // both sides' offsets and strides
    pub fn copy_runs(&self, src: &HostMem, offset: u64, stride: u64, dst: &HostMem, dst_offset: u64, dst_stride: u64, len: u64, count: u64) -> Result<(), MemError> {
        src.copy_runs(offset, stride, dst, dst_offset, dst_stride, len, count, 0, false)
    }
}

impl Drop for Streaming {
    fn drop(&mut self) {
        // Whoever is told the copies landed must see them.
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a store fence has no preconditions.
        unsafe {
            std::arch::x86_64::_mm_sfence()
        };
    }
}

/// A copy with non-temporal stores. SSE2 only, which every x86_64 has, so
/// no feature check. Lines are read from four pages in turn: more reads in
/// flight than one sequential stream keeps, which is what brings a
/// streamed copy up to (and past) one large memcpy.
#[cfg(target_arch = "x86_64")]
mod stream {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_prefetch, _mm_sfence, _mm_stream_si128, _MM_HINT_T0};

    const PAGE: usize = 4096;
    const PAGES: usize = 4;
    const LINE: usize = 64;

    /// One 64-byte line; `to` 16-byte aligned.
    ///
    /// # Safety
    /// 64 bytes readable at `from`, writable at `to`.
    #[inline(always)]
    unsafe fn line(from: *const u8, to: *mut u8) {
        // SAFETY: per the function's contract; loads are unaligned, stores aligned.
        unsafe {
            let (f, t) = (from as *const __m128i, to as *mut __m128i);
            let (a, b, c, d) = (_mm_loadu_si128(f), _mm_loadu_si128(f.add(1)), _mm_loadu_si128(f.add(2)), _mm_loadu_si128(f.add(3)));
            _mm_stream_si128(t, a);
            _mm_stream_si128(t.add(1), b);
            _mm_stream_si128(t.add(2), c);
            _mm_stream_si128(t.add(3), d);
        }
    }

    /// Ends with a fence unless `fence` is false (the caller's [`super::Streaming`] fences).
    ///
    /// # Safety
    /// As [`super::copy_apart`].
    pub(super) unsafe fn copy(mut from: *const u8, mut to: *mut u8, mut len: usize, fence: bool) {
        // SAFETY (throughout): every access lies in the first `len` bytes
        // of both ranges; a prefetch may point past them, and never faults.
        unsafe {
            // Up to the destination's first whole line, plainly.
            let head = to.align_offset(LINE).min(len);
            std::ptr::copy_nonoverlapping(from, to, head);
            (from, to, len) = (from.add(head), to.add(head), len - head);
            while len >= PAGE * PAGES {
                for o in (0..PAGE).step_by(2 * LINE) {
                    for p in 0..PAGES {
                        let at = p * PAGE + o;
                        _mm_prefetch::<_MM_HINT_T0>(from.wrapping_add(at + 4 * LINE) as *const i8);
                        line(from.add(at), to.add(at));
                        line(from.add(at + LINE), to.add(at + LINE));
                    }
                }
                (from, to, len) = (from.add(PAGE * PAGES), to.add(PAGE * PAGES), len - PAGE * PAGES);
            }
            while len >= LINE {
                line(from, to);
                (from, to, len) = (from.add(LINE), to.add(LINE), len - LINE);
            }
            // Streamed stores are weakly ordered: whoever is told the copy
            // is done must see them.
            if fence {
                _mm_sfence();
            }
            std::ptr::copy_nonoverlapping(from, to, len);
        }
    }

    /// Whether rows of `len` bytes, `dst_stride` apart from `to`, are whole
    /// lines each starting a line: then [`rows`] streams them.
    pub(super) fn rows_fit(to: *mut u8, dst_stride: usize, len: usize) -> bool {
        len > 0 && len % LINE == 0 && dst_stride % LINE == 0 && to.align_offset(LINE) == 0
    }

    /// `count` rows of `len` bytes, `stride` apart at `from` and
    /// `dst_stride` at `to`, with streamed stores: each written line costs
    /// no read for ownership first, which a row copied plainly into cold
    /// memory does.
    ///
    /// Ends with a fence unless `fence` is false, as [`copy`].
    ///
    /// # Safety
    /// As [`super::copy_rows`], and [`rows_fit`] holds.
    pub(super) unsafe fn rows(from: *const u8, stride: usize, to: *mut u8, dst_stride: usize, len: usize, count: usize, fence: bool) {
        // SAFETY (throughout): every access lies in a row, which lies in
        // live memory on both sides; stores are line-aligned (`rows_fit`).
        unsafe {
            for i in 0..count {
                let (f, t) = (from.add(i * stride), to.add(i * dst_stride));
                for o in (0..len).step_by(LINE) {
                    line(f.add(o), t.add(o));
                }
            }
            // As in `copy`: whoever is told the rows landed must see them.
            if fence {
                _mm_sfence();
            }
        }
    }
}

/// `count` rows of `N` bytes, `stride` apart at `from` and `dst_stride` at
/// `to`.
///
/// # Safety
/// Every row must lie inside live memory on both sides, and the two sets of
/// rows must not overlap.
#[inline(always)]
unsafe fn copy_rows<const N: usize>(from: *const u8, stride: usize, to: *mut u8, dst_stride: usize, count: usize) {
    for i in 0..count {
        // SAFETY: per the function's contract.
        unsafe { std::ptr::copy_nonoverlapping(from.add(i * stride), to.add(i * dst_stride), N) };
    }
}
