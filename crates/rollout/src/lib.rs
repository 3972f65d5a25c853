//! The rollout engine: every generation in conrub (the learner's rollouts, `conrub generate`,
//! `eval`, the local judge) runs here, for any model that implements [`PagedModel`].
//!
//! - [`rollout`] / [`generate`]: one continuation per prompt over a paged KV pool of a fixed
//!   size ([`EngineConfig`]), with continuous batching, preemption to host memory, shared prompt
//!   prefixes (copy-on-write), attention shapes in a few sizes ([`attended_blocks`]) and sampling
//!   on the device ([`sample_on_device`]); [`RolloutStats`] says what a call did.
//! - [`SamplingConfig`] with [`Decoding`] (greedy, or a draw under temperature, top-p and top-k),
//!   the host rule [`sample_token`], per-sequence streams [`sequence_rng`], and what comes back:
//!   [`Generation`] with its [`FinishReason`].
//! - The pool itself for model code: [`PagedKv`] (blocks of every layer), [`PagedPass`] (where a
//!   pass writes, what it reads: [`PagedRead`], [`PagedPrefix`]), [`BlockAllocator`] and
//!   [`KvLayout`]; token batches [`ForwardBatch`] and [`PaddedBatch`].
//! - [`generate_static`]: the static-batch schedule over the same pass (one padded prefill, a
//!   fixed reservation per row, host sampling), the reference the engine is tested and
//!   benchmarked against.
//! - Errors: [`RolloutError`], [`Result`].
//!
//! A model plugs in with three methods: its [`KvLayout`], its vocabulary size and one
//! [`PagedModel::forward_paged`] (a prefill or a decode step over the pool). `conrub-qwen3`
//! implements it for `Qwen3ForCausalLM`.

mod batch;
mod device_sampling;
mod engine;
mod error;
mod model;
mod paged;
mod reference;
mod sampling;
mod shapes;

pub use batch::{ForwardBatch, PaddedBatch, Padding};
pub use device_sampling::sample_on_device;
pub use engine::{
    generate, rollout, EngineConfig, Rollout, RolloutStats, DEFAULT_BLOCK_SIZE, DEFAULT_MAX_ROWS,
};
pub use error::{Result, RolloutError};
pub use model::{KvLayout, PagedModel};
pub use paged::{BlockAllocator, PagedKv, PagedLayer, PagedPass, PagedPrefix, PagedRead};
pub use reference::generate_static;
pub use sampling::{
    check_sequences, sample_token, sequence_rng, Decoding, FinishReason, Generation, SamplingConfig,
};
pub use shapes::{attended_blocks, bucket_len, bucket_rows};
