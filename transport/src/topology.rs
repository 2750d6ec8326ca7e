//! The host's topology, read from sysfs; host memory's NUMA node; the
//! topology file applied loudly. The daemon ranks its rails from this, and
//! `kvwire topology` prints it.
//!
//! What is read, under a root that is `/` on a real host and a fixture
//! directory in tests (every symlink is resolved *within* the root, so a
//! fixture never reaches into the host's own `/sys`):
//!
//! - RDMA devices: `sys/class/infiniband/*`. A device with a `device` link
//!   (a PCI function: mlx5, irdma, …) takes its PCI path from the link's
//!   resolved path, its NUMA node from `numa_node` (walking up to the nearest
//!   ancestor that has one; `-1` is unknown) and its netdevs from the
//!   function's `net/`. A software device without one (rxe, siw) names its
//!   netdev in `parent`, or else in `ports/*/gid_attrs/ndevs/0`, and takes
//!   that netdev's place.
//! - Netdevs: `sys/class/net/*` (entries that are directories: not
//!   `bonding_masters`), placed by `device` the same way; a virtual netdev
//!   (`lo`, bridges, veths) has no `device` and no PCI path. `operstate` is
//!   kept for reports.
//! - GPUs: `sys/bus/pci/devices/*` whose `vendor` is 0x10de (NVIDIA) and
//!   whose `class` is a VGA (0x0300xx) or 3D (0x0302xx) controller.

use kvwire_core::topology::{
    Device, DeviceKind, HostTopology, PciAddr, PciAddrError, TopologyFile, TopologyFileError,
};
use std::ffi::OsString;
use std::io;
use std::path::{Component, Path, PathBuf};

/// Why the topology could not be read.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum TopologyError {
    /// The root has no `sys` directory: not a sysfs tree.
    #[error("no sysfs under {}: {} is not a directory", root.display(), root.join("sys").display())]
    NoSysfs {
        /// The root given.
        root: PathBuf,
    },
    /// Reading a sysfs file, directory or link failed.
    #[error("{op} {}: {message}", path.display())]
    Io {
        /// What was being done (`read`, `list`, `resolve`).
        op: &'static str,
        /// The path, under the root.
        path: PathBuf,
        /// Kind of the OS error.
        kind: io::ErrorKind,
        /// OS message.
        message: String,
    },
    /// A sysfs file holds something sysfs never writes there.
    #[error("{}: {reason}", path.display())]
    Malformed {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The topology file could not be read.
    #[error("cannot read topology file {}: {message}", path.display())]
    ReadFile {
        /// The file.
        path: PathBuf,
        /// Kind of the OS error.
        kind: io::ErrorKind,
        /// OS message.
        message: String,
    },
    /// The topology file is malformed or names a device this host does not have.
    #[error("topology file {}: {error}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// What is wrong, with the key and (for a missing device) what exists.
        error: TopologyFileError,
    },
}

/// Most symlinks followed while resolving one path (Linux's own limit).
const MAX_LINKS: usize = 40;

/// A sysfs tree under `root`.
struct Sysfs<'a> {
    root: &'a Path,
}

fn io_err(op: &'static str, path: &Path) -> impl Fn(io::Error) -> TopologyError {
    let path = path.to_path_buf();
    move |e| TopologyError::Io { op, path: path.clone(), kind: e.kind(), message: e.to_string() }
}

