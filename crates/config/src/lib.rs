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

use conrub_settings::{
    AttentionKernelChoice, JudgeConfig, LearnerConfig, Precision, RunConfig, SettingsError,
    Sharding, ValidationConfig,
};
use serde::{Deserialize, Serialize};

pub use conrub_settings::{
    Family, ModelSection, RandomModel, RolloutEngineKind, RolloutSection, SaveDtype, ShardSize,
};
pub use error::{ConfigError, Result};
pub use sections::{DataSection, OverlongPrompts, RewardSection, SftSection, TrainFile};

/// A train config (`conrub train --config FILE`, `conrub plan --config FILE`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// Device of the policy (`cpu`, `wgpu`, `cuda:0`, ...): the first of `devices`.
    #[serde(default)]
    pub device: String,
    /// Every device of the policy: one (`device = ...`), or one data-parallel rank each
    /// (`devices = ["cuda:0", "cuda:1", ...]`; `["cpu", "cpu"]` simulates ranks on the CPU).
    #[serde(default)]
    pub devices: Vec<String>,
    /// How data-parallel ranks divide the training state (`sharding = "none" | "optimizer" |
    /// "gradients" | "full"`; ZeRO stages 1-3). `conrub plan` counts every mode; training takes
    /// all but `full`.
    #[serde(default)]
    pub sharding: Sharding,
    /// Compute precision of the policy.
    #[serde(default)]
    pub precision: Precision,
    /// The attention kernels on CubeCL devices (`attention_kernels = "auto" | "tensor-core" |
    /// "portable"`), resolved against the device when the policy loads.
    #[serde(default)]
    pub attention_kernels: AttentionKernelChoice,
    /// The policy.
    #[serde(default)]
    pub model: ModelSection,
    /// The rubric records.
    #[serde(default)]
    pub data: DataSection,
    /// The judge (`None` when the file has no `[judge]`: enough to plan, not to train); read
    /// apart, by its kind ([`JudgeConfig::from_table`]).
    #[serde(skip)]
    pub judge: Option<JudgeConfig>,
    /// How labels become rewards.
    #[serde(default)]
    pub reward: RewardSection,
    /// The learner.
    #[serde(default)]
    pub learner: LearnerConfig,
    /// The training loop.
    #[serde(default)]
    pub run: RunConfig,
    /// Optional supervised warm-up on the records' reference answers.
    #[serde(default)]
    pub warmup: Option<SftSection>,
    /// The rollout engine.
    #[serde(default)]
    pub rollout: RolloutSection,
    /// Validation during training (`[eval]`), with its grader judge (read apart, like `[judge]`).
    #[serde(skip)]
    pub eval: Option<EvalSection>,
    /// Where compiled kernels and autotune results are kept on the CubeCL backends (cuda,
    /// wgpu), relative to the file (`kernel_cache = "DIR"`); `None`: `--kernel-cache`, else
    /// `~/.cache/conrub/kernels` (XDG rules).
    #[serde(default)]
    pub kernel_cache: Option<PathBuf>,
    /// The file the config was read from.
    #[serde(skip)]
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
        let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        let judge_table = take_table(&mut table, "judge", path)?;
        let eval_table = take_table(&mut table, "eval", path)?;
        let devices_given = table.contains_key("devices");
        let mut cfg: TrainConfig = serde_path_to_error::deserialize(toml::Value::Table(table))
            .map_err(|e| serde_error(path, "", e))?;
        cfg.path = path.to_path_buf();
        cfg.settle_devices(devices_given)?;
        cfg.judge = judge_table
            .map(|t| read_judge(t, &base, "judge."))
            .transpose()
            .map_err(|e| in_file(path, e))?;
        cfg.eval = eval_table.map(|t| read_eval(t, &base, path)).transpose()?;
        // `steps = 0` turns the table off (`--set warmup.steps=0` on a config that has one).
        cfg.warmup = cfg.warmup.filter(|w| w.steps > 0);
        cfg.kernel_cache = cfg.kernel_cache.map(|p| base.join(p));
        cfg.validate()?;
        Ok(cfg)
    }

    /// `device` or `devices` (not both) as the list of devices; `cpu` when neither is given.
    fn settle_devices(&mut self, devices_given: bool) -> Result<()> {
        match (self.device.is_empty(), self.devices.is_empty()) {
            (false, false) => {
                let m = "give `device` or `devices`, not both";
                return Err(self.key_error("devices", m.into()));
            }
            (false, true) => self.devices = vec![self.device.clone()],
            (true, true) if !devices_given => self.devices = vec!["cpu".into()],
            _ => {}
        }
        self.device = self.devices.first().cloned().unwrap_or_default();
        Ok(())
    }

    /// An error naming `key` in this config's file.
    fn key_error(&self, key: &str, message: String) -> ConfigError {
        ConfigError::Key {
            path: self.path.clone(),
            key: key.into(),
            message,
        }
    }

    /// Replaces the devices (`--device` or `--devices` on the command line).
    pub fn set_devices(&mut self, devices: Vec<String>) -> Result<()> {
        self.device = devices.first().cloned().unwrap_or_default();
        self.devices = devices;
        self.validate()
    }

    /// Range checks across sections; errors name the key.
    fn validate(&self) -> Result<()> {
        let key_error = |key: &str, message: String| self.key_error(key, message);
        let in_file = |e: SettingsError| in_file(&self.path, e);
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
        self.learner.validate().map_err(in_file)?;
        self.run.validate().map_err(in_file)?;
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
            e.settings.validate().map_err(in_file)?;
        }
        let judges = [("judge", self.judge.as_ref())]
            .into_iter()
            .chain([("eval.grader", self.eval.as_ref().map(|e| &e.grader))]);
        for (key, judge) in judges {
            if let Some(d) = judge.and_then(|j| j.device()) {
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

    /// The judge; an error when the config has none.
    pub fn judge(&self) -> Result<&JudgeConfig> {
        self.judge.as_ref().ok_or_else(|| ConfigError::Key {
            path: self.path.clone(),
            key: "judge".into(),
            message: "missing: training needs a [judge] table".into(),
        })
    }

    /// The most prompt groups of a step one data-parallel rank holds (all of them on one
    /// device).
    pub fn prompts_per_rank(&self) -> usize {
        self.run
            .prompts_per_step
            .div_ceil(self.devices.len().max(1))
    }
}

/// `[judge]` (or `[eval.grader]`, keys named under `prefix`): either `config = "FILE"` alone (a
/// judge file, relative to the config) or the judge table inline.
fn read_judge(
    table: toml::Table,
    base: &Path,
    prefix: &str,
) -> std::result::Result<JudgeConfig, SettingsError> {
    match table.get("config").and_then(toml::Value::as_str) {
        Some(file) if table.len() == 1 => JudgeConfig::from_file(&base.join(file)),
        _ => JudgeConfig::from_table(table, base, prefix),
    }
}

/// `[eval]`: the validation settings and the `[eval.grader]` judge.
fn read_eval(mut table: toml::Table, base: &Path, path: &Path) -> Result<EvalSection> {
    let key_error = |key: &str, message: String| ConfigError::Key {
        path: path.to_path_buf(),
        key: key.into(),
        message,
    };
    let grader = match table.remove("grader") {
        Some(toml::Value::Table(g)) => {
            read_judge(g, base, "eval.grader.").map_err(|e| in_file(path, e))?
        }
        Some(other) => {
            let m = format!("expected a judge table, found {}", other.type_str());
            return Err(key_error("eval.grader", m));
        }
        None => {
            let m = "missing: validation needs a grader judge ([eval.grader])";
            return Err(key_error("eval.grader", m.into()));
        }
    };
    let settings = serde_path_to_error::deserialize(toml::Value::Table(table))
        .map_err(|e| serde_error(path, "eval.", e))?;
    Ok(EvalSection { settings, grader })
}

/// Takes the table `key` out of `table` (`[judge]`, `[eval]`: read apart, by their own rules).
fn take_table(table: &mut toml::Table, key: &str, path: &Path) -> Result<Option<toml::Table>> {
    match table.remove(key) {
        None => Ok(None),
        Some(toml::Value::Table(t)) => Ok(Some(t)),
        Some(other) => Err(ConfigError::Key {
            path: path.to_path_buf(),
            key: key.into(),
            message: format!("expected a table, found {}", other.type_str()),
        }),
    }
}

/// Serde's error at a key under `prefix`, in `path`.
fn serde_error(
    path: &Path,
    prefix: &str,
    e: serde_path_to_error::Error<toml::de::Error>,
) -> ConfigError {
    let key = match e.path().to_string() {
        p if p == "." && !prefix.is_empty() => prefix.trim_end_matches('.').to_string(),
        p => format!("{prefix}{p}"),
    };
    let message = e.into_inner().message().trim_end().to_string();
    ConfigError::Key {
        path: path.to_path_buf(),
        key,
        message,
    }
}

/// A setting's error in the config file `path`: a key's, or a judge file's.
fn in_file(path: &Path, e: SettingsError) -> ConfigError {
    match e {
        SettingsError::Key { key, message } => ConfigError::Key {
            path: path.to_path_buf(),
            key,
            message,
        },
        source => ConfigError::Judge {
            path: path.to_path_buf(),
            source,
        },
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
