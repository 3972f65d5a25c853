//! One group's advantages under a tie mode, and the tie statistics docs/METHOD.md §7 asks for.

use conrub_judge::PairOutcome;
use serde::{Deserialize, Serialize};

use crate::advantages::{is_exact_tie, AdvantageEstimator, TieStatus};
use crate::ties::{PairRecord, TieBreaker, TiedGroup};

/// What happens to exactly tied groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TieMode {
    /// The method: the pairwise tie breaker gives +1/-1 sequence advantages.
    #[default]
    Pairwise,
    /// The GRPO+DPO baseline: vanilla advantages (zero for ties) plus a DPO term on accepted pairs.
    GrpoDpo,
    /// Vanilla GRPO: ties keep zero advantages, no judge calls.
    Off,
}

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
        let estimated = self.estimator.advantages(rewards);
        if !is_exact_tie(rewards, k) {
            return GroupOutcome {
                advantages: estimated,
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

/// The bin of a reward in the 20 bins of width 0.1 over [-1, 1] (-1 and 1 fall in the end bins).
pub(crate) fn reward_bin(r: f64) -> usize {
    (((r + 1.0) / 0.1).floor() as i64).clamp(0, 19) as usize
}

/// Tie telemetry over a step or an epoch (docs/METHOD.md §7).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TieStats {
    /// Groups seen.
    pub groups: u64,
    /// Exactly tied groups.
    pub tied_groups: u64,
    /// Reward histogram of tied groups, 0.1-wide bins over [-1, 1] (20 bins).
    pub tied_reward_histogram: Vec<u64>,
    /// Pairwise judge calls (two per pair).
    pub pairwise_calls: u64,
    /// Pairs accepted.
    pub accepted: u64,
    /// Pairs judged `same`.
    pub same: u64,
    /// Pairs with an order flip.
    pub order_flips: u64,
    /// Pairs with invalid output.
    pub invalid: u64,
    /// Groups that got at least one nonzero pairwise advantage.
    pub groups_with_direction: u64,
    /// Responses that got a nonzero pairwise advantage.
    pub responses_with_direction: u64,
    /// Accepted pairs whose winner is the longer response.
    pub winner_longer: u64,
}

impl TieStats {
    /// The tie rate (tied / groups).
    pub fn tie_rate(&self) -> f64 {
        if self.groups == 0 {
            0.0
        } else {
            self.tied_groups as f64 / self.groups as f64
        }
    }

    /// Adds one group (`reward` is the tied value when the group is tied).
    pub fn add(&mut self, outcome: &GroupOutcome, reward: Option<f64>) {
        if self.tied_reward_histogram.is_empty() {
            self.tied_reward_histogram = vec![0; 20];
        }
        self.groups += 1;
        if outcome.status == TieStatus::NotTied {
            return;
        }
        self.tied_groups += 1;
        if let Some(r) = reward {
            self.tied_reward_histogram[reward_bin(r)] += 1;
        }
        for p in &outcome.pairs {
            self.pairwise_calls += 2;
            match p.outcome {
                PairOutcome::PreferA | PairOutcome::PreferB => {
                    self.accepted += 1;
                    self.winner_longer += p.winner_longer.unwrap_or(false) as u64;
                }
                PairOutcome::Same => self.same += 1,
                PairOutcome::OrderFlip => self.order_flips += 1,
                PairOutcome::Invalid => self.invalid += 1,
            }
        }
        if outcome.status == TieStatus::Tied {
            let directed = outcome.advantages.iter().filter(|a| **a != 0.0).count() as u64;
            self.responses_with_direction += directed;
            self.groups_with_direction += (directed > 0) as u64;
        }
    }

    /// Adds another set of statistics.
    pub fn merge(&mut self, other: &TieStats) {
        if self.tied_reward_histogram.is_empty() {
            self.tied_reward_histogram = vec![0; 20];
        }
        for (a, b) in self
            .tied_reward_histogram
            .iter_mut()
            .zip(other.tied_reward_histogram.iter())
        {
            *a += b;
        }
        self.groups += other.groups;
        self.tied_groups += other.tied_groups;
        self.pairwise_calls += other.pairwise_calls;
        self.accepted += other.accepted;
        self.same += other.same;
        self.order_flips += other.order_flips;
        self.invalid += other.invalid;
        self.groups_with_direction += other.groups_with_direction;
        self.responses_with_direction += other.responses_with_direction;
        self.winner_longer += other.winner_longer;
    }
}
