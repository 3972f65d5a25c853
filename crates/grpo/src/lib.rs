//! The GRPO learner of the ConRub method (docs/METHOD.md §5-§7), generic over burn backends.
//!
//! A step is a list of stages, each a type or trait of its own that a user can replace through
//! [`LearnerBuilder`]:
//!
//! | stage | type / trait | default |
//! |---|---|---|
//! | rollout | [`RolloutEngine`] ([`RolloutRequest`] -> [`RolloutBatch`], then weight sync) | [`GroupSampler`] over [`Policy::sample`]; `conrub train` uses [`InProcessEngine`] |
//! | rewards | [`RewardSource`] -> [`GroupScores`] | [`JudgeRewards`] (the judge crate's judge-then-score path); `[[reward.functions]]`: [`WeightedRewards`] built by [`RewardKinds`] |
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
//! - the task: [`TaskPrompt`] (one prompt of a task; [`conrub_rubric::RubricRecord`] is one kind)
//! - rewards: [`RewardSource`] (of a task's prompts), [`JudgeRewards`] (rubric records), [`GroupScores`];
//!   `[[reward.functions]]`: [`RewardKinds`] (the registry of kinds, [`BUILTIN_REWARD_KINDS`]),
//!   [`WeightedRewards`] (the mix), [`VerifiableReward`], [`HttpReward`]
//! - advantages: [`AdvantageEstimator`], [`GroupRelative`], [`ScaleRewards`],
//!   [`TieAwareAdvantages`], [`TieMode`], [`GroupOutcome`], [`TieStatus`]
//! - ties: [`TieBreaker`], [`PairwiseTieBreaker`], [`NoTieBreaker`], [`TiedGroup`], [`TieOutcome`],
//!   [`PairRecord`], [`TieStats`]
//! - plug-ins by name: [`Registry`], [`EstimatorFactory`], [`LossFactory`], [`DEFAULT_ESTIMATOR`],
//!   [`DEFAULT_LOSS`], [`BUILTIN_ESTIMATORS`], [`BUILTIN_LOSSES`]
//! - loss and update: [`PolicyObjective`], [`PolicyLoss`], [`Aggregation`], [`Clip`], [`SurrogateBatch`],
//!   [`SurrogateOutput`], [`KlEstimator`], [`ImportanceLevel`], [`dpo_pair_loss`], [`TrainBatch`],
//!   [`mask_rows`], [`Update`] (global clipping with fixed-order sums on the device, then AdamW),
//!   [`UpdateConfig`], [`LrSchedule`], [`LrScheduleKind`]
//! - what a run writes besides its metrics: [`samples`] (each step's rollouts and each validation
//!   round's answers, for reading), [`tensorboard`] (event files written directly),
//!   [`run_folder`] (the folder's lock, `--resume auto`'s newest complete checkpoint)
//! - the run: [`train`] over a [`Trainee`] (a [`Learner`] or a [`DataParallel`] group; epochs in a seeded order, `metrics.jsonl` ([`MetricsLine`]), checkpoints,
//!   resume), [`RunConfig`], [`RunHooks`], [`RunSummary`], [`EpochSummary`], [`save_state`]
//!   ([`write_state`] + [`StateDraft::seal`]: the loop seals a checkpoint behind the next steps),
//!   [`load_state`], [`TrainingState`], [`sft_warmup`], [`warmup_pairs`], [`BestCheckpoint`],
//!   [`best_checkpoint_path`]
//! - validation during training: [`Validator`] (held-out prompts scored by the training judge and
//!   a grader) over [`HeldOutPrompt`]s, [`ValidationConfig`], [`ValidationDecoding`],
//!   [`ValidationLine`], [`JudgeScore`], [`Answer`]
//! - data parallel: [`DataParallel`] (one learner per device on threads of one process, one
//!   gradient all-reduce per optimizer step, or the state sharded: [`Sharding`], [`ShardLayout`]),
//!   [`Collective`], [`HostCollective`], [`RankSlot`], [`split_groups`]
//! - errors: [`GrpoError`], [`Result`]
//!
//! Every tensor-taking item documents its shapes in a `# Shapes` section.
//!
//! Warnings and progress go through `tracing` (`warn!`, `info!`); a program that embeds the
//! learner sees them once it installs a subscriber (the `conrub` binary prints them on stderr,
//! filtered by `CONRUB_LOG`).

mod advantages;
mod batch;
mod buckets;
mod checkpoint;
mod collective;
mod error;
mod group;
mod learner;
mod loss;
#[cfg(feature = "cuda")]
mod nccl;
mod parallel;
mod registry;
mod reward;
mod reward_functions;
mod reward_http;
mod rollout;
pub mod run_folder;
pub mod samples;
mod schedule;
mod sharding;
mod stop;
mod task;
mod telemetry;
pub mod tensorboard;
mod ties;
mod trainer;
mod update;
mod validation;
mod warmup;

pub use advantages::{AdvantageEstimator, GroupRelative, ScaleRewards, TieStatus};
pub use batch::{mask_rows, padded_width, TrainBatch};
pub use checkpoint::{load_state, save_state, write_state, StateDraft, TrainingState};
pub use collective::{Collective, HostCollective};
// The contracts the learner is written against, re-exported so an embedder names one crate.
pub use conrub_contracts::LrScheduleKind;
pub use conrub_contracts::{
    add_gradients, sample_by_recomputation, ContractError, EpochSummary, Export, JudgeScore,
    KernelWarmupLine, MetricsLine, Policy, ResponseLogprobs, RolloutBatch, RolloutEngine,
    RolloutRequest, StepMetrics, TextCodec, TieStats, TokenBatch, ValidationDecoding,
    ValidationLine, WeightSync,
};
pub use conrub_kernels::Clip;
pub use error::{GrpoError, Result};
pub use group::{record_group, GroupOutcome, TieAwareAdvantages, TieMode};
pub use learner::{Learner, LearnerBuilder, LearnerConfig, OnNonFinite, RankSlot, StepOutput};
pub use loss::{
    aggregate_token_term, dpo_pair_loss, Aggregation, ImportanceLevel, KlEstimator, PolicyLoss,
    PolicyObjective, SurrogateBatch, SurrogateOutput,
};
#[cfg(feature = "cuda")]
pub use nccl::NcclCollective;
pub use parallel::{split_groups, DataParallel};
pub use registry::{
    EstimatorFactory, LossFactory, Registry, BUILTIN_ESTIMATORS, BUILTIN_LOSSES, DEFAULT_ESTIMATOR,
    DEFAULT_LOSS,
};
pub use reward::{GroupScores, JudgeRewards, RewardSource};
pub use reward_functions::{
    RewardFactory, RewardKinds, VerifiableReward, WeightedFunction, WeightedRewards,
    BUILTIN_REWARD_KINDS,
};
pub use reward_http::HttpReward;
pub use rollout::{GroupSampler, InProcessEngine};
pub use schedule::LrSchedule;
pub use sharding::{ShardLayout, Sharding};
pub use stop::{cut_at_stop_strings, stop_point};
pub use task::TaskPrompt;
pub use ties::{NoTieBreaker, PairRecord, PairwiseTieBreaker, TieBreaker, TieOutcome, TiedGroup};
pub use trainer::{
    best_checkpoint_path, epoch_order, train, BestCheckpoint, RunConfig, RunHooks, RunSummary,
    Trainee,
};
pub use update::{Update, UpdateConfig};
pub use validation::{Answer, HeldOutPrompt, ValidationConfig, Validator};
pub use warmup::{sft_warmup, warmup_pairs};
