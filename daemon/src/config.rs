//! kvwired settings: TOML file, then `KVWIRED_*` environment variables, then
//! command-line flags — the later wins. Every key, its default and its
//! meaning is documented in `config/kvwired.example.toml`. A bad setting
//! fails at start with the key and the reason.

use serde::Deserialize;
use std::path::PathBuf;
use std::time::Duration;

pub use kvwire_core::protocol::TransportKind;

/// A statically configured peer daemon.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerConfig {
    /// The peer's node name (what clients name as a transfer's destination).
    pub name: String,
    /// Its peer-control address, `host:port`.
    pub address: String,
}

/// One more data rail, of the `[transport]` kind: for tcp a listener on
/// another NIC's address, for verbs another RDMA device. The `[transport]`
/// endpoint is always the first rail, `rail0`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RailConfig {
    /// Rail name, in reports and metrics.
    pub name: String,
    /// tcp: data listener on this rail's address (port 0 picks one).
    #[serde(default)]
    pub tcp_listen: String,
    /// verbs: the RDMA device (e.g. `mlx5_1`, `rxe1`).
    #[serde(default)]
    pub verbs_device: Option<String>,
    /// verbs: its port.
    #[serde(default = "default_verbs_port")]
    pub verbs_port: u8,
    /// verbs: GID index (default: its IPv4-mapped RoCE v2 GID).
    #[serde(default)]
    pub verbs_gid_index: Option<u32>,
    /// verbs: the rail's handshake listener (port 0 picks one).
    #[serde(default = "default_verbs_listen")]
    pub verbs_listen: String,
    /// Address told to peers for this rail, when it differs from the bound one.
    #[serde(default)]
    pub tcp_advertise: Option<String>,
    /// The netdev or RDMA device this rail uses, for locality (sysfs);
    /// verbs rails default to their RDMA device.
    #[serde(default)]
    pub device: Option<String>,
}

fn default_verbs_port() -> u8 {
    1
}

fn default_verbs_listen() -> String {
    "127.0.0.1:0".into()
}

/// Data-plane settings.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TransportConfig {
    /// Which transport to offer.
    pub kind: TransportKind,
    /// Data listener for `tcp` (port 0 picks one; peers learn it in the handshake).
    pub tcp_listen: String,
    /// Data address told to peers for `tcp`, when they must reach this host
    /// through another address (NAT, a proxy); default: the bound address.
    pub tcp_advertise: Option<String>,
    /// Directory for `shm` sockets (default: a private temp dir).
    pub shm_dir: Option<PathBuf>,
    /// RDMA device for `verbs` (default: the first).
    pub verbs_device: Option<String>,
    /// RDMA port.
    pub verbs_port: u8,
    /// GID index (default: the IPv4-mapped RoCE v2 GID).
    pub verbs_gid_index: Option<u32>,
    /// Handshake listener for `verbs`.
    pub verbs_listen: String,
    /// Largest slice a transfer is cut into for striping across rails:
    /// each slice travels whole on one rail and is re-sent whole on another
    /// if its rail fails. Smaller slices balance rails more finely and lose
    /// less on a failure; larger ones cost fewer completions.
    pub slice_bytes: u64,
    /// A rail with slices outstanding and no completion for this long is
    /// failed and its slices re-sent on the others (a port that went down
    /// breaks no TCP connection by itself).
    pub rail_stall_ms: u64,
    /// A source transfer of at least this many payload bytes is packed and
    /// hashed beside the wire: its manifest goes without checksums, and a
    /// worker packs and hashes each layer, its checksums and then its bytes
    /// going as soon as it is done (striped over several rails: packed
    /// first, then hashed beside the writes). Smaller ones are packed and hashed
    /// whole first (per-layer messages and hand-offs cost more than they save:
    /// at 1 MiB, packing each piece just before its write and sending the
    /// checksums after the bytes reached `decoder_usable` in 0.77-0.79 ms
    /// against 0.68-0.71, its posts twice as long with the destination
    /// woken per piece).
    pub hash_beside_bytes: u64,
    /// A receive prepared for a named source node (`source` in the
    /// prepare) of at most this many payload bytes is announced to it:
    /// keys granted and a staging buffer of the payload's size set aside
    /// ahead, so its submit needs no round trip. Larger ones wait for the
    /// source's offer (the round trip is small beside their bytes, and the
    /// buffer would be large). 0 announces nothing.
    pub announce_max_bytes: u64,
    /// The netdev or RDMA device of the `[transport]` rail (`rail0`), for
    /// locality (sysfs); with verbs and `[[rails]]`, the verbs device.
    pub device: Option<String>,
    /// A topology file overriding what sysfs says (see `kvwire topology`):
    /// a device it names that does not exist stops the daemon.
    pub topology_file: Option<PathBuf>,
    /// Microseconds a serving thread polls its connection for the next
    /// message before it sleeps, while messages come that close together
    /// ([`kvwire_transport::idle::IdleSpin`]). Unset: [`IDLE_POLL_PINNED`]
    /// when `cpus` gives the daemon cores of its own, else 0.
    pub idle_poll_us: Option<u64>,
}

