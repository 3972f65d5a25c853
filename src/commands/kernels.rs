//! `conrub kernels-check`: the fused GRPO ops on a device against true-f32 references (values
//! and gradients), then timings of both ops and of a forward/backward step at the 0.6B shape, fused
//! against naive, as one table. `scripts/gpu-check.sh` runs it on a machine with an NVIDIA GPU.

use std::time::Instant;

use anyhow::{ensure, Result};
use burn::backend::Autodiff;
use burn::tensor::activation::log_softmax;
use burn::tensor::{Int, Tensor, TensorData};
use clap::Args;
use conrub_kernels::reference::{
    naive_clipped_surrogate, naive_entropy, naive_token_logprobs, relative_error, seeded_uniform,
};
use conrub_kernels::{clipped_surrogate, token_logprobs, Clip, KernelOps, Reduce};
use conrub_models::{CausalLm, ModelConfig};

use crate::backend::{run_on_device, BackendTask};

/// Arguments of `kernels check`.
#[derive(Args, Clone)]
pub struct KernelsArgs {
    /// Device to check (`cuda:0`, `wgpu`, `cpu`, ...); the reference is the fallback on the CPU.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Tokens of the parity check (full vocabulary, hidden 64).
    #[arg(long, default_value_t = 257)]
    pub parity_tokens: usize,
    /// Tokens of the timed `token_logprobs` (hidden `--hidden`, vocabulary 151,936).
    #[arg(long, default_value_t = 4096)]
    pub tokens: usize,
    /// Hidden size of the timed `token_logprobs` (1,024 is the 0.6B shape's).
    #[arg(long, default_value_t = 1024)]
    pub hidden: usize,
    /// Timed repetitions after one warm-up (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub iters: usize,
    /// Skip the 0.6B-shape step (it allocates the full model).
    #[arg(long)]
    pub skip_model: bool,
}

const VOCAB: usize = 151_936;

fn host<B: burn::tensor::backend::Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec().expect("f32 data")
}

/// Values and gradients of both ops on backend `B` (under autodiff); with `naive`, the log-prob
/// rows (log-probs, entropy and their gradients) come from the textbook graph instead of the fused
/// op.
#[cfg(feature = "flex")]
fn parity_run<B: KernelOps>(device: &B::Device, tokens: usize, naive: bool) -> Vec<Vec<f32>> {
    type A<B> = Autodiff<B>;
    let hidden = 64;
    let h = Tensor::<A<B>, 2>::from_data(
        TensorData::new(seeded_uniform(tokens * hidden, 1, 1.0), [tokens, hidden]),
        device,
    )
    .require_grad();
    let w = Tensor::<A<B>, 2>::from_data(
        TensorData::new(seeded_uniform(VOCAB * hidden, 2, 0.3), [VOCAB, hidden]),
        device,
    )
    .require_grad();
    let t: Vec<i64> = (0..tokens)
        .map(|i| ((i * 7919 + 13) % VOCAB) as i64)
        .collect();
    let t = Tensor::<A<B>, 1, Int>::from_data(TensorData::new(t, [tokens]), device);
    let (logprobs, entropy) = if naive {
        (
            naive_token_logprobs(h.clone(), w.clone(), t),
            naive_entropy(h.clone(), w.clone()),
        )
    } else {
        let out = token_logprobs(h.clone(), w.clone(), t, 128);
        (out.logprobs, out.entropy)
    };
    let g = Tensor::<A<B>, 1>::from_data(
        TensorData::new(seeded_uniform(tokens, 3, 1.0), [tokens]),
        device,
    );
    let grads = (logprobs.clone() * g).sum().backward();
    let (n, len) = (6, 1000);
    let lp = Tensor::<A<B>, 2>::from_data(
        TensorData::new(seeded_uniform(n * len, 4, 1.0), [n, len]),
        device,
    )
    .require_grad();
    let old = lp.clone().detach()
        - Tensor::from_data(
            TensorData::new(seeded_uniform(n * len, 5, 0.6), [n, len]),
            device,
        );
    let adv = Tensor::<A<B>, 1>::from_data(
        TensorData::new(vec![1.0f32, -0.5, 0.7, -1.2, 0.0, 0.3], [n]),
        device,
    );
    let mut m = vec![0f32; n * len];
    for (i, l) in [1000usize, 513, 0, 999, 7, 300].iter().enumerate() {
        m[i * len..i * len + l].fill(1.0);
    }
    let mask = Tensor::<A<B>, 2>::from_data(TensorData::new(m, [n, len]), device);
    let s = clipped_surrogate(
        lp.clone(),
        old,
        adv,
        mask,
        Clip {
            low: 0.2,
            high: 0.28,
        },
        Reduce::MeanPerResponse,
    );
    let sg = s.per_response.clone().sum().backward();
    vec![
        host(logprobs.inner()),
        host(entropy.inner()),
        host(h.grad(&grads).unwrap()),
        host(w.grad(&grads).unwrap()),
        host(s.per_response.inner()),
        host(lp.grad(&sg).unwrap()),
        host(s.clip_low.inner()),
        host(s.clip_high.inner()),
    ]
}

