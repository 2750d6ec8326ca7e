//! Topology: locality levels and rail ranking against hand-derived orders,
//! PCI address spellings, and the topology file's checks.

use kvwire_core::topology::{
    rank, Device, DeviceKind, HostTopology, Locality, MemPlace, PciAddr, TopologyFile, TopologyFileError,
};

fn pci(s: &str) -> PciAddr {
    s.parse().unwrap()
}

fn path(addrs: &[&str]) -> Vec<PciAddr> {
    PciAddr::path(addrs).unwrap()
}

fn gpu_mem(s: &str) -> MemPlace {
    MemPlace::Gpu { pci: pci(s) }
}

/// One GPU and a NIC at each locality level from it:
///
/// ```text
/// host bridge 0000:15 (NUMA 0)
///   root port 15:01.0 ── switch 16:00.0 ─┬─ 17:00.0 ── GPU 18:00.0
///                                        └─ 17:01.0 ── sw  19:00.0   (same switch)
///   root port 15:02.0 ── rc  1a:00.0                                 (same host bridge)
/// host bridge 0000:27 (NUMA 0)
///   root port 27:01.0 ── 28:00.0 ── 29:01.0 ── node 2b:00.0          (same NUMA)
/// host bridge 0000:97 (NUMA 1)
///   root port 97:01.0 ── 98:00.0 ── 99:01.0 ── far 9b:00.0           (other NUMA)
/// virtual netdev `virt` (no PCI path, NUMA unknown)
/// ```
fn host() -> HostTopology {
    let nic = |name: &str, numa, p: &[&str]| Device::new(name, DeviceKind::Rdma).with_numa(Some(numa)).with_pci_path(path(p));
    HostTopology {
        devices: vec![
            nic("sw", 0, &["0000:15:01.0", "0000:16:00.0", "0000:17:01.0", "0000:19:00.0"]),
            nic("rc", 0, &["0000:15:02.0", "0000:1a:00.0"]),
            nic("node", 0, &["0000:27:01.0", "0000:28:00.0", "0000:29:01.0", "0000:2b:00.0"]),
            nic("far", 1, &["0000:97:01.0", "0000:98:00.0", "0000:99:01.0", "0000:9b:00.0"]),
            Device::new("virt", DeviceKind::Net),
            Device::new("0000:18:00.0", DeviceKind::Gpu)
                .with_numa(Some(0))
                .with_pci_path(path(&["0000:15:01.0", "0000:16:00.0", "0000:17:00.0", "0000:18:00.0"])),
        ],
        rails: Vec::new(),
    }
}

#[test]
fn gpu_memory_ranks_switch_then_root_complex_then_node_then_unknown_then_remote() {
    let h = host();
    let rails = ["virt", "far", "node", "rc", "sw"];
    assert_eq!(
        rank(&h, &gpu_mem("0000:18:00.0"), &rails),
        vec![
            (4, Locality::SamePcieSwitch),
            (3, Locality::SameRootComplex),
            (2, Locality::SameNuma),
            (0, Locality::Unknown),
            (1, Locality::OtherNuma),
        ]
    );
}

#[test]
fn host_memory_compares_numa_nodes_only_and_ties_keep_rail_order() {
    let h = host();
    let rails = ["sw", "far", "virt", "node", "rc"];
    // Node 0: sw, node, rc are all same_numa (no PCIe level for host memory), in rail order.
    assert_eq!(
        rank(&h, &MemPlace::Host { numa: Some(0) }, &rails),
        vec![(0, Locality::SameNuma), (3, Locality::SameNuma), (4, Locality::SameNuma), (2, Locality::Unknown), (1, Locality::OtherNuma)]
    );
    assert_eq!(
        rank(&h, &MemPlace::Host { numa: Some(1) }, &rails),
        vec![(1, Locality::SameNuma), (2, Locality::Unknown), (0, Locality::OtherNuma), (3, Locality::OtherNuma), (4, Locality::OtherNuma)]
    );
    let unknown: Vec<_> = (0..rails.len()).map(|i| (i, Locality::Unknown)).collect();
    assert_eq!(rank(&h, &MemPlace::Host { numa: None }, &rails), unknown);
}

#[test]
fn unknown_rails_and_gpus_rank_unknown() {
    let h = host();
    assert_eq!(h.locality(&gpu_mem("0000:18:00.0"), "mlx5_9"), Locality::Unknown);
    // A GPU is no rail.
    assert_eq!(h.locality(&gpu_mem("0000:18:00.0"), "0000:18:00.0"), Locality::Unknown);
    // Memory of a GPU this host does not have.
    assert_eq!(rank(&h, &gpu_mem("0000:42:00.0"), &["sw", "far"]), vec![(0, Locality::Unknown), (1, Locality::Unknown)]);
    assert!(rank::<&str>(&h, &gpu_mem("0000:18:00.0"), &[]).is_empty());
}

