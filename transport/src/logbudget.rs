//! Log lines an outsider can cause at will (a connection refused in its
//! handshake, a write refused) are budgeted, so no peer can flood the log:
//! per kind of event and process, the first [`WHOLE_PER_WINDOW`] of each
//! second are logged whole, the rest only counted, and the next line logged
//! says how many were held back before it (`held_back`, a field only such a
//! line has). The daemon's counters have every event.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Events of one kind logged whole per window.
pub const WHOLE_PER_WINDOW: u32 = 4;
const WINDOW: Duration = Duration::from_secs(1);

/// One kind of event's budget.
#[derive(Debug)]
pub struct LogBudget(Mutex<Window>);

#[derive(Debug)]
struct Window {
    start: Option<Instant>,
    logged: u32,
    held: u64,
}

impl LogBudget {
    /// A budget with nothing logged yet.
    pub const fn new() -> LogBudget {
        LogBudget(Mutex::new(Window { start: None, logged: 0, held: 0 }))
    }

    /// One event: Some when it is to be logged whole, with how many were
    /// held back since the last one logged (None when none were: a field
    /// that records nothing); None when it is only counted.
    pub fn admit(&self) -> Option<Option<u64>> {
        let mut w = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        if w.start.is_none_or(|s| now.duration_since(s) >= WINDOW) {
            w.start = Some(now);
            w.logged = 0;
        }
        if w.logged < WHOLE_PER_WINDOW {
            w.logged += 1;
            Some(Some(std::mem::take(&mut w.held)).filter(|&n| n > 0))
        } else {
            w.held += 1;
            None
        }
    }
}

impl Default for LogBudget {
    fn default() -> LogBudget {
        LogBudget::new()
    }
}

/// Data-plane connections that ended in an error (most often refused in
/// their handshake), on every backend.
pub(crate) static CONNECTIONS: LogBudget = LogBudget::new();

/// Writes refused, on every backend.
pub(crate) static WRITES: LogBudget = LogBudget::new();

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_logs_a_few_whole_and_the_next_line_says_how_many_it_held_back() {
        let b = LogBudget::new();
        let got: Vec<_> = (0..10).map(|_| b.admit()).collect();
        let whole = got.iter().filter(|g| g.is_some()).count();
        // Unless the window ended meanwhile (a slow machine), 4 whole, 6 held.
        assert!(whole >= WHOLE_PER_WINDOW as usize && whole < 10, "{got:?}");
        assert_eq!(got[0], Some(None));
        std::thread::sleep(WINDOW);
        let held: u64 = got.iter().flatten().flatten().sum::<u64>() + b.admit().expect("a new window logs whole").expect("it says what was held back");
        assert_eq!(held as usize + whole, 10, "{got:?}");
    }
}
