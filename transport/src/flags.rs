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
//! the daemon and by its clients) and a publish or failure wakes them, so
//! a wait costs no core and is seen within a wake-up, not a poll period.
//!
//! A wake is a system call, and most flags have nobody asleep on them. The
//! clients map the page read-only, so they cannot count themselves in it:
//! each client process declares the words it sleeps on in a page of its
//! own ([`SleepDecl`]), which the daemon reads ([`SleepBoard`]) before it
//! wakes. A client can write only its own page, so it can only delay its
//! own wake-ups (a sleep is bounded; a missed wake costs a short nap), and
//! one that declares nothing is woken on every publish, as before.

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
    // Who may be asleep on a word, so a publish nobody sleeps on makes no
    // system call.
    sleepers: Sleepers,
}

/// Who may sleep on a table's words.
#[derive(Debug, Clone)]
enum Sleepers {
    /// Unknown: every publish wakes.
    Anyone,
    /// Only this process waits on the table: a count of its sleepers.
    Counted(Arc<AtomicU32>),
    /// This process and the clients on the board.
    Board(Arc<SleepBoard>),
    /// A client's table: its waits declare themselves in its page.
    Declared(Arc<SleepDecl>),
}

/// Bytes of a client's sleep page: an overflow count, a high-water mark,
/// then [`SLEEP_ENTRIES`] entries, each 0 or the index of the word a
/// thread of the client sleeps on plus one.
pub const SLEEP_PAGE_BYTES: u64 = 4 * (2 + SLEEP_ENTRIES as u64);

/// Threads of one client that can declare their sleep each in an entry;
/// more are counted in the overflow, which wakes on every publish.
pub const SLEEP_ENTRIES: usize = 62;

/// The u32 words of a sleep page.
fn sleep_words(mem: &HostMem) -> &[AtomicU32] {
    // SAFETY: the mapping is page-aligned and at least SLEEP_PAGE_BYTES
    // long (checked where it was made or adopted), and is held by `mem` for
    // the slice's lifetime; its words are only accessed atomically, here
    // and by the other process mapping it.
    unsafe { std::slice::from_raw_parts(mem.as_ptr() as *const AtomicU32, SLEEP_PAGE_BYTES as usize / 4) }
}

/// A client's sleep page, written by its waits.
#[derive(Debug)]
pub struct SleepDecl {
    mem: Arc<HostMem>,
}

impl SleepDecl {
    /// A fresh page, to hand to the daemon.
    pub fn new() -> Result<SleepDecl, MemError> {
        Ok(SleepDecl { mem: Arc::new(HostMem::new("kvwire-sleepers", SLEEP_PAGE_BYTES)?) })
    }

    /// The page (its fd goes to the daemon).
    pub fn mem(&self) -> &Arc<HostMem> {
        &self.mem
    }

    /// Declares a sleep on word `index`: the entry taken, or None when all
    /// are taken and the overflow counts it instead. Sequentially
    /// consistent, so either the publisher sees it or the sleep sees the
    /// word changed.
    fn enter(&self, index: u32) -> Option<usize> {
        let w = sleep_words(&self.mem);
        for (i, e) in w[2..].iter().enumerate() {
            if e.compare_exchange(0, index + 1, Ordering::SeqCst, Ordering::Relaxed).is_ok() {
                w[1].fetch_max(i as u32 + 1, Ordering::SeqCst);
                return Some(i);
            }
        }
        w[0].fetch_add(1, Ordering::SeqCst);
        None
    }

    fn leave(&self, entry: Option<usize>) {
        let w = sleep_words(&self.mem);
        match entry {
            Some(i) => w[2 + i].store(0, Ordering::SeqCst),
            None => {
                w[0].fetch_sub(1, Ordering::SeqCst);
            }
        }
    }
}

/// The daemon's view of who sleeps on its page: its own waits, and each
/// client's sleep page. A client without one is woken on every publish.
#[derive(Debug, Default)]
pub struct SleepBoard {
    local: AtomicU32,
    undeclared: AtomicU32,
    pages: std::sync::RwLock<Vec<(u64, Arc<HostMem>)>>,
}

