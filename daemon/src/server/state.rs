//! What the daemon holds: cache groups registered by local clients, and
//! transfer slots. Each has its own lock; a path that needs both takes
//! `groups` first.

use super::error::Refusal;
use kvwire_client::control::{Code, Mark, PrepareReceive, RailUse, TransferState};
use kvwire_core::layout::ModelSpec;
use kvwire_core::reuse::CacheIdentity;
use kvwire_core::shard::{LayoutSpec, RegionId, ShardMap};
use kvwire_core::CacheFormat;
use kvwire_transport::device::bound::BoundMem;
use kvwire_transport::{HostMem, Region};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(crate) struct RankCache {
    // Field order: regions (revoked on release) before the memory.
    pub regions: BTreeMap<RegionId, Arc<Region>>,
    /// The memfds its regions are windows of (a device rank's: this
    /// daemon's host mirrors of its allocations).
    pub mems: Vec<Arc<HostMem>>,
    pub client: u64,
    pub device: Option<DeviceRank>,
}

/// Bytes of a rank's memories, as `limits.max_memory_bytes` counts them.
pub(crate) fn bytes_of(mems: &[Arc<HostMem>]) -> u64 {
    mems.iter().map(|m| m.len()).sum()
}

/// A rank whose cache lives in device memory: each allocation (one, or
/// one per engine tensor) with the host mirror it is staged through, at
/// the same offsets.
pub(crate) struct DeviceRank {
    // The mirrors' pins, taken when the rank first prepares to receive: a
    // rank that only sends stages through its transfers' rings and never
    // touches its mirrors, so they pin (and fault in) nothing. Field
    // order: unpin the mirrors before the allocations are let go.
    pub pins: Arc<std::sync::Mutex<Vec<Pin>>>,
    pub devs: Vec<Mirrored>,
}

/// How the data plane reads a device allocation at the source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum DevicePath {
    /// In place: the NIC registered it (GPUDirect) under `key`, which
    /// writes name with offsets from the allocation's start; `how` says
    /// which registration.
    Direct { key: u32, how: String },
    /// Copied device -> host into the transfer's ring first, and why.
    Staged { why: String },
}

impl DevicePath {
    /// The key writes read the allocation under, when read in place.
    pub fn key(&self) -> Option<u32> {
        match self {
            DevicePath::Direct { key, .. } => Some(*key),
            DevicePath::Staged { .. } => None,
        }
    }
}

/// Keeps host memory pinned until dropped, its bytes counted in a gauge
/// meanwhile.
pub(crate) struct Pin {
    _pin: Box<dyn std::any::Any + Send + Sync>,
    bytes: u64,
    gauge: Arc<std::sync::atomic::AtomicU64>,
}

impl Pin {
    pub fn new(pin: Box<dyn std::any::Any + Send + Sync>, bytes: u64, gauge: &Arc<std::sync::atomic::AtomicU64>) -> Pin {
        gauge.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
        Pin { _pin: pin, bytes, gauge: gauge.clone() }
    }
}

impl Drop for Pin {
    fn drop(&mut self) {
        self.gauge.fetch_sub(self.bytes, std::sync::atomic::Ordering::Relaxed);
    }
}

/// A device allocation, its host mirror, and how the source reads it.
#[derive(Clone)]
pub(crate) struct Mirrored {
    pub mirror: Arc<HostMem>,
    pub dev: Arc<dyn BoundMem>,
    pub path: DevicePath,
}

impl Mirrored {
    /// Staged until the registration chooses its path.
    pub fn new(mirror: Arc<HostMem>, dev: Arc<dyn BoundMem>) -> Mirrored {
        Mirrored { mirror, dev, path: DevicePath::Staged { why: "not registered yet".into() } }
    }
}

/// The device-resident ranks of a group, by rank.
pub(crate) type DeviceMems = HashMap<u32, Vec<Mirrored>>;

pub(crate) struct Group {
    /// Unique to this group's life ([`next_group_gen`]): plans kept under
    /// it stay valid, since its model, layout and format never change.
    pub gen: u64,
    pub model: ModelSpec,
    pub format: CacheFormat,
    pub layout: LayoutSpec,
    pub layout_text: String,
    pub num_blocks: u32,
    pub identity: CacheIdentity,
    pub shard: ShardMap,
    pub ranks: BTreeMap<u32, RankCache>,
}

