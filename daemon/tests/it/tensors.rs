//! Engine tensors through two real daemons: each side registers its cache
//! as an engine holds it (per-layer or cross-layer tensors, in several
//! memfds or one memfd at several offsets), a transfer remaps layout and TP,
//! and every row is read back where the destination engine's shape says.
//! Offsets come from each engine's published tensor shape, written here.

use super::daemons::{identity_of, MODEL, WAIT};
use kvwire_client::client::Client;
use kvwire_client::control::*;
use kvwire_core::tensors::{Role, TensorDesc};
use kvwire_testkit::{start_daemon, TempDir};
use kvwire_transport::HostMem;

const SECRET: &str = "a-secret-of-at-least-16-bytes";
const LAYERS: u64 = 4;
const HEADS: u64 = 4;
const DIM: u64 = 16;
const CANARY: u8 = 0xA5;

/// One engine side: a preset, TP degree, block size and table seed.
#[derive(Clone, Copy)]
struct Engine {
    preset: &'static str,
    tp: u64,
    block: u64,
    seed: u64,
    /// One memfd per tensor, or all tensors of a rank in one memfd with gaps.
    memfd_per_tensor: bool,
}

impl Engine {
    fn layout(&self) -> String {
        format!("tp={},block={},table=shuffle:{},kv={}", self.tp, self.block, self.seed, self.preset)
    }

    fn cross(&self) -> bool {
        self.preset == "vllm_cross"
    }

    /// The engine's tensor shape for `nb` blocks, and the role it registers it with.
    fn shape(&self, nb: u64) -> (Vec<u64>, Role) {
        let (t, h, d) = (self.block, HEADS / self.tp, DIM);
        match self.preset {
            "vllm_nhd" => (vec![2, nb, t, h, d], Role::Kv),
            "vllm_hnd" => (vec![2, nb, h, t, d], Role::Kv),
            "flashinfer" => (vec![nb, 2, t, h, d], Role::Kv),
            "vllm_cpu" => (vec![nb, h, t, 2 * d], Role::KvPacked),
            "vllm_cross" => (vec![nb, LAYERS, 2, t, h, d], Role::Kv),
            _ => unreachable!(),
        }
    }

    /// Element index of (layer, kv, block, slot, local head) in its tensor.
    fn index(&self, nb: u64, layer: u64, kv: u64, b: u64, t: u64, h: u64) -> u64 {
        let (nt, nh, nd) = (self.block, HEADS / self.tp, DIM);
        match self.preset {
            "vllm_nhd" => (((kv * nb + b) * nt + t) * nh + h) * nd,
            "vllm_hnd" => (((kv * nb + b) * nh + h) * nt + t) * nd,
            "flashinfer" => (((b * 2 + kv) * nt + t) * nh + h) * nd,
            "vllm_cpu" => ((b * nh + h) * nt + t) * 2 * nd + kv * nd,
            "vllm_cross" => ((((b * LAYERS + layer) * 2 + kv) * nt + t) * nh + h) * nd,
            _ => unreachable!(),
        }
    }
}

/// A registered engine side: per rank, its memfds and each tensor's (memfd, offset).
struct Registered {
    mems: Vec<Vec<HostMem>>,
    at: Vec<Vec<(usize, u64)>>,
    table: Vec<u32>,
    num_blocks: u64,
}

const GAP: u64 = 4096;

fn register(c: &Client, group: &str, e: Engine, tokens: u64) -> Registered {
    let n = tokens.div_ceil(e.block);
    let num_blocks = n + n / 2 + 1;
    let table: Vec<u32> = {
        // A deterministic shuffle of the pool (the engine's allocator).
        let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, (i as u64 * 7919 + e.seed) as usize % (i + 1));
        }
        ids[..n as usize].to_vec()
    };
    let (shape, role) = e.shape(num_blocks);
    let bytes = shape.iter().product::<u64>() * 2;
    let per_rank = if e.cross() { 1 } else { LAYERS };
    let (mut mems, mut at) = (Vec::new(), Vec::new());
    for rank in 0..e.tp as u32 {
        let mut descs = Vec::new();
        let mut rank_mems = Vec::new();
        let mut rank_at = Vec::new();
        if !e.memfd_per_tensor {
            rank_mems.push(HostMem::new("engine-cache", GAP + per_rank * (bytes + GAP)).unwrap());
        }
        for i in 0..per_rank {
            let (memory, offset) = if e.memfd_per_tensor {
                rank_mems.push(HostMem::new("engine-layer", bytes + GAP).unwrap());
                (rank_mems.len() - 1, GAP)
            } else {
                (0, GAP + i * (bytes + GAP))
            };
            let mut strides = vec![1u64; shape.len()];
            for k in (0..shape.len() - 1).rev() {
                strides[k] = strides[k + 1] * shape[k + 1];
            }
            let layers = if e.cross() { [0, LAYERS as u32] } else { [i as u32, i as u32 + 1] };
            descs.push(TensorDesc { memory: memory as u32, offset, dtype: "torch.bfloat16".into(), shape: shape.clone(), strides, role, layers });
            rank_at.push((memory, offset));
        }
        for m in &rank_mems {
            m.write(0, &vec![CANARY; m.len() as usize]).unwrap();
        }
        let r = RegisterTensors {
            cache: RegisterCache {
                group: group.into(),
                model: ModelSource::Toml(MODEL.into()),
                format: "bf16".into(),
                layout: e.layout(),
                rank,
                num_blocks: num_blocks as u32,
                identity: identity_of("toy-digest", "t1"),
            },
            tensors: descs,
        };
        let fds: Vec<_> = rank_mems.iter().map(|m| m.fd()).collect();
        let (regions, registered, complete) = c.register_tensors(r, &fds).unwrap();
        // One region per layer: K and V share each tensor.
        assert_eq!((regions as u64, registered), (LAYERS, per_rank * bytes));
        assert_eq!(complete, u64::from(rank) == e.tp - 1);
        mems.push(rank_mems);
        at.push(rank_at);
    }
    Registered { mems, at, table, num_blocks }
}

