//! Judge traits and verdict types.

use std::time::Duration;

use async_trait::async_trait;
use conrub_rubric::{Label, ScoringMode};
use serde::{Deserialize, Serialize};

use crate::parse::{PairAnswer, Preference};

/// One response to grade against ordered criteria. The reference answer is never part of it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CriterionRequest {
    /// The question as the policy saw it (plain text).
    pub question: String,
    /// The response to grade.
    pub response: String,
    /// Criterion texts in order.
    pub criteria: Vec<String>,
    /// Label set to use.
    pub mode: ScoringMode,
}

/// What a criterion judge returned for one response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CriterionVerdict {
    /// One label per criterion, or `None` when no valid output came within the retry budget.
    pub labels: Option<Vec<Label>>,
    /// Why there are no labels (or the last recoverable problem).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Raw model outputs of every attempt, in order (audit trail).
    pub raw_outputs: Vec<String>,
    /// Attempts made (0 when served from the cache).
    pub attempts: u32,
    /// Wall time spent on this verdict, retries and backoff included.
    pub latency_ms: f64,
    /// True when served from the judge cache.
    pub cached: bool,
    /// Cheap mode only: per criterion, the log-probability margin of the chosen label over the
    /// runner-up.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub margins: Vec<f64>,
    /// Criteria this judge handed to another (a probe judge's fallback for criteria it abstained
    /// on); 0 for every other judge.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub deferred: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl CriterionVerdict {
    fn new(
        labels: Option<Vec<Label>>,
        error: Option<String>,
        raw_outputs: Vec<String>,
        attempts: u32,
        latency: Duration,
    ) -> Self {
        Self {
            labels,
            error,
            raw_outputs,
            attempts,
            latency_ms: latency.as_secs_f64() * 1e3,
            cached: false,
            margins: Vec::new(),
            deferred: 0,
        }
    }

    /// A verdict without labels.
    pub fn failed(
        error: impl Into<String>,
        raw_outputs: Vec<String>,
        attempts: u32,
        latency: Duration,
    ) -> Self {
        Self::new(None, Some(error.into()), raw_outputs, attempts, latency)
    }

    /// A verdict with labels.
    pub fn labelled(
        labels: Vec<Label>,
        raw_outputs: Vec<String>,
        attempts: u32,
        latency: Duration,
    ) -> Self {
        Self::new(Some(labels), None, raw_outputs, attempts, latency)
    }
}

/// Grades responses against criteria.
#[async_trait]
pub trait CriterionJudge: Send + Sync {
    /// Identifies the judge (model and settings) in reports and cache keys.
    fn id(&self) -> String;

    /// Grades one response. Never fails: problems end as a verdict without labels.
    async fn judge(&self, request: &CriterionRequest) -> CriterionVerdict;

    /// Grades many responses; the default runs them concurrently (a client limits its own
    /// concurrency), in-process judges override it to batch on the device.
    async fn judge_batch(&self, requests: &[CriterionRequest]) -> Vec<CriterionVerdict> {
        futures::future::join_all(requests.iter().map(|r| self.judge(r))).await
    }
}

/// One pairwise comparison, candidates in the order shown.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PairRequest {
    /// The question.
    pub question: String,
    /// Criterion texts in order (the judge's primary anchors).
    pub criteria: Vec<String>,
    /// Candidate shown as A.
    pub first: String,
    /// Candidate shown as B.
    pub second: String,
}

/// What a pairwise judge returned for one ordering.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PairVerdict {
    /// The parsed answer, or `None` for invalid output after the retry budget.
    pub answer: Option<PairAnswer>,
    /// Why there is no answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Raw outputs of every attempt.
    pub raw_outputs: Vec<String>,
    /// Attempts made (0 from the cache).
    pub attempts: u32,
    /// Wall time.
    pub latency_ms: f64,
    /// Served from the cache.
    pub cached: bool,
}

