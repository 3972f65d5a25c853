//! Qwen3 causal language model on [burn](https://burn.dev), generic over `B: Backend`.
//!
//! - [`Qwen3Config`]: HF `config.json` (hub and transformers-5 layouts).
//! - [`Qwen3ForCausalLM`]: the model; [`load_weights`] reads HF safetensors (single or sharded,
//!   f32/bf16/f16) and [`save_pretrained`] writes an HF directory back.
//! - Generation runs in `conrub-rollout`'s engine, which drives the model through its
//!   `PagedModel` implementation ([`Qwen3::generate`] is the shortcut; the paged pass is the
//!   model's only KV path); [`score_sequences`]: teacher-forced log-probs.
//! - [`Qwen3Tokenizer`]: `tokenizer.json` plus the Jinja chat template, over [`Message`]s
//!   (`conrub_base::Message`, re-exported: the same type as a rubric record's question).
//! - [`Qwen3`]: all of the above loaded from a directory or hub id.
//!
//! ```no_run
//! use burn::backend::Flex;
//! use conrub_qwen3::{ChatOptions, Message, Qwen3};
//! use conrub_rollout::SamplingConfig;
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
pub mod config;
pub mod error;
pub mod hub;
pub mod io;
pub mod model;
mod pretrained;
pub mod score;
pub mod tokenizer;
pub mod weights;

pub use config::{GenerationConfig, Qwen3Config, TokenIds};
pub use conrub_kernels::{AttentionKernelChoice, AttentionKernels};
pub use conrub_rollout::{ForwardBatch, PaddedBatch, Padding};
pub use error::{Qwen3Error, Result};
pub use hub::resolve_model_dir;
pub use model::{AttentionImpl, Execution, Precision, Qwen3ForCausalLM};
pub use pretrained::{save_pretrained, Qwen3};
pub use score::{score_sequences, SequenceScores};
pub use tokenizer::{ChatOptions, Message, Qwen3Tokenizer};
pub use weights::{load_weights, SaveDtype, WeightFiles};