/// (rank, memfd, byte offset) of row (layer, kv, position, global head).
fn locate(e: Engine, r: &Registered, layer: u64, kv: u64, p: u64, head: u64) -> (usize, usize, u64) {
    let per = HEADS / e.tp;
    let rank = (head / per) as usize;
    let b = u64::from(r.table[(p / e.block) as usize]);
    let tensor = if e.cross() { 0 } else { layer as usize };
    let (mem, base) = r.at[rank][tensor];
    (rank, mem, base + e.index(r.num_blocks, layer, kv, b, p % e.block, head % per) * 2)
}

fn code(layer: u64, kv: u64, p: u64, head: u64, i: u64) -> u8 {
    let c = (layer * 131 + kv * 71 + p * 29 + head * 7 + i * 3) as u8;
    if c == CANARY {
        !CANARY
    } else {
        c
    }
}

fn rows(tokens: u64) -> impl Iterator<Item = (u64, u64, u64, u64)> {
    (0..LAYERS).flat_map(move |l| (0..2).flat_map(move |kv| (0..tokens).flat_map(move |p| (0..HEADS).map(move |h| (l, kv, p, h)))))
}

fn transfer(name: &str, src_e: Engine, dst_e: Engine, tokens: u64) {
    let dir = TempDir::new(name);
    let b = start_daemon(dir.path(), "b", SECRET, &[], "");
    let a = start_daemon(dir.path(), "a", SECRET, &[("b", &b.peer)], "");
    let ca = Client::connect(&a.socket, "prefill").unwrap();
    let cb = Client::connect(&b.socket, "decode").unwrap();
    let src = register(&ca, "prefill", src_e, tokens);
    let dst = register(&cb, "decode", dst_e, tokens);
    for (l, kv, p, h) in rows(tokens) {
        let (rank, mem, off) = locate(src_e, &src, l, kv, p, h);
        let row: Vec<u8> = (0..DIM * 2).map(|i| code(l, kv, p, h, i)).collect();
        src.mems[rank][mem].write(off, &row).unwrap();
    }
    let slot = cb.prepare(PrepareReceive { group: "decode".into(), request: "r1".into(), block_table: dst.table.clone(), tokens, prefix_tokens: 0, source: None }).unwrap();
    let sub = ca
        .submit(Submit {
            request: "p-r1".into(),
            group: "prefill".into(),
            block_table: src.table.clone(),
            tokens,
            peer: "b".into(),
            dst_group: "decode".into(),
            dst_request: "r1".into(),
            codec: None,
            stream: false,
        })
        .unwrap();
    assert_eq!(sub.bytes, LAYERS * HEADS * DIM * 2 * 2 * tokens);
    cb.wait(slot, FlagName::DecoderUsable, WAIT).unwrap();
    ca.wait(sub.slot, FlagName::SourceReleased, WAIT).unwrap();
    // Every row where the destination engine's shape says, and nothing else written.
    let mut expected: Vec<Vec<Vec<u8>>> = dst.mems.iter().map(|ms| ms.iter().map(|m| vec![CANARY; m.len() as usize]).collect()).collect();
    for (l, kv, p, h) in rows(tokens) {
        let (rank, mem, off) = locate(dst_e, &dst, l, kv, p, h);
        for i in 0..DIM * 2 {
            expected[rank][mem][(off + i) as usize] = code(l, kv, p, h, i);
        }
    }
    for (rank, ms) in dst.mems.iter().enumerate() {
        for (i, m) in ms.iter().enumerate() {
            let mut got = vec![0u8; m.len() as usize];
            m.read(0, &mut got).unwrap();
            if let Some(at) = got.iter().zip(&expected[rank][i]).position(|(g, w)| g != w) {
                panic!("{name}: destination rank {rank} memfd {i} byte {at}: {:#04x}, expected {:#04x}", got[at], expected[rank][i][at]);
            }
        }
    }
    assert_eq!(cb.status(slot).unwrap().state, TransferState::Done);
}