impl Sysfs<'_> {
    /// `rel` with every symlink resolved, relative to the root, never
    /// leaving it: an absolute target restarts at the root, `..` stops there.
    fn resolve(&self, rel: &Path) -> io::Result<PathBuf> {
        let mut todo: Vec<OsString> = rel.components().rev().filter_map(normal).collect();
        let mut done: Vec<OsString> = Vec::new();
        let mut links = 0;
        while let Some(c) = todo.pop() {
            if c == ".." {
                done.pop();
                continue;
            }
            let here: PathBuf = self.root.join(done.iter().collect::<PathBuf>()).join(&c);
            if !std::fs::symlink_metadata(&here)?.file_type().is_symlink() {
                done.push(c);
                continue;
            }
            links += 1;
            if links > MAX_LINKS {
                return Err(io::Error::other("too many levels of symbolic links"));
            }
            let target = std::fs::read_link(&here)?;
            if target.is_absolute() {
                done.clear();
            }
            todo.extend(target.components().rev().filter_map(normal));
        }
        Ok(done.iter().collect())
    }

    /// The resolved `rel`, or `None` when some component does not exist.
    fn resolve_opt(&self, rel: &Path) -> Result<Option<PathBuf>, TopologyError> {
        match self.resolve(rel) {
            Ok(p) => Ok(Some(p)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_err("resolve", &self.root.join(rel))(e)),
        }
    }

    /// Names in the directory `rel`, naturally sorted (`mlx5_2` before
    /// `mlx5_10`); empty when it does not exist.
    fn list(&self, rel: &Path) -> Result<Vec<String>, TopologyError> {
        let Some(dir) = self.resolve_opt(rel)? else { return Ok(Vec::new()) };
        let path = self.root.join(dir);
        let entries = match std::fs::read_dir(&path) {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io_err("list", &path)(e)),
        };
        let mut names = Vec::new();
        for e in entries {
            names.push(e.map_err(io_err("list", &path))?.file_name().to_string_lossy().into_owned());
        }
        names.sort_by(|a, b| natural_key(a).cmp(&natural_key(b)));
        Ok(names)
    }

    /// The trimmed text of the file `rel`; `None` when it does not exist.
    fn read_opt(&self, rel: &Path) -> Result<Option<String>, TopologyError> {
        let Some(file) = self.resolve_opt(rel)? else { return Ok(None) };
        let path = self.root.join(file);
        match std::fs::read_to_string(&path) {
            Ok(s) => Ok(Some(s.trim().to_string())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_err("read", &path)(e)),
        }
    }

    /// Like `read_opt`, but sysfs always has this file.
    fn read(&self, rel: &Path) -> Result<String, TopologyError> {
        self.read_opt(rel)?.ok_or_else(|| TopologyError::Malformed { path: self.root.join(rel), reason: "missing".into() })
    }

    /// A `0x…` hex file (`class`, `vendor`).
    fn read_hex(&self, rel: &Path) -> Result<u32, TopologyError> {
        let text = self.read(rel)?;
        let digits = text.strip_prefix("0x").unwrap_or(&text);
        u32::from_str_radix(digits, 16)
            .map_err(|_| TopologyError::Malformed { path: self.root.join(rel), reason: format!("`{text}` is not a hex number") })
    }

    /// Whether `rel` is, after resolving, a directory.
    fn is_dir(&self, rel: &Path) -> Result<bool, TopologyError> {
        let Some(p) = self.resolve_opt(rel)? else { return Ok(false) };
        Ok(self.root.join(p).is_dir())
    }

    /// The NUMA node of the resolved device directory `dev`: its own
    /// `numa_node`, else the nearest ancestor's (a virtio netdev's parent is
    /// the PCI function). `-1`, or no file up to `sys/devices`, is unknown.
    fn numa_of(&self, dev: &Path) -> Result<Option<u32>, TopologyError> {
        for dir in dev.ancestors().take_while(|d| d.components().count() > 2) {
            let rel = dir.join("numa_node");
            let Some(text) = self.read_opt(&rel)? else { continue };
            let n: i64 = text.parse().map_err(|_| TopologyError::Malformed {
                path: self.root.join(&rel),
                reason: format!("`{text}` is not a NUMA node number"),
            })?;
            return Ok(u32::try_from(n).ok());
        }
        Ok(None)
    }

    /// Place a device found at the resolved directory `dev`.
    fn place(&self, d: &mut Device, dev: &Path) -> Result<(), TopologyError> {
        d.pci_path = pci_path(dev);
        d.numa = self.numa_of(dev)?;
        Ok(())
    }
}

fn normal(c: Component<'_>) -> Option<OsString> {
    match c {
        Component::Normal(s) => Some(s.to_os_string()),
        Component::ParentDir => Some("..".into()),
        Component::RootDir | Component::Prefix(_) | Component::CurDir => None,
    }
}

/// The PCI addresses among a resolved device path's components, root port
/// first: `sys/devices/pci0000:15/0000:15:01.0/…/0000:19:00.0/infiniband/mlx5_0`.
/// Only names in sysfs's own spelling count (`0000:15:01.0`, lower case).
fn pci_path(dev: &Path) -> Vec<PciAddr> {
    dev.components()
        .filter_map(|c| c.as_os_str().to_str())
        .filter_map(|s| s.parse::<PciAddr>().ok().filter(|a| a.to_string() == s))
        .collect()
}

/// Sort key that orders digit runs by value: `mlx5_2` < `mlx5_10`.
fn natural_key(s: &str) -> Vec<(bool, u64, &str)> {
    let mut key = Vec::new();
    let mut rest = s;
    while let Some(c) = rest.chars().next() {
        let digits = c.is_ascii_digit();
        let end = rest.find(|ch: char| ch.is_ascii_digit() != digits).unwrap_or(rest.len());
        let (run, tail) = rest.split_at(end);
        key.push(if digits { (true, run.parse().unwrap_or(u64::MAX), run) } else { (false, 0, run) });
        rest = tail;
    }
    key
}