/// A new group's generation.
pub(crate) fn next_group_gen() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl Group {
    pub fn complete(&self) -> bool {
        self.ranks.len() == self.shard.ranks.len()
    }

    /// Every registered region by (rank, region), held so a transfer keeps
    /// them alive even if their client goes away meanwhile.
    pub fn regions(&self) -> super::ByRegion<Arc<Region>> {
        self.ranks.iter().flat_map(|(rank, rc)| rc.regions.iter().map(move |(id, r)| ((*rank, *id), r.clone()))).collect()
    }

    /// The device-resident ranks whose mirrors are not pinned yet: where
    /// their pins go, and the mirrors.
    pub fn unpinned(&self) -> Vec<(Arc<std::sync::Mutex<Vec<Pin>>>, Vec<Arc<HostMem>>)> {
        let rank_devs = self.ranks.values().filter_map(|rc| rc.device.as_ref());
        rank_devs.filter(|d| d.pins.lock().expect("pins lock").is_empty()).map(|d| (d.pins.clone(), d.devs.iter().map(|m| m.mirror.clone()).collect())).collect()
    }

    /// The device-resident ranks and their allocations.
    pub fn devices(&self) -> DeviceMems {
        self.ranks.iter().filter_map(|(rank, rc)| rc.device.as_ref().map(|d| (*rank, d.devs.clone()))).collect()
    }

    /// Refuses a group with ranks still missing.
    pub fn require_complete(&self, name: &str) -> Result<(), Refusal> {
        if self.complete() {
            return Ok(());
        }
        Err(Refusal::new(Code::IncompleteGroup, format!("group `{name}` has {} of {} ranks registered", self.ranks.len(), self.shard.ranks.len())))
    }
}

/// The groups, and what their registrations hold against the limits.
#[derive(Default)]
pub(crate) struct Groups {
    pub map: HashMap<String, Group>,
    pub memory: u64,
    pub regions: usize,
    /// Groups shared under a token, by name: who presented it.
    pub shares: HashMap<String, Share>,
}

/// A group shared among the clients that presented one token.
pub(crate) struct Share {
    /// A hash of the token (the token itself is not kept).
    pub token: [u8; 32],
    pub members: std::collections::BTreeSet<u64>,
}

impl Groups {
    /// Group `name`, if `client` holds a rank of it: a client touches only
    /// the caches it registered (ranks of one group may come from several
    /// clients, one per process).
    pub fn access(&self, client: u64, name: &str) -> Result<&Group, Refusal> {
        let Some(g) = self.map.get(name) else { return Err(Refusal::new(Code::UnknownGroup, format!("no group `{name}`"))) };
        if !g.ranks.values().any(|r| r.client == client) {
            return Err(Refusal::new(Code::PermissionDenied, format!("group `{name}` was registered by another client")));
        }
        Ok(g)
    }

    /// Whether `client` may register a rank of group `name`: a new group
    /// anyone may start unless it is shared; an existing one only its own
    /// registrants, or the clients that presented its token.
    pub fn may_register(&self, client: u64, name: &str) -> Result<(), Refusal> {
        if let Some(s) = self.shares.get(name) {
            if s.members.contains(&client) {
                return Ok(());
            }
            return Err(Refusal::new(Code::PermissionDenied, format!("group `{name}` is shared under a token this client has not presented (share_group)")));
        }
        match self.map.get(name) {
            Some(g) if !g.ranks.values().any(|r| r.client == client) => Err(Refusal::new(
                Code::PermissionDenied,
                format!("group `{name}` belongs to another client; to register its ranks from several clients, each calls share_group with one token first"),
            )),
            _ => Ok(()),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    Source,
    Destination,
}

/// A slot and the transfer in it: slots are reused, so everything a
/// transfer's threads do to its slot is checked against `gen` first and a
/// stale thread can never touch the transfer that took the slot after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SlotId {
    pub slot: u16,
    pub gen: u64,
}

/// A lifetime boundary of a transfer (DESIGN §1), as its status lists them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Boundary {
    Enqueued,
    Posting,
    // A streamed source: every rank reading layer L announced it written.
    Produced(usize),
    // A device-resident source: layer L's device → host copies were
    // enqueued into its ring slot, and completed.
    Staging(usize),
    HostStaged(usize),
    // A source's layer L writes all completed (its ring slot is free again).
    Sent(usize),
    SourceReleased,
    HostReceived(usize),
    DeviceComplete(usize),
    LayerReady(usize),
    DecoderUsable,
}

