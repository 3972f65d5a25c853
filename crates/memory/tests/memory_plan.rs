//! `conrub plan`'s formulas against peaks measured on the CPU: one learner update (forward, fused
//! head, loss, backward, AdamW) of a Qwen3-shaped model at 512 and 1,024 tokens (2,048, 4,096 and
//! 8,192 are in `benches/attention.rs`, too slow for a test on 2 cores), with fused attention,
//! with and without per-layer activation checkpointing, and at 512 tokens with two micro-batches
//! whose gradients are summed before the step. The measured peak is the most heap held at once
//! beyond the weights and AdamW moments (a counting allocator); the plan's is its training peak
//! less what it allocates for the whole run. They must agree within 15%.

#[path = "../../../benches/common/attention_update.rs"]
#[allow(dead_code)]
mod attention_update;
#[path = "../../../benches/common/peak.rs"]
mod peak;

#[test]
fn the_memory_plan_predicts_measured_cpu_peaks_within_15_percent() {
    let mut failures = Vec::new();
    for (t, micro_batches) in [(512, 1), (512, 2), (1024, 1)] {
        for mode in ["fused", "fused+ckpt"] {
            let (_, measured) = attention_update::measure(mode, t, 1, micro_batches);
            let plan = attention_update::predicted(mode, t, micro_batches)
                .expect("the plan models fused attention");
            let ratio = plan / measured as f64;
            let line = format!(
                "{mode} T={t} micro-batches={micro_batches}: measured {:.1} MB, plan {:.1} MB, plan/measured {ratio:.3}",
                measured as f64 / 1e6,
                plan / 1e6
            );
            println!("{line}");
            if !(0.85..=1.15).contains(&ratio) {
                failures.push(line);
            }
        }
    }
    assert!(failures.is_empty(), "outside 15%:\n{}", failures.join("\n"));
}
