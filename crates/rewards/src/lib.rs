//! Rewards of a conrub task: how a group of responses to one prompt gets its scalar rewards.
//!
//! | piece | what |
//! |---|---|
//! | [`TaskPrompt`] | one prompt of a task (id, chat messages, reference answer, ground truth); [`conrub_rubric::RubricRecord`] is one kind |
//! | [`RewardSource`] -> [`GroupScores`] | scores a group; a response it cannot score is unscored, never 0 |
//! | [`JudgeRewards`] | the rubric kind: a criterion judge's verdicts scored in `reward.mode` with the length penalty and rubric dropout |
//! | [`RewardKinds`] | the registry of `[[reward.functions]]` kinds ([`BUILTIN_REWARD_KINDS`]; `rubric` is registered from a judge with [`RewardKinds::register_rubric`]) |
//! | [`WeightedRewards`] | the weighted mix of the functions |
//! | [`VerifiableReward`], [`HttpReward`] | the `exact` / `numeric` / `regex` / `format` checks and the reward server |
//! | [`is_exact_tie`] | the learner's one tie test: a complete group of bit-equal rewards |
//!
//! The learner (`conrub-grpo`) scores each step's groups through a [`RewardSource`]; the
//! trainer builds the task's once from the run config.

mod error;
mod http;
mod kinds;
mod source;
mod task;

pub use error::{Result, RewardError};
pub use http::HttpReward;
pub use kinds::{
    RewardFactory, RewardKinds, VerifiableReward, WeightedFunction, WeightedRewards,
    BUILTIN_REWARD_KINDS,
};
pub use source::{is_exact_tie, GroupScores, JudgeRewards, RewardSource};
pub use task::TaskPrompt;
