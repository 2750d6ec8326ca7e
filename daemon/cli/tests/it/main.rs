//! kvwire CLI integration tests: one module per area, through the real
//! `kvwire` binary (and real kvwired processes where a command needs one).

mod campaign;
mod cli;
mod report;
mod stats;
mod topology;