/// NVIDIA's PCI vendor id.
const NVIDIA: u32 = 0x10de;

/// Reads the topology of the sysfs tree under `root` (`/` on a real host):
/// RDMA devices, then netdevs, each sorted by name (`mlx5_2` before
/// `mlx5_10`), then GPUs by PCI address. A class directory that does not
/// exist (no `infiniband` without RDMA) is no device; anything else
/// unreadable or malformed is an error naming the path.
pub fn read_sysfs(root: &Path) -> Result<HostTopology, TopologyError> {
    if !root.join("sys").is_dir() {
        return Err(TopologyError::NoSysfs { root: root.to_path_buf() });
    }
    let fs = Sysfs { root };

    let mut netdevs = Vec::new();
    let class_net = Path::new("sys/class/net");
    for name in fs.list(class_net)? {
        let entry = class_net.join(&name);
        if !fs.is_dir(&entry)? {
            continue; // bonding_masters
        }
        let read = || -> Result<Device, TopologyError> {
            let mut d = Device::new(&name, DeviceKind::Net);
            d.state = fs.read_opt(&entry.join("operstate"))?;
            // No `device`: a virtual netdev (lo, bridge, veth), with no PCI path.
            if let Some(dev) = fs.resolve_opt(&entry.join("device"))? {
                fs.place(&mut d, &dev)?;
            }
            Ok(d)
        };
        match read() {
            Ok(d) => netdevs.push(d),
            // Removed while we read it (a veth of a namespace going away): it is no device.
            Err(_) if !fs.is_dir(&entry)? => {}
            Err(e) => return Err(e),
        }
    }

    let mut rdma = Vec::new();
    let class_ib = Path::new("sys/class/infiniband");
    for name in fs.list(class_ib)? {
        let entry = class_ib.join(&name);
        let mut d = Device::new(&name, DeviceKind::Rdma);
        match fs.resolve_opt(&entry.join("device"))? {
            Some(dev) => {
                fs.place(&mut d, &dev)?;
                d.netdevs = fs.list(&dev.join("net"))?;
            }
            None => {
                // Software RDMA (rxe, siw): it runs over a netdev and sits where that netdev sits.
                d.netdevs = match fs.read_opt(&entry.join("parent"))? {
                    Some(parent) if !parent.is_empty() => vec![parent],
                    _ => software_netdevs(&fs, &entry)?,
                };
                if let Some(nd) = d.netdevs.iter().find_map(|n| netdevs.iter().find(|x: &&Device| &x.name == n)) {
                    d.pci_path = nd.pci_path.clone();
                    d.numa = nd.numa;
                }
            }
        }
        rdma.push(d);
    }

    let mut gpus = Vec::new();
    let bus_pci = Path::new("sys/bus/pci/devices");
    for addr in fs.list(bus_pci)? {
        let entry = bus_pci.join(&addr);
        let vendor = fs.read_hex(&entry.join("vendor"))?;
        let class = fs.read_hex(&entry.join("class"))?;
        if vendor != NVIDIA || !matches!(class >> 8, 0x0300 | 0x0302) {
            continue;
        }
        let own: PciAddr = addr.parse().map_err(|e: PciAddrError| TopologyError::Malformed {
            path: root.join(&entry),
            reason: e.to_string(),
        })?;
        let mut d = Device::new(own.to_string(), DeviceKind::Gpu);
        if let Some(dev) = fs.resolve_opt(&entry)? {
            fs.place(&mut d, &dev)?;
        }
        if d.pci_addr() != Some(own) {
            d.pci_path = vec![own];
        }
        gpus.push(d);
    }

    gpus.sort_by_key(|g: &Device| g.pci_addr());
    tracing::debug!(root = %root.display(), rdma = rdma.len(), netdevs = netdevs.len(), gpus = gpus.len(), "read sysfs topology");
    let mut devices = rdma;
    devices.append(&mut netdevs);
    devices.append(&mut gpus);
    Ok(HostTopology { devices, rails: Vec::new() })
}

/// The netdevs of a software RDMA device without `parent`: the default GID's
/// netdev of each port. A port that is not RoCE answers EINVAL there: no netdev.
fn software_netdevs(fs: &Sysfs<'_>, entry: &Path) -> Result<Vec<String>, TopologyError> {
    let mut out: Vec<String> = Vec::new();
    for port in fs.list(&entry.join("ports"))? {
        let rel = entry.join("ports").join(port).join("gid_attrs/ndevs/0");
        let text = match fs.read_opt(&rel) {
            Ok(t) => t,
            Err(TopologyError::Io { kind: io::ErrorKind::InvalidInput, .. }) => None,
            Err(e) => return Err(e),
        };
        if let Some(n) = text.filter(|n| !n.is_empty() && !out.contains(n)) {
            out.push(n);
        }
    }
    Ok(out)
}

