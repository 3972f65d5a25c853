//! The GRPO learner of the ConRub method (docs/METHOD.md §5-§7), generic over burn backends.
//!
//! A step is a list of stages, each a type or trait of its own that a user can replace through
//! [`LearnerBuilder`]:
//!
//! | stage | type / trait | default |
//! |---|---|---|
//! | rollout | [`RolloutEngine`] ([`RolloutRequest`] -> [`RolloutBatch`], then weight sync) | [`GroupSampler`] over [`Policy::sample`]; `conrub train` uses [`InProcessEngine`] |
//! | rewards | `conrub_rewards::RewardSource` -> `GroupScores` | `JudgeRewards` (the rubric judge); `[[reward.functions]]`: `WeightedRewards` built by `RewardKinds` (all in `conrub-rewards`) |
//! | advantages | [`AdvantageEstimator`] (by name: `learner.estimator`) wrapped by [`TieAwareAdvantages`] with a [`TieBreaker`] | `group-relative` ([`GroupRelative`]) + [`PairwiseTieBreaker`] |
//! | train batch | [`TrainBatch`] (device-resident; micro-batches are slices of it) | built by the learner |
//! | policy loss | [`PolicyObjective`] (by name: `learner.loss`) | `clipped-surrogate` ([`PolicyLoss`]), `sequence-mean`; `gspo` ([`ImportanceLevel::Sequence`]) |
//! | update | [`Update`] (global clipping + AdamW at the [`LrSchedule`]'s rate) | `max_grad_norm = 1`, constant rate |
//!
//! `learner.estimator` and `learner.loss` are looked up in a [`Registry`] (verl-style): the
//! built-in entries take today's keys as parameters; an embedder registers its own and passes the
//! registry to [`LearnerBuilder::registry`].
//!
//! The whole public API:
//! - learner: [`Learner`], [`LearnerBuilder`], [`LearnerConfig`], [`StepMetrics`], [`StepOutput`]
//! - model side (defined in `conrub_contracts`, re-exported): [`Policy`], [`ResponseLogprobs`],
//!   [`TokenBatch`], [`TextCodec`], [`Export`], [`sample_by_recomputation`]
//! - rollout: [`RolloutEngine`], [`RolloutRequest`], [`RolloutBatch`], [`WeightSync`] (contracts),
//!   and the crate's engines [`InProcessEngine`], [`GroupSampler`]
//! - the task and its rewards are `conrub_rewards`' (`TaskPrompt`, `RewardSource`, `GroupScores`,
//!   the kinds registry); the learner takes a task's prompts and one reward source
//! - advantages: [`AdvantageEstimator`], [`GroupRelative`], [`ScaleRewards`],
//!   [`TieAwareAdvantages`], [`TieMode`], [`GroupOutcome`], [`TieStatus`]
//! - ties: [`TieBreaker`], [`PairwiseTieBreaker`], [`NoTieBreaker`], [`TiedGroup`], [`TieOutcome`],
//!   [`PairRecord`], [`TieStats`]
//! - plug-ins by name: [`Registry`], [`EstimatorFactory`], [`LossFactory`], [`DEFAULT_ESTIMATOR`],
//!   [`DEFAULT_LOSS`]
//! - loss and update: [`PolicyObjective`], [`PolicyLoss`], [`Aggregation`], [`Clip`], [`SurrogateBatch`],
//!   [`SurrogateOutput`], [`KlEstimator`], [`ImportanceLevel`], [`dpo_pair_loss`], [`TrainBatch`],
//!   [`mask_rows`], [`Update`] (global clipping with fixed-order sums on the device, then AdamW),
//!   [`UpdateConfig`], [`LrSchedule`], [`LrScheduleKind`]
//! - the learner's state on disk: [`save_state`] ([`write_state`] / [`write_group_state`] +
//!   [`StateDraft::seal`]), [`load_state`], [`TrainingState`], [`swap_in`]
//! - generation outside training (validation reads it): [`Learner::generate`] -> [`Answer`]
//! - the run (the loop, checkpoints, the run folder, metrics sinks, validation, the supervised
//!   warm-up) is `conrub_trainer`'s: this crate is the method and the learner
//! - data parallel: [`DataParallel`] (one learner per device on threads of one process, one
//!   gradient all-reduce per optimizer step, or the state sharded), [`split_groups`]; the
//!   collectives, shard layouts and buckets are `conrub_parallel`'s (`Collective`,
//!   `HostCollective`, `RankSlot`, `Sharding`, `ShardLayout`)
//! - errors: [`GrpoError`], [`Result`]
//!
//! Every tensor-taking item documents its shapes in a `# Shapes` section.
//!
//! Warnings and progress go through `tracing` (`warn!`, `info!`); a program that embeds the
//! learner sees them once it installs a subscriber (the `conrub` binary prints them on stderr,
//! filtered by `CONRUB_LOG`).

mod advantages;
mod batch;
mod error;
mod group;
mod learner;
mod loss;
mod parallel;
mod registry;
mod rollout;
mod schedule;
mod state;
mod stop;
mod ties;
mod update;

pub use advantages::{stable_seed, AdvantageEstimator, GroupRelative, ScaleRewards, TieStatus};
pub use batch::{mask_rows, TrainBatch};
pub use conrub_contracts::padded_width;
// The contracts the learner is written against, re-exported so an embedder names one crate.
pub use conrub_contracts::LrScheduleKind;
pub use conrub_contracts::{
    add_gradients, sample_by_recomputation, ContractError, EpochSummary, Export, JudgeScore,
    KernelWarmupLine, MetricsLine, Policy, ResponseLogprobs, RolloutBatch, RolloutEngine,
    RolloutRequest, StepMetrics, TextCodec, TieStats, TokenBatch, ValidationDecoding,
    ValidationLine, WeightSync,
};
pub use conrub_kernels::Clip;
pub use conrub_parallel::split_groups;
pub use error::{GrpoError, Result};
pub use group::{record_group, GroupOutcome, TieAwareAdvantages, TieMode};
pub use learner::{
    Learner, LearnerBuilder, LearnerConfig, ObjectiveSettings, OnNonFinite, OptimizerSettings,
    StepOutput, SystemSettings,
};
pub use loss::{
    aggregate_token_term, dpo_pair_loss, Aggregation, ImportanceLevel, KlEstimator, PolicyLoss,
    PolicyObjective, SurrogateBatch, SurrogateOutput,
};
pub use parallel::DataParallel;
pub use registry::{EstimatorFactory, LossFactory, Registry, DEFAULT_ESTIMATOR, DEFAULT_LOSS};
pub use rollout::{Answer, GroupSampler, InProcessEngine};
pub use schedule::LrSchedule;
pub use state::{
    load_state, save_state, swap_in, write_group_state, write_state, StateDraft, TrainingState,
};
pub use stop::{cut_at_stop_strings, stop_point};
pub use ties::{NoTieBreaker, PairRecord, PairwiseTieBreaker, TieBreaker, TieOutcome, TiedGroup};
pub use update::{Update, UpdateConfig};