impl std::fmt::Display for Boundary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Boundary::Enqueued => f.write_str("enqueued"),
            Boundary::Posting => f.write_str("posting"),
            Boundary::Produced(l) => write!(f, "produced({l})"),
            Boundary::Staging(l) => write!(f, "staging({l})"),
            Boundary::HostStaged(l) => write!(f, "host_staged({l})"),
            Boundary::Sent(l) => write!(f, "sent({l})"),
            Boundary::SourceReleased => f.write_str("source_released"),
            Boundary::HostReceived(l) => write!(f, "host_received({l})"),
            Boundary::DeviceComplete(l) => write!(f, "device_complete({l})"),
            Boundary::LayerReady(l) => write!(f, "layer_ready({l})"),
            Boundary::DecoderUsable => f.write_str("decoder_usable"),
        }
    }
}

impl Boundary {
    /// Reaching this boundary `at` after the start.
    pub fn at(self, at: Duration) -> Marked {
        Marked { boundary: self, at_ns: at.as_nanos() as u64 }
    }
}

/// A boundary a transfer reached, named only when a status asks (a
/// transfer reaches a dozen, and formatting each cost an allocation).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Marked {
    pub boundary: Boundary,
    pub at_ns: u64,
}

impl Marked {
    /// The status entry.
    pub fn mark(&self) -> Mark {
        Mark { name: self.boundary.to_string(), at_ns: self.at_ns }
    }
}

pub(crate) struct Slot {
    pub gen: u64,
    pub role: Role,
    pub request: String,
    // The group it reads or fills, and the client that made it: only
    // clients holding a rank of that group may look at or cancel it.
    pub group: String,
    pub owner: u64,
    // Destination: the region keys made for this transfer alone, revoked
    // when it ends, so a late write of it is refused and can never land
    // in blocks that were reused for another request.
    pub keys: Vec<u32>,
    pub retransmitted: u64,
    pub rails: Vec<RailUse>,
    pub state: TransferState,
    pub error: Option<String>,
    pub layers: u16,
    pub bytes: u64,
    pub segments: u64,
    pub reused: u64,
    // Payload the schedule sends, after packing and any codec.
    pub compressed: u64,
    // Host staging held for it: a source's ring or staging buffer, a destination's staging buffer.
    pub staging: u64,
    // Payload bytes written from device memory in place (source).
    pub in_place: u64,
    // Source: what crossed the link, counted as the transfer ends.
    // Destination: its control frames; the data plane's count lives in
    // the placement (read with it).
    pub wire: u64,
    pub hops: BTreeMap<&'static str, (u64, u64)>,
    // Per-rank (ns, bytes) of the hops ranks work on concurrently.
    pub rank_hops: BTreeMap<(&'static str, u32), (u64, u64)>,
    pub marks: Vec<Marked>,
    // The peer daemon on the other end, once known.
    pub peer: String,
    pub started: Instant,
    pub elapsed: Option<Duration>,
    pub recv: Option<PrepareReceive>,
    // Destination: announced to its source and not claimed yet.
    pub announced: Option<Announced>,
    // Destination: the peer connection its verdict goes to as it ends.
    pub verdicts: Option<Arc<super::destination::Verdicts>>,
    pub stop: Arc<AtomicBool>,
}

/// What an announced receive holds until its source claims it: the
/// connection it went on, the node its keys (in `Slot::keys`) are granted
/// to, and the staging buffer set aside. Each layer's bytes are declared
/// in the placement. `bytes` is the announcement's frame: it counts
/// toward the transfer's wire_bytes once the source shows it read it (it
/// claims, or offers on the same connection).
pub(crate) struct Announced {
    pub session: u64,
    pub grantee: u64,
    pub stage: Option<Arc<Region>>,
    pub bytes: u64,
}

impl Slot {
    pub fn new(gen: u64, role: Role, request: &str, group: &str, owner: u64, recv: Option<PrepareReceive>, stop: Arc<AtomicBool>) -> Slot {
        Slot {
            gen,
            role,
            request: request.to_string(),
            group: group.to_string(),
            owner,
            keys: Vec::new(),
            retransmitted: 0,
            rails: Vec::new(),
            state: if role == Role::Source { TransferState::Running } else { TransferState::Prepared },
            error: None,
            layers: 0,
            bytes: 0,
            segments: 0,
            reused: 0,
            compressed: 0,
            staging: 0,
            in_place: 0,
            wire: 0,
            hops: BTreeMap::new(),
            rank_hops: BTreeMap::new(),
            peer: String::new(),
            marks: vec![Boundary::Enqueued.at(Duration::ZERO)],
            started: Instant::now(),
            elapsed: None,
            recv,
            announced: None,
            verdicts: None,
            stop,
        }
    }

