//! The run config: one typed schema for `conrub train`, `conrub plan` and any program that embeds
//! the learner. `configs/README.md` lists every key with its default; a test fails when one is
//! missing there.
//!
//! ```no_run
//! use conrub_config::TrainConfig;
//!
//! let cfg = TrainConfig::from_file("configs/demo-cpu.toml".as_ref(), &[]).unwrap();
//! println!("{} prompts per step on {}", cfg.run.prompts_per_step, cfg.device);
//! ```
//!
//! Reading a config checks every key: an unknown key, a key of another judge kind, a value of the
//! wrong type or out of range is an error that names the file and the dotted key. Relative paths
//! resolve against the config file's directory ([`TrainConfig::resolve`]).

mod error;
mod sections;

use std::path::{Path, PathBuf};

use conrub_contracts::{LearnerConfig, RunConfig, Sharding, ValidationConfig};
use conrub_judge::JudgeConfig;
use conrub_memory::{MemoryPlanInput, ModelShape, DEFAULT_MAX_PROMPT_TOKENS};

use conrub_models::{AttentionImpl, AttentionKernelChoice, AttentionKernels, Execution, Precision};
use serde::{Deserialize, Serialize};

pub use error::{ConfigError, Result};
pub use sections::{
    DataSection, ModelSection, OverlongPrompts, RandomModel, RewardSection, RolloutEngineKind,
    RolloutSection, SftSection, ShardSize, TrainFile,
};

/// A train config (`conrub train --config FILE`, `conrub plan --config FILE`).
#[derive(Debug, Clone, PartialEq)]
pub struct TrainConfig {
    /// Device of the policy (`cpu`, `wgpu`, `cuda:0`, ...): the first of `devices`.
    pub device: String,
    /// Every device of the policy: one (`device = ...`), or one data-parallel rank each
    /// (`devices = ["cuda:0", "cuda:1", ...]`; `["cpu", "cpu"]` simulates ranks on the CPU).
    pub devices: Vec<String>,
    /// How data-parallel ranks divide the training state (`sharding = "none" | "optimizer" |
    /// "gradients" | "full"`; ZeRO stages 1-3). `conrub plan` counts every mode; training takes
    /// all but `full`.
    pub sharding: Sharding,
    /// Compute precision of the policy.
    pub precision: Precision,
    /// The attention kernels on CubeCL devices (`attention_kernels = "auto" | "tensor-core" |
    /// "portable"`), resolved against the device when the policy loads.
    pub attention_kernels: AttentionKernelChoice,
    /// The policy.
    pub model: ModelSection,
    /// The rubric records.
    pub data: DataSection,
    /// The judge (`None` when the file has no `[judge]`: enough to plan, not to train).
    pub judge: Option<JudgeConfig>,
    /// How labels become rewards.
    pub reward: RewardSection,
    /// The learner.
    pub learner: LearnerConfig,
    /// The training loop.
    pub run: RunConfig,
    /// Optional supervised warm-up on the records' reference answers.
    pub warmup: Option<SftSection>,
    /// The rollout engine.
    pub rollout: RolloutSection,
    /// Validation during training (`[eval]`), with its grader judge.
    pub eval: Option<EvalSection>,
    /// Where compiled kernels and autotune results are kept on the CubeCL backends (cuda,
    /// wgpu), relative to the file (`kernel_cache = "DIR"`); `None`: `--kernel-cache`, else
    /// `~/.cache/conrub/kernels` (XDG rules).
    pub kernel_cache: Option<PathBuf>,
    /// The file the config was read from.
    pub path: PathBuf,
}

/// `[eval]`: validation every N steps on held-out prompts, scored by the training judge and by
/// the `[eval.grader]` judge (a judge table, or `config = "FILE"` alone, like `[judge]`).
#[derive(Debug, Clone, PartialEq)]
pub struct EvalSection {
    /// Every key but the grader.
    pub settings: ValidationConfig,
    /// The grader.
    pub grader: JudgeConfig,
}

