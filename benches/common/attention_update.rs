//! One learner update of a Qwen3-shaped model at T tokens and its peak heap, and what
//! `conrub plan` predicts for it: shared by `benches/attention.rs` and
//! `crates/memory/tests/memory_plan.rs` (included with `#[path]`; the including binary installs
//! `peak::Counting` as its global allocator).

use std::sync::atomic::Ordering;
use std::time::Instant;

use burn::backend::{Autodiff, Flex};
use burn::optim::GradientsAccumulator;
use burn::tensor::{Tensor, TensorData};
use conrub_grpo::{TokenBatch, Update, UpdateConfig};
use conrub_memory::{MemoryPlan, MemoryPlanInput, Phase};
use conrub_models::{AttentionImpl, CausalLm, Execution, ModelConfig};

use super::peak::{CURRENT, PEAK};

type A = Autodiff<Flex>;
/// The three ways of running attention that the bench compares.
pub const MODES: [&str; 3] = ["naive", "fused", "fused+ckpt"];

/// Qwen3-0.6B's head geometry (16 query heads, 8 KV heads, head_dim 128) on a narrow, 2-layer
/// body with a small vocabulary, so attention is what grows with T.
pub fn config() -> ModelConfig {
    let mut c = ModelConfig::tiny(4096);
    c.hidden_size = 256;
    c.intermediate_size = 768;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 16;
    c.num_key_value_heads = Some(8);
    c.head_dim = Some(128);
    c
}

fn exec(mode: &str) -> Execution {
    match mode {
        "naive" => Execution {
            attention: AttentionImpl::Naive,
            ..Default::default()
        },
        "fused" => Execution {
            attention: AttentionImpl::Fused,
            ..Default::default()
        },
        _ => Execution {
            attention: AttentionImpl::Fused,
            activation_checkpointing: true,
            ..Default::default()
        },
    }
}

/// Median seconds and peak heap bytes of `iters` updates after one warm-up update (whose
/// allocations, the AdamW moments among them, are the baseline). Each update sums the gradients
/// of `micro_batches` one-row micro-batches (as the learner does) before its AdamW step.
pub fn measure(mode: &str, t: usize, iters: usize, micro_batches: usize) -> (f64, u64) {
    let dev = Default::default();
    let mut policy = CausalLm::<A>::random(&config(), 0.02, 0, &dev).with_execution(exec(mode));
    let prompt: Vec<u32> = (0..16).map(|i| (i * 131 % 4096) as u32).collect();
    let response: Vec<u32> = (0..t - 16)
        .map(|i| ((i * 7919 + 3) % 4096) as u32)
        .collect();
    let tf = TokenBatch::<A>::new(
        std::iter::once((prompt.as_slice(), response.as_slice())),
        &dev,
    );
    let mut update = Update::<A, CausalLm<A>>::new(UpdateConfig::recipe());
    let weight = Tensor::<A, 2>::from_data(
        TensorData::new(vec![-1.0f32 / (t - 16) as f32; t - 16], [1, t - 16]),
        &dev,
    );
    let mut step = |policy: CausalLm<A>| {
        let start = Instant::now();
        let mut loss = |lp: conrub_grpo::ResponseLogprobs<A>| (lp.logprobs * weight.clone()).sum();
        let grads = if micro_batches <= 1 {
            conrub_contracts::loss_gradients(&policy, &tf, &mut loss).expect("the whole set")
        } else {
            let mut acc = GradientsAccumulator::new();
            for _ in 0..micro_batches {
                acc.accumulate(
                    &policy,
                    conrub_contracts::loss_gradients(&policy, &tf, &mut loss)
                        .expect("the whole set"),
                );
            }
            acc.grads()
        };
        let (next, norm) = update.apply(policy, grads);
        let _ = norm.into_scalar();
        (next, start.elapsed().as_secs_f64())
    };
    // Warm-up: also allocates the AdamW moments, which then belong to the baseline.
    policy = step(policy).0;
    let base = CURRENT.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let mut times = Vec::new();
    for _ in 0..iters.max(1) {
        let (next, secs) = step(policy);
        policy = next;
        times.push(secs);
    }
    times.sort_by(f64::total_cmp);
    (
        times[times.len() / 2],
        PEAK.load(Ordering::Relaxed).saturating_sub(base) as u64,
    )
}

/// `conrub plan`'s prediction of the same peak: its training peak less what is allocated for the
/// whole run (weights, AdamW moments, the runtime reserve).
pub fn predicted(mode: &str, t: usize, micro_batches: usize) -> Option<f64> {
    if mode == "naive" {
        return None; // the plan models the fused attention only
    }
    let mut input = MemoryPlanInput::new(config().shape());
    input.activation_checkpointing = mode == "fused+ckpt";
    input.micro_batch_tokens = t;
    input.max_prompt_tokens = 16;
    input.max_response_tokens = t - 16;
    input.group_size = 1;
    input.prompts_per_step = micro_batches.max(1);
    input.rollout_prompts_per_call = 1;
    let plan = MemoryPlan::new(input);
    let always = plan
        .parts
        .iter()
        .filter(|x| x.phase == Phase::Always)
        .map(|x| x.bytes)
        .sum::<f64>();
    Some(plan.training_peak - always)
}
