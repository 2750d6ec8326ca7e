//! Plan tests (filled in below).
