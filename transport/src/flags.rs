//! Per-layer completion flags in a shared page.
//!
//! One 64-bit word per (transfer slot, layer). Zero means "not ready"; the
//! destination publishes `layer_ready` by storing the publish time
//! (CLOCK_MONOTONIC nanoseconds, never zero) with release ordering, after
//! every byte of the layer was counted as placed. A waiter loads with
//! acquire ordering, so once it sees the flag every placed byte is visible
//! to it, and `now - word` is the `notify` hop. The words live in a memfd
//! so a client process can map the page and wait without a round trip.
//!
//! Waiters sleep on the word with a shared futex (the page is mapped by
//! the daemon and by its clients) and every publish or failure wakes them,
//! so a wait costs no core and is seen within a wake-up, not a poll period.

use crate::mem::{HostMem, MemError};
use kvwire_core::protocol::Tag;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Nanoseconds on CLOCK_MONOTONIC: comparable across processes on one host.
pub fn monotonic_ns() -> u64 {
    let ts = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).expect("CLOCK_MONOTONIC is always available");
    (ts.tv_sec() as u64) * 1_000_000_000 + ts.tv_nsec() as u64
}

/// The flag page of one endpoint.
#[derive(Debug, Clone)]
pub struct FlagTable {
    mem: Arc<HostMem>,
    slots: u16,
    layers: u16,
    // A table only this process waits on counts its sleeping waiters, so
    // a publish nobody sleeps on makes no system call. A shared page's
    // waiters are in other processes too: every publish wakes.
    sleepers: Option<Arc<AtomicU32>>,
}

/// The word value of a flag whose transfer failed: waiters stop waiting.
pub const FAILED: u64 = u64::MAX;

/// A flag wait that ended without the flag.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum WaitError {
    /// Not published in time.
    #[error("{flag} of transfer slot {slot} not ready after {waited:?}", flag = column_name(*layer))]
    Timeout {
        /// Slot.
        slot: u16,
        /// Layer (column).
        layer: u16,
        /// How long it waited.
        waited: Duration,
    },
    /// The transfer failed; the flag will never be published.
    #[error("transfer slot {slot} failed ({flag} will never be ready)", flag = column_name(*layer))]
    Failed {
        /// Slot.
        slot: u16,
        /// Layer (column).
        layer: u16,
    },
}

/// Layer columns of a slot in kvwired's flag page; the two after them are
/// `decoder_usable` and `source_released`.
pub const LAYER_COLUMNS: u16 = 256;

/// The flag a column holds, as the vocabulary names it: `layer_ready(L)`,
/// `decoder_usable` or `source_released`.
pub fn column_name(column: u16) -> String {
    match column {
        c if c < LAYER_COLUMNS => format!("layer_ready({c})"),
        LAYER_COLUMNS => "decoder_usable".into(),
        c if c == LAYER_COLUMNS + 1 => "source_released".into(),
        c => format!("flag column {c}"),
    }
}

impl FlagTable {
    /// A zeroed table for `slots` transfers × `layers` layers.
    pub fn new(slots: u16, layers: u16) -> Result<FlagTable, MemError> {
        // Clients map it read-only: only this process publishes.
        let mem = HostMem::new_for_readers("kvwire-flags", u64::from(slots) * u64::from(layers) * 8)?;
        Ok(FlagTable { mem: Arc::new(mem), slots, layers, sleepers: None })
    }

    /// A table that only this process maps and waits on (never shared
    /// with a client): a publish wakes only when a waiter sleeps.
    pub fn private(slots: u16, layers: u16) -> Result<FlagTable, MemError> {
        Ok(FlagTable { sleepers: Some(Arc::new(AtomicU32::new(0))), ..FlagTable::new(slots, layers)? })
    }

    /// Wakes the waiters of `w` (just stored), unless none can be asleep.
    fn wake(&self, w: &AtomicU64) {
        if let Some(s) = &self.sleepers {
            // Pairs with the waiter's count before its futex wait: either
            // it is counted here, or its wait sees the word changed.
            std::sync::atomic::fence(Ordering::SeqCst);
            if s.load(Ordering::SeqCst) == 0 {
                return;
            }
        }
        futex_wake(w);
    }

    /// The memory holding the words (to share with a client).
    pub fn mem(&self) -> &Arc<HostMem> {
        &self.mem
    }

    /// Maps a flag page received from a daemon (read-only use by clients).
    pub fn from_mem(mem: Arc<HostMem>, slots: u16, layers: u16) -> Result<FlagTable, MemError> {
        mem.check(0, u64::from(slots) * u64::from(layers) * 8)?;
        Ok(FlagTable { mem, slots, layers, sleepers: None })
    }

    /// Transfer slots (rows) of the table.
    pub fn slots(&self) -> u16 {
        self.slots
    }

    /// Whether `tag` has a word in this table.
    pub fn contains(&self, tag: Tag) -> bool {
        tag.slot < self.slots && tag.layer < self.layers
    }

    fn word(&self, tag: Tag) -> Option<&AtomicU64> {
        if !self.contains(tag) {
            return None;
        }
        let index = usize::from(tag.slot) * usize::from(self.layers) + usize::from(tag.layer);
        // SAFETY: the mapping is page-aligned and `index * 8` is inside it
        // (checked above), so the pointer is aligned and valid for the
        // table's lifetime, which `self.mem` holds; the word is only ever
        // accessed atomically, by this process or another mapping the page.
        Some(unsafe { &*(self.mem.as_ptr().add(index * 8) as *const AtomicU64) })
    }

