//! Qwen2 / Qwen2.5: the shared decoder with biases on the q, k and v projections (never on o), no
//! q/k norms, default RoPE, full attention (sliding windows refused).

use crate::architecture::{default_rope_only, Architecture};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};

/// `architectures` of an exported checkpoint.
pub const HF_ARCHITECTURE: &str = "Qwen2ForCausalLM";
/// transformers' `Qwen2Config` default (released Qwen2.5 configs set 1,000,000).
pub const DEFAULT_ROPE_THETA: f64 = 10_000.0;

/// Qwen2's checks and variant.
pub(crate) fn architecture(config: &ModelConfig) -> Result<Architecture> {
    if config.attention_bias {
        return Err(ModelError::config(
            "attention_bias",
            "Qwen2 has biases on q, k and v only; an o_proj bias is not part of the family",
        ));
    }
    if config.use_sliding_window {
        return Err(ModelError::config(
            "use_sliding_window",
            "sliding-window attention is not supported",
        ));
    }
    Ok(Architecture {
        qk_norm: false,
        qkv_bias: true,
        o_bias: false,
        rope: default_rope_only(config)?,
    })
}
