//! conrub (burn, on each CPU backend compiled in) vs candle-transformers' Qwen3 (CPU, f32) on the
//! same random Qwen3-0.6B-shaped safetensors: single-sequence prefill and KV-cache decode at batch
//! 1 and 8 (conrub's rollout engine against candle's KV cache), measured in the same run.
//! Also checks that both produce the same last-position logits.
//!
//! `cargo bench -p conrub-bench-peers` (flex, the default CPU backend); add `--features ndarray` to
//! measure burn-ndarray too. `CONRUB_BENCH_LAYERS=N` shortens the model (default: all 28 layers).

use std::time::{Duration, Instant};

use burn::tensor::DType;
use candle_core::{Device as CandleDevice, Tensor as CandleTensor};
use conrub_bench_peers::{load_candle, write_checkpoint};
use conrub_kernels::KernelOps;
use conrub_models::{CausalLm, ForwardBatch, Pretrained};
use conrub_rollout::{rollout, EngineConfig, SamplingConfig};
use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion, Throughput};

const PREFILL_LEN: usize = 256;
const DECODE_BATCHES: [usize; 2] = [1, 8];
const DECODE_PROMPT: usize = 16;
const DECODE_STEPS: usize = 8;

fn ids(batch: usize, len: usize, salt: u32) -> Vec<Vec<u32>> {
    (0..batch)
        .map(|b| {
            (0..len as u32)
                .map(|i| (i * 7919 + b as u32 * 104_729 + salt) % 151_000)
                .collect()
        })
        .collect()
}

fn candle_ids(ids: &[Vec<u32>]) -> CandleTensor {
    let (b, t) = (ids.len(), ids[0].len());
    let flat: Vec<u32> = ids.iter().flatten().copied().collect();
    CandleTensor::from_vec(flat, (b, t), &CandleDevice::Cpu).unwrap()
}

fn run<B: KernelOps>(c: &mut Criterion, name: &str) {
    let layers = std::env::var("CONRUB_BENCH_LAYERS")
        .ok()
        .and_then(|v| v.parse().ok());
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_checkpoint::<B>(dir.path(), layers);
    let device = B::Device::default();
    let ours = Pretrained::<B>::load_dir(dir.path(), &device)
        .unwrap()
        .model;
    let mut candle = load_candle(dir.path(), &cfg);

    // Same checkpoint, same numbers: compare the last-position logits once.
    let prompt = ids(1, 32, 3);
    let batch = ForwardBatch::<B>::contiguous(&prompt, 0, &device);
    let ours_logits: Vec<f32> = ours
        .forward(&batch)
        .slice([0..1, 31..32, 0..cfg.vocab_size])
        .cast(DType::F32)
        .into_data()
        .convert::<f32>()
        .into_vec()
        .unwrap();
    candle.clear_kv_cache();
    let theirs: Vec<f32> = candle
        .forward(&candle_ids(&prompt), 0)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let diff = ours_logits
        .iter()
        .zip(&theirs)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    eprintln!("[{name}] max |logit difference| conrub vs candle: {diff:e}");
    assert!(diff < 1e-3, "implementations disagree");

    let mut group = c.benchmark_group(format!("qwen3-0.6b-peers/{name}"));
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(20));

    group.throughput(Throughput::Elements(PREFILL_LEN as u64));
    let prompt = ids(1, PREFILL_LEN, 1);
    group.bench_function(format!("conrub prefill 1x{PREFILL_LEN}"), |b| {
        b.iter(|| {
            let batch = ForwardBatch::<B>::contiguous(&prompt, 0, &device);
            ours.forward_last(&batch).into_data()
        })
    });
    let input = candle_ids(&prompt);
    group.bench_function(format!("candle prefill 1x{PREFILL_LEN}"), |b| {
        b.iter(|| {
            candle.clear_kv_cache();
            candle.forward(&input, 0).unwrap().to_vec3::<f32>().unwrap()
        })
    });

    for batch in DECODE_BATCHES {
        decode_benches::<B>(&mut group, &ours, &mut candle, batch, &device);
    }
    group.finish();
}

/// Batched decode, `DECODE_STEPS` tokens per row after a `DECODE_PROMPT`-token prompt (prefill
/// not timed), two ways: conrub's rollout engine (paged pool, decode attention over block tables, greedy sampling on the device;
/// its decode time is a run of `DECODE_STEPS + 1` tokens minus a run of 1, both prefilling the
/// same prompts), and candle's KV cache (logits to the host).
fn decode_benches<B: KernelOps>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    ours: &CausalLm<B>,
    candle: &mut candle_transformers::models::qwen3::ModelForCausalLM,
    n: usize,
    device: &B::Device,
) {
    group.throughput(Throughput::Elements((n * DECODE_STEPS) as u64));
    let prompt = ids(n, DECODE_PROMPT, 2);
    let engine = EngineConfig::default();
    let greedy = |tokens: usize| SamplingConfig {
        stop_ids: vec![],
        ..SamplingConfig::greedy(tokens)
    };
    let (short, long) = (greedy(1), greedy(DECODE_STEPS + 1));
    group.bench_function(format!("conrub engine decode {n}x{DECODE_STEPS}"), |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let start = Instant::now();
                let out = rollout(ours, &prompt, &long, &engine, device).unwrap();
                let with_decode = start.elapsed();
                assert_eq!(
                    out.stats.generated_tokens,
                    n * (DECODE_STEPS + 1),
                    "every row decodes every step"
                );
                let start = Instant::now();
                rollout(ours, &prompt, &short, &engine, device).unwrap();
                total += with_decode.saturating_sub(start.elapsed());
            }
            total
        })
    });
    let input = candle_ids(&prompt);
    group.bench_function(format!("candle decode {n}x{DECODE_STEPS}"), |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                candle.clear_kv_cache();
                // candle's Qwen3 builds its causal mask for one sequence only, so the batched
                // prompt is fed one position at a time (no mask is needed then).
                for pos in 0..DECODE_PROMPT {
                    candle
                        .forward(&input.narrow(1, pos, 1).unwrap(), pos)
                        .unwrap();
                }
                let start = Instant::now();
                for step in 0..DECODE_STEPS {
                    let next = candle_ids(&ids(n, 1, step as u32));
                    let _ = candle
                        .forward(&next, DECODE_PROMPT + step)
                        .unwrap()
                        .to_vec3::<f32>()
                        .unwrap();
                }
                total += start.elapsed();
            }
            total
        })
    });
}

fn benches(c: &mut Criterion) {
    #[cfg(feature = "ndarray")]
    run::<burn::backend::NdArray<f32>>(c, "ndarray");
    #[cfg(feature = "flex")]
    run::<burn::backend::Flex>(c, "flex");
    let _ = c;
}

criterion_group!(peers, benches);
criterion_main!(peers);
