//! Registered regions of one endpoint, by remote key, and the data-plane
//! sessions peers may prove ([`crate::auth`]).
//!
//! A region is local (what this side's writes read from; no peer may
//! write into it) or granted to one peer node and one transfer slot
//! ([`Grant`]): only a connection that proved a session of that node may
//! write into it, and only with that slot's tag. A cache's own regions are
//! local; a destination grants each transfer windows of its own.
//!
//! The grant names the node, not one session: a source with several
//! connections to this daemon may run a transfer negotiated (or
//! announced) on one of them over another's data connections. A node's id
//! lasts while it has a session open here; once its last closes, a
//! reconnecting node gets a new one, so nothing granted before is
//! writable by it.
//!
//! Keys are unpredictable and never reused within a registry, so a write aimed
//! at a revoked region can never land in the region registered after it,
//! and no key can be guessed from another. Revoking a key makes every
//! later write to it fail — how a destination fences stale writes after
//! an abort.

use crate::auth::Credential;
use crate::mem::{HostMem, MemError};
use kvwire_core::protocol::RegionDesc;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Whom a region is open to for remote writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Grant {
    /// The node whose data-plane connections may write: its id here
    /// ([`Registry::open_session`]).
    pub peer: u64,
    /// The slot every write into it must be tagged with.
    pub slot: u16,
}

/// `n` through a four-round Feistel network with round keys `keys`: a
/// permutation of u32, so distinct counters give distinct keys. The round
/// function is a seeded hash, not a MAC: a transfer registers a region per
/// layer and tensor, and this runs for each, on the transfer's critical path.
fn permuted(keys: &[u64; 4], n: u32) -> u32 {
    let (mut l, mut r) = ((n >> 16) as u16, n as u16);
    for k in keys {
        let f = twox_hash::XxHash3_64::oneshot_with_seed(*k, &r.to_le_bytes());
        (l, r) = (r, l ^ f as u16);
    }
    (u32::from(l) << 16) | u32::from(r)
}

fn random_round_keys() -> [u64; 4] {
    let b = crate::auth::random_bytes::<32>();
    std::array::from_fn(|i| u64::from_le_bytes(b[8 * i..8 * i + 8].try_into().expect("8 bytes")))
}

/// Most sessions one registry holds (each is an authenticated peer connection).
pub const MAX_SESSIONS: usize = 4096;

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
    /// Who may write into it from afar; None: nobody (a local region).
    pub grant: Option<Grant>,
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
    /// Too many sessions.
    #[error("session limit of {MAX_SESSIONS} reached")]
    Sessions,
}

/// A data-plane session as the destination knows it.
#[derive(Debug, Clone)]
pub struct Session {
    /// Its credential.
    pub credential: Credential,
    /// The node that authenticated it: the only name its connections may give.
    pub peer: String,
    /// That node's id here, which grants name ([`Grant::peer`]).
    pub peer_id: u64,
}

/// Open sessions, and the nodes they belong to.
#[derive(Debug, Default)]
struct Sessions {
    by_id: HashMap<u64, Session>,
    // Each node with a session open: its id, and how many it has open.
    peers: HashMap<String, (u64, usize)>,
    next_peer: u64,
}

impl Sessions {
    /// Drops session `id`; the node's id when it was its last.
    fn remove(&mut self, id: u64) -> Option<u64> {
        let s = self.by_id.remove(&id)?;
        let e = self.peers.get_mut(&s.peer).expect("an open session's node is counted");
        e.1 -= 1;
        (e.1 == 0).then(|| self.peers.remove(&s.peer).expect("just seen").0)
    }
}

/// The regions of one endpoint.
#[derive(Debug)]
pub struct Registry {
    regions: Mutex<HashMap<u32, Arc<Region>>>,
    // Keys are a keyed permutation of a counter: distinct for 2^32
    // registrations, and unpredictable without `permute`.
    next: Mutex<u32>,
    permute: [u64; 4],
    sessions: Mutex<Sessions>,
    /// Keys taken by memory a NIC registered without a host mapping
    /// (device memory through a dmabuf): never handed to a region.
    reserved: Mutex<std::collections::HashSet<u32>>,
    limit: usize,
    handshakes_refused: Arc<std::sync::atomic::AtomicU64>,
}

impl Registry {
    /// An empty registry holding at most `limit` regions.
    pub fn new(limit: usize) -> Registry {
        Registry {
            regions: Mutex::new(HashMap::new()),
            next: Mutex::new(0),
            permute: random_round_keys(),
            sessions: Mutex::new(Sessions::default()),
            reserved: Mutex::new(Default::default()),
            limit,
            handshakes_refused: Default::default(),
        }
    }

