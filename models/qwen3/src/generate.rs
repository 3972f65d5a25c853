//! Batched autoregressive generation with a KV cache, and teacher-forced scoring.

use burn::tensor::activation::log_softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Tensor, TensorData};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::batch::{ForwardBatch, PaddedBatch, Padding};
use crate::cache::KvCache;
use crate::error::{Qwen3Error, Result};
use crate::model::Qwen3ForCausalLM;

/// Decoding settings. The defaults are plain sampling at temperature 1 (what GRPO rollouts use).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingConfig {
    /// Maximum number of new tokens per sequence.
    pub max_new_tokens: usize,
    /// Softmax temperature (> 0; ignored when `greedy`).
    pub temperature: f64,
    /// Nucleus threshold in (0, 1]; 1 disables it.
    pub top_p: f64,
    /// Keep only the `k` most likely tokens; `None` disables it.
    pub top_k: Option<usize>,
    /// Always take the most likely token.
    pub greedy: bool,
    /// Seed; sequence `i` of a call draws from its own stream seeded by `(seed, i)`, so its tokens
    /// do not depend on the other sequences in the batch.
    pub seed: u64,
    /// Token ids that end a sequence (the stop token is kept as the last new token).
    pub stop_ids: Vec<u32>,
}

impl Default for SamplingConfig {
    fn default() -> Self {
        Self {
            max_new_tokens: 256,
            temperature: 1.0,
            top_p: 1.0,
            top_k: None,
            greedy: false,
            seed: 0,
            stop_ids: Vec::new(),
        }
    }
}

impl SamplingConfig {
    /// Checks the ranges of the settings.
    pub fn validate(&self) -> Result<()> {
        if !(self.greedy || self.temperature > 0.0 && self.temperature.is_finite()) {
            return Err(Qwen3Error::arg(
                "temperature",
                format!(
                    "{} must be > 0 (use greedy decoding for 0)",
                    self.temperature
                ),
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Qwen3Error::arg(
                "top_p",
                format!("{} must be in (0, 1]", self.top_p),
            ));
        }
        if self.top_k == Some(0) {
            return Err(Qwen3Error::arg("top_k", "must be at least 1"));
        }
        Ok(())
    }
}

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// A stop id was produced.
    Stop,
    /// `max_new_tokens` was reached.
    Length,
}

/// The result for one prompt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Generation {
    /// New token ids (including the stop token when `finish_reason` is `stop`).
    pub tokens: Vec<u32>,
    /// Log-probability of each new token under the distribution it was drawn from: after
    /// temperature, top-k and top-p renormalisation when sampling; the model's own (temperature 1)
    /// distribution for greedy decoding.
    pub logprobs: Vec<f32>,
    /// Why generation ended.
    pub finish_reason: FinishReason,
}

impl Generation {
    /// An empty generation (finish reason `length` until a stop id arrives).
    pub fn new() -> Self {
        Self {
            tokens: Vec::new(),
            logprobs: Vec::new(),
            finish_reason: FinishReason::Length,
        }
    }

    /// Appends a sampled token; returns whether the sequence goes on (no stop id and below
    /// `max_new_tokens`): the stopping rule of every sampler.
    pub fn push(&mut self, token: u32, logprob: f32, cfg: &SamplingConfig) -> bool {
        self.tokens.push(token);
        self.logprobs.push(logprob);
        if cfg.stop_ids.contains(&token) {
            self.finish_reason = FinishReason::Stop;
            return false;
        }
        self.tokens.len() < cfg.max_new_tokens
    }
}

impl Default for Generation {
    fn default() -> Self {
        Self::new()
    }
}

/// The kernels' sampling settings of `cfg`.
pub fn sample_params(cfg: &SamplingConfig) -> conrub_kernels::sampling::SampleParams {
    conrub_kernels::sampling::SampleParams {
        greedy: cfg.greedy,
        temperature: cfg.temperature,
        top_k: cfg.top_k,
        top_p: cfg.top_p,
    }
}

/// Picks the next token from one row of logits; returns `(token, logprob)`. Draws one uniform
/// from `rng` unless greedy (the rule is `conrub_kernels::sampling::sample_row`).
pub fn sample_token(logits: &[f32], cfg: &SamplingConfig, rng: &mut ChaCha8Rng) -> (u32, f32) {
    let u = if cfg.greedy { 0.0 } else { rng.random::<f64>() };
    conrub_kernels::sampling::sample_row(logits, &sample_params(cfg), u)
}

/// The RNG stream of sequence `row` for a call seeded with `seed`.
pub fn sequence_rng(seed: u64, row: usize) -> ChaCha8Rng {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(row as u64);
    rng
}

/// `[batch, vocab]` logits as row-major f32 on the host.
fn to_host<B: Backend>(logits: Tensor<B, 2>) -> Vec<f32> {
    logits
        .cast(DType::F32)
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("f32 logits")
}