    /// The word of `tag`, where this process may write it.
    fn word_mut(&self, tag: Tag) -> Option<&AtomicU64> {
        self.word(tag).filter(|_| self.mem.writable())
    }

    /// Publishes `layer_ready` for `tag` (release). Returns false when the
    /// tag is outside the table or the table is mapped read-only here.
    pub fn publish(&self, tag: Tag) -> bool {
        match self.word_mut(tag) {
            Some(w) => {
                // Waiters sleep on the low half: it must change too.
                let now = monotonic_ns().max(1);
                let now = if now as u32 == 0 { now + 1 } else { now };
                w.store(now, Ordering::Release);
                self.wake(w);
                true
            }
            None => false,
        }
    }

    /// Marks `tag` failed, unless it was already published.
    pub fn fail(&self, tag: Tag) {
        if let Some(w) = self.word_mut(tag) {
            if w.compare_exchange(0, FAILED, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                self.wake(w);
            }
        }
    }

    /// The publish time of `tag`'s flag, or `None` while not ready (acquire).
    pub fn ready(&self, tag: Tag) -> Option<u64> {
        self.word(tag).map(|w| w.load(Ordering::Acquire)).filter(|&v| v != 0 && v != FAILED)
    }

    /// Whether `tag` was marked failed.
    pub fn failed(&self, tag: Tag) -> bool {
        self.word(tag).is_some_and(|w| w.load(Ordering::Acquire) == FAILED)
    }

    /// Waits until `tag` is ready; returns the `notify` hop (publish → seen).
    pub fn wait(&self, tag: Tag, timeout: Duration) -> Result<Duration, WaitError> {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            if let Some(at) = self.ready(tag) {
                return Ok(Duration::from_nanos(monotonic_ns().saturating_sub(at)));
            }
            if self.failed(tag) {
                return Err(WaitError::Failed { slot: tag.slot, layer: tag.layer });
            }
            let waited = start.elapsed();
            if waited >= timeout {
                return Err(WaitError::Timeout { slot: tag.slot, layer: tag.layer, waited });
            }
            // Spin briefly for latency, then sleep on the word until a
            // publish or failure wakes us (bounded, so a lost wake-up or a
            // kernel without futexes costs at most a short nap).
            spins += 1;
            if spins < 200 {
                std::hint::spin_loop();
            } else if let Some(w) = self.word(tag) {
                if let Some(s) = &self.sleepers {
                    s.fetch_add(1, Ordering::SeqCst);
                }
                futex_wait(w, 0, (timeout - waited).min(Duration::from_millis(50)));
                if let Some(s) = &self.sleepers {
                    s.fetch_sub(1, Ordering::SeqCst);
                }
            } else {
                // Outside the table: nothing will ever be published there.
                std::thread::sleep((timeout - waited).min(Duration::from_millis(50)));
            }
        }
    }

    /// Clears every flag of `slot`, before the slot serves another transfer.
    pub fn clear_slot(&self, slot: u16) {
        for layer in 0..self.layers {
            if let Some(w) = self.word_mut(Tag { slot, layer }) {
                w.store(0, Ordering::Release);
            }
        }
    }
}

/// The address of the word's low half, which the futex calls watch.
fn low_half(w: &AtomicU64) -> *mut u32 {
    let p = w.as_ptr().cast::<u32>();
    if cfg!(target_endian = "little") {
        p
    } else {
        p.wrapping_add(1)
    }
}

/// Sleeps while the low half of `w` still holds `expected`, for at most
/// `timeout`. A shared futex: the word may be in another process's mapping.
fn futex_wait(w: &AtomicU64, expected: u32, timeout: Duration) {
    use nix::libc;
    let ts = libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as libc::c_long };
    // SAFETY: FUTEX_WAIT reads the aligned u32 at `low_half(w)`, which lies
    // inside the live word `w` (an 8-byte-aligned AtomicU64 in a mapping
    // held by the caller), and reads `ts` from this stack frame; it writes
    // nothing. Every argument is passed as a full machine word.
    let rc = unsafe {
        libc::syscall(libc::SYS_futex, low_half(w), libc::FUTEX_WAIT as libc::c_long, expected as libc::c_long, &ts as *const libc::timespec, 0 as libc::c_long, 0 as libc::c_long)
    };
    if rc != 0 {
        let e = std::io::Error::last_os_error().raw_os_error();
        if !matches!(e, Some(libc::EAGAIN | libc::ETIMEDOUT | libc::EINTR)) {
            // No futex here (a sandbox that refuses it): nap instead.
            std::thread::sleep(Duration::from_micros(50).min(timeout));
        }
    }
}

/// Wakes every waiter sleeping on `w`.
fn futex_wake(w: &AtomicU64) {
    use nix::libc;
    // SAFETY: FUTEX_WAKE only uses the address as a key (the u32 at
    // `low_half(w)`, inside the live word `w`); it reads and writes no memory.
    unsafe {
        libc::syscall(libc::SYS_futex, low_half(w), libc::FUTEX_WAKE as libc::c_long, libc::c_long::from(i32::MAX), 0 as libc::c_long, 0 as libc::c_long, 0 as libc::c_long);
    }
}
