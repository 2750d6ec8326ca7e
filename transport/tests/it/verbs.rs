//! verbs tests (being written).
