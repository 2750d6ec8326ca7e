//! Host topology: which rail is closest to a region's memory.
//!
//! A production host has several NICs ("rails"). A region is sent fastest over
//! the rails closest to its memory: for GPU memory, a NIC under the same PCIe
//! switch as the GPU (GPUDirect RDMA then never crosses the root complex); for
//! host memory, a NIC on the same NUMA node. This module holds the facts
//! (devices with their NUMA node and PCI path), the order of closeness
//! ([`Locality`]), the ranking ([`rank`]), and the explicit topology file
//! ([`TopologyFile`]) that overrides discovery and is checked loudly against
//! the devices that exist.
//!
//! Pure: the daemon reads sysfs and the file's text and hands them in.
//!
//! # The locality order
//!
//! From closest to farthest, with the score [`Locality::score`] reports (lower
//! is closer; the gaps leave room for levels in between, as NVML's do) and the
//! `nvidia-smi topo -m` word for the same relation:
//!
//! | level | score | `topo -m` | meaning |
//! |---|---|---|---|
//! | [`Locality::Pinned`] | 0 | — | a topology file says this rail serves this GPU first |
//! | [`Locality::SamePcieSwitch`] | 10 | PIX / PXB | the rail and the GPU share a PCIe bridge below the root port |
//! | [`Locality::SameRootComplex`] | 20 | PHB | same root port, or root ports on the same host bridge |
//! | [`Locality::SameNuma`] | 30 | NODE | same NUMA node, different host bridges |
//! | [`Locality::Unknown`] | 40 | — | a NUMA node is not known on one side |
//! | [`Locality::OtherNuma`] | 50 | SYS | known to be on different NUMA nodes |
//!
//! `Unknown` ranks ahead of `OtherNuma`: a rail whose node is unknown may be
//! local, one known to be remote is not. Host memory compares only NUMA nodes
//! (the PCIe levels need a device on both sides).

use serde::{Deserialize, Serialize, Serializer};
use std::fmt;
use std::str::FromStr;

// ------------------------------------------------------------ PCI addresses

/// A PCI function address, `domain:bus:device.function`, e.g. `0000:18:00.0`.
///
/// Parsing accepts what the tools print: `0000:18:00.0` (sysfs, CUDA),
/// `00000000:18:00.0` (NVML, `nvidia-smi`), `18:00.0` (`lspci`, domain 0),
/// in either case. It prints in the sysfs form: lower case, a domain of at
/// least four hex digits (VMD domains such as `10000` keep all five).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PciAddr {
    /// PCI segment (domain).
    pub domain: u32,
    /// Bus number.
    pub bus: u8,
    /// Device number, 0..=31.
    pub device: u8,
    /// Function number, 0..=7.
    pub function: u8,
}

/// A string that is not a PCI address.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[error("`{0}` is not a PCI address like 0000:18:00.0")]
pub struct PciAddrError(pub String);

impl PciAddr {
    /// The host bridge (root bus) this address sits below, as `(domain, bus)`
    /// of the first element of a PCI path.
    pub fn host_bridge(self) -> (u32, u8) {
        (self.domain, self.bus)
    }

    /// Parses every element of a path, root port first.
    pub fn path<S: AsRef<str>>(addrs: &[S]) -> Result<Vec<PciAddr>, PciAddrError> {
        addrs.iter().map(|a| a.as_ref().parse()).collect()
    }
}

impl FromStr for PciAddr {
    type Err = PciAddrError;

    fn from_str(s: &str) -> Result<PciAddr, PciAddrError> {
        let bad = || PciAddrError(s.to_string());
        let hex = |t: &str, max_len: usize| -> Option<u32> {
            if t.is_empty() || t.len() > max_len || !t.bytes().all(|b| b.is_ascii_hexdigit()) {
                return None;
            }
            u32::from_str_radix(t, 16).ok()
        };
        let (rest, function) = s.rsplit_once('.').ok_or_else(bad)?;
        let mut parts = rest.rsplitn(3, ':');
        let device = parts.next().and_then(|t| hex(t, 2)).ok_or_else(bad)?;
        let bus = parts.next().and_then(|t| hex(t, 2)).ok_or_else(bad)?;
        let domain = match parts.next() {
            None => 0,
            Some(t) => hex(t, 8).ok_or_else(bad)?,
        };
        let function = hex(function, 1).ok_or_else(bad)?;
        if device > 0x1f || function > 7 {
            return Err(bad());
        }
        Ok(PciAddr { domain, bus: bus as u8, device: device as u8, function: function as u8 })
    }
}

