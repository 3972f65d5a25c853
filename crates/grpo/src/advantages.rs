//! Advantages (docs/METHOD.md §5): the [`AdvantageEstimator`] stage (group-relative, with or without
//! std scaling), exact-tie detection and the seeded pairing of a tied group.

pub use conrub_contracts::ScaleRewards;
use conrub_rubric::seeded_permutation;
use serde::{Deserialize, Serialize};

/// Added to the group standard deviation (as TRL does), so a near-constant group does not explode.
pub(crate) const ADVANTAGE_EPS: f64 = 1e-4;

/// Turns one group's rewards into one sequence-level advantage per response.
pub trait AdvantageEstimator: Send + Sync {
    /// `rewards[i]` is `None` for an unscored response, which must get advantage 0.
    fn advantages(&self, rewards: &[Option<f64>]) -> Vec<f64>;
}

/// Group-relative advantages: `A_i = (R_i - mean(R)) / (std(R) + eps)` over the *scored*
/// responses of one group, or `R_i - mean(R)` with [`ScaleRewards::None`]. Unscored responses get 0
/// and are left out of the mean and the standard deviation; with fewer than two scored responses,
/// or all of them equal, every advantage is 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GroupRelative {
    /// Standard-deviation scaling.
    pub scale: ScaleRewards,
}

impl AdvantageEstimator for GroupRelative {
    fn advantages(&self, rewards: &[Option<f64>]) -> Vec<f64> {
        let scored: Vec<f64> = rewards
            .iter()
            .flatten()
            .copied()
            .filter(|r| r.is_finite())
            .collect();
        // A naive mean of equal values can be off by an ulp, which would give a tied group tiny
        // nonzero advantages: equal bits mean no signal.
        if scored.len() < 2 || scored.iter().all(|r| r.to_bits() == scored[0].to_bits()) {
            return vec![0.0; rewards.len()];
        }
        // Rewards near f64::MAX (a reward server's ±1e308) overflow the sums: then the group is
        // worked on scaled down by a power of two, which rounds nothing (1.0 otherwise).
        let unit = overflow_scale(&scored);
        let scored: Vec<f64> = scored.iter().map(|r| r * unit).collect();
        let n = scored.len() as f64;
        let mean = scored.iter().sum::<f64>() / n;
        let denom = match self.scale {
            ScaleRewards::Group => {
                (scored.iter().map(|r| (r - mean) * (r - mean)).sum::<f64>() / (n - 1.0)).sqrt()
                    + ADVANTAGE_EPS * unit
            }
            ScaleRewards::None => unit,
        };
        rewards
            .iter()
            .map(|r| match r {
                Some(x) if x.is_finite() => (x * unit - mean) / denom,
                _ => 0.0,
            })
            .collect()
    }
}

/// 1.0 when a group's mean and squared deviations stay finite; else the power of two that
/// brings its largest reward below 1 (multiplying by it is exact).
fn overflow_scale(x: &[f64]) -> f64 {
    let mean = x.iter().sum::<f64>() / x.len() as f64;
    let squares = x.iter().map(|r| (r - mean) * (r - mean)).sum::<f64>();
    if mean.is_finite() && squares.is_finite() {
        return 1.0;
    }
    let max = x.iter().fold(0f64, |m, r| m.max(r.abs()));
    0.5f64.powi(max.log2().ceil() as i32 + 1)
}

/// A platform-stable PRNG seed from the run seed and a key.
pub fn stable_seed(seed: u64, key: &str) -> u64 {
    conrub_rubric::stable_seed(&[&seed.to_le_bytes(), key.as_bytes()])
}

/// Shuffles `0..k` with a PRNG seeded by `(run_seed, group_key)` and splits it into `k / 2`
/// disjoint pairs (with odd `k`, the last shuffled response stays unpaired).
pub(crate) fn tie_pairs(k: usize, run_seed: u64, group_key: &str) -> Vec<(usize, usize)> {
    let order = seeded_permutation(k, stable_seed(run_seed, group_key));
    order.chunks_exact(2).map(|p| (p[0], p[1])).collect()
}

/// How a group's advantages came about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TieStatus {
    /// Not tied: vanilla GRPO.
    NotTied,
    /// Tied and sent to the tie breaker.
    Tied,
    /// Tied, but tie breaking is off (all advantages 0).
    TiedUnbroken,
}

