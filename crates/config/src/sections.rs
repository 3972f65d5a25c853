//! The sections of a train config other than `[learner]` and `[run]` (the learner crate's) and
//! `[judge]` (the judge crate's).

use std::path::PathBuf;

use conrub_models::{Family, ModelConfig, SaveDtype};
use conrub_rollout::EngineConfig;
use conrub_rubric::{ImportFormat, LengthPenalty, RewardFunctionSpec, RubricDropout, ScoringMode};
use serde::{Deserialize, Serialize};

use crate::error::ConfigError;

/// `[model]`: the policy, a checkpoint (`path`) or a random model (`[model.random]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelSection {
    /// Checkpoint directory (relative to the config) or hub id.
    pub path: Option<String>,
    /// A random model of a family (demos, tests).
    pub random: Option<RandomModel>,
    /// Passed to the chat template (`false` for thinking-disabled runs).
    pub enable_thinking: Option<bool>,
    /// Weights of exported checkpoints (and of the weights handed to SGLang, which are bf16
    /// whatever this says).
    pub save_dtype: SaveDtype,
    /// The largest weight file of an export: `"5GB"`, `"500MB"`, `"2GiB"` or a number of
    /// bytes; larger exports are sharded as transformers shards them.
    pub max_shard_size: ShardSize,
}

impl Default for ModelSection {
    fn default() -> Self {
        Self {
            path: None,
            random: None,
            enable_thinking: Some(false),
            save_dtype: SaveDtype::Bf16,
            max_shard_size: ShardSize::Text("5GB".into()),
        }
    }
}

/// `model.max_shard_size` as written: a size with a unit, or bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ShardSize {
    /// Bytes.
    Bytes(u64),
    /// A number and a unit: `B`, `KB`, `MB`, `GB` (powers of 1000) or `KiB`, `MiB`, `GiB`
    /// (powers of 1024).
    Text(String),
}

impl ShardSize {
    /// The size in bytes, or why it is not one.
    pub fn bytes(&self) -> Result<u64, ConfigError> {
        let invalid = |message: String| value_error("model.max_shard_size", message);
        let text = match self {
            ShardSize::Bytes(0) => return Err(invalid("must be more than 0 bytes".into())),
            ShardSize::Bytes(b) => return Ok(*b),
            ShardSize::Text(t) => t.trim(),
        };
        let split = text
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(text.len());
        let (number, unit) = text.split_at(split);
        let scale: u64 = match unit.trim() {
            "" | "B" => 1,
            "KB" => 1_000,
            "MB" => 1_000_000,
            "GB" => 1_000_000_000,
            "KiB" => 1 << 10,
            "MiB" => 1 << 20,
            "GiB" => 1 << 30,
            other => {
                return Err(invalid(format!(
                    "`{text}`: unknown unit `{other}` (B, KB, MB, GB, KiB, MiB, GiB)"
                )))
            }
        };
        match number.parse::<f64>() {
            Ok(n) if n > 0.0 && n.is_finite() => Ok((n * scale as f64) as u64),
            _ => Err(invalid(format!("`{text}` is not a size such as \"5GB\""))),
        }
    }
}

impl ModelSection {
    /// Exactly one of `path` and `[model.random]`, and a valid random shape.
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        match (&self.path, &self.random) {
            (Some(_), None) => Ok(()),
            (None, Some(r)) => r
                .config()
                .validate()
                .map_err(|e| value_error("model.random", e.to_string())),
            _ => Err(value_error(
                "model",
                "needs exactly one of `path` or `[model.random]`",
            )),
        }?;
        self.max_shard_size.bytes().map(|_| ())
    }

    /// `max_shard_size` in bytes (checked by the config's validation).
    pub fn max_shard_bytes(&self) -> u64 {
        self.max_shard_size.bytes().unwrap_or(5_000_000_000)
    }
}

/// `[model.random]`: a randomly initialised model of the given family and shape with a tokenizer
/// from disk.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RandomModel {
    /// The model family: `qwen3` (default), `llama` or `qwen2`.
    #[serde(default)]
    pub family: Family,
    /// Directory with `tokenizer.json` (and `tokenizer_config.json`), relative to the config.
    pub tokenizer: PathBuf,
    /// Hidden width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads.
    pub num_key_value_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Standard deviation of the initial weights.
    #[serde(default = "default_std")]
    pub std: f64,
    /// Seed of the initial weights.
    #[serde(default)]
    pub seed: u64,
}