impl fmt::Display for PciAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04x}:{:02x}:{:02x}.{:x}", self.domain, self.bus, self.device, self.function)
    }
}

impl Serialize for PciAddr {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

// ------------------------------------------------------------ devices

/// What a device is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceKind {
    /// An RDMA device (`/sys/class/infiniband/*`): mlx5_0, rxe0, …
    Rdma,
    /// A network interface (`/sys/class/net/*`), physical or virtual.
    Net,
    /// A GPU (an NVIDIA display or 3D controller on the PCI bus).
    Gpu,
}

impl DeviceKind {
    /// `rdma`, `net` or `gpu`.
    pub fn label(self) -> &'static str {
        match self {
            DeviceKind::Rdma => "rdma",
            DeviceKind::Net => "net",
            DeviceKind::Gpu => "gpu",
        }
    }
}

/// One device of a host and where it sits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Device {
    /// `mlx5_0`, `eth0`; a GPU is named by its PCI address (`0000:18:00.0`).
    pub name: String,
    /// RDMA device, netdev or GPU.
    pub kind: DeviceKind,
    /// NUMA node, when the platform says (sysfs `numa_node` of -1 is `None`).
    pub numa: Option<u32>,
    /// Whether `numa` comes from a topology file rather than discovery.
    pub numa_from_file: bool,
    /// PCI addresses from the root port (or root-bus device) down to the
    /// device's own function; empty for a virtual device.
    pub pci_path: Vec<PciAddr>,
    /// For an RDMA device: the netdevs it runs over (RoCE, IPoIB, soft-RoCE's
    /// parent). Empty otherwise.
    pub netdevs: Vec<String>,
    /// For a netdev: its `operstate` (`up`, `down`, `unknown`, …) when known.
    pub state: Option<String>,
}

impl Device {
    /// A device with nothing known about where it sits.
    pub fn new(name: impl Into<String>, kind: DeviceKind) -> Device {
        Device { name: name.into(), kind, numa: None, numa_from_file: false, pci_path: Vec::new(), netdevs: Vec::new(), state: None }
    }

    /// With a NUMA node.
    pub fn with_numa(mut self, numa: Option<u32>) -> Device {
        self.numa = numa;
        self
    }

    /// With a PCI path, root port first.
    pub fn with_pci_path(mut self, path: Vec<PciAddr>) -> Device {
        self.pci_path = path;
        self
    }

    /// The device's own PCI address: the last element of its path.
    pub fn pci_addr(&self) -> Option<PciAddr> {
        self.pci_path.last().copied()
    }

    /// Whether this device can carry a rail (an RDMA device or a netdev).
    pub fn can_be_rail(&self) -> bool {
        matches!(self.kind, DeviceKind::Rdma | DeviceKind::Net)
    }
}

/// A rail a topology file declares.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Rail {
    /// The rail's name (the device's name unless the file gives one).
    pub name: String,
    /// The RDMA device or netdev it sends over.
    pub device: String,
    /// GPUs this rail serves first: for their memory it ranks [`Locality::Pinned`].
    pub gpus: Vec<PciAddr>,
}

/// Where a region's memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MemPlace {
    /// Host memory on this NUMA node (`None`: unknown).
    Host {
        /// The node, from `move_pages(2)` or the allocation policy.
        numa: Option<u32>,
    },
    /// Device memory of the GPU at this PCI address.
    Gpu {
        /// The GPU's PCI address (CUDA's `cudaDeviceGetPCIBusId`).
        pci: PciAddr,
    },
}

