//! Multiple-choice answer extraction and accuracy.

use conrub_judge::parse::strip_thinking;
use serde::{Deserialize, Serialize};

/// The label at the start of `s` (after opening punctuation), if `s` starts with one as a whole token.
/// `strict` (outside an explicit "answer is" marker): a one-letter label must have its own case or be
/// closed by `)`, `]`, `.` or `:`, so the word "a" is not option A.
fn label_at(s: &str, labels: &[&str], strict: bool) -> Option<usize> {
    let t = s.trim_start_matches(|c: char| {
        c.is_whitespace() || matches!(c, ':' | '*' | '(' | '[' | '{' | '"' | '\'' | '-' | '=')
    });
    let lower = t.to_lowercase();
    // Longest label first, so "maybe" is not read as a one-letter label.
    let mut order: Vec<usize> = (0..labels.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(labels[i].len()));
    order.into_iter().find(|&i| {
        let l = labels[i].to_lowercase();
        if !lower.starts_with(&l) {
            return false;
        }
        let next = lower[l.len()..].chars().next();
        let whole = !next.is_some_and(|c| c.is_alphanumeric());
        let cased = !strict
            || labels[i].chars().count() > 1
            || t.starts_with(labels[i])
            || matches!(next, Some(')' | ']' | '.' | ':'));
        whole && cased
    })
}

const MARKERS: &[&str] = &[
    "\\boxed{",
    "final answer is",
    "final answer:",
    "final answer",
    "correct answer is",
    "correct option is",
    "correct choice is",
    "the answer is",
    "answer is",
    "answer:",
    "option",
];

/// The chosen option (an index into `labels`, e.g. `["A", "B", "C", "D"]` or
/// `["yes", "no", "maybe"]`), or `None` when the response commits to no single option.
///
/// Looks, in order, for an explicit marker ("the answer is (B)", "Answer: B", "\boxed{B}",
/// "Final answer - C", "Option D"; the last marker wins), a response that starts with an option
/// ("B. Aspirin", "(c)"), and a single distinct standalone option anywhere in the text.
pub fn extract_choice(text: &str, labels: &[&str]) -> Option<usize> {
    let text = strip_thinking(text);
    let lower = text.to_lowercase();
    for m in MARKERS {
        if let Some(pos) = lower.rfind(m) {
            if let Some(i) = label_at(&text[pos + m.len()..], labels, false) {
                return Some(i);
            }
        }
    }
    if let Some(i) = label_at(&text, labels, true) {
        return Some(i);
    }
    // A single distinct option mentioned as a standalone token.
    let mut found: Option<usize> = None;
    let bytes = text.as_bytes();
    for (start, _) in text.char_indices() {
        let boundary = start == 0 || !(bytes[start - 1] as char).is_alphanumeric();
        if !boundary {
            continue;
        }
        if let Some(i) = label_at(&text[start..], labels, true) {
            // Label must itself start at `start` (label_at skips punctuation, which is fine here).
            match found {
                None => found = Some(i),
                Some(j) if j == i => {}
                Some(_) => return None,
            }
        }
    }
    found
}

/// Accuracy over a set of graded answers.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct McqSummary {
    /// Questions.
    pub n: usize,
    /// Correct answers.
    pub correct: usize,
    /// Responses with no extractable answer.
    pub invalid: usize,
    /// `correct / n` (invalid counts as wrong).
    pub accuracy: f64,
    /// 95% Wilson interval of the accuracy.
    pub ci95: (f64, f64),
    /// `invalid / n`.
    pub invalid_rate: f64,
}

impl McqSummary {
    /// Summarises `(extracted, gold)` pairs.
    pub fn from_answers(answers: &[(Option<usize>, usize)]) -> Self {
        let n = answers.len();
        let correct = answers.iter().filter(|(a, g)| *a == Some(*g)).count();
        let invalid = answers.iter().filter(|(a, _)| a.is_none()).count();
        if n == 0 {
            return Self::default();
        }
        let p = correct as f64 / n as f64;
        let z = 1.959963984540054f64;
        let nn = n as f64;
        let denom = 1.0 + z * z / nn;
        let centre = (p + z * z / (2.0 * nn)) / denom;
        let half = z * (p * (1.0 - p) / nn + z * z / (4.0 * nn * nn)).sqrt() / denom;
        Self {
            n,
            correct,
            invalid,
            accuracy: p,
            ci95: ((centre - half).max(0.0), (centre + half).min(1.0)),
            invalid_rate: invalid as f64 / nn,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ABCD: &[&str] = &["A", "B", "C", "D"];

    #[test]
    fn usual_phrasings() {
        let cases: &[(&str, Option<usize>)] = &[
            ("The answer is (B).", Some(1)),
            ("Answer: c", Some(2)),
            ("**D**", Some(3)),
            ("B. Aspirin inhibits cyclooxygenase.", Some(1)),
            ("Let me think. A is wrong because ... so the correct answer is C, since B is a distractor.", Some(2)),
            ("Final answer: \\boxed{A}", Some(0)),
            ("<think>maybe A or B</think>\nThe best option is D", Some(3)),
            ("Option B is correct.", Some(1)),
            ("It could be A or B.", None),
            ("I am not sure.", None),
            ("a patient with a cough", None),
        ];
        for (text, want) in cases {
            assert_eq!(extract_choice(text, ABCD), *want, "{text}");
        }
        let pubmed = &["yes", "no", "maybe"];
        assert_eq!(
            extract_choice("Maybe; the evidence is mixed.", pubmed),
            Some(2)
        );
        assert_eq!(
            extract_choice("Based on the trial, the answer is yes.", pubmed),
            Some(0)
        );
        assert_eq!(extract_choice("No.", pubmed), Some(1));
    }

    #[test]
    fn accuracy_with_wilson_interval() {
        let s = McqSummary::from_answers(&[(Some(0), 0), (Some(1), 0), (None, 2), (Some(3), 3)]);
        assert_eq!((s.n, s.correct, s.invalid), (4, 2, 1));
        assert_eq!(s.accuracy, 0.5);
        assert_eq!(s.invalid_rate, 0.25);
        // Wilson 95% for 2/4: [0.150, 0.850].
        assert!(
            (s.ci95.0 - 0.1500).abs() < 1e-3 && (s.ci95.1 - 0.8500).abs() < 1e-3,
            "{:?}",
            s.ci95
        );
    }
}