/// Rejects empty sequences and ids outside the vocabulary; `arg` names the argument in the error.
pub(crate) fn check_sequences(seqs: &[Vec<u32>], vocab: usize, arg: &str) -> Result<()> {
    if let Some(i) = seqs.iter().position(Vec::is_empty) {
        return Err(Qwen3Error::arg(arg, format!("sequence {i} is empty")));
    }
    if let Some(bad) = seqs.iter().flatten().find(|&&t| t as usize >= vocab) {
        return Err(Qwen3Error::arg(
            arg,
            format!("token id {bad} is outside the vocabulary ({vocab})"),
        ));
    }
    Ok(())
}

/// Generates a continuation for every prompt with the rollout engine ([`crate::engine`]) and a KV
/// pool that holds every sequence at full length. The engine prefills each prompt unpadded, so
/// `pad_id` is not used (it is [`generate_dense`]'s). For a memory
/// budget and telemetry call [`crate::rollout`].
pub fn generate<B: conrub_kernels::GrpoOps>(
    model: &Qwen3ForCausalLM<B>,
    prompts: &[Vec<u32>],
    cfg: &SamplingConfig,
    _pad_id: u32,
    device: &B::Device,
) -> Result<Vec<Generation>> {
    crate::engine::rollout(
        model,
        prompts,
        cfg,
        &crate::engine::EngineConfig::default(),
        device,
    )
    .map(|r| r.generations)
}

/// The engine before [`crate::engine`], kept as the reference it is tested and benchmarked
/// against: every prompt in one static batch, left padded with `pad_id` and prefilled together
/// (a group's shared prompt once per row), a dense KV cache per row that grows by doubling, and
/// `[rows, vocab]` logits copied to the host every step and sampled there. Finished sequences
/// are dropped from the batch and the cache.
pub fn generate_dense<B: conrub_kernels::GrpoOps>(
    model: &Qwen3ForCausalLM<B>,
    prompts: &[Vec<u32>],
    cfg: &SamplingConfig,
    pad_id: u32,
    device: &B::Device,
) -> Result<Vec<Generation>> {
    cfg.validate()?;
    check_sequences(prompts, model.vocab_size(), "prompts")?;
    let mut out: Vec<Generation> = prompts.iter().map(|_| Generation::new()).collect();
    if prompts.is_empty() || cfg.max_new_tokens == 0 {
        return Ok(out);
    }
    let mut rngs: Vec<ChaCha8Rng> = (0..prompts.len())
        .map(|i| sequence_rng(cfg.seed, i))
        .collect();
    let padded = PaddedBatch::new(prompts, pad_id, Padding::Left);
    let mut cache = KvCache::new(model.num_layers());
    // Left padding puts every prompt's last token in the last column.
    let v = model.vocab_size();
    let mut host = to_host(model.forward_last(&padded.to_device(device), Some(&mut cache)));

    // Rows of the current batch, as indices into `prompts`.
    let mut active: Vec<usize> = (0..prompts.len()).collect();
    loop {
        let mut next = Vec::with_capacity(active.len());
        let mut still = Vec::with_capacity(active.len());
        for (row, &seq) in active.iter().enumerate() {
            let (tok, lp) = sample_token(&host[row * v..(row + 1) * v], cfg, &mut rngs[seq]);
            if out[seq].push(tok, lp, cfg) {
                still.push(row);
                next.push(tok);
            }
        }
        if still.is_empty() {
            break;
        }
        if still.len() != active.len() {
            cache.retain_rows(&still, device);
            active = still.iter().map(|&r| active[r]).collect();
        }
        let n = active.len();
        let ids: Vec<i64> = next.iter().map(|&t| t as i64).collect();
        let pos: Vec<i64> = active
            .iter()
            .map(|&s| (prompts[s].len() + out[s].tokens.len() - 1) as i64)
            .collect();
        let step = ForwardBatch {
            input_ids: Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [n, 1]), device),
            position_ids: Tensor::<B, 2, Int>::from_data(TensorData::new(pos, [n, 1]), device),
            key_mask: None,
        };
        host = to_host(model.forward_last(&step, Some(&mut cache)));
    }
    Ok(out)
}

/// Teacher-forced scores of one sequence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SequenceScores {
    /// `log p(x[t+1] | x[..=t])` for `t = 0..T-1` (length `T - 1`).
    pub token_logprobs: Vec<f32>,
    /// Argmax of the logits at every position (length `T`).
    pub argmax: Vec<u32>,
}

