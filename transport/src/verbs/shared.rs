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
    pub(super) mem: MrMem,
}

/// What an MR covers.
#[derive(Debug)]
pub(super) enum MrMem {
    /// A region of the registry (host memory).
    Region(Arc<Region>),
    /// Device memory through a dmabuf, under a key the registry reserved:
    /// no host mapping, local reads only. The dmabuf's exporter keeps its
    /// pages while the MR holds it.
    Device { key: u32, len: u64, iova: u64 },
}

impl RegionMr {
    pub(super) fn rdesc(&self) -> RegionDesc {
        let (key, addr) = match &self.mem {
            MrMem::Region(r) => (r.key, r.desc().addr),
            MrMem::Device { key, iova, .. } => (*key, *iova),
        };
        RegionDesc { key, addr, len: self.len(), rkey: Some(self.mr.rkey()) }
    }

    /// Bytes it covers.
    pub(super) fn len(&self) -> u64 {
        match &self.mem {
            MrMem::Region(r) => r.len,
            MrMem::Device { len, .. } => *len,
        }
    }

    /// The address its first byte has in work requests.
    pub(super) fn laddr(&self) -> u64 {
        match &self.mem {
            MrMem::Region(r) => r.desc().addr,
            MrMem::Device { iova, .. } => *iova,
        }
    }

    /// Whether a remote peer, node `peer`, may write into it.
    fn granted_to(&self, peer: u64) -> bool {
        matches!(&self.mem, MrMem::Region(r) if r.grant.is_some_and(|g| g.peer == peer))
    }

    /// Whether its key is still registered (or reserved) in `registry`.
    pub(super) fn live(&self, key: u32, registry: &Registry) -> bool {
        match self.mem {
            MrMem::Region(_) => registry.get(key).is_some(),
            MrMem::Device { .. } => registry.is_reserved(key),
        }
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
        mrs.retain(|key, m| m.live(*key, &self.registry));
    }

    /// What node `peer` may write into: the regions granted to it.
    pub(super) fn descs(&self, peer: u64) -> Vec<RegionDesc> {
        self.sweep();
        let mrs = self.mrs.lock().expect("mr lock");
        let mut v: Vec<RegionDesc> = mrs.values().filter(|m| m.granted_to(peer)).map(|m| m.rdesc()).collect();
        v.sort_by_key(|d| d.key);
        v
    }
}
