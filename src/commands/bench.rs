//! `conrub bench`: conrub's side of the GPU benchmark against PyTorch (`benches/gpu/`; the
//! PyTorch side is `benches/gpu/torch_side.py`, `benches/gpu/compare.py` runs both and prints
//! the table). Each run prints one JSON line in the PyTorch side's format.
//!
//! - `bench train`: one training step (forward, backward, global clipping, AdamW) of a
//!   policy of a released shape with random weights, `bf16-mixed`, fused attention, per-layer
//!   activation checkpointing when asked; `rows` sequences of `seq` tokens, the log-probability of
//!   every token after the first, weighted like a policy-gradient loss. The first (cold) step and
//!   the timed ones are reported, with the kernels each compiled.
//! - `bench rollout`: the rollout engine, `rows` prompts of `prompt` tokens, exactly `new` new
//!   tokens each (no stop token), sampling at temperature 1, `bf16-mixed`; tokens/s and the bound
//!   of reading the weights and the KV cache once per decode step at `--bandwidth-gbs`.
//! - `bench sampling`: one token per row at the full vocabulary (greedy, whole distribution,
//!   top-k, top-p) against one softmax over the same logits, one JSON line per operation with its
//!   ratio to the softmax (`conrub_kernels::sampling_bench`; `benches/sampling.rs` prints the
//!   same as a table).

use std::time::Instant;

use anyhow::Result;
use burn::backend::Autodiff;
use burn::tensor::Tensor;
use clap::{Args, Subcommand, ValueEnum};
use conrub_kernels::KernelOps;
use conrub_models::{CausalLm, ModelConfig};

use crate::backend::{run_on_device, BackendTask};

/// The shapes both sides of the benchmark know (`benches/gpu/torch_side.py`'s `SHAPES`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Shape {
    /// `ModelConfig::tiny` at the full vocabulary: for checking the command on a CPU.
    Tiny,
    /// The 0.6B shape (hidden 1,024, 28 layers, 16/8 heads of 128).
    #[value(name = "0.6b")]
    Qwen06b,
    /// The 4B shape (hidden 2,560, 36 layers, 32/8 heads of 128).
    #[value(name = "4b")]
    Qwen4b,
}

impl Shape {
    fn name(self) -> &'static str {
        match self {
            Shape::Tiny => "tiny",
            Shape::Qwen06b => "0.6b",
            Shape::Qwen4b => "4b",
        }
    }

    fn config(self) -> ModelConfig {
        match self {
            Shape::Tiny => ModelConfig::tiny(151_936),
            Shape::Qwen06b => ModelConfig::qwen3_0_6b(),
            Shape::Qwen4b => {
                let mut c = ModelConfig::qwen3_0_6b();
                c.hidden_size = 2560;
                c.intermediate_size = 9728;
                c.num_hidden_layers = 36;
                c.num_attention_heads = 32;
                c.num_key_value_heads = Some(8);
                c.head_dim = Some(128);
                c
            }
        }
    }
}

/// Weights that take part in matmuls per token (every projection and the LM head).
fn matmul_params(c: &ModelConfig) -> f64 {
    let h = c.hidden_size as f64;
    let d = c.head_dim.unwrap_or(c.hidden_size / c.num_attention_heads) as f64;
    let q = c.num_attention_heads as f64 * d;
    let kv = c.num_key_value_heads.unwrap_or(c.num_attention_heads) as f64 * d;
    let per_layer = h * q + 2.0 * h * kv + q * h + 3.0 * h * c.intermediate_size as f64;
    c.num_hidden_layers as f64 * per_layer + c.vocab_size as f64 * h
}

/// Model FLOPs of one training step: 3 x forward; forward = 2 x matmul weights per token plus
/// causal attention's two products over the mean context `seq / 2` (the PyTorch side's formula).
fn train_flops(c: &ModelConfig, rows: usize, seq: usize) -> f64 {
    let d = c.head_dim.unwrap_or(c.hidden_size / c.num_attention_heads) as f64;
    let attn =
        4.0 * c.num_hidden_layers as f64 * c.num_attention_heads as f64 * d * (seq as f64 / 2.0);
    3.0 * (rows * seq) as f64 * (2.0 * matmul_params(c) + attn)
}

