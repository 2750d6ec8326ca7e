//! Registered regions of one endpoint, by remote key.
//!
//! Keys are never reused: a key combines a counter with a per-registry
//! salt, so a write aimed at a revoked region can never land in the region
//! registered after it. Revoking a key makes every later write to it fail —
//! how a destination fences stale writes after an abort.

use crate::mem::{HostMem, MemError};
use kvwire_core::protocol::RegionDesc;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// One registered region: a window of a [`HostMem`].
#[derive(Debug)]
pub struct Region {
    /// Remote key.
    pub key: u32,
    /// The memory (kept alive while registered).
    pub mem: Arc<HostMem>,
    /// Start of the window in `mem`.
    pub offset: u64,
    /// Length of the window.
    pub len: u64,
}

impl Region {
    /// What a peer needs to write here (`addr` is the window's address, for verbs).
    pub fn desc(&self) -> RegionDesc {
        RegionDesc { key: self.key, addr: self.mem.as_ptr() as u64 + self.offset, len: self.len, rkey: None }
    }
}

/// Why a registration failed.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum RegistryError {
    /// The window is not inside the memory.
    #[error("region window: {0}")]
    Window(#[from] MemError),
    /// Too many regions.
    #[error("region limit of {0} reached")]
    Limit(usize),
    /// The key chosen for a region is already registered.
    #[error("key {0:#010x} is already registered")]
    KeyInUse(u32),
}

/// The regions of one endpoint.
#[derive(Debug)]
pub struct Registry {
    regions: Mutex<HashMap<u32, Arc<Region>>>,
    next: Mutex<u32>,
    salt: u32,
    limit: usize,
}

impl Registry {
    /// An empty registry holding at most `limit` regions.
    pub fn new(limit: usize) -> Registry {
        // The salt only has to differ between registries and runs; the
        // clock and address are enough for that.
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
        let salt = t ^ (&t as *const u32 as usize as u32).rotate_left(13);
        Registry { regions: Mutex::new(HashMap::new()), next: Mutex::new(1), salt: salt & 0xFFF0_0000, limit }
    }

    /// Registers `mem[offset..offset+len]` and returns it.
    pub fn register(&self, mem: Arc<HostMem>, offset: u64, len: u64) -> Result<Arc<Region>, RegistryError> {
        self.insert(mem, offset, len, None)
    }

    /// Registers a window under a key chosen by the caller (a NIC's rkey,
    /// so local and remote names agree). Refuses a key already in use.
    pub fn register_with_key(&self, mem: Arc<HostMem>, offset: u64, len: u64, key: u32) -> Result<Arc<Region>, RegistryError> {
        self.insert(mem, offset, len, Some(key))
    }

    /// Checks the window and the limit, then inserts under `key`, or under
    /// the next salted counter value.
    fn insert(&self, mem: Arc<HostMem>, offset: u64, len: u64, key: Option<u32>) -> Result<Arc<Region>, RegistryError> {
        mem.check(offset, len)?;
        if len == 0 {
            return Err(RegistryError::Window(MemError::Empty));
        }
        let mut regions = self.regions.lock().expect("registry lock");
        if regions.len() >= self.limit {
            return Err(RegistryError::Limit(self.limit));
        }
        let key = match key {
            Some(k) if regions.contains_key(&k) => return Err(RegistryError::KeyInUse(k)),
            Some(k) => k,
            None => {
                let mut next = self.next.lock().expect("key counter lock");
                let k = self.salt ^ (*next & 0x000F_FFFF) ^ ((*next >> 20) << 20);
                *next = next.wrapping_add(1);
                k
            }
        };
        let region = Arc::new(Region { key, mem, offset, len });
        regions.insert(key, region.clone());
        Ok(region)
    }

    /// Registers a whole mapping.
    pub fn register_all(&self, mem: Arc<HostMem>) -> Result<Arc<Region>, RegistryError> {
        let len = mem.len();
        self.register(mem, 0, len)
    }

    /// Revokes `key`; returns whether it was registered.
    pub fn revoke(&self, key: u32) -> bool {
        self.regions.lock().expect("registry lock").remove(&key).is_some()
    }

    /// The region registered under `key`.
    pub fn get(&self, key: u32) -> Option<Arc<Region>> {
        self.regions.lock().expect("registry lock").get(&key).cloned()
    }

    /// Descriptors of every registered region.
    pub fn descs(&self) -> Vec<RegionDesc> {
        let mut v: Vec<RegionDesc> = self.regions.lock().expect("registry lock").values().map(|r| r.desc()).collect();
        v.sort_by_key(|d| d.key);
        v
    }
}
