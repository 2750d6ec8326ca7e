//! An engine that keeps its cache as its own tensors: per layer (or one
//! cross-layer tensor per rank) in the engine's layout, each in its own
//! memfd, registered as they are (`register_tensors`), or each its own
//! allocation of the daemons' stand-in device memory
//! (`register_device_tensors`). A prefill engine
//! writes its tensors, a decode engine reads them, both by the engine's
//! shape, written here from the engines' published shapes, not from
//! kvwire's placement code. With the layout's `pad=`, the engine's tensors
//! are padded views (`as_strided`): each axis step skips the inner axes and
//! its padding, and the padding holds bytes no one may touch.

use crate::scenario::ScenarioError;
use crate::tinylm::KvCache;
use kvwire_client::client::Client;
use kvwire_client::control::{DeviceMemory, ModelSource, RegisterCache, RegisterDeviceTensors, RegisterTensors};
use kvwire_core::plan::Side;
use kvwire_core::reuse::CacheIdentity;
use kvwire_core::tensors::{Role, TensorDesc};
use kvwire_transport::HostMem;

/// The engine's cache: per rank, one memfd per tensor.
#[derive(Debug)]
pub struct EngineCache {
    preset: String,
    layers: u64,
    tp: u64,
    block: u64,
    num_blocks: u64,
    table: Vec<u32>,
    kv_heads: u64,
    head_dim: u64,
    /// The layout's `pad=`: elements of padding after each step of an axis, by letter.
    pad: Vec<(char, u64)>,
    mems: Vec<Vec<HostMem>>,
}

const F32: u64 = 4;

impl EngineCache {
    /// The engine tensor of `preset` for one rank: its dimensions (a
    /// letter each: layer, K/V, block, token, head, row element) and sizes,
    /// outermost first, and its role. vLLM CPU packs K and V in its last
    /// dimension of `2 * head_dim`.
    fn dims(&self, preset: &str) -> (&'static str, Vec<u64>, Role) {
        let (nb, t, h, d) = (self.num_blocks, self.block, self.kv_heads / self.tp, self.head_dim);
        match preset {
            "vllm_nhd" => ("kbthd", vec![2, nb, t, h, d], Role::Kv),
            "vllm_hnd" => ("kbhtd", vec![2, nb, h, t, d], Role::Kv),
            "flashinfer" => ("bkthd", vec![nb, 2, t, h, d], Role::Kv),
            "flashinfer_hnd" => ("bkhtd", vec![nb, 2, h, t, d], Role::Kv),
            "vllm_cpu" => ("bhtd", vec![nb, h, t, 2 * d], Role::KvPacked),
            "vllm_cross" => ("blkthd", vec![nb, self.layers, 2, t, h, d], Role::Kv),
            other => panic!("engine: no shape for preset {other}"),
        }
    }

    /// Strides in elements of `preset`'s tensor: row-major, plus this
    /// engine's padding when it is its own preset.
    fn strides(&self, preset: &str) -> Vec<u64> {
        let (letters, shape, _) = self.dims(preset);
        let letters: Vec<char> = letters.chars().collect();
        let pad = |c: char| if preset == self.preset { self.pad.iter().find(|p| p.0 == c).map_or(0, |p| p.1) } else { 0 };
        let mut strides = vec![1; shape.len()];
        for i in (0..shape.len() - 1).rev() {
            strides[i] = strides[i + 1] * shape[i + 1] + pad(letters[i]);
        }
        strides
    }

    /// Element index of (layer, kv, block, slot, local head) in a tensor of `preset`.
    fn index(&self, preset: &str, layer: u64, kv: u64, b: u64, t: u64, h: u64) -> u64 {
        let (letters, ..) = self.dims(preset);
        let coord = |c| match c {
            'l' => layer,
            'k' => kv,
            'b' => b,
            't' => t,
            'h' => h,
            // vLLM CPU's V is the second half of the row.
            _ if preset == "vllm_cpu" => kv * self.head_dim,
            _ => 0,
        };
        letters.chars().zip(self.strides(preset)).map(|(c, s)| coord(c) * s).sum()
    }

