//! Rubric dropout (docs/METHOD.md §9): per step, a seeded random 30-50% of a prompt's criteria are
//! hidden from the judge, the same subset for every response of the group.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::error::{Result, RubricError};
use crate::record::{Criterion, CriterionKind};

/// Dropout settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RubricDropout {
    /// Smallest fraction of criteria dropped.
    pub min_fraction: f64,
    /// Largest fraction of criteria dropped.
    pub max_fraction: f64,
    /// When true, the two global controls are never dropped (only content criteria are drawn).
    pub keep_global_controls: bool,
}

impl Default for RubricDropout {
    fn default() -> Self {
        Self {
            min_fraction: 0.3,
            max_fraction: 0.5,
            keep_global_controls: false,
        }
    }
}

/// The criteria kept for one group: indices into the record's criteria, ascending.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CriterionSubset {
    /// Kept indices.
    pub kept: Vec<usize>,
}

impl CriterionSubset {
    /// All `n` criteria.
    pub fn all(n: usize) -> Self {
        Self {
            kept: (0..n).collect(),
        }
    }

    /// The kept criteria, in order.
    pub fn select<'a>(&self, criteria: &'a [Criterion]) -> Vec<&'a Criterion> {
        self.kept.iter().map(|&i| &criteria[i]).collect()
    }
}

/// FNV-1a over the concatenated parts, then splitmix64: a seed that is the same on every platform
/// and release (run seeds, steps and group keys go in; PRNG seeds come out).
pub fn stable_seed(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in parts.iter().flat_map(|p| p.iter()) {
        h ^= *b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    let mut z = h.wrapping_add(0x9e3779b97f4a7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
    z ^ (z >> 31)
}

/// A permutation of `0..n` from a ChaCha8 stream seeded with `seed` (Fisher-Yates from the last
/// position down): the one seeded shuffle of the project (epoch order, tie pairing, rubric
/// dropout), stable across platforms and releases.
pub fn seeded_permutation(n: usize, seed: u64) -> Vec<usize> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = rng.random_range(0..=i);
        order.swap(i, j);
    }
    order
}

impl RubricDropout {
    /// Checks `0 <= min <= max < 1`.
    pub fn validate(&self) -> Result<()> {
        if !(0.0 <= self.min_fraction
            && self.min_fraction <= self.max_fraction
            && self.max_fraction < 1.0)
        {
            return Err(RubricError::Config {
                field: "rubric_dropout".into(),
                message: format!(
                    "need 0 <= min_fraction <= max_fraction < 1, got {} and {}",
                    self.min_fraction, self.max_fraction
                ),
            });
        }
        Ok(())
    }

    /// The subset for the group of prompt `group_key` at `step` under run seed `seed`. At least one
    /// droppable criterion always survives.
    pub fn subset(
        &self,
        criteria: &[Criterion],
        seed: u64,
        step: u64,
        group_key: &str,
    ) -> CriterionSubset {
        let parts: [&[u8]; 3] = [
            &seed.to_le_bytes(),
            &step.to_le_bytes(),
            group_key.as_bytes(),
        ];
        let mut rng = ChaCha8Rng::seed_from_u64(stable_seed(&parts));
        let droppable: Vec<usize> = (0..criteria.len())
            .filter(|&i| {
                !(self.keep_global_controls && criteria[i].kind == CriterionKind::GlobalControl)
            })
            .collect();
        let fraction = if self.max_fraction > self.min_fraction {
            rng.random_range(self.min_fraction..=self.max_fraction)
        } else {
            self.min_fraction
        };
        let n_drop = ((fraction * droppable.len() as f64).round() as usize)
            .min(droppable.len().saturating_sub(1));
        // The first n_drop of a seeded shuffle of the droppable criteria are dropped.
        let order_parts: [&[u8]; 4] = [parts[0], parts[1], parts[2], b"order"];
        let order = seeded_permutation(droppable.len(), stable_seed(&order_parts));
        let dropped: Vec<usize> = order[..n_drop].iter().map(|&i| droppable[i]).collect();
        CriterionSubset {
            kept: (0..criteria.len())
                .filter(|i| !dropped.contains(i))
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::global_controls;

    fn rubric(n: usize) -> Vec<Criterion> {
        let mut c: Vec<Criterion> = (0..n)
            .map(|i| Criterion::content(format!("The response says {i}.")))
            .collect();
        c.extend(global_controls());
        c
    }

    #[test]
    fn same_inputs_same_subset_and_fraction_in_range() {
        let d = RubricDropout::default();
        let c = rubric(10);
        let a = d.subset(&c, 1234, 3, "prompt-7");
        assert_eq!(a, d.subset(&c, 1234, 3, "prompt-7"));
        let mut differs = 0;
        for step in 0..200 {
            let s = d.subset(&c, 1234, step, "prompt-7");
            let dropped = c.len() - s.kept.len();
            assert!((4..=6).contains(&dropped), "dropped {dropped} of 12");
            assert!(s.kept.windows(2).all(|w| w[0] < w[1]));
            differs += (s != a) as usize;
        }
        assert!(differs > 150, "subsets vary by step ({differs}/200)");
        assert_ne!(d.subset(&c, 1234, 3, "prompt-8"), a);
    }

    #[test]
    fn global_controls_can_be_protected_and_one_survives() {
        let d = RubricDropout {
            keep_global_controls: true,
            ..Default::default()
        };
        let c = rubric(4);
        for step in 0..50 {
            let s = d.subset(&c, 1, step, "p");
            assert!(s.kept.contains(&4) && s.kept.contains(&5));
        }
        let single = vec![Criterion::content("The response x.")];
        let d = RubricDropout {
            min_fraction: 0.9,
            max_fraction: 0.9,
            keep_global_controls: false,
        };
        assert_eq!(d.subset(&single, 1, 1, "p").kept, vec![0]);
        assert!(RubricDropout {
            min_fraction: 0.6,
            max_fraction: 0.5,
            ..Default::default()
        }
        .validate()
        .is_err());
    }
}