/// The poll window of a daemon on cores of its own. kvwire-soak 64 KiB
/// tcp, each daemon on a core of its own: p50 0.117-0.118 ms sleeping at
/// once, 0.083-0.084 polling 200 us; unpinned, polling ran 0.085-0.149
/// (its pollers sharing a core with the source's threads in some runs).
pub const IDLE_POLL_PINNED: Duration = Duration::from_micros(200);

impl Default for TransportConfig {
    fn default() -> Self {
        TransportConfig {
            kind: TransportKind::Tcp,
            tcp_listen: "127.0.0.1:0".into(),
            tcp_advertise: None,
            shm_dir: None,
            verbs_device: None,
            verbs_port: 1,
            verbs_gid_index: None,
            verbs_listen: "127.0.0.1:0".into(),
            slice_bytes: 1 << 20,
            rail_stall_ms: 2000,
            hash_beside_bytes: 16 << 20,
            announce_max_bytes: 16 << 20,
            device: None,
            topology_file: None,
            idle_poll_us: None,
        }
    }
}

/// Resource limits.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Most registered regions (one per layer tensor per registered rank).
    pub max_regions: usize,
    /// Most transfers in flight, both directions.
    pub max_inflight_transfers: usize,
    /// Most receives one client may hold prepared (not yet offered into),
    /// so no single client can take every slot.
    pub max_prepared_per_client: usize,
    /// Most bytes of client memory registered at once.
    pub max_memory_bytes: u64,
    /// Most concurrent control clients.
    pub max_clients: usize,
    /// Seconds a transfer may take before it fails.
    pub transfer_timeout_secs: u64,
    /// Seconds a peer may stay silent mid-transfer before the transfer
    /// fails on this side; a closed peer connection fails it at once.
    pub peer_timeout_secs: u64,
    /// Most bytes of staging buffers kept between transfers, already
    /// faulted in, for the next transfer to reuse; as much again of
    /// device-resident sources' pinned rings.
    pub staging_pool_bytes: u64,
    /// Idle connections kept per peer (peer-control, and data per rail)
    /// between transfers, for the next transfers to that peer: as many as
    /// usually overlap. A transfer finding none idle opens one; one handed
    /// back past this many is closed. 0 keeps none: each transfer from here
    /// opens its own, and the peer has no idle connection from here to
    /// announce a receive on.
    pub peer_connections_kept: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_regions: 4096,
            max_inflight_transfers: 64,
            max_prepared_per_client: 32,
            max_memory_bytes: 64 << 30,
            max_clients: 256,
            transfer_timeout_secs: 120,
            peer_timeout_secs: 10,
            staging_pool_bytes: 512 << 20,
            peer_connections_kept: 8,
        }
    }
}

/// Discovery through etcd (`crate::discovery`): this daemon registers under
/// a lease, and a peer missing from `[[peers]]` is looked up there.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DiscoveryConfig {
    /// etcd client endpoints, `host:port` or `http://host:port`; empty = off.
    pub etcd: Vec<String>,
    /// Seconds this daemon's entry outlives it when it dies without
    /// revoking its lease (killed, host down, cut off from etcd).
    pub lease_ttl_secs: u64,
    /// Key prefix: entries are `{prefix}/nodes/{node}`.
    pub prefix: String,
    /// Peer-control address told to other daemons, when it differs from the
    /// bound `peer_listen` (which must then not be a wildcard address).
    pub advertise_peer: Option<String>,
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        DiscoveryConfig { etcd: Vec::new(), lease_ttl_secs: 10, prefix: "/kvwire/v1".into(), advertise_peer: None }
    }
}

