//! The sections of a train config about its data and rewards: `[data]`, `[reward]` and
//! `[warmup]` (the rest are `conrub-settings` structs).

use std::path::PathBuf;

use conrub_rubric::{ImportFormat, LengthPenalty, RewardFunctionSpec, RubricDropout, ScoringMode};
use serde::{Deserialize, Serialize};

/// `[data]`: the rubric records.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataSection {
    /// Rubric JSONL, relative to the config: the one-file spelling of `train` (one of the two is
    /// required to train).
    pub rubrics: Option<PathBuf>,
    /// `[[data.train]]`: the files of the task, each in any format `rubrics import` reads (or
    /// rubric JSONL), with a weight for mixing.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub train: Vec<TrainFile>,
    /// Longest prompt in tokens once rendered with the policy's chat template: sizes the
    /// memory plan (1,024 when unset), and when set, longer prompts are dropped before the
    /// first step and counted (or stop the run: `overlong_prompts`).
    pub max_prompt_tokens: Option<usize>,
    /// What a prompt over `max_prompt_tokens` does: `drop` (counted in the log) or `error`.
    pub overlong_prompts: OverlongPrompts,
}

fn unit_weight() -> f64 {
    1.0
}

/// One file of `[[data.train]]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainFile {
    /// The file, relative to the config.
    pub path: PathBuf,
    /// `rar`, `rubrichub` or `healthbench` (imported as `conrub rubrics import` does, global
    /// controls appended); absent: rubric JSONL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<ImportFormat>,
    /// How many times each of its records is drawn per epoch (default 1): `2` repeats every
    /// record, `0.5` keeps a seeded half. The file contributes `round(weight * records)`.
    #[serde(default = "unit_weight")]
    pub weight: f64,
}

/// What a prompt over `data.max_prompt_tokens` does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OverlongPrompts {
    /// Left out of the run, counted in the log.
    #[default]
    Drop,
    /// Stops the run before the first step, naming the prompt.
    Error,
}

/// `[reward]`: labels to rewards (docs/METHOD.md §4, §9).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RewardSection {
    /// `three-state` (the method) or `binary`.
    pub mode: ScoringMode,
    /// The soft overlength penalty.
    pub length_penalty: bool,
    /// Its buffer `Lbuf` in tokens (capped at `learner.max_response_tokens`).
    pub length_buffer_tokens: u32,
    /// Rubric dropout; off when absent.
    pub dropout: Option<RubricDropout>,
    /// A step whose share of scored responses (every reward part scored) is below this does not
    /// update the policy (`learner.min_scored_share` of the learner).
    pub min_scored_share: f64,
    /// That many such steps in a row stop the run with the judge's last error.
    pub max_unscored_steps: usize,
    /// `[[reward.functions]]`: a weighted mix of reward functions (`kind = "rubric"` is the
    /// judge above; `exact`, `numeric`, `regex`, `format`, `http`, or an embedder's kind). Empty
    /// (the default): the rubric judge alone, exactly as without the list.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub functions: Vec<RewardFunctionSpec>,
}

impl Default for RewardSection {
    fn default() -> Self {
        Self {
            mode: ScoringMode::ThreeState,
            length_penalty: true,
            length_buffer_tokens: 1024,
            dropout: None,
            min_scored_share: 0.5,
            max_unscored_steps: 3,
            functions: vec![],
        }
    }
}

impl RewardSection {
    /// The overlength penalty for responses of at most `max_response_tokens`.
    pub fn length_penalty(&self, max_response_tokens: usize) -> LengthPenalty {
        LengthPenalty {
            enabled: self.length_penalty,
            max_tokens: max_response_tokens as u32,
            buffer_tokens: self.length_buffer_tokens.min(max_response_tokens as u32),
        }
    }
}

/// `[warmup]`: supervised steps on the reference answers before GRPO (fresh runs only).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SftSection {
    /// Optimizer steps; 0 means no warm-up (the table is then ignored).
    pub steps: usize,
    /// Learning rate.
    pub lr: f64,
}
