//! Peak memory and time of one learner update (forward, fused head, GRPO-style loss, backward,
//! AdamW) of a Qwen3-shaped model with few layers, at T = 512 ... 8,192 tokens, three ways:
//! the naive attention graph, the fused attention, and fused attention with per-layer activation
//! checkpointing. Prints the peaks, the growth exponent of peak memory in T (least squares of
//! log peak on log T over 1k..8k) and the time ratios against naive.
//!
//! Each measurement runs in a fresh child process; the peak is the most heap bytes held at once
//! (a counting allocator; the model, its optimizer state from a first warm-up update and the batch
//! are excluded as the baseline).
//!
//! `cargo bench --profile test --bench attention` (`CONRUB_BENCH_T=512,1024` picks lengths;
//! `CONRUB_BENCH_ITERS` timed updates, default 1 after one warm-up).

use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::Instant;

use burn::backend::{Autodiff, Flex};
use burn::tensor::{Tensor, TensorData};
use conrub_grpo::memory::{MemoryPlan, MemoryPlanInput, ModelShape, Phase};
use conrub_grpo::{Policy, TokenBatch, Update, UpdateConfig};
use conrub_qwen3::{AttentionImpl, Execution, Qwen3Config, Qwen3ForCausalLM};

#[path = "common/peak.rs"]
mod peak;
use peak::{CURRENT, PEAK};

type A = Autodiff<Flex>;
const MODES: [&str; 3] = ["naive", "fused", "fused+ckpt"];

/// Qwen3-0.6B's head geometry (16 query heads, 8 KV heads, head_dim 128) on a narrow, 2-layer
/// body with a small vocabulary, so attention is what grows with T.
fn config() -> Qwen3Config {
    let mut c = Qwen3Config::tiny(4096);
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
        "naive" => Execution { attention: AttentionImpl::Naive, ..Default::default() },
        "fused" => Execution { attention: AttentionImpl::Fused, ..Default::default() },
        _ => Execution { attention: AttentionImpl::Fused, activation_checkpointing: true, ..Default::default() },
    }
}

