//! Tie breaking: sequence advantages for exactly tied groups from a bidirectional pairwise judge.

use std::sync::Arc;

use async_trait::async_trait;
use conrub_judge::{compare_both_orders, BidirectionalComparison, PairOutcome, PairwiseJudge};
use serde::{Deserialize, Serialize};

use crate::advantages::tie_pairs;

/// A tied group as the tie breaker sees it (never its rewards or the reference answer).
#[derive(Debug, Clone, Copy)]
pub struct TiedGroup<'a> {
    /// Identifies the group for the pairing seed (e.g. prompt id and step).
    pub group_key: &'a str,
    /// The question.
    pub question: &'a str,
    /// The criteria the responses were scored against.
    pub criteria: &'a [String],
    /// The k responses.
    pub responses: &'a [String],
    /// Their lengths in tokens (telemetry: was the winner the longer one?).
    pub lengths: &'a [u32],
}

/// One judged pair, kept for audit and telemetry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PairRecord {
    /// Index of the first response of the pair.
    pub a: usize,
    /// Index of the second.
    pub b: usize,
    /// The accepted outcome.
    pub outcome: PairOutcome,
    /// Whether the accepted winner is strictly longer than the loser (`None` unless accepted).
    pub winner_longer: Option<bool>,
    /// Both raw verdicts.
    pub comparison: Option<BidirectionalComparison>,
}

/// The advantages a tie breaker assigns to a tied group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TieOutcome {
    /// One sequence-level advantage per response: +1 / -1 for accepted pairs, 0 otherwise.
    pub advantages: Vec<f64>,
    /// The pairs judged.
    pub pairs: Vec<PairRecord>,
}

