//! The arguments of `kvwire bench campaign` ([`CampaignArgs`]) and the
//! validated [`Settings`] they become.

use kvwire_core::protocol::TransportKind;
use crate::parse_size;
use anyhow::{anyhow, bail};
use clap::Args;
use std::path::PathBuf;

/// Most transfers at once in one point.
const MAX_CONCURRENCY: u32 = 64;
/// Most timed transfers per connection and point.
const MAX_ITERATIONS: u32 = 100_000;
/// Most batches outstanding per transfer.
const MAX_DEPTH: u32 = 4096;
/// Most writes one transfer is split into.
const MAX_CHUNKS: u64 = 1 << 20;

/// Raw arguments of `kvwire bench campaign`.
#[derive(Debug, Args)]
pub struct CampaignArgs {
    /// Transports to sweep, comma-separated: tcp, shm, verbs (verbs needs an
    /// RDMA device, e.g. soft-RoCE; without one its points are skipped loudly).
    #[arg(long, value_delimiter = ',', default_value = "tcp,shm")]
    transports: Vec<String>,
    /// Transfer sizes, comma-separated (suffixes K, M, G = KiB, MiB, GiB).
    #[arg(long, value_delimiter = ',', default_value = "4K,64K,1M,16M,64M")]
    sizes: Vec<String>,
    /// Timed transfers per connection and point (after one warm-up round).
    #[arg(long, default_value_t = 5)]
    iterations: u32,
    /// Bytes per write: each transfer is split into writes of this size.
    #[arg(long, default_value = "1M")]
    chunk: String,
    /// Pipeline depth: most write batches outstanding per transfer.
    #[arg(long, default_value_t = 4)]
    depth: u32,
    /// Transfers at once sharing one link, comma-separated (1 = alone).
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    concurrency: Vec<u32>,
    /// Directory for campaign.jsonl and the SVG plots (created if missing).
    #[arg(long, default_value = "kvwire-campaign")]
    out: PathBuf,
    /// Print the JSONL lines instead of a table.
    #[arg(long)]
    json: bool,
}

/// Validated settings of a campaign.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// Transports, in the order given, without repeats.
    pub transports: Vec<TransportKind>,
    /// Transfer sizes in bytes, ascending, without repeats.
    pub sizes: Vec<u64>,
    /// Timed transfers per connection and point.
    pub iterations: u32,
    /// Bytes per write.
    pub chunk: u64,
    /// Most batches outstanding per transfer.
    pub depth: u32,
    /// Concurrency levels, ascending, without repeats.
    pub concurrency: Vec<u32>,
    /// Output directory.
    pub out: PathBuf,
    /// JSONL on stdout instead of a table.
    pub json: bool,
}

impl CampaignArgs {
    /// Step two of argument parsing: every value checked, errors naming the flag.
    pub fn settings(&self) -> anyhow::Result<Settings> {
        let mut transports = Vec::new();
        for t in self.transports.iter().map(|t| t.trim()) {
            let t: TransportKind = t.parse().map_err(|e| anyhow::anyhow!("--transports: {e}"))?;
            if !transports.contains(&t) {
                transports.push(t);
            }
        }
        if transports.is_empty() {
            bail!("--transports: give at least one of tcp, shm, verbs");
        }
        let mut sizes = Vec::new();
        for s in &self.sizes {
            sizes.push(parse_size(s).map_err(|e| anyhow!("--sizes: {e}"))?);
        }
        sizes.sort_unstable();
        sizes.dedup();
        if sizes.is_empty() {
            bail!("--sizes: give at least one size");
        }
        if self.iterations == 0 || self.iterations > MAX_ITERATIONS {
            bail!("--iterations {}: must be 1 to {MAX_ITERATIONS}", self.iterations);
        }
        let chunk = parse_size(&self.chunk).map_err(|e| anyhow!("--chunk: {e}"))?;
        if self.depth == 0 || self.depth > MAX_DEPTH {
            bail!("--depth {}: must be 1 to {MAX_DEPTH} (write batches in flight per transfer)", self.depth);
        }
        let largest = *sizes.last().expect("at least one size");
        if largest.div_ceil(chunk) > MAX_CHUNKS {
            bail!("--chunk {chunk}: splits a {largest}-byte transfer into more than {MAX_CHUNKS} writes; use a larger chunk");
        }
        let mut concurrency = self.concurrency.clone();
        concurrency.sort_unstable();
        concurrency.dedup();
        match (concurrency.first(), concurrency.last()) {
            (None, _) => bail!("--concurrency: give at least one level"),
            (Some(0), _) => bail!("--concurrency 0: must be at least 1 (transfers at once)"),
            (_, Some(&c)) if c > MAX_CONCURRENCY => bail!("--concurrency {c}: at most {MAX_CONCURRENCY}"),
            _ => {}
        }
        Ok(Settings { transports, sizes, iterations: self.iterations, chunk, depth: self.depth, concurrency, out: self.out.clone(), json: self.json })
    }
}
