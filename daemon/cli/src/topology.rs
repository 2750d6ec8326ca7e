//! `kvwire topology`: what the daemon would see on this host.

use crate::Failure;
use anyhow::anyhow;
use clap::Args;
use kvwire_core::topology::{rank, DeviceKind, Locality, MemPlace};
use kvwire_transport::topology::{load_topology_file, read_sysfs, TopologyError};
use std::fmt::Write as _;
use std::path::PathBuf;


/// `kvwire topology`: what the daemon would see.
#[derive(Debug, Args)]
pub struct TopologyArgs {
    /// Root of the sysfs tree to read (a copy of a host's, for tests).
    #[arg(long, value_name = "ROOT", default_value = "/")]
    sysfs: PathBuf,
    /// Topology file (TOML) applied over what sysfs says; every device it names must exist.
    #[arg(long, value_name = "TOPOLOGY.toml")]
    file: Option<PathBuf>,
    /// Rails to rank (RDMA device, netdev, or the file's rail name); repeatable.
    /// Default: the file's rails, else every RDMA device, else every physical netdev.
    #[arg(long = "rail", value_name = "NAME")]
    rails: Vec<String>,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    json: bool,
}

/// A label, a memory place, and the rails ranked for it.
type Preference = (String, MemPlace, Vec<(usize, Locality)>);

/// Runs `kvwire topology`: exit 2 for a bad root, file or rail name; 1 when
/// sysfs cannot be read.
pub fn topology_cmd(a: TopologyArgs, out: &mut String) -> Result<(), Failure> {
    let host = read_sysfs(&a.sysfs).map_err(|e| match e {
        TopologyError::NoSysfs { .. } => Failure::BadInput(e.into()),
        other => Failure::Failed(other.into()),
    })?;
    let host = match &a.file {
        Some(f) => load_topology_file(f, &host).map_err(|e| Failure::BadInput(e.into()))?,
        None => host,
    };
    let (rails, rails_from) = if a.rails.is_empty() {
        let from = if !host.rails.is_empty() {
            "topology file"
        } else if host.of_kind(DeviceKind::Rdma).next().is_some() {
            "RDMA devices"
        } else {
            "physical netdevs"
        };
        (host.default_rails(), from)
    } else {
        for r in &a.rails {
            if host.rail_device(r).is_none() {
                let names = |k| host.of_kind(k).map(|d| d.name.as_str()).collect::<Vec<_>>().join(", ");
                return Err(Failure::BadInput(anyhow!(
                    "--rail {r}: no rail, RDMA device or netdev of that name (RDMA devices: {}; netdevs: {})",
                    names(DeviceKind::Rdma),
                    names(DeviceKind::Net)
                )));
            }
        }
        (a.rails.clone(), "--rail")
    };
    let mut places: Vec<(String, MemPlace)> = host
        .of_kind(DeviceKind::Gpu)
        .filter_map(|g| g.pci_addr())
        .map(|pci| (format!("gpu {pci}"), MemPlace::Gpu { pci }))
        .collect();
    let nodes = host.numa_nodes();
    places.extend(nodes.iter().map(|&n| (format!("host numa {n}"), MemPlace::Host { numa: Some(n) })));
    if nodes.is_empty() {
        places.push(("host numa unknown".to_string(), MemPlace::Host { numa: None }));
    }
    let prefs: Vec<Preference> = places.into_iter().map(|(label, mem)| (label, mem, rank(&host, &mem, &rails))).collect();

    if a.json {
        let v = serde_json::json!({
            "sysfs": a.sysfs,
            "file": a.file,
            "devices": host.devices,
            "file_rails": host.rails,
            "rails": rails,
            "rails_from": rails_from,
            "preferences": prefs.iter().map(|(label, mem, ranked)| serde_json::json!({
                "label": label,
                "memory": mem,
                "rails": ranked.iter().map(|&(i, l)| serde_json::json!({
                    "rail": rails[i], "locality": l, "score": l.score(),
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        });
        out.push_str(&serde_json::to_string_pretty(&v).expect("topology serializes"));
        out.push('\n');
        return Ok(());
    }

    let _ = writeln!(
        out,
        "sysfs {}  topology file {}",
        a.sysfs.display(),
        a.file.as_deref().map_or("none".to_string(), |f| f.display().to_string())
    );
    let w = host.devices.iter().map(|d| d.name.len()).max().unwrap_or(4).max(4);
    let _ = writeln!(out, "{:<w$}  {:<4}  {:>4}  {:<14}  pci path", "name", "kind", "numa", "netdevs/state");
    for d in &host.devices {
        let numa = match d.numa {
            Some(n) if d.numa_from_file => format!("{n}*"),
            Some(n) => n.to_string(),
            None => "-".into(),
        };
        let extra = match d.kind {
            DeviceKind::Rdma if d.netdevs.is_empty() => "-".to_string(),
            DeviceKind::Rdma => d.netdevs.join(","),
            _ => d.state.clone().unwrap_or_else(|| "-".into()),
        };
        let path = if d.pci_path.is_empty() {
            "- (virtual)".to_string()
        } else {
            d.pci_path.iter().map(|p| p.to_string()).collect::<Vec<_>>().join("/")
        };
        let _ = writeln!(out, "{:<w$}  {:<4}  {numa:>4}  {extra:<14}  {path}", d.name, d.kind.label());
    }
    if host.devices.iter().any(|d| d.numa_from_file) {
        let _ = writeln!(out, "numa*: from the topology file");
    }
    for r in &host.rails {
        let gpus = r.gpus.iter().map(|g| g.to_string()).collect::<Vec<_>>().join(", ");
        let _ = writeln!(out, "file rail {} -> {}{}", r.name, r.device, if gpus.is_empty() { String::new() } else { format!("  serves first: {gpus}") });
    }
    let _ = writeln!(out);
    if rails.is_empty() {
        let _ = writeln!(out, "rails: none (no RDMA device, no physical netdev, no topology file rails)");
        return Ok(());
    }
    let _ = writeln!(out, "rails ({rails_from}): {}", rails.join(" "));
    let lw = prefs.iter().map(|p| p.0.len()).max().unwrap_or(6).max(6);
    let _ = writeln!(out, "{:<lw$}  rails, best first (locality)", "memory");
    for (label, _, ranked) in &prefs {
        let list = ranked.iter().map(|&(i, l)| format!("{} ({l})", rails[i])).collect::<Vec<_>>().join(", ");
        let _ = writeln!(out, "{label:<lw$}  {list}");
    }
    Ok(())
}