/// Assigns advantages to an exactly tied group.
#[async_trait]
pub trait TieBreaker: Send + Sync {
    /// Breaks one tie.
    async fn break_tie(&self, group: &TiedGroup<'_>) -> TieOutcome;
}

/// A shared tie breaker is a tie breaker (one per data-parallel rank, one judge client).
#[async_trait]
impl<T: TieBreaker + ?Sized> TieBreaker for std::sync::Arc<T> {
    async fn break_tie(&self, group: &TiedGroup<'_>) -> TieOutcome {
        (**self).break_tie(group).await
    }
}

/// Tie breaking off: tied groups keep vanilla GRPO's zero advantages.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoTieBreaker;

#[async_trait]
impl TieBreaker for NoTieBreaker {
    async fn break_tie(&self, group: &TiedGroup<'_>) -> TieOutcome {
        TieOutcome {
            advantages: vec![0.0; group.responses.len()],
            pairs: Vec::new(),
        }
    }
}

/// The method's tie breaker: seeded disjoint pairs, each judged in both orders; only
/// order-consistent preferences give (+1, -1).
#[derive(Clone)]
pub struct PairwiseTieBreaker {
    judge: Arc<dyn PairwiseJudge>,
    run_seed: u64,
}

impl PairwiseTieBreaker {
    /// A tie breaker asking `judge`, pairing with `run_seed`.
    pub fn new(judge: Arc<dyn PairwiseJudge>, run_seed: u64) -> Self {
        Self { judge, run_seed }
    }
}

#[async_trait]
impl TieBreaker for PairwiseTieBreaker {
    async fn break_tie(&self, g: &TiedGroup<'_>) -> TieOutcome {
        let pairs = tie_pairs(g.responses.len(), self.run_seed, g.group_key);
        let comparisons = futures::future::join_all(pairs.iter().map(|&(a, b)| {
            compare_both_orders(
                self.judge.as_ref(),
                g.question,
                g.criteria,
                &g.responses[a],
                &g.responses[b],
            )
        }))
        .await;
        let mut advantages = vec![0.0; g.responses.len()];
        let records = pairs
            .into_iter()
            .zip(comparisons)
            .map(|((a, b), c)| {
                let (adv_a, adv_b) = c.outcome.advantages();
                advantages[a] = adv_a;
                advantages[b] = adv_b;
                let len = |i: usize| g.lengths.get(i).copied().unwrap_or(0);
                let winner_longer = match c.outcome {
                    PairOutcome::PreferA => Some(len(a) > len(b)),
                    PairOutcome::PreferB => Some(len(b) > len(a)),
                    _ => None,
                };
                PairRecord {
                    a,
                    b,
                    outcome: c.outcome,
                    winner_longer,
                    comparison: Some(c),
                }
            })
            .collect();
        TieOutcome {
            advantages,
            pairs: records,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use conrub_judge::{PairAnswer, PairRequest, PairVerdict, Preference};

    /// Prefers the candidate containing "good"; answers `A` twice for "biased" (order flip) and
    /// gives no answer for "broken".
    struct Scripted;

    #[async_trait]
    impl PairwiseJudge for Scripted {
        fn id(&self) -> String {
            "scripted".into()
        }
        async fn compare(&self, r: &PairRequest) -> PairVerdict {
            let verdict = if r.first.contains("broken") || r.second.contains("broken") {
                None
            } else if r.first.contains("biased")
                || (r.first.contains("good") && !r.second.contains("good"))
            {
                Some(Preference::A)
            } else if r.second.contains("good") && !r.first.contains("good") {
                Some(Preference::B)
            } else {
                Some(Preference::Same)
            };
            PairVerdict {
                answer: verdict.map(|v| PairAnswer {
                    verdict: v,
                    criteria: vec![],
                    confidence: None,
                    reason: None,
                }),
                error: None,
                raw_outputs: vec![],
                attempts: 1,
                latency_ms: 0.0,
                cached: false,
            }
        }
    }

    #[tokio::test]
    async fn only_order_consistent_pairs_get_directions() {
        let responses: Vec<String> = [
            "good long answer",
            "plain",
            "biased one",
            "biased two",
            "same a",
            "same b",
            "broken",
            "good",
        ]
        .map(String::from)
        .to_vec();
        let lengths = [30, 10, 5, 5, 5, 5, 5, 3];
        let breaker = PairwiseTieBreaker::new(Arc::new(Scripted), 1234);
        let g = TiedGroup {
            group_key: "p1/step3",
            question: "q",
            criteria: &["c".to_string()],
            responses: &responses,
            lengths: &lengths,
        };
        let out = breaker.break_tie(&g).await;
        assert_eq!(out.pairs.len(), 4);
        assert_eq!(out, breaker.break_tie(&g).await, "deterministic");
        for p in &out.pairs {
            let (x, y) = (&responses[p.a], &responses[p.b]);
            let expected = if x.contains("broken") || y.contains("broken") {
                PairOutcome::Invalid
            } else if x.contains("biased") && y.contains("biased") {
                PairOutcome::OrderFlip
            } else if x.contains("good") && !y.contains("good") {
                PairOutcome::PreferA
            } else if y.contains("good") && !x.contains("good") {
                PairOutcome::PreferB
            } else {
                // "biased" against a neutral answer: A, then the neutral one shown first vs biased: same.
                PairOutcome::combine(
                    Some(if x.contains("biased") {
                        Preference::A
                    } else {
                        Preference::Same
                    }),
                    Some(if y.contains("biased") {
                        Preference::A
                    } else {
                        Preference::Same
                    }),
                )
            };
            assert_eq!(p.outcome, expected, "{x} vs {y}");
            let (ea, eb) = expected.advantages();
            assert_eq!((out.advantages[p.a], out.advantages[p.b]), (ea, eb));
            assert_eq!(
                p.winner_longer.is_some(),
                matches!(expected, PairOutcome::PreferA | PairOutcome::PreferB)
            );
        }
        assert_eq!(
            out.advantages.iter().sum::<f64>(),
            0.0,
            "every +1 has its -1"
        );
        let off = NoTieBreaker.break_tie(&g).await;
        assert_eq!(off.advantages, vec![0.0; 8]);
    }
}
