//! kvwired integration tests: one module per area; real binaries and daemons.

mod cli;
mod config;
mod daemons;
mod stats;
