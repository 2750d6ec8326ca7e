//! The real `kvwire` binary: output shapes, figures, and exit status 2 with a
//! one-line error for bad input.

use crate::kvwire;
use serde_json::Value;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

fn stdout_json(args: &[&str]) -> Value {
    let out = kvwire(args);
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{args:?}: not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

/// Exit 2, exactly one stderr line containing every `needle`, no panic.
fn assert_bad_input(args: &[&str], needles: &[&str]) {
    let out = kvwire(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: status {:?}, stderr: {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{args:?} panicked: {stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: not one line: {stderr}");
    for needle in needles {
        assert!(stderr.contains(needle), "{args:?}: stderr lacks `{needle}`: {stderr}");
    }
}

/// A file under the temp dir, unique per process and call, removed on drop.
struct TempFile(PathBuf);

impl TempFile {
    fn new(ext: &str, text: &str) -> TempFile {
        static N: AtomicU32 = AtomicU32::new(0);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
        let name = format!("kvwire-cli-{}-{}-{nanos}.{ext}", std::process::id(), N.fetch_add(1, Ordering::Relaxed));
        let path = std::env::temp_dir().join(name);
        std::fs::write(&path, text).unwrap();
        TempFile(path)
    }

    fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

const LLAMA_8B: &str = include_str!("../../../../config/models/llama-3.1-8b.json");

/// The llama-3.1-8b config with `key` removed or replaced.
fn llama_config_with(key: &str, value: Option<Value>) -> TempFile {
    let mut root: serde_json::Map<String, Value> = serde_json::from_str(LLAMA_8B).unwrap();
    match value {
        Some(v) => root.insert(key.to_string(), v),
        None => root.remove(key),
    };
    TempFile::new("json", &serde_json::to_string(&root).unwrap())
}

#[test]
fn inventory_json_llama_8b() {
    let v = stdout_json(&["inventory", "--model", "llama-3.1-8b", "--tokens", "4096", "--json"]);
    let per_token = 32u64 /*layers*/ * 8 /*kv heads*/ * 128 /*head_dim*/ * 2 /*K,V*/ * 2 /*bf16*/;
    assert_eq!(v["format"], "bf16/v1");
    assert_eq!(v["tokens"], 4096);
    assert_eq!(v["payload_bytes"], per_token * 4096);
    assert_eq!(v["allocated_bytes"], per_token * 4096);
    assert_eq!(v["per_token_bytes"], per_token);
    assert!(v.get("wire_bytes").is_some_and(Value::is_null), "{v}");
    let layers = v["per_layer"].as_array().unwrap();
    assert_eq!(layers.len(), 32);
    for key in ["layer", "kind", "retained_tokens", "payload_bytes", "allocated_bytes"] {
        assert!(layers[0].get(key).is_some(), "per_layer[0] lacks {key}: {}", layers[0]);
    }
}

#[test]
fn inventory_json_partial_block_and_format_flag() {
    let v = stdout_json(&[
        "inventory", "--model", "llama-3.1-8b", "--tokens", "1000", "--format", "fp8_e4m3_pth/v1", "--json",
    ]);
    let row = 128 /*fp8*/ + 4 /*f32 scale*/;
    assert_eq!(v["format"], "fp8_e4m3_pth/v1");
    assert_eq!(v["payload_bytes"], 32 * 8 * 2 * row * 1000);
    // 1000 tokens in 16-token blocks: 63 blocks.
    assert_eq!(v["allocated_bytes"], 32 * 8 * 2 * row * 63 * 16);
}

#[test]
fn inventory_default_format_is_the_config_dtype() {
    // gemma-2-9b declares float32.
    let v = stdout_json(&["inventory", "--model", "gemma-2-9b", "--tokens", "2000", "--json"]);
    assert_eq!(v["format"], "fp32/v1");
    assert_eq!(v["payload_bytes"], 42u64 * 8 * 256 * 2 * 4 * 2000);
    // deepseek-v3's fp8 weight quantization leaves the cache in bf16.
    let v = stdout_json(&["inventory", "--model", "deepseek-v3", "--tokens", "10", "--json"]);
    assert_eq!(v["format"], "bf16/v1");
    assert_eq!(v["payload_bytes"], 61 * (512 + 64) * 2 * 10);
}

#[test]
fn inventory_table_has_a_total_row() {
    let out = kvwire(&["inventory", "--model", "llama-3.1-8b", "--tokens", "4096"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let total = text.lines().find(|l| l.starts_with("total")).unwrap_or_else(|| panic!("no total row:\n{text}"));
    assert!(total.contains(&(32u64 * 8 * 128 * 2 * 2 * 4096).to_string()), "{total}");
    assert!(text.lines().any(|l| l.starts_with("full")), "{text}");
}

#[test]
fn inventory_reads_a_toml_spec() {
    let spec = TempFile::new(
        "toml",
        "[[layers]]\nrepeat = 2\nattention = \"dense\"\nkv_heads = 2\nhead_dim = 64\n\
         [[layers]]\nattention = \"none\"\nstate_bytes = 1000\n",
    );
    let v = stdout_json(&["inventory", "--model", spec.path(), "--tokens", "16", "--format", "bf16", "--json"]);
    assert_eq!(v["payload_bytes"], 2 /*layers*/ * 2 /*heads*/ * 64 * 2 /*K,V*/ * 2 * 16 + 1000 /*state*/);
}

#[test]
fn bad_input_unknown_model() {
    assert_bad_input(&["inventory", "--model", "no-such-model", "--tokens", "1"], &["no-such-model", "model"]);
}

#[test]
fn bad_input_missing_file() {
    let path = std::env::temp_dir().join(format!("kvwire-cli-absent-{}.json", std::process::id()));
    let path = path.to_str().unwrap();
    assert_bad_input(&["inventory", "--model", path, "--tokens", "1"], &[path]);
}

#[test]
fn bad_input_config_missing_field() {
    let cfg = llama_config_with("num_hidden_layers", None);
    assert_bad_input(&["inventory", "--model", cfg.path(), "--tokens", "1"], &["num_hidden_layers"]);
}

#[test]
fn bad_input_config_zero_heads() {
    let cfg = llama_config_with("num_key_value_heads", Some(Value::from(0)));
    assert_bad_input(&["inventory", "--model", cfg.path(), "--tokens", "1"], &["num_key_value_heads"]);
}

#[test]
fn bad_input_config_heads_do_not_divide() {
    let cfg = llama_config_with("num_attention_heads", Some(Value::from(24)));
    assert_bad_input(&["inventory", "--model", cfg.path(), "--tokens", "1"], &["head_dim", "hidden_size"]);
}

#[test]
fn bad_input_config_unknown_model_type() {
    let cfg = llama_config_with("model_type", Some(Value::from("mamba")));
    assert_bad_input(&["inventory", "--model", cfg.path(), "--tokens", "1"], &["model_type", "mamba"]);
}

#[test]
fn bad_input_invalid_json() {
    let cfg = TempFile::new("json", "{\"model_type\": ");
    assert_bad_input(&["inventory", "--model", cfg.path(), "--tokens", "1"], &["config.json"]);
}

#[test]
fn bad_input_toml_unknown_field() {
    let spec = TempFile::new("toml", "[[layers]]\nattention = \"dense\"\nkv_heads = 1\nhead_dim = 8\nwindwo = 4\n");
    assert_bad_input(&["inventory", "--model", spec.path(), "--tokens", "1", "--format", "bf16"], &["windwo"]);
}

#[test]
fn bad_input_zero_tokens() {
    assert_bad_input(&["inventory", "--model", "llama-3.1-8b", "--tokens", "0"], &["tokens"]);
}

#[test]
fn bad_input_unknown_format() {
    assert_bad_input(
        &["inventory", "--model", "llama-3.1-8b", "--tokens", "1", "--format", "nonsense"],
        &["format", "nonsense"],
    );
    assert_bad_input(
        &["inventory", "--model", "llama-3.1-8b", "--tokens", "1", "--format", "bf16/v9"],
        &["format", "v9"],
    );
}

#[test]
fn bad_input_zero_block_size() {
    assert_bad_input(&["inventory", "--model", "llama-3.1-8b", "--tokens", "1", "--block-size", "0"], &["block_size"]);
}

#[test]
fn bad_input_spec_without_dtype_asks_for_format() {
    let spec = TempFile::new("toml", "[[layers]]\nattention = \"dense\"\nkv_heads = 1\nhead_dim = 8\n");
    assert_bad_input(&["inventory", "--model", spec.path(), "--tokens", "1"], &["--format"]);
}

#[test]
fn bad_input_huge_token_count() {
    assert_bad_input(&["inventory", "--model", "llama-3.1-8b", "--tokens", "18446744073709551615"], &["tokens"]);
}

#[test]
fn plan_tp8_to_tp2_moves_every_byte_once() {
    let v = stdout_json(&[
        "plan", "--model", "llama-3.1-8b", "--tokens", "100", "--src", "tp=8", "--dst", "tp=2", "--verify", "--json",
    ]);
    assert_eq!(v["total_bytes_moved"], 32u64 /*layers*/ * 8 /*kv heads*/ * 128 * 2 /*K,V*/ * 2 /*bf16*/ * 100);
    assert!(v["verified"].is_object(), "{v}");
}

/// The README's `plan --verify` shape (deepseek-v3, TP8 -> TP4 x PP2)
/// verifies within a buffer budget far below the whole cache: one layer's
/// tensor at a time. A budget below one such step is bad input, by name.
#[test]
fn plan_verify_streams_within_a_fixed_memory_budget() {
    let args = ["plan", "--model", "deepseek-v3", "--tokens", "512", "--src", "tp=8", "--dst", "tp=4,pp=2", "--verify", "--json"];
    let v = stdout_json(&[&args[..], &["--verify-limit-mib", "16"]].concat());
    let r = &v["verified"];
    // The MLA latent is replicated on every TP rank: each of the 4 TP ranks
    // of each stage receives its stage's layers whole, 61 layers in all.
    // deepseek-v3 latent: (512 + 64) bf16 elements = 1152 bytes per token.
    assert_eq!(v["total_bytes_moved"], 4u64 * 61 * 1152 * 512, "{v}");
    assert_eq!(r["bytes_copied"], v["total_bytes_moved"], "{v}");
    assert_eq!(r["bytes_expected"], v["total_bytes_moved"], "{v}");
    // Every destination byte was checked: far more than the 16 MiB held at once.
    assert!(r["bytes_checked"].as_u64().unwrap() > 16 << 20, "{v}");
    assert_bad_input(&[&args[..], &["--verify-limit-mib", "1"]].concat(), &["at once", "allowed"]);
}

#[test]
fn plan_bad_tp_names_tp_and_kv_heads() {
    let out = kvwire(&["plan", "--model", "llama-3.1-8b", "--tokens", "100", "--src", "tp=3", "--dst", "tp=2"]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("tp=3") && stderr.contains("8 KV heads"), "{stderr}");
}

fn sysfs_fixture(name: &str) -> String {
    format!("{}/tests/fixtures/sysfs/{name}", env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn topology_bad_file_names_the_missing_device_and_what_exists() {
    let dgx = sysfs_fixture("dgx-h100");
    let file = TempFile::new("toml", "[[rail]]\ndevice = \"mlx5_0\"\n[[rail]]\ndevice = \"mlx5_8\"\n");
    assert_bad_input(
        &["topology", "--sysfs", &dgx, "--file", file.path()],
        &[file.path(), "rail[1].device", "`mlx5_8`", "mlx5_0, mlx5_1, mlx5_2, mlx5_3, mlx5_4, mlx5_5, mlx5_6, mlx5_7", "eth0"],
    );
    let typo = TempFile::new("toml", "[[rail]]\ndevice = \"mlx5_0\"\ngpu = [\"0000:18:00.0\"]\n");
    assert_bad_input(&["topology", "--sysfs", &dgx, "--file", typo.path()], &["line 3", "unknown field `gpu`"]);
    assert_bad_input(&["topology", "--sysfs", &dgx, "--rail", "mlx5_9"], &["--rail mlx5_9", "mlx5_7"]);
    assert_bad_input(&["topology", "--sysfs", "/nonexistent-sysfs-root"], &["no sysfs under /nonexistent-sysfs-root"]);
}

#[test]
fn topology_json_ranks_rails_for_every_gpu_and_node() {
    let file = TempFile::new("toml", "[[rail]]\ndevice = \"mlx5_0\"\n[[rail]]\nname = \"pinned\"\ndevice = \"mlx5_3\"\ngpus = [\"0000:18:00.0\"]\n");
    let v = stdout_json(&["topology", "--sysfs", &sysfs_fixture("dgx-h100"), "--file", file.path(), "--json"]);
    assert_eq!(v["devices"].as_array().unwrap().len(), 8 + 10 + 8, "{v}");
    assert_eq!(v["rails"], serde_json::json!(["mlx5_0", "pinned"]));
    assert_eq!(v["rails_from"], "topology file");
    let prefs = v["preferences"].as_array().unwrap();
    assert_eq!(prefs.len(), 8 + 2, "8 GPUs, 2 NUMA nodes");
    assert_eq!(prefs[0]["memory"], serde_json::json!({"gpu": {"pci": "0000:18:00.0"}}));
    let order = |p: &Value| p["rails"].as_array().unwrap().iter().map(|r| (r["rail"].as_str().unwrap().to_string(), r["locality"].as_str().unwrap().to_string(), r["score"].as_u64().unwrap())).collect::<Vec<_>>();
    let s = |r: &str, l: &str, n| (r.to_string(), l.to_string(), n);
    assert_eq!(order(&prefs[0]), [s("pinned", "pinned", 0), s("mlx5_0", "same_pcie_switch", 10)]);
    assert_eq!(order(&prefs[3]), [s("pinned", "same_pcie_switch", 10), s("mlx5_0", "same_numa", 30)]);
    assert_eq!(prefs[9]["memory"], serde_json::json!({"host": {"numa": 1}}));
    assert_eq!(order(&prefs[9]), [s("mlx5_0", "other_numa", 50), s("pinned", "other_numa", 50)]);
}
