//! One thread that runs every transfer's periodic checks (the stripe
//! watchdog, the heartbeat) every few milliseconds. Each transfer used to
//! start a worker for each, woken at its start and again at its end: on a
//! small transfer those wake-ups cost the source more CPU than its bytes,
//! and took a core from the transfer thread at the moment it posts.
//!
//! A check must not block: it looks and returns at once, and hands
//! anything slow (a ping, which waits for its answer) to a worker.

use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Duration;

/// How often every check runs.
pub(super) const PERIOD: Duration = Duration::from_millis(10);

/// A check: runs every [`PERIOD`] until it returns false.
pub(super) type Check = Box<dyn FnMut() -> bool + Send>;

#[derive(Default)]
struct State {
    checks: Vec<Check>,
    // Checks added while the thread runs the others (outside the lock).
    added: Vec<Check>,
    stop: bool,
    // The thread waits on the condvar (it had no checks), rather than
    // between ticks: only then is a new check worth a wake, a system call.
    idle: bool,
}

type Inner = (Mutex<State>, Condvar);

/// The thread and its checks; the thread ends when this is dropped.
pub(super) struct Ticker {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Ticker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.inner.0.lock().expect("ticker lock");
        f.debug_struct("Ticker").field("checks", &(st.checks.len() + st.added.len())).finish()
    }
}

impl Ticker {
    /// Starts the thread, named `name`.
    pub fn start(name: &str) -> std::io::Result<Ticker> {
        let inner: Arc<Inner> = Arc::default();
        let weak = Arc::downgrade(&inner);
        std::thread::Builder::new().name(name.into()).spawn(move || run(&weak))?;
        Ok(Ticker { inner })
    }

    /// Runs `check` from the next tick on, until it returns false.
    pub fn add(&self, check: Check) {
        let (lock, cv) = &*self.inner;
        let mut st = lock.lock().expect("ticker lock");
        st.added.push(check);
        let idle = st.idle;
        drop(st);
        if idle {
            cv.notify_one();
        }
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        let (lock, cv) = &*self.inner;
        lock.lock().expect("ticker lock").stop = true;
        cv.notify_one();
    }
}

fn run(weak: &Weak<Inner>) {
    let mut checks: Vec<Check> = Vec::new();
    loop {
        let Some(inner) = weak.upgrade() else { return };
        {
            let (lock, cv) = &*inner;
            let mut st = lock.lock().expect("ticker lock");
            // Nothing to check: sleep until a check comes (no idle wake-ups).
            while !st.stop && checks.is_empty() && st.added.is_empty() {
                st.idle = true;
                st = cv.wait(st).expect("ticker lock");
                st.idle = false;
            }
            if st.stop {
                return;
            }
            checks.append(&mut st.added);
        }
        drop(inner);
        // A check that panics is dropped alone: the thread, and every other
        // transfer's checks, go on.
        checks.retain_mut(|c| match std::panic::catch_unwind(std::panic::AssertUnwindSafe(&mut *c)) {
            Ok(again) => again,
            Err(p) => {
                tracing::error!(why = super::workers::panic_text(&*p), "a periodic check panicked; it stops");
                false
            }
        });
        std::thread::sleep(PERIOD);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Instant;

    // Threads of this process named `name` (tests run side by side here,
    // so a count of all threads would say nothing).
    fn named(name: &str) -> usize {
        let tasks = std::fs::read_dir("/proc/self/task").unwrap();
        tasks.filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok()).filter(|c| c.trim() == name).count()
    }

    #[test]
    fn a_check_runs_until_it_says_stop_and_the_thread_ends_with_the_ticker() {
        let t = Ticker::start("tick-test").unwrap();
        // The new thread names itself as it starts.
        let started = Instant::now();
        while named("tick-test") == 0 && started.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(PERIOD);
        }
        assert_eq!(named("tick-test"), 1);
        let runs = Arc::new(AtomicUsize::new(0));
        let r = runs.clone();
        t.add(Box::new(move || r.fetch_add(1, Ordering::SeqCst) + 1 < 3));
        let started = Instant::now();
        while runs.load(Ordering::SeqCst) < 3 && started.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(PERIOD);
        }
        // Three runs, then it is gone: no fourth however long we wait.
        std::thread::sleep(5 * PERIOD);
        assert_eq!(runs.load(Ordering::SeqCst), 3);
        // Checks added from inside a check (the lock is not held) run too.
        let (inner_runs, t2) = (Arc::new(AtomicUsize::new(0)), Arc::new(t));
        let (ir, tt) = (inner_runs.clone(), t2.clone());
        t2.add(Box::new(move || {
            let ir = ir.clone();
            tt.add(Box::new(move || {
                ir.fetch_add(1, Ordering::SeqCst);
                false
            }));
            false
        }));
        let started = Instant::now();
        while inner_runs.load(Ordering::SeqCst) == 0 && started.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(PERIOD);
        }
        assert_eq!(inner_runs.load(Ordering::SeqCst), 1);
        // A check that panics goes; the thread and the others stay.
        let after = Arc::new(AtomicUsize::new(0));
        let a = after.clone();
        t2.add(Box::new(|| panic!("boom")));
        t2.add(Box::new(move || a.fetch_add(1, Ordering::SeqCst) < 2));
        let started = Instant::now();
        while after.load(Ordering::SeqCst) < 3 && started.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(PERIOD);
        }
        assert_eq!(after.load(Ordering::SeqCst), 3);
        assert_eq!(named("tick-test"), 1);
        drop(t2);
        let started = Instant::now();
        while named("tick-test") > 0 && started.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(PERIOD);
        }
        assert_eq!(named("tick-test"), 0, "the thread ends with its ticker");
    }
}
