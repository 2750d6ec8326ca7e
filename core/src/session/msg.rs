//! Daemon ↔ daemon messages, after the HMAC handshake that opens a peer
//! connection (the daemon's `peer` module does the handshake's I/O).
//!
//! The source sends `Offer` with its side of the plan; the destination
//! plans too, stages, and answers `Accept` with its layout, block table,
//! rails, region keys and staging buffer, or `Refused`. The source plans,
//! sends `Expect` (the manifest; no answer) and posts its writes at once;
//! a source streaming layers as they are produced sends each layer's
//! checksums (`LayerSums`) just before that layer's writes instead.
//! Bytes flow on the data plane while the source pings. The destination
//! pushes its `Verdict` as the transfer ends there, unasked; a source that
//! gives up first sends `Abort`.
//!
//! A destination told at prepare which node will fill a request sends that
//! node `Announce` on an idle connection the node opened: the accept,
//! made ahead (keys, an upper-bound staging buffer, each layer's byte
//! count declared). The source's submit then sends `Claim` and `Expect`
//! and posts its writes without waiting for anything; a claim the
//! destination cannot honour is answered `Refused`, and the writes find
//! their keys revoked.

use crate::manifest::{LayerChecksum, Manifest, ManifestError, MAX_MANIFEST_JSON};
use crate::reuse::CacheIdentity;
use crate::shard::RegionId;
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::{Deserialize, Serialize};
use std::borrow::Cow;

/// Peer protocol version.
/// 3: messages after the handshake are sealed, and data connections prove the session.
/// 4: one round trip before the bytes (the offer carries the source's side, the accept the staging buffer; `Expect` is not answered).
/// 5: a source may stream layers as its engine produces them (`Expect::layer_sums`, `LayerSums`).
/// 6: a destination may announce a prepared request (`Announce`); the source claims it with no round trip (`Claim`).
/// 7: a checksum per chunk of a region's stream (manifest version 2, `LayerChecksum::chunk`).
/// 8: the destination pushes each transfer's `Verdict` as it ends; the source sends no `Done`.
/// 9: a transfer's keys are granted to the source node, not to one connection: an announcement may be claimed on any connection of the node it went to.
/// 10: `Expect::manifest` is the manifest's JSON inline, not a string holding it.
/// 11: sealed messages are binary ([`PeerMsg::to_binary`]), and so is `Expect::manifest` ([`ManifestWire`]; hex in JSON).
pub const PEER_VERSION: u32 = 11;

/// Messages on a peer connection. In JSON (the handshake's form): objects,
/// `msg` naming the message (its first key), the rest its fields. Sealed,
/// after the handshake: their binary form ([`PeerMsg::to_binary`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub enum PeerMsg {
    /// Server's challenge.
    Challenge {
        /// Server node.
        node: String,
        /// Protocol version.
        version: u32,
        /// Server nonce (hex).
        nonce: String,
    },
    /// Client's answer.
    Auth {
        /// Client node.
        node: String,
        /// Client nonce (hex).
        nonce: String,
        /// Client proof (hex).
        mac: String,
    },
    /// Server's proof.
    AuthOk {
        /// Server proof (hex).
        mac: String,
    },
    /// Refusal, with the reason.
    Refused {
        /// Why.
        reason: String,
    },
    /// A source offers a transfer into a prepared request.
    Offer(Offer),
    /// The destination accepts and describes where bytes go.
    Accept(Accept),
    /// The integrity manifest of an accepted transfer, sent without
    /// waiting for an answer (there is none): the destination checks it
    /// before it publishes any flag of the slot.
    Expect(Expect),
    /// One layer's checksums, from a source that streams layers as its
    /// engine produces them (its `Expect` said `layer_sums`): sent before
    /// the layer's writes, unanswered; the destination verifies the layer
    /// against them before it publishes `layer_ready`.
    LayerSums(LayerSums),
    /// A prepared request, accepted ahead for the node this connection
    /// authenticated: unsolicited, from destination to source, only on a
    /// connection with no transfer running.
    Announce(Announce),
    /// The source takes an announced request: the offer it would have
    /// made, for the announced slot. Unanswered when the destination
    /// honours it; `Refused` with the reason when it does not.
    Claim(Claim),
    /// Generic success.
    Ok,
    /// The source gave up on a transfer.
    Abort {
        /// Destination slot.
        slot: u16,
        /// Why.
        reason: String,
    },
    /// Liveness while a transfer runs; answered with `Pong`. A source that
    /// stops sending these is gone for the destination after the peer timeout.
    Ping,
    /// The answer to `Ping`.
    Pong,
    /// The destination's verdict on the transfer into `slot`, pushed by
    /// whichever of its threads ends it: `error` is None once it published
    /// `decoder_usable`, else why it failed. Unasked and unanswered; after
    /// it the slot is no longer this connection's.
    Verdict {
        /// Destination slot.
        slot: u16,
        /// Why the transfer failed there; None when it landed.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<String>,
    },
}

