//! Inventory tests (filled in below).
