//! What an endpoint's threads and connections share: the device context,
//! the protection domain, and the MRs of its regions.

use super::{VerbsInfo, VerbsLimits};
use crate::placement::Placement;
use crate::registry::{Region, Registry};
use kvwire_core::protocol::RegionDesc;
use sideway::ibverbs::device_context::DeviceContext;
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

/// A registered region together with its NIC registration.
#[derive(Debug)]
pub(super) struct RegionMr {
    // Field order is drop order: deregister the MR before the region (and
    // so possibly the memory) goes away.
    pub(super) mr: Arc<MemoryRegion>,
    pub(super) region: Arc<Region>,
}

impl RegionMr {
    pub(super) fn rdesc(&self) -> RegionDesc {
        RegionDesc { key: self.region.key, addr: self.region.desc().addr, len: self.region.len, rkey: Some(self.mr.rkey()) }
    }
}

/// What the endpoint's threads share.
#[derive(Debug)]
pub(super) struct Shared {
    // Field order is drop order: MRs before the PD and the context they live in
    // (the MRs also hold the PD through an Arc), and before the registry that
    // keeps the memory alive.
    pub(super) mrs: Mutex<HashMap<u32, Arc<RegionMr>>>,
    pub(super) pd: Arc<ProtectionDomain>,
    pub(super) ctx: Arc<DeviceContext>,
    pub(super) registry: Arc<Registry>,
    pub(super) placement: Arc<Placement>,
    pub(super) info: VerbsInfo,
    pub(super) limits: VerbsLimits,
    pub(super) stop: AtomicBool,
}

impl Shared {
    /// Deregisters MRs whose key was revoked through the registry directly.
    pub(super) fn sweep(&self) {
        let mut mrs = self.mrs.lock().expect("mr lock");
        mrs.retain(|key, _| self.registry.get(*key).is_some());
    }

    /// What a peer of `session` may write into: the regions granted to it.
    pub(super) fn descs(&self, session: u64) -> Vec<RegionDesc> {
        self.sweep();
        let mrs = self.mrs.lock().expect("mr lock");
        let mut v: Vec<RegionDesc> = mrs.values().filter(|m| m.region.grant.is_some_and(|g| g.session == session)).map(|m| m.rdesc()).collect();
        v.sort_by_key(|d| d.key);
        v
    }
}