impl SleepBoard {
    /// A client that maps the page and has not declared a sleep page yet.
    /// Owns its share of the board: a client's state may move between
    /// the daemon's threads.
    pub fn undeclared(self: &Arc<Self>) -> Undeclared {
        self.undeclared.fetch_add(1, Ordering::SeqCst);
        Undeclared { board: self.clone(), counted: true }
    }

    /// Client `client`'s sleep page, read before every wake from now on,
    /// until [`SleepBoard::remove`]. Refused when it is too short.
    pub fn add(&self, client: u64, mem: Arc<HostMem>) -> Result<(), MemError> {
        mem.check(0, SLEEP_PAGE_BYTES)?;
        let mut pages = self.pages.write().expect("sleep board lock");
        pages.retain(|(c, _)| *c != client);
        pages.push((client, mem));
        Ok(())
    }

    /// Client `client` went away.
    pub fn remove(&self, client: u64) {
        self.pages.write().expect("sleep board lock").retain(|(c, _)| *c != client);
    }

    /// Whether anyone may sleep on word `index` (after a SeqCst fence).
    fn anyone_on(&self, index: u32) -> bool {
        if self.local.load(Ordering::SeqCst) > 0 || self.undeclared.load(Ordering::SeqCst) > 0 {
            return true;
        }
        let pages = self.pages.read().expect("sleep board lock");
        pages.iter().any(|(_, mem)| {
            let w = sleep_words(mem);
            // A client's own high-water mark bounds the scan; a wrong one
            // costs it its wake-ups, or this daemon a few more loads.
            let high = (w[1].load(Ordering::SeqCst) as usize).min(SLEEP_ENTRIES);
            w[0].load(Ordering::SeqCst) > 0 || w[2..2 + high].iter().any(|e| e.load(Ordering::SeqCst) == index + 1)
        })
    }
}

/// A client counted as waking on every publish, until it declares its
/// sleep page or goes away.
#[derive(Debug)]
pub struct Undeclared {
    board: Arc<SleepBoard>,
    counted: bool,
}

impl Undeclared {
    /// The client declared its page: no longer counted.
    pub fn declared(&mut self) {
        if std::mem::take(&mut self.counted) {
            self.board.undeclared.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Drop for Undeclared {
    fn drop(&mut self) {
        self.declared();
    }
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
        Ok(FlagTable { mem: Arc::new(mem), slots, layers, sleepers: Sleepers::Anyone })
    }

    /// A table that only this process maps and waits on (never shared
    /// with a client): a publish wakes only when a waiter sleeps.
    pub fn private(slots: u16, layers: u16) -> Result<FlagTable, MemError> {
        Ok(FlagTable { sleepers: Sleepers::Counted(Arc::new(AtomicU32::new(0))), ..FlagTable::new(slots, layers)? })
    }

    /// A table shared with clients that declare their sleeps on `board`:
    /// a publish wakes only when someone may sleep on its word.
    pub fn shared(slots: u16, layers: u16, board: Arc<SleepBoard>) -> Result<FlagTable, MemError> {
        Ok(FlagTable { sleepers: Sleepers::Board(board), ..FlagTable::new(slots, layers)? })
    }

    /// Wakes the waiters of word `index` (`w`, just stored), unless none can be asleep.
    fn wake(&self, index: u32, w: &AtomicU64) {
        // Pairs with a waiter's declaration before its futex wait: either
        // it is seen here, or its wait sees the word changed.
        let anyone = match &self.sleepers {
            Sleepers::Anyone | Sleepers::Declared(_) => true,
            Sleepers::Counted(n) => {
                std::sync::atomic::fence(Ordering::SeqCst);
                n.load(Ordering::SeqCst) > 0
            }
            Sleepers::Board(b) => {
                std::sync::atomic::fence(Ordering::SeqCst);
                b.anyone_on(index)
            }
        };
        if anyone {
            futex_wake(w);
        }
    }

    /// The memory holding the words (to share with a client).
    pub fn mem(&self) -> &Arc<HostMem> {
        &self.mem
    }

    /// Maps a flag page received from a daemon (read-only use by clients).
    pub fn from_mem(mem: Arc<HostMem>, slots: u16, layers: u16) -> Result<FlagTable, MemError> {
        mem.check(0, u64::from(slots) * u64::from(layers) * 8)?;
        Ok(FlagTable { mem, slots, layers, sleepers: Sleepers::Anyone })
    }

    /// As [`FlagTable::from_mem`], for a client whose waits declare
    /// themselves in `decl`, a page the daemon reads.
    pub fn from_mem_declaring(mem: Arc<HostMem>, slots: u16, layers: u16, decl: Arc<SleepDecl>) -> Result<FlagTable, MemError> {
        Ok(FlagTable { sleepers: Sleepers::Declared(decl), ..FlagTable::from_mem(mem, slots, layers)? })
    }

    /// Transfer slots (rows) of the table.
    pub fn slots(&self) -> u16 {
        self.slots
    }

    /// Whether `tag` has a word in this table.
    pub fn contains(&self, tag: Tag) -> bool {
        tag.slot < self.slots && tag.layer < self.layers
    }

    /// The index of `tag`'s word (inside the table or not).
    fn index(&self, tag: Tag) -> u32 {
        u32::from(tag.slot) * u32::from(self.layers) + u32::from(tag.layer)
    }

    fn word(&self, tag: Tag) -> Option<&AtomicU64> {
        if !self.contains(tag) {
            return None;
        }
        let index = self.index(tag) as usize;
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
                self.wake(self.index(tag), w);
                true
            }
            None => false,
        }
    }

