//! Verbs (RDMA) transport (being written).