/// How close a rail is to a region's memory; declaration order is closeness
/// (`Ord`: closer is smaller). See the [module docs](self) for the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Locality {
    /// A topology file pins this rail to this GPU.
    Pinned,
    /// The rail's device and the GPU share a PCIe bridge below the root port
    /// (a PCIe switch): `nvidia-smi` PIX/PXB.
    SamePcieSwitch,
    /// Same root port, or root ports of the same host bridge: PHB.
    SameRootComplex,
    /// Same NUMA node, different host bridges (or host memory on the rail's node): NODE.
    SameNuma,
    /// A NUMA node is unknown on at least one side (or the rail or GPU is not
    /// on this host).
    Unknown,
    /// Known to be on different NUMA nodes: SYS.
    OtherNuma,
}

impl Locality {
    /// Every level, closest first.
    pub const ALL: [Locality; 6] = [
        Locality::Pinned,
        Locality::SamePcieSwitch,
        Locality::SameRootComplex,
        Locality::SameNuma,
        Locality::Unknown,
        Locality::OtherNuma,
    ];

    /// Distance score, lower is closer: 0, 10, 20, 30, 40, 50 in the order of
    /// [`Locality::ALL`]. Stable: configs and dashboards may compare it.
    pub fn score(self) -> u32 {
        match self {
            Locality::Pinned => 0,
            Locality::SamePcieSwitch => 10,
            Locality::SameRootComplex => 20,
            Locality::SameNuma => 30,
            Locality::Unknown => 40,
            Locality::OtherNuma => 50,
        }
    }

    /// The snake_case name used in CLI output and JSON.
    pub fn label(self) -> &'static str {
        match self {
            Locality::Pinned => "pinned",
            Locality::SamePcieSwitch => "same_pcie_switch",
            Locality::SameRootComplex => "same_root_complex",
            Locality::SameNuma => "same_numa",
            Locality::Unknown => "unknown",
            Locality::OtherNuma => "other_numa",
        }
    }
}

impl fmt::Display for Locality {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// A host's devices and, when a topology file was applied, its rails.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct HostTopology {
    /// Every device found: RDMA devices, then netdevs, then GPUs.
    pub devices: Vec<Device>,
    /// Rails a topology file declares, in file order; empty without one.
    pub rails: Vec<Rail>,
}

impl HostTopology {
    /// Devices of one kind, in order.
    pub fn of_kind(&self, kind: DeviceKind) -> impl Iterator<Item = &Device> {
        self.devices.iter().filter(move |d| d.kind == kind)
    }

    /// The device of this kind and name.
    pub fn find(&self, kind: DeviceKind, name: &str) -> Option<&Device> {
        self.of_kind(kind).find(|d| d.name == name)
    }

    /// The GPU at this PCI address.
    pub fn gpu(&self, pci: PciAddr) -> Option<&Device> {
        self.of_kind(DeviceKind::Gpu).find(|d| d.pci_addr() == Some(pci))
    }

    /// The rail a topology file declares under this name.
    pub fn rail(&self, name: &str) -> Option<&Rail> {
        self.rails.iter().find(|r| r.name == name)
    }

    /// The device behind a rail name: a rail the topology file declares, else
    /// an RDMA device of that name, else a netdev of that name.
    pub fn rail_device(&self, name: &str) -> Option<&Device> {
        let device = self.rail(name).map_or(name, |r| r.device.as_str());
        self.find(DeviceKind::Rdma, device).or_else(|| self.find(DeviceKind::Net, device))
    }

    /// The NUMA nodes any device is on, ascending.
    pub fn numa_nodes(&self) -> Vec<u32> {
        let mut nodes: Vec<u32> = self.devices.iter().filter_map(|d| d.numa).collect();
        nodes.sort_unstable();
        nodes.dedup();
        nodes
    }

    /// The rails to rank when none are named: the file's rails; else every
    /// RDMA device; else every netdev with a PCI path (a physical NIC).
    pub fn default_rails(&self) -> Vec<String> {
        if !self.rails.is_empty() {
            return self.rails.iter().map(|r| r.name.clone()).collect();
        }
        let rdma: Vec<String> = self.of_kind(DeviceKind::Rdma).map(|d| d.name.clone()).collect();
        if !rdma.is_empty() {
            return rdma;
        }
        self.of_kind(DeviceKind::Net).filter(|d| !d.pci_path.is_empty()).map(|d| d.name.clone()).collect()
    }