#[test]
fn same_root_port_without_a_shared_switch_is_root_complex() {
    // A two-function card straight below a root port: they share only the root port.
    let h = HostTopology {
        devices: vec![
            Device::new("nic", DeviceKind::Rdma).with_pci_path(path(&["0000:00:01.0", "0000:01:00.1"])),
            Device::new("0000:01:00.0", DeviceKind::Gpu).with_pci_path(path(&["0000:00:01.0", "0000:01:00.0"])),
        ],
        rails: Vec::new(),
    };
    assert_eq!(h.locality(&gpu_mem("0000:01:00.0"), "nic"), Locality::SameRootComplex);
}

#[test]
fn different_host_bridges_and_no_numa_is_unknown() {
    let h = HostTopology {
        devices: vec![
            Device::new("nic", DeviceKind::Net).with_pci_path(path(&["0000:00:03.0"])),
            Device::new("0000:40:00.0", DeviceKind::Gpu).with_pci_path(path(&["0000:3f:01.0", "0000:40:00.0"])),
            Device::new("0000:00:05.0", DeviceKind::Gpu).with_pci_path(path(&["0000:00:05.0"])),
        ],
        rails: Vec::new(),
    };
    assert_eq!(h.locality(&gpu_mem("0000:40:00.0"), "nic"), Locality::Unknown);
    // Both on the root bus of one host bridge (a VM's flat bus).
    assert_eq!(h.locality(&gpu_mem("0000:00:05.0"), "nic"), Locality::SameRootComplex);
}

#[test]
fn scores_follow_the_documented_table() {
    let table = [
        (Locality::Pinned, 0, "pinned"),
        (Locality::SamePcieSwitch, 10, "same_pcie_switch"),
        (Locality::SameRootComplex, 20, "same_root_complex"),
        (Locality::SameNuma, 30, "same_numa"),
        (Locality::Unknown, 40, "unknown"),
        (Locality::OtherNuma, 50, "other_numa"),
    ];
    assert_eq!(Locality::ALL.to_vec(), table.iter().map(|t| t.0).collect::<Vec<_>>());
    for (l, score, label) in table {
        assert_eq!((l.score(), l.label()), (score, label));
        assert_eq!(serde_json::to_value(l).unwrap(), label);
    }
    assert!(Locality::ALL.windows(2).all(|w| w[0] < w[1]));
}

#[test]
fn pci_addresses_in_every_common_spelling() {
    for s in ["0000:18:00.0", "00000000:18:00.0", "18:00.0", "0000:18:00.0", "0:18:00.0"] {
        assert_eq!(pci(s), PciAddr { domain: 0, bus: 0x18, device: 0, function: 0 }, "{s}");
    }
    assert_eq!(pci("0000:3B:1F.7").to_string(), "0000:3b:1f.7");
    assert_eq!(pci("10000:e0:17.0").to_string(), "10000:e0:17.0");
    for bad in ["", "0000:18:00", "0000:18:20.0", "0000:18:00.8", "zz:00.0", "0000:118:00.0", "000000000:18:00.0", "18.00.0"] {
        assert!(bad.parse::<PciAddr>().is_err(), "`{bad}` parsed");
    }
    assert_eq!(serde_json::to_value(pci("18:00.0")).unwrap(), "0000:18:00.0");
}

// ------------------------------------------------------------ the file

#[test]
fn file_pin_outranks_discovered_switch() {
    let file = TopologyFile::parse(
        r#"
        [[rail]]
        device = "sw"
        [[rail]]
        name = "fast"
        device = "far"
        gpus = ["00000000:18:00.0"]
        "#,
    )
    .unwrap();
    let h = file.apply(&host()).unwrap();
    assert_eq!(h.rails.iter().map(|r| (r.name.as_str(), r.device.as_str())).collect::<Vec<_>>(), [("sw", "sw"), ("fast", "far")]);
    assert_eq!(h.default_rails(), ["sw", "fast"]);
    // By rail name and by device name alike.
    assert_eq!(rank(&h, &gpu_mem("0000:18:00.0"), &["sw", "fast"]), vec![(1, Locality::Pinned), (0, Locality::SamePcieSwitch)]);
    assert_eq!(h.locality(&gpu_mem("0000:18:00.0"), "far"), Locality::Pinned);
    // Host memory is untouched by GPU pins.
    assert_eq!(h.locality(&MemPlace::Host { numa: Some(0) }, "fast"), Locality::OtherNuma);
}

