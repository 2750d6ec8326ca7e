//! kvwire's benchmarks, behind `kvwire bench …` and `kvwire report`: the
//! transport baselines ([`baseline`]), the latency campaign ([`campaign`])
//! with its HTML report ([`report`]) and SVG plots ([`svg`]), the layouts
//! sweep through two real kvwired processes ([`layouts`]), kvwire beside
//! Mooncake and NIXL in one run ([`peers`]), and the shared
//! set-up of the criterion benches ([`PlanCase`]). The soak and the rails
//! bench are this crate's binaries.

#![warn(missing_docs)]

pub mod baseline;
pub mod campaign;
pub mod layouts;
pub mod peers;
pub mod report;
pub mod svg;

use kvwire_core::layout::builtin;
use kvwire_core::plan::{build, CostModel, Plan, PlanInput, Side};
use kvwire_core::shard::LayoutSpec;
use kvwire_core::{CacheFormat, ModelSpec};

/// A planning case: model, tokens and both layouts, resolved once.
#[derive(Debug)]
pub struct PlanCase {
    /// Case name for reports.
    pub name: String,
    /// The model.
    pub model: ModelSpec,
    /// Tokens in the request.
    pub tokens: u64,
    /// Source side.
    pub src: Side,
    /// Destination side.
    pub dst: Side,
}

impl PlanCase {
    /// Resolves a case from a built-in model and layout strings.
    pub fn new(model: &str, tokens: u64, src: &str, dst: &str) -> PlanCase {
        let m = builtin(model).expect("built-in model");
        let format = CacheFormat::parse("bf16").expect("bf16");
        let s = Side::new(&m, &LayoutSpec::parse(src).expect("src"), format, tokens).expect("src side");
        let d = Side::new(&m, &LayoutSpec::parse(dst).expect("dst"), format, tokens).expect("dst side");
        PlanCase { name: format!("{model} {tokens} tok {src} -> {dst}"), model: m, tokens, src: s, dst: d }
    }

    /// Builds the plan.
    pub fn plan(&self) -> Plan {
        build(&PlanInput {
            model: &self.model,
            tokens: self.tokens,
            prefix_tokens: 0,
            src: &self.src,
            dst: &self.dst,
            cost: CostModel::default(),
        })
        .expect("plan")
    }
}

/// How a bench command failed. The `kvwire` CLI owns the exit codes: it
/// maps `BadInput` to 2 and `Failed` to 1.
#[derive(Debug)]
pub enum Error {
    /// The arguments or input files were wrong.
    BadInput(anyhow::Error),
    /// The measurement that was asked for failed.
    Failed(anyhow::Error),
}

/// What on this host decides how long a thread woken on another core
/// waits to run, for the benches to print beside their figures: the CPUs
/// online, and the idle driver with its polling window. A core that halts
/// when idle must leave its halt before the woken thread runs; on a
/// virtual machine that is an exit to the hypervisor. Measured on a 2-vCPU
/// VM (haltpoll, `guest_halt_poll_ns` 0): such a wake-up took 17-31 µs
/// against 1-2 µs on a busy core, and kvwire-soak 64 KiB p50 went from
/// 0.18 to 0.10 ms with a 200 µs polling window.
pub fn host_conditions() -> String {
    let read = |p: &str| std::fs::read_to_string(p).ok().map(|s| s.trim().to_string());
    // The host's, not this process's: a pinned run may use fewer.
    let online = read("/sys/devices/system/cpu/online").and_then(|l| kvwire_transport::topology::parse_cpu_list(&l).ok()).map(|c| c.len());
    let cpus = online.unwrap_or_else(|| std::thread::available_parallelism().map_or(0, |n| n.get()));
    let driver = read("/sys/devices/system/cpu/cpuidle/current_driver").unwrap_or_else(|| "unknown".into());
    let poll = match read("/sys/module/haltpoll/parameters/guest_halt_poll_ns") {
        Some(ns) => format!(", guest_halt_poll_ns {ns}"),
        None => String::new(),
    };
    format!("host: {cpus} CPUs, idle driver {driver}{poll}")
}

/// The CPUs this thread may run on, split in two as two hosts would have
/// them: the sending side's (the first half) and the receiving side's.
pub fn cpu_halves() -> Result<(Vec<usize>, Vec<usize>), String> {
    use nix::sched::{sched_getaffinity, CpuSet};
    let set = sched_getaffinity(nix::unistd::Pid::from_raw(0)).map_err(|e| format!("sched_getaffinity: {e}"))?;
    let cpus: Vec<usize> = (0..CpuSet::count()).filter(|&c| set.is_set(c).unwrap_or(false)).collect();
    if cpus.len() < 2 {
        return Err(format!("pinning each side to CPUs of its own needs 2 CPUs; this process may run on {}", cpus.len()));
    }
    let (a, b) = cpus.split_at(cpus.len() / 2);
    Ok((a.to_vec(), b.to_vec()))
}

/// `cpus` as a Linux CPU list (`0,1`), as `kvwired`'s `cpus` reads it.
pub fn cpu_list(cpus: &[usize]) -> String {
    cpus.iter().map(usize::to_string).collect::<Vec<_>>().join(",")
}

/// Parses a size like `4096`, `64K`, `64M` or `1G` (binary multiples).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim().trim_end_matches("iB").trim_end_matches('B');
    let (num, mult) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&t[..t.len() - 1], 1 << 20),
        Some('G' | 'g') => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("`{s}` is not a positive size like 4096, 64K, 64M or 1G"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn host_conditions_name_the_cpus_this_process_may_use_and_the_idle_driver() {
        let line = super::host_conditions();
        let cpus = std::thread::available_parallelism().unwrap().get();
        assert!(line.starts_with(&format!("host: {cpus} CPUs, idle driver ")), "{line}");
        let driver = std::fs::read_to_string("/sys/devices/system/cpu/cpuidle/current_driver").map_or("unknown".to_string(), |s| s.trim().to_string());
        assert!(line.contains(&format!("idle driver {driver}")), "{line}");
    }
}
