//! kvwired integration tests: one module per area; real binaries and daemons.

mod campaign;
mod cli;
mod config;
mod daemons;
mod discovery;
mod report;
mod stats;
mod topology;