/// Everything kvwired needs.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// This daemon's node name.
    pub node: String,
    /// Control socket path (mode 0600).
    pub control_socket: PathBuf,
    /// Peer-control listener, `host:port`.
    pub peer_listen: String,
    /// Prometheus metrics listener, `host:port`; empty = off.
    pub metrics_listen: String,
    /// File holding the shared secret peers authenticate with.
    pub secret_file: Option<PathBuf>,
    /// Checksum every transfer: the source sends xxh3 of what it wrote, the
    /// destination recomputes each layer before publishing its flag.
    pub verify_checksums: bool,
    /// Data plane.
    pub transport: TransportConfig,
    /// Static peers.
    pub peers: Vec<PeerConfig>,
    /// Data rails beyond `[transport]`'s own.
    pub rails: Vec<RailConfig>,
    /// Limits.
    pub limits: Limits,
    /// Discovery through etcd (off by default: static peers only).
    pub discovery: DiscoveryConfig,
    /// Device-resident caches (GPU memory).
    pub device: DeviceConfig,
    /// CPUs the daemon runs on, as a Linux CPU list (`2`, `2-3`, `0,4-5`);
    /// empty: wherever the scheduler puts it.
    pub cpus: String,
}

/// How device-resident caches are reached.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DeviceConfig {
    /// `none` (clients register host memory only), `cuda` (clients hand
    /// over GPU allocations; staged through pinned host memory), or `host`
    /// (a stand-in whose "device memory" is host memory with asynchronous
    /// copies, for tests and demos without a GPU).
    pub backend: String,
    /// The device ordinal this daemon serves.
    pub ordinal: u32,
    /// Longest wait for one layer's device copies (D2H at the source, H2D
    /// at the destination) before the transfer fails.
    pub copy_timeout_secs: u64,
    /// Slots in a device-resident source's staging ring, each one layer's
    /// source bytes: layer L+1..L+depth-1's device → host copies run while
    /// layer L is on the wire, and a transfer holds `depth` layers of
    /// pinned host memory, not its ranks'.
    pub ring_depth: u32,
    /// Whether a device-resident source's NIC reads its allocations in
    /// place (GPUDirect), chosen per allocation at registration:
    /// - `auto`: on verbs, each allocation is registered with every rail's
    ///   NIC (CUDA: `ibv_reg_dmabuf_mr` of the dmabuf the client handed
    ///   over; the stand-in: its host memory as it is); where that is
    ///   refused, or on tcp or shm, the allocation stages through the ring,
    ///   and the reason is logged and reported (`kvwire_device_memory`).
    /// - `on`: as auto on any transport that can read the memory (the
    ///   stand-in's host memory on tcp and shm too); a refusal fails the
    ///   registration.
    /// - `off`: every allocation stages through the ring.
    pub gpudirect: String,
    /// `host` stand-in only (tests): every copy sleeps this long first, as
    /// a slow device would.
    pub standin_delay_ms: u64,
    /// `host` stand-in only (tests): the N-th copy (from 0) of this
    /// daemon's stand-in device fails, as a broken device would.
    pub standin_fail_copy: Option<u64>,
}

impl Default for DeviceConfig {
    fn default() -> Self {
        DeviceConfig { backend: "none".into(), ordinal: 0, copy_timeout_secs: 30, ring_depth: 2, gpudirect: "auto".into(), standin_delay_ms: 0, standin_fail_copy: None }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            node: "kvwired".into(),
            control_socket: PathBuf::from("/run/kvwire/kvwired.sock"),
            peer_listen: "127.0.0.1:7400".into(),
            metrics_listen: String::new(),
            secret_file: None,
            verify_checksums: true,
            transport: TransportConfig::default(),
            peers: Vec::new(),
            rails: Vec::new(),
            limits: Limits::default(),
            discovery: DiscoveryConfig::default(),
            device: DeviceConfig::default(),
            cpus: String::new(),
        }
    }
}

