//! Topology from sysfs: the fixtures of a DGX-H100-like host and a soft-RoCE
//! VM (daemon/cli/tests/fixtures/sysfs, see its README), this machine's own `/`,
//! the topology file's override and its loud refusal, and `move_pages(2)`.

use kvwire_core::topology::{rank, DeviceKind, HostTopology, Locality, MemPlace, PciAddr, TopologyFileError};
use kvwire_testkit::TempDir;
use kvwire_transport::topology::{load_topology_file, numa_node_of, read_sysfs, TopologyError};
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sysfs").join(name)
}

fn dgx() -> HostTopology {
    read_sysfs(&fixture("dgx-h100")).unwrap()
}

/// The fixture's GPUs in pair order (README table): GPU i shares a switch with mlx5_i.
const GPUS: [&str; 8] =
    ["0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0", "0000:9a:00.0", "0000:ab:00.0", "0000:ba:00.0", "0000:db:00.0"];

fn mlx(i: usize) -> String {
    format!("mlx5_{i}")
}

fn gpu(s: &str) -> MemPlace {
    MemPlace::Gpu { pci: s.parse().unwrap() }
}

/// A symlink at `rel` inside `dir` pointing at `target` (a fake sysfs
/// link), its parent directories created.
fn link(dir: &TempDir, rel: &str, target: &str) {
    let p = dir.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::os::unix::fs::symlink(target, p).unwrap();
}

#[test]
fn dgx_devices_with_numa_and_pci_paths() {
    let h = dgx();
    let names = |k| h.of_kind(k).map(|d| d.name.clone()).collect::<Vec<_>>();
    assert_eq!(names(DeviceKind::Rdma), (0..8).map(mlx).collect::<Vec<_>>());
    assert_eq!(
        names(DeviceKind::Net),
        ["eth0", "ibp25s0", "ibp43s0", "ibp59s0", "ibp94s0", "ibp155s0", "ibp172s0", "ibp187s0", "ibp220s0", "lo"]
    );
    // The ASPEED VGA (vendor 0x1a03) and the NICs are not GPUs.
    assert_eq!(names(DeviceKind::Gpu), GPUS);

    let m0 = h.find(DeviceKind::Rdma, "mlx5_0").unwrap();
    assert_eq!(m0.pci_path, PciAddr::path(&["0000:15:01.0", "0000:16:00.0", "0000:17:01.0", "0000:19:00.0"]).unwrap());
    assert_eq!((m0.numa, m0.netdevs.as_slice()), (Some(0), &["ibp25s0".to_string()][..]));
    let m6 = h.find(DeviceKind::Rdma, "mlx5_6").unwrap();
    assert_eq!((m6.numa, m6.netdevs.as_slice()), (Some(1), &["ibp187s0".to_string()][..]));
    let g4 = h.find(DeviceKind::Gpu, "0000:9a:00.0").unwrap();
    assert_eq!(g4.pci_path, PciAddr::path(&["0000:97:01.0", "0000:98:00.0", "0000:99:00.0", "0000:9a:00.0"]).unwrap());
    assert_eq!(g4.numa, Some(1));
    let eth0 = h.find(DeviceKind::Net, "eth0").unwrap();
    assert_eq!(eth0.pci_path, PciAddr::path(&["0000:15:03.0", "0000:1a:00.0"]).unwrap());
    assert_eq!((eth0.numa, eth0.state.as_deref()), (Some(0), Some("up")));
    let lo = h.find(DeviceKind::Net, "lo").unwrap();
    assert_eq!((lo.pci_path.is_empty(), lo.numa, lo.state.as_deref()), (true, None, Some("unknown")));
    assert_eq!(h.numa_nodes(), [0, 1]);
    assert_eq!(h.default_rails(), (0..8).map(mlx).collect::<Vec<_>>());
}