#[test]
fn file_numa_overrides_replace_sysfs() {
    let file = TopologyFile::parse("[[rail]]\ndevice = \"virt\"\nnuma = 1\n[[gpu]]\npci = \"18:00.0\"\nnuma = 1\n").unwrap();
    let h = file.apply(&host()).unwrap();
    let virt = h.find(DeviceKind::Net, "virt").unwrap();
    assert_eq!((virt.numa, virt.numa_from_file), (Some(1), true));
    assert_eq!(h.locality(&MemPlace::Host { numa: Some(1) }, "virt"), Locality::SameNuma);
    // The GPU is now on node 1, so `far` (node 1, other host bridge) is same_numa; `sw` keeps its switch.
    assert_eq!(h.locality(&gpu_mem("0000:18:00.0"), "far"), Locality::SameNuma);
    assert_eq!(h.locality(&gpu_mem("0000:18:00.0"), "sw"), Locality::SamePcieSwitch);
    assert!(!h.find(DeviceKind::Rdma, "sw").unwrap().numa_from_file);
}

#[test]
fn file_naming_a_missing_device_lists_what_exists() {
    let file = TopologyFile::parse("[[rail]]\ndevice = \"sw\"\n[[rail]]\ndevice = \"mlx5_9\"\n").unwrap();
    let err = file.apply(&host()).unwrap_err();
    assert_eq!(
        err,
        TopologyFileError::NoSuchDevice {
            key: "rail[1].device".into(),
            device: "mlx5_9".into(),
            rdma: vec!["sw".into(), "rc".into(), "node".into(), "far".into()],
            netdevs: vec!["virt".into()],
        }
    );
    assert_eq!(
        err.to_string(),
        "rail[1].device: no RDMA device or netdev `mlx5_9` on this host (RDMA devices: sw, rc, node, far; netdevs: virt)"
    );
}

#[test]
fn file_naming_a_missing_gpu_lists_the_gpus() {
    let file = TopologyFile::parse("[[rail]]\ndevice = \"sw\"\ngpus = [\"0000:18:00.0\", \"0000:2a:00.0\"]\n").unwrap();
    assert_eq!(
        file.apply(&host()).unwrap_err().to_string(),
        "rail[0].gpus[1]: no GPU 0000:2a:00.0 on this host (GPUs: 0000:18:00.0)"
    );
    let file = TopologyFile::parse("[[gpu]]\npci = \"0000:2a:00.0\"\nnuma = 0\n").unwrap();
    let empty = HostTopology::default();
    assert_eq!(file.apply(&empty).unwrap_err().to_string(), "gpu[0].pci: no GPU 0000:2a:00.0 on this host (GPUs: none)");
}

#[test]
fn file_rail_name_must_not_shadow_another_device() {
    let file = TopologyFile::parse("[[rail]]\nname = \"rc\"\ndevice = \"sw\"\n").unwrap();
    let err = file.apply(&host()).unwrap_err();
    assert!(matches!(&err, TopologyFileError::Invalid { key, .. } if key == "rail[0].name"), "{err}");
    assert!(err.to_string().contains("rdma device `rc`"), "{err}");
}

#[test]
fn file_syntax_and_value_errors_name_the_line_or_key() {
    let err = TopologyFile::parse("[[rail]]\ndevice = \"sw\"\ndevcie = \"x\"\n").unwrap_err();
    assert!(matches!(&err, TopologyFileError::Syntax { line: 3, reason } if reason.contains("devcie")), "{err:?}");
    let err = TopologyFile::parse("[[rail]]\ndevice = \"sw\"\nnuma = -1\n").unwrap_err();
    assert!(matches!(err, TopologyFileError::Syntax { line: 3, .. }), "{err:?}");
    let err = TopologyFile::parse("[[rail]]\nname = \"r\"\n").unwrap_err();
    assert!(matches!(&err, TopologyFileError::Syntax { reason, .. } if reason.contains("device")), "{err:?}");

    let invalid = |text: &str| match TopologyFile::parse(text) {
        Err(TopologyFileError::Invalid { key, .. }) => key,
        other => panic!("{text}: {other:?}"),
    };
    assert_eq!(invalid("[[rail]]\ndevice = \"\"\n"), "rail[0].device");
    assert_eq!(invalid("[[rail]]\ndevice = \"a\"\n[[rail]]\ndevice = \"a\"\n"), "rail[1].device");
    assert_eq!(invalid("[[rail]]\nname = \"x\"\ndevice = \"a\"\n[[rail]]\nname = \"x\"\ndevice = \"b\"\n"), "rail[1].name");
    assert_eq!(invalid("[[rail]]\ndevice = \"a\"\ngpus = [\"18:00.0\", \"0000:18:00.0\"]\n"), "rail[0].gpus[1]");
    assert_eq!(invalid("[[rail]]\ndevice = \"a\"\ngpus = [\"gpu0\"]\n"), "rail[0].gpus[0]");
    assert_eq!(invalid("[[gpu]]\npci = \"18:00.0\"\n[[gpu]]\npci = \"0000:18:00.0\"\n"), "gpu[1].pci");
    assert_eq!(TopologyFile::parse("").unwrap(), TopologyFile::default());
}