/// The message names, for errors.
const MESSAGES: &[&str] = &["challenge", "auth", "auth_ok", "refused", "offer", "accept", "expect", "layer_sums", "announce", "claim", "ok", "abort", "ping", "pong", "verdict"];

/// Read with the tag first, as [`Serialize`] writes it: the fields then go
/// straight into the message. A derived internally tagged enum would
/// buffer the whole object first to find its tag wherever it is, which
/// doubled the parse of every announcement on the submit path.
impl<'de> Deserialize<'de> for PeerMsg {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<PeerMsg, D::Error> {
        d.deserialize_map(MsgVisitor)
    }
}

struct MsgVisitor;

// The fields of the messages that carry no struct of their own.
#[derive(Deserialize)]
struct ChallengeFields {
    node: String,
    version: u32,
    nonce: String,
}

#[derive(Deserialize)]
struct AuthFields {
    node: String,
    nonce: String,
    mac: String,
}

#[derive(Deserialize)]
struct Mac {
    mac: String,
}

#[derive(Deserialize)]
struct Reason {
    reason: String,
}

#[derive(Deserialize)]
struct SlotReason {
    slot: u16,
    reason: String,
}

#[derive(Deserialize)]
struct SlotVerdict {
    slot: u16,
    #[serde(default)]
    error: Option<String>,
}

impl<'de> Visitor<'de> for MsgVisitor {
    type Value = PeerMsg;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a peer message: an object whose first key is `msg`")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<PeerMsg, A::Error> {
        if map.next_key::<String>()?.as_deref() != Some("msg") {
            return Err(de::Error::custom("a peer message's first key must be `msg`"));
        }
        let tag: String = map.next_value()?;
        let rest = de::value::MapAccessDeserializer::new(map);
        Ok(match tag.as_str() {
            "challenge" => {
                let f = ChallengeFields::deserialize(rest)?;
                PeerMsg::Challenge { node: f.node, version: f.version, nonce: f.nonce }
            }
            "auth" => {
                let f = AuthFields::deserialize(rest)?;
                PeerMsg::Auth { node: f.node, nonce: f.nonce, mac: f.mac }
            }
            "auth_ok" => PeerMsg::AuthOk { mac: Mac::deserialize(rest)?.mac },
            "refused" => PeerMsg::Refused { reason: Reason::deserialize(rest)?.reason },
            "offer" => PeerMsg::Offer(Offer::deserialize(rest)?),
            "accept" => PeerMsg::Accept(Accept::deserialize(rest)?),
            "expect" => PeerMsg::Expect(Expect::deserialize(rest)?),
            "layer_sums" => PeerMsg::LayerSums(LayerSums::deserialize(rest)?),
            "announce" => PeerMsg::Announce(Announce::deserialize(rest)?),
            "claim" => PeerMsg::Claim(Claim::deserialize(rest)?),
            "abort" => {
                let f = SlotReason::deserialize(rest)?;
                PeerMsg::Abort { slot: f.slot, reason: f.reason }
            }
            "verdict" => {
                let f = SlotVerdict::deserialize(rest)?;
                PeerMsg::Verdict { slot: f.slot, error: f.error }
            }
            unit @ ("ok" | "ping" | "pong") => {
                de::IgnoredAny::deserialize(rest)?;
                match unit {
                    "ok" => PeerMsg::Ok,
                    "ping" => PeerMsg::Ping,
                    _ => PeerMsg::Pong,
                }
            }
            other => return Err(de::Error::unknown_variant(other, MESSAGES)),
        })
    }
}

