//! kvwire-transport integration tests: the shared conformance suite, run
//! against every backend, plus each backend's own cases.

mod conformance;
mod mem;
mod netns;
mod shm;
mod tcp;
mod verbs;