    /// Whether a topology file pins the rail device `device` to the GPU `gpu`.
    fn pinned(&self, device: &str, gpu: PciAddr) -> bool {
        self.rails.iter().any(|r| r.device == device && r.gpus.contains(&gpu))
    }

    /// How close the rail `rail` (see [`HostTopology::rail_device`]) is to `mem`.
    pub fn locality(&self, mem: &MemPlace, rail: &str) -> Locality {
        let Some(dev) = self.rail_device(rail) else { return Locality::Unknown };
        match *mem {
            MemPlace::Host { numa } => numa_level(numa, dev.numa),
            MemPlace::Gpu { pci } => {
                if self.pinned(&dev.name, pci) {
                    return Locality::Pinned;
                }
                let Some(gpu) = self.gpu(pci) else { return Locality::Unknown };
                pcie_level(&gpu.pci_path, &dev.pci_path).unwrap_or_else(|| numa_level(gpu.numa, dev.numa))
            }
        }
    }
}

/// Same, other or unknown NUMA node.
fn numa_level(a: Option<u32>, b: Option<u32>) -> Locality {
    match (a, b) {
        (Some(a), Some(b)) if a == b => Locality::SameNuma,
        (Some(_), Some(_)) => Locality::OtherNuma,
        _ => Locality::Unknown,
    }
}

/// The PCIe relation of two devices by their paths, when they share more than
/// a NUMA node: a bridge below the root port, a root port, or a host bridge.
fn pcie_level(a: &[PciAddr], b: &[PciAddr]) -> Option<Locality> {
    let (Some((_, a_up)), Some((_, b_up))) = (a.split_last(), b.split_last()) else { return None };
    let shared = a_up.iter().zip(b_up).take_while(|(x, y)| x == y).count();
    if shared >= 2 {
        Some(Locality::SamePcieSwitch)
    } else if shared == 1 || a[0].host_bridge() == b[0].host_bridge() {
        Some(Locality::SameRootComplex)
    } else {
        None
    }
}

/// The rails, best first for memory at `mem`: `(index into rails, locality)`.
///
/// Sorted by [`Locality`]; ties keep the order of `rails` (a stable sort), so
/// the caller's order is the tie-break. A name that is neither a rail of the
/// topology file nor an RDMA device or netdev ranks [`Locality::Unknown`]:
/// check names with [`HostTopology::rail_device`] when reading a config.
pub fn rank<S: AsRef<str>>(topology: &HostTopology, mem: &MemPlace, rails: &[S]) -> Vec<(usize, Locality)> {
    let mut ranked: Vec<(usize, Locality)> =
        rails.iter().enumerate().map(|(i, r)| (i, topology.locality(mem, r.as_ref()))).collect();
    ranked.sort_by_key(|&(_, l)| l);
    ranked
}

// ------------------------------------------------------------ topology file

/// An explicit topology file (TOML). It overrides discovery for what it
/// states and leaves the rest to discovery; every device it names must exist,
/// or [`TopologyFile::apply`] fails naming the key, the device, and the
/// devices that do exist. Unknown keys are errors, so a typo is never ignored.
///
/// ```toml
/// # One [[rail]] per rail, in the order the host should use them.
/// [[rail]]
/// name = "rail0"            # optional; the rail's name (default: `device`).
///                           # Must not be the name of another RDMA device or netdev.
/// device = "mlx5_0"         # required; an RDMA device (/sys/class/infiniband) or a
///                           # netdev (/sys/class/net) that exists on this host.
/// numa = 0                  # optional; the device's NUMA node, overriding sysfs
///                           # (for platforms that report -1).
/// gpus = ["0000:18:00.0"]   # optional; GPUs (PCI addresses, any common spelling)
///                           # this rail serves first: it ranks `pinned` for their
///                           # memory, ahead of any discovered PCIe locality.
///
/// # One [[gpu]] per GPU whose facts need overriding.
/// [[gpu]]
/// pci = "0000:18:00.0"      # required; a GPU that exists on this host.
/// numa = 0                  # optional; the GPU's NUMA node, overriding sysfs.
/// ```
///
/// Checked without the host ([`TopologyFile::parse`]): rail names and devices
/// are unique and non-empty, PCI addresses well formed, a GPU listed once per
/// rail and once in `[[gpu]]`. Checked against the host
/// ([`TopologyFile::apply`]): every `device` and every GPU exists; a rail
/// name is not another device's name.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct TopologyFile {
    /// `[[rail]]` entries, in file order.
    pub rails: Vec<RailEntry>,
    /// `[[gpu]]` entries, in file order.
    pub gpus: Vec<GpuEntry>,
}

