//! `conrub generate`.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use conrub_kernels::KernelOps;
use conrub_models::{ChatOptions, Message, Pretrained};
use conrub_rollout::{Decoding, SamplingConfig, SamplingParams};

use crate::backend::{run_on_device, BackendTask};

/// Arguments of `conrub generate`.
#[derive(Args, Clone)]
#[command(group = clap::ArgGroup::new("input").required(true).args(["prompt", "messages", "ids"]))]
pub struct GenerateArgs {
    /// Model directory or hub id (any supported family: qwen3, llama, qwen2).
    #[arg(long)]
    pub model: String,
    /// A user message, rendered with the chat template (raw text with `--raw` or when the
    /// tokenizer has no template).
    #[arg(long)]
    pub prompt: Option<String>,
    /// JSON file with chat messages.
    #[arg(long)]
    pub messages: Option<PathBuf>,
    /// Prompt token ids, comma-separated (works without tokenizer files).
    #[arg(long)]
    pub ids: Option<String>,
    /// Encode `--prompt` as raw text, without the chat template.
    #[arg(long)]
    pub raw: bool,
    /// Maximum number of new tokens.
    #[arg(long, default_value_t = 128)]
    pub max_new_tokens: usize,
    /// Sampling temperature (default: generation_config.json, else 1.0).
    #[arg(long)]
    pub temperature: Option<f64>,
    /// Nucleus threshold (default: generation_config.json, else 1.0).
    #[arg(long)]
    pub top_p: Option<f64>,
    /// Top-k (default: generation_config.json, else off).
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Repetition penalty on the ids of the prompt and of the tokens so far when sampling
    /// (default: generation_config.json, else 1.0, off); refused with --greedy.
    #[arg(long)]
    pub repetition_penalty: Option<f64>,
    /// Random seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Greedy decoding.
    #[arg(long, conflicts_with_all = ["temperature", "top_p", "top_k"])]
    pub greedy: bool,
    /// Extra stop token ids, comma-separated (added to the model's EOS ids).
    #[arg(long)]
    pub stop_ids: Option<String>,
    /// Render the chat template with `enable_thinking=False`.
    #[arg(long)]
    pub no_thinking: bool,
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
    /// Print one JSON object: new_tokens, text, token_logprobs, finish_reason.
    #[arg(long)]
    pub json: bool,
}

impl BackendTask for GenerateArgs {
    fn run<B: KernelOps>(self, device: B::Device) -> Result<()> {
        let qwen = Pretrained::<B>::load(&self.model, &device)?.with_execution(
            crate::backend::inference_execution::<B>(
                self.precision,
                self.attention_kernels,
                &device,
            )?,
        );
        let tok = qwen.tokenizer.as_ref();
        let prompt: Vec<u32> = if let Some(ids) = &self.ids {
            super::parse_ids(ids)?
        } else {
            let tok = tok.with_context(|| {
                format!(
                    "{}: no tokenizer.json; pass --ids instead of text",
                    qwen.dir.display()
                )
            })?;
            let opts = ChatOptions {
                add_generation_prompt: true,
                enable_thinking: self.no_thinking.then_some(false),
            };
            match (&self.prompt, &self.messages) {
                (Some(text), _) if self.raw || tok.chat_template().is_none() => tok.encode(text)?,
                (Some(text), _) => tok.apply_chat_template(&[Message::user(text)], opts)?,
                (None, Some(path)) => {
                    tok.apply_chat_template(&super::read_messages(path)?, opts)?
                }
                (None, None) => bail!("one of --prompt, --messages or --ids is required"),
            }
        };
        if self.greedy && self.repetition_penalty.is_some_and(|p| p != 1.0) {
            bail!("--repetition-penalty applies when sampling: --greedy decoding takes none");
        }
        let defaults = qwen.generation_config.clone().unwrap_or_default();
        let mut stop_ids = qwen.stop_ids();
        if let Some(extra) = &self.stop_ids {
            stop_ids.extend(super::parse_ids(extra).context("--stop-ids")?);
        }
        let cfg = SamplingConfig {
            max_new_tokens: self.max_new_tokens,
            decoding: if self.greedy {
                Decoding::Greedy
            } else {
                Decoding::Sample(SamplingParams {
                    temperature: self.temperature.or(defaults.temperature).unwrap_or(1.0),
                    top_p: self.top_p.or(defaults.top_p).unwrap_or(1.0),
                    top_k: self.top_k.or(defaults.top_k).filter(|&k| k > 0),
                    min_p: 0.0,
                    repetition_penalty: self
                        .repetition_penalty
                        .or(defaults.repetition_penalty)
                        .unwrap_or(1.0),
                })
            },
            seed: self.seed,
            stop_ids,
            first_stream: 0,
        };
        let out = qwen
            .generate(&[prompt], &cfg, &device)?
            .pop()
            .expect("one generation");
        let text = match tok {
            Some(t) => Some(t.decode(&out.tokens, true)?),
            None => None,
        };
        if self.json {
            outln!(
                "{}",
                serde_json::json!({
                    "new_tokens": out.tokens,
                    "text": text,
                    "token_logprobs": out.logprobs,
                    "finish_reason": out.finish_reason,
                })
            );
        } else {
            match text {
                Some(t) => outln!("{t}"),
                None => outln!(
                    "{}",
                    out.tokens
                        .iter()
                        .map(u32::to_string)
                        .collect::<Vec<_>>()
                        .join(",")
                ),
            }
            tracing::info!(
                "[{} tokens, finish_reason={:?}]",
                out.tokens.len(),
                out.finish_reason
            );
        }
        Ok(())
    }
}

/// Runs the command.
pub fn run(args: GenerateArgs) -> Result<()> {
    let device = args.device.clone();
    run_on_device(&device, args)
}
