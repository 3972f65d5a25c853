//! The GRPO learner of the ConRub method (SPEC sections 5-7), generic over burn backends.
//!
//! This first part holds the method's exact rules:
//! - [`advantages`]: vanilla GRPO advantages over scored responses (unscored ones get none), exact
//!   tie detection on complete groups, and the seeded pairing of a tied group.
//! - [`policy`]: the [`Policy`] trait (differentiable response log-probs, sampling), implemented
//!   for the Qwen3 model.
//! - [`reward`]: the [`RewardSource`] trait and rubric rewards through a criterion judge (dropout,
//!   mode, overlength penalty).
//! - [`group`]: a group's advantages under a [`TieMode`] and the tie telemetry.
//! - [`grad_norm`]: global gradient-norm clipping (burn's own clips per tensor).
//! - [`learner`]: one GRPO step (rollout, rewards, advantages, PPO-style updates) and its metrics.
//! - [`codec`]: prompt rendering and response decoding for judges.
//! - [`telemetry`]: metrics JSONL, progress line, SVG plots; [`trainer`]: the epoch loop with
//!   checkpoints and resume; [`checkpoint`]: the atomic training state.
//! - [`ties`]: the [`TieBreaker`] trait and its pairwise-judge implementation (both orders, only
//!   order-consistent preferences become +1/-1 sequence advantages).
//! - [`loss`]: the clipped surrogate with asymmetric clipping and the method's aggregation (token mean
//!   per response, then mean over responses), the alternatives (global token mean, Dr. GRPO), the
//!   optional k3 KL term and the GRPO+DPO baseline term, all as burn tensor code that autodiff
//!   differentiates.

pub mod advantages;
pub mod checkpoint;
pub mod codec;
pub mod grad_norm;
pub mod group;
pub mod learner;
pub mod loss;
pub mod policy;
pub mod reward;
pub mod telemetry;
pub mod ties;
pub mod trainer;
pub mod warmup;

pub use advantages::{grpo_advantages, is_exact_tie, tie_pairs, GroupAdvantages, TieStatus, ADVANTAGE_EPS};
pub use grad_norm::{clip_global_norm, global_grad_norm, scale_grads};
pub use checkpoint::{load_state, save_state, TrainingState};
pub use codec::{ChatTemplateCodec, TextCodec};
pub use learner::{Learner, LearnerConfig, StepMetrics, StepOutput};
pub use group::{group_outcome, GroupOutcome, TieMode, TieStats};
pub use loss::{clipped_surrogate, dpo_pair_loss, Aggregation, ClipRange, SurrogateBatch, SurrogateOutput};
pub use policy::{Policy, RolloutTokens, Sample, SampleSettings, TeacherForcing};
pub use reward::{GroupScores, JudgeRewards, RewardSource};
pub use telemetry::{progress_line, write_plots, EpochSummary, MetricsLine, MetricsLog};
pub use trainer::{checkpoint_dir, epoch_order, train, RunConfig, RunSummary};
pub use warmup::sft_warmup;
pub use ties::{NoTieBreaker, PairRecord, PairwiseTieBreaker, TieBreaker, TieOutcome, TiedGroup};