/// `conrub bench`.
#[derive(Subcommand, Clone)]
pub enum BenchCommand {
    /// One training step (see the module docs).
    Train(TrainBench),
    /// One rollout (see the module docs).
    Rollout(RolloutBench),
    /// Sampling one token per row at the full vocabulary against one softmax over the same
    /// logits (`conrub_kernels::sampling_bench`).
    Sampling(SamplingBench),
    /// Causal attention forward and forward + backward (TFLOP/s) under the portable and the
    /// tensor-core kernels, and paged decode with and without key splits against the gather
    /// fallback (`conrub_kernels::attention_bench`).
    Attention(AttentionBench),
}

/// Arguments of `conrub bench attention`.
#[derive(Args, Clone)]
pub struct AttentionBench {
    /// Training sequence lengths (queries = keys), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "2048,8192")]
    pub seq: Vec<usize>,
    /// Query heads, key/value heads and head dimension (the 4B shape's by default).
    #[arg(long, value_delimiter = ',', default_value = "32,8,128")]
    pub heads: Vec<usize>,
    /// Kernels timed (the first is the baseline of `vs_first`): `portable`, `tensor-core`,
    /// `tiled-units`.
    #[arg(long, value_delimiter = ',', default_value = "portable,tensor-core")]
    pub kernels: Vec<String>,
    /// Decode cases as ROWSxKEYS, comma-separated (empty: none).
    #[arg(long, value_delimiter = ',', default_value = "64x2048,1x32768")]
    pub decode: Vec<String>,
    /// Input dtype: `bf16`, `f16` or `f32`.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Timed calls per case after one untimed call (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub iters: usize,
    /// Device.
    #[arg(long, default_value = "cuda")]
    pub device: String,
}

/// Arguments of `conrub bench sampling`.
#[derive(Args, Clone)]
pub struct SamplingBench {
    /// Rows (sequences decoding at once).
    #[arg(long, default_value_t = 256)]
    pub rows: usize,
    /// Vocabulary (151,936 by default, the bundled tokenizer's).
    #[arg(long, default_value_t = 151_936)]
    pub vocab: usize,
    /// Timed calls per mode after one untimed call (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub iters: usize,
    /// Device.
    #[arg(long, default_value = "cuda")]
    pub device: String,
}

/// Arguments of `conrub bench train`.
#[derive(Args, Clone)]
pub struct TrainBench {
    /// Model shape.
    #[arg(long, value_enum, default_value = "0.6b")]
    pub shape: Shape,
    /// Sequences per step.
    #[arg(long, default_value_t = 8)]
    pub rows: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 2048)]
    pub seq: usize,
    /// Per-layer activation checkpointing.
    #[arg(long)]
    pub checkpointing: bool,
    /// Timed steps after the first (the fastest is reported).
    #[arg(long, default_value_t = 2)]
    pub iters: usize,
    /// Device.
    #[arg(long, default_value = "cuda")]
    pub device: String,
    /// Dense bf16 peak of the device for MFU (989: H100 / H200 SXM).
    #[arg(long, default_value_t = 989.0)]
    pub peak_tflops: f64,
}

/// Arguments of `conrub bench rollout`.
#[derive(Args, Clone)]
pub struct RolloutBench {
    /// Model shape.
    #[arg(long, value_enum, default_value = "0.6b")]
    pub shape: Shape,
    /// Sequences.
    #[arg(long, default_value_t = 64)]
    pub rows: usize,
    /// Prompt tokens per sequence.
    #[arg(long, default_value_t = 256)]
    pub prompt: usize,
    /// New tokens per sequence (all of them: no stop token).
    #[arg(long, default_value_t = 1024)]
    pub new: usize,
    /// Timed rollouts after the first (the fastest is reported).
    #[arg(long, default_value_t = 1)]
    pub iters: usize,
    /// Device.
    #[arg(long, default_value = "cuda")]
    pub device: String,
    /// Device memory bandwidth for the bound (3,350 GB/s: H100 SXM; 4,800: H200).
    #[arg(long, default_value_t = 3350.0)]
    pub bandwidth_gbs: f64,
}

