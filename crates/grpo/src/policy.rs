//! The `Policy` trait: what the learner needs from a model. Qwen3 implements it; a user's own burn
//! model can too.

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use conrub_kernels::{token_logprobs, GrpoOps, DEFAULT_CHUNK_TOKENS};
use conrub_qwen3::{PaddedBatch, Padding, Qwen3ForCausalLM, SamplingConfig};
use serde::{Deserialize, Serialize};

/// Prompt and response token ids of a batch of rollouts.
#[derive(Debug, Clone, PartialEq)]
pub struct RolloutTokens {
    /// Prompt ids per row (chat-templated).
    pub prompts: Vec<Vec<u32>>,
    /// Response ids per row (the stop token included when one was sampled).
    pub responses: Vec<Vec<u32>>,
}

/// Host-side teacher-forcing layout: `prompt ++ response`, right-padded to `seq_len`; response
/// token `j` of row `i` is predicted at position `prompt_len(i) - 1 + j`.
#[derive(Debug, Clone, PartialEq)]
pub struct TeacherForcing {
    /// Rows.
    pub rows: usize,
    /// Longest `prompt ++ response`.
    pub seq_len: usize,
    /// Longest response (`R`); outputs are `[rows, R]`.
    pub response_len: usize,
    /// `prompt ++ response` per row.
    pub sequences: Vec<Vec<u32>>,
    /// Predicting position of each response slot, `[rows * R]` (0 for padding slots).
    pub positions: Vec<i64>,
    /// Target ids, `[rows * R]` (0 for padding slots).
    pub targets: Vec<i64>,
    /// 1 for real response tokens, `[rows * R]`.
    pub mask: Vec<f32>,
}

impl RolloutTokens {
    /// The teacher-forcing layout. Every prompt must be non-empty.
    pub fn teacher_forcing(&self) -> TeacherForcing {
        let rows = self.prompts.len();
        let response_len = self.responses.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let sequences: Vec<Vec<u32>> =
            self.prompts.iter().zip(&self.responses).map(|(p, r)| p.iter().chain(r).copied().collect()).collect();
        let seq_len = sequences.iter().map(Vec::len).max().unwrap_or(0);
        let mut positions = vec![0i64; rows * response_len];
        let mut targets = vec![0i64; rows * response_len];
        let mut mask = vec![0f32; rows * response_len];
        for (i, (p, r)) in self.prompts.iter().zip(&self.responses).enumerate() {
            assert!(!p.is_empty(), "row {i}: empty prompt");
            for (j, &tok) in r.iter().enumerate() {
                positions[i * response_len + j] = (p.len() - 1 + j) as i64;
                targets[i * response_len + j] = tok as i64;
                mask[i * response_len + j] = 1.0;
            }
        }
        TeacherForcing { rows, seq_len, response_len, sequences, positions, targets, mask }
    }
}

/// Settings of rollout sampling.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SampleSettings {
    /// Longest response in tokens.
    pub max_new_tokens: usize,
    /// Sampling temperature.
    pub temperature: f64,
    /// Nucleus threshold (1 disables).
    pub top_p: f64,
    /// Top-k (`None` disables).
    pub top_k: Option<usize>,
    /// Seed of this call (row `i` uses its own stream derived from it).
    pub seed: u64,
    /// Ids that end a response.
    pub stop_ids: Vec<u32>,
}

/// One sampled response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Response ids.
    pub tokens: Vec<u32>,
    /// Log-probability of each token under the sampling distribution.
    pub logprobs: Vec<f32>,
    /// True when the response hit `max_new_tokens` without a stop token.
    pub truncated: bool,
}

/// What the learner needs from a model.
pub trait Policy<B: Backend>: Module<B> {
    /// `log p(response[j] | prompt, response[..j])` as `[rows, R]` (0 on padding slots), differentiable.
    fn response_logprobs(&self, batch: &TeacherForcing, device: &B::Device) -> Tensor<B, 2>;

    /// [`Policy::response_logprobs`] plus, where the model computes it in the same pass, the entropy
    /// of each next-token distribution `[rows, R]` (telemetry only, no gradient).
    fn response_logprobs_and_entropy(&self, batch: &TeacherForcing, device: &B::Device) -> (Tensor<B, 2>, Option<Tensor<B, 2>>) {
        (self.response_logprobs(batch, device), None)
    }

    /// Samples one response per prompt (no gradient is needed; the learner calls this on the
    /// inner backend).
    fn sample(&self, prompts: &[Vec<u32>], settings: &SampleSettings, device: &B::Device) -> Result<Vec<Sample>, String>;
}

/// The Qwen3 policy computes response log-probabilities with the fused, chunked
/// [`conrub_kernels::token_logprobs`]: only the response positions go through the head, a chunk of
/// [`conrub_kernels::DEFAULT_CHUNK_TOKENS`] tokens at a time, and the backward recomputes each
/// chunk instead of keeping `[tokens, vocab]` probabilities.
impl<B: GrpoOps> Policy<B> for Qwen3ForCausalLM<B> {
    fn response_logprobs(&self, tf: &TeacherForcing, device: &B::Device) -> Tensor<B, 2> {
        self.response_logprobs_and_entropy(tf, device).0
    }

    fn response_logprobs_and_entropy(&self, tf: &TeacherForcing, device: &B::Device) -> (Tensor<B, 2>, Option<Tensor<B, 2>>) {
        let padded = PaddedBatch::new(&tf.sequences, 0, Padding::Right);
        let hidden = self.forward_hidden(&padded.to_device(device), None);
        let [n, _, h] = hidden.dims();
        let r = tf.response_len;
        let pos = Tensor::<B, 1, Int>::from_data(TensorData::new(tf.positions.clone(), [n * r]), device)
            .reshape([n, r, 1])
            .repeat_dim(2, h);
        let picked = hidden.gather(1, pos).reshape([n * r, h]);
        let targets = Tensor::<B, 1, Int>::from_data(TensorData::new(tf.targets.clone(), [n * r]), device);
        let out = token_logprobs(picked, self.head_weight(), targets, DEFAULT_CHUNK_TOKENS);
        let mask = Tensor::<B, 2>::from_data(TensorData::new(tf.mask.clone(), [n, r]), device);
        (out.logprobs.reshape([n, r]) * mask.clone(), Some(out.entropy.reshape([n, r]) * mask))
    }

    fn sample(&self, prompts: &[Vec<u32>], s: &SampleSettings, device: &B::Device) -> Result<Vec<Sample>, String> {
        let cfg = SamplingConfig {
            max_new_tokens: s.max_new_tokens,
            temperature: s.temperature,
            top_p: s.top_p,
            top_k: s.top_k,
            greedy: false,
            seed: s.seed,
            stop_ids: s.stop_ids.clone(),
        };
        let pad = s.stop_ids.first().copied().unwrap_or(0);
        let gens = conrub_qwen3::generate(self, prompts, &cfg, pad, device).map_err(|e| e.to_string())?;
        Ok(gens
            .into_iter()
            .map(|g| Sample {
                truncated: matches!(g.finish_reason, conrub_qwen3::FinishReason::Length),
                tokens: g.tokens,
                logprobs: g.logprobs,
            })
            .collect())
    }
}
