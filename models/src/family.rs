//! The model families conrub runs, chosen by `config.json`'s `model_type`: the one registry. A
//! family is a small file (`qwen3.rs`, `llama.rs`, `qwen2.rs`) that checks its config and says
//! which variant of the shared decoder (`model.rs`) it is: an [`Architecture`]. Adding a family is
//! one file and one arm in each match below.

use serde::{Deserialize, Serialize};

pub use crate::architecture::{Architecture, Llama3Rope, Rope};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};

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

    /// The transformers class an exported checkpoint names in `architectures`.
    pub fn hf_architecture(self) -> &'static str {
        match self {
            Family::Qwen3 => crate::qwen3::HF_ARCHITECTURE,
            Family::Llama => crate::llama::HF_ARCHITECTURE,
            Family::Qwen2 => crate::qwen2::HF_ARCHITECTURE,
        }
    }

    /// RoPE base when a config gives none (transformers' default for the family's config class,
    /// or the released checkpoints' value).
    pub fn default_rope_theta(self) -> f64 {
        match self {
            Family::Qwen3 => crate::qwen3::DEFAULT_ROPE_THETA,
            Family::Llama => crate::llama::DEFAULT_ROPE_THETA,
            Family::Qwen2 => crate::qwen2::DEFAULT_ROPE_THETA,
        }
    }

    /// The family's checks of `config` and the decoder variant it describes.
    pub fn architecture(self, config: &ModelConfig) -> Result<Architecture> {
        match self {
            Family::Qwen3 => crate::qwen3::architecture(config),
            Family::Llama => crate::llama::architecture(config),
            Family::Qwen2 => crate::qwen2::architecture(config),
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

impl std::fmt::Display for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.model_type())
    }
}

impl ModelConfig {
    /// The family `model_type` names.
    pub fn family(&self) -> Result<Family> {
        Family::from_model_type(&self.model_type).ok_or_else(|| {
            ModelError::config(
                "model_type",
                format!(
                    "`{}` is not a supported family (supported: {})",
                    self.model_type,
                    Family::names()
                ),
            )
        })
    }

    /// The decoder variant this config describes (its family's checks included).
    pub fn architecture(&self) -> Result<Architecture> {
        self.family()?.architecture(self)
    }
}