/// Median seconds of `f` over `iters` runs after one warm-up.
fn time(iters: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut v: Vec<f64> = (0..iters.max(1))
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Waits for the device by reading one value.
fn sync<B: burn::tensor::backend::Backend, const D: usize>(t: Tensor<B, D>) {
    let _ = t.flatten::<1>(0, D - 1).slice(0..1).into_data();
}

impl BackendTask for KernelsArgs {
    fn run<B: KernelOps>(self, device: B::Device) -> Result<()> {
        let mut table = Table::new();
        #[cfg(feature = "flex")]
        {
            let checked = parity::<B>(&self, &device, &mut table);
            print_table(&table);
            checked?;
            table.clear();
        }
        paged_decode::<B>(&self, &device, &mut table)?;
        logprobs_timing::<B>(&self, &device, &mut table);
        surrogate_timing::<B>(&self, &device, &mut table);
        if !self.skip_model {
            model_step_timing::<B>(&self, &device, &mut table);
            train_step_timing::<B>(&self, &device, &mut table);
            rollout_timing::<B>(&device, &mut table)?;
        }
        print_table(&table);
        Ok(())
    }
}

/// Rows of the report: what, the figure, a comment (bound, baseline, ratio).
type Table = Vec<(String, String, String)>;

type A<B> = Autodiff<B>;

/// Relative error of an f32 matmul on `B` against the same product on the CPU: about 5e-4 where
/// f32 matmuls run on tensor cores in TF32 (burn 0.21 on CUDA: cubek-matmul stages f32 operands
/// as TF32 whenever the device supports it), near 1e-7 where they run in f32.
#[cfg(feature = "flex")]
fn f32_matmul_error<B: KernelOps>(device: &B::Device) -> f64 {
    fn product<B: burn::tensor::backend::Backend>(device: &B::Device) -> Vec<f32> {
        let (m, k, n) = (128, 512, 128);
        let a = TensorData::new(seeded_uniform(m * k, 31, 1.0), [m, k]);
        let b = TensorData::new(seeded_uniform(k * n, 32, 1.0), [k, n]);
        host(Tensor::<B, 2>::from_data(a, device).matmul(Tensor::from_data(b, device)))
    }
    relative_error(
        &product::<B>(device),
        &product::<burn::backend::Flex>(&Default::default()),
    )
}

/// Above this relative error of [`f32_matmul_error`], the device's f32 matmuls are TF32.
const TF32_SIGN: f64 = 1e-5;

/// Parity of the log-prob, loss and attention ops on `B` against true-f32 references. The
/// fused kernels compute in f32 (or bf16) FMA; the log-prob op's logits matmul and its backward's
/// matmuls are burn's, which run in TF32 where the device has tensor cores for it (an H200): there
/// the log-prob rows are checked against the textbook graph on the same device (the same TF32
/// matmuls, so the bound still isolates our kernels), and their distance from the CPU's f32 is
/// printed as what TF32 costs. Attention is checked against the textbook graph on the CPU.
#[cfg(feature = "flex")]
fn parity<B: KernelOps>(args: &KernelsArgs, device: &B::Device, table: &mut Table) -> Result<()> {
    let matmul = f32_matmul_error::<B>(device);
    let tf32 = matmul > TF32_SIGN;
    table.push((
        "device f32 matmul vs CPU f32".into(),
        format!("{matmul:.2e}"),
        if tf32 { "TF32 tensor cores" } else { "f32" }.into(),
    ));
    let got = parity_run::<B>(device, args.parity_tokens, false);
    let cpu = parity_run::<burn::backend::Flex>(&Default::default(), args.parity_tokens, false);
    let mut want = cpu.clone();
    if tf32 {
        let same_device = parity_run::<B>(device, args.parity_tokens, true);
        want.splice(0..4, same_device.into_iter().take(4));
        for (name, (a, b)) in ["log-probabilities", "d hidden", "d head"].iter().zip([
            (&got[0], &cpu[0]),
            (&got[2], &cpu[2]),
            (&got[3], &cpu[3]),
        ]) {
            table.push((
                format!("TF32 cost: {name} vs CPU f32"),
                format!("{:.2e}", relative_error(a, b)),
                "no bound (the matmuls' precision)".into(),
            ));
        }
    }
    let names = [
        "log-probabilities",
        "entropy",
        "d hidden",
        "d head",
        "surrogate loss",
        "surrogate d logp",
        "clip low counts",
        "clip high counts",
    ];
    let tol = [1e-5, 1e-4, 1e-4, 1e-4, 1e-5, 1e-5, 0.0, 0.0];
    let mut ok = true;
    for ((name, t), (a, b)) in names.iter().zip(tol).zip(got.iter().zip(&want)) {
        let name = if tf32 && ["log-probabilities", "entropy", "d hidden", "d head"].contains(name)
        {
            format!("{name} (vs textbook graph on the device)")
        } else {
            name.to_string()
        };
        let e = relative_error(a, b);
        ok &= e <= t;
        table.push((
            format!("parity: {name}"),
            format!("{e:.2e}"),
            format!("{} (bound {t:.0e})", if e <= t { "ok" } else { "FAIL" }),
        ));
    }
    // Fused causal attention against the textbook graph on the CPU.
    for (dtype, bound) in [
        (burn::tensor::DType::F32, 1e-4),
        (burn::tensor::DType::BF16, 3e-2),
    ] {
        for (name, e) in attention_parity::<B>(device, dtype) {
            ok &= e <= bound;
            table.push((
                format!("parity: attention {name} ({dtype:?})"),
                format!("{e:.2e}"),
                format!(
                    "{} (bound {bound:.0e})",
                    if e <= bound { "ok" } else { "FAIL" }
                ),
            ));
        }
    }
    ok &= tensor_core_parity::<B>(device, table);
    ok &= sampling_parity::<B>(device, table);
    ensure!(ok, "kernel parity failed on {}", args.device);
    Ok(())
}

/// The sampling rule on the device (`conrub_kernels::sampling_check`): `sample_rows` against the
/// host rule in every checked mode (min-p included) at the full vocabulary, and the repetition
/// penalty's gather and scatter against the host rule within 3 ULP (a GPU's f32 division). One
/// row each; returns whether both passed.
#[cfg(feature = "flex")]
fn sampling_parity<B: KernelOps>(device: &B::Device, table: &mut Table) -> bool {
    use conrub_kernels::sampling_check::{check_penalty, check_sample_rows};
    let (sampling, modes) = match check_sample_rows::<B>(device, VOCAB) {
        Ok(report) => {
            let exact: usize = report.iter().map(|m| m.exact).sum();
            let rows: usize = report.iter().map(|m| m.rows).sum();
            let modes = report.len();
            (
                Ok(()),
                format!("{exact}/{rows} tokens exact in {modes} modes"),
            )
        }
        Err(e) => (Err(e), "-".to_string()),
    };
    let penalty = check_penalty::<B>(device, VOCAB, 3);
    let mut ok = true;
    for (name, result, figure) in [
        ("parity: sampling vs host rule", sampling, modes),
        (
            "parity: repetition penalty vs host rule",
            penalty,
            "3 ULP".to_string(),
        ),
    ] {
        ok &= result.is_ok();
        let verdict = match result {
            Ok(()) => "ok".to_string(),
            Err(e) => format!("FAIL: {e}"),
        };
        table.push((name.into(), figure, verdict));
    }
    ok
}

/// The tensor-core attention kernels (bf16 and f16) against the textbook graph on the CPU: the
/// shape above (GQA 16/8, 300 queries, padded keys), 8,192 keys (GQA 4/2, one sequence) and
/// head_dim 96, at
/// the bound of the 16-bit checks above. A device without cooperative matrices gets a row saying
/// so (and no failure). Returns whether every check passed.
#[cfg(feature = "flex")]
fn tensor_core_parity<B: KernelOps>(device: &B::Device, table: &mut Table) -> bool {
    use conrub_kernels::AttentionKernels;
    if let Err(why) = B::check_attention_kernels(device, AttentionKernels::TensorCore) {
        table.push((
            "parity: tensor-core attention".into(),
            "-".into(),
            format!("not run: {why}"),
        ));
        return true;
    }
    let bound = 3e-2;
    let mut ok = true;
    for dtype in [burn::tensor::DType::BF16, burn::tensor::DType::F16] {
        // The parity shape, 8,192 keys, and head_dim 96 (six 16-column tiles: accumulator
        // groups of three).
        for shape in [
            [2, 16, 8, 300, 128],
            [1, 4, 2, 8192, 128],
            [1, 4, 2, 300, 96],
        ] {
            let fused =
                attention_run::<B>(device, dtype, Some(AttentionKernels::TensorCore), shape);
            let naive =
                attention_run::<burn::backend::Flex>(&Default::default(), dtype, None, shape);
            for (name, (a, b)) in ["out", "d q", "d k", "d v"]
                .into_iter()
                .zip(fused.iter().zip(&naive))
            {
                let e = relative_error(a, b);
                ok &= e <= bound;
                table.push((
                    format!(
                        "parity: tensor-core attention {name} ({dtype:?}, {} keys, head_dim {})",
                        shape[3], shape[4]
                    ),
                    format!("{e:.2e}"),
                    format!(
                        "{} (bound {bound:.0e})",
                        if e <= bound { "ok" } else { "FAIL" }
                    ),
                ));
            }
        }
    }
    ok
}

/// Decode attention over the paged pool: the backend's op (the kernel on CubeCL) vs
/// the gather fallback, the 4B shape's heads (32 over 8, head_dim 128), 64 rows of up to 2k keys.
fn paged_decode<B: KernelOps>(
    args: &KernelsArgs,
    device: &B::Device,
    table: &mut Table,
) -> Result<()> {
    use conrub_kernels::attention::fallback_paged_decode;
    use conrub_kernels::PagedLayout;
    let (rows, nh, nkv, d, bs) = (64usize, 32usize, 8usize, 128usize, 16usize);
    let lens: Vec<usize> = (0..rows).map(|r| 2048 - (r * 29) % 1500).collect();
    let blocks = 2048 / bs;
    let slots = rows * blocks * bs;
    // Row r owns blocks r, r + rows, r + 2 rows, ...: interleaved, as a busy pool is.
    let block_ids: Vec<i64> = (0..rows)
        .flat_map(|r| (0..blocks).map(move |j| (j * rows + r) as i64))
        .collect();
    for dtype in [burn::tensor::DType::F32, burn::tensor::DType::BF16] {
        let q = Tensor::<B, 4>::from_data(
            TensorData::new(seeded_uniform(rows * nh * d, 31, 1.0), [rows, nh, 1, d]),
            device,
        )
        .cast(dtype);
        let kp = Tensor::<B, 2>::from_data(
            TensorData::new(seeded_uniform(slots * nkv * d, 32, 1.0), [slots, nkv * d]),
            device,
        )
        .cast(dtype);
        let vp = Tensor::<B, 2>::from_data(
            TensorData::new(seeded_uniform(slots * nkv * d, 33, 1.0), [slots, nkv * d]),
            device,
        )
        .cast(dtype);
        let tables = Tensor::<B, 2, Int>::from_data(
            TensorData::new(block_ids.clone(), [rows, blocks]),
            device,
        );
        let lt = Tensor::<B, 1, Int>::from_data(
            TensorData::new(lens.iter().map(|&l| l as i64).collect::<Vec<_>>(), [rows]),
            device,
        );
        let layout = PagedLayout::new(bs, 1.0 / (d as f64).sqrt());
        let run = |kernel: bool| -> Tensor<B, 4> {
            let (q, k, v, t, l) = (
                q.clone().into_primitive().tensor(),
                kp.clone().into_primitive().tensor(),
                vp.clone().into_primitive().tensor(),
                tables.clone().into_primitive(),
                lt.clone().into_primitive(),
            );
            let out = if kernel {
                B::paged_decode_attention(q, k, v, t, l, layout)
            } else {
                fallback_paged_decode::<B>(q, k, v, t, l, layout)
            };
            Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(out))
        };
        let e = relative_error(
            &host(run(true).cast(burn::tensor::DType::F32)),
            &host(run(false).cast(burn::tensor::DType::F32)),
        );
        let bound = if dtype == burn::tensor::DType::F32 {
            1e-4
        } else {
            3e-2
        };
        ensure!(
            e <= bound,
            "paged decode attention ({dtype:?}) differs from the gather fallback by {e:.2e} on {}",
            args.device
        );
        let kernel = time(args.iters, || sync(run(true)));
        let gather = time(args.iters, || sync(run(false)));
        table.push((
            format!("parity: paged decode attention ({dtype:?})"),
            format!("{e:.2e}"),
            format!("ok (bound {bound:.0e})"),
        ));
        table.push((
            format!("paged decode attention, {rows} rows x up to 2,048 keys, {dtype:?}"),
            format!("{:.3} ms", kernel * 1e3),
            format!(
                "gather fallback {:.3} ms, op/gather {:.2}x",
                gather * 1e3,
                kernel / gather
            ),
        ));
    }
    Ok(())
}

