//! kvwire CLI integration tests: one module per area, through the real
//! `kvwire` binary (and real kvwired processes where a command needs one).

mod campaign;
mod cli;
mod report;
mod stats;
mod topology;

use std::process::{Command, Output};

/// Runs the `kvwire` binary this crate tests (cargo's build of it, not
/// whatever sits next to the test executable) with `args`.
fn kvwire(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvwire")).args(args).output().expect("run kvwire")
}