/// Runs `conrub bench`.
pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Train(a) => run_on_device(&a.device.clone(), a),
        BenchCommand::Rollout(a) => run_on_device(&a.device.clone(), a),
        BenchCommand::Sampling(a) => run_on_device(&a.device.clone(), a),
        BenchCommand::Attention(a) => run_on_device(&a.device.clone(), a),
    }
}

fn events() -> conrub_kernels::events::KernelEvents {
    conrub_kernels::events::snapshot().unwrap_or_default()
}

fn device_name(spec: &str) -> String {
    #[cfg(feature = "cuda")]
    if spec.starts_with("cuda") {
        let index = spec
            .strip_prefix("cuda:")
            .and_then(|i| i.parse().ok())
            .unwrap_or(0);
        if let Ok(id) = conrub_kernels::kernel_cache::cuda_identity(index) {
            return id.name;
        }
    }
    spec.to_string()
}

/// The step's training peak by conrub's memory plan: one micro-batch of the whole step (no
/// gradient sum), no rollout; `None` when it fits `gpu_bytes`, else why not.
fn does_not_fit(cfg: &ModelConfig, a: &TrainBench, gpu_bytes: u64) -> Option<String> {
    let input = conrub_memory::MemoryPlanInput {
        precision: conrub_models::Precision::Bf16Mixed,
        activation_checkpointing: a.checkpointing,
        micro_batch_tokens: a.rows * a.seq,
        group_size: a.rows,
        prompts_per_step: 1,
        mini_batches: 1,
        rollout_prompts_per_call: 1,
        max_prompt_tokens: 1,
        max_response_tokens: a.seq - 1,
        rollout_in_process: false,
        gpu_memory_gb: gpu_bytes as f64 / 1e9,
        ..conrub_memory::MemoryPlanInput::new(cfg.shape())
    };
    let plan = conrub_memory::MemoryPlan::new(input);
    (plan.training_peak > gpu_bytes as f64).then(|| {
        format!(
            "conrub plan: training peak {:.1} GB > {:.1} GB of device memory",
            plan.training_peak / 1e9,
            gpu_bytes as f64 / 1e9
        )
    })
}

