//! kvwire-core integration tests: one module per area.

mod codec;
mod inventory;
mod manifest;
mod oracle;
mod plan;
mod protocol;
mod schedule;
mod session;
mod tensors;
mod timing;
mod topology;
