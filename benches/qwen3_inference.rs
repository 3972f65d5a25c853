//! Prefill and batched-decode throughput of a Qwen3-0.6B-shaped model with random weights (no
//! download) on each CPU backend compiled in (`--features flex` adds burn's flex backend next to the
//! default ndarray one).
//!
//! `cargo bench --bench qwen3_inference [--features flex]`; `CONRUB_BENCH_LAYERS=N` shortens the
//! model (default: all 28 layers).

use std::time::{Duration, Instant};

use burn::tensor::backend::Backend;
use conrub_qwen3::{ForwardBatch, KvCache, Qwen3Config, Qwen3ForCausalLM};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

const PREFILL_BATCH: usize = 2;
const PREFILL_LEN: usize = 128;
const DECODE_BATCH: usize = 8;
const DECODE_PROMPT: usize = 16;
const DECODE_STEPS: usize = 8;

fn config() -> Qwen3Config {
    let mut c = Qwen3Config::qwen3_0_6b();
    if let Some(n) = std::env::var("CONRUB_BENCH_LAYERS").ok().and_then(|v| v.parse().ok()) {
        c.num_hidden_layers = n;
    }
    c
}

fn ids(batch: usize, len: usize, salt: u32) -> Vec<Vec<u32>> {
    (0..batch)
        .map(|b| (0..len as u32).map(|i| (i * 7919 + b as u32 * 104_729 + salt) % 151_000).collect())
        .collect()
}

fn bench_backend<B: Backend>(c: &mut Criterion, name: &str) {
    let device = B::Device::default();
    let cfg = config();
    let model = Qwen3ForCausalLM::<B>::random(&cfg, 0.02, 0, &device);
    let mut group = c.benchmark_group(format!("qwen3-0.6b/{name}"));
    group.sample_size(10).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(10));

    group.throughput(Throughput::Elements((PREFILL_BATCH * PREFILL_LEN) as u64));
    let prompt = ids(PREFILL_BATCH, PREFILL_LEN, 1);
    group.bench_function(format!("prefill {PREFILL_BATCH}x{PREFILL_LEN} tokens"), |b| {
        b.iter(|| {
            let batch = ForwardBatch::<B>::contiguous(&prompt, 0, &device);
            let mut cache = KvCache::new(model.num_layers());
            let hidden = model.forward_hidden(&batch, Some(&mut cache));
            // Only the last position's logits are needed to start decoding.
            let [bsz, t, h] = hidden.dims();
            let last = model.logits(hidden.slice([0..bsz, t - 1..t, 0..h]));
            B::sync(&device).unwrap();
            last
        })
    });

    group.throughput(Throughput::Elements((DECODE_BATCH * DECODE_STEPS) as u64));
    let prompt = ids(DECODE_BATCH, DECODE_PROMPT, 2);
    group.bench_function(format!("decode {DECODE_BATCH} seqs x {DECODE_STEPS} steps"), |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let mut cache = KvCache::new(model.num_layers());
                model.forward(&ForwardBatch::<B>::contiguous(&prompt, 0, &device), Some(&mut cache));
                B::sync(&device).unwrap();
                let start = Instant::now();
                for step in 0..DECODE_STEPS {
                    let next = ids(DECODE_BATCH, 1, step as u32);
                    let batch = ForwardBatch::<B>::contiguous(&next, DECODE_PROMPT + step, &device);
                    let logits = model.forward(&batch, Some(&mut cache));
                    // Sampling needs the logits on the host.
                    let _ = logits.into_data();
                }
                total += start.elapsed();
            }
            total
        })
    });
    group.finish();
}

fn benches(c: &mut Criterion) {
    #[cfg(feature = "ndarray")]
    bench_backend::<burn::backend::NdArray<f32>>(c, "ndarray");
    #[cfg(feature = "flex")]
    bench_backend::<burn::backend::Flex>(c, "flex");
    let _ = c;
}

criterion_group!(qwen3, benches);
criterion_main!(qwen3);
