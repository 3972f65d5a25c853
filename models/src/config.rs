//! Hugging Face `config.json` and `generation_config.json` of the decoder families
//! ([`Family`](crate::Family)), with HF field names.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

/// Rope parameters as transformers 5 writes them (`rope_parameters`), or as `rope_scaling` in older
/// checkpoints. The default (unscaled) RoPE and, for Llama, `llama3` are implemented; any other
/// `rope_type` is rejected by the family.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct RopeParameters {
    /// `default` (or absent) is plain RoPE.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_type: Option<String>,
    /// Legacy spelling of `rope_type` used by some checkpoints.
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub legacy_type: Option<String>,
    /// Base frequency (transformers 5 layout).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    /// `llama3`: stretch of the low frequencies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub factor: Option<f64>,
    /// `llama3`: lower edge of the interpolated band.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub low_freq_factor: Option<f64>,
    /// `llama3`: upper edge of the interpolated band.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub high_freq_factor: Option<f64>,
    /// `llama3`: the base model's context length (kept as written: an integer stays one on
    /// export).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub original_max_position_embeddings: Option<serde_json::Number>,
}

impl RopeParameters {
    fn kind(&self) -> Option<&str> {
        self.rope_type.as_deref().or(self.legacy_type.as_deref())
    }
}

/// A decoder's configuration, parsed from a Hugging Face `config.json` of any [`Family`](crate::Family)
/// (`model_type` chooses it; a config without one is read as Qwen3).
///
/// Both layouts seen in the wild are accepted: the hub layout with top-level `rope_theta` and
/// `torch_dtype`, and the transformers-5 layout with `rope_parameters.rope_theta` and `dtype`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: usize,
    /// Model width.
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Number of query heads.
    pub num_attention_heads: usize,
    /// Number of key/value heads (GQA when smaller than `num_attention_heads`, MQA when 1).
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Per-head width; Qwen3 sets it explicitly and it may differ from hidden/heads (the others
    /// default to hidden/heads).
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// RMSNorm epsilon.
    #[serde(default = "default_rms_norm_eps")]
    pub rms_norm_eps: f64,
    /// RoPE base frequency (hub layout).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    /// RoPE parameters (transformers 5 layout).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_parameters: Option<RopeParameters>,
    /// Legacy RoPE scaling block; its type must be one the family implements (`default`; for
    /// Llama also `llama3`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<RopeParameters>,
    /// Context length the model was trained for.
    #[serde(default = "default_max_position_embeddings")]
    pub max_position_embeddings: usize,
    /// Whether the LM head reuses the token embedding.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Whether q/k/v/o projections carry a bias (false for released Qwen3 and Llama; Qwen2's
    /// q/k/v biases come with the family, not with this key).
    #[serde(default)]
    pub attention_bias: bool,
    /// Llama's MLP biases: `true` is refused for every family (no release uses them); kept as
    /// written on export.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mlp_bias: Option<bool>,
    /// Activation of the MLP; only `silu` is supported.
    #[serde(default = "default_hidden_act")]
    pub hidden_act: String,
    /// Storage dtype (hub layout).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub torch_dtype: Option<String>,
    /// Storage dtype (transformers 5 layout).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<String>,
    /// End-of-sequence id(s) from the config.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eos_token_id: Option<TokenIds>,
    /// Beginning-of-sequence id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bos_token_id: Option<u32>,
    /// Sliding-window attention (only `false`/absent is supported; released Qwen3 does not use it).
    #[serde(default)]
    pub use_sliding_window: bool,
    /// `model_type`: the [`Family`](crate::Family) (`qwen3`, `llama`, `qwen2`).
    #[serde(default = "default_model_type")]
    pub model_type: String,
    /// `architectures`, kept for export.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub architectures: Option<Vec<String>>,
    /// Every other field of `config.json`, kept unchanged so a saved checkpoint's config says
    /// everything the loaded one did.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// One token id or a list of them, as HF configs write `eos_token_id`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    /// A single id.
    One(u32),
    /// Several ids.
    Many(Vec<u32>),
}

impl TokenIds {
    /// The ids as a vector.
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            TokenIds::One(id) => vec![*id],
            TokenIds::Many(ids) => ids.clone(),
        }
    }
}

fn default_rms_norm_eps() -> f64 {
    1e-6
}
fn default_max_position_embeddings() -> usize {
    40_960
}
fn default_hidden_act() -> String {
    "silu".into()
}
fn default_model_type() -> String {
    "qwen3".into()
}

