//! kvwire-e2e integration tests: one module per area.

mod daemons;
mod tinylm;
