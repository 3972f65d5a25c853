//! Peak memory and time of `token_logprobs` forward + backward, fused (chunked, recomputing
//! backward) against the naive `log_softmax(h · Wᵀ).gather(targets)` under burn autodiff, at the
//! Qwen3-0.6B head shape: 4,096 tokens x 151,936 vocabulary x hidden 1,024.
//!
//! Every measurement runs in a fresh child process, so peaks do not leak between them: on CPU
//! (flex) the peak is the most heap bytes held at once (a counting allocator, inputs excluded); on
//! wgpu it is the growth of the CubeCL memory pools' reservation (their high-water mark).
//!
//! `cargo bench --bench kernels` (CPU) or `cargo bench --bench kernels --features wgpu` (adds
//! wgpu). `CONRUB_BENCH_ITERS` sets the timed iterations (default 2, after one warm-up).
//!
//! On wgpu through Mesa's lavapipe no buffer may exceed 128 MiB, so neither the 0.6B head (622 MB)
//! nor 4,096 x 151,936 logits (2.5 GB) fit: there the rows use hidden 128, the fused path runs all
//! 4,096 tokens in 128-token chunks, and the naive path is measured at the largest token count
//! whose logits fit (192), next to the fused path at the same shape.

use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::Instant;

use burn::backend::Autodiff;
use burn::tensor::{Int, Tensor, TensorData};
use conrub_kernels::reference::{naive_token_logprobs, seeded_uniform};
use conrub_kernels::{token_logprobs, KernelOps};

#[path = "common/peak.rs"]
mod peak;
use peak::{CURRENT, PEAK};

const VOCAB: usize = 151_936;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// One forward + backward; returns seconds.
fn step<B: KernelOps>(
    h0: &Tensor<B, 2>,
    w0: &Tensor<B, 2>,
    t: &Tensor<B, 1, Int>,
    fused: bool,
    chunk: usize,
) -> f64 {
    let start = Instant::now();
    let h = Tensor::<Autodiff<B>, 2>::from_inner(h0.clone()).require_grad();
    let w = Tensor::<Autodiff<B>, 2>::from_inner(w0.clone()).require_grad();
    let tt = Tensor::<Autodiff<B>, 1, Int>::from_inner(t.clone());
    let lp = if fused {
        token_logprobs(h.clone(), w.clone(), tt, chunk).logprobs
    } else {
        naive_token_logprobs(h.clone(), w.clone(), tt)
    };
    let grads = lp.sum().backward();
    // Reading one value of each gradient waits for the device.
    let gh = h.grad(&grads).unwrap();
    let gw = w.grad(&grads).unwrap();
    let _ = gh.slice([0..1, 0..1]).into_data();
    let _ = gw.slice([0..1, 0..1]).into_data();
    start.elapsed().as_secs_f64()
}

/// Child process: one path on one backend; prints `RESULT <median secs> <peak bytes>`.
fn measure<B: KernelOps>(
    device: &B::Device,
    fused: bool,
    (tokens, hidden, chunk): (usize, usize, usize),
    memory: impl Fn() -> u64,
) {
    let iters = env("CONRUB_BENCH_ITERS", 2);
    let h = seeded_uniform(tokens * hidden, 1, 0.5);
    let w = seeded_uniform(VOCAB * hidden, 2, 0.05);
    let t: Vec<i64> = (0..tokens).map(|i| ((i * 7919) % VOCAB) as i64).collect();
    let h = Tensor::<B, 2>::from_data(TensorData::new(h, [tokens, hidden]), device);
    let w = Tensor::<B, 2>::from_data(TensorData::new(w, [VOCAB, hidden]), device);
    let t = Tensor::<B, 1, Int>::from_data(TensorData::new(t, [tokens]), device);
    let _ = h.clone().slice([0..1, 0..1]).into_data();
    let _ = w.clone().slice([0..1, 0..1]).into_data();
    let base = memory();
    PEAK.store(CURRENT.load(Ordering::Relaxed), Ordering::Relaxed);
    let base_heap = CURRENT.load(Ordering::Relaxed) as u64;
    step(&h, &w, &t, fused, chunk);
    let mut times: Vec<f64> = (0..iters.max(1))
        .map(|_| step(&h, &w, &t, fused, chunk))
        .collect();
    times.sort_by(f64::total_cmp);
    let device_peak = memory().saturating_sub(base);
    let heap_peak = PEAK.load(Ordering::Relaxed) as u64 - base_heap;
    println!(
        "RESULT {} {}",
        times[times.len() / 2],
        device_peak.max(heap_peak)
    );
}

