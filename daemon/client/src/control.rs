//! The control protocol between an inference engine (client) and its
//! host's kvwired, over a Unix socket (see [`crate::wire`] for framing).
//!
//! A client says `hello` and receives the flag page (a memfd) with the
//! reply; it registers each TP/PP rank's cache by passing a memfd holding
//! that rank's regions back to back, in [`kvwire_core::plan::Side::regions`]
//! order (per held layer: K then V, or the MLA latent, then any state), or
//! by passing the memfds its engine tensors live in with their description
//! ([`RegisterTensors`], for a layout with `kv=`); a
//! decode side prepares to receive a request; a prefill side submits a
//! transfer naming the destination peer and request. Waiting needs no round
//! trip: flag words for (slot, column) live in the mapped page —
//! `layer_ready(L)` at column `L`, `decoder_usable` at
//! [`DECODER_USABLE`], `source_released` at [`SOURCE_RELEASED`].

use kvwire_core::reuse::CacheIdentity;
use kvwire_core::tensors::TensorDesc;
use serde::{Deserialize, Serialize};

/// Transfer slots in a daemon's flag page.
pub const FLAG_SLOTS: u16 = 256;
/// Most layers a transfer may have.
pub const MAX_TRANSFER_LAYERS: u16 = kvwire_transport::flags::LAYER_COLUMNS;
/// Flag column: all layers ready and the request's metadata committed.
pub const DECODER_USABLE: u16 = MAX_TRANSFER_LAYERS;
/// Flag column: the source's memory may be reused. Every local completion
/// of its writes polled; or, for a device-resident source staged through
/// its ring, its last device → host copy completed (its writes then read
/// only the ring, which the daemon owns). A retry on another rail re-sends
/// from the same place, so it never reads the engine's memory again.
pub const SOURCE_RELEASED: u16 = MAX_TRANSFER_LAYERS + 1;
/// Columns per slot.
pub const FLAG_COLUMNS: u16 = MAX_TRANSFER_LAYERS + 2;

/// Most `notify` samples one [`Request::Notified`] may carry.
pub const MAX_NOTIFIED: usize = 1024;

/// Where a model's cache description comes from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum ModelSource {
    /// A built-in model by name.
    Builtin(String),
    /// The text of a Hugging Face `config.json`.
    HfConfig(String),
    /// The text of a TOML model spec.
    Toml(String),
}

impl ModelSource {
    /// A `hf_config` or `toml` source given as a path (text that cannot be
    /// the document itself: no `{` first, no newline, no `=`) replaced by the
    /// file's text, read here, so a client may pass either.
    pub fn read_path(self) -> Result<ModelSource, String> {
        let read = |p: &str, what: &str| std::fs::read_to_string(p.trim()).map_err(|e| format!("{what} `{p}` is neither the document's text nor a readable file: {e}"));
        Ok(match self {
            ModelSource::HfConfig(t) if !t.trim_start().starts_with('{') => ModelSource::HfConfig(read(&t, "hf_config")?),
            ModelSource::Toml(t) if !t.contains('\n') && !t.contains('=') => ModelSource::Toml(read(&t, "toml")?),
            other => other,
        })
    }
}

/// Registers one rank's cache (a memfd travels with the message).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegisterCache {
    /// Cache group: every rank of one engine instance's cache, one layout.
    pub group: String,
    /// The model.
    pub model: ModelSource,
    /// Cache format id, e.g. `bf16` or `fp8_e4m3_pth/v1`.
    pub format: String,
    /// Parallel layout, e.g. `tp=4,block=16,layout=nhd`.
    pub layout: String,
    /// This rank's number in the layout.
    pub rank: u32,
    /// Blocks per region (the engine's cache capacity).
    pub num_blocks: u32,
    /// What the cache holds: model/adapter digests, format, tenant, RoPE.
    pub identity: CacheIdentity,
}