#[test]
fn dgx_each_gpu_prefers_its_switch_partner_then_its_node() {
    let h = dgx();
    let rails: Vec<String> = (0..8).map(mlx).collect();
    for (i, g) in GPUS.iter().enumerate() {
        // Hand-derived: the partner, then the other three NICs of its node in
        // rail order, then the other node's four in rail order.
        let node = i / 4;
        let mut want = vec![(i, Locality::SamePcieSwitch)];
        want.extend((node * 4..node * 4 + 4).filter(|&j| j != i).map(|j| (j, Locality::SameNuma)));
        want.extend((0..8).filter(|j| j / 4 != node).map(|j| (j, Locality::OtherNuma)));
        assert_eq!(rank(&h, &gpu(g), &rails), want, "GPU {i} {g}");
    }
    // The management NIC shares GPU 0's host bridge but not its switch; the IPoIB
    // netdev of mlx5_0 sits where mlx5_0 sits.
    assert_eq!(
        rank(&h, &gpu(GPUS[0]), &["lo", "mlx5_4", "mlx5_1", "eth0", "ibp25s0"]),
        vec![(4, Locality::SamePcieSwitch), (3, Locality::SameRootComplex), (2, Locality::SameNuma), (0, Locality::Unknown), (1, Locality::OtherNuma)]
    );
}

#[test]
fn dgx_host_memory_on_node_1_prefers_mlx5_4_to_7() {
    let h = dgx();
    let rails: Vec<String> = (0..8).map(mlx).collect();
    let ranked = rank(&h, &MemPlace::Host { numa: Some(1) }, &rails);
    let want: Vec<_> = (4..8).map(|j| (j, Locality::SameNuma)).chain((0..4).map(|j| (j, Locality::OtherNuma))).collect();
    assert_eq!(ranked, want);
    let ranked = rank(&h, &MemPlace::Host { numa: Some(0) }, &rails);
    assert_eq!(ranked[..4], (0..4).map(|j| (j, Locality::SameNuma)).collect::<Vec<_>>());
}

#[test]
fn softroce_vm_rxe_devices_sit_where_their_virtio_netdevs_sit() {
    let h = read_sysfs(&fixture("softroce-vm")).unwrap();
    assert_eq!(h.of_kind(DeviceKind::Gpu).count(), 0, "QEMU's VGA is no GPU");
    let rxe0 = h.find(DeviceKind::Rdma, "rxe0").unwrap();
    let rxe1 = h.find(DeviceKind::Rdma, "rxe1").unwrap();
    // rxe0 through `parent`, rxe1 through its port's GID table.
    assert_eq!((rxe0.netdevs.as_slice(), rxe0.numa), (&["ens3".to_string()][..], Some(0)));
    assert_eq!((rxe1.netdevs.as_slice(), rxe1.numa), (&["ens4".to_string()][..], Some(0)));
    assert_eq!(rxe0.pci_path, PciAddr::path(&["0000:00:03.0"]).unwrap());
    assert_eq!(rxe1.pci_path, PciAddr::path(&["0000:00:04.0"]).unwrap());
    // The netdevs' `device` is the virtio device; their node is the PCI function's.
    let ens4 = h.find(DeviceKind::Net, "ens4").unwrap();
    assert_eq!((ens4.numa, ens4.pci_path.clone()), (Some(0), PciAddr::path(&["0000:00:04.0"]).unwrap()));
    assert_eq!(h.default_rails(), ["rxe0", "rxe1"]);
    assert_eq!(
        rank(&h, &MemPlace::Host { numa: Some(0) }, &["lo", "rxe1", "rxe0"]),
        vec![(1, Locality::SameNuma), (2, Locality::SameNuma), (0, Locality::Unknown)]
    );
}

#[test]
fn topology_file_naming_a_missing_device_fails_naming_it_and_what_exists() {
    let h = dgx();
    let dir = TempDir::new("topology-missing");
    let file = dir.write("topology.toml", "[[rail]]\ndevice = \"mlx5_0\"\n\n[[rail]]\nname = \"rail8\"\ndevice = \"mlx5_8\"\n");
    let err = load_topology_file(&file, &h).unwrap_err();
    let TopologyError::File { path, error: TopologyFileError::NoSuchDevice { key, device, rdma, netdevs } } = &err else {
        panic!("{err:?}");
    };
    assert_eq!((path, key.as_str(), device.as_str()), (&file, "rail[1].device", "mlx5_8"));
    assert_eq!(rdma, &(0..8).map(mlx).collect::<Vec<_>>());
    assert!(netdevs.contains(&"eth0".to_string()) && netdevs.contains(&"lo".to_string()), "{netdevs:?}");
    let text = err.to_string();
    assert!(text.contains(&file.display().to_string()), "{text}");
    assert!(text.contains("`mlx5_8`"), "{text}");
    assert!(text.contains("mlx5_0, mlx5_1, mlx5_2, mlx5_3, mlx5_4, mlx5_5, mlx5_6, mlx5_7"), "{text}");

    let err = load_topology_file(&dir.join("absent.toml"), &h).unwrap_err();
    assert!(matches!(err, TopologyError::ReadFile { kind: std::io::ErrorKind::NotFound, .. }), "{err:?}");
}

