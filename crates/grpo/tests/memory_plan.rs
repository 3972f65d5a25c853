//! `conrub plan`'s formulas against peaks measured on the CPU: one learner update (forward, fused
//! head, loss, backward, AdamW) of a Qwen3-shaped model at 2,048 tokens (4,096 and 8,192 are in
//! `benches/attention.rs`, too slow for a test on 2 cores), with fused
//! attention, with and without per-layer activation checkpointing. The measured peak is the most
//! heap held at once beyond the weights and AdamW moments (a counting allocator); the plan's is
//! its gradients plus the larger of a micro-batch and the optimizer step. They must agree within
//! 15%.

#[path = "../../../benches/common/peak.rs"]
mod peak;
#[path = "../../../benches/common/attention_update.rs"]
#[allow(dead_code)]
mod attention_update;

#[test]
fn the_memory_plan_predicts_measured_cpu_peaks_within_15_percent() {
    for t in [2048] {
        for mode in ["fused", "fused+ckpt"] {
            let (_, measured) = attention_update::measure(mode, t, 1);
            let plan = attention_update::predicted(mode, t).expect("the plan models fused attention");
            let ratio = plan / measured as f64;
            println!("{mode} T={t}: measured {:.1} MB, plan {:.1} MB, plan/measured {ratio:.3}", measured as f64 / 1e6, plan / 1e6);
            assert!((0.85..=1.15).contains(&ratio), "{mode} at {t} tokens: plan/measured = {ratio:.3}");
        }
    }
}
