//! Our three-state rubric score (docs/METHOD.md §4) of evaluation responses, next to the
//! HealthBench-style points score: each criterion is `correct` (+1), `missing` (0) or `wrong` (-1),
//! and a response scores the mean over its criteria (no length penalty in evaluation).

use std::collections::BTreeMap;

use conrub_rubric::{score_labels, Label, LengthPenalty, ScoringMode};
use serde::{Deserialize, Serialize};

use crate::rubric_score::{bootstrap_std_clipped, group_by_tag};

/// Fractions of each three-state label over all graded criteria.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LabelFractions {
    /// Share of `correct`.
    pub correct: f64,
    /// Share of `missing`.
    pub missing: f64,
    /// Share of `wrong`.
    pub wrong: f64,
}

/// Three-state results over a set of responses.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ThreeStateSummary {
    /// Responses with labels.
    pub responses: usize,
    /// Mean response score, in [-1, 1].
    pub mean: f64,
    /// Bootstrap standard deviation of `mean`.
    pub bootstrap_std: f64,
    /// Label shares over all criteria of all responses.
    pub labels: LabelFractions,
    /// Mean response score per example tag.
    pub by_example_tag: BTreeMap<String, f64>,
}

/// The three-state score of one response: the criteria mean of the training scorer without a length
/// penalty, or `None` without labels (or with labels that are not three-state).
pub fn three_state_score(labels: &[Label]) -> Option<f64> {
    score_labels(
        labels,
        labels.len(),
        ScoringMode::ThreeState,
        0,
        &LengthPenalty::disabled(),
    )
    .ok()
    .map(|s| s.criteria_mean)
}

/// Summarises `(example tags, labels)` per response.
pub fn summarize_three_state(
    rows: &[(Vec<String>, Vec<Label>)],
    resamples: usize,
    seed: u64,
) -> ThreeStateSummary {
    let scored: Vec<(&Vec<String>, f64)> = rows
        .iter()
        .filter_map(|(t, l)| three_state_score(l).map(|s| (t, s)))
        .collect();
    let scores: Vec<f64> = scored.iter().map(|(_, s)| *s).collect();
    let mean = |v: &[f64]| {
        if v.is_empty() {
            0.0
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        }
    };
    let by_tag = group_by_tag(&scored);
    let all: Vec<Label> = rows.iter().flat_map(|(_, l)| l.iter().copied()).collect();
    let share = |want: Label| {
        if all.is_empty() {
            0.0
        } else {
            all.iter().filter(|l| **l == want).count() as f64 / all.len() as f64
        }
    };
    ThreeStateSummary {
        responses: scores.len(),
        mean: mean(&scores),
        bootstrap_std: bootstrap_std_clipped(&scores, resamples, seed, (-1.0, 1.0)),
        labels: LabelFractions {
            correct: share(Label::Correct),
            missing: share(Label::Missing),
            wrong: share(Label::Wrong),
        },
        by_example_tag: by_tag.into_iter().map(|(k, v)| (k, mean(&v))).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Label::*;

    #[test]
    fn hand_computed_three_state_summary() {
        let rows = vec![
            (
                vec!["theme:a".to_string()],
                vec![Correct, Missing, Wrong, Correct, Missing],
            ), // 1/5
            (
                vec!["theme:b".to_string()],
                vec![Correct, Correct, Wrong, Correct],
            ), // 2/4
            (vec!["theme:a".to_string()], vec![Wrong, Wrong]), // -1
            (vec![], vec![]),                                  // ungraded
        ];
        let s = summarize_three_state(&rows, 1000, 3);
        assert_eq!(s.responses, 3);
        assert!((s.mean - (0.2 + 0.5 - 1.0) / 3.0).abs() < 1e-12);
        assert!((s.labels.correct - 5.0 / 11.0).abs() < 1e-12);
        assert!((s.labels.missing - 2.0 / 11.0).abs() < 1e-12);
        assert!((s.labels.wrong - 4.0 / 11.0).abs() < 1e-12);
        assert!((s.by_example_tag["theme:a"] - (-0.4)).abs() < 1e-12);
        assert_eq!(s.by_example_tag["theme:b"], 0.5);
        assert!(
            s.bootstrap_std > 0.0,
            "resampling a negative score is not clipped at 0"
        );
        assert_eq!(three_state_score(&[]), None);
    }
}