/// Times `token_logprobs` forward and backward, fused against naive.
fn logprobs_timing<B: KernelOps>(args: &KernelsArgs, device: &B::Device, table: &mut Table) {
    let (n, hd) = (args.tokens, args.hidden);
    let h0 = Tensor::<B, 2>::from_data(
        TensorData::new(seeded_uniform(n * hd, 6, 1.0), [n, hd]),
        device,
    );
    let w0 = Tensor::<B, 2>::from_data(
        TensorData::new(seeded_uniform(VOCAB * hd, 7, 0.05), [VOCAB, hd]),
        device,
    );
    let t0 = Tensor::<B, 1, Int>::from_data(
        TensorData::new(
            (0..n)
                .map(|i| ((i * 31) % VOCAB) as i64)
                .collect::<Vec<_>>(),
            [n],
        ),
        device,
    );
    let logprob_step = |fused: bool| {
        let h = Tensor::<A<B>, 2>::from_inner(h0.clone()).require_grad();
        let w = Tensor::<A<B>, 2>::from_inner(w0.clone()).require_grad();
        let t = Tensor::<A<B>, 1, Int>::from_inner(t0.clone());
        let lp = if fused {
            token_logprobs(h.clone(), w.clone(), t, 512).logprobs
        } else {
            naive_token_logprobs(h.clone(), w.clone(), t)
        };
        let g = lp.sum().backward();
        sync(w.grad(&g).unwrap());
        sync(h.grad(&g).unwrap());
    };
    let fused = time(args.iters, || logprob_step(true));
    let naive = time(args.iters, || logprob_step(false));
    let shape = format!("{n} x {VOCAB} x {hd}");
    table.push((
        format!("token_logprobs fwd+bwd, fused ({shape})"),
        format!("{:.2} ms", fused * 1e3),
        String::new(),
    ));
    table.push((
        format!("token_logprobs fwd+bwd, naive ({shape})"),
        format!("{:.2} ms", naive * 1e3),
        format!("fused/naive {:.2}x", fused / naive),
    ));
}

