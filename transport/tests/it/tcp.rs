//! tcp tests (being written).
