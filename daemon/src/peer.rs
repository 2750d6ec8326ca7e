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
pub use kvwire_core::session::msg::{PeerMsg, PEER_VERSION};
use kvwire_core::session::kind;
use sha2::Sha256;
use std::io::Read;
use std::net::TcpStream;

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
        other => return Err(AuthError::Denied(format!("expected auth, got {}", kind(&other)))),
    };
    // Checked before it is used anywhere, logs included: an outsider's
    // string goes nowhere unless it is a plain node name.
    if !crate::config::is_node_name(&client) {
        return Err(AuthError::Denied(format!("malformed node name ({} bytes)", client.len())));
    }
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
        other => return Err(AuthError::Denied(format!("expected a challenge, got {}", kind(&other)))),
    };
    if !crate::config::is_node_name(&server) {
        return Err(AuthError::Denied(format!("malformed node name ({} bytes)", server.len())));
    }
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
        other => Err(AuthError::Denied(format!("expected auth_ok, got {}", kind(&other)))),
    }
}