impl PeerMsg {
    /// The destination slot a message of a transfer names, if it names one.
    pub fn slot(&self) -> Option<u16> {
        match self {
            PeerMsg::Accept(a) => Some(a.slot),
            PeerMsg::Claim(c) => Some(c.slot),
            PeerMsg::Expect(e) => Some(e.slot),
            PeerMsg::LayerSums(l) => Some(l.slot),
            PeerMsg::Abort { slot, .. } | PeerMsg::Verdict { slot, .. } => Some(*slot),
            _ => None,
        }
    }
}

/// The binary form of a message, as sealed connections carry it: the
/// variant's number, then its fields in order (postcard). JSON stays the
/// form of the handshake, which must tell another version by its
/// challenge; after it both sides speak this daemon's version. An
/// announcement, a claim and the verdict are each parsed on a transfer's
/// path, where JSON cost more than the rest of their handling. Written
/// from borrowed fields, read back into owned ones.
#[derive(Serialize, Deserialize)]
enum Bin<'a> {
    Challenge { node: Cow<'a, str>, version: u32, nonce: Cow<'a, str> },
    Auth { node: Cow<'a, str>, nonce: Cow<'a, str>, mac: Cow<'a, str> },
    AuthOk { mac: Cow<'a, str> },
    Refused { reason: Cow<'a, str> },
    Offer(Cow<'a, Offer>),
    Accept(Cow<'a, Accept>),
    Expect(Cow<'a, Expect>),
    LayerSums(Cow<'a, LayerSums>),
    Announce(Cow<'a, Announce>),
    Claim(Cow<'a, Claim>),
    Ok,
    Abort { slot: u16, reason: Cow<'a, str> },
    Ping,
    Pong,
    Verdict { slot: u16, error: Option<Cow<'a, str>> },
}

impl PeerMsg {
    /// This message's binary form (see [`Bin`]).
    pub fn to_binary(&self) -> Vec<u8> {
        fn b(s: &str) -> Cow<'_, str> {
            Cow::Borrowed(s)
        }
        let m = match self {
            PeerMsg::Challenge { node, version, nonce } => Bin::Challenge { node: b(node), version: *version, nonce: b(nonce) },
            PeerMsg::Auth { node, nonce, mac } => Bin::Auth { node: b(node), nonce: b(nonce), mac: b(mac) },
            PeerMsg::AuthOk { mac } => Bin::AuthOk { mac: b(mac) },
            PeerMsg::Refused { reason } => Bin::Refused { reason: b(reason) },
            PeerMsg::Offer(o) => Bin::Offer(Cow::Borrowed(o)),
            PeerMsg::Accept(a) => Bin::Accept(Cow::Borrowed(a)),
            PeerMsg::Expect(e) => Bin::Expect(Cow::Borrowed(e)),
            PeerMsg::LayerSums(l) => Bin::LayerSums(Cow::Borrowed(l)),
            PeerMsg::Announce(a) => Bin::Announce(Cow::Borrowed(a)),
            PeerMsg::Claim(c) => Bin::Claim(Cow::Borrowed(c)),
            PeerMsg::Ok => Bin::Ok,
            PeerMsg::Abort { slot, reason } => Bin::Abort { slot: *slot, reason: b(reason) },
            PeerMsg::Ping => Bin::Ping,
            PeerMsg::Pong => Bin::Pong,
            PeerMsg::Verdict { slot, error } => Bin::Verdict { slot: *slot, error: error.as_deref().map(b) },
        };
        postcard::to_allocvec(&m).expect("a message encodes to memory")
    }

    /// Reads a message's binary form, refusing bytes that do not decode
    /// and bytes left over. A length inside it reserves at most 1 MiB
    /// ahead of the elements that are really there (serde's cautious
    /// hint); the frame's own limit bounds the rest.
    pub fn from_binary(bytes: &[u8]) -> Result<PeerMsg, String> {
        let (m, rest) = postcard::take_from_bytes::<Bin>(bytes).map_err(|e| format!("malformed peer message: {e}"))?;
        if !rest.is_empty() {
            return Err(format!("malformed peer message: {} bytes after it", rest.len()));
        }
        let o = Cow::into_owned;
        Ok(match m {
            Bin::Challenge { node, version, nonce } => PeerMsg::Challenge { node: o(node), version, nonce: o(nonce) },
            Bin::Auth { node, nonce, mac } => PeerMsg::Auth { node: o(node), nonce: o(nonce), mac: o(mac) },
            Bin::AuthOk { mac } => PeerMsg::AuthOk { mac: o(mac) },
            Bin::Refused { reason } => PeerMsg::Refused { reason: o(reason) },
            Bin::Offer(x) => PeerMsg::Offer(x.into_owned()),
            Bin::Accept(x) => PeerMsg::Accept(x.into_owned()),
            Bin::Expect(x) => PeerMsg::Expect(x.into_owned()),
            Bin::LayerSums(x) => PeerMsg::LayerSums(x.into_owned()),
            Bin::Announce(x) => PeerMsg::Announce(x.into_owned()),
            Bin::Claim(x) => PeerMsg::Claim(x.into_owned()),
            Bin::Ok => PeerMsg::Ok,
            Bin::Abort { slot, reason } => PeerMsg::Abort { slot, reason: o(reason) },
            Bin::Ping => PeerMsg::Ping,
            Bin::Pong => PeerMsg::Pong,
            Bin::Verdict { slot, error } => PeerMsg::Verdict { slot, error: error.map(o) },
        })
    }
}

/// An offered transfer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Offer {
    /// Destination group.
    pub dst_group: String,
    /// Destination request.
    pub dst_request: String,
    /// Source request (for logs).
    pub src_request: String,
    /// What the source cache holds.
    pub identity: CacheIdentity,
    /// Tokens in the request.
    pub tokens: u64,
    /// Transfer codec, if any.
    #[serde(default)]
    pub codec: Option<String>,
    /// Source layout string: with the table, the source's side of the
    /// plan, which the destination plans from before it accepts.
    pub src_layout: String,
    /// Source blocks per region.
    pub src_num_blocks: u32,
    /// Source block table.
    pub src_block_table: Vec<u32>,
}

/// A request the destination prepared and accepted ahead, for the node
/// it names in its prepare.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Announce {
    /// Destination group.
    pub group: String,
    /// Destination request.
    pub request: String,
    /// Which preparation of the slot this is: a claim must name it, so a
    /// claim of an earlier, cancelled preparation cannot take a later one.
    pub gen: u64,
    /// Tokens the request will hold.
    pub tokens: u64,
    /// What the destination holds (its prefix must match the source's).
    pub identity: CacheIdentity,
    /// Bytes each layer receives, declared already: a source whose
    /// schedule sends other counts (a codec) must offer instead.
    pub layer_bytes: Vec<u64>,
    /// The accept, made ahead. Its staging buffer is an upper bound: the
    /// source's schedule may stage less.
    pub accept: Accept,
}

/// A source's claim of an announced request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Claim {
    /// The announced slot.
    pub slot: u16,
    /// The announcement's `gen`.
    pub gen: u64,
    /// What an offer would have said; no codec.
    pub offer: Offer,
}

/// The manifest of an accepted transfer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expect {
    /// Destination slot.
    pub slot: u16,
    /// The integrity manifest, checksums included unless the source
    /// turned them off or sends them per layer.
    pub manifest: ManifestWire,
    /// The checksums come per layer, each in a `LayerSums` before that
    /// layer's writes, instead of in the manifest: the source streams layers
    /// as its engine produces them, so none can be hashed up front.
    #[serde(default)]
    pub layer_sums: bool,
}

/// A manifest in its compact binary form ([`Manifest::to_wire`]), as hex
/// in its message. Decoded by [`ManifestWire::manifest`], with the
/// manifest's own limit and version check.
#[derive(Debug, Clone, PartialEq)]
pub struct ManifestWire(Vec<u8>);

impl ManifestWire {
    /// `m`, encoded once.
    pub fn of(m: &Manifest) -> ManifestWire {
        ManifestWire(m.to_wire())
    }

    /// Bytes as they are, whatever they hold: what a message carries.
    pub fn from_bytes(bytes: Vec<u8>) -> ManifestWire {
        ManifestWire(bytes)
    }

    /// The encoded bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.0
    }

    /// The manifest these bytes hold.
    pub fn manifest(&self) -> Result<Manifest, ManifestError> {
        Manifest::from_wire(&self.0)
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

// Hex in JSON; the bytes themselves in the binary form.
impl Serialize for ManifestWire {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if !s.is_human_readable() {
            return s.serialize_bytes(&self.0);
        }
        let mut text = String::with_capacity(2 * self.0.len());
        for b in &self.0 {
            text.push(char::from(HEX[usize::from(b >> 4)]));
            text.push(char::from(HEX[usize::from(b & 15)]));
        }
        s.serialize_str(&text)
    }
}

impl<'de> Deserialize<'de> for ManifestWire {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<ManifestWire, D::Error> {
        struct Hex;
        impl Visitor<'_> for Hex {
            type Value = ManifestWire;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a binary manifest as lowercase hex")
            }

            fn visit_bytes<E: de::Error>(self, bytes: &[u8]) -> Result<ManifestWire, E> {
                Ok(ManifestWire(bytes.to_vec()))
            }

            fn visit_str<E: de::Error>(self, text: &str) -> Result<ManifestWire, E> {
                // The message's own limit bounds the text; this one names it.
                if text.len() > 2 * MAX_MANIFEST_JSON {
                    return Err(E::custom(format!("a manifest of {} hex digits; at most {}", text.len(), 2 * MAX_MANIFEST_JSON)));
                }
                if text.len() % 2 != 0 {
                    return Err(E::custom(format!("a manifest of {} hex digits, an odd count", text.len())));
                }
                let digit = |c: u8| match c {
                    b'0'..=b'9' => Some(c - b'0'),
                    b'a'..=b'f' => Some(c - b'a' + 10),
                    _ => None,
                };
                let pairs = text.as_bytes().chunks_exact(2);
                let bytes: Option<Vec<u8>> = pairs.map(|p| Some(digit(p[0])? << 4 | digit(p[1])?)).collect();
                bytes.map(ManifestWire).ok_or_else(|| E::custom("a manifest's hex holds a character other than 0-9 and a-f"))
            }
        }
        match d.is_human_readable() {
            true => d.deserialize_str(Hex),
            false => d.deserialize_bytes(Hex),
        }
    }
}

/// One layer's checksums (see [`PeerMsg::LayerSums`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerSums {
    /// Destination slot.
    pub slot: u16,
    /// The layer.
    pub layer: u16,
    /// Its checksums, as the manifest would carry them (empty when the
    /// source does not hash).
    pub checksums: Vec<LayerChecksum>,
}

/// One destination region a source may write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerRegion {
    /// Destination rank.
    pub rank: u32,
    /// Which region.
    pub region: RegionId,
    /// Data-plane key.
    pub key: u32,
    /// Length.
    pub len: u64,
}

/// The destination's answer to an offer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Accept {
    /// Destination slot (its flags, and the tag of every write).
    pub slot: u16,
    /// Destination layout string.
    pub layout: String,
    /// Its cache format id.
    pub format: String,
    /// Its blocks per region.
    pub num_blocks: u32,
    /// The request's block table.
    pub block_table: Vec<u32>,
    /// Prefix positions the destination holds (already checked against identity).
    pub prefix_tokens: u64,
    /// Data-plane address to connect to.
    pub data_addr: String,
    /// Data-plane transport (`tcp`, `shm`, `verbs`).
    pub transport: String,
    /// Every region of every destination rank.
    pub regions: Vec<PeerRegion>,
    /// The staging buffer for packed or converted segments: its key (0
    /// when nothing is staged) and length, which the source's own
    /// schedule must match.
    pub stage_key: u32,
    /// Its length.
    pub stage_len: u64,
    /// Every data rail of the destination, `data_addr`'s first: the
    /// source stripes slices across those it can reach.
    #[serde(default)]
    pub rails: Vec<RailAddr>,
    /// Per destination rank, the rails closest to its memory, when some
    /// rails are closer than others; slices for that rank use only these
    /// while any of them is up.
    #[serde(default)]
    pub locality: Vec<RankRails>,
}

/// The rails a destination rank prefers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RankRails {
    /// Destination rank.
    pub rank: u32,
    /// Rail names, all of the best locality level.
    pub rails: Vec<String>,
    /// That level (`same-pcie-switch`, `same-numa`, ...).
    pub level: String,
}

/// One data rail of a daemon.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RailAddr {
    /// Rail name.
    pub name: String,
    /// Data-plane address on it.
    pub addr: String,
}
