//! A deterministic lexical judge: a **test double** for tests and the offline demo, never a judge
//! for real training runs (it checks phrases, not meaning).
//!
//! Per criterion: `wrong` if the response contains one of the criterion's `contradictions`,
//! `correct` if it contains one of its `keywords`, otherwise `missing` (binary: `yes` iff correct).
//! A criterion without keywords falls back to the significant words of its text (at least half must
//! appear). Pairwise: the response with the higher criterion score sum wins, equal sums are `same`.

use std::collections::HashMap;
use std::time::Instant;

use async_trait::async_trait;
use conrub_rubric::{Label, RubricSet, ScoringMode};

use crate::judge::{CriterionJudge, CriterionRequest, CriterionVerdict, PairRequest, PairVerdict, PairwiseJudge};
use crate::parse::{PairAnswer, Preference};

#[derive(Debug, Clone, Default)]
struct Keys {
    keywords: Vec<String>,
    contradictions: Vec<String>,
}

/// The lexical test-double judge.
#[derive(Debug, Clone, Default)]
pub struct LexicalJudge {
    keys: HashMap<String, Keys>,
}

const STOPWORDS: &[&str] = &[
    "about", "after", "against", "before", "being", "between", "clearly", "could", "every", "explains", "mentions",
    "other", "response", "should", "states", "their", "there", "these", "which", "while", "would", "where", "includes",
];

fn contains_phrase(haystack: &str, phrase: &str) -> bool {
    let p = phrase.trim().to_lowercase();
    if p.is_empty() {
        return false;
    }
    let bytes = haystack.as_bytes();
    let mut from = 0;
    while let Some(i) = haystack[from..].find(&p) {
        let s = from + i;
        let e = s + p.len();
        let left = s == 0 || !bytes[s - 1].is_ascii_alphanumeric();
        let right = e == bytes.len() || !bytes[e].is_ascii_alphanumeric();
        if left && right {
            return true;
        }
        from = s + 1;
    }
    false
}

fn significant_words(text: &str) -> Vec<String> {
    let mut words: Vec<String> = text
        .split(|c: char| !c.is_alphanumeric())
        .map(str::to_lowercase)
        .filter(|w| w.len() >= 5 && !STOPWORDS.contains(&w.as_str()))
        .collect();
    words.dedup();
    words
}

impl LexicalJudge {
    /// A judge that knows the keywords of every criterion in `rubrics`.
    pub fn new(rubrics: &RubricSet) -> Self {
        let mut keys = HashMap::new();
        for r in rubrics.iter() {
            for c in &r.criteria {
                if !c.keywords.is_empty() || !c.contradictions.is_empty() {
                    keys.insert(c.text.clone(), Keys { keywords: c.keywords.clone(), contradictions: c.contradictions.clone() });
                }
            }
        }
        Self { keys }
    }

    /// The integer score of one criterion (+1, 0, -1).
    fn criterion_score(&self, criterion: &str, response_lower: &str) -> i64 {
        match self.keys.get(criterion) {
            Some(k) => {
                if k.contradictions.iter().any(|p| contains_phrase(response_lower, p)) {
                    -1
                } else if k.keywords.iter().any(|p| contains_phrase(response_lower, p)) {
                    1
                } else {
                    0
                }
            }
            None => {
                let words = significant_words(criterion);
                let hits = words.iter().filter(|w| contains_phrase(response_lower, w)).count();
                (!words.is_empty() && 2 * hits >= words.len()) as i64
            }
        }
    }

    /// Labels for one response.
    pub fn labels(&self, response: &str, criteria: &[String], mode: ScoringMode) -> Vec<Label> {
        let lower = response.to_lowercase();
        criteria
            .iter()
            .map(|c| match (self.criterion_score(c, &lower), mode) {
                (1, ScoringMode::ThreeState) => Label::Correct,
                (0, ScoringMode::ThreeState) => Label::Missing,
                (_, ScoringMode::ThreeState) => Label::Wrong,
                (1, ScoringMode::Binary) => Label::Yes,
                (_, ScoringMode::Binary) => Label::No,
            })
            .collect()
    }
}