/// Registers one rank's cache that lives in device (GPU) memory. The
/// daemon opens the allocation through its `[device]` backend and stages
/// it through a host mirror of its own. With the `host` stand-in backend a
/// memfd playing the device memory travels with the message; with `cuda`
/// the allocation's dmabuf fd may (the IPC handle is what the daemon opens).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegisterDeviceCache {
    /// The cache, as for host memory.
    pub cache: RegisterCache,
    /// Device ordinal of the allocation.
    pub ordinal: u32,
    /// Bytes of the allocation (at least what the rank's regions need).
    pub len: u64,
    /// CUDA IPC handle of the allocation (64 bytes), for `cuda`.
    #[serde(default)]
    pub ipc: Option<Vec<u8>>,
}

/// Registers one rank's cache held in the engine's own tensors, for a
/// layout with `kv=` (see [`kvwire_core::tensors`]). Each tensor names one of
/// the message's file descriptors (`memory`, in order: memfds the engine
/// allocated) and the byte offset of its element 0 there; the daemon maps
/// them as they are and checks every tensor against the layout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegisterTensors {
    /// The cache, as for one memfd.
    pub cache: RegisterCache,
    /// The rank's tensors.
    pub tensors: Vec<TensorDesc>,
}

/// One device allocation of an engine's tensors in device memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceMemory {
    /// Device ordinal of the allocation.
    pub ordinal: u32,
    /// Bytes of the allocation.
    pub len: u64,
    /// CUDA IPC handle of the allocation (64 bytes), for `cuda`.
    #[serde(default)]
    pub ipc: Option<Vec<u8>>,
}

/// Registers one rank's cache held in the engine's own tensors in device
/// memory, each tensor in an allocation of its own (vLLM's per-layer GPU
/// tensors): as [`RegisterTensors`], with `memory` indexing `memories`.
/// With the `host` stand-in backend one memfd per allocation travels with
/// the message, in order; with `cuda` each allocation's IPC handle does
/// (and no fd, or one dmabuf fd per allocation). The daemon stages each
/// allocation through a host mirror of its own.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegisterDeviceTensors {
    /// The cache, as for one memfd.
    pub cache: RegisterCache,
    /// The rank's tensors; `memory` indexes `memories`.
    pub tensors: Vec<TensorDesc>,
    /// The device allocations the tensors live in.
    pub memories: Vec<DeviceMemory>,
}

/// Prepares a destination group to receive a request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrepareReceive {
    /// Destination cache group (registered on this daemon).
    pub group: String,
    /// Destination request id (what the source names).
    pub request: String,
    /// Block ids, in position order, shared by every rank of the group.
    pub block_table: Vec<u32>,
    /// Tokens the request will hold.
    pub tokens: u64,
    /// Leading positions this side already holds (checked against identity).
    pub prefix_tokens: u64,
    /// The node that will fill the request, when known: the daemon then
    /// announces the receive to it (grants its keys and sets its staging
    /// aside now), so the source's submit starts writing with no round
    /// trip. Best effort: a receive that cannot be announced waits for the
    /// source's offer, as one prepared without a source does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
}

/// Submits a transfer from a local group to a peer's prepared request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Submit {
    /// Source request id (for logs and metrics).
    pub request: String,
    /// Source cache group.
    pub group: String,
    /// Source block table.
    pub block_table: Vec<u32>,
    /// Tokens in the request.
    pub tokens: u64,
    /// Destination daemon's node name.
    pub peer: String,
    /// Destination group.
    pub dst_group: String,
    /// Destination request id.
    pub dst_request: String,
    /// Transfer codec (`fp8_e4m3_row`), or none for a lossless copy.
    #[serde(default)]
    pub codec: Option<String>,
    /// Stream the layers as the engine produces them: the submit returns
    /// once the destination accepted, and each layer moves once every rank
    /// that holds part of it said it is written ([`Request::Produced`]).
    #[serde(default)]
    pub stream: bool,
}

