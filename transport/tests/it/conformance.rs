//! conformance tests (being written).