/// Times `clipped_surrogate` forward and backward, fused against naive: 64 responses x 8,192
/// tokens.
fn surrogate_timing<B: KernelOps>(args: &KernelsArgs, device: &B::Device, table: &mut Table) {
    let (rows, len) = (64, 8192);
    let lp0 = Tensor::<B, 2>::from_data(
        TensorData::new(seeded_uniform(rows * len, 8, 1.0), [rows, len]),
        device,
    );
    let old0 = lp0.clone()
        - Tensor::from_data(
            TensorData::new(seeded_uniform(rows * len, 9, 0.3), [rows, len]),
            device,
        );
    let adv0 = Tensor::<B, 1>::from_data(
        TensorData::new(seeded_uniform(rows, 10, 1.0), [rows]),
        device,
    );
    let mask0 = Tensor::<B, 2>::ones([rows, len], device);
    let surrogate_step = |fused: bool| {
        let lp = Tensor::<A<B>, 2>::from_inner(lp0.clone()).require_grad();
        let (old, adv, mask) = (
            Tensor::from_inner(old0.clone()),
            Tensor::from_inner(adv0.clone()),
            Tensor::from_inner(mask0.clone()),
        );
        let clip = Clip {
            low: 0.2,
            high: 0.28,
        };
        let loss = if fused {
            clipped_surrogate(lp.clone(), old, adv, mask, clip, Reduce::MeanPerResponse)
                .per_response
        } else {
            naive_clipped_surrogate(lp.clone(), old, adv, mask, clip, Reduce::MeanPerResponse)
        };
        sync(lp.grad(&loss.mean().backward()).unwrap());
    };
    let fused = time(args.iters, || surrogate_step(true));
    let naive = time(args.iters, || surrogate_step(false));
    table.push((
        format!("clipped_surrogate fwd+bwd, fused ({rows} x {len})"),
        format!("{:.3} ms", fused * 1e3),
        String::new(),
    ));
    table.push((
        format!("clipped_surrogate fwd+bwd, naive ({rows} x {len})"),
        format!("{:.3} ms", naive * 1e3),
        format!("fused/naive {:.2}x", fused / naive),
    ));
}

