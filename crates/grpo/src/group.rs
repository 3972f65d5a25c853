//! One group's advantages under a tie mode, and the tie statistics docs/METHOD.md §7 asks for.

use conrub_contracts::TieStats;
use conrub_judge::PairOutcome;
use serde::{Deserialize, Serialize};

use crate::advantages::{AdvantageEstimator, TieStatus};
use crate::ties::{PairRecord, TieBreaker, TiedGroup};
pub use conrub_contracts::TieMode;
use conrub_rewards::is_exact_tie;

/// A group's outcome.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupOutcome {
    /// One sequence advantage per response.
    pub advantages: Vec<f64>,
    /// Tie status.
    pub status: TieStatus,
    /// Pairs judged (tied groups only).
    pub pairs: Vec<PairRecord>,
}

impl GroupOutcome {
    /// Accepted pairs as `(winner, loser)` response indices (for the DPO baseline).
    pub fn accepted_pairs(&self) -> Vec<(usize, usize)> {
        self.pairs
            .iter()
            .filter_map(|p| match p.outcome {
                PairOutcome::PreferA => Some((p.a, p.b)),
                PairOutcome::PreferB => Some((p.b, p.a)),
                _ => None,
            })
            .collect()
    }
}

/// The advantage stage: an [`AdvantageEstimator`] wrapped by exact-tie handling. A group that is
/// not an exact tie gets the estimator's advantages; a tied one goes to the [`TieBreaker`] as the
/// [`TieMode`] says. Scalar rewards are never changed.
pub struct TieAwareAdvantages {
    estimator: Box<dyn AdvantageEstimator>,
    mode: TieMode,
    breaker: Box<dyn TieBreaker>,
}

impl TieAwareAdvantages {
    /// Wraps `estimator`; tied groups go to `breaker` unless `mode` is [`TieMode::Off`].
    pub fn new(
        estimator: Box<dyn AdvantageEstimator>,
        mode: TieMode,
        breaker: Box<dyn TieBreaker>,
    ) -> Self {
        Self {
            estimator,
            mode,
            breaker,
        }
    }

    /// The tie mode.
    pub fn mode(&self) -> TieMode {
        self.mode
    }

    /// Advantages of one group of `k` responses (`rewards[i]` is `None` when unscored).
    pub async fn group(
        &self,
        rewards: &[Option<f64>],
        k: usize,
        group: &TiedGroup<'_>,
    ) -> GroupOutcome {
        self.group_shaped(rewards, None, k, group).await
    }

    /// [`group`](Self::group) whose estimator reads `shaped` rewards (the rewards less a KL
    /// penalty, `learner.kl_in_reward`) where `rewards` differ: the exact-tie test reads
    /// `rewards`, and a tied group gets what it gets without the penalty (a penalty difference
    /// of 1e-3 scaled by its own standard deviation would be a full-size advantage).
    pub async fn group_shaped(
        &self,
        rewards: &[Option<f64>],
        shaped: Option<&[Option<f64>]>,
        k: usize,
        group: &TiedGroup<'_>,
    ) -> GroupOutcome {
        let estimated = self.estimator.advantages(rewards);
        if !is_exact_tie(rewards, k) {
            // The penalty moves a group only where its scored rewards differ (an incomplete
            // group of equal rewards is no tie, but has no signal of its own either).
            let shaped = shaped.filter(|_| scored_rewards_differ(rewards));
            return GroupOutcome {
                advantages: shaped.map_or(estimated, |s| self.estimator.advantages(s)),
                status: TieStatus::NotTied,
                pairs: Vec::new(),
            };
        }
        match self.mode {
            TieMode::Off => GroupOutcome {
                advantages: estimated,
                status: TieStatus::TiedUnbroken,
                pairs: Vec::new(),
            },
            TieMode::Pairwise => {
                let t = self.breaker.break_tie(group).await;
                GroupOutcome {
                    advantages: t.advantages,
                    status: TieStatus::Tied,
                    pairs: t.pairs,
                }
            }
            TieMode::GrpoDpo => {
                let t = self.breaker.break_tie(group).await;
                GroupOutcome {
                    advantages: estimated,
                    status: TieStatus::Tied,
                    pairs: t.pairs,
                }
            }
        }
    }
}

/// Whether the group's finite scored rewards are not all equal bit for bit.
pub(crate) fn scored_rewards_differ(rewards: &[Option<f64>]) -> bool {
    let mut scored = rewards.iter().flatten().filter(|r| r.is_finite());
    scored
        .next()
        .is_some_and(|first| scored.any(|r| r.to_bits() != first.to_bits()))
}

/// The bin of a reward in the 20 bins of width 0.1 over [-1, 1] (-1 and 1 fall in the end bins).
pub(crate) fn reward_bin(r: f64) -> usize {
    (((r + 1.0) / 0.1).floor() as i64).clamp(0, 19) as usize
}

/// Adds one group to `stats` (`reward` is the tied value when the group is tied).
pub fn record_group(stats: &mut TieStats, outcome: &GroupOutcome, reward: Option<f64>) {
    if stats.tied_reward_histogram.is_empty() {
        stats.tied_reward_histogram = vec![0; 20];
    }
    stats.groups += 1;
    if outcome.status == TieStatus::NotTied {
        return;
    }
    stats.tied_groups += 1;
    if let Some(r) = reward {
        stats.tied_reward_histogram[reward_bin(r)] += 1;
    }
    for p in &outcome.pairs {
        stats.pairwise_calls += 2;
        match p.outcome {
            PairOutcome::PreferA | PairOutcome::PreferB => {
                stats.accepted += 1;
                stats.winner_longer += p.winner_longer.unwrap_or(false) as u64;
            }
            PairOutcome::Same => stats.same += 1,
            PairOutcome::OrderFlip => stats.order_flips += 1,
            PairOutcome::Invalid => stats.invalid += 1,
        }
    }
    if outcome.status == TieStatus::Tied {
        let directed = outcome.advantages.iter().filter(|a| **a != 0.0).count() as u64;
        stats.responses_with_direction += directed;
        stats.groups_with_direction += (directed > 0) as u64;
    }
}
