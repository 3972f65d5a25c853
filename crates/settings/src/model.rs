//! The `[model]` table: the policy (a checkpoint, or a random model of a family) and how its
//! exports are written; the family and storage-dtype names it uses.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::error::{Result, SettingsError};

/// A supported model family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// Qwen3 dense (`model_type = "qwen3"`): per-head q/k RMSNorm before RoPE.
    #[default]
    Qwen3,
    /// Llama 3.x (`"llama"`): plain GQA, the `llama3` RoPE frequency scaling, optional biases.
    Llama,
    /// Qwen2 / Qwen2.5 (`"qwen2"`): biases on the q, k and v projections, no q/k norms.
    Qwen2,
}

impl std::fmt::Display for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.model_type())
    }
}

impl Family {
    /// Every family, in the order help texts list them.
    pub const ALL: [Family; 3] = [Family::Qwen3, Family::Llama, Family::Qwen2];

    /// The family of a `config.json`'s `model_type`.
    pub fn from_model_type(model_type: &str) -> Option<Family> {
        Family::ALL
            .into_iter()
            .find(|f| f.model_type() == model_type)
    }

    /// The `model_type` this family writes.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Qwen3 => "qwen3",
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
        }
    }

    /// Every accepted `model_type`, for error messages.
    pub fn names() -> String {
        Family::ALL
            .iter()
            .map(|f| f.model_type())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Storage precision for exported weights (`"f32"` or `"bf16"` in configs; bf16 unless set,
/// as released checkpoints are).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SaveDtype {
    /// 32-bit floats.
    F32,
    /// bfloat16 (what released Qwen3 checkpoints use).
    #[default]
    Bf16,
}

impl SaveDtype {
    /// Bytes per stored weight.
    pub fn bytes(self) -> u64 {
        match self {
            SaveDtype::F32 => 4,
            SaveDtype::Bf16 => 2,
        }
    }
}

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
    pub fn bytes(&self) -> Result<u64> {
        let invalid = |message: String| SettingsError::key("model.max_shard_size", message);
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
    pub fn validate(&self) -> Result<()> {
        match (&self.path, &self.random) {
            (Some(_), None) => Ok(()),
            (None, Some(r)) => r.validate(),
            _ => Err(SettingsError::key(
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
    /// The shape's own checks (a random model's `config.json` is made from it): positive sizes,
    /// key/value heads that divide the query heads, an even head width.
    pub(crate) fn validate(&self) -> Result<()> {
        let bad = |key: &str, message: String| {
            Err(SettingsError::key(format!("model.random.{key}"), message))
        };
        for (key, v) in [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
        ] {
            if v == 0 {
                return bad(key, "must be positive".into());
            }
        }
        let kv = self.num_key_value_heads;
        if kv == 0 || !self.num_attention_heads.is_multiple_of(kv) {
            return bad(
                "num_key_value_heads",
                format!(
                    "{kv} does not divide num_attention_heads = {}",
                    self.num_attention_heads
                ),
            );
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad(
                "head_dim",
                format!(
                    "{} must be positive and even (rotary halves)",
                    self.head_dim
                ),
            );
        }
        if !(self.std > 0.0 && self.std.is_finite()) {
            return bad("std", format!("{} must be a finite number > 0", self.std));
        }
        Ok(())
    }
}
