//! Shared setup of the peer benchmarks: one random Qwen3-0.6B-shaped checkpoint on disk, loaded
//! by conrub (burn) and by candle-transformers.

use std::path::Path;

use burn::tensor::backend::Backend;
use conrub_models::{save_pretrained, CausalLm, ModelConfig, SaveDtype};

/// Writes a random Qwen3-0.6B-shaped f32 checkpoint (optionally with fewer layers) into `dir`.
pub fn write_checkpoint<B: Backend>(dir: &Path, layers: Option<usize>) -> ModelConfig {
    let mut cfg = ModelConfig::qwen3_0_6b();
    if let Some(n) = layers {
        cfg.num_hidden_layers = n;
    }
    let model = CausalLm::<B>::random(&cfg, 0.02, 0, &Default::default());
    save_pretrained(&model, &cfg, None, None, dir, SaveDtype::F32).expect("checkpoint written");
    cfg
}

/// candle's `Config` for the same checkpoint (candle requires fields our config leaves optional).
pub fn candle_config(cfg: &ModelConfig) -> candle_transformers::models::qwen3::Config {
    let json = serde_json::json!({
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "head_dim": cfg.head_dim(),
        "attention_bias": cfg.attention_bias,
        "num_key_value_heads": cfg.num_key_value_heads(),
        "max_position_embeddings": 4096,
        "sliding_window": null,
        "max_window_layers": cfg.num_hidden_layers,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "rope_theta": cfg.rope_theta(),
        "rms_norm_eps": cfg.rms_norm_eps,
        "use_sliding_window": false,
        "hidden_act": "silu",
    });
    serde_json::from_value(json).expect("candle config")
}

/// Loads the checkpoint with candle on the CPU in f32.
pub fn load_candle(
    dir: &Path,
    cfg: &ModelConfig,
) -> candle_transformers::models::qwen3::ModelForCausalLM {
    let device = candle_core::Device::Cpu;
    // SAFETY: the checkpoint was just written by this process and is not modified while mapped.
    let vb = unsafe {
        candle_nn::VarBuilder::from_mmaped_safetensors(
            &[dir.join("model.safetensors")],
            candle_core::DType::F32,
            &device,
        )
    }
    .expect("candle var builder");
    candle_transformers::models::qwen3::ModelForCausalLM::new(&candle_config(cfg), vb)
        .expect("candle model")
}
