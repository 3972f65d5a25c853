//! Rollout throughput and memory: the rollout engine (`conrub_rollout::rollout`: paged KV pool,
//! continuous batching, shared prompts, sampling on the device) against the static-batch schedule
//! over the same paged pass (`conrub_rollout::generate_static`: one static batch, every row's
//! longest sequence reserved up front, every prompt prefilled per row, `[rows, vocab]` logits
//! copied to the host each step), same weights, same prompts, in the same run.
//!
//! Workload: 64 rows (8 prompts x 8 responses) x 256 new tokens, no stop token, temperature 1, on
//! the CPU demo model (random Qwen3, hidden 64, 2 layers, the full 151,936-token vocabulary).
//! Printed per engine: tokens/s, peak heap beyond the weights (a counting allocator), host bytes
//! read per decode step, and the KV memory curve: the engine's blocks in use against the static
//! schedule's reservation (`rows x (prompt + new tokens)`, in blocks) at the same steps. With `--features wgpu` and an adapter the
//! same comparison runs on wgpu (lavapipe in CI) at 64 rows x 32 tokens and vocabulary 4,096 (its
//! heap column is host memory only).
//!
//! `cargo bench --profile test --bench rollout` (`CONRUB_BENCH_TOKENS=N` new tokens per row).

use std::sync::atomic::Ordering;
use std::time::Instant;

use conrub_kernels::KernelOps;
use conrub_models::{CausalLm, ModelConfig};
use conrub_rollout::{generate_static, rollout, EngineConfig, SamplingConfig, DEFAULT_BLOCK_SIZE};

#[path = "common/peak.rs"]
mod peak;
use peak::{CURRENT, PEAK};

const PROMPTS: usize = 8;
const GROUP: usize = 8;
const PROMPT_LEN: usize = 40;

fn demo_config(vocab: usize) -> ModelConfig {
    let mut c = ModelConfig::tiny(vocab);
    c.num_key_value_heads = Some(2);
    c.head_dim = Some(16);
    c
}

struct Measured {
    secs: f64,
    peak_bytes: u64,
    host_bytes_per_step: f64,
    /// Per decode step: KV bytes held.
    kv_curve: Vec<f64>,
    tokens: usize,
}

fn measure<B: KernelOps>(
    name: &str,
    vocab: usize,
    new_tokens: usize,
    device: &B::Device,
) -> (Measured, Measured) {
    let cfg = demo_config(vocab);
    let model = CausalLm::<B>::random(&cfg, 0.02, 0, device);
    let prompts: Vec<Vec<u32>> = (0..PROMPTS)
        .flat_map(|p| {
            let ids: Vec<u32> = (0..PROMPT_LEN)
                .map(|t| ((p * 7919 + t * 104_729) % (vocab - 1)) as u32)
                .collect();
            std::iter::repeat_n(ids, GROUP)
        })
        .collect();
    let rows = prompts.len();
    let sampling = SamplingConfig {
        max_new_tokens: new_tokens,
        seed: 1,
        ..Default::default()
    };
    let per_pos =
        (cfg.num_hidden_layers * 2 * cfg.num_key_value_heads() * cfg.head_dim() * 4) as f64;

    // Warm-up (allocator pools, autotune) on a short run of each.
    let short = SamplingConfig {
        max_new_tokens: 2,
        ..sampling.clone()
    };
    let _ = generate_static(&model, &prompts, &short, device).unwrap();
    let _ = rollout(&model, &prompts, &short, &EngineConfig::default(), device).unwrap();

    let base = CURRENT.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let t0 = Instant::now();
    let baseline = generate_static(&model, &prompts, &sampling, device).unwrap();
    let baseline_secs = t0.elapsed().as_secs_f64();
    let baseline_peak = PEAK.load(Ordering::Relaxed).saturating_sub(base) as u64;
    // The static schedule reserves every row's longest sequence, in whole blocks, from the start.
    let cap = (PROMPT_LEN + new_tokens).next_multiple_of(DEFAULT_BLOCK_SIZE);
    let baseline_curve: Vec<f64> = (0..new_tokens.saturating_sub(1))
        .map(|_| (rows * cap) as f64 * per_pos)
        .collect();
    let baseline_m = Measured {
        secs: baseline_secs,
        peak_bytes: baseline_peak,
        host_bytes_per_step: (rows * vocab * 4) as f64,
        kv_curve: baseline_curve,
        tokens: baseline.iter().map(|g| g.tokens.len()).sum(),
    };

    let base = CURRENT.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let t0 = Instant::now();
    let out = rollout(
        &model,
        &prompts,
        &sampling,
        &EngineConfig::default(),
        device,
    )
    .unwrap();
    let engine_secs = t0.elapsed().as_secs_f64();
    let engine_peak = PEAK.load(Ordering::Relaxed).saturating_sub(base) as u64;
    let s = &out.stats;
    let block_bytes = s.block_size as f64 * per_pos;
    let engine_m = Measured {
        secs: engine_secs,
        peak_bytes: engine_peak,
        host_bytes_per_step: s.host_bytes_read as f64 / (s.decode_steps + 1) as f64,
        kv_curve: s
            .steps
            .iter()
            .map(|&(_, blocks)| blocks as f64 * block_bytes)
            .collect(),
        tokens: out.generations.iter().map(|g| g.tokens.len()).sum(),
    };
    println!(
        "[{name}] engine: {} prompt prefills ({} tokens) for {} rows, {} decode steps, pool {} blocks of {} ({:.2} MB), peak {} blocks",
        s.prompt_prefills,
        s.prefill_tokens,
        s.sequences,
        s.decode_steps,
        s.kv_blocks,
        s.block_size,
        s.kv_pool_bytes as f64 / 1e6,
        s.peak_kv_blocks
    );
    (baseline_m, engine_m)
}