/// Flag names for round-trip waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FlagName {
    /// `layer_ready(L)`.
    LayerReady(u16),
    /// `decoder_usable`.
    DecoderUsable,
    /// `source_released`.
    SourceReleased,
}

impl FlagName {
    /// The flag page column.
    pub fn column(self) -> u16 {
        match self {
            FlagName::LayerReady(l) => l,
            FlagName::DecoderUsable => DECODER_USABLE,
            FlagName::SourceReleased => SOURCE_RELEASED,
        }
    }
}

/// Client → daemon.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// First message; the reply carries the flag page fd.
    Hello {
        /// Client name, for logs.
        client: String,
    },
    /// Register one rank's cache (memfd attached).
    RegisterCache(RegisterCache),
    /// Register one rank's cache in device memory (see [`RegisterDeviceCache`]).
    RegisterDeviceCache(RegisterDeviceCache),
    /// Register one rank's cache as the engine's tensors (memfds attached; see [`RegisterTensors`]).
    RegisterTensors(RegisterTensors),
    /// Register one rank's cache as the engine's tensors in device memory (see [`RegisterDeviceTensors`]).
    RegisterDeviceTensors(RegisterDeviceTensors),
    /// Share group `group` with the clients that present `token`: the first
    /// client to name the group this way owns it; every other client must
    /// present the same token (each rank's process of one engine, say)
    /// before it may register a rank of it. A group nobody shared belongs
    /// to the client that registered it first.
    ShareGroup {
        /// Group.
        group: String,
        /// What the sharing clients agree on (16 bytes at least).
        token: String,
    },
    /// Unregister a rank's cache: its regions are revoked.
    ReleaseCache {
        /// Group.
        group: String,
        /// Rank.
        rank: u32,
    },
    /// Prepare to receive.
    PrepareReceive(PrepareReceive),
    /// Start a transfer.
    Submit(Submit),
    /// Layers `0..layers` of request `request`'s blocks on rank `rank` of
    /// group `group` are written and final: a streamed submit of that
    /// request moves them. May come before the submit; counts only grow.
    Produced {
        /// Group.
        group: String,
        /// Source request id, as the submit names it.
        request: String,
        /// Rank.
        rank: u32,
        /// Layers written, from layer 0.
        layers: u16,
    },
    /// Wait for a flag with a round trip (clients that map the page need not).
    Wait {
        /// Slot.
        slot: u16,
        /// Which flag.
        flag: FlagName,
        /// Give up after this long.
        timeout_ms: u64,
    },
    /// A transfer's state.
    Status {
        /// Slot.
        slot: u16,
    },
    /// Cancel a transfer (either side); its flags fail.
    Cancel {
        /// Slot.
        slot: u16,
    },
    /// Counters and hop histograms.
    Stats,
    /// `notify` hop samples (flag published → seen, ns) the client measured
    /// on the mapped flag page, sent ahead of its next call: the daemon
    /// cannot see those waits, and they are DESIGN's `notify`. At most
    /// [`MAX_NOTIFIED`].
    Notified {
        /// One sample per wait that saw its flag.
        notify_ns: Vec<u64>,
    },
    /// [`Request::Notified`] that is never answered, so the call it goes
    /// ahead of costs one reply, not two. Sent only to a daemon whose
    /// hello says `quiet_notify`.
    NotifiedQuiet {
        /// One sample per wait that saw its flag.
        notify_ns: Vec<u64>,
    },
    /// The client's sleep page (memfd attached, at least
    /// `kvwire_transport::flags::SLEEP_PAGE_BYTES`): where its waits on the
    /// flag page declare the word they sleep on, so the daemon wakes only
    /// words someone sleeps on. Sent only to a daemon whose hello says
    /// `sleep_page`; until then, and for a client that never sends it,
    /// every publish wakes. Answered `Recorded`.
    SleepPage,
}