impl ModelConfig {
    /// Reads and validates `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        Self::from_json_str(&text).map_err(|e| match e {
            ModelError::Json { source, .. } => ModelError::Json {
                path: path.to_path_buf(),
                source,
            },
            ModelError::Config { field, message, .. } => ModelError::Config {
                path: Some(path.to_path_buf()),
                field,
                message,
            },
            other => other,
        })
    }

    /// Parses and validates a `config.json` text.
    pub fn from_json_str(text: &str) -> Result<Self> {
        let config: Self = serde_json::from_str(text).map_err(|source| ModelError::Json {
            path: "config.json".into(),
            source,
        })?;
        config.validate()?;
        Ok(config)
    }

    /// The RoPE block that says a type: the field it is under (`rope_scaling` first, as
    /// transformers reads it), the type, and the block.
    pub fn rope_kind(&self) -> Option<(&'static str, &str, &RopeParameters)> {
        [
            ("rope_scaling", &self.rope_scaling),
            ("rope_parameters", &self.rope_parameters),
        ]
        .into_iter()
        .find_map(|(field, r)| {
            let r = r.as_ref()?;
            r.kind().map(|k| (field, k, r))
        })
    }

    /// Checks the fields this implementation relies on (the family's own checks included).
    pub fn validate(&self) -> Result<()> {
        let err = |field: &str, message: String| Err(ModelError::config(field, message));
        self.architecture()?;
        if self.mlp_bias == Some(true) {
            return err(
                "mlp_bias",
                "MLP biases are not supported (no released checkpoint of a supported family uses them)".into(),
            );
        }
        if self.hidden_act != "silu" {
            return err(
                "hidden_act",
                format!("`{}` is not supported (expected `silu`)", self.hidden_act),
            );
        }
        if self.use_sliding_window {
            return err(
                "use_sliding_window",
                "sliding-window attention is not supported".into(),
            );
        }
        for (field, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
        ] {
            if v == 0 {
                return err(field, "must be positive".into());
            }
        }
        let kv = self.num_key_value_heads();
        if kv == 0 || !self.num_attention_heads.is_multiple_of(kv) {
            return err(
                "num_key_value_heads",
                format!(
                    "{kv} does not divide num_attention_heads = {}",
                    self.num_attention_heads
                ),
            );
        }
        if self.head_dim() == 0 || !self.head_dim().is_multiple_of(2) {
            return err(
                "head_dim",
                format!(
                    "{} must be a positive even number (RoPE rotates pairs)",
                    self.head_dim()
                ),
            );
        }
        if !(self.rms_norm_eps > 0.0) {
            return err("rms_norm_eps", "must be positive".into());
        }
        Ok(())
    }

    /// Key/value heads (defaults to the number of query heads).
    pub fn num_key_value_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Per-head width (defaults to hidden/heads when the config omits it).
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    /// RoPE base from either layout (else the family's default: 1,000,000 for Qwen3).
    pub fn rope_theta(&self) -> f64 {
        self.rope_theta
            .or_else(|| self.rope_parameters.as_ref().and_then(|r| r.rope_theta))
            .or_else(|| self.rope_scaling.as_ref().and_then(|r| r.rope_theta))
            .unwrap_or_else(|| self.family_rope_theta())
    }

    /// Storage dtype name from either layout (`bfloat16`, `float32`, ...).
    pub fn storage_dtype(&self) -> Option<&str> {
        self.torch_dtype.as_deref().or(self.dtype.as_deref())
    }

    /// A Qwen3-0.6B-shaped configuration (28 layers, hidden 1,024, 16/8 heads of 128, vocab 151,936).
    pub fn qwen3_0_6b() -> Self {
        Self::from_json_str(QWEN3_0_6B_CONFIG).expect("built-in config is valid")
    }

    /// A tiny configuration for tests and demos with the given vocabulary size.
    pub fn tiny(vocab_size: usize) -> Self {
        let mut c = Self::qwen3_0_6b();
        c.vocab_size = vocab_size;
        c.hidden_size = 64;
        c.intermediate_size = 128;
        c.num_hidden_layers = 2;
        c.num_attention_heads = 4;
        c.num_key_value_heads = Some(2);
        c.head_dim = Some(32);
        c.max_position_embeddings = 4096;
        c
    }

    /// Writes this config as pretty JSON (atomically).
    pub fn write(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self).expect("config serialises");
        crate::io::write_atomic(path, text.as_bytes())
    }
}

/// The published Qwen3-0.6B `config.json` shape (hub layout).
pub const QWEN3_0_6B_CONFIG: &str = r#"{
  "architectures": ["Qwen3ForCausalLM"],
  "attention_bias": false,
  "bos_token_id": 151643,
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 1024,
  "intermediate_size": 3072,
  "max_position_embeddings": 40960,
  "model_type": "qwen3",
  "num_attention_heads": 16,
  "num_hidden_layers": 28,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "use_sliding_window": false,
  "vocab_size": 151936
}"#;