#[test]
fn topology_file_pin_wins_over_discovery() {
    let h = dgx();
    let dir = TempDir::new("topology-pin");
    let file = dir.write("topology.toml", "[[rail]]\ndevice = \"mlx5_3\"\ngpus = [\"0000:18:00.0\"]\n");
    let h = load_topology_file(&file, &h).unwrap();
    let rails: Vec<String> = (0..8).map(mlx).collect();
    let ranked = rank(&h, &gpu(GPUS[0]), &rails);
    assert_eq!(
        ranked,
        vec![
            (3, Locality::Pinned),
            (0, Locality::SamePcieSwitch),
            (1, Locality::SameNuma),
            (2, Locality::SameNuma),
            (4, Locality::OtherNuma),
            (5, Locality::OtherNuma),
            (6, Locality::OtherNuma),
            (7, Locality::OtherNuma),
        ]
    );
    // Other GPUs keep their discovered partner.
    assert_eq!(rank(&h, &gpu(GPUS[3]), &rails)[0], (3, Locality::SamePcieSwitch));
    // The file's rails are the default rails now.
    assert_eq!(h.default_rails(), ["mlx5_3"]);
}

#[test]
fn this_machine_reads_without_error() {
    let h = read_sysfs(Path::new("/")).unwrap();
    let lo = h.find(DeviceKind::Net, "lo").unwrap_or_else(|| panic!("no lo among {:?}", h.devices));
    assert!(lo.pci_path.is_empty(), "{lo:?}");
}

#[test]
fn a_root_without_sys_is_refused() {
    let dir = TempDir::new("topology-nosys");
    assert_eq!(read_sysfs(dir.path()), Err(TopologyError::NoSysfs { root: dir.path().to_path_buf() }));
}

#[test]
fn symlinks_resolve_within_the_root() {
    // An absolute link and one with more `..` than the tree is deep: both
    // stay inside the root (read outside it, neither target exists).
    let dir = TempDir::new("topology-links");
    link(&dir, "sys/class/net/abs0", "/sys/devices/kvwire-test/net/abs0");
    dir.write("sys/devices/kvwire-test/net/abs0/operstate", "up\n");
    link(&dir, "sys/devices/kvwire-test/net/abs0/device", "/sys/devices/pci0000:00/0000:00:07.0");
    dir.write("sys/devices/pci0000:00/0000:00:07.0/numa_node", "3\n");
    link(&dir, "sys/class/net/deep0", "../../../../../../../../../../sys/devices/kvwire-test/net/deep0");
    dir.write("sys/devices/kvwire-test/net/deep0/operstate", "down\n");
    link(&dir, "sys/class/net/loop0", "loop0");
    let err = read_sysfs(dir.path()).unwrap_err();
    assert!(err.to_string().contains("too many levels of symbolic links"), "{err}");
    std::fs::remove_file(dir.join("sys/class/net/loop0")).unwrap();

    let h = read_sysfs(dir.path()).unwrap();
    let abs0 = h.find(DeviceKind::Net, "abs0").unwrap();
    assert_eq!((abs0.state.as_deref(), abs0.numa), (Some("up"), Some(3)));
    assert_eq!(abs0.pci_path, PciAddr::path(&["0000:00:07.0"]).unwrap());
    assert_eq!(h.find(DeviceKind::Net, "deep0").unwrap().state.as_deref(), Some("down"));
}

#[test]
fn numa_node_of_touched_memory_is_a_node_of_this_machine_or_unknown() {
    let mut v = vec![0u8; 1 << 20];
    for b in v.iter_mut().step_by(4096) {
        *b = 1;
    }
    let node = numa_node_of(v.as_ptr());
    // Some(0) or None on a one-node machine; any online node on a bigger one.
    let online: Vec<u32> = std::fs::read_dir("/sys/devices/system/node")
        .map(|d| d.filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix("node")?.parse().ok()).collect())
        .unwrap_or_default();
    assert!(node.is_none_or(|n| n == 0 || online.contains(&n)), "{node:?} not among {online:?}");
    // Whatever it answered for real memory, an unmapped address is no node, not a panic.
    assert_eq!(numa_node_of(std::ptr::null()), None);
    assert_eq!(numa_node_of(usize::MAX as *const u8), None);
    std::hint::black_box(&v);
}