fn default_std() -> f64 {
    0.02
}

impl RandomModel {
    /// The config of this family and shape (the 151,936-token vocabulary of the bundled
    /// tokenizer; the rest as `ModelConfig::tiny`).
    pub fn config(&self) -> ModelConfig {
        let mut c = ModelConfig::tiny(151_936);
        c.model_type = self.family.model_type().into();
        c.architectures = Some(vec![self.family.hf_architecture().into()]);
        c.hidden_size = self.hidden_size;
        c.intermediate_size = self.intermediate_size;
        c.num_hidden_layers = self.num_hidden_layers;
        c.num_attention_heads = self.num_attention_heads;
        c.num_key_value_heads = Some(self.num_key_value_heads);
        c.head_dim = Some(self.head_dim);
        c
    }
}

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

/// Which engine generates the rollouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RolloutEngineKind {
    /// conrub-rollout's paged engine, in process on the policy's own weights.
    #[default]
    Paged,
    /// SGLang servers (`urls`), given the policy's weights after every step.
    Sglang,
}

/// `[rollout]`: the rollout engine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RolloutSection {
    /// `paged` (in process, the default) or `sglang`.
    pub engine: RolloutEngineKind,
    /// `sglang`: the servers' base URLs (`http://host:30000`); groups are spread over them.
    pub urls: Vec<String>,
    /// `sglang`: seconds one HTTP call may take (a whole group's generation).
    pub timeout_secs: f64,
    /// `sglang`: retries of a refused or timed-out call, with doubling backoff from 1 s.
    pub max_retries: u32,
    /// `sglang`: `/generate` calls (groups) in flight at once over all servers.
    pub concurrency: usize,
    /// `sglang`: the servers run on the learner's GPUs (`--enable-memory-saver`) and release
    /// their memory during the update stage.
    pub colocate: bool,
    /// KV pool in decimal GB. Unset: on devices with a known size (`cuda`, or `--gpu-memory-gb`)
    /// the memory plan's budget rule (90% of what the rollout leaves free); elsewhere enough for
    /// every row of a call at full length.
    pub kv_cache_gb: Option<f64>,
    /// Positions per KV block.
    pub block_size: usize,
    /// Sequences decoded at once at most.
    pub max_rows: usize,
}

impl Default for RolloutSection {
    fn default() -> Self {
        let e = EngineConfig::default();
        Self {
            engine: RolloutEngineKind::Paged,
            urls: Vec::new(),
            timeout_secs: 600.0,
            max_retries: 3,
            concurrency: 64,
            colocate: false,
            kv_cache_gb: None,
            block_size: e.block_size,
            max_rows: e.max_rows,
        }
    }
}

impl RolloutSection {
    /// Checks the values; errors name the key.
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        if let Some(gb) = self.kv_cache_gb {
            if !(gb.is_finite() && gb > 0.0) {
                return Err(value_error(
                    "rollout.kv_cache_gb",
                    format!("{gb} must be a positive number of GB"),
                ));
            }
        }
        let sglang = self.engine == RolloutEngineKind::Sglang;
        if sglang && self.urls.is_empty() {
            let m = "engine = \"sglang\" needs the servers' URLs";
            return Err(value_error("rollout.urls", m));
        }
        if !sglang && (!self.urls.is_empty() || self.colocate) {
            let key = if self.colocate { "colocate" } else { "urls" };
            let m = "only for engine = \"sglang\"";
            return Err(value_error(format!("rollout.{key}"), m));
        }
        if let Some(u) = self.urls.iter().find(|u| !u.starts_with("http")) {
            return Err(value_error(
                "rollout.urls",
                format!("{u:?} is not an http(s) URL"),
            ));
        }
        if !(self.timeout_secs > 0.0) {
            return Err(value_error("rollout.timeout_secs", "must be > 0"));
        }
        for (key, v) in [
            ("block_size", self.block_size),
            ("max_rows", self.max_rows),
            ("concurrency", self.concurrency),
        ] {
            if v == 0 {
                return Err(value_error(format!("rollout.{key}"), "must be at least 1"));
            }
        }
        Ok(())
    }

    /// The engine settings, the pool left to the caller.
    pub fn engine(&self) -> EngineConfig {
        EngineConfig {
            block_size: self.block_size,
            kv_blocks: None,
            max_rows: self.max_rows,
        }
    }
}

/// A section's value that is out of range, named by its dotted key.
fn value_error(key: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Value {
        key: key.into(),
        message: message.into(),
    }
}
