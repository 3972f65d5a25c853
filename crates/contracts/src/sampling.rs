//! Sampling settings, the one sampling rule (on the host: [`sample_token`]; on the device:
//! `conrub_rollout::sample_on_device`), per-sequence random streams and what a generation returns.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::error::{ContractError, Result};

pub use conrub_settings::{Decoding, SamplingParams};

impl SamplingConfig {
    /// The rollout's sampling settings of `[learner]` at `seed` (stop ids as given).
    pub fn from_learner(cfg: &conrub_settings::LearnerConfig, seed: u64, stop_ids: &[u32]) -> Self {
        SamplingConfig {
            max_new_tokens: cfg.max_response_tokens,
            decoding: Decoding::Sample(cfg.sampling),
            seed,
            stop_ids: stop_ids.to_vec(),
            first_stream: 0,
        }
    }
}

/// Settings of one generation call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingConfig {
    /// Maximum number of new tokens per sequence.
    pub max_new_tokens: usize,
    /// How each token is chosen.
    pub decoding: Decoding,
    /// Seed; sequence `i` of a call draws from its own stream seeded by `(seed, i)`, so its tokens
    /// do not depend on the other sequences in the batch.
    pub seed: u64,
    /// Token ids that end a sequence (the stop token is kept as the last new token).
    pub stop_ids: Vec<u32>,
    /// The stream of the call's first sequence: sequence `i` draws from stream
    /// `first_stream + i`. A caller that splits one batch into several calls (data-parallel
    /// ranks, each with a slice of the step's groups) gives each call the streams its sequences
    /// had in the whole batch, so a response does not depend on the split. 0 unless told.
    #[serde(default)]
    pub first_stream: u64,
}

impl Default for SamplingConfig {
    fn default() -> Self {
        Self {
            max_new_tokens: 256,
            decoding: Decoding::default(),
            seed: 0,
            stop_ids: Vec::new(),
            first_stream: 0,
        }
    }
}

impl SamplingConfig {
    /// Greedy decoding of up to `max_new_tokens`.
    pub fn greedy(max_new_tokens: usize) -> Self {
        Self {
            max_new_tokens,
            decoding: Decoding::Greedy,
            ..Default::default()
        }
    }

    /// Checks the ranges of the settings; errors name the parameter.
    pub fn validate(&self) -> Result<()> {
        self.decoding.validate().map_err(|e| match e {
            conrub_settings::SettingsError::Key { key, message } => {
                ContractError::Argument { name: key, message }
            }
            other => ContractError::Argument {
                name: "decoding".into(),
                message: other.to_string(),
            },
        })
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

/// Picks the next token from one row of logits; returns `(token, logprob)`. Draws one uniform
/// from `rng` unless greedy (the rule is `conrub_kernels::sampling::sample_row`, after the
/// repetition penalty on the distinct ids of `seen`, the sequence's prompt and new tokens).
pub fn sample_token(
    logits: &[f32],
    seen: &[u32],
    cfg: &SamplingConfig,
    rng: &mut ChaCha8Rng,
) -> (u32, f32) {
    let u = if cfg.decoding.is_greedy() {
        0.0
    } else {
        rng.random::<f64>()
    };
    let penalty = cfg.decoding.repetition_penalty();
    if penalty == 1.0 || seen.is_empty() {
        return conrub_kernels::sampling::sample_row(logits, &cfg.decoding, u);
    }
    let mut row = logits.to_vec();
    conrub_kernels::sampling::penalize_row(&mut row, seen, penalty);
    conrub_kernels::sampling::sample_row(&row, &cfg.decoding, u)
}

/// The RNG stream of sequence `row` for a call seeded with `seed` (a call's sequence `i` uses
/// `row = first_stream + i`, see [`SamplingConfig::first_stream`]).
pub fn sequence_rng(seed: u64, row: u64) -> ChaCha8Rng {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(row);
    rng
}

/// Rejects empty sequences and ids outside the vocabulary; `arg` names the argument in the error.
pub fn check_sequences(seqs: &[Vec<u32>], vocab: usize, arg: &str) -> Result<()> {
    if let Some(i) = seqs.iter().position(Vec::is_empty) {
        return Err(ContractError::arg(arg, format!("sequence {i} is empty")));
    }
    if let Some(bad) = seqs.iter().flatten().find(|&&t| t as usize >= vocab) {
        return Err(ContractError::arg(
            arg,
            format!("token id {bad} is outside the vocabulary ({vocab})"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_argmax_with_model_logprob() {
        let logits = [0.0f32, 2.0, 1.0];
        let cfg = SamplingConfig::greedy(1);
        let (tok, lp) = sample_token(&logits, &[], &cfg, &mut sequence_rng(0, 0));
        assert_eq!(tok, 1);
        let lse = (1.0f64 + 2f64.exp() + 1f64.exp()).ln();
        assert!((lp as f64 - (2.0 - lse)).abs() < 1e-6);
    }

    #[test]
    fn top_k_one_is_greedy_with_logprob_zero() {
        let logits = [0.5f32, -1.0, 3.0, 2.9];
        let cfg = SamplingConfig {
            decoding: Decoding::Sample(SamplingParams {
                temperature: 1.0,
                top_p: 1.0,
                top_k: Some(1),
                min_p: 0.0,
                repetition_penalty: 1.0,
            }),
            ..Default::default()
        };
        for s in 0..20 {
            let (tok, lp) = sample_token(&logits, &[], &cfg, &mut sequence_rng(s, 0));
            assert_eq!((tok, lp), (2, 0.0));
        }
    }

    #[test]
    fn top_p_keeps_the_smallest_sufficient_prefix() {
        // probabilities ~ [0.64, 0.24, 0.09, 0.03]; top_p 0.8 keeps the first two.
        let logits = [3.0f32, 2.0, 1.0, 0.0];
        let cfg = SamplingConfig {
            decoding: Decoding::Sample(SamplingParams {
                temperature: 1.0,
                top_p: 0.8,
                top_k: None,
                min_p: 0.0,
                repetition_penalty: 1.0,
            }),
            ..Default::default()
        };
        let mut seen = [0usize; 4];
        let mut rng = sequence_rng(7, 0);
        for _ in 0..4000 {
            let (tok, lp) = sample_token(&logits, &[], &cfg, &mut rng);
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
            decoding: Decoding::Sample(SamplingParams {
                temperature: 0.5,
                top_p: 1.0,
                top_k: None,
                min_p: 0.0,
                repetition_penalty: 1.0,
            }),
            ..Default::default()
        };
        let mut rng = sequence_rng(1, 3);
        let n = 20000;
        let mut first = 0;
        for _ in 0..n {
            let (tok, lp) = sample_token(&logits, &[], &cfg, &mut rng);
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
            decoding: Decoding::Sample(SamplingParams {
                temperature: 1.0,
                top_p: 0.0,
                top_k: None,
                min_p: 0.0,
                repetition_penalty: 1.0,
            }),
            ..Default::default()
        };
        assert!(cfg.validate().unwrap_err().to_string().contains("top_p"));
        let cfg = SamplingConfig {
            decoding: Decoding::Sample(SamplingParams {
                temperature: 0.0,
                top_p: 1.0,
                top_k: None,
                min_p: 0.0,
                repetition_penalty: 1.0,
            }),
            ..Default::default()
        };
        assert!(cfg
            .validate()
            .unwrap_err()
            .to_string()
            .contains("temperature"));
    }
}
