//! kvwire-e2e integration tests: one module per area.

mod daemons;
mod faults;
mod tinylm;

use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Tests whose timings are judged run alone: on 2 cores another test's work
/// would add scheduling gaps that no hop accounts for. Everything else shares.
static TIMED: RwLock<()> = RwLock::new(());

fn shared() -> RwLockReadGuard<'static, ()> {
    TIMED.read().unwrap_or_else(|e| e.into_inner())
}

fn alone() -> RwLockWriteGuard<'static, ()> {
    TIMED.write().unwrap_or_else(|e| e.into_inner())
}