#[cfg(test)]
mod tests {
    use super::*;
    use conrub_rewards::is_exact_tie;

    /// Issue 53, item 9: rewards of ±1e308 overflowed the group's sums, so every advantage was
    /// 0; they get the advantages of the same group scaled down.
    #[test]
    fn rewards_near_the_largest_f64_keep_their_advantages() {
        let grpo = GroupRelative {
            scale: ScaleRewards::Group,
        };
        let huge = [Some(1e308), Some(-1e308), Some(1e308), None, Some(-1e308)];
        let small = huge.map(|r| r.map(|x| x / 1e300));
        let (a, b) = (grpo.advantages(&huge), grpo.advantages(&small));
        assert!(a[0] > 0.8 && a[1] < -0.8 && a[3] == 0.0, "{a:?}");
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() < 1e-9, "{a:?} vs {b:?}");
        }
        // In range, nothing changes: the scale is exactly 1.
        assert_eq!(overflow_scale(&[1.0, -1.0, 0.5]), 1.0);
    }

    #[test]
    fn vanilla_grpo_with_unscored_responses() {
        let grpo = |r: &[Option<f64>], scale| GroupRelative { scale }.advantages(r);
        let a = grpo(
            &[Some(1.0), Some(0.0), None, Some(0.5)],
            ScaleRewards::Group,
        );
        // Scored: 1, 0, 0.5 -> mean 0.5, unbiased std 0.5.
        assert!((a[0] - 0.5 / 0.5001).abs() < 1e-12);
        assert!((a[1] + 0.5 / 0.5001).abs() < 1e-12);
        assert_eq!(a[2], 0.0);
        assert_eq!(a[3], 0.0);
        assert_eq!(
            grpo(&[Some(0.3), None], ScaleRewards::Group),
            vec![0.0, 0.0]
        );
        assert_eq!(grpo(&[Some(0.7); 8], ScaleRewards::Group), vec![0.0; 8]);
        assert_eq!(
            grpo(&[Some(1.0), Some(0.0)], ScaleRewards::None),
            vec![0.5, -0.5]
        );
    }

    #[test]
    fn exact_ties_need_complete_finite_equal_groups() {
        let t = [Some(0.75); 8];
        assert!(is_exact_tie(&t, 8));
        let mut near = t;
        near[3] = Some(0.75 + f64::EPSILON);
        assert!(!is_exact_tie(&near, 8), "a near tie is not a tie");
        let mut incomplete = t;
        incomplete[5] = None;
        assert!(
            !is_exact_tie(&incomplete, 8),
            "an unscored response breaks completeness"
        );
        assert!(
            !is_exact_tie(&t[..7], 8),
            "a removed response breaks completeness"
        );
        assert!(!is_exact_tie(&[Some(f64::NAN); 8], 8));
        assert!(!is_exact_tie(&[Some(f64::INFINITY); 8], 8));
        // Equal rationals from the scorer are equal bits.
        let r = |n: i64, d: i64| Some(n as f64 / d as f64);
        assert!(is_exact_tie(&[r(1, 2), r(2, 4), r(6, 12)], 3));
    }

    #[test]
    fn pairing_is_a_seeded_disjoint_cover() {
        let p = tie_pairs(8, 1234, "med-0001/epoch-0");
        assert_eq!(
            p,
            tie_pairs(8, 1234, "med-0001/epoch-0"),
            "deterministic per seed and group"
        );
        assert_eq!(p.len(), 4);
        let mut seen: Vec<usize> = p.iter().flat_map(|&(a, b)| [a, b]).collect();
        seen.sort();
        assert_eq!(seen, (0..8).collect::<Vec<_>>());
        assert_ne!(p, tie_pairs(8, 1235, "med-0001/epoch-0"));
        assert_ne!(p, tie_pairs(8, 1234, "med-0002/epoch-0"));
        assert_eq!(tie_pairs(5, 1, "g").len(), 2);
        // Golden values: the pairing must not change across releases or platforms.
        assert_eq!(
            tie_pairs(8, 1234, "g"),
            vec![(6, 3), (7, 2), (1, 0), (4, 5)]
        );
    }
}