    /// Marks `tag` failed, unless it was already published.
    pub fn fail(&self, tag: Tag) {
        if let Some(w) = self.word_mut(tag) {
            if w.compare_exchange(0, FAILED, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                self.wake(self.index(tag), w);
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
        self.wait_spinning(tag, timeout, Duration::ZERO)
    }

    /// [`FlagTable::wait`], but polling the word for up to `spin` before it
    /// sleeps, yielding the core to any other thread that wants it. A
    /// sleeper on an idle core is woken only once that core leaves its
    /// halt; a poller's core never halts.
    pub fn wait_spinning(&self, tag: Tag, timeout: Duration, spin: Duration) -> Result<Duration, WaitError> {
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
            } else if waited < spin {
                std::thread::yield_now();
            } else if let Some(w) = self.word(tag) {
                let nap = (timeout - waited).min(Duration::from_millis(50));
                match &self.sleepers {
                    Sleepers::Anyone => futex_wait(w, 0, nap),
                    Sleepers::Counted(n) => counted_wait(n, w, nap),
                    Sleepers::Board(b) => counted_wait(&b.local, w, nap),
                    Sleepers::Declared(d) => {
                        let entry = d.enter(self.index(tag));
                        futex_wait(w, 0, nap);
                        d.leave(entry);
                    }
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

/// A futex wait counted in `n` while it sleeps.
fn counted_wait(n: &AtomicU32, w: &AtomicU64, nap: Duration) {
    n.fetch_add(1, Ordering::SeqCst);
    futex_wait(w, 0, nap);
    n.fetch_sub(1, Ordering::SeqCst);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The daemon's table on `board`, and a client's view of the same page
    /// declaring its sleeps in a page the board reads.
    fn daemon_and_client(board: &Arc<SleepBoard>) -> (FlagTable, FlagTable, Arc<SleepDecl>) {
        let daemon = FlagTable::shared(4, 3, board.clone()).unwrap();
        let decl = Arc::new(SleepDecl::new().unwrap());
        board.add(7, decl.mem().clone()).unwrap();
        let client = FlagTable::from_mem_declaring(daemon.mem().clone(), 4, 3, decl.clone()).unwrap();
        (daemon, client, decl)
    }

    #[test]
    fn a_publish_wakes_only_a_word_a_client_declared_it_sleeps_on() {
        let board = Arc::new(SleepBoard::default());
        let (_daemon, client, decl) = daemon_and_client(&board);
        let word = client.index(Tag { slot: 2, layer: 1 });
        assert!(!board.anyone_on(word), "nobody sleeps yet");
        let entry = decl.enter(word);
        assert!(board.anyone_on(word));
        assert!(!board.anyone_on(word + 1), "another word wakes nobody");
        decl.leave(entry);
        assert!(!board.anyone_on(word));
        // More sleeping threads than entries: the rest are counted, and
        // every word wakes while they sleep.
        let taken: Vec<_> = (0..SLEEP_ENTRIES).map(|_| decl.enter(word)).collect();
        assert!(taken.iter().all(Option::is_some));
        let over = decl.enter(word + 2);
        assert_eq!(over, None);
        assert!(board.anyone_on(0));
        decl.leave(over);
        taken.into_iter().for_each(|e| decl.leave(e));
        assert!(!board.anyone_on(word));
        // A client gone: its page is no longer read.
        let e = decl.enter(word);
        board.remove(7);
        assert!(!board.anyone_on(word));
        decl.leave(e);
    }

    #[test]
    fn a_client_that_has_not_declared_and_the_daemons_own_waits_wake_every_word() {
        let board = Arc::new(SleepBoard::default());
        let (daemon, _client, _decl) = daemon_and_client(&board);
        let mut u = board.undeclared();
        assert!(board.anyone_on(5));
        u.declared();
        assert!(!board.anyone_on(5));
        drop(u);
        assert!(!board.anyone_on(5), "declared once, uncounted once");
        drop(board.undeclared());
        assert!(!board.anyone_on(5), "gone before declaring: uncounted");
        // A wait in the daemon itself counts while it sleeps.
        let tag = Tag { slot: 1, layer: 2 };
        let waiter = {
            let d = daemon.clone();
            std::thread::spawn(move || d.wait(tag, Duration::from_secs(30)))
        };
        let b = board.clone();
        let asleep = move || b.local.load(Ordering::SeqCst) > 0;
        let started = Instant::now();
        while !asleep() && started.elapsed() < Duration::from_secs(30) {
            std::thread::yield_now();
        }
        assert!(board.anyone_on(daemon.index(tag)));
        assert!(daemon.publish(tag));
        assert!(waiter.join().unwrap().is_ok());
    }

    #[test]
    fn a_polling_wait_declares_no_sleep_until_its_window_is_spent() {
        let board = Arc::new(SleepBoard::default());
        let (daemon, client, _decl) = daemon_and_client(&board);
        let client = Arc::new(client);
        // Within its window: polling, never asleep on the word, and it
        // sees the publish.
        let tag = Tag { slot: 1, layer: 2 };
        let waiter = {
            let c = client.clone();
            std::thread::spawn(move || c.wait_spinning(tag, Duration::from_secs(30), Duration::from_secs(3600)))
        };
        let until = Instant::now() + Duration::from_millis(50);
        while Instant::now() < until {
            assert!(!board.anyone_on(client.index(tag)), "a polling wait declared a sleep");
            std::thread::yield_now();
        }
        assert!(daemon.publish(tag));
        assert!(waiter.join().unwrap().is_ok());
        // Its window spent: asleep, declared, and woken by the publish.
        let tag = Tag { slot: 2, layer: 0 };
        let waiter = {
            let c = client.clone();
            std::thread::spawn(move || c.wait_spinning(tag, Duration::from_secs(30), Duration::from_micros(100)))
        };
        let started = Instant::now();
        while !board.anyone_on(client.index(tag)) {
            assert!(started.elapsed() < Duration::from_secs(30), "the wait never slept");
            std::thread::yield_now();
        }
        assert!(daemon.publish(tag));
        assert!(waiter.join().unwrap().is_ok());
    }

    #[test]
    fn a_sleep_page_too_short_is_refused() {
        let board = SleepBoard::default();
        let short = Arc::new(HostMem::new("short", 8).unwrap());
        assert!(board.add(1, short).is_err());
    }
}
