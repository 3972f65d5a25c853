//! The `[run]` table (the training loop) and the `[eval]` table (validation during training).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::error::{Result, SettingsError};

/// The most prompts a step may draw (a value near 2^63 made `plan` scan for minutes).
pub const MAX_PROMPTS_PER_STEP: usize = 1 << 20;

/// Loop settings (the `[run]` table of a train config).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    /// Passes over the prompts.
    pub epochs: usize,
    /// Prompts per step (32 in the published run: 32 x 8 = 256 responses).
    pub prompts_per_step: usize,
    /// Save a checkpoint every this many steps (0: only at the end).
    pub checkpoint_every: u64,
    /// Stop after this many steps in total (for smoke runs); `None` runs every epoch.
    pub max_steps: Option<u64>,
    /// Output directory: metrics, plots, checkpoints.
    pub output_dir: PathBuf,
    /// Keep only the newest this many checkpoints, counting the one just written (and the best
    /// one by the validation grader, see `[eval]`); at least 1. `None` keeps every checkpoint.
    /// A resumed run first moves the checkpoints of later steps, left by an earlier attempt,
    /// into `attempt-SECONDS/` (`conrub_trainer::run_folder::set_aside_later_checkpoints`).
    pub keep_checkpoints: Option<usize>,
    /// Groups of each step whose rollouts go to `output_dir/samples/step-NNNNNN.jsonl` (prompt,
    /// responses, rewards and their parts, labels, tie verdicts, advantages), the step's first
    /// ones; 0 writes none. Validation rounds write all their answers.
    pub sample_groups: usize,
    /// TensorBoard event files under `output_dir/tensorboard/`: every scalar of the metrics
    /// lines, each step's reward histogram and first group as text
    /// (`conrub_trainer::tensorboard`).
    pub tensorboard: bool,
    /// Make each checkpoint durable behind the steps that follow it: the step that saves
    /// writes the files (the device's tensors read back, the Hugging Face export flushed file by
    /// file as before, the training state's files handed to the operating system) and goes on;
    /// hashing the training state into its manifest, flushing it to the disk and renaming the
    /// folder from `.tmp` happen on a background thread, one checkpoint at a time (the next
    /// save, and the run's end, wait for it; a failed seal stops the run at the next step).
    /// `false`: all of it before the next step. Either way a kill leaves no partial checkpoint
    /// in place.
    pub checkpoint_in_background: bool,
    /// Start a fresh run over an earlier run's metrics and checkpoints in `output_dir`, deleting
    /// them (`conrub train --overwrite`; not a config key, so no config file carries it).
    /// Without it a fresh run into such a folder is refused (see `conrub_trainer::run_folder`).
    #[serde(skip)]
    pub overwrite: bool,
    /// Start a fresh run over an earlier attempt's files in `output_dir`, moving them into
    /// `attempt-SECONDS/` (`conrub train --resume auto` finding no checkpoint to resume; not a
    /// config key).
    #[serde(skip)]
    pub set_aside: bool,
}

impl RunConfig {
    /// Range checks; errors name the key under `run.`.
    pub fn validate(&self) -> Result<()> {
        if !(1..=MAX_PROMPTS_PER_STEP).contains(&self.prompts_per_step) {
            return Err(SettingsError::key(
                "run.prompts_per_step",
                format!("must be from 1 to {MAX_PROMPTS_PER_STEP}"),
            ));
        }
        if self.keep_checkpoints == Some(0) {
            return Err(SettingsError::key(
                "run.keep_checkpoints",
                "must be at least 1 (unset keeps every checkpoint)",
            ));
        }
        Ok(())
    }
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            epochs: 3,
            prompts_per_step: 32,
            checkpoint_every: 50,
            max_steps: None,
            output_dir: PathBuf::from("runs/conrub"),
            keep_checkpoints: None,
            sample_groups: 16,
            tensorboard: true,
            checkpoint_in_background: true,
            overwrite: false,
            set_aside: false,
        }
    }
}

/// The `[eval]` table of a run config, less its `grader` judge (read like `[judge]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ValidationConfig {
    /// Validate after every this many steps (and never at step 0).
    pub every: u64,
    /// Held-out prompts: our rubric JSONL or HealthBench rows (relative to the config file).
    pub data: PathBuf,
    /// Responses per prompt.
    #[serde(default = "one")]
    pub samples: usize,
    /// Greedy or sampled.
    #[serde(default)]
    pub decoding: ValidationDecoding,
    /// Longest answer in tokens (default: `learner.max_response_tokens`).
    #[serde(default)]
    pub max_new_tokens: Option<usize>,
    /// Validate on the first N prompts only.
    #[serde(default)]
    pub limit: Option<usize>,
    /// Bootstrap resamples of each score's standard deviation.
    #[serde(default = "thousand")]
    pub bootstrap_resamples: usize,
}

fn one() -> usize {
    1
}

fn thousand() -> usize {
    1000
}

impl ValidationConfig {
    /// Range checks; errors name the key under `eval.`.
    pub fn validate(&self) -> Result<()> {
        if self.every == 0 {
            return Err(SettingsError::key("eval.every", "must be at least 1"));
        }
        if self.samples == 0 {
            return Err(SettingsError::key("eval.samples", "must be at least 1"));
        }
        if self.max_new_tokens == Some(0) {
            return Err(SettingsError::key(
                "eval.max_new_tokens",
                "must be at least 1",
            ));
        }
        if self.limit == Some(0) {
            return Err(SettingsError::key("eval.limit", "must be at least 1"));
        }
        Ok(())
    }
}

/// How validation answers are decoded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ValidationDecoding {
    /// The most likely token each step (one sample per prompt is enough).
    #[default]
    Greedy,
    /// The training sampler's settings (`learner.temperature`, `top_p`, `top_k`), seeded by the
    /// run seed and the step.
    Sampled,
}
