//! Qwen3 (dense): the shared decoder with per-head q/k RMSNorm before RoPE, no biases in released
//! checkpoints (`attention_bias` puts one on q, k, v and o), default RoPE; and the shapes of the
//! released checkpoints, for planning offline.

use conrub_contracts::ModelShape;

use crate::architecture::{default_rope_only, Architecture};
use crate::config::ModelConfig;
use crate::error::Result;

/// `architectures` of an exported checkpoint.
pub const HF_ARCHITECTURE: &str = "Qwen3ForCausalLM";
/// RoPE base of the released checkpoints.
pub const DEFAULT_ROPE_THETA: f64 = 1_000_000.0;

/// Qwen3's checks and variant.
pub(crate) fn architecture(config: &ModelConfig) -> Result<Architecture> {
    Ok(Architecture {
        qk_norm: true,
        qkv_bias: config.attention_bias,
        o_bias: config.attention_bias,
        rope: default_rope_only(config)?,
    })
}

const fn qwen3(
    hidden: usize,
    intermediate: usize,
    layers: usize,
    heads: usize,
    tied: bool,
) -> ModelShape {
    ModelShape {
        vocab_size: 151_936,
        hidden_size: hidden,
        intermediate_size: intermediate,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: 8,
        head_dim: 128,
        tie_word_embeddings: tied,
        qk_norm: true,
        qkv_bias: false,
        o_bias: false,
    }
}

/// Shapes of the released Qwen3 checkpoints, by hub id (for planning offline, without their
/// `config.json`).
pub const KNOWN_SHAPES: &[(&str, ModelShape)] = &[
    ("Qwen/Qwen3-0.6B", qwen3(1024, 3072, 28, 16, true)),
    ("Qwen/Qwen3-0.6B-Base", qwen3(1024, 3072, 28, 16, true)),
    ("Qwen/Qwen3-1.7B", qwen3(2048, 6144, 28, 16, true)),
    ("Qwen/Qwen3-1.7B-Base", qwen3(2048, 6144, 28, 16, true)),
    ("Qwen/Qwen3-4B", qwen3(2560, 9728, 36, 32, true)),
    ("Qwen/Qwen3-4B-Base", qwen3(2560, 9728, 36, 32, true)),
    (
        "Qwen/Qwen3-4B-Instruct-2507",
        qwen3(2560, 9728, 36, 32, true),
    ),
    (
        "Qwen/Qwen3-4B-Thinking-2507",
        qwen3(2560, 9728, 36, 32, true),
    ),
    ("Qwen/Qwen3-8B", qwen3(4096, 12288, 36, 32, false)),
    ("Qwen/Qwen3-8B-Base", qwen3(4096, 12288, 36, 32, false)),
    ("Qwen/Qwen3-14B", qwen3(5120, 17408, 40, 40, false)),
    ("Qwen/Qwen3-14B-Base", qwen3(5120, 17408, 40, 40, false)),
    ("Qwen/Qwen3-32B", qwen3(5120, 25600, 64, 64, false)),
];

/// The shape of a released Qwen3 by hub id (case-insensitive), from [`KNOWN_SHAPES`].
pub fn known_shape(hub_id: &str) -> Option<ModelShape> {
    KNOWN_SHAPES
        .iter()
        .find(|(id, _)| id.eq_ignore_ascii_case(hub_id))
        .map(|(_, s)| *s)
}