/// Why the settings were refused; always names the key.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("config file {path}: {reason}")]
    Read {
        /// Path.
        path: String,
        /// OS error.
        reason: String,
    },
    /// The TOML is malformed or has an unknown key / wrong type.
    #[error("config file {path}: {reason}")]
    Parse {
        /// Path.
        path: String,
        /// Parser message (names the key).
        reason: String,
    },
    /// A value is impossible.
    #[error("config key `{key}`: {reason}")]
    Invalid {
        /// Dotted key.
        key: String,
        /// Why.
        reason: String,
    },
}

/// Most idle connections kept per peer: a bound, so a typo cannot hold
/// thousands of sockets open.
pub const MAX_PEER_CONNECTIONS_KEPT: usize = 64;

fn invalid(key: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { key: key.into(), reason: reason.into() }
}

impl Config {
    /// Parses TOML text (`path` only names it in errors).
    pub fn from_toml(path: &str, text: &str) -> Result<Config, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse { path: path.into(), reason: one_line(&e.to_string()) })
    }

    /// Reads and parses a file.
    pub fn load(path: &std::path::Path) -> Result<Config, ConfigError> {
        let p = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read { path: p.clone(), reason: e.to_string() })?;
        Config::from_toml(&p, &text)
    }

    /// Applies `KVWIRED_*` variables from `vars` (e.g. `std::env::vars()`):
    /// `KVWIRED_NODE`, `KVWIRED_CONTROL_SOCKET`, `KVWIRED_PEER_LISTEN`,
    /// `KVWIRED_METRICS_LISTEN`, `KVWIRED_SECRET_FILE`, `KVWIRED_TRANSPORT`.
    pub fn apply_env(&mut self, vars: impl IntoIterator<Item = (String, String)>) -> Result<(), ConfigError> {
        for (k, v) in vars {
            match k.as_str() {
                "KVWIRED_NODE" => self.node = v,
                "KVWIRED_CONTROL_SOCKET" => self.control_socket = v.into(),
                "KVWIRED_PEER_LISTEN" => self.peer_listen = v,
                "KVWIRED_METRICS_LISTEN" => self.metrics_listen = v,
                "KVWIRED_SECRET_FILE" => self.secret_file = Some(v.into()),
                "KVWIRED_TRANSPORT" => {
                    self.transport.kind = v.parse().map_err(|_| invalid("KVWIRED_TRANSPORT", format!("expected tcp, shm or verbs, got `{v}`")))?;
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Checks values that parse but cannot work.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !is_node_name(&self.node) {
            return Err(invalid("node", "1-64 characters of [A-Za-z0-9-_.]"));
        }
        let addr = |key: &str, v: &str| -> Result<(), ConfigError> {
            v.parse::<std::net::SocketAddr>().map(|_| ()).map_err(|e| invalid(key, format!("`{v}` is not host:port ({e})")))
        };
        addr("peer_listen", &self.peer_listen)?;
        if !self.metrics_listen.is_empty() {
            addr("metrics_listen", &self.metrics_listen)?;
        }
        addr("transport.tcp_listen", &self.transport.tcp_listen)?;
        if let Some(a) = &self.transport.tcp_advertise {
            addr("transport.tcp_advertise", a)?;
        }
        addr("transport.verbs_listen", &self.transport.verbs_listen)?;
        if self.control_socket.as_os_str().len() > 100 {
            return Err(invalid("control_socket", "path longer than a Unix socket allows (100 bytes)"));
        }
        let mut names = std::collections::HashSet::new();
        for (i, p) in self.peers.iter().enumerate() {
            addr(&format!("peers[{i}].address"), &p.address)?;
            if !names.insert(&p.name) {
                return Err(invalid(&format!("peers[{i}].name"), format!("peer `{}` listed twice", p.name)));
            }
        }
        let mut rails = std::collections::HashSet::from(["rail0"]);
        for (i, r) in self.rails.iter().enumerate() {
            if r.name.is_empty() || !rails.insert(&r.name) {
                return Err(invalid(&format!("rails[{i}].name"), format!("`{}` is empty or taken (the [transport] rail is `rail0`)", r.name)));
            }
            // Like [transport]'s keys, a rail's keys of another kind are
            // not read (one example file serves both kinds).
            match self.transport.kind {
                TransportKind::Tcp => addr(&format!("rails[{i}].tcp_listen"), &r.tcp_listen)?,
                TransportKind::Verbs => {
                    if r.verbs_device.as_deref().is_none_or(str::is_empty) {
                        return Err(invalid(&format!("rails[{i}].verbs_device"), "a verbs rail names its RDMA device (see `ibv_devices`)"));
                    }
                    if r.verbs_port == 0 {
                        return Err(invalid(&format!("rails[{i}].verbs_port"), "ports are numbered from 1"));
                    }
                    addr(&format!("rails[{i}].verbs_listen"), &r.verbs_listen)?;
                }
                TransportKind::Shm => {
                    return Err(invalid(&format!("rails[{i}]"), "extra rails are supported for transport.kind = \"tcp\" and \"verbs\", not shm"));
                }
            }
        }
        if !(4096..=1 << 30).contains(&self.transport.slice_bytes) {
            return Err(invalid("transport.slice_bytes", "between 4096 and 1073741824"));
        }
        if !["none", "host", "cuda"].contains(&self.device.backend.as_str()) {
            return Err(invalid("device.backend", format!("`{}`: expected none, cuda or host", self.device.backend)));
        }
        if self.device.copy_timeout_secs == 0 {
            return Err(invalid("device.copy_timeout_secs", "must be > 0"));
        }
        if !(1..=64).contains(&self.device.ring_depth) {
            return Err(invalid("device.ring_depth", "between 1 and 64"));
        }
        if !["auto", "on", "off"].contains(&self.device.gpudirect.as_str()) {
            return Err(invalid("device.gpudirect", format!("`{}`: expected auto, on or off", self.device.gpudirect)));
        }
        self.cpu_list()?;
        if self.transport.idle_poll_us.is_some_and(|us| us > 10_000) {
            return Err(invalid("transport.idle_poll_us", "at most 10000 (10 ms): a longer poll only burns the core"));
        }
        if self.transport.rail_stall_ms == 0 {
            return Err(invalid("transport.rail_stall_ms", "must be > 0"));
        }
        let l = &self.limits;
        for (key, v) in [
            ("limits.max_regions", l.max_regions as u64),
            ("limits.max_inflight_transfers", l.max_inflight_transfers as u64),
            ("limits.max_prepared_per_client", l.max_prepared_per_client as u64),
            ("limits.max_memory_bytes", l.max_memory_bytes),
            ("limits.max_clients", l.max_clients as u64),
            ("limits.transfer_timeout_secs", l.transfer_timeout_secs),
            ("limits.peer_timeout_secs", l.peer_timeout_secs),
        ] {
            if v == 0 {
                return Err(invalid(key, "must be > 0"));
            }
        }
        if l.peer_timeout_secs > l.transfer_timeout_secs {
            return Err(invalid("limits.peer_timeout_secs", "must not exceed limits.transfer_timeout_secs"));
        }
        if l.peer_connections_kept > MAX_PEER_CONNECTIONS_KEPT {
            return Err(invalid("limits.peer_connections_kept", format!("at most {MAX_PEER_CONNECTIONS_KEPT} (each holds a socket, and per rail its data connection)")));
        }
        if l.max_inflight_transfers > 200 {
            return Err(invalid("limits.max_inflight_transfers", "at most 200 (flag-page slots)"));
        }
        self.validate_discovery()
    }

    /// The CPUs `cpus` names, ascending; empty when it is unset.
    pub fn cpu_list(&self) -> Result<Vec<usize>, ConfigError> {
        kvwire_transport::topology::parse_cpu_list(&self.cpus).map_err(|why| invalid("cpus", format!("`{}`: {why}", self.cpus)))
    }

    /// How long serving threads poll before they sleep: `transport.idle_poll_us`, or its default.
    pub fn idle_poll(&self) -> Duration {
        match self.transport.idle_poll_us {
            Some(us) => Duration::from_micros(us),
            None if !self.cpus.trim().is_empty() => IDLE_POLL_PINNED,
            None => Duration::ZERO,
        }
    }

    fn validate_discovery(&self) -> Result<(), ConfigError> {
        let d = &self.discovery;
        for (i, e) in d.etcd.iter().enumerate() {
            let key = format!("discovery.etcd[{i}]");
            if e.starts_with("https://") {
                return Err(invalid(&key, format!("`{e}`: TLS to etcd is not built in; use http:// or host:port")));
            }
            let hostport = e.strip_prefix("http://").unwrap_or(e);
            let ok = hostport.rsplit_once(':').is_some_and(|(host, port)| {
                !host.is_empty() && !host.contains(['/', ' ']) && port.parse::<u16>().is_ok_and(|p| p > 0)
            });
            if !ok {
                return Err(invalid(&key, format!("`{e}` is not host:port or http://host:port")));
            }
        }
        if d.lease_ttl_secs < 2 {
            return Err(invalid("discovery.lease_ttl_secs", "at least 2 (etcd grants no shorter lease with its default timing)"));
        }
        if !d.prefix.starts_with('/') || d.prefix.len() < 2 || d.prefix.ends_with('/') || d.prefix.contains(char::is_whitespace) {
            return Err(invalid("discovery.prefix", format!("`{}`: starts with `/`, does not end with one, no spaces", d.prefix)));
        }
        let reachable = |key: &str, v: &str| -> Result<(), ConfigError> {
            let a = v.parse::<std::net::SocketAddr>().map_err(|e| invalid(key, format!("`{v}` is not host:port ({e})")))?;
            if a.ip().is_unspecified() || a.port() == 0 {
                return Err(invalid(key, format!("`{v}` is not an address other daemons can connect to")));
            }
            Ok(())
        };
        match &d.advertise_peer {
            Some(a) => reachable("discovery.advertise_peer", a)?,
            None if !d.etcd.is_empty() => {
                let bound: std::net::SocketAddr = self.peer_listen.parse().map_err(|e| invalid("peer_listen", format!("{e}")))?;
                if bound.ip().is_unspecified() {
                    return Err(invalid(
                        "discovery.advertise_peer",
                        format!("required when peer_listen `{}` binds every address: set the address other hosts reach this daemon's peer listener at", self.peer_listen),
                    ));
                }
            }
            None => {}
        }
        Ok(())
    }

    /// The shared secret, read from `secret_file` (trailing newline ignored).
    pub fn secret(&self) -> Result<Vec<u8>, ConfigError> {
        let Some(path) = &self.secret_file else {
            return Err(invalid("secret_file", "required: peers authenticate with a shared secret"));
        };
        check_private(path)?;
        let mut s = std::fs::read(path).map_err(|e| invalid("secret_file", format!("{}: {e}", path.display())))?;
        while s.last().is_some_and(|b| b.is_ascii_whitespace()) {
            s.pop();
        }
        if s.len() < 16 {
            return Err(invalid("secret_file", format!("{}: secret shorter than 16 bytes", path.display())));
        }
        Ok(s)
    }
}

/// Refuses a secret file that others could read or that another user
/// owns, as ssh does with private keys: whoever reads it can pose as any
/// daemon of the cluster.
fn check_private(path: &std::path::Path) -> Result<(), ConfigError> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).map_err(|e| invalid("secret_file", format!("{}: {e}", path.display())))?;
    let me = nix::unistd::geteuid().as_raw();
    if m.uid() != me {
        return Err(invalid("secret_file", format!("{} is owned by uid {}, not by this daemon's uid {me}", path.display(), m.uid())));
    }
    if m.mode() & 0o077 != 0 {
        return Err(invalid(
            "secret_file",
            format!("{} has mode {:03o}: group and others must not read it (chmod 600 {})", path.display(), m.mode() & 0o777, path.display()),
        ));
    }
    Ok(())
}

/// Whether `s` can be a node name: 1-64 characters of [A-Za-z0-9-_.].
pub(crate) fn is_node_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= 64 && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}
