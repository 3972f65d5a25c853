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
//! - Errors: [`ContractError`], [`Result`].
//!
//! The model-facing types ([`PagedModel`], the pool, the batches, [`SamplingConfig`],
//! [`Generation`], [`RolloutStats`]) are defined in `conrub_contracts` and re-exported here.
//!
//! A model plugs in with three methods: its [`KvLayout`], its vocabulary size and one
//! [`PagedModel::forward_paged`] (a prefill or a decode step over the pool). `conrub-models`
//! implements it for `CausalLm`.

mod device_sampling;
mod engine;
mod error;
mod reference;

pub use device_sampling::sample_on_device;
pub use engine::{
    generate, rollout, walk_shapes, EngineConfig, Rollout, DEFAULT_BLOCK_SIZE, DEFAULT_MAX_ROWS,
};
pub use error::{ContractError, Result};
pub use reference::generate_static;
// The model side of the engine lives in `conrub_contracts`; re-exported so the engine's callers
// name one crate.
pub use conrub_contracts::{
    attended_blocks, bucket_len, bucket_rows, check_sequences, sample_token, sequence_rng,
    BlockAllocator, Decoding, FinishReason, ForwardBatch, Generation, KvLayout, PaddedBatch,
    Padding, PagedKv, PagedLayer, PagedModel, PagedPass, PagedPrefix, PagedRead, RolloutStats,
    SamplingConfig, SamplingParams,
};