/// The subset of `generation_config.json` that generation uses.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GenerationConfig {
    /// Stop ids.
    #[serde(default)]
    pub eos_token_id: Option<TokenIds>,
    /// Padding id.
    #[serde(default)]
    pub pad_token_id: Option<u32>,
    /// Default sampling temperature.
    #[serde(default)]
    pub temperature: Option<f64>,
    /// Default nucleus threshold.
    #[serde(default)]
    pub top_p: Option<f64>,
    /// Default top-k.
    #[serde(default)]
    pub top_k: Option<usize>,
    /// Default repetition penalty.
    #[serde(default)]
    pub repetition_penalty: Option<f64>,
}

impl GenerationConfig {
    /// Reads `generation_config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        serde_json::from_str(&text).map_err(|source| ModelError::Json {
            path: path.to_path_buf(),
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::family::Family;

    #[test]
    fn parses_hub_layout() {
        let c = ModelConfig::qwen3_0_6b();
        assert_eq!(c.head_dim(), 128);
        assert_eq!(c.num_key_value_heads(), 8);
        assert_eq!(c.rope_theta(), 1_000_000.0);
        assert_eq!(c.rms_norm_eps, 1e-6);
        assert_eq!(c.storage_dtype(), Some("bfloat16"));
        assert!(c.tie_word_embeddings);
    }

    #[test]
    fn parses_transformers5_layout() {
        let text = r#"{"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 6, "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0},
            "dtype": "float32", "eos_token_id": [3, 4]}"#;
        let c = ModelConfig::from_json_str(text).unwrap();
        assert_eq!(c.rope_theta(), 5000.0);
        assert_eq!(c.storage_dtype(), Some("float32"));
        assert_eq!(c.head_dim(), 6);
        assert_eq!(c.eos_token_id.unwrap().to_vec(), vec![3, 4]);
    }

    #[test]
    fn unknown_fields_survive_a_round_trip() {
        let text = r#"{"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "layer_types": ["full_attention"],
            "use_cache": true, "rope_theta": 10000.0}"#;
        let c = ModelConfig::from_json_str(text).unwrap();
        let back: serde_json::Value = serde_json::to_value(&c).unwrap();
        assert_eq!(back["layer_types"], serde_json::json!(["full_attention"]));
        assert_eq!(back["use_cache"], true);
        assert_eq!(back["rope_theta"], 10000.0);
    }

    #[test]
    fn rejects_unknown_rope_scaling() {
        let text = r#"{"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}"#;
        let err = ModelConfig::from_json_str(text).unwrap_err().to_string();
        assert!(
            err.contains("rope_scaling") && err.contains("yarn"),
            "{err}"
        );
    }

    /// A Llama 3.1 `config.json` in the hub layout (`rope_scaling` beside a top-level
    /// `rope_theta`): the `llama3` parameters are read, and an export writes them back as given
    /// (the integer context stays an integer, `mlp_bias: false` stays).
    #[test]
    fn reads_a_llama_3_1_hub_config_and_writes_it_back() {
        let text = r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "attention_bias": false,
            "mlp_bias": false, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
            "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"}}"#;
        let c = ModelConfig::from_json_str(text).unwrap();
        assert_eq!(c.family().unwrap(), Family::Llama);
        let a = c.architecture().unwrap();
        assert!(!a.qk_norm && !a.qkv_bias && !a.o_bias);
        assert_eq!(a.rope.theta, 500_000.0);
        let l = a.rope.llama3.unwrap();
        assert_eq!(
            (l.factor, l.low_freq_factor, l.high_freq_factor),
            (8.0, 1.0, 4.0)
        );
        assert_eq!(l.original_max_position_embeddings, 8192.0);
        assert_eq!(c.head_dim(), 128);
        let back = serde_json::to_value(&c).unwrap();
        assert_eq!(
            back["rope_scaling"]["original_max_position_embeddings"],
            serde_json::json!(8192)
        );
        assert_eq!(back["mlp_bias"], false);
        // Other RoPE types and MLP biases are refused, naming the key.
        let yarn = text.replace("\"llama3\"", "\"yarn\"");
        let e = ModelConfig::from_json_str(&yarn).unwrap_err().to_string();
        assert!(e.contains("rope_scaling") && e.contains("yarn"), "{e}");
        let biased = text.replace("\"mlp_bias\": false", "\"mlp_bias\": true");
        let e = ModelConfig::from_json_str(&biased).unwrap_err().to_string();
        assert!(e.contains("mlp_bias"), "{e}");
        let missing = text.replace("\"low_freq_factor\": 1.0, ", "");
        let e = ModelConfig::from_json_str(&missing)
            .unwrap_err()
            .to_string();
        assert!(e.contains("rope_scaling.low_freq_factor"), "{e}");
    }

    #[test]
    fn rejects_bad_kv_heads_naming_the_field() {
        let text = r#"{"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 3, "num_key_value_heads": 2}"#;
        let err = ModelConfig::from_json_str(text).unwrap_err().to_string();
        assert!(err.contains("num_key_value_heads"), "{err}");
    }
}
