//! kvwire's control protocol and its client.
//!
//! Everything a process on the daemon's host needs to drive the local
//! kvwired: the framing ([`wire`]), the requests and replies ([`control`]),
//! [`client::Client`], and the reader of the daemon's metrics text
//! ([`promtext`]). It links no part of the daemon, so the C ABI, the CLI,
//! the fuzz targets and the tests stay small.

#![warn(missing_docs)]

pub mod client;
pub mod control;
pub mod promtext;
pub mod wire;

pub use client::{Client, ClientError, Submitted};