/// A step at the 0.6B shape: 4 sequences of 1,024 tokens, log-probs of the last 768.
fn model_step_timing<B: KernelOps>(args: &KernelsArgs, device: &B::Device, table: &mut Table) {
    let cfg = ModelConfig::qwen3_0_6b();
    let model = CausalLm::<A<B>>::random(&cfg, 0.02, 11, device);
    let (b, seq, resp) = (4usize, 1024usize, 768usize);
    let seqs: Vec<Vec<u32>> = (0..b)
        .map(|r| {
            (0..seq)
                .map(|i| ((i * 7 + r * 13) % 150_000) as u32)
                .collect()
        })
        .collect();
    let prompts: Vec<Vec<u32>> = seqs.iter().map(|s| s[..seq - resp].to_vec()).collect();
    let responses: Vec<Vec<u32>> = seqs.iter().map(|s| s[seq - resp..].to_vec()).collect();
    let tf = conrub_grpo::TokenBatch::<A<B>>::new(
        prompts
            .iter()
            .map(Vec::as_slice)
            .zip(responses.iter().map(Vec::as_slice)),
        device,
    );
    let model_step = |fused: bool| {
        use conrub_grpo::Policy;
        let lp = if fused {
            model.response_logprobs(&tf).logprobs
        } else {
            let padded = conrub_models::PaddedBatch::new(&seqs, 0, conrub_models::Padding::Right);
            let logits = model.forward(&padded.to_device(device));
            let [bb, s, _] = logits.dims();
            let targets: Vec<i64> = seqs
                .iter()
                .flat_map(|x| x[1..].iter().map(|&t| t as i64).chain([0]))
                .collect();
            let targets =
                Tensor::<A<B>, 3, Int>::from_data(TensorData::new(targets, [bb, s, 1]), device);
            log_softmax(logits, 2).gather(2, targets).reshape([bb, s])
        };
        let grads = lp.sum().backward();
        sync(model.head_weight().grad(&grads).unwrap());
    };
    let fused = time(args.iters, || model_step(true));
    let naive = time(args.iters, || model_step(false));
    table.push((
        format!("0.6B shape fwd+bwd, {b} x {seq} tokens, fused head"),
        format!("{:.1} ms", fused * 1e3),
        String::new(),
    ));
    table.push((
        format!("0.6B shape fwd+bwd, {b} x {seq} tokens, full logits"),
        format!("{:.1} ms", naive * 1e3),
        format!("fused/naive {:.2}x", fused / naive),
    ));
}

