//! The learner's input: a task, i.e. a list of prompts of one type, each scored by a
//! [`RewardSource`](crate::RewardSource) of that type. Rubric records
//! ([`RubricRecord`]) are one kind of task: their reward source is the criterion judge
//! ([`JudgeRewards`](crate::JudgeRewards)). A task with verifiable answers implements
//! [`TaskPrompt`] for its own prompt type and scores responses itself (see
//! `examples/verifiable_reward.rs`).

use conrub_rubric::{messages_text, Message, RubricRecord};

/// One prompt of a task: what the learner renders, names and (for the supervised warm-up)
/// imitates.
pub trait TaskPrompt: Send + Sync {
    /// The prompt's unique id: group keys, seeds and error messages name it.
    fn id(&self) -> &str;

    /// The prompt as chat messages (rendered by the learner's `TextCodec` (`conrub_contracts`)).
    fn messages(&self) -> &[Message];

    /// A reference answer the supervised warm-up (`[warmup]`) trains on; `None` (the default)
    /// leaves the prompt out of it.
    fn reference_answer(&self) -> Option<&str> {
        None
    }

    /// The short final answer verifiable reward functions (`exact`, `numeric`) compare a
    /// response to; `None` (the default) when the prompt has none.
    fn ground_truth(&self) -> Option<&str> {
        None
    }

    /// The prompt as plain text, as judges see it: a single user message's content, or
    /// `role: content` blocks for a conversation.
    fn text(&self) -> String {
        messages_text(self.messages())
    }
}

impl TaskPrompt for RubricRecord {
    fn id(&self) -> &str {
        &self.id
    }

    fn messages(&self) -> &[Message] {
        &self.question
    }

    fn reference_answer(&self) -> Option<&str> {
        self.reference_answer.as_deref()
    }

    fn ground_truth(&self) -> Option<&str> {
        self.ground_truth.as_deref()
    }

    fn text(&self) -> String {
        self.question_text()
    }
}
