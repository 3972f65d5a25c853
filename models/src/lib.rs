//! The decoder families conrub trains (Qwen3, Llama 3.x, Qwen2 / Qwen2.5) on
//! [burn](https://burn.dev), generic over `B: Backend`, as candle does it: one shared decoder
//! (`model.rs`: RMSNorm, RoPE, GQA on our kernels, SwiGLU, the paged pass, layer-wise gradients)
//! and one small file per family (`qwen3.rs`, `llama.rs`, `qwen2.rs`) that checks its config and
//! names its [`Architecture`]; [`Family`] is the registry, chosen by `config.json`'s `model_type`.
//!
//! - [`ModelConfig`]: HF `config.json` of any family (hub and transformers-5 layouts).
//! - [`CausalLm`]: the model; [`load_weights`] reads HF safetensors (single or sharded,
//!   f32/bf16/f16) and [`save_pretrained`] writes an HF directory back.
//! - Generation runs in `conrub-rollout`'s engine, which drives the model through its
//!   `PagedModel` implementation ([`Pretrained::generate`] is the shortcut; the paged pass is the
//!   model's only KV path); [`score_sequences`]: teacher-forced log-probs.
//! - [`ChatTokenizer`]: `tokenizer.json` plus the Jinja chat template, over [`Message`]s
//!   (`conrub_base::Message`, re-exported: the same type as a rubric record's question).
//! - [`Pretrained`]: all of the above loaded from a directory or hub id.
//! - The contracts (`conrub_contracts`): `Policy` and `PagedModel` for [`CausalLm`],
//!   `TextCodec` for [`ChatTemplateCodec`], the shape ([`ModelConfig::shape`], [`known_shape`]).
//!
//! ```no_run
//! use burn::backend::Flex;
//! use conrub_models::{ChatOptions, Message, Pretrained};
//! use conrub_rollout::SamplingConfig;
//!
//! let device = Default::default();
//! let qwen = Pretrained::<Flex>::load("Qwen/Qwen3-0.6B", &device).unwrap();
//! let tok = qwen.tokenizer.as_ref().unwrap();
//! let prompt = tok
//!     .apply_chat_template(&[Message::user("What is sepsis?")], ChatOptions::default())
//!     .unwrap();
//! let cfg = SamplingConfig { stop_ids: qwen.stop_ids(), ..Default::default() };
//! let out = qwen.generate(&[prompt], &cfg, &device).unwrap();
//! println!("{}", tok.decode(&out[0].tokens, true).unwrap());
//! ```

mod architecture;
pub mod batch;
mod codec;
pub mod config;
pub mod error;
pub mod family;
pub mod hub;
pub mod io;
pub mod llama;
pub mod model;
mod policy;
mod pretrained;
pub mod qwen2;
pub mod qwen3;
pub mod score;
mod shapes;
pub mod tokenizer;
pub mod weights;

pub use codec::ChatTemplateCodec;
pub use config::{GenerationConfig, ModelConfig, TokenIds};
pub use conrub_contracts::{
    AttentionKernelChoice, AttentionKernels, ForwardBatch, PaddedBatch, Padding,
};
pub use error::{ModelError, Result};
pub use family::{Architecture, Family, FamilyModel, Llama3Rope, Rope};
pub use hub::resolve_model_dir;
pub use model::{AttentionImpl, CausalLm, Execution, Precision};
pub use pretrained::{save_pretrained, save_pretrained_sharded, HfExport, Pretrained};
pub use qwen3::{known_shape, KNOWN_SHAPES};
pub use score::{score_sequences, SequenceScores};
pub use tokenizer::{ChatOptions, ChatTokenizer, Message};
pub use weights::{load_weights, shard_plan, SaveDtype, WeightFiles, INDEX_FILE, SINGLE_FILE};
