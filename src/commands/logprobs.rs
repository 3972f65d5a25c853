//! `conrub logprobs`.

use anyhow::{bail, Result};
use clap::Args;
use conrub_kernels::KernelOps;
use conrub_models::{score_sequences, Pretrained};

use crate::backend::{run_on_device, BackendTask};

/// Arguments of `conrub logprobs`.
#[derive(Args)]
pub struct LogprobsArgs {
    /// Model directory or hub id.
    #[arg(long)]
    pub model: String,
    /// Comma-separated token ids.
    #[arg(long)]
    pub ids: String,
    /// Device: cpu (default), ndarray, flex, wgpu[:N], cuda[:N], tch[:cpu|:cuda:N].
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Compute precision: `f32` or `bf16-mixed` (bf16 activations, f32 weights and statistics).
    #[arg(long, default_value = "f32", value_parser = crate::backend::parse_precision)]
    pub precision: conrub_models::Precision,
    /// Attention kernels on CubeCL devices: `auto`, `tensor-core` (an error without cooperative
    /// matrices) or `portable`.
    #[arg(long, default_value = "auto", value_parser = crate::backend::parse_attention_kernels)]
    pub attention_kernels: conrub_models::AttentionKernelChoice,
    /// Print `{"token_logprobs": [...], "argmax": [...]}`.
    #[arg(long)]
    pub json: bool,
}

struct Task {
    model: String,
    ids: Vec<u32>,
    json: bool,
    precision: conrub_models::Precision,
    attention_kernels: conrub_models::AttentionKernelChoice,
}

impl BackendTask for Task {
    fn run<B: KernelOps>(self, device: B::Device) -> Result<()> {
        let qwen = Pretrained::<B>::load(&self.model, &device)?.with_execution(
            crate::backend::inference_execution::<B>(
                self.precision,
                self.attention_kernels,
                &device,
            )?,
        );
        let scores = score_sequences(&qwen.model, &[self.ids], qwen.pad_id(), &device)?
            .pop()
            .expect("one sequence");
        if let Some((i, x)) = scores
            .token_logprobs
            .iter()
            .enumerate()
            .find(|(_, x)| !x.is_finite())
        {
            bail!(
                "{}: the log-probability of token {} is {x} (the model's outputs are not finite)",
                self.model,
                i + 1
            );
        }
        if self.json {
            outln!(
                "{}",
                serde_json::json!({ "token_logprobs": scores.token_logprobs, "argmax": scores.argmax })
            );
        } else {
            outln!("token_logprobs: {:?}", scores.token_logprobs);
            outln!("argmax: {:?}", scores.argmax);
        }
        Ok(())
    }
}

/// Runs the command.
pub fn run(args: LogprobsArgs) -> Result<()> {
    let ids = super::parse_ids(&args.ids)?;
    run_on_device(
        &args.device,
        Task {
            model: args.model,
            ids,
            json: args.json,
            precision: args.precision,
            attention_kernels: args.attention_kernels,
        },
    )
}
