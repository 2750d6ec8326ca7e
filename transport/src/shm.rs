//! Same-host shared-memory transport (being written).
