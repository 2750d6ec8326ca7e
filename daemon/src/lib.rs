//! kvwired: the per-host daemon. The control protocol it serves is in
//! kvwire-client, the `kvwire` CLI in kvwire-cli, the benches in kvwire-bench.

#![warn(missing_docs)]

pub mod config;
pub mod discovery;
pub mod metrics;
pub mod peer;
pub mod server;
pub mod stripe;
