//! kvwire-transport integration tests: the shared conformance suite, run
//! against every backend, plus each backend's own cases.

mod accept;
mod conformance;
mod device;
mod mem;
mod shm;
mod tcp;
mod verbs;

use kvwire_testkit::netns;