/// One learner micro-batch of the published recipe at the 0.6B shape: 8,192 tokens,
/// bf16-mixed, fused attention, per-layer activation checkpointing, AdamW.
fn train_step_timing<B: KernelOps>(args: &KernelsArgs, device: &B::Device, table: &mut Table) {
    use conrub_grpo::{Update, UpdateConfig};
    let cfg = ModelConfig::qwen3_0_6b();
    let exec = conrub_models::Execution {
        precision: conrub_models::Precision::Bf16Mixed,
        attention: conrub_models::AttentionImpl::Fused,
        activation_checkpointing: true,
        ..Default::default()
    };
    let mut model = Some(CausalLm::<A<B>>::random(&cfg, 0.02, 11, device).with_execution(exec));
    let (prompt, resp) = (1024usize, 7168usize);
    let p: Vec<u32> = (0..prompt).map(|i| ((i * 7) % 150_000) as u32).collect();
    let r: Vec<u32> = (0..resp).map(|i| ((i * 13 + 5) % 150_000) as u32).collect();
    let tf =
        conrub_grpo::TokenBatch::<A<B>>::new(std::iter::once((p.as_slice(), r.as_slice())), device);
    let w = Tensor::<A<B>, 2>::full([1, resp], -1.0 / resp as f32, device);
    let mut update = Update::<A<B>, CausalLm<A<B>>>::new(UpdateConfig::recipe());
    let secs = time(args.iters, || {
        let m = model.take().expect("model");
        let grads =
            conrub_contracts::loss_gradients(&m, &tf, &mut |lp| (lp.logprobs * w.clone()).sum())
                .expect("a whole policy backward does not fail");
        let (next, norm) = update.apply(m, grads);
        let _ = norm.into_scalar();
        model = Some(next);
    });
    table.push((
        format!(
            "0.6B shape train step, 1 x {} tokens, bf16-mixed + fused attention + checkpointing",
            prompt + resp
        ),
        format!("{:.1} ms", secs * 1e3),
        format!("{:.0} tokens/s", (prompt + resp) as f64 / secs),
    ));
}