    /// Data-plane connections that failed their handshake here (proved no
    /// open session, sent no valid hello, or went away), on every backend:
    /// the counter itself, for a daemon's metrics to share.
    pub fn handshakes_refused(&self) -> &Arc<std::sync::atomic::AtomicU64> {
        &self.handshakes_refused
    }

    pub(crate) fn handshake_refused(&self) {
        self.handshakes_refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Registers `mem[offset..offset+len]`, open to remote writes as
    /// `grant` says (None: local only), and returns it.
    pub fn register(&self, mem: Arc<HostMem>, offset: u64, len: u64, grant: Option<Grant>) -> Result<Arc<Region>, RegistryError> {
        self.insert(mem, offset, len, None, grant)
    }

    /// Registers a window under a key chosen by the caller (a NIC's rkey,
    /// so local and remote names agree). Refuses a key already in use.
    pub fn register_with_key(&self, mem: Arc<HostMem>, offset: u64, len: u64, key: u32, grant: Option<Grant>) -> Result<Arc<Region>, RegistryError> {
        self.insert(mem, offset, len, Some(key), grant)
    }

    /// Checks the window and the limit, then inserts under `key`, or under
    /// a fresh random key.
    fn insert(&self, mem: Arc<HostMem>, offset: u64, len: u64, key: Option<u32>, grant: Option<Grant>) -> Result<Arc<Region>, RegistryError> {
        mem.check(offset, len)?;
        if len == 0 {
            return Err(RegistryError::Window(MemError::Empty));
        }
        let mut regions = self.regions.lock().expect("registry lock");
        let reserved = self.reserved.lock().expect("reserved keys lock");
        // Reserved keys are registrations too (device memory a NIC holds).
        if regions.len() + reserved.len() >= self.limit {
            return Err(RegistryError::Limit(self.limit));
        }
        let key = match key {
            Some(k) if regions.contains_key(&k) || reserved.contains(&k) => return Err(RegistryError::KeyInUse(k)),
            Some(k) => k,
            None => self.fresh(&regions, &reserved),
        };
        let region = Arc::new(Region { key, mem, offset, len, grant });
        regions.insert(key, region.clone());
        Ok(region)
    }

    /// A key no region or reservation holds, from the keyed counter.
    fn fresh(&self, regions: &HashMap<u32, Arc<Region>>, reserved: &std::collections::HashSet<u32>) -> u32 {
        let mut next = self.next.lock().expect("key lock");
        loop {
            let k = permuted(&self.permute, *next);
            *next = next.wrapping_add(1);
            // 0 reads as "no key" in logs; a key a NIC chose may be in use.
            if k != 0 && !regions.contains_key(&k) && !reserved.contains(&k) {
                break k;
            }
        }
    }

    /// Takes a key for memory registered outside the registry (a NIC's
    /// registration of device memory), under the region limit; no region
    /// gets it until [`Registry::revoke`] gives it back.
    pub fn reserve(&self) -> Result<u32, RegistryError> {
        let regions = self.regions.lock().expect("registry lock");
        let mut reserved = self.reserved.lock().expect("reserved keys lock");
        if regions.len() + reserved.len() >= self.limit {
            return Err(RegistryError::Limit(self.limit));
        }
        let k = self.fresh(&regions, &reserved);
        reserved.insert(k);
        Ok(k)
    }

    /// Whether `key` is reserved ([`Registry::reserve`]).
    pub fn is_reserved(&self, key: u32) -> bool {
        self.reserved.lock().expect("reserved keys lock").contains(&key)
    }

    /// Registers a whole mapping, local only.
    pub fn register_all(&self, mem: Arc<HostMem>) -> Result<Arc<Region>, RegistryError> {
        let len = mem.len();
        self.register(mem, 0, len, None)
    }

    /// Revokes `key` (a region's, or a reservation); returns whether it was registered.
    pub fn revoke(&self, key: u32) -> bool {
        let region = self.regions.lock().expect("registry lock").remove(&key).is_some();
        region | self.reserved.lock().expect("reserved keys lock").remove(&key)
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

    /// Opens a session that connections of node `peer` may prove, and
    /// returns the node's id: what a [`Grant`] to it names.
    pub fn open_session(&self, credential: &Credential, peer: &str) -> Result<u64, RegistryError> {
        let mut s = self.sessions.lock().expect("session lock");
        if s.by_id.len() >= MAX_SESSIONS && !s.by_id.contains_key(&credential.session) {
            return Err(RegistryError::Sessions);
        }
        // Opened again (the same credential): counted once, for the node it
        // names now; for the same node, under the id it has.
        if let Some(open) = s.by_id.get_mut(&credential.session).filter(|o| o.peer == peer) {
            open.credential = credential.clone();
            return Ok(open.peer_id);
        }
        s.remove(credential.session);
        let fresh = s.next_peer + 1;
        let e = s.peers.entry(peer.to_string()).or_insert((fresh, 0));
        e.1 += 1;
        let peer_id = e.0;
        if peer_id == fresh {
            s.next_peer = fresh;
        }
        s.by_id.insert(credential.session, Session { credential: credential.clone(), peer: peer.into(), peer_id });
        Ok(peer_id)
    }

    /// Closes a session: no new connection can prove it. (Its regions
    /// are revoked by whoever granted them.) Returns its node's id when
    /// this was the node's last session here: what was granted to it is
    /// then writable by no connection, now or later.
    pub fn close_session(&self, session: u64) -> Option<u64> {
        self.sessions.lock().expect("session lock").remove(session)
    }

    /// The session `id`, while open.
    pub fn session(&self, id: u64) -> Option<Session> {
        self.sessions.lock().expect("session lock").by_id.get(&id).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_keeps_its_id_while_any_of_its_sessions_is_open() {
        let r = Registry::new(2);
        let (a1, a2, b) = (Credential::random(), Credential::random(), Credential::random());
        let a = r.open_session(&a1, "a").unwrap();
        assert_eq!(r.open_session(&a1, "a").unwrap(), a, "its only session, opened again");
        assert_eq!(r.open_session(&a2, "a").unwrap(), a, "one id for a node's sessions");
        let other = r.open_session(&b, "b").unwrap();
        assert_ne!(other, a);
        // Opened again, a session is counted once.
        assert_eq!(r.open_session(&a1, "a").unwrap(), a);
        assert_eq!(r.session(a2.session).map(|s| s.peer_id), Some(a));
        assert_eq!(r.close_session(a1.session), None, "`a` has another session open");
        assert_eq!(r.close_session(a1.session), None, "closed already");
        assert_eq!(r.close_session(a2.session), Some(a), "its last");
        // Back, it is a new node here: nothing granted to its old id is its.
        let again = r.open_session(&a1, "a").unwrap();
        assert!(again != a && again != other);
        // A session reopened under another node's name moves to it.
        assert_eq!(r.open_session(&a1, "b").unwrap(), other);
        assert_eq!(r.close_session(b.session), None);
        assert_eq!(r.close_session(a1.session), Some(other));
    }

    #[test]
    fn reserved_keys_count_toward_the_limit_and_no_region_takes_one() {
        let r = Registry::new(2);
        let mem = Arc::new(HostMem::new("t", 4096).unwrap());
        let k = r.reserve().unwrap();
        let region = r.register(mem.clone(), 0, 4096, None).unwrap();
        assert_ne!(region.key, k);
        assert_eq!(r.register(mem.clone(), 0, 4096, None).unwrap_err(), RegistryError::Limit(2));
        assert_eq!(r.reserve().unwrap_err(), RegistryError::Limit(2));
        assert_eq!(r.register_with_key(mem.clone(), 0, 4096, k, None).unwrap_err(), RegistryError::Limit(2));
        // Given back, its room is free again, and its key is still no region's.
        assert!(r.revoke(k) && !r.is_reserved(k));
        assert!(r.register(mem.clone(), 0, 4096, None).is_ok());
        // With room, a region under a reserved key (a NIC's rkey) is refused by name.
        let r = Registry::new(4);
        let k = r.reserve().unwrap();
        assert_eq!(r.register_with_key(mem, 0, 4096, k, None).unwrap_err(), RegistryError::KeyInUse(k));
    }

    #[test]
    fn region_keys_are_distinct_and_not_a_counter() {
        let key = random_round_keys();
        let keys: std::collections::HashSet<u32> = (0..100_000).map(|n| permuted(&key, n)).collect();
        assert_eq!(keys.len(), 100_000);
        let steps = (1..1000).filter(|&n| permuted(&key, n).wrapping_sub(permuted(&key, n - 1)) == 1).count();
        assert!(steps < 10, "{steps} consecutive keys differ by one");
        let other = random_round_keys();
        assert!((0..16).any(|n| permuted(&other, n) != permuted(&key, n)), "two registries hand out the same keys");
    }
}
