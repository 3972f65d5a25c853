//! One GRPO step as a list of stages: rollout, rewards, advantages (with tie breaking), the
//! device-resident train batch (old and reference log-probs), and the update (mini-batches, PPO
//! epochs, token-budget micro-batches, global grad-norm clipping, AdamW). Each stage is a type or
//! trait of its own that a user can replace through [`LearnerBuilder`].
//!
//! Host/device traffic of one step: the rollout's token ids and the decoded texts; one upload of
//! the teacher-forcing layout and one of the advantages (plus small row-index uploads for the
//! GRPO+DPO pairs); old and reference log-probs never leave the device; every micro-batch is a
//! slice of the train batch; the step's metrics and gradient norms come back in one transfer at
//! the end.

mod advantage;
mod builder;
mod dynamic;
mod output;
mod reward;
mod rollout;
mod step;
mod train_batch;
mod types;
mod update;
mod warm;

pub use builder::LearnerBuilder;
pub use conrub_contracts::{
    LearnerConfig, ObjectiveSettings, OnNonFinite, OptimizerSettings, SystemSettings,
};
pub(crate) use output::step_output;
pub(crate) use types::Shard;
pub use types::{Learner, StepOutput};
