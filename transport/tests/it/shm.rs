//! shm tests (being written).
