//! kvwire-core integration tests: one module per area.

mod inventory;
mod plan;
mod protocol;
