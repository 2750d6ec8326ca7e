//! kvwire-transport integration tests: the shared conformance suite, run
//! against every backend, plus each backend's own cases.

mod accept;
mod conformance;
mod device;
mod mem;
#[path = "../../../tests/src/netns.rs"]
#[allow(dead_code)] // shared with kvwire-e2e, which uses all of it
mod netns;
mod shm;
mod tcp;
mod verbs;