#[test]
fn vllm_cpu_tensors_in_a_memfd_each_reach_flashinfer_in_one_memfd_across_tp2_to_tp1() {
    let src = Engine { preset: "vllm_cpu", tp: 2, block: 16, seed: 5, memfd_per_tensor: true };
    let dst = Engine { preset: "flashinfer", tp: 1, block: 32, seed: 9, memfd_per_tensor: false };
    transfer("tensors-cpu-fi", src, dst, 75);
}

#[test]
fn vllm_cross_layer_tensor_reaches_vllm_hnd_per_layer_tensors_across_tp1_to_tp4() {
    let src = Engine { preset: "vllm_cross", tp: 1, block: 8, seed: 3, memfd_per_tensor: false };
    let dst = Engine { preset: "vllm_hnd", tp: 4, block: 16, seed: 11, memfd_per_tensor: true };
    transfer("tensors-cross-hnd", src, dst, 50);
}

#[test]
fn bad_tensor_registrations_are_refused_by_name_and_the_daemon_keeps_serving() {
    let dir = TempDir::new("tensors-bad");
    let d = start_daemon(dir.path(), "b", SECRET, &[], "");
    let c = Client::connect(&d.socket, "engine").unwrap();
    let nb = 8u64;
    let shape = vec![2, nb, 16, HEADS, DIM];
    let bytes = shape.iter().product::<u64>() * 2;
    let mem = HostMem::new("engine", LAYERS * bytes).unwrap();
    let strides = vec![nb * 16 * HEADS * DIM, 16 * HEADS * DIM, HEADS * DIM, DIM, 1];
    let good: Vec<TensorDesc> = (0..LAYERS as u32)
        .map(|l| TensorDesc { memory: 0, offset: u64::from(l) * bytes, dtype: "bf16".into(), shape: shape.clone(), strides: strides.clone(), role: Role::Kv, layers: [l, l + 1] })
        .collect();
    let req = |layout: &str, tensors: Vec<TensorDesc>| RegisterTensors {
        cache: RegisterCache {
            group: "g".into(),
            model: ModelSource::Toml(MODEL.into()),
            format: "bf16".into(),
            layout: layout.into(),
            rank: 0,
            num_blocks: nb as u32,
            identity: identity_of("toy-digest", "t1"),
        },
        tensors,
    };
    let refusal = |r: RegisterTensors| c.register_tensors(r, &[mem.fd()]).unwrap_err().to_string();
    let mut t = good.clone();
    t[2].dtype = "float32".into();
    let e = refusal(req("kv=vllm_nhd", t));
    assert!(e.contains("tensor 2 (kv of layers [2, 3)): dtype float32 (32 bits) but the cache format is bf16/v1"), "{e}");
    let mut t = good.clone();
    t[3].offset += 2;
    let e = refusal(req("kv=vllm_nhd", t));
    assert!(e.contains("tensor 3") && e.contains("past memory 0's"), "{e}");
    let mut t = good.clone();
    t[1].offset = 2;
    let e = refusal(req("kv=vllm_nhd", t));
    assert!(e.contains("overlap in memory 0"), "{e}");
    let e = refusal(req("kv=flashinfer", good.clone()));
    assert!(e.contains("shape") && e.contains("expects"), "{e}");
    let e = refusal(req("tp=1,block=16", good.clone()));
    assert!(e.contains("kv="), "{e}");
    let mut r = req("kv=vllm_nhd", good.clone());
    r.cache.identity.format = "fp32/v1".into();
    let e = refusal(r);
    assert!(e.contains("the identity's format is fp32/v1 but the cache is registered as bf16/v1"), "{e}");
    let mut r = req("kv=vllm_nhd", good.clone());
    r.cache.model = ModelSource::HfConfig("/models/llama/config.json".into());
    let e = refusal(r);
    assert!(e.contains("hf_config is not a config.json's text"), "{e}");
    // Still serving: the good list registers.
    let (regions, registered, complete) = c.register_tensors(req("kv=vllm_nhd", good), &[mem.fd()]).unwrap();
    assert_eq!((regions, registered, complete), (LAYERS as u32, LAYERS * bytes, true));
}
