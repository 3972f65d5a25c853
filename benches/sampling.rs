//! Sampling one token per row at Qwen3's full 151,936-token vocabulary (`DecodeOps::sample_rows`,
//! what the rollout engine calls every decode step) against one softmax over the same
//! `[rows, vocab]` logits in the same process (`conrub_kernels::sampling_bench`, which
//! `conrub bench sampling` also runs on the GPU machine).
//!
//! `cargo bench --bench sampling` (flex), `--features wgpu` adds wgpu, `--features cuda` adds
//! CUDA. `CONRUB_BENCH_ROWS` sets the rows (default 64; lavapipe caps a buffer at 128 MiB, 220
//! rows of f32 logits), `CONRUB_BENCH_ITERS` the timed calls (default 5, after one warm-up; the
//! median is reported).

use conrub_kernels::sampling_bench::sampling_timings;
use conrub_kernels::KernelOps;

const VOCAB: usize = 151_936;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// One backend's table: the softmax baseline, then each mode with its ratio to it.
fn run<B: KernelOps>(name: &str, device: &B::Device, cube: bool) {
    let rows = env("CONRUB_BENCH_ROWS", 64);
    let iters = env("CONRUB_BENCH_ITERS", 5);
    let timings = sampling_timings::<B>(device, [rows, VOCAB], iters, cube);
    let base = timings[0].secs;
    println!("{name}: {rows} rows x {VOCAB} ids, median of {iters}");
    for t in &timings {
        println!(
            "  {:<22} {:>10.3} ms  {:>8.2} us/row  {:>6.2}x softmax",
            t.label,
            t.secs * 1e3,
            t.secs * 1e6 / rows as f64,
            t.secs / base
        );
    }
}

fn main() {
    run::<burn::backend::Flex>("flex (CPU)", &Default::default(), false);
    #[cfg(feature = "wgpu")]
    {
        if conrub_kernels::wgpu_adapter_or_skip("sampling bench") {
            use burn::backend::wgpu::{Wgpu, WgpuDevice};
            run::<Wgpu>("wgpu", &WgpuDevice::DefaultDevice, true);
        }
    }
    #[cfg(feature = "cuda")]
    {
        use burn::backend::cuda::{Cuda, CudaDevice};
        run::<Cuda>("cuda", &CudaDevice::default(), true);
    }
}
