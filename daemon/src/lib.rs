//! kvwired: the per-host daemon, and the pieces the `kvwire` CLI shares with it.

#![warn(missing_docs)]

pub mod bench;
pub mod cli;
