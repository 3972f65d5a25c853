//! Qwen3 causal language model on [burn](https://burn.dev), generic over `B: Backend`.
//!
//! - [`Qwen3Config`]: HF `config.json` (hub and transformers-5 layouts).
//! - [`Qwen3ForCausalLM`]: the model; [`load_weights`] reads HF safetensors (single or sharded,
//!   f32/bf16/f16) and [`save_pretrained`] writes an HF directory back.
//! - [`rollout()`] / [`generate()`]: the rollout engine ([`engine`]: paged KV pool, continuous
//!   batching, shared prompts, sampling on the device); [`score_sequences`]: teacher-forced log-probs.
//! - [`Qwen3Tokenizer`]: `tokenizer.json` plus the Jinja chat template, over [`Message`]s
//!   (`conrub_rubric::Message`, re-exported: the same type as a rubric record's question).
//! - [`Qwen3`]: all of the above loaded from a directory or hub id.
//!
//! ```no_run
//! use burn::backend::Flex;
//! use conrub_qwen3::{ChatOptions, Message, Qwen3, SamplingConfig};
//!
//! let device = Default::default();
//! let qwen = Qwen3::<Flex>::load("Qwen/Qwen3-0.6B", &device).unwrap();
//! let tok = qwen.tokenizer.as_ref().unwrap();
//! let prompt = tok
//!     .apply_chat_template(&[Message::user("What is sepsis?")], ChatOptions::default())
//!     .unwrap();
//! let cfg = SamplingConfig { stop_ids: qwen.stop_ids(), ..Default::default() };
//! let out = qwen.generate(&[prompt], &cfg, &device).unwrap();
//! println!("{}", tok.decode(&out[0].tokens, true).unwrap());
//! ```

pub mod batch;
pub mod cache;
pub mod config;
pub mod device_sampling;
pub mod engine;
pub mod error;
pub mod generate;
pub mod hub;
pub mod io;
pub mod model;
pub mod paged;
mod pretrained;
pub mod tokenizer;
pub mod weights;

pub use batch::{ForwardBatch, PaddedBatch, Padding};
pub use cache::KvCache;
pub use config::{GenerationConfig, Qwen3Config, TokenIds};
pub use device_sampling::sample_on_device;
pub use engine::{attended_blocks, kv_block_bytes, rollout, EngineConfig, Rollout, RolloutStats};
pub use error::{Qwen3Error, Result};
pub use generate::{
    generate, generate_dense, sample_token, score_sequences, sequence_rng, FinishReason,
    Generation, SamplingConfig, SequenceScores,
};
pub use hub::resolve_model_dir;
pub use model::{AttentionImpl, Execution, Precision, Qwen3ForCausalLM};
pub use paged::{BlockAllocator, PagedKv, PagedPass, PagedRead};
pub use pretrained::{save_pretrained, Qwen3};
pub use tokenizer::{ChatOptions, Message, Qwen3Tokenizer};
pub use weights::{load_weights, SaveDtype, WeightFiles};