/// A rollout of the published shape at the 0.6B shape: 8 prompts x 8 responses x 1,024 new
/// tokens (no stop token), bf16-mixed, the rollout engine with its default pool.
fn rollout_timing<B: KernelOps>(device: &B::Device, table: &mut Table) -> Result<()> {
    let cfg = ModelConfig::qwen3_0_6b();
    let exec = conrub_models::Execution {
        precision: conrub_models::Precision::Bf16Mixed,
        ..Default::default()
    };
    let model = CausalLm::<B>::random(&cfg, 0.02, 13, device).with_execution(exec);
    let prompts: Vec<Vec<u32>> = (0..64)
        .map(|r| {
            (0..256)
                .map(|i| (((r / 8) * 7919 + i * 13) % 150_000) as u32)
                .collect()
        })
        .collect();
    let sampling = conrub_rollout::SamplingConfig {
        max_new_tokens: 1024,
        seed: 3,
        ..Default::default()
    };
    let start = std::time::Instant::now();
    let out = conrub_rollout::rollout(
        &model,
        &prompts,
        &sampling,
        &conrub_rollout::EngineConfig::default(),
        device,
    )?;
    let secs = start.elapsed().as_secs_f64();
    let s = &out.stats;
    table.push((
                "0.6B shape rollout, 8 prompts x 8 x 1,024 new tokens, bf16-mixed, paged engine".to_string(),
                format!("{:.1} s", secs),
                format!(
                    "{:.0} tokens/s; {} prompt prefills, {} decode steps, peak {} of {} KV blocks, {} preemptions",
                    s.generated_tokens as f64 / secs,
                    s.prompt_prefills,
                    s.decode_steps,
                    s.peak_kv_blocks,
                    s.kv_blocks,
                    s.preemptions
                ),
            ));
    Ok(())
}

