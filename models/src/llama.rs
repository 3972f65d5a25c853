//! Llama 3.x: the shared decoder without q/k norms; `attention_bias` puts a bias on q, k, v and
//! o; RoPE plain or with the `llama3` frequency scaling of the 3.1+ releases; tied (3.2 1B/3B) or
//! untied head.

use crate::architecture::{Architecture, Llama3Rope, Rope};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};

/// `architectures` of an exported checkpoint.
pub const HF_ARCHITECTURE: &str = "LlamaForCausalLM";
/// transformers' `LlamaConfig` default (every released Llama 3 config sets its own, 500,000).
pub const DEFAULT_ROPE_THETA: f64 = 10_000.0;

/// Llama's checks and variant.
pub(crate) fn architecture(config: &ModelConfig) -> Result<Architecture> {
    Ok(Architecture {
        qk_norm: false,
        qkv_bias: config.attention_bias,
        o_bias: config.attention_bias,
        rope: rope(config)?,
    })
}

/// Plain RoPE, or `llama3` with all four of its parameters.
fn rope(config: &ModelConfig) -> Result<Rope> {
    let theta = config.rope_theta();
    match config.rope_kind() {
        None | Some((_, "default", _)) => Ok(Rope {
            theta,
            llama3: None,
        }),
        Some((field, "llama3", p)) => {
            let need = |name: &str, v: Option<f64>| {
                v.filter(|x| x.is_finite() && *x > 0.0).ok_or_else(|| {
                    ModelError::config(
                        &format!("{field}.{name}"),
                        "required by rope type `llama3` (a positive number)",
                    )
                })
            };
            let l = Llama3Rope {
                factor: need("factor", p.factor)?,
                low_freq_factor: need("low_freq_factor", p.low_freq_factor)?,
                high_freq_factor: need("high_freq_factor", p.high_freq_factor)?,
                original_max_position_embeddings: need(
                    "original_max_position_embeddings",
                    p.original_max_position_embeddings
                        .as_ref()
                        .and_then(serde_json::Number::as_f64),
                )?,
            };
            if !(l.high_freq_factor > l.low_freq_factor) {
                return Err(ModelError::config(
                    &format!("{field}.high_freq_factor"),
                    format!(
                        "must exceed low_freq_factor ({} <= {})",
                        l.high_freq_factor, l.low_freq_factor
                    ),
                ));
            }
            Ok(Rope {
                theta,
                llama3: Some(l),
            })
        }
        Some((field, other, _)) => Err(ModelError::config(
            field,
            format!("rope type `{other}` is not supported for llama (`default` and `llama3` are)"),
        )),
    }
}
