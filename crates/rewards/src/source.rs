//! Reward sources: how a group of responses gets its scalar rewards.

use std::sync::Arc;

use async_trait::async_trait;
use conrub_judge::{score_jobs, CriterionJudge, CriterionRequest, ScoreJob};
use conrub_rubric::{LengthPenalty, ResponseScore, RubricDropout, RubricRecord, ScoringMode};

use serde::{Deserialize, Serialize};

use crate::error::RewardError;
use crate::task::TaskPrompt;

/// One group's scores and the criteria they were scored against.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupScores {
    /// One score per response, in order.
    pub scores: Vec<ResponseScore>,
    /// The criterion texts the judge saw (after rubric dropout).
    pub criteria: Vec<String>,
    /// Judge attempts beyond the first, over the group.
    pub judge_retries: u32,
    /// Sum of judge latencies over the group, milliseconds.
    pub judge_latency_ms: f64,
    /// Criteria the judge handed to its fallback (a probe judge abstaining), over the group.
    #[serde(default)]
    pub judge_deferred: u64,
}

impl GroupScores {
    /// Scores given directly (a verifiable reward, a reward model): no criteria, no judge.
    pub fn direct(scores: Vec<ResponseScore>) -> Self {
        Self {
            scores,
            criteria: vec![],
            judge_retries: 0,
            judge_latency_ms: 0.0,
            judge_deferred: 0,
        }
    }
}

/// Scores a group of responses to one prompt of a task whose prompts are `T` (rubric records
/// by default). A response the source cannot score is [`ResponseScore::Unscored`], never a
/// reward of 0.
#[async_trait]
pub trait RewardSource<T: TaskPrompt = RubricRecord>: Send + Sync {
    /// Scores `responses` (with their token `lengths`) to `prompt` at training `step`.
    async fn score_group(
        &self,
        prompt: &T,
        responses: &[String],
        lengths: &[u32],
        step: u64,
    ) -> GroupScores;

    /// Checks a prompt before training (a verifiable function: that it has the ground truth
    /// it compares to); the error says what is missing. Accepts every prompt by default.
    fn check_prompt(&self, _prompt: &T) -> Result<(), RewardError> {
        Ok(())
    }
}

/// Rubric rewards from a criterion judge: optional rubric dropout (one subset per group and step),
/// the scoring mode and the overlength penalty.
#[derive(Clone)]
pub struct JudgeRewards {
    /// The criterion judge.
    pub judge: Arc<dyn CriterionJudge>,
    /// Binary or three-state.
    pub mode: ScoringMode,
    /// The soft overlength penalty.
    pub penalty: LengthPenalty,
    /// Rubric dropout, if enabled.
    pub dropout: Option<RubricDropout>,
    /// Run seed (dropout subsets derive from it).
    pub seed: u64,
}

#[async_trait]
impl RewardSource for JudgeRewards {
    async fn score_group(
        &self,
        record: &RubricRecord,
        responses: &[String],
        lengths: &[u32],
        step: u64,
    ) -> GroupScores {
        let criteria: Vec<String> = match &self.dropout {
            Some(d) => d
                .subset(&record.criteria, self.seed, step, &record.id)
                .select(&record.criteria)
                .iter()
                .map(|c| c.text.clone())
                .collect(),
            None => record.criterion_texts(),
        };
        let question = record.question_text();
        let jobs: Vec<ScoreJob> = responses
            .iter()
            .zip(lengths)
            .map(|(r, &len)| ScoreJob {
                request: CriterionRequest {
                    question: question.clone(),
                    response: r.clone(),
                    criteria: criteria.clone(),
                    mode: self.mode,
                },
                response_tokens: Some(len),
            })
            .collect();
        // The judge crate's own judge-then-score path, the whole group as one batch.
        let (scored, summary) = score_jobs(
            self.judge.as_ref(),
            &jobs,
            &self.penalty,
            Some(jobs.len()),
            jobs.len(),
            &|_| {},
        )
        .await;
        GroupScores {
            scores: scored.into_iter().map(|s| s.score).collect(),
            criteria,
            judge_retries: summary.retries as u32,
            judge_latency_ms: summary.latency_ms_mean * summary.responses as f64,
            judge_deferred: summary.deferred,
        }
    }
}

/// A shared reward source is a reward source (one per data-parallel rank, one judge client).
#[async_trait]
impl<T: TaskPrompt, R: RewardSource<T> + ?Sized> RewardSource<T> for Arc<R> {
    async fn score_group(
        &self,
        prompt: &T,
        responses: &[String],
        lengths: &[u32],
        step: u64,
    ) -> GroupScores {
        (**self).score_group(prompt, responses, lengths, step).await
    }

    fn check_prompt(&self, prompt: &T) -> Result<(), RewardError> {
        (**self).check_prompt(prompt)
    }
}

/// Whether a group is an exact tie: complete (`k` responses, all scored), every reward finite, and
/// all rewards exactly equal (bit-for-bit; our rewards are exact rationals rounded once).
pub fn is_exact_tie(rewards: &[Option<f64>], k: usize) -> bool {
    if rewards.len() != k || k < 2 {
        return false;
    }
    let Some(Some(first)) = rewards.first().copied() else {
        return false;
    };
    first.is_finite()
        && rewards
            .iter()
            .all(|r| matches!(r, Some(x) if x.to_bits() == first.to_bits()))
}
