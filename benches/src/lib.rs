//! Shared set-up for kvwire's benchmarks.

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