/// One `[[rail]]` of a topology file (see [`TopologyFile`] for each key).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RailEntry {
    /// `name`, defaulted to `device`.
    pub name: String,
    /// `device`.
    pub device: String,
    /// `numa`.
    pub numa: Option<u32>,
    /// `gpus`, parsed.
    pub gpus: Vec<PciAddr>,
}

/// One `[[gpu]]` of a topology file (see [`TopologyFile`] for each key).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuEntry {
    /// `pci`, parsed.
    pub pci: PciAddr,
    /// `numa`.
    pub numa: Option<u32>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    #[serde(default)]
    rail: Vec<RawRail>,
    #[serde(default)]
    gpu: Vec<RawGpu>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRail {
    name: Option<String>,
    device: String,
    numa: Option<u32>,
    #[serde(default)]
    gpus: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGpu {
    pci: String,
    numa: Option<u32>,
}

/// Why a topology file was refused.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum TopologyFileError {
    /// Not TOML, an unknown key, or a value of the wrong type.
    #[error("line {line}: {reason}")]
    Syntax {
        /// 1-based line of the error.
        line: usize,
        /// What the TOML reader said.
        reason: String,
    },
    /// A value that cannot be right whatever the host (empty, duplicate, malformed).
    #[error("{key}: {reason}")]
    Invalid {
        /// The key, e.g. `rail[1].name`.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A rail's `device` names no RDMA device or netdev of this host.
    #[error(
        "{key}: no RDMA device or netdev `{device}` on this host (RDMA devices: {}; netdevs: {})",
        list(rdma),
        list(netdevs)
    )]
    NoSuchDevice {
        /// The key, e.g. `rail[2].device`.
        key: String,
        /// The name the file gives.
        device: String,
        /// The RDMA devices that exist.
        rdma: Vec<String>,
        /// The netdevs that exist.
        netdevs: Vec<String>,
    },
    /// A GPU address names no GPU of this host.
    #[error("{key}: no GPU {gpu} on this host (GPUs: {})", list(gpus))]
    NoSuchGpu {
        /// The key, e.g. `rail[0].gpus[1]` or `gpu[3].pci`.
        key: String,
        /// The address the file gives.
        gpu: PciAddr,
        /// The GPUs that exist, by address.
        gpus: Vec<String>,
    },
}

fn list(names: &[String]) -> String {
    if names.is_empty() {
        "none".to_string()
    } else {
        names.join(", ")
    }
}

