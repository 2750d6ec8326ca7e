//! kvwired: the per-host daemon, and the pieces the `kvwire` CLI shares with it.

#![warn(missing_docs)]

pub mod bench;
pub mod campaign;
pub mod cli;
pub mod client;
pub mod config;
pub mod control;
pub mod discovery;
pub mod layouts;
pub mod metrics;
pub mod peer;
pub mod promtext;
pub mod report;
pub mod server;
pub mod staging;
pub mod stripe;
pub mod svg;
pub mod topology;
pub mod wire;