/// The state of a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TransferState {
    /// Prepared, waiting for the source.
    Prepared,
    /// Bytes moving.
    Running,
    /// Finished: every flag published.
    Done,
    /// Failed; see `error`.
    Failed,
    /// Cancelled by a client.
    Cancelled,
}

/// What [`Request::Status`] reports.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TransferStatus {
    /// Slot.
    pub slot: u16,
    /// Request id on this side.
    pub request: String,
    /// `source` or `destination`.
    pub role: String,
    /// State.
    pub state: TransferState,
    /// Why it failed.
    pub error: Option<String>,
    /// Layers in the transfer.
    pub layers: u16,
    /// Bytes the plan moves (counted at this side: sent or to receive).
    pub bytes: u64,
    /// Segments of the plan (source side).
    pub segments: u64,
    /// Destination bytes skipped by prefix reuse.
    pub reused_bytes: u64,
    /// The payload the transfer's writes carry, after packing and any
    /// codec (the schedule's figure; `bytes` when no codec converts).
    #[serde(default)]
    pub compressed_bytes: u64,
    /// What crossed the link for the transfer (DESIGN's `wire_bytes`), as
    /// this side counted it: its control frames both ways (offer, accept,
    /// manifest, layer checksums, pings, done, verdict) and its data
    /// plane's payload and framing both ways (frame headers, write requests
    /// or notes, answers). The source counts as the transfer ends, the
    /// payload once (a slice sent again on another rail is in
    /// `retransmitted_bytes`). The destination counts as writes arrive,
    /// a re-sent slice's payload once too; its figure is final once the
    /// source has its verdict.
    pub wire_bytes: u64,
    /// Bytes the transport sent again (source side; tcp: the kernel's
    /// count on the data connection, so loss and reordering show here).
    #[serde(default)]
    pub retransmitted_bytes: u64,
    /// Nanoseconds from submit (or the accepted offer) to done, when done.
    pub elapsed_ns: Option<u64>,
    /// This side's busy time per hop for this transfer (one clock: this daemon's).
    #[serde(default)]
    pub hops: Vec<HopTotal>,
    /// Lifetime boundaries reached, in ns since this side started the transfer.
    #[serde(default)]
    pub marks: Vec<Mark>,
    /// The rails the source used (source side).
    #[serde(default)]
    pub rails: Vec<RailUse>,
    /// Host staging memory this side held for the transfer: a
    /// device-resident source's ring (its depth times its largest layer),
    /// or the buffer packed segments cross in at either side.
    #[serde(default)]
    pub staging_bytes: u64,
    /// Payload bytes the NIC read in place from device memory (GPUDirect;
    /// source side): the rest went from host memory.
    #[serde(default)]
    pub in_place_bytes: u64,
}

/// What one rail carried for one transfer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RailUse {
    /// The destination's rail name.
    pub name: String,
    /// Its data address.
    pub addr: String,
    /// Bytes completed on it.
    pub bytes: u64,
    /// Slices completed on it.
    pub slices: u64,
    /// Bytes of its slices re-sent on other rails after it failed, plus
    /// what its transport retransmitted.
    pub retransmitted_bytes: u64,
    /// Nanoseconds it was busy (first post to last completion).
    pub busy_ns: u64,
    /// Why it failed, if it did (unreachable, reset, stalled).
    pub failed: Option<String>,
}

/// One hop's busy time within one transfer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HopTotal {
    /// Hop name.
    pub hop: String,
    /// Busy nanoseconds: wall time, where several ranks work on the hop at
    /// once (device copies) the union of their intervals, not their sum.
    pub ns: u64,
    /// Bytes handled.
    pub bytes: u64,
    /// Each rank's own busy time, where ranks worked on the hop
    /// concurrently (empty otherwise).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ranks: Vec<RankBusy>,
}

/// One rank's share of a concurrent hop ([`HopTotal::ranks`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankBusy {
    /// Rank.
    pub rank: u32,
    /// Its busy nanoseconds.
    pub ns: u64,
    /// Its bytes.
    pub bytes: u64,
}

