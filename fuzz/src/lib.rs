//! Shared checks for kvwire's fuzz targets: what every decoded model, layout
//! and manifest must satisfy, whatever bytes it came from. A target calls
//! these after its decoder accepts an input; any panic here or in the code
//! under test is a finding.

use kvwire_core::format::FORMATS;
use kvwire_core::layout::{inventory, Geometry, ModelSpec, MAX_BLOCK_SIZE, MAX_TOKENS};
use kvwire_core::manifest::layer_shapes;
use kvwire_core::shard::ShardMap;

/// Token counts every model is counted at: the edges of what kvwire accepts
/// (0 and past [`MAX_TOKENS`] must be refused, not panic), a few ordinary
/// lengths, and block-boundary neighbours.
pub const TOKENS: &[u64] = &[0, 1, 15, 16, 17, 4096, 131_073, 1 << 30, MAX_TOKENS, MAX_TOKENS + 1, u64::MAX];

/// Counts `model` at every [`TOKENS`] length in every format at three block
/// sizes; checks what the inventory claims about itself.
pub fn exercise_model(model: &ModelSpec) {
    model.validate().expect("a model a decoder accepted must validate");
    for &format in FORMATS {
        for block in [1, 16, MAX_BLOCK_SIZE] {
            let geo = Geometry::new(format, block).expect("block sizes within the limits");
            for &tokens in TOKENS {
                check_inventory(model, &geo, tokens);
            }
        }
    }
    for tokens in [1, 17, 4096] {
        let shapes = layer_shapes(model, tokens);
        assert_eq!(shapes.len(), model.layers.len(), "one layer shape per layer");
    }
}

fn check_inventory(model: &ModelSpec, geo: &Geometry, tokens: u64) {
    let Ok(inv) = inventory(model, geo, tokens) else {
        return;
    };
    assert!(tokens > 0 && tokens <= MAX_TOKENS, "inventory accepted {tokens} tokens");
    assert_eq!(inv.tokens, tokens);
    assert_eq!(inv.per_layer.len(), model.layers.len());
    // Totals are the sums of the rows (recomputed here, in u128).
    let payload: u128 = inv.per_layer.iter().map(|l| u128::from(l.payload_bytes)).sum();
    let allocated: u128 = inv.per_layer.iter().map(|l| u128::from(l.allocated_bytes)).sum();
    assert_eq!(payload, u128::from(inv.payload_bytes));
    assert_eq!(allocated, u128::from(inv.allocated_bytes));
    let grouped: u64 = inv.kinds.iter().map(|k| u64::from(k.layers)).sum();
    assert_eq!(grouped, model.layers.len() as u64, "every layer in exactly one kind row");
    for l in &inv.per_layer {
        assert!(l.retained_tokens <= tokens, "layer {} retains {} of {tokens} tokens", l.layer, l.retained_tokens);
    }
}

/// Checks a resolved shard map against its model: ranks numbered in order,
/// layers in range and increasing, heads within the layer's tensors.
pub fn check_shard_map(model: &ModelSpec, map: &ShardMap) {
    for (i, r) in map.ranks.iter().enumerate() {
        assert_eq!(r.rank as usize, i, "ranks indexed by number");
        assert!(r.layers.windows(2).all(|w| w[0].layer < w[1].layer), "rank {i}: layers increasing");
        for l in &r.layers {
            let spec = model.layers.get(l.layer as usize).expect("held layer exists");
            let rows = spec.tensors().first().map_or(0, |t| t.heads);
            assert!(l.heads.end <= rows, "rank {i} layer {}: heads {:?} past {rows}", l.layer, l.heads);
        }
    }
}