/// Fused causal attention on `B` against the textbook graph on the CPU (flex; bf16 there too):
/// out, dq, dk, dv of a GQA layout (16 query heads over 8), head_dim 128, 300 queries, padded keys.
#[cfg(feature = "flex")]
fn attention_parity<B: KernelOps>(
    device: &B::Device,
    dtype: burn::tensor::DType,
) -> Vec<(&'static str, f64)> {
    let shape = [2, 16, 8, 300, 128];
    let portable = Some(conrub_kernels::AttentionKernels::Portable);
    let fused = attention_run::<B>(device, dtype, portable, shape);
    let naive = attention_run::<burn::backend::Flex>(&Default::default(), dtype, None, shape);
    ["out", "d q", "d k", "d v"]
        .into_iter()
        .zip(fused.iter().zip(&naive))
        .map(|(n, (a, b))| (n, relative_error(a, b)))
        .collect()
}

/// Out, dq, dk, dv of one attention on `B` (fused under `kernels`, or the textbook graph when
/// `None`) of `[batch, heads, kv_heads, t, head_dim]`, as f32 host vectors.
#[cfg(feature = "flex")]
fn attention_run<B: KernelOps>(
    device: &B::Device,
    dtype: burn::tensor::DType,
    kernels: Option<conrub_kernels::AttentionKernels>,
    [b, nh, nkv, t, d]: [usize; 5],
) -> [Vec<f32>; 4] {
    use burn::tensor::DType;
    use conrub_kernels::{causal_attention, reference::naive_causal_attention, AttentionLayout};
    let mk = |shape: [usize; 4], seed: u64| {
        let n = shape.iter().product();
        Tensor::<Autodiff<B>, 4>::from_data(
            TensorData::new(seeded_uniform(n, seed, 1.0), shape),
            device,
        )
        .cast(dtype)
        .require_grad()
    };
    let mut valid = vec![1.0f32; b * t];
    for j in 5..40 {
        // Keys 5..40 of the last row are padding; key 0 keeps every query row visible.
        valid[(b - 1) * t + j] = 0.0;
    }
    let (q, k, v) = (
        mk([b, nh, t, d], 21),
        mk([b, nkv, t, d], 22),
        mk([b, nkv, t, d], 23),
    );
    let kv = Tensor::<Autodiff<B>, 2>::from_data(TensorData::new(valid, [b, t]), device);
    let layout = AttentionLayout::new(0, 1.0 / (d as f64).sqrt());
    let out = match kernels {
        Some(kernels) => causal_attention(
            q.clone(),
            k.clone(),
            v.clone(),
            kv,
            AttentionLayout { kernels, ..layout },
        ),
        None => naive_causal_attention(q.clone(), k.clone(), v.clone(), kv, layout),
    };
    let g = Tensor::<Autodiff<B>, 4>::from_data(
        TensorData::new(seeded_uniform(b * nh * t * d, 24, 1.0), [b, nh, t, d]),
        device,
    );
    let grads = (out.clone().cast(DType::F32) * g).sum().backward();
    let f = |x: Tensor<B, 4>| host(x.cast(DType::F32));
    [
        f(out.inner()),
        f(q.grad(&grads).unwrap()),
        f(k.grad(&grads).unwrap()),
        f(v.grad(&grads).unwrap()),
    ]
}

fn print_table(rows: &[(String, String, String)]) {
    let w = rows.iter().map(|r| r.0.len()).max().unwrap_or(0);
    for (a, b, c) in rows {
        outln!("{a:<w$}  {b:>12}  {c}");
    }
}

/// `conrub kernels check`.
pub fn run(args: KernelsArgs) -> Result<()> {
    let device = args.device.clone();
    run_on_device(&device, args)
}
