//! Planning speed for the reference cases. Each case prints its
//! segment and write counts once, so a faster plan that is worse for the
//! data plane shows up next to the timing.

use criterion::{criterion_group, criterion_main, Criterion};
use kvwire_bench::PlanCase;
use std::hint::black_box;

fn cases() -> Vec<PlanCase> {
    vec![
        PlanCase::new("llama-3.1-70b", 131_072, "tp=8", "tp=2"),
        PlanCase::new("llama-3.1-70b", 131_072, "tp=8,layout=nhd,block=16", "tp=2,layout=hnd,block=32"),
        PlanCase::new("llama-3.1-70b", 131_072, "tp=8,table=shuffle", "tp=2,table=shuffle:7"),
    ]
}

fn bench_plan(c: &mut Criterion) {
    let mut group = c.benchmark_group("plan");
    group.sample_size(10);
    for case in cases() {
        let plan = case.plan();
        let k = &plan.counters;
        println!(
            "{}: segments {} writes {} bytes {} packed {}",
            case.name, k.segments, k.writes, k.total_bytes_moved, k.packed_bytes
        );
        group.bench_function(&case.name, |b| b.iter(|| black_box(case.plan())));
    }
    group.finish();
}

criterion_group!(benches, bench_plan);
criterion_main!(benches);