impl BackendTask for TrainBench {
    fn run<B: KernelOps>(self, device: B::Device) -> Result<()> {
        use conrub_grpo::{Update, UpdateConfig};
        type A<B> = Autodiff<B>;
        let cfg = self.shape.config();
        anyhow::ensure!(self.seq >= 2, "--seq: at least 2 tokens");
        if let Some(gpu) = crate::backend::device_memory_bytes(&self.device)? {
            if let Some(why) = does_not_fit(&cfg, &self, gpu) {
                let record = serde_json::json!({
                    "side": "conrub", "what": "train", "shape": self.shape.name(),
                    "rows": self.rows, "seq": self.seq, "skipped": why,
                });
                outln!("{record}");
                return Ok(());
            }
        }
        let exec = conrub_models::Execution {
            precision: conrub_models::Precision::Bf16Mixed,
            attention: conrub_models::AttentionImpl::Fused,
            activation_checkpointing: self.checkpointing,
            ..Default::default()
        };
        let mut model =
            Some(CausalLm::<A<B>>::random(&cfg, 0.02, 11, &device).with_execution(exec));
        // Row r: one prompt token, then seq - 1 response tokens whose log-probabilities count.
        let rows: Vec<(Vec<u32>, Vec<u32>)> = (0..self.rows)
            .map(|r| {
                let ids: Vec<u32> = (0..self.seq)
                    .map(|i| ((r * 7919 + i * 13 + 5) % 150_000) as u32)
                    .collect();
                (ids[..1].to_vec(), ids[1..].to_vec())
            })
            .collect();
        let batch = conrub_grpo::TokenBatch::<A<B>>::new(
            rows.iter().map(|(p, r)| (p.as_slice(), r.as_slice())),
            &device,
        );
        let targets = self.rows * (self.seq - 1);
        let w = Tensor::<A<B>, 2>::full([self.rows, self.seq - 1], -1.0 / targets as f32, &device);
        let mut update = Update::<A<B>, CausalLm<A<B>>>::new(UpdateConfig::recipe());
        let mut step = || {
            let start = Instant::now();
            let before = events();
            let m = model.take().expect("model");
            let grads = conrub_contracts::loss_gradients(&m, &batch, &mut |lp| {
                (lp.logprobs * w.clone()).sum()
            })
            .expect("a whole policy backward does not fail");
            let (next, norm) = update.apply(m, grads);
            let _ = norm.into_scalar();
            model = Some(next);
            (start.elapsed().as_secs_f64(), events().since(&before))
        };
        let (first, first_events) = step();
        let timed: Vec<(f64, conrub_kernels::events::KernelEvents)> =
            (0..self.iters).map(|_| step()).collect();
        let secs = timed.iter().map(|t| t.0).fold(first, f64::min);
        let flops = train_flops(&cfg, self.rows, self.seq);
        let record = serde_json::json!({
            "side": "conrub",
            "what": "train",
            "shape": self.shape.name(),
            "rows": self.rows,
            "seq": self.seq,
            "checkpointing": self.checkpointing,
            "device": device_name(&self.device),
            "first_step_secs": first,
            "first_step_kernel_compiles": first_events.kernel_compiles,
            "first_step_autotune_runs": first_events.autotune_runs,
            "timed_kernel_compiles": timed.iter().map(|t| t.1.kernel_compiles).collect::<Vec<_>>(),
            "secs": secs,
            "tokens_per_s": (self.rows * self.seq) as f64 / secs,
            "tflops": flops / secs / 1e12,
            "mfu": flops / secs / (self.peak_tflops * 1e12),
        });
        outln!("{record}");
        Ok(())
    }
}

impl BackendTask for SamplingBench {
    /// One JSON line per timed operation, with its ratio to the softmax.
    fn run<B: KernelOps>(self, device: B::Device) -> Result<()> {
        let cube = self.device.starts_with("wgpu") || self.device.starts_with("cuda");
        let timings = conrub_kernels::sampling_bench::sampling_timings::<B>(
            &device,
            [self.rows, self.vocab],
            self.iters,
            cube,
        );
        let base = timings[0].secs;
        for t in &timings {
            let record = serde_json::json!({
                "bench": "sampling",
                "device": device_name(&self.device),
                "op": t.label,
                "rows": self.rows,
                "vocab": self.vocab,
                "secs": t.secs,
                "us_per_row": t.secs * 1e6 / self.rows as f64,
                "vs_softmax": t.secs / base,
            });
            outln!("{record}");
        }
        Ok(())
    }
}

