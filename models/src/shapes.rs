//! The Qwen3 family's shape as the memory planner and the learner read it
//! ([`conrub_contracts::ModelShape`]), from a `config.json` or, offline, from a released
//! checkpoint's hub id.

use conrub_contracts::ModelShape;

use crate::config::ModelConfig;

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

impl ModelConfig {
    /// The shape of this `config.json`.
    pub fn shape(&self) -> ModelShape {
        ModelShape {
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_hidden_layers: self.num_hidden_layers,
            num_attention_heads: self.num_attention_heads,
            num_key_value_heads: self.num_key_value_heads(),
            head_dim: self.head_dim(),
            tie_word_embeddings: self.tie_word_embeddings,
        }
    }
}