/// Compares two responses.
#[async_trait]
pub trait PairwiseJudge: Send + Sync {
    /// Identifies the judge.
    fn id(&self) -> String;

    /// One comparison in the order given.
    async fn compare(&self, request: &PairRequest) -> PairVerdict;
}

/// The accepted result of asking in both orders.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PairOutcome {
    /// Both orders picked response `a`: `a` gets +1, `b` gets -1.
    PreferA,
    /// Both orders picked response `b`.
    PreferB,
    /// At least one order said `same`, and no order flip.
    Same,
    /// Each order picked a different underlying response (position bias).
    OrderFlip,
    /// At least one order gave no valid answer.
    Invalid,
}

impl PairOutcome {
    /// Sequence advantages `(a, b)`: `(+1, -1)`, `(-1, +1)` or `(0, 0)`.
    pub fn advantages(self) -> (f64, f64) {
        match self {
            PairOutcome::PreferA => (1.0, -1.0),
            PairOutcome::PreferB => (-1.0, 1.0),
            _ => (0.0, 0.0),
        }
    }

    /// Combines the verdict with `a` shown first and the one with `b` shown first.
    pub fn combine(forward: Option<Preference>, backward: Option<Preference>) -> Self {
        use Preference::*;
        match (forward, backward) {
            (Some(f), Some(g)) => match (f, g) {
                // In the backward order, A is response b.
                (A, B) => PairOutcome::PreferA,
                (B, A) => PairOutcome::PreferB,
                (A, A) | (B, B) => PairOutcome::OrderFlip,
                _ => PairOutcome::Same,
            },
            _ => PairOutcome::Invalid,
        }
    }
}

/// Both raw verdicts and the accepted outcome of a bidirectional comparison.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BidirectionalComparison {
    /// `a` shown first.
    pub forward: PairVerdict,
    /// `b` shown first.
    pub backward: PairVerdict,
    /// The accepted outcome.
    pub outcome: PairOutcome,
}

/// Asks `judge` with `a` first and with `b` first (concurrently) and accepts a preference only when
/// both orders pick the same underlying response.
pub async fn compare_both_orders<J: PairwiseJudge + ?Sized>(
    judge: &J,
    question: &str,
    criteria: &[String],
    a: &str,
    b: &str,
) -> BidirectionalComparison {
    let fwd = PairRequest {
        question: question.into(),
        criteria: criteria.to_vec(),
        first: a.into(),
        second: b.into(),
    };
    let bwd = PairRequest {
        first: b.into(),
        second: a.into(),
        ..fwd.clone()
    };
    let (forward, backward) = futures::join!(judge.compare(&fwd), judge.compare(&bwd));
    let outcome = PairOutcome::combine(
        forward.answer.as_ref().map(|x| x.verdict),
        backward.answer.as_ref().map(|x| x.verdict),
    );
    BidirectionalComparison {
        forward,
        backward,
        outcome,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Preference::*;

    #[test]
    fn only_order_consistent_preferences_are_accepted() {
        assert_eq!(PairOutcome::combine(Some(A), Some(B)), PairOutcome::PreferA);
        assert_eq!(PairOutcome::combine(Some(B), Some(A)), PairOutcome::PreferB);
        assert_eq!(
            PairOutcome::combine(Some(A), Some(A)),
            PairOutcome::OrderFlip
        );
        assert_eq!(
            PairOutcome::combine(Some(B), Some(B)),
            PairOutcome::OrderFlip
        );
        for (f, g) in [(Same, Same), (A, Same), (Same, B)] {
            assert_eq!(PairOutcome::combine(Some(f), Some(g)), PairOutcome::Same);
        }
        assert_eq!(PairOutcome::combine(None, Some(A)), PairOutcome::Invalid);
        assert_eq!(PairOutcome::combine(Some(A), None), PairOutcome::Invalid);
        assert_eq!(PairOutcome::PreferB.advantages(), (-1.0, 1.0));
        assert_eq!(PairOutcome::OrderFlip.advantages(), (0.0, 0.0));
    }
}