impl AttentionBench {
    /// The checked arguments: heads, kernels, decode cases, dtype.
    #[allow(clippy::type_complexity)]
    fn parsed(
        &self,
    ) -> Result<(
        [usize; 3],
        Vec<conrub_kernels::AttentionKernels>,
        Vec<[usize; 2]>,
        burn::tensor::DType,
    )> {
        use conrub_kernels::AttentionKernels as K;
        let [h, kv, d] = self.heads[..] else {
            anyhow::bail!(
                "--heads: expected HEADS,KV_HEADS,HEAD_DIM, got {:?}",
                self.heads
            );
        };
        anyhow::ensure!(
            kv > 0 && h % kv == 0 && d > 0,
            "--heads: {h} query heads are not a multiple of {kv} key/value heads (head_dim {d})"
        );
        let kernels = self
            .kernels
            .iter()
            .map(|k| match k.as_str() {
                "portable" => Ok(K::Portable),
                "tensor-core" => Ok(K::TensorCore),
                "tiled-units" => Ok(K::TiledUnits),
                other => Err(anyhow::anyhow!(
                    "--kernels: `{other}` (allowed: portable, tensor-core, tiled-units)"
                )),
            })
            .collect::<Result<Vec<_>>>()?;
        let decode = self
            .decode
            .iter()
            .filter(|c| !c.is_empty())
            .map(|c| {
                let parsed = c
                    .split_once('x')
                    .and_then(|(r, k)| Some([r.parse().ok()?, k.parse().ok()?]));
                parsed.ok_or_else(|| anyhow::anyhow!("--decode: `{c}` is not ROWSxKEYS"))
            })
            .collect::<Result<Vec<_>>>()?;
        let dtype = match self.dtype.as_str() {
            "bf16" => burn::tensor::DType::BF16,
            "f16" => burn::tensor::DType::F16,
            "f32" => burn::tensor::DType::F32,
            other => anyhow::bail!("--dtype: `{other}` (allowed: bf16, f16, f32)"),
        };
        Ok(([h, kv, d], kernels, decode, dtype))
    }
}

impl BackendTask for AttentionBench {
    /// One JSON line per timed case: seconds, TFLOP/s, and the ratio to the first kernels' time
    /// (training) or to the gather fallback (decode).
    fn run<B: KernelOps>(self, device: B::Device) -> Result<()> {
        use conrub_kernels::attention_bench::{decode_timings, training_timings};
        let ([h, kv, d], kernels, decode, dtype) = self.parsed()?;
        for k in &kernels {
            if *k == conrub_kernels::AttentionKernels::TensorCore {
                B::check_attention_kernels(&device, *k)
                    .map_err(|why| anyhow::anyhow!("--kernels tensor-core: {why}"))?;
            }
        }
        let name = device_name(&self.device);
        for &t in &self.seq {
            let timings =
                training_timings::<B>(&device, [1, h, kv, t, d], dtype, &kernels, self.iters);
            for tm in &timings {
                let base = timings
                    .iter()
                    .find(|b| b.op == tm.op)
                    .map(|b| b.secs)
                    .unwrap_or(tm.secs);
                let record = serde_json::json!({
                    "bench": "attention",
                    "device": name,
                    "op": tm.op,
                    "kernels": tm.kernels,
                    "dtype": self.dtype,
                    "heads": [h, kv, d],
                    "tokens": tm.tokens,
                    "secs": tm.secs,
                    "tflops": tm.tflops,
                    "vs_first": tm.secs / base,
                });
                outln!("{record}");
            }
        }
        for [rows, keys] in decode {
            let timings = decode_timings::<B>(&device, [rows, keys, h, kv, d], dtype, self.iters);
            let gather = timings.last().map(|g| g.secs).unwrap_or(1.0);
            for tm in &timings {
                let record = serde_json::json!({
                    "bench": "attention",
                    "device": name,
                    "op": tm.op,
                    "kernels": tm.kernels,
                    "dtype": self.dtype,
                    "heads": [h, kv, d],
                    "rows": rows,
                    "tokens": keys,
                    "secs": tm.secs,
                    "vs_gather": tm.secs / gather,
                });
                outln!("{record}");
            }
        }
        Ok(())
    }
}

