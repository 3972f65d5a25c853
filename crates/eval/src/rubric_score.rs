//! HealthBench-style rubric scores.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One rubric item with the grader's decision.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GradedItem {
    /// Points (negative for undesirable behaviour).
    pub points: f64,
    /// Whether the grader found the item met (for a negative item: the behaviour is present).
    pub met: bool,
    /// Item tags (`axis:accuracy`, ...).
    #[serde(default)]
    pub tags: Vec<String>,
}

/// `sum(points of met items) / sum(positive points)`, unclipped (it can be negative); `None` when
/// the rubric has no positive points.
pub fn example_score(items: &[GradedItem]) -> Option<f64> {
    let total: f64 = items
        .iter()
        .filter(|i| i.points > 0.0)
        .map(|i| i.points)
        .sum();
    if total <= 0.0 {
        return None;
    }
    let achieved: f64 = items.iter().filter(|i| i.met).map(|i| i.points).sum();
    Some(achieved / total)
}

pub use conrub_rubric::bootstrap::{bootstrap_std, bootstrap_std_clipped};

/// Overall and per-tag results.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RubricSummary {
    /// Examples with a score.
    pub examples: usize,
    /// Mean example score clipped to [0, 1].
    pub score: f64,
    /// Bootstrap standard deviation of `score`.
    pub bootstrap_std: f64,
    /// Per example tag (e.g. `theme:emergency_referrals`): clipped mean over examples with the tag.
    pub by_example_tag: BTreeMap<String, f64>,
    /// Per item tag (e.g. `axis:accuracy`): the score restricted to items with that tag, clipped
    /// mean over examples that have such items.
    pub by_item_tag: BTreeMap<String, f64>,
}

/// Scores grouped by each of their example's tags.
pub(crate) fn group_by_tag(scored: &[(&Vec<String>, f64)]) -> BTreeMap<String, Vec<f64>> {
    let mut by_tag: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for (tags, s) in scored {
        for t in tags.iter() {
            by_tag.entry(t.clone()).or_default().push(*s);
        }
    }
    by_tag
}

/// Summarises graded examples `(example tags, items)`.
pub fn summarize(
    examples: &[(Vec<String>, Vec<GradedItem>)],
    resamples: usize,
    seed: u64,
) -> RubricSummary {
    let scored: Vec<(&Vec<String>, f64)> = examples
        .iter()
        .filter_map(|(t, items)| example_score(items).map(|s| (t, s)))
        .collect();
    let scores: Vec<f64> = scored.iter().map(|(_, s)| *s).collect();
    let clipped_mean = |v: &[f64]| {
        if v.is_empty() {
            0.0
        } else {
            (v.iter().sum::<f64>() / v.len() as f64).clamp(0.0, 1.0)
        }
    };
    let by_example_tag = group_by_tag(&scored);
    let mut by_item_tag: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for (_, items) in examples {
        let mut tags: Vec<&String> = items.iter().flat_map(|i| i.tags.iter()).collect();
        tags.sort();
        tags.dedup();
        for t in tags {
            let sub: Vec<GradedItem> = items
                .iter()
                .filter(|i| i.tags.contains(t))
                .cloned()
                .collect();
            if let Some(s) = example_score(&sub) {
                by_item_tag.entry(t.clone()).or_default().push(s);
            }
        }
    }
    RubricSummary {
        examples: scores.len(),
        score: clipped_mean(&scores),
        bootstrap_std: bootstrap_std(&scores, resamples, seed),
        by_example_tag: by_example_tag
            .into_iter()
            .map(|(k, v)| (k, clipped_mean(&v)))
            .collect(),
        by_item_tag: by_item_tag
            .into_iter()
            .map(|(k, v)| (k, clipped_mean(&v)))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(points: f64, met: bool, tag: &str) -> GradedItem {
        GradedItem {
            points,
            met,
            tags: vec![tag.into()],
        }
    }

    #[test]
    fn hand_computed_scores_with_negative_points_and_clipping() {
        // Met 5 of 5 + 3 positive points, and the -4 behaviour is present: (5 - 4) / 8.
        let a = vec![
            item(5.0, true, "axis:accuracy"),
            item(3.0, false, "axis:completeness"),
            item(-4.0, true, "axis:accuracy"),
        ];
        assert_eq!(example_score(&a), Some(0.125));
        // Only the undesirable behaviour: -6 / 2 = -3 (unclipped per example).
        let b = vec![
            item(2.0, false, "axis:completeness"),
            item(-6.0, true, "axis:accuracy"),
        ];
        assert_eq!(example_score(&b), Some(-3.0));
        // All met: 1.
        let c = vec![item(10.0, true, "axis:accuracy")];
        assert_eq!(example_score(&c), Some(1.0));
        assert_eq!(example_score(&[item(-1.0, false, "x")]), None);
        let s = summarize(
            &[
                (vec!["theme:a".into()], a),
                (vec!["theme:a".into()], b),
                (vec!["theme:b".into()], c),
            ],
            1000,
            42,
        );
        // Mean (0.125 - 3 + 1) / 3 = -0.625 -> clipped to 0.
        assert_eq!(s.score, 0.0);
        assert_eq!(s.examples, 3);
        assert_eq!(s.by_example_tag["theme:b"], 1.0);
        assert_eq!(s.by_example_tag["theme:a"], 0.0, "(0.125 - 3) / 2 clipped");
        // Accuracy items only: a: (5 - 4) / 5 = 0.2; b: no positive accuracy points; c: 1 -> 0.6.
        assert!((s.by_item_tag["axis:accuracy"] - 0.6).abs() < 1e-12);
        // Completeness: a 0 / 3, b 0 / 2 -> 0.
        assert_eq!(s.by_item_tag["axis:completeness"], 0.0);
    }

    #[test]
    fn bootstrap_is_seeded_and_close_to_the_analytic_value() {
        let scores: Vec<f64> = (0..400)
            .map(|i| if i % 4 == 0 { 1.0 } else { 0.2 })
            .collect();
        let a = bootstrap_std(&scores, 1000, 7);
        assert_eq!(a, bootstrap_std(&scores, 1000, 7));
        // Population std of {1, 0.2, 0.2, 0.2} is sqrt(0.12) = 0.3464; std of the mean ~0.3464 / 20.
        assert!((a - 0.3464 / 20.0).abs() < 0.0025, "{a}");
        assert_eq!(bootstrap_std(&[0.5], 1000, 7), 0.0);
    }
}
