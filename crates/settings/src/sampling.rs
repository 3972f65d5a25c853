//! The sampling rule's parameters, one type for every path that samples: the learner's
//! `[learner]` keys (flat, beside the others), the host rule and the tensor sampler
//! (`conrub_kernels::sampling`), the CubeCL kernel (`conrub_kernels`' `cube_sampling.rs`) and
//! the mapping to an inference server's request (`conrub_remote`). A new knob is a field here
//! (with its default and range check) and its use in those three places.

use serde::{Deserialize, Serialize};

use crate::error::{Result, SettingsError};

/// How a draw is shaped, in the order the rule applies them: the repetition penalty on the
/// logits of ids the sequence has seen, the temperature, top-k, top-p, then min-p. Every
/// default turns its step off.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SamplingParams {
    /// Softmax temperature (> 0).
    pub temperature: f64,
    /// Nucleus threshold in (0, 1]; 1 disables it.
    pub top_p: f64,
    /// Keep only the `k` most likely tokens; `None` disables it.
    pub top_k: Option<usize>,
    /// Then keep only tokens at least `min_p` times as likely as the most likely one (min-p
    /// sampling); 0 disables it.
    pub min_p: f64,
    /// Before all of that, the logit of every id the sequence has seen (its prompt's and its
    /// new tokens) divided by this when positive and multiplied by it when negative
    /// (`conrub_kernels::sampling::penalized_logit`); 1 disables it.
    pub repetition_penalty: f64,
}

impl Default for SamplingParams {
    /// Plain sampling at temperature 1 over the whole distribution (what GRPO rollouts use).
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: None,
            min_p: 0.0,
            repetition_penalty: 1.0,
        }
    }
}

impl SamplingParams {
    /// Sampling at `temperature` over the whole distribution.
    pub fn at_temperature(temperature: f64) -> Self {
        Self {
            temperature,
            ..Self::default()
        }
    }

    /// Checks the ranges; errors name the key under `prefix` (`learner.`, or none for a call's
    /// settings).
    pub fn validate(&self, prefix: &str) -> Result<()> {
        let bad =
            |key: &str, message: String| Err(SettingsError::key(format!("{prefix}{key}"), message));
        // The rule computes in f32 and divides logits by the penalty: a value outside
        // [1e-30, 1e30] (or one that is subnormal there) would send them to infinity or to 0.
        let penalty = self.repetition_penalty as f32;
        if !(penalty.is_normal() && (1e-30..=1e30).contains(&penalty)) {
            let p = self.repetition_penalty;
            return bad(
                "repetition_penalty",
                format!("{p} must be a number in [1e-30, 1e30] (1 turns it off)"),
            );
        }
        if !(self.temperature > 0.0 && self.temperature.is_finite()) {
            let t = self.temperature;
            return bad(
                "temperature",
                format!("{t} must be > 0 (use greedy decoding for 0)"),
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", format!("{} must be in (0, 1]", self.top_p));
        }
        if self.top_k == Some(0) {
            return bad("top_k", "must be at least 1".into());
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(
                "min_p",
                format!("{} must be in [0, 1] (0 turns it off)", self.min_p),
            );
        }
        Ok(())
    }
}

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "lowercase")]
pub enum Decoding {
    /// Always the most likely token; its log-probability is the model's own (temperature 1).
    Greedy,
    /// A draw from the distribution the parameters shape; its log-probability is under that
    /// renormalised distribution.
    Sample(SamplingParams),
}

impl Default for Decoding {
    /// Plain sampling at temperature 1 (what GRPO rollouts use).
    fn default() -> Self {
        Decoding::Sample(SamplingParams::default())
    }
}

impl Decoding {
    /// Sampling at `temperature` over the whole distribution.
    pub fn temperature(temperature: f64) -> Self {
        Decoding::Sample(SamplingParams::at_temperature(temperature))
    }

    /// A draw at `temperature`, kept to the `top_k` most likely ids and then to the `top_p`
    /// nucleus (1: none).
    pub fn draw(temperature: f64, top_k: Option<usize>, top_p: f64) -> Self {
        Decoding::Sample(SamplingParams {
            temperature,
            top_k,
            top_p,
            ..SamplingParams::default()
        })
    }

    /// This draw with min-p `min_p` (0: none); greedy decoding stays greedy.
    pub fn with_min_p(self, min_p: f64) -> Self {
        match self {
            Decoding::Greedy => Decoding::Greedy,
            Decoding::Sample(p) => Decoding::Sample(SamplingParams { min_p, ..p }),
        }
    }

    /// Whether this is greedy decoding (no random draw per token).
    pub fn is_greedy(&self) -> bool {
        matches!(self, Decoding::Greedy)
    }

    /// The parameters of a draw; greedy decoding's are the defaults (every step off at
    /// temperature 1, which the samplers do not read).
    pub fn params(&self) -> SamplingParams {
        match self {
            Decoding::Greedy => SamplingParams::default(),
            Decoding::Sample(p) => *p,
        }
    }

    /// Checks the ranges of a draw's parameters (names without a prefix).
    pub fn validate(&self) -> Result<()> {
        match self {
            Decoding::Greedy => Ok(()),
            Decoding::Sample(p) => p.validate(""),
        }
    }

    /// The repetition penalty (1 when greedy or off), as the f32 the rule computes with.
    pub fn repetition_penalty(&self) -> f32 {
        self.params().repetition_penalty as f32
    }
}

impl crate::flat::Flat for SamplingParams {
    fn read<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        <Self as Deserialize>::deserialize(d)
    }
}