fn report(name: &str, rows: usize, new_tokens: usize, baseline: &Measured, engine: &Measured) {
    println!("[{name}] {rows} rows ({PROMPTS} prompts x {GROUP}) x {new_tokens} new tokens, prompt {PROMPT_LEN} tokens");
    println!(
        "{:<8} {:>10} {:>12} {:>14} {:>22}",
        "engine", "seconds", "tokens/s", "peak heap MB", "host bytes/decode step"
    );
    for (label, m) in [("static", baseline), ("paged", engine)] {
        println!(
            "{label:<8} {:>10.2} {:>12.1} {:>14.1} {:>22.0}",
            m.secs,
            m.tokens as f64 / m.secs,
            m.peak_bytes as f64 / 1e6,
            m.host_bytes_per_step
        );
    }
    println!(
        "[{name}] paged vs static: tokens/s {:.2}x, peak heap {:.2}x, host bytes per decode step {:.5}x",
        (engine.tokens as f64 / engine.secs) / (baseline.tokens as f64 / baseline.secs),
        engine.peak_bytes as f64 / baseline.peak_bytes.max(1) as f64,
        engine.host_bytes_per_step / baseline.host_bytes_per_step
    );
    println!("[{name}] KV memory (MB) by decode step: step, static (rows x reservation), paged (blocks in use), tokens alive");
    let steps = engine.kv_curve.len().min(baseline.kv_curve.len());
    for s in [
        0,
        steps / 8,
        steps / 4,
        steps / 2,
        3 * steps / 4,
        steps.saturating_sub(1),
    ] {
        if s < steps {
            let alive = rows * (PROMPT_LEN + s + 1);
            println!(
                "  {s:>5} {:>10.2} {:>10.2} {alive:>8}",
                baseline.kv_curve[s] / 1e6,
                engine.kv_curve[s] / 1e6
            );
        }
    }
}

fn run_on<B: KernelOps>(name: &str, vocab: usize, new_tokens: usize, device: &B::Device) {
    let (baseline, engine) = measure::<B>(name, vocab, new_tokens, device);
    report(name, PROMPTS * GROUP, new_tokens, &baseline, &engine);
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let tokens: usize = std::env::var("CONRUB_BENCH_TOKENS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    run_on::<burn::backend::Flex>("flex CPU", 151_936, tokens, &Default::default());
    #[cfg(feature = "wgpu")]
    {
        if conrub_kernels::wgpu_adapter_count() > 0 {
            run_on::<burn::backend::Wgpu>("wgpu", 4096, 32, &Default::default());
        } else {
            println!("[wgpu] no adapter: skipped");
        }
    }
}