    /// Allocates the engine's tensors for `side` (TP only, dense fp32
    /// layers of `kv_heads` × `head_dim`) and registers every rank: as host
    /// memfds, or with `device` as device allocations of the stand-in
    /// backend (the memfds play the engine's GPU tensors).
    #[allow(clippy::too_many_arguments)]
    pub fn register(c: &Client, group: &str, model_toml: &str, layout: &str, preset: &str, side: &Side, layers: u64, (kv_heads, head_dim): (u64, u64), id: &CacheIdentity, device: bool) -> Result<EngineCache, ScenarioError> {
        let setup = |e: String| ScenarioError::Setup(e);
        if side.shard.pp_layers.len() != 1 {
            return Err(setup("engine: the per-layer engine scenario holds TP layouts only".into()));
        }
        let mut e = EngineCache {
            preset: preset.into(),
            layers,
            tp: u64::from(side.shard.tp),
            block: u64::from(side.geo.block_size),
            num_blocks: u64::from(side.num_blocks),
            table: side.block_table.clone(),
            kv_heads,
            head_dim,
            pad: side.kv.as_ref().map(|o| o.pad_text()).unwrap_or_default().split(':').filter(|p| !p.is_empty()).map(|p| (p.as_bytes()[0] as char, p[1..].parse().expect("pad= as the layout gave it"))).collect(),
            mems: Vec::new(),
        };
        let (_, shape, role) = e.dims(preset);
        let strides = e.strides(preset);
        // From the first element to the end of the last: padding past it is not the tensor's.
        let bytes = (shape.iter().zip(&strides).map(|(n, s)| (n - 1) * s).sum::<u64>() + 1) * F32;
        let tensors = if preset == "vllm_cross" { 1 } else { layers };
        for rank in 0..e.tp as u32 {
            let mems = (0..tensors).map(|_| HostMem::new("engine-layer", bytes).map_err(|e| setup(e.to_string()))).collect::<Result<Vec<_>, _>>()?;
            let descs = (0..tensors as u32)
                .map(|i| TensorDesc {
                    memory: i,
                    offset: 0,
                    dtype: "float32".into(),
                    shape: shape.clone(),
                    strides: strides.clone(),
                    role,
                    layers: if tensors == 1 { [0, layers as u32] } else { [i, i + 1] },
                })
                .collect();
            let cache = RegisterCache {
                group: group.into(),
                model: ModelSource::Toml(model_toml.into()),
                format: "fp32".into(),
                layout: layout.into(),
                rank,
                num_blocks: side.num_blocks,
                identity: id.clone(),
            };
            let fds: Vec<_> = mems.iter().map(|m| m.fd()).collect();
            if device {
                let memories = mems.iter().map(|m| DeviceMemory { ordinal: 0, len: m.len(), ipc: None }).collect();
                c.register_device_tensors(RegisterDeviceTensors { cache, tensors: descs, memories }, &fds).map_err(|e| ScenarioError::Daemon { step: "register_device_tensors", source: e })?;
            } else {
                c.register_tensors(RegisterTensors { cache, tensors: descs }, &fds).map_err(|e| ScenarioError::Daemon { step: "register_tensors", source: e })?;
            }
            e.mems.push(mems);
        }
        Ok(e)
    }

    /// Writes `cache` into the engine's tensors, each (layer, head, position)
    /// on the rank holding that head, as a prefill engine does.
    pub fn scatter(&self, cache: &KvCache) {
        let per = self.kv_heads / self.tp;
        let d = self.head_dim as usize;
        for layer in 0..self.layers {
            for (kv, rows) in [(0, &cache.k[layer as usize]), (1, &cache.v[layer as usize])] {
                for pos in 0..cache.tokens as u64 {
                    for head in 0..self.kv_heads {
                        let mem = &self.mems[(head / per) as usize][if self.preset == "vllm_cross" { 0 } else { layer as usize }];
                        let b = u64::from(self.table[(pos / self.block) as usize]);
                        let at = self.index(&self.preset, layer, kv, b, pos % self.block, head % per) * F32;
                        let start = (pos as usize * self.kv_heads as usize + head as usize) * d;
                        let bytes: Vec<u8> = rows[start..start + d].iter().flat_map(|x| x.to_le_bytes()).collect();
                        mem.write(at, &bytes).expect("write an engine tensor");
                    }
                }
            }
        }
    }

    /// Bytes of the engine's tensors that are in no row of any block and
    /// not zero (the memfds start zeroed): padding someone wrote.
    pub fn stray_bytes(&self) -> u64 {
        let per = self.kv_heads / self.tp;
        let row = (self.head_dim * F32) as usize;
        let mut stray = 0;
        for mems in &self.mems {
            for (i, mem) in mems.iter().enumerate() {
                let mut bytes = vec![0u8; mem.len() as usize];
                mem.read(0, &mut bytes).expect("read an engine tensor");
                let layers = if self.preset == "vllm_cross" { 0..self.layers } else { i as u64..i as u64 + 1 };
                for layer in layers {
                    for (kv, b, t, h) in (0..2).flat_map(|kv| (0..self.num_blocks).flat_map(move |b| (0..self.block).flat_map(move |t| (0..per).map(move |h| (kv, b, t, h))))) {
                        let at = (self.index(&self.preset, layer, kv, b, t, h) * F32) as usize;
                        bytes[at..at + row].fill(0);
                    }
                }
                stray += bytes.iter().filter(|&&b| b != 0).count() as u64;
            }
        }
        stray
    }

    /// The cache of `tokens` positions, read from the engine's tensors as
    /// `read_as` lays them out (its own preset, unless a negative control
    /// names another).
    pub fn gather(&self, tokens: u64, read_as: Option<&str>) -> KvCache {
        let preset = read_as.unwrap_or(&self.preset);
        let (h, d) = (self.kv_heads as usize, self.head_dim as usize);
        let n = tokens as usize * h * d;
        let mut cache = KvCache { kv_heads: h, head_dim: d, tokens: tokens as usize, k: vec![vec![0.0; n]; self.layers as usize], v: vec![vec![0.0; n]; self.layers as usize] };
        let per = self.kv_heads / self.tp;
        let mut row = vec![0u8; (self.head_dim * F32) as usize];
        for layer in 0..self.layers {
            for kv in 0..2 {
                for pos in 0..tokens {
                    for head in 0..self.kv_heads {
                        let rank = (head / per) as usize;
                        let mem = &self.mems[rank][if self.preset == "vllm_cross" { 0 } else { layer as usize }];
                        let b = u64::from(self.table[(pos / self.block) as usize]);
                        let at = self.index(preset, layer, kv, b, pos % self.block, head % per) * F32;
                        mem.read(at, &mut row).expect("read an engine tensor");
                        let start = (pos as usize * h + head as usize) * d;
                        let out = if kv == 0 { &mut cache.k[layer as usize] } else { &mut cache.v[layer as usize] };
                        for (x, bytes) in out[start..start + d].iter_mut().zip(row.chunks_exact(4)) {
                            *x = f32::from_le_bytes(bytes.try_into().expect("chunks of 4"));
                        }
                    }
                }
            }
        }
        cache
    }
}
