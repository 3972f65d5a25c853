//! A model's shape as the memory planner and the learner read it
//! ([`conrub_contracts::ModelShape`]), from its `config.json`.

use conrub_contracts::ModelShape;

use crate::config::ModelConfig;

impl ModelConfig {
    /// The shape of this `config.json` (a config that fails its family's checks counts as
    /// Qwen3-like: q/k norms, no biases).
    pub fn shape(&self) -> ModelShape {
        let arch = self.architecture().ok();
        ModelShape {
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_hidden_layers: self.num_hidden_layers,
            num_attention_heads: self.num_attention_heads,
            num_key_value_heads: self.num_key_value_heads(),
            head_dim: self.head_dim(),
            tie_word_embeddings: self.tie_word_embeddings,
            qk_norm: arch.is_none_or(|a| a.qk_norm),
            qkv_bias: arch.is_some_and(|a| a.qkv_bias),
            o_bias: arch.is_some_and(|a| a.o_bias),
        }
    }
}
