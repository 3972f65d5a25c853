//! The model families conrub runs, chosen by `config.json`'s `model_type`: the one registry. A
//! family is a small file (`qwen3.rs`, `llama.rs`, `qwen2.rs`) that checks its config and says
//! which variant of the shared decoder (`model.rs`) it is: an [`Architecture`]. Adding a family is
//! one file and one arm in each match below.

pub use crate::architecture::{Architecture, Llama3Rope, Rope};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};

pub use conrub_settings::Family;

/// What a family is to this crate: the transformers class it exports as, its RoPE default and
/// the decoder variant a config of it describes. `Family` itself (its names) is a setting.
pub trait FamilyModel {
    /// The transformers class an exported checkpoint names in `architectures`.
    fn hf_architecture(self) -> &'static str;
    /// RoPE base when a config gives none (transformers' default for the family's config class,
    /// or the released checkpoints' value).
    fn default_rope_theta(self) -> f64;
    /// The family's checks of `config` and the decoder variant it describes.
    fn architecture(self, config: &ModelConfig) -> Result<Architecture>;
}

impl FamilyModel for Family {
    fn hf_architecture(self) -> &'static str {
        match self {
            Family::Qwen3 => crate::qwen3::HF_ARCHITECTURE,
            Family::Llama => crate::llama::HF_ARCHITECTURE,
            Family::Qwen2 => crate::qwen2::HF_ARCHITECTURE,
        }
    }

    fn default_rope_theta(self) -> f64 {
        match self {
            Family::Qwen3 => crate::qwen3::DEFAULT_ROPE_THETA,
            Family::Llama => crate::llama::DEFAULT_ROPE_THETA,
            Family::Qwen2 => crate::qwen2::DEFAULT_ROPE_THETA,
        }
    }

    fn architecture(self, config: &ModelConfig) -> Result<Architecture> {
        match self {
            Family::Qwen3 => crate::qwen3::architecture(config),
            Family::Llama => crate::llama::architecture(config),
            Family::Qwen2 => crate::qwen2::architecture(config),
        }
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

    /// The family's RoPE base, for a config that gives none (Qwen3's for an unknown family).
    pub(crate) fn family_rope_theta(&self) -> f64 {
        self.family().unwrap_or_default().default_rope_theta()
    }

    /// The decoder variant this config describes (its family's checks included).
    pub fn architecture(&self) -> Result<Architecture> {
        self.family()?.architecture(self)
    }

    /// The config of a `[model.random]` table: its family and shape, the 151,936-token
    /// vocabulary of the bundled tokenizer, the rest as [`ModelConfig::tiny`].
    pub fn random(r: &conrub_settings::RandomModel) -> Self {
        let mut c = ModelConfig::tiny(151_936);
        c.model_type = r.family.model_type().into();
        c.architectures = Some(vec![r.family.hf_architecture().into()]);
        c.hidden_size = r.hidden_size;
        c.intermediate_size = r.intermediate_size;
        c.num_hidden_layers = r.num_hidden_layers;
        c.num_attention_heads = r.num_attention_heads;
        c.num_key_value_heads = Some(r.num_key_value_heads);
        c.head_dim = Some(r.head_dim);
        c
    }
}