/// Scores every sequence with one right-padded forward pass.
pub fn score_sequences<B: conrub_kernels::GrpoOps>(
    model: &Qwen3ForCausalLM<B>,
    seqs: &[Vec<u32>],
    pad_id: u32,
    device: &B::Device,
) -> Result<Vec<SequenceScores>> {
    if seqs.is_empty() {
        return Ok(Vec::new());
    }
    check_sequences(seqs, model.vocab_size(), "ids")?;
    let padded = PaddedBatch::new(seqs, pad_id, Padding::Right);
    let (b, t) = (padded.batch, padded.len);
    let logits = model
        .forward(&padded.to_device(device), None)
        .cast(DType::F32);
    let argmax: Vec<i64> = logits
        .clone()
        .argmax(2)
        .reshape([b * t])
        .into_data()
        .convert::<i64>()
        .into_vec()
        .expect("int data");
    let logp = log_softmax(logits, 2);
    let targets: Vec<i64> = (0..b)
        .flat_map(|r| (0..t).map(move |c| (r, c)))
        .map(|(r, c)| {
            if c + 1 < t {
                padded.ids[r * t + c + 1] as i64
            } else {
                0
            }
        })
        .collect();
    let idx = Tensor::<B, 3, Int>::from_data(TensorData::new(targets, [b, t, 1]), device);
    let gathered: Vec<f32> = logp
        .gather(2, idx)
        .reshape([b * t])
        .into_data()
        .convert::<f32>()
        .into_vec()
        .expect("f32 data");
    Ok((0..b)
        .map(|r| {
            let len = padded.lengths[r];
            SequenceScores {
                token_logprobs: gathered[r * t..r * t + len - 1].to_vec(),
                argmax: argmax[r * t..r * t + len]
                    .iter()
                    .map(|&x| x as u32)
                    .collect(),
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_argmax_with_model_logprob() {
        let logits = [0.0f32, 2.0, 1.0];
        let cfg = SamplingConfig {
            greedy: true,
            ..Default::default()
        };
        let (tok, lp) = sample_token(&logits, &cfg, &mut sequence_rng(0, 0));
        assert_eq!(tok, 1);
        let lse = (1.0f64 + 2f64.exp() + 1f64.exp()).ln();
        assert!((lp as f64 - (2.0 - lse)).abs() < 1e-6);
    }

    #[test]
    fn top_k_one_is_greedy_with_logprob_zero() {
        let logits = [0.5f32, -1.0, 3.0, 2.9];
        let cfg = SamplingConfig {
            top_k: Some(1),
            ..Default::default()
        };
        for s in 0..20 {
            let (tok, lp) = sample_token(&logits, &cfg, &mut sequence_rng(s, 0));
            assert_eq!((tok, lp), (2, 0.0));
        }
    }

    #[test]
    fn top_p_keeps_the_smallest_sufficient_prefix() {
        // probabilities ~ [0.64, 0.24, 0.09, 0.03]; top_p 0.8 keeps the first two.
        let logits = [3.0f32, 2.0, 1.0, 0.0];
        let cfg = SamplingConfig {
            top_p: 0.8,
            ..Default::default()
        };
        let mut seen = [0usize; 4];
        let mut rng = sequence_rng(7, 0);
        for _ in 0..4000 {
            let (tok, lp) = sample_token(&logits, &cfg, &mut rng);
            seen[tok as usize] += 1;
            let p = if tok == 0 {
                1.0 / (1.0 + (-1f64).exp())
            } else {
                (-1f64).exp() / (1.0 + (-1f64).exp())
            };
            assert!((lp as f64 - p.ln()).abs() < 1e-6);
        }
        assert_eq!(seen[2] + seen[3], 0);
        let frac = seen[0] as f64 / 4000.0;
        assert!((frac - 0.731).abs() < 0.03, "{frac}");
    }

    #[test]
    fn full_sampling_matches_softmax_frequencies_and_temperature() {
        let logits = [1.0f32, 0.0];
        let cfg = SamplingConfig {
            temperature: 0.5,
            ..Default::default()
        };
        let mut rng = sequence_rng(1, 3);
        let n = 20000;
        let mut first = 0;
        for _ in 0..n {
            let (tok, lp) = sample_token(&logits, &cfg, &mut rng);
            let p0 = 1.0 / (1.0 + (-2f64).exp());
            let expect = if tok == 0 { p0 } else { 1.0 - p0 };
            assert!((lp as f64 - expect.ln()).abs() < 1e-6);
            first += (tok == 0) as usize;
        }
        let frac = first as f64 / n as f64;
        assert!((frac - 0.8808).abs() < 0.01, "{frac}");
    }

    #[test]
    fn invalid_settings_are_rejected_by_name() {
        let cfg = SamplingConfig {
            top_p: 0.0,
            ..Default::default()
        };
        assert!(cfg.validate().unwrap_err().to_string().contains("top_p"));
        let cfg = SamplingConfig {
            temperature: 0.0,
            ..Default::default()
        };
        assert!(cfg
            .validate()
            .unwrap_err()
            .to_string()
            .contains("temperature"));
    }
}