#[async_trait]
impl CriterionJudge for LexicalJudge {
    fn id(&self) -> String {
        "lexical".into()
    }

    async fn judge(&self, r: &CriterionRequest) -> CriterionVerdict {
        let start = Instant::now();
        let labels = self.labels(&r.response, &r.criteria, r.mode);
        let raw = serde_json::to_string(&labels).expect("labels serialise");
        CriterionVerdict::labelled(labels, vec![raw], 1, start.elapsed())
    }
}

#[async_trait]
impl PairwiseJudge for LexicalJudge {
    fn id(&self) -> String {
        "lexical".into()
    }

    async fn compare(&self, r: &PairRequest) -> PairVerdict {
        let start = Instant::now();
        let (a, b) = (r.first.to_lowercase(), r.second.to_lowercase());
        let per: Vec<(i64, i64)> = r.criteria.iter().map(|c| (self.criterion_score(c, &a), self.criterion_score(c, &b))).collect();
        let pref = |x: i64, y: i64| match x.cmp(&y) {
            std::cmp::Ordering::Greater => Preference::A,
            std::cmp::Ordering::Less => Preference::B,
            std::cmp::Ordering::Equal => Preference::Same,
        };
        let (sa, sb) = per.iter().fold((0, 0), |(x, y), (p, q)| (x + p, y + q));
        let answer = PairAnswer {
            verdict: pref(sa, sb),
            criteria: per.iter().map(|&(x, y)| pref(x, y)).collect(),
            confidence: Some(1.0),
            reason: Some(format!("criterion score sums {sa} vs {sb}")),
        };
        let raw = serde_json::to_string(&answer).expect("answer serialises");
        PairVerdict { answer: Some(answer), error: None, raw_outputs: vec![raw], attempts: 1, latency_ms: start.elapsed().as_secs_f64() * 1e3, cached: false }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use conrub_rubric::{Criterion, Message, RubricRecord};

    fn judge() -> (LexicalJudge, Vec<String>) {
        let mut c = Criterion::content("The response recommends calling emergency services.");
        c.keywords = vec!["call 911".into(), "emergency services".into()];
        c.contradictions = vec!["wait and see".into()];
        let plain = Criterion::content("The response mentions aspirin dosing.");
        let r = RubricRecord { id: "p".into(), question: vec![Message::user("q")], reference_answer: None, source: None, criteria: vec![c.clone(), plain.clone()], provenance: None };
        let set = RubricSet::from_records("mem", vec![r]).unwrap();
        (LexicalJudge::new(&set), vec![c.text, plain.text])
    }

    #[test]
    fn keywords_contradictions_and_fallback_words() {
        let (j, crit) = judge();
        use Label::*;
        assert_eq!(j.labels("Call 911 now. Aspirin dosing: 300 mg.", &crit, ScoringMode::ThreeState), vec![Correct, Correct]);
        assert_eq!(j.labels("Better wait and see; call 911 if worse.", &crit, ScoringMode::ThreeState), vec![Wrong, Missing]);
        assert_eq!(j.labels("recall 9110", &crit, ScoringMode::Binary), vec![No, No], "word boundaries");
    }

    #[tokio::test]
    async fn pairwise_is_order_consistent() {
        let (j, crit) = judge();
        let c = crate::judge::compare_both_orders(&j, "q", &crit, "Call 911.", "Rest at home.").await;
        assert_eq!(c.outcome, crate::judge::PairOutcome::PreferA);
        let c = crate::judge::compare_both_orders(&j, "q", &crit, "Rest.", "Sleep.").await;
        assert_eq!(c.outcome, crate::judge::PairOutcome::Same);
    }
}