    /// A prepared receive starts: `peer`'s offer was accepted or its claim
    /// honoured; its time and marks count from here.
    pub fn receiving_from(&mut self, peer: &str) {
        self.state = TransferState::Running;
        self.started = Instant::now();
        self.marks = vec![Boundary::Enqueued.at(Duration::ZERO)];
        self.peer = peer.to_string();
    }

    /// Records the transfer's size once planned.
    pub fn sized(&mut self, layers: usize, c: &kvwire_core::plan::PlanCounters, compressed: u64) {
        self.layers = layers as u16;
        self.bytes = c.total_bytes_moved;
        self.segments = c.segments;
        self.reused = c.reused_bytes;
        self.compressed = compressed;
    }
}

/// The transfer slots.
#[derive(Default)]
pub(crate) struct Slots {
    pub map: HashMap<u16, Slot>,
    pub next_slot: u16,
    pub next_gen: u64,
}

impl Slots {
    /// Slot `id`, if it still holds that transfer.
    pub fn get_mut(&mut self, id: SlotId) -> Option<&mut Slot> {
        self.map.get_mut(&id.slot).filter(|s| s.gen == id.gen)
    }

    /// The slots whose transfer has not ended, as `live` lists them, with
    /// their ids.
    pub fn live<'a>(&'a self, live: &'a LiveSlots) -> impl Iterator<Item = (SlotId, &'a Slot)> + 'a {
        live.iter().filter_map(|slot| self.map.get(&slot).map(|s| (SlotId { slot, gen: s.gen }, s)))
    }
}

/// The slots whose transfer has not ended (prepared or running), kept
/// beside the slots and changed under their lock: a look at the live ones
/// reads these 32 bytes, not every slot (each its own cache lines; all 256
/// are in use once as many transfers have run).
#[derive(Debug, Default)]
pub(crate) struct LiveSlots([std::sync::atomic::AtomicU64; 4]);

const _: () = assert!(kvwire_client::control::FLAG_SLOTS as usize <= 4 * 64);

impl LiveSlots {
    pub fn insert(&self, slot: u16) {
        self.0[usize::from(slot / 64)].fetch_or(1 << (slot % 64), std::sync::atomic::Ordering::Relaxed);
    }

    pub fn remove(&self, slot: u16) {
        self.0[usize::from(slot / 64)].fetch_and(!(1 << (slot % 64)), std::sync::atomic::Ordering::Relaxed);
    }

    pub fn len(&self) -> usize {
        self.0.iter().map(|w| w.load(std::sync::atomic::Ordering::Relaxed).count_ones() as usize).sum()
    }

    /// The live slots, in order.
    pub fn iter(&self) -> impl Iterator<Item = u16> + '_ {
        self.0.iter().enumerate().flat_map(|(i, w)| {
            let mut bits = w.load(std::sync::atomic::Ordering::Relaxed);
            std::iter::from_fn(move || {
                (bits != 0).then(|| {
                    let b = bits.trailing_zeros() as u16;
                    bits &= bits - 1;
                    i as u16 * 64 + b
                })
            })
        })
    }
}

pub(crate) fn running(state: TransferState) -> bool {
    matches!(state, TransferState::Prepared | TransferState::Running)
}

#[cfg(test)]
mod live_tests {
    use super::LiveSlots;

    #[test]
    fn live_slots_are_counted_and_listed_in_order_across_words() {
        let l = LiveSlots::default();
        for s in [255, 0, 64, 63] {
            l.insert(s);
        }
        l.insert(64);
        assert_eq!(l.len(), 4);
        assert_eq!(l.iter().collect::<Vec<_>>(), vec![0, 63, 64, 255]);
        l.remove(63);
        l.remove(7);
        assert_eq!((l.len(), l.iter().collect::<Vec<_>>()), (3, vec![0, 64, 255]));
    }
}