fn child(backend: &str, fused: bool, shape: (usize, usize, usize)) {
    match backend {
        "cpu" => measure::<burn::backend::Flex>(&Default::default(), fused, shape, || 0),
        #[cfg(feature = "wgpu")]
        "wgpu" => {
            use burn::backend::wgpu::{Wgpu, WgpuDevice, WgpuRuntime};
            let device = WgpuDevice::DefaultDevice;
            measure::<Wgpu>(&device, fused, shape, || {
                conrub_kernels::cube_memory_usage::<WgpuRuntime>(&device)
                    .map(|u| u.1)
                    .unwrap_or(0)
            })
        }
        other => panic!("backend {other} is not built in"),
    }
}

fn run_child(
    backend: &str,
    path: &str,
    (tokens, hidden, chunk): (usize, usize, usize),
) -> Result<(f64, u64), String> {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--child",
            backend,
            path,
            &tokens.to_string(),
            &hidden.to_string(),
            &chunk.to_string(),
        ])
        .output()
        .map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with("RESULT "))
        .ok_or_else(|| {
            let err = String::from_utf8_lossy(&out.stderr);
            let why = err
                .lines()
                .find(|l| l.contains("Err") || l.contains("panicked at") && !l.contains("note:"))
                .unwrap_or("");
            format!("failed ({}): {}", out.status, why.trim())
        })?;
    let f: Vec<&str> = line.split_whitespace().collect();
    Ok((f[1].parse().unwrap(), f[2].parse().unwrap()))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--child") {
        let n = |k: usize| args[i + k].parse::<usize>().unwrap();
        child(&args[i + 1], args[i + 2] == "fused", (n(3), n(4), n(5)));
        return;
    }
    // (device, fused shape, naive shape): (tokens, hidden, chunk).
    let mut rows = vec![("cpu", (4096, 1024, 512), (4096, 1024, 512))];
    if cfg!(feature = "wgpu") {
        rows.push(("wgpu", (4096, 128, 128), (4096, 128, 128)));
        rows.push(("wgpu", (192, 128, 128), (192, 128, 128)));
    }
    println!("token_logprobs forward + backward against log_softmax(h W^T).gather under autodiff, vocab {VOCAB}");
    println!(
        "{:<6} {:<6} {:>7} {:>7} {:>6} {:>10} {:>14}",
        "device", "path", "tokens", "hidden", "chunk", "seconds", "peak memory"
    );
    for (b, fs, ns) in rows {
        let fused = run_child(b, "fused", fs);
        let naive = run_child(b, "naive", ns);
        for (name, r, s) in [("fused", &fused, fs), ("naive", &naive, ns)] {
            match r {
                Ok((t, m)) => println!(
                    "{b:<6} {name:<6} {:>7} {:>7} {:>6} {t:>10.3} {:>11.1} MB",
                    s.0,
                    s.1,
                    s.2,
                    *m as f64 / 1e6
                ),
                Err(e) => println!("{b:<6} {name:<6} {:>7} {:>7} {:>6} {e}", s.0, s.1, s.2),
            }
        }
        if let (Ok((sf, mf)), Ok((sn, mn))) = (&fused, &naive) {
            println!(
                "{b:<6} ratio  time fused/naive {:.2}x, peak memory naive/fused {:.1}x",
                sf / sn,
                *mn as f64 / (*mf).max(1) as f64
            );
        }
    }
}