/// Reads the topology file at `path` and applies it to `discovered`. A file
/// that does not parse, or that names a device or GPU this host lacks, is an
/// error naming the file, the key and the device, and listing what exists.
pub fn load_topology_file(path: &Path, discovered: &HostTopology) -> Result<HostTopology, TopologyError> {
    let text = std::fs::read_to_string(path).map_err(|e| TopologyError::ReadFile {
        path: path.to_path_buf(),
        kind: e.kind(),
        message: e.to_string(),
    })?;
    let file = |error| TopologyError::File { path: path.to_path_buf(), error };
    let host = TopologyFile::parse(&text).map_err(file)?.apply(discovered).map_err(file)?;
    tracing::info!(file = %path.display(), rails = host.rails.len(), "topology file applied");
    Ok(host)
}

/// The host's topology: sysfs under `sysfs_root`, then the topology file if any.
pub fn discover(sysfs_root: &Path, file: Option<&Path>) -> Result<HostTopology, TopologyError> {
    let host = read_sysfs(sysfs_root)?;
    match file {
        Some(f) => load_topology_file(f, &host),
        None => Ok(host),
    }
}

/// The NUMA node of the host memory page holding `ptr`, from `move_pages(2)`
/// in query mode; `None` when the kernel cannot say (no NUMA support, the
/// call refused, as by a container's seccomp policy, or the page not present
/// or not mapped). Touch the memory first: an untouched page is on no node.
pub fn numa_node_of(ptr: *const u8) -> Option<u32> {
    use nix::libc;
    let mut pages = [ptr.cast_mut().cast::<libc::c_void>()];
    let mut status: [libc::c_int; 1] = [libc::c_int::MIN];
    // SAFETY: move_pages(pid 0 = this process, count 1, pages, nodes NULL,
    // status, flags 0). With `nodes` NULL it moves nothing: it only reports,
    // in `status[0]`, the node of the page holding the address, or a negative
    // errno (-EFAULT for an unmapped address, -ENOENT for a page not present).
    // The kernel never dereferences the queried address itself in our address
    // space; it looks it up in the page tables, so any value, null included,
    // is sound. It reads `count` (1) pointers from `pages` and writes `count`
    // ints to `status`: both are live one-element arrays on this stack. Every
    // argument is passed as a full machine word (variadic syscall(2)).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_pages,
            0 as libc::c_long,
            1 as libc::c_ulong,
            pages.as_mut_ptr(),
            std::ptr::null::<libc::c_int>(),
            status.as_mut_ptr(),
            0 as libc::c_long,
        )
    };
    if rc != 0 {
        return None;
    }
    u32::try_from(status[0]).ok()
}

/// Most CPUs a list may name (glibc's `cpu_set_t`).
pub const MAX_CPUS: usize = 1024;

/// A Linux CPU list (`0-3,8`, as `cpus` in kvwired's config, sysfs's
/// `online` and /proc's `Cpus_allowed_list` write them): numbers and
/// ascending ranges, comma separated; empty gives none. Ascending, each once.
pub fn parse_cpu_list(s: &str) -> Result<Vec<usize>, String> {
    let mut cpus = std::collections::BTreeSet::new();
    if s.trim().is_empty() {
        return Ok(Vec::new());
    }
    for part in s.split(',') {
        let part = part.trim();
        let num = |x: &str| x.trim().parse::<usize>().ok().filter(|&n| n < MAX_CPUS).ok_or_else(|| format!("`{x}` is not a CPU number below {MAX_CPUS}"));
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (num(a)?, num(b)?),
            None => (num(part)?, num(part)?),
        };
        if a > b {
            return Err(format!("range `{part}` runs backwards"));
        }
        cpus.extend(a..=b);
    }
    Ok(cpus.into_iter().collect())
}

/// Runs this thread, and the threads it starts from now on, on `cpus`.
pub fn run_on_cpus(cpus: &[usize]) -> Result<(), String> {
    use nix::sched::{sched_setaffinity, CpuSet};
    let mut set = CpuSet::new();
    for &c in cpus {
        set.set(c).map_err(|e| format!("CPU {c}: {e}"))?;
    }
    sched_setaffinity(nix::unistd::Pid::from_raw(0), &set).map_err(|e| format!("cannot run on CPUs {cpus:?}: {e} (none of them online, or outside this process's cpuset)"))
}
