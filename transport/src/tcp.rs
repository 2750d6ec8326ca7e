//! TCP emulation of one-sided writes (being written).