fn child(mode: &str, t: usize) {
    let dev = Default::default();
    let iters: usize = std::env::var("CONRUB_BENCH_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    let mut policy = Qwen3ForCausalLM::<A>::random(&config(), 0.02, 0, &dev).with_execution(exec(mode));
    let prompt: Vec<u32> = (0..16).map(|i| (i * 131 % 4096) as u32).collect();
    let response: Vec<u32> = (0..t - 16).map(|i| ((i * 7919 + 3) % 4096) as u32).collect();
    let tf = TokenBatch::<A>::new(std::iter::once((prompt.as_slice(), response.as_slice())), &dev);
    let mut update = Update::<A, Qwen3ForCausalLM<A>>::new(UpdateConfig { lr: 3e-6, weight_decay: 0.1, beta1: 0.9, beta2: 0.999, eps: 1e-8, max_grad_norm: 1.0 });
    let weight = Tensor::<A, 2>::from_data(TensorData::new(vec![-1.0f32 / (t - 16) as f32; t - 16], [1, t - 16]), &dev);
    let mut step = |policy: Qwen3ForCausalLM<A>| {
        let start = Instant::now();
        let grads = policy.loss_gradients(&tf, &mut |lp| (lp.logprobs * weight.clone()).sum());
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
    println!("RESULT {} {}", times[times.len() / 2], PEAK.load(Ordering::Relaxed).saturating_sub(base));
}

/// `conrub plan`'s prediction of the same peak (what a training step allocates beyond the weights
/// and the AdamW moments: gradients, then the larger of a micro-batch and the optimizer step).
fn predicted(mode: &str, t: usize) -> Option<f64> {
    if mode == "naive" {
        return None; // the plan models the fused attention only
    }
    let mut input = MemoryPlanInput::new(ModelShape::from_config(&config()));
    input.activation_checkpointing = mode == "fused+ckpt";
    input.micro_batch_tokens = t;
    input.max_prompt_tokens = 16;
    input.max_response_tokens = t - 16;
    input.group_size = 1;
    input.prompts_per_step = 1;
    input.rollout_prompts_per_call = 1;
    let plan = MemoryPlan::new(input);
    let sum = |p: Phase| plan.parts.iter().filter(|x| x.phase == p).map(|x| x.bytes).sum::<f64>();
    Some(sum(Phase::Training) + sum(Phase::MicroBatch).max(sum(Phase::OptimizerStep)))
}

fn run_child(mode: &str, t: usize) -> Result<(f64, u64), String> {
    let out = Command::new(std::env::current_exe().unwrap()).args(["--child", mode, &t.to_string()]).output().map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find(|l| l.starts_with("RESULT ")).ok_or_else(|| format!("failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("")))?;
    let f: Vec<&str> = line.split_whitespace().collect();
    Ok((f[1].parse().unwrap(), f[2].parse().unwrap()))
}

/// Least-squares slope of ln(peak) on ln(T).
fn exponent(points: &[(usize, u64)]) -> f64 {
    let xs: Vec<f64> = points.iter().map(|p| (p.0 as f64).ln()).collect();
    let ys: Vec<f64> = points.iter().map(|p| (p.1.max(1) as f64).ln()).collect();
    let (mx, my) = (xs.iter().sum::<f64>() / xs.len() as f64, ys.iter().sum::<f64>() / ys.len() as f64);
    let num: f64 = xs.iter().zip(&ys).map(|(x, y)| (x - mx) * (y - my)).sum();
    let den: f64 = xs.iter().map(|x| (x - mx).powi(2)).sum();
    num / den
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--child") {
        child(&args[i + 1], args[i + 2].parse().unwrap());
        return;
    }
    if args.iter().any(|a| a == "--list") {
        return;
    }
    let ts: Vec<usize> = std::env::var("CONRUB_BENCH_T")
        .ok()
        .map(|v| v.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![512, 1024, 2048, 4096, 8192]);
    let c = config();
    println!(
        "one update of a Qwen3-shaped model (hidden {}, {} layers, {} heads / {} KV heads x {}, vocab {}), 1 sequence, flex CPU",
        c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads(), c.head_dim(), c.vocab_size
    );
    println!("{:<11} {:>6} {:>9} {:>12} {:>12} {:>12}", "mode", "T", "seconds", "peak MB", "plan MB", "plan/peak");
    let mut results: Vec<Vec<Option<(f64, u64)>>> = vec![Vec::new(); MODES.len()];
    for &t in &ts {
        for (m, mode) in MODES.iter().enumerate() {
            let r = run_child(mode, t);
            match &r {
                Ok((s, p)) => {
                    let (plan, ratio) = match predicted(mode, t) {
                        Some(b) => (format!("{:.1}", b / 1e6), format!("{:.2}", b / *p as f64)),
                        None => ("-".into(), "-".into()),
                    };
                    println!("{mode:<11} {t:>6} {s:>9.3} {:>12.1} {plan:>12} {ratio:>12}", *p as f64 / 1e6)
                }
                Err(e) => println!("{mode:<11} {t:>6} {e}"),
            }
            results[m].push(r.ok());
        }
    }
    for (m, mode) in MODES.iter().enumerate() {
        let pts: Vec<(usize, u64)> = ts.iter().zip(&results[m]).filter(|(t, _)| **t >= 1024).filter_map(|(t, r)| r.map(|r| (*t, r.1))).collect();
        if pts.len() >= 2 {
            println!("{mode:<11} peak memory grows as T^{:.2} (T >= 1024)", exponent(&pts));
        }
    }
    for (i, &t) in ts.iter().enumerate() {
        if let Some((naive, _)) = results[0][i] {
            let ratio = |m: usize| results[m][i].map(|r| format!("{:.2}x", r.0 / naive)).unwrap_or_else(|| "-".into());
            println!("T = {t:>5}: time vs naive: fused {}, fused+ckpt {}", ratio(1), ratio(2));
        }
    }
}