impl BackendTask for RolloutBench {
    fn run<B: KernelOps>(self, device: B::Device) -> Result<()> {
        let cfg = self.shape.config();
        let exec = conrub_models::Execution {
            precision: conrub_models::Precision::Bf16Mixed,
            ..Default::default()
        };
        let model = CausalLm::<B>::random(&cfg, 0.02, 13, &device).with_execution(exec);
        let prompts: Vec<Vec<u32>> = (0..self.rows)
            .map(|r| {
                (0..self.prompt)
                    .map(|i| ((r * 7919 + i * 13) % 150_000) as u32)
                    .collect()
            })
            .collect();
        let sampling = conrub_rollout::SamplingConfig {
            max_new_tokens: self.new,
            seed: 3,
            ..Default::default()
        };
        let run = || -> Result<(f64, conrub_rollout::RolloutStats, u64)> {
            let start = Instant::now();
            let before = events();
            let out = conrub_rollout::rollout(
                &model,
                &prompts,
                &sampling,
                &conrub_rollout::EngineConfig::default(),
                &device,
            )?;
            Ok((
                start.elapsed().as_secs_f64(),
                out.stats,
                events().since(&before).kernel_compiles,
            ))
        };
        let (first, _, first_compiles) = run()?;
        let mut secs = first;
        let mut stats = None;
        for _ in 0..self.iters {
            let (s, st, _) = run()?;
            secs = secs.min(s);
            stats = Some(st);
        }
        let stats = match stats {
            Some(s) => s,
            None => run()?.1,
        };
        // A decode step reads the bf16 weights once and every row's keys and values so far; over
        // the rollout the mean context is prompt + new / 2.
        let weights = matmul_params(&cfg) * 2.0;
        let d = cfg
            .head_dim
            .unwrap_or(cfg.hidden_size / cfg.num_attention_heads) as f64;
        let kv_per_token = 2.0
            * cfg.num_hidden_layers as f64
            * cfg.num_key_value_heads.unwrap_or(cfg.num_attention_heads) as f64
            * d
            * 2.0;
        let context = self.prompt as f64 + self.new as f64 / 2.0;
        let step_bytes = weights + self.rows as f64 * context * kv_per_token;
        let bound = self.rows as f64 / (step_bytes / (self.bandwidth_gbs * 1e9));
        let record = serde_json::json!({
            "side": "conrub",
            "what": "rollout",
            "shape": self.shape.name(),
            "rows": self.rows,
            "prompt": self.prompt,
            "new": self.new,
            "device": device_name(&self.device),
            "first_secs": first,
            "first_kernel_compiles": first_compiles,
            "secs": secs,
            "tokens_per_s": stats.generated_tokens as f64 / secs,
            "bandwidth_bound_tokens_per_s": bound,
            "decode_steps": stats.decode_steps,
            "preemptions": stats.preemptions,
        });
        outln!("{record}");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The 4B step of the benchmark (8 x 2,048 tokens, checkpointing) fits an 80 GB H100 by the
    /// plan; the same step without checkpointing at 8 x 8,192 does not.
    #[test]
    fn the_4b_step_fits_an_h100() {
        let c = Shape::Qwen4b.config();
        let a = |rows, seq, checkpointing| TrainBench {
            shape: Shape::Qwen4b,
            rows,
            seq,
            checkpointing,
            iters: 1,
            device: "cuda".into(),
            peak_tflops: 989.0,
        };
        let h100 = 80 * (1 << 30);
        assert_eq!(does_not_fit(&c, &a(8, 2048, true), h100), None);
        assert_eq!(does_not_fit(&c, &a(1, 8192, true), h100), None);
        assert!(does_not_fit(&c, &a(8, 8192, false), h100).is_some());
    }

    /// The FLOP count of the 0.6B shape against a hand count: 28 layers of
    /// (1024 x 2048 + 2 x 1024 x 1024 + 2048 x 1024 + 3 x 1024 x 3072) plus the 151,936 x 1,024
    /// head = 595.6M matmul weights.
    #[test]
    fn flops_of_the_0_6b_shape() {
        let c = Shape::Qwen06b.config();
        let per_layer = 1024.0 * 2048.0 * 2.0 + 2.0 * 1024.0 * 1024.0 + 3.0 * 1024.0 * 3072.0;
        let want = 28.0 * per_layer + 151_936.0 * 1024.0;
        assert_eq!(matmul_params(&c), want);
        let attn = 4.0 * 28.0 * 16.0 * 128.0 * 1024.0;
        assert_eq!(
            train_flops(&c, 8, 2048),
            3.0 * 8.0 * 2048.0 * (2.0 * want + attn)
        );
    }
}