impl TopologyFile {
    /// Reads a topology file's text and checks what can be checked without
    /// the host. Errors name the line, or the key (`rail[1].gpus[0]`).
    pub fn parse(text: &str) -> Result<TopologyFile, TopologyFileError> {
        let raw: RawFile = toml::from_str(text).map_err(|e| TopologyFileError::Syntax {
            line: e.span().map_or(1, |s| text[..s.start.min(text.len())].matches('\n').count() + 1),
            reason: e.message().split_whitespace().collect::<Vec<_>>().join(" "),
        })?;
        let invalid = |key: String, reason: String| TopologyFileError::Invalid { key, reason };
        let mut rails: Vec<RailEntry> = Vec::new();
        for (i, r) in raw.rail.into_iter().enumerate() {
            if r.device.trim().is_empty() {
                return Err(invalid(format!("rail[{i}].device"), "is empty".into()));
            }
            let name = r.name.unwrap_or_else(|| r.device.clone());
            if name.trim().is_empty() {
                return Err(invalid(format!("rail[{i}].name"), "is empty".into()));
            }
            if let Some(j) = rails.iter().position(|p| p.device == r.device) {
                return Err(invalid(format!("rail[{i}].device"), format!("`{}` is also the device of rail[{j}]", r.device)));
            }
            if let Some(j) = rails.iter().position(|p| p.name == name) {
                return Err(invalid(format!("rail[{i}].name"), format!("`{name}` is also the name of rail[{j}]")));
            }
            let mut gpus = Vec::new();
            for (k, g) in r.gpus.iter().enumerate() {
                let key = format!("rail[{i}].gpus[{k}]");
                let pci: PciAddr = g.parse().map_err(|e: PciAddrError| invalid(key.clone(), e.to_string()))?;
                if gpus.contains(&pci) {
                    return Err(invalid(key, format!("GPU {pci} is listed twice")));
                }
                gpus.push(pci);
            }
            rails.push(RailEntry { name, device: r.device, numa: r.numa, gpus });
        }
        let mut gpus: Vec<GpuEntry> = Vec::new();
        for (i, g) in raw.gpu.into_iter().enumerate() {
            let key = format!("gpu[{i}].pci");
            let pci: PciAddr = g.pci.parse().map_err(|e: PciAddrError| invalid(key.clone(), e.to_string()))?;
            if let Some(j) = gpus.iter().position(|p| p.pci == pci) {
                return Err(invalid(key, format!("GPU {pci} is also gpu[{j}]")));
            }
            gpus.push(GpuEntry { pci, numa: g.numa });
        }
        Ok(TopologyFile { rails, gpus })
    }

    /// Applies the file to a discovered topology: its NUMA overrides replace
    /// sysfs's, its rails (with their GPU pins) become the topology's rails.
    /// Fails, naming the key, the missing device and the devices that exist,
    /// when the file names a device or GPU this host does not have.
    pub fn apply(&self, discovered: &HostTopology) -> Result<HostTopology, TopologyFileError> {
        let names = |kind| discovered.of_kind(kind).map(|d| d.name.clone()).collect::<Vec<_>>();
        let no_gpu = |key: String, gpu: PciAddr| TopologyFileError::NoSuchGpu {
            key,
            gpu,
            gpus: discovered.of_kind(DeviceKind::Gpu).filter_map(Device::pci_addr).map(|a| a.to_string()).collect(),
        };
        let mut out = discovered.clone();
        out.rails.clear();
        for (i, r) in self.rails.iter().enumerate() {
            let find = |kind| out.devices.iter().position(|d| d.kind == kind && d.name == r.device);
            let at = find(DeviceKind::Rdma).or_else(|| find(DeviceKind::Net)).ok_or_else(|| TopologyFileError::NoSuchDevice {
                key: format!("rail[{i}].device"),
                device: r.device.clone(),
                rdma: names(DeviceKind::Rdma),
                netdevs: names(DeviceKind::Net),
            })?;
            if r.name != r.device {
                if let Some(other) = discovered.devices.iter().find(|d| d.can_be_rail() && d.name == r.name) {
                    return Err(TopologyFileError::Invalid {
                        key: format!("rail[{i}].name"),
                        reason: format!(
                            "`{}` is the name of {} device `{}` but this rail sends over `{}`; pick a name that is no device's",
                            r.name,
                            other.kind.label(),
                            other.name,
                            r.device
                        ),
                    });
                }
            }
            for (k, &gpu) in r.gpus.iter().enumerate() {
                if discovered.gpu(gpu).is_none() {
                    return Err(no_gpu(format!("rail[{i}].gpus[{k}]"), gpu));
                }
            }
            if let Some(n) = r.numa {
                out.devices[at].numa = Some(n);
                out.devices[at].numa_from_file = true;
            }
            out.rails.push(Rail { name: r.name.clone(), device: r.device.clone(), gpus: r.gpus.clone() });
        }
        for (i, g) in self.gpus.iter().enumerate() {
            let at = out
                .devices
                .iter()
                .position(|d| d.kind == DeviceKind::Gpu && d.pci_addr() == Some(g.pci))
                .ok_or_else(|| no_gpu(format!("gpu[{i}].pci"), g.pci))?;
            if let Some(n) = g.numa {
                out.devices[at].numa = Some(n);
                out.devices[at].numa_from_file = true;
            }
        }
        Ok(out)
    }
}
