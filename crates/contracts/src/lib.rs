//! The contracts between conrub's learner, its models and its rollout engines. Everything here is
//! an interface or the plain data that crosses one; no algorithm, no model, no engine. The
//! dependencies point at this crate: `conrub-grpo` (the learner), `conrub-rollout` (the paged
//! engine), `conrub-remote` (an inference server as an engine), `conrub-plot` (the metrics
//! file), `conrub-memory` (the memory plan) and every model family of `models/`. It depends on
//! burn, on `conrub-kernels` where a contract names an op, and on `conrub-settings` for the
//! settings it re-exports.
//!
//! | contract | implemented by | used by |
//! |---|---|---|
//! | [`Policy`] (+ [`TokenBatch`], [`ResponseLogprobs`]) | each model family; a user's burn model | the learner |
//! | [`PagedModel`] (+ [`KvLayout`], [`PagedKv`], [`PagedPass`], [`ForwardBatch`], [`PaddedBatch`]) | each model family | the paged engine |
//! | [`TextCodec`] | each family's tokenizer and chat template | the learner, the judges |
//! | [`RolloutEngine`] (+ [`RolloutRequest`], [`RolloutBatch`], [`WeightSync`], [`RolloutStats`]) | the in-process engines, an SGLang server | the learner |
//! | [`Export`] | each family's Hugging Face writer | checkpoints |
//! | [`ParamGather`] (+ [`gathered`], [`GatheredParam`]) | a sharded data-parallel rank | [`Gradients::Gathered`] |
//! | [`Execution`] ([`Precision`], [`AttentionImpl`], [`AttentionKernelChoice`]) | data | every family's forward |
//! | [`ModelShape`] | data a family reports | the memory plan |
//! | [`MetricsLine`] ([`StepMetrics`], [`EpochSummary`], [`ValidationLine`], [`KernelWarmupLine`]) | data the learner writes | plots, a user's tools |
//! | [`LearnerConfig`], [`RunConfig`], [`ValidationConfig`] (+ [`TieMode`], [`Aggregation`], [`ScaleRewards`], [`OnNonFinite`], [`LrScheduleKind`]) | data: the `[learner]`, `[run]` and `[eval]` tables, defined in `conrub-settings` and re-exported | the learner, the config crate |
//! | [`SamplingConfig`], [`Generation`], [`sample_token`], [`sequence_rng`] | the one sampling rule | the engines, [`sample_by_recomputation`] |
//!
//! Errors: [`ContractError`], [`Result`].

mod batch;
mod codec;
mod engine;
mod error;
mod exec;
mod export;
mod gather;
mod metrics;
mod model;
mod paged;
mod policy;
mod sampling;
mod shape;
mod shapes;
mod stats;
mod tokens;

pub use batch::{ForwardBatch, PaddedBatch, Padding};
pub use codec::TextCodec;
pub use conrub_base::Message;
pub use conrub_settings::{
    Aggregation, KlEstimator, LearnerConfig, LrScheduleKind, ObjectiveSettings, OnNonFinite,
    OptimizerSettings, RunConfig, ScaleRewards, Sharding, SystemSettings, TieMode,
    ValidationConfig, DEFAULT_ESTIMATOR, DEFAULT_LOSS, GSPO_LOSS,
};
pub use engine::{RolloutBatch, RolloutEngine, RolloutRequest, ShapeWalk, WeightSync};
pub use error::{ContractError, Result};
pub use exec::{
    to_dtype, AttentionImpl, AttentionKernelChoice, AttentionKernels, Execution, Precision,
};
pub use export::Export;
pub use gather::{gathered, gathered_as, GatheredParam, ParamGather};
pub use metrics::{
    EpochSummary, JudgeScore, KernelWarmupLine, MetricsLine, StepMetrics, TieStats,
    ValidationDecoding, ValidationLine,
};
pub use model::PagedModel;
pub use paged::{BlockAllocator, KvLayout, PagedKv, PagedLayer, PagedPass, PagedPrefix, PagedRead};
pub use policy::{
    add_gradients, loss_gradients, sample_by_recomputation, whole_backward, Gradients, Policy,
    ResponseLogprobs,
};
pub use sampling::{
    check_sequences, sample_token, sequence_rng, Decoding, FinishReason, Generation,
    SamplingConfig, SamplingParams,
};
pub use shape::ModelShape;
pub use shapes::{
    attended_blocks, bucket_len, bucket_rows, dim_class, padded_width, EngineShapes, MicroShape,
    ShapeBounds,
};
pub use stats::RolloutStats;
pub use tokens::TokenBatch;
