//! The peer wire protocol: the out-of-band handshake and the frames of the
//! TCP emulation of one-sided writes. Pure encode/decode and validation; the
//! transports do the I/O.
//!
//! Every frame starts with a fixed 40-byte little-endian header:
//!
//! | offset | field  | type | meaning |
//! |---|---|---|---|
//! | 0  | magic  | u32 | `KVW1` (0x3157_564B as LE bytes `K V W 1`) |
//! | 4  | kind   | u16 | [`Kind`] |
//! | 6  | flags  | u16 | reserved, must be 0 |
//! | 8  | tag    | u32 | (transfer slot << 16) \| layer, see [`Tag`] |
//! | 12 | key    | u32 | remote key of the destination region (writes) |
//! | 16 | seq    | u64 | sender's sequence number, echoed by acks |
//! | 24 | offset | u64 | byte offset in the region (writes); placed bytes (acks) |
//! | 32 | len    | u64 | payload bytes that follow the header |
//!
//! A `Hello` payload is JSON ([`Hello`]); a `Write` payload is the data; a
//! `Nack` payload is a UTF-8 message. A receiver refuses a header before
//! reading its payload when the length is beyond its limit, so a hostile
//! peer cannot make it allocate or read without bound.

use serde::{Deserialize, Serialize};

/// The data-plane transports. On the wire (hellos, accepts, discovery
/// entries) a transport is its lowercase name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TransportKind {
    /// TCP emulation of one-sided writes.
    Tcp,
    /// Same-host shared memory.
    Shm,
    /// RDMA verbs (real NIC or soft-RoCE).
    Verbs,
}

impl TransportKind {
    /// Every kind, in the order error messages list them.
    pub const ALL: [TransportKind; 3] = [TransportKind::Tcp, TransportKind::Shm, TransportKind::Verbs];