/// The keys of the file as serde reads them (`[judge]` is parsed apart, by its kind).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Schema {
    #[serde(default)]
    pub device: Option<String>,
    #[serde(default)]
    pub devices: Option<Vec<String>>,
    #[serde(default)]
    pub sharding: Sharding,
    #[serde(default)]
    pub precision: Precision,
    #[serde(default)]
    pub attention_kernels: AttentionKernelChoice,
    #[serde(default)]
    pub model: ModelSection,
    #[serde(default)]
    pub data: DataSection,
    #[serde(default)]
    pub reward: RewardSection,
    #[serde(default)]
    pub learner: LearnerConfig,
    #[serde(default)]
    pub run: RunConfig,
    #[serde(default)]
    pub warmup: Option<SftSection>,
    #[serde(default)]
    pub rollout: RolloutSection,
    #[serde(default)]
    pub kernel_cache: Option<PathBuf>,
}

/// The backend a device spec names (`cuda:1` -> `cuda`): the ranks of one run share it.
pub fn backend_of(spec: &str) -> &str {
    spec.split(':').next().unwrap_or(spec)
}

impl TrainConfig {
    /// Reads `path` and applies `overrides` (`KEY=VALUE`, the value as TOML, else as a string).
    pub fn from_file(path: &Path, overrides: &[String]) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let mut table: toml::Table = toml::from_str(&text).map_err(|e| ConfigError::Toml {
            path: path.to_path_buf(),
            message: e.to_string().trim_end().to_string(),
        })?;
        for o in overrides {
            apply_override(&mut table, o)?;
        }
        Self::from_table(table, path)
    }

    /// A config from a parsed table; `path` names the file in errors and anchors relative paths.
    pub fn from_table(mut table: toml::Table, path: &Path) -> Result<Self> {
        let key_error = |key: String, message: String| ConfigError::Key {
            path: path.to_path_buf(),
            key,
            message,
        };
        let judge_table = match table.remove("judge") {
            None => None,
            Some(toml::Value::Table(t)) => Some(t),
            Some(other) => {
                return Err(key_error(
                    "judge".into(),
                    format!("expected a table, found {}", other.type_str()),
                ))
            }
        };
        let eval_table = match table.remove("eval") {
            None => None,
            Some(toml::Value::Table(t)) => Some(t),
            Some(other) => {
                return Err(key_error(
                    "eval".into(),
                    format!("expected a table, found {}", other.type_str()),
                ))
            }
        };
        let serde_key_error = |prefix: &str, e: serde_path_to_error::Error<toml::de::Error>| {
            let key = match e.path().to_string() {
                p if p == "." && !prefix.is_empty() => prefix.trim_end_matches('.').to_string(),
                p => format!("{prefix}{p}"),
            };
            let message = e.into_inner().message().trim_end().to_string();
            key_error(key, message)
        };
        let schema: Schema = serde_path_to_error::deserialize(toml::Value::Table(table))
            .map_err(|e| serde_key_error("", e))?;
        let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        let judge_error = |source| ConfigError::Judge {
            path: path.to_path_buf(),
            source,
        };
        let judge = judge_table
            .map(|t| read_judge(t, &base, "judge."))
            .transpose()
            .map_err(judge_error)?;
        let eval = match eval_table {
            None => None,
            Some(mut t) => {
                let grader = match t.remove("grader") {
                    Some(toml::Value::Table(g)) => {
                        read_judge(g, &base, "eval.grader.").map_err(judge_error)?
                    }
                    Some(other) => {
                        return Err(key_error(
                            "eval.grader".into(),
                            format!("expected a judge table, found {}", other.type_str()),
                        ))
                    }
                    None => {
                        return Err(key_error(
                            "eval.grader".into(),
                            "missing: validation needs a grader judge ([eval.grader])".into(),
                        ))
                    }
                };
                let settings = serde_path_to_error::deserialize(toml::Value::Table(t))
                    .map_err(|e| serde_key_error("eval.", e))?;
                Some(EvalSection { settings, grader })
            }
        };
        let devices = match (schema.device, schema.devices) {
            (Some(_), Some(_)) => {
                return Err(key_error(
                    "devices".into(),
                    "give `device` or `devices`, not both".into(),
                ))
            }
            (Some(d), None) => vec![d],
            (None, Some(ds)) => ds,
            (None, None) => vec!["cpu".into()],
        };
        let cfg = Self {
            device: devices.first().cloned().unwrap_or_default(),
            devices,
            sharding: schema.sharding,
            precision: schema.precision,
            attention_kernels: schema.attention_kernels,
            model: schema.model,
            data: schema.data,
            judge,
            reward: schema.reward,
            learner: schema.learner,
            run: schema.run,
            // `steps = 0` turns the table off (`--set warmup.steps=0` on a config that has one).
            warmup: schema.warmup.filter(|w| w.steps > 0),
            rollout: schema.rollout,
            eval,
            kernel_cache: schema.kernel_cache.map(|p| base.join(p)),
            path: path.to_path_buf(),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Replaces the devices (`--device` or `--devices` on the command line).
    pub fn set_devices(&mut self, devices: Vec<String>) -> Result<()> {
        self.device = devices.first().cloned().unwrap_or_default();
        self.devices = devices;
        self.validate()
    }

    /// Range checks across sections; errors name the key.
    fn validate(&self) -> Result<()> {
        let key_error = |key: &str, message: String| ConfigError::Key {
            path: self.path.clone(),
            key: key.into(),
            message,
        };
        let Some(first) = self.devices.first() else {
            return Err(key_error("devices", "needs at least one device".into()));
        };
        if let Some(other) = self
            .devices
            .iter()
            .find(|d| backend_of(d) != backend_of(first))
        {
            return Err(key_error(
                "devices",
                format!("\"{first}\" and \"{other}\": every rank runs on one backend"),
            ));
        }
        self.learner.validate().map_err(|e| match e {
            conrub_contracts::ContractError::Config { key, message } => key_error(&key, message),
            other => key_error("learner", other.to_string()),
        })?;
        self.run.validate().map_err(|e| match e {
            conrub_contracts::ContractError::Config { key, message } => key_error(&key, message),
            other => key_error("run", other.to_string()),
        })?;
        let in_file = |e: ConfigError| match e {
            ConfigError::Value { key, message } => key_error(&key, message),
            other => other,
        };
        self.rollout.validate().map_err(in_file)?;
        self.model.validate().map_err(in_file)?;
        self.reward
            .length_penalty(self.learner.max_response_tokens)
            .validate()
            .map_err(|e| key_error("reward", e.to_string()))?;
        if !(0.0..=1.0).contains(&self.reward.min_scored_share) {
            return Err(key_error(
                "reward.min_scored_share",
                "must be in [0, 1]".into(),
            ));
        }
        if self.reward.max_unscored_steps == 0 {
            return Err(key_error(
                "reward.max_unscored_steps",
                "must be at least 1".into(),
            ));
        }
        if let Some(d) = &self.reward.dropout {
            d.validate()
                .map_err(|e| key_error("reward.dropout", e.to_string()))?;
        }
        if self.data.max_prompt_tokens == Some(0) {
            return Err(key_error(
                "data.max_prompt_tokens",
                "must be at least 1".into(),
            ));
        }
        if let Some(w) = &self.warmup {
            if !(w.lr > 0.0 && w.lr.is_finite()) {
                return Err(key_error(
                    "warmup.lr",
                    "needs a finite lr > 0 (or `steps = 0` for no warm-up)".into(),
                ));
            }
        }
        if let Some(e) = &self.eval {
            e.settings.validate().map_err(|e| match e {
                conrub_contracts::ContractError::Config { key, message } => {
                    key_error(&key, message)
                }
                other => key_error("eval", other.to_string()),
            })?;
        }
        let judges = [("judge", self.judge.as_ref())]
            .into_iter()
            .chain([("eval.grader", self.eval.as_ref().map(|e| &e.grader))]);
        for (key, judge) in judges {
            if let Some(d) = judge.and_then(JudgeConfig::device) {
                return Err(key_error(
                    &format!("{key}.device"),
                    format!(
                        "\"{d}\": `conrub train` runs an in-process judge on the training device ({}); remove the key (`conrub score` and `conrub judge-pair` use it)",
                        self.device
                    ),
                ));
            }
        }
        Ok(())
    }

    /// `p` relative to the config file's directory (absolute paths stay as they are).
    pub fn resolve(&self, p: &Path) -> PathBuf {
        if p.is_absolute() {
            return p.to_path_buf();
        }
        self.path
            .parent()
            .map(|d| d.join(p))
            .unwrap_or_else(|| p.to_path_buf())
    }

    /// The learner's settings: `[learner]`, with the unscored budget of `[reward]`
    /// (`min_scored_share`, `max_unscored_steps`).
    pub fn learner_config(&self) -> LearnerConfig {
        LearnerConfig {
            min_scored_share: self.reward.min_scored_share,
            max_unscored_steps: self.reward.max_unscored_steps,
            ..self.learner.clone()
        }
    }

    /// The task's files, paths resolved: `[[data.train]]`, or `data.rubrics` as one rubric
    /// JSONL of weight 1. Errors name the key: neither or both given, a weight that is not a
    /// finite number above 0.
    pub fn train_files(&self) -> Result<Vec<TrainFile>> {
        let key_error = |key: String, message: String| ConfigError::Key {
            path: self.path.clone(),
            key,
            message,
        };
        let files = match (&self.data.rubrics, self.data.train.as_slice()) {
            (Some(_), [_, ..]) => {
                let why = "give the records once: `data.rubrics` (one file) or `[[data.train]]`";
                return Err(key_error("data.train".into(), why.into()));
            }
            (Some(path), []) => vec![TrainFile {
                path: path.clone(),
                format: None,
                weight: 1.0,
            }],
            (None, []) => {
                let why =
                    "missing: training needs the records (`data.rubrics` or `[[data.train]]`)";
                return Err(key_error("data.rubrics".into(), why.into()));
            }
            (None, files) => files.to_vec(),
        };
        files
            .into_iter()
            .enumerate()
            .map(|(i, f)| {
                if !(f.weight.is_finite() && f.weight > 0.0) {
                    let why = format!("{} is not a finite weight above 0", f.weight);
                    return Err(key_error(format!("data.train[{i}].weight"), why));
                }
                Ok(TrainFile {
                    path: self.resolve(&f.path),
                    ..f
                })
            })
            .collect()
    }

    /// Refuses `learner.estimator` / `learner.loss` names that are not built in: what
    /// `conrub train` and `conrub plan` check before loading anything (a program embedding the
    /// learner with its own `conrub_grpo::Registry` skips this; its learner checks the names it
    /// registered when it is built).
    pub fn check_builtin_plugins(&self) -> Result<()> {
        for (key, name, builtin) in [
            (
                "learner.estimator",
                &self.learner.estimator,
                conrub_contracts::BUILTIN_ESTIMATORS,
            ),
            (
                "learner.loss",
                &self.learner.loss,
                conrub_contracts::BUILTIN_LOSSES,
            ),
        ] {
            if !builtin.contains(&name.as_str()) {
                return Err(ConfigError::Key {
                    path: self.path.clone(),
                    key: key.into(),
                    message: format!(
                        "`{name}` is not a built-in entry (built in: {})",
                        builtin.join(", ")
                    ),
                });
            }
        }
        Ok(())
    }

    /// The judge; an error when the config has none.
    pub fn judge(&self) -> Result<&JudgeConfig> {
        self.judge.as_ref().ok_or_else(|| ConfigError::Key {
            path: self.path.clone(),
            key: "judge".into(),
            message: "missing: training needs a [judge] table".into(),
        })
    }

    /// How the policy runs, with `attention_kernels` as resolved against the device
    /// ([`AttentionKernelChoice::resolve`]). Activation checkpointing is not set here: the
    /// learner applies `learner.activation_checkpointing` when it is built
    /// (`LearnerBuilder::build`), the one place that does.
    pub fn execution(&self, attention_kernels: AttentionKernels) -> Execution {
        Execution {
            precision: self.precision,
            attention: AttentionImpl::Fused,
            activation_checkpointing: false,
            attention_kernels,
            // The learner turns it on for `learner.entropy_coeff` (Policy::enable_entropy_gradient).
            entropy_gradient: false,
        }
    }

    /// The most prompt groups of a step one data-parallel rank holds (all of them on one
    /// device).
    pub fn prompts_per_rank(&self) -> usize {
        self.run
            .prompts_per_step
            .div_ceil(self.devices.len().max(1))
    }

    /// The memory plan's inputs for a model of `shape` on a device of `gpu_memory_gb`;
    /// `max_prompt_tokens` overrides `data.max_prompt_tokens` (default 1,024).
    pub fn memory_plan_input(
        &self,
        shape: ModelShape,
        gpu_memory_gb: f64,
        max_prompt_tokens: Option<usize>,
    ) -> MemoryPlanInput {
        let l = &self.learner;
        let mut input = MemoryPlanInput::new(shape);
        input.precision = self.precision;
        input.activation_checkpointing = l.activation_checkpointing;
        input.micro_batch_tokens = l.micro_batch_tokens;
        input.mini_batches = l.mini_batches;
        input.group_size = l.group_size;
        input.max_response_tokens = l.max_response_tokens;
        input.rollout_prompts_per_call = l.rollout_prompts_per_call;
        // Each data-parallel rank holds its share of the step's groups (the first ranks one
        // more when they do not divide): the plan is per rank.
        input.prompts_per_step = self.prompts_per_rank();
        input.keep_reference = l.kl_beta != 0.0 || l.kl_in_reward != 0.0;
        input.max_prompt_tokens = max_prompt_tokens
            .or(self.data.max_prompt_tokens)
            .unwrap_or(DEFAULT_MAX_PROMPT_TOKENS);
        input.kv_cache_gb = self.rollout.kv_cache_gb;
        input.kv_block_size = self.rollout.block_size;
        input.rollout_max_rows = self.rollout.max_rows;
        input.rollout_in_process = self.rollout.engine == RolloutEngineKind::Paged;
        input.gpu_memory_gb = gpu_memory_gb;
        input.ranks = self.devices.len().max(1);
        input.sharding = self.sharding;
        input.bucket_bytes = l.allreduce_bucket_bytes() as f64;
        input.export_bytes_per_weight = match self.model.save_dtype {
            conrub_models::SaveDtype::F32 => 4.0,
            conrub_models::SaveDtype::Bf16 => 2.0,
        };
        input
    }
}

/// `[judge]` (or `[eval.grader]`, keys named under `prefix`): either `config = "FILE"` alone (a
/// judge file, relative to the config) or the judge table inline.
fn read_judge(table: toml::Table, base: &Path, prefix: &str) -> conrub_judge::Result<JudgeConfig> {
    match table.get("config").and_then(toml::Value::as_str) {
        Some(file) if table.len() == 1 => JudgeConfig::from_file(&base.join(file)),
        _ => JudgeConfig::from_table(table, base, prefix),
    }
}

/// Sets `a.b.c = value` in a TOML table (the value parsed as TOML, else taken as a string).
pub fn apply_override(table: &mut toml::Table, spec: &str) -> Result<()> {
    let err = |message: String| ConfigError::Override {
        spec: spec.to_string(),
        message,
    };
    let (key, raw) = spec
        .split_once('=')
        .ok_or_else(|| err("expected KEY=VALUE".into()))?;
    let value: toml::Value = match toml::from_str::<toml::Table>(&format!("v = {raw}")) {
        Ok(mut t) => t.remove("v").expect("parsed"),
        Err(_) => toml::Value::String(raw.to_string()),
    };
    let parts: Vec<&str> = key.trim().split('.').collect();
    let mut cur = table;
    for p in &parts[..parts.len() - 1] {
        cur = cur
            .entry(p.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()))
            .as_table_mut()
            .ok_or_else(|| err(format!("`{p}` is not a table")))?;
    }
    cur.insert(parts[parts.len() - 1].to_string(), value);
    Ok(())
}

#[cfg(test)]
mod tests;
