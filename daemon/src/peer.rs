//! Daemon ↔ daemon control: a TCP connection authenticated by HMAC-SHA256
//! challenge–response over the shared secret (both sides prove they hold
//! it; the secret never crosses the wire), then offer/accept of transfers.
//!
//! 1. server → `Challenge { node, version, nonce_s }`
//! 2. client → `Auth { node, nonce_c, mac = HMAC(secret, "kvwire-peer-client-v1" ‖ nonce_s ‖ nonce_c ‖ client node) }`
//! 3. server → `AuthOk { mac = HMAC(secret, "kvwire-peer-server-v1" ‖ nonce_c ‖ nonce_s ‖ server node) }` or `Refused`
//!
//! Then the source sends `Offer`, the destination answers `Accept` with its
//! layout, block table, data-plane address and region keys; the source plans
//! and sends `Expect` (bytes per layer); bytes flow on the data plane;
//! `Abort` fails the destination's flags when the source gives up.

use kvwire_client::wire::{read_msg, write_msg, WireError};
use hmac::{Hmac, Mac};
use kvwire_core::reuse::CacheIdentity;
use kvwire_core::shard::RegionId;
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use std::io::Read;
use std::net::TcpStream;

/// Peer protocol version.
pub const PEER_VERSION: u32 = 2;

/// Messages on a peer connection.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    /// The source's side of the plan and the integrity manifest; the
    /// destination recomputes the plan, checks the manifest, and only then
    /// expects bytes.
    Expect(Expect),
    /// Generic success.
    Ok,
    /// The destination's staging buffer for packed or converted segments.
    Staging {
        /// Data-plane key (0 when nothing is staged).
        key: u32,
        /// Length.
        len: u64,
    },
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
    /// Every write of the transfer into `slot` completed at the source, so
    /// a connection closed after this is not a failure.
    Done {
        /// Destination slot.
        slot: u16,
    },
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
}

/// What the destination needs to recompute the plan and check it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expect {
    /// Destination slot.
    pub slot: u16,
    /// Source layout string.
    pub src_layout: String,
    /// Source blocks per region.
    pub src_num_blocks: u32,
    /// Source block table.
    pub src_block_table: Vec<u32>,
    /// The integrity manifest (JSON), checksums included unless the source turned them off.
    pub manifest: String,
    /// Transfer codec, if any (as offered).
    #[serde(default)]
    pub codec: Option<String>,
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

/// Why authentication failed.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// Transport-level failure.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// The other side does not hold the secret, or refused us.
    #[error("peer authentication failed: {0}")]
    Denied(String),
}

type HmacSha256 = Hmac<Sha256>;

fn mac(secret: &[u8], label: &str, parts: &[&[u8]]) -> Vec<u8> {
    let mut m = HmacSha256::new_from_slice(secret).expect("HMAC takes any key length");
    m.update(label.as_bytes());
    for p in parts {
        m.update(&(p.len() as u32).to_le_bytes());
        m.update(p);
    }
    m.finalize().into_bytes().to_vec()
}

fn verify(secret: &[u8], label: &str, parts: &[&[u8]], proof_hex: &str) -> bool {
    let Some(proof) = unhex(proof_hex) else { return false };
    let mut m = HmacSha256::new_from_slice(secret).expect("HMAC takes any key length");
    m.update(label.as_bytes());
    for p in parts {
        m.update(&(p.len() as u32).to_le_bytes());
        m.update(p);
    }
    // Constant-time comparison.
    m.verify_slice(&proof).is_ok()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 || s.len() > 128 {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok()).collect()
}

/// 32 random bytes from the kernel.
pub fn nonce() -> Vec<u8> {
    let mut b = vec![0u8; 32];
    std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b)).expect("/dev/urandom is readable");
    b
}

/// Server side of the handshake; returns the authenticated client's node
/// name. On failure the caller counts the refusal, then sends
/// [`PeerMsg::Refused`] so the client's error names the cause.
pub fn accept_auth(s: &mut TcpStream, secret: &[u8], node: &str) -> Result<String, AuthError> {
    let ns = nonce();
    write_msg(s, &PeerMsg::Challenge { node: node.into(), version: PEER_VERSION, nonce: hex(&ns) })?;
    let (client, nc, proof) = match read_msg::<PeerMsg>(s)? {
        PeerMsg::Auth { node, nonce, mac } => (node, nonce, mac),
        other => return Err(AuthError::Denied(format!("expected auth, got {other:?}"))),
    };
    let nc_bytes = unhex(&nc).filter(|n| n.len() == 32).ok_or_else(|| AuthError::Denied("malformed client nonce".into()))?;
    if !verify(secret, "kvwire-peer-client-v1", &[&ns, &nc_bytes, client.as_bytes()], &proof) {
        return Err(AuthError::Denied(format!("peer `{client}` does not hold the shared secret")));
    }
    let m = mac(secret, "kvwire-peer-server-v1", &[&nc_bytes, &ns, node.as_bytes()]);
    write_msg(s, &PeerMsg::AuthOk { mac: hex(&m) })?;
    Ok(client)
}

/// Client side of the handshake; returns the authenticated server's node name.
pub fn connect_auth(s: &mut TcpStream, secret: &[u8], node: &str) -> Result<String, AuthError> {
    let (server, version, ns) = match read_msg::<PeerMsg>(s)? {
        PeerMsg::Challenge { node, version, nonce } => (node, version, nonce),
        other => return Err(AuthError::Denied(format!("expected a challenge, got {other:?}"))),
    };
    if version != PEER_VERSION {
        return Err(AuthError::Denied(format!("peer `{server}` speaks peer protocol {version}, this daemon {PEER_VERSION}")));
    }
    let ns_bytes = unhex(&ns).filter(|n| n.len() == 32).ok_or_else(|| AuthError::Denied("malformed server nonce".into()))?;
    let nc = nonce();
    let m = mac(secret, "kvwire-peer-client-v1", &[&ns_bytes, &nc, node.as_bytes()]);
    write_msg(s, &PeerMsg::Auth { node: node.into(), nonce: hex(&nc), mac: hex(&m) })?;
    match read_msg::<PeerMsg>(s)? {
        PeerMsg::AuthOk { mac: proof } if verify(secret, "kvwire-peer-server-v1", &[&nc, &ns_bytes, server.as_bytes()], &proof) => Ok(server),
        PeerMsg::AuthOk { .. } => Err(AuthError::Denied(format!("peer `{server}` failed to prove the shared secret"))),
        PeerMsg::Refused { reason } => Err(AuthError::Denied(format!("peer `{server}` refused: {reason}"))),
        other => Err(AuthError::Denied(format!("expected auth_ok, got {other:?}"))),
    }
}