    /// Its name on the wire and in configs.
    pub const fn as_str(self) -> &'static str {
        match self {
            TransportKind::Tcp => "tcp",
            TransportKind::Shm => "shm",
            TransportKind::Verbs => "verbs",
        }
    }
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A transport name that is none of [`TransportKind::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown transport `{0}`: expected tcp, shm or verbs")]
pub struct UnknownTransport(pub String);

impl std::str::FromStr for TransportKind {
    type Err = UnknownTransport;

    fn from_str(s: &str) -> Result<TransportKind, UnknownTransport> {
        TransportKind::ALL.into_iter().find(|k| k.as_str() == s).ok_or_else(|| UnknownTransport(s.to_string()))
    }
}

/// Version of this protocol; peers speaking another are refused.
/// 3: the destination challenges first and the source proves its session
/// (see [`Hello::session`]). 4: strided writes (tcp's [`Kind::StridedWrite`],
/// shm's 64-byte write trailer). 5: a packed segment whose destination runs
/// lie back to back lands in place, not in staging (the schedule's
/// `Staged::placed`): both ends must agree on where its bytes go.
pub const PROTOCOL_VERSION: u32 = 5;
/// `KVW1` in wire order.
pub const MAGIC: u32 = u32::from_le_bytes(*b"KVW1");
/// Size of a frame header.
pub const HEADER_LEN: usize = 40;
/// Largest `Hello` payload accepted.
pub const MAX_HELLO: u64 = 1 << 20;
/// Largest `Hello` a destination reads before the sender proved its
/// session: a source's hello carries no regions, so a few KiB is plenty,
/// and an outsider cannot make the destination hold more.
pub const MAX_UNAUTHENTICATED_HELLO: u64 = 4096;
/// Bytes of a handshake nonce (a `Challenge` payload).
pub const NONCE_LEN: usize = 32;

/// Identifies what a write belongs to: a transfer slot the destination
/// assigned, and a layer. Carried by TCP frame headers and by verbs write
/// notes ([`WriteNote`]), so the destination can count placed bytes per layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Tag {
    /// Transfer slot (assigned by the destination).
    pub slot: u16,
    /// Layer index.
    pub layer: u16,
}

impl Tag {
    /// The 32-bit wire form.
    pub fn to_wire(self) -> u32 {
        u32::from(self.slot) << 16 | u32::from(self.layer)
    }

    /// From the 32-bit wire form.
    pub fn from_wire(v: u32) -> Tag {
        Tag { slot: (v >> 16) as u16, layer: v as u16 }
    }
}

/// Frame kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum Kind {
    /// Handshake; payload is JSON [`Hello`].
    Hello = 1,
    /// One-sided write; payload is the data.
    Write = 2,
    /// The write `seq` was placed; `offset` carries the bytes placed.
    Ack = 3,
    /// The write `seq` was refused; payload is the reason.
    Nack = 4,
    /// The destination's first frame: payload is its [`NONCE_LEN`]-byte nonce.
    Challenge = 5,
    /// A strided write (tcp): `offset` is its first run's; the payload is
    /// [`STRIDE_PREFIX`] bytes (runs and their distance at the
    /// destination, u64 little-endian each), then the runs back to back.
    StridedWrite = 6,
}

/// Bytes before a [`Kind::StridedWrite`]'s runs: their count and distance.
pub const STRIDE_PREFIX: usize = 16;

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Frame kind.
    pub kind: Kind,
    /// Tag (writes, acks).
    pub tag: Tag,
    /// Remote key (writes).
    pub key: u32,
    /// Sequence number.
    pub seq: u64,
    /// Region offset (writes) or bytes placed (acks).
    pub offset: u64,
    /// Payload length.
    pub len: u64,
}

/// Why a header was refused. After any of these the stream is out of sync
/// and the connection must be closed.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum FrameError {
    /// Not a kvwire frame.
    #[error("bad frame magic {0:#010x} (not a kvwire peer, or the stream lost sync)")]
    Magic(u32),
    /// Unknown frame kind.
    #[error("unknown frame kind {0}")]
    Kind(u16),
    /// Reserved flags set.
    #[error("reserved frame flags {0:#06x} set")]
    Flags(u16),
    /// Payload longer than the receiver accepts.
    #[error("{kind:?} frame payload of {len} bytes exceeds the limit of {limit}")]
    TooLong {
        /// Frame kind.
        kind: Kind,
        /// Declared length.
        len: u64,
        /// Receiver's limit.
        limit: u64,
    },
    /// Fewer bytes than a header.
    #[error("truncated frame: {0} of {HEADER_LEN} header bytes")]
    Truncated(usize),
    /// A verbs write-note message that is not a whole number of notes.
    #[error("write-note message of {0} bytes is not a multiple of {NOTE_LEN}")]
    NoteLength(usize),
}

impl Header {
    /// Encodes into the 40-byte wire form.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&(self.kind as u16).to_le_bytes());
        b[8..12].copy_from_slice(&self.tag.to_wire().to_le_bytes());
        b[12..16].copy_from_slice(&self.key.to_le_bytes());
        b[16..24].copy_from_slice(&self.seq.to_le_bytes());
        b[24..32].copy_from_slice(&self.offset.to_le_bytes());
        b[32..40].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes and checks a header; `max_write` bounds `Write` payloads.
    pub fn decode(b: &[u8], max_write: u64) -> Result<Header, FrameError> {
        if b.len() < HEADER_LEN {
            return Err(FrameError::Truncated(b.len()));
        }
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let magic = u32_at(0);
        if magic != MAGIC {
            return Err(FrameError::Magic(magic));
        }
        let kind = match u16_at(4) {
            1 => Kind::Hello,
            2 => Kind::Write,
            3 => Kind::Ack,
            4 => Kind::Nack,
            5 => Kind::Challenge,
            6 => Kind::StridedWrite,
            k => return Err(FrameError::Kind(k)),
        };
        let flags = u16_at(6);
        if flags != 0 {
            return Err(FrameError::Flags(flags));
        }
        let len = u64_at(32);
        let limit = match kind {
            Kind::Hello => MAX_HELLO,
            Kind::Write => max_write,
            Kind::StridedWrite => max_write.saturating_add(STRIDE_PREFIX as u64),
            Kind::Ack => 0,
            Kind::Nack => 4096,
            Kind::Challenge => NONCE_LEN as u64,
        };
        if len > limit {
            return Err(FrameError::TooLong { kind, len, limit });
        }
        Ok(Header { kind, tag: Tag::from_wire(u32_at(8)), key: u32_at(12), seq: u64_at(16), offset: u64_at(24), len })
    }
}

/// A registered region as a peer sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionDesc {
    /// Remote key.
    pub key: u32,
    /// Base address in the owner's address space (verbs); 0 for emulated transports.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// The NIC's remote key for this region on the device the hello came
    /// from (verbs). Each device registers a region on its own, so one
    /// region has one rkey per rail, while `key` names it on every rail.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rkey: Option<u32>,
}

/// What a verbs peer needs to connect an RC queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerbsAddr {
    /// Queue pair number.
    pub qpn: u32,
    /// Initial packet sequence number.
    pub psn: u32,
    /// Port GID (RoCE), 16 bytes.
    pub gid: [u8; 16],
    /// Port LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Active path MTU enum value (1 = 256 … 5 = 4096).
    pub mtu: u8,
}

/// The handshake each side sends first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hello {
    /// [`PROTOCOL_VERSION`] of the sender.
    pub version: u32,
    /// Transport the sender speaks (`tcp`, `shm`, `verbs`).
    pub transport: String,
    /// Sender's name, for logs and errors.
    pub node: String,
    /// Regions the sender exposes for remote writes.
    pub regions: Vec<RegionDesc>,
    /// Verbs connection data (verbs only).
    pub verbs: Option<VerbsAddr>,
    /// (source) The data-plane session it proves, as the peer-control
    /// handshake named it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<u64>,
    /// The sender's nonce, hex (sources; destinations sent theirs in the `Challenge`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub nonce: String,
    /// HMAC-SHA256 under the session key over both nonces, the transport
    /// and the sender's node, hex: proves the sender holds the session.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub proof: String,
}

/// Why a peer's hello was refused.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum HelloError {
    /// Not valid JSON of the right shape.
    #[error("malformed hello: {0}")]
    Malformed(String),
    /// Another protocol version.
    #[error("peer {node} speaks protocol version {theirs}, this side speaks {ours}")]
    Version {
        /// Peer's node name.
        node: String,
        /// Peer's version.
        theirs: u32,
        /// Ours.
        ours: u32,
    },
    /// Another transport.
    #[error("peer {node} speaks transport `{theirs}`, this endpoint is `{ours}`")]
    Transport {
        /// Peer's node name.
        node: String,
        /// Peer's transport.
        theirs: String,
        /// Ours.
        ours: String,
    },
}

impl Hello {
    /// JSON payload.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("hello serializes")
    }

    /// Parses a peer's hello and checks its version and transport.
    pub fn decode(payload: &[u8], transport: &str) -> Result<Hello, HelloError> {
        let h: Hello = serde_json::from_slice(payload).map_err(|e| HelloError::Malformed(e.to_string()))?;
        if h.version != PROTOCOL_VERSION {
            return Err(HelloError::Version { node: h.node, theirs: h.version, ours: PROTOCOL_VERSION });
        }
        if h.transport != transport {
            return Err(HelloError::Transport { node: h.node, theirs: h.transport, ours: transport.into() });
        }
        Ok(h)
    }
}

/// Why a one-sided write was refused at the destination. The write fails;
/// the region and every other transfer are untouched.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum WriteError {
    /// No region has this key (never registered, or revoked).
    #[error("unknown or revoked remote key {0:#010x}")]
    UnknownKey(u32),
    /// The write reaches past the region.
    #[error("write of {len} bytes at offset {offset} exceeds region {key:#010x} of {region_len} bytes")]
    OutOfBounds {
        /// Key.
        key: u32,
        /// Offset.
        offset: u64,
        /// Length.
        len: u64,
        /// Region length.
        region_len: u64,
    },
    /// Zero-length writes are refused: they would count nothing and hide bugs.
    #[error("zero-length write")]
    ZeroLength,
}

/// Checks a write against a region of `region_len` bytes (or none); returns the byte range.
pub fn check_write(key: u32, region_len: Option<u64>, offset: u64, len: u64) -> Result<std::ops::Range<u64>, WriteError> {
    let region_len = region_len.ok_or(WriteError::UnknownKey(key))?;
    if len == 0 {
        return Err(WriteError::ZeroLength);
    }
    match offset.checked_add(len) {
        Some(end) if end <= region_len => Ok(offset..end),
        _ => Err(WriteError::OutOfBounds { key, offset, len, region_len }),
    }
}

/// Bytes of one encoded [`WriteNote`].
pub const NOTE_LEN: usize = 24;

/// What a verbs source tells the destination after one-sided writes land:
/// which bytes of which region they covered. It travels as a SEND after
/// the writes on the same RC queue pair, so by the time the destination
/// sees it the bytes are in memory. Naming the range (not only a length,
/// as an immediate value would) lets the destination count a range once
/// even when a slice is written again on another rail after a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteNote {
    /// Slot and layer.
    pub tag: Tag,
    /// Region key (the same on every rail).
    pub key: u32,
    /// Offset in the region.
    pub offset: u64,
    /// Bytes written.
    pub len: u64,
}

impl WriteNote {
    /// Little-endian: tag, key, offset, len.
    pub fn encode(&self, out: &mut [u8]) {
        out[0..4].copy_from_slice(&self.tag.to_wire().to_le_bytes());
        out[4..8].copy_from_slice(&self.key.to_le_bytes());
        out[8..16].copy_from_slice(&self.offset.to_le_bytes());
        out[16..24].copy_from_slice(&self.len.to_le_bytes());
    }

    /// Every note in a received buffer; a length that is not a whole
    /// number of notes is refused (a truncated or foreign message).
    pub fn decode_all(b: &[u8]) -> Result<Vec<WriteNote>, FrameError> {
        if b.len() % NOTE_LEN != 0 {
            return Err(FrameError::NoteLength(b.len()));
        }
        Ok(b
            .chunks_exact(NOTE_LEN)
            .map(|c| {
                let u32_at = |i: usize| u32::from_le_bytes(c[i..i + 4].try_into().expect("4 bytes"));
                let u64_at = |i: usize| u64::from_le_bytes(c[i..i + 8].try_into().expect("8 bytes"));
                WriteNote { tag: Tag::from_wire(u32_at(0)), key: u32_at(4), offset: u64_at(8), len: u64_at(16) }
            })
            .collect())
    }
}
