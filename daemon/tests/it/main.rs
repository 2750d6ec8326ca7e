//! kvwired integration tests: one module per area; real binaries and daemons.

mod config;
mod daemons;
mod discovery;
mod hostile;
mod metrics;
mod stream;
mod tensors;
