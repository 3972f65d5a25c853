//! Which variant of the shared decoder a family is ([`Architecture`]) and its rotary embedding
//! ([`Rope`]): what a family file (`qwen3.rs`, `llama.rs`, `qwen2.rs`) makes of a config.

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};

/// Which variant of the shared pre-norm decoder a family is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Architecture {
    /// Per-head RMSNorm of queries and keys before RoPE (`self_attn.q_norm` / `k_norm`).
    pub qk_norm: bool,
    /// Biases on the q, k and v projections.
    pub qkv_bias: bool,
    /// A bias on the output projection.
    pub o_bias: bool,
    /// Rotary embedding.
    pub rope: Rope,
}

/// Rotary position embedding settings: the base and an optional frequency scaling.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rope {
    /// Base frequency.
    pub theta: f64,
    /// Llama 3's rescaling of the low frequencies (`rope_type = "llama3"`).
    pub llama3: Option<Llama3Rope>,
}

/// The `llama3` RoPE scaling: wavelengths longer than `original_max_position_embeddings /
/// low_freq_factor` are stretched by `factor`, shorter than `... / high_freq_factor` kept, and
/// the band between interpolated.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3Rope {
    /// Stretch of the low frequencies.
    pub factor: f64,
    /// Lower edge of the interpolated band.
    pub low_freq_factor: f64,
    /// Upper edge of the interpolated band.
    pub high_freq_factor: f64,
    /// The context length the base model was trained for.
    pub original_max_position_embeddings: f64,
}

/// Refuses any RoPE scaling but the default (families that implement none).
pub(crate) fn default_rope_only(config: &ModelConfig) -> Result<Rope> {
    if let Some((field, kind, _)) = config.rope_kind() {
        if kind != "default" {
            return Err(ModelError::config(
                field,
                format!("rope type `{kind}` is not supported for {} (only `default` RoPE is implemented)", config.model_type),
            ));
        }
    }
    Ok(Rope {
        theta: config.rope_theta(),
        llama3: None,
    })
}