/// A lifetime boundary, timed on this daemon's clock.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mark {
    /// `enqueued`, `source_released`, `layer_ready(L)`, `decoder_usable`.
    pub name: String,
    /// Nanoseconds since this side started the transfer.
    pub at_ns: u64,
}

/// Daemon → client. Errors carry a numbered [`Code`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum Reply {
    /// Hello answered; the flag page fd is attached.
    Hello {
        /// Daemon node name.
        node: String,
        /// Protocol version.
        version: u32,
        /// Slots in the flag page.
        slots: u16,
        /// Columns per slot.
        columns: u16,
        /// It takes [`Request::NotifiedQuiet`] (absent from older daemons).
        #[serde(default)]
        quiet_notify: bool,
        /// It takes [`Request::SleepPage`] (absent from older daemons).
        #[serde(default)]
        sleep_page: bool,
    },
    /// Rank registered.
    Registered {
        /// Regions registered.
        regions: u32,
        /// Bytes of the rank's regions.
        bytes: u64,
        /// Every rank of the group is now registered.
        complete: bool,
    },
    /// Rank released.
    Released,
    /// This client may register ranks of the shared group.
    Shared,
    /// Receive prepared in `slot`.
    Prepared {
        /// Slot.
        slot: u16,
        /// The prepare named a source and it was told (`announced`), or
        /// why it was not: it will have to offer.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        announce: Option<Result<(), String>>,
    },
    /// Transfer started in `slot`.
    Submitted {
        /// Slot (this daemon's, for `source_released`).
        slot: u16,
        /// The destination daemon's slot (its `layer_ready` flags).
        peer_slot: u16,
        /// Bytes the plan moves.
        bytes: u64,
        /// Segments of the plan.
        segments: u64,
    },
    /// Wait finished; nanoseconds from publish to seen.
    Waited {
        /// Notify hop.
        notify_ns: u64,
    },
    /// Transfer state.
    Status(TransferStatus),
    /// Cancelled.
    Cancelled,
    /// The layers a `Produced` announced are noted.
    Announced,
    /// `notify` samples recorded, or the sleep page taken.
    Recorded,
    /// Prometheus text of the counters.
    Stats {
        /// Exposition text.
        text: String,
    },
    /// The request failed.
    Error {
        /// Numbered code.
        code: u32,
        /// Message naming what was wrong.
        message: String,
    },
}

/// Result codes, numbered by family; a retired number is never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Code {
    /// Malformed message.
    Malformed = 100,
    /// Bad model description.
    BadModel = 101,
    /// Bad layout or format.
    BadLayout = 102,
    /// Memory passed does not fit the layout.
    BadRegion = 103,
    /// Unknown group or rank.
    UnknownGroup = 104,
    /// Unknown slot.
    UnknownSlot = 105,
    /// Not every rank of a group is registered.
    IncompleteGroup = 106,
    /// Two registrations of one group disagree.
    Mismatch = 107,
    /// A limit was reached.
    Limit = 108,
    /// No prepared receive matches.
    NotPrepared = 109,
    /// A request the daemon cannot carry out as asked: block table or token
    /// counts, a plan, manifest or codec refusal, a slot already finished
    /// (the message names which).
    BadRequest = 110,
    /// The peer is not configured.
    UnknownPeer = 200,
    /// The peer cannot be reached.
    PeerUnreachable = 201,
    /// Peer authentication failed.
    AuthFailed = 202,
    /// The peer refused the transfer.
    PeerRefused = 203,
    /// The transfer failed.
    TransferFailed = 300,
    /// A wait timed out.
    Timeout = 301,
    /// The transfer was cancelled.
    Cancelled = 302,
    /// The client may not do this.
    PermissionDenied = 400,
}

impl Reply {
    /// An error reply.
    pub fn error(code: Code, message: impl Into<String>) -> Reply {
        Reply::Error { code: code as u32, message: message.into() }
    }
}
