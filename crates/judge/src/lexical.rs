//! A deterministic lexical judge: a **test double** for tests and the offline demo, never a judge
//! for real training runs (it checks phrases, not meaning).
//!
//! **Its data.** The judge's phrases are its own, not part of the rubric records users write: a
//! keyword file (JSONL, named by `keywords = "FILE.jsonl"` in a `kind = "lexical"` judge config,
//! relative to that config) with one line per criterion,
//! `{"criterion": TEXT, "keywords": [...], "contradictions": [...]}`, matched by the criterion's
//! exact text (the only thing a judge request carries, as for a real judge). See
//! `data/samples/lexical-keywords.jsonl` for the sample rubrics' file.
//!
//! **Criterion labels.** Per criterion: `wrong` if the response contains one of the criterion's
//! contradictions, `correct` if it contains one of its keywords, otherwise `missing` (binary: `yes`
//! iff correct). A criterion without an entry falls back to the significant words of its text (at
//! least half must appear). Phrases match case-insensitively on word boundaries.
//!
//! **Pairwise** (see [`LexicalJudge::pair_answer`]): the candidate with the higher criterion score
//! sum wins. On equal sums (the case the learner asks about: a tied group) it compares finer
//! *evidence*: the number of distinct anchor terms the candidate contains (the significant words of
//! the question and the criteria, plus the criteria's keywords: a proxy for covering the criteria)
//! minus the number of immediately repeated words (`rather rather`: a proxy for the appropriateness
//! control's "clear, usable form"). Everything it uses is in the pairwise request and the judge's own
//! keyword data, never rewards or the reference answer. A difference of at least [`PAIR_MARGIN`]
//! prefers the candidate with more evidence, in either order (so the bidirectional check accepts
//! it); a smaller nonzero difference prefers whichever candidate is shown first (a deliberate
//! position bias, which the bidirectional check turns into an order flip); no difference is `same`.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::time::Instant;

use async_trait::async_trait;
use conrub_rubric::{Label, ScoringMode};
use serde::{Deserialize, Serialize};

use crate::error::{JudgeError, Result};
use crate::judge::{
    CriterionJudge, CriterionRequest, CriterionVerdict, PairRequest, PairVerdict, PairwiseJudge,
};
use crate::parse::{PairAnswer, Preference};

/// One line of the lexical judge's keyword file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeywordEntry {
    /// The criterion's exact text.
    pub criterion: String,
    /// Any of these phrases makes the criterion `correct`.
    #[serde(default)]
    pub keywords: Vec<String>,
    /// Any of these phrases makes the criterion `wrong` (checked first).
    #[serde(default)]
    pub contradictions: Vec<String>,
}

#[derive(Debug, Clone, Default)]
struct Keys {
    keywords: Vec<String>,
    contradictions: Vec<String>,
}

/// Smallest difference in pairwise evidence (anchor terms minus repeated words) for which the
/// pairwise rule prefers a candidate on its content; smaller nonzero differences prefer the
/// candidate shown first.
pub const PAIR_MARGIN: usize = 2;

/// The lexical test-double judge.
#[derive(Debug, Clone, Default)]
pub struct LexicalJudge {
    keys: HashMap<String, Keys>,
}

const STOPWORDS: &[&str] = &[
    "about", "after", "against", "before", "being", "between", "clearly", "could", "every",
    "explains", "mentions", "other", "response", "should", "states", "their", "there", "these",
    "which", "while", "would", "where", "includes",
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

/// Words immediately followed by the same word (case-insensitive; punctuation between them ignored).
fn repeated_words(text_lower: &str) -> usize {
    let words: Vec<&str> = text_lower
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .collect();
    words.windows(2).filter(|w| w[0] == w[1]).count()
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
    /// A judge with the entries of a keyword file (JSONL, see the module docs). Errors name the
    /// file, line and field; a criterion listed twice is an error.
    pub fn from_file(path: &Path) -> Result<Self> {
        let err = |message: String| JudgeError::config("keywords", message);
        let rows: Vec<(usize, KeywordEntry)> =
            conrub_rubric::read_jsonl(path).map_err(|e| err(e.to_string()))?;
        let mut judge = Self::default();
        let mut lines: HashMap<String, usize> = HashMap::new();
        for (line, e) in rows {
            if let Some(first) = lines.insert(e.criterion.clone(), line) {
                return Err(err(format!(
                    "{}:{line}: criterion already listed on line {first}",
                    path.display()
                )));
            }
            if e.keywords.is_empty() && e.contradictions.is_empty() {
                return Err(err(format!(
                    "{}:{line}: neither `keywords` nor `contradictions` (drop the line to match the criterion's own words)",
                    path.display()
                )));
            }
            judge.keys.insert(
                e.criterion,
                Keys {
                    keywords: e.keywords,
                    contradictions: e.contradictions,
                },
            );
        }
        Ok(judge)
    }

    /// Adds (or replaces) the phrases of one criterion.
    pub fn with_keywords(
        mut self,
        criterion: &str,
        keywords: &[&str],
        contradictions: &[&str],
    ) -> Self {
        let own = |v: &[&str]| v.iter().map(|s| s.to_string()).collect();
        self.keys.insert(
            criterion.to_string(),
            Keys {
                keywords: own(keywords),
                contradictions: own(contradictions),
            },
        );
        self
    }

    /// Criteria with an entry (keywords or contradictions).
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// True when no criterion has an entry (every criterion uses its own words).
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// True when `criterion` (exact text) has an entry.
    pub fn knows(&self, criterion: &str) -> bool {
        self.keys.contains_key(criterion)
    }

    /// The integer score of one criterion (+1, 0, -1).
    fn criterion_score(&self, criterion: &str, response_lower: &str) -> i64 {
        match self.keys.get(criterion) {
            Some(k) => {
                if k.contradictions
                    .iter()
                    .any(|p| contains_phrase(response_lower, p))
                {
                    -1
                } else if k
                    .keywords
                    .iter()
                    .any(|p| contains_phrase(response_lower, p))
                {
                    1
                } else {
                    0
                }
            }
            None => {
                let words = significant_words(criterion);
                let hits = words
                    .iter()
                    .filter(|w| contains_phrase(response_lower, w))
                    .count();
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

    /// The anchor terms of a pairwise request: significant words of the question and of the
    /// criteria, and the keywords of the criteria (lower case, deduplicated).
    fn anchor_terms(&self, r: &PairRequest) -> BTreeSet<String> {
        let mut terms: BTreeSet<String> = significant_words(&r.question).into_iter().collect();
        for c in &r.criteria {
            terms.extend(significant_words(c));
            if let Some(k) = self.keys.get(c) {
                terms.extend(
                    k.keywords
                        .iter()
                        .map(|p| p.trim().to_lowercase())
                        .filter(|p| !p.is_empty()),
                );
            }
        }
        terms
    }

    /// The answer for one ordering (the rule of the module docs):
    /// 1. the higher criterion score sum wins;
    /// 2. equal sums: evidence = distinct anchor terms contained minus immediately repeated words,
    ///    `d` = evidence of `first` minus evidence of `second`; `|d| >= PAIR_MARGIN` prefers the one
    ///    with more, `0 < |d| < PAIR_MARGIN` prefers `first` (position bias), `d == 0` is `same`.
    pub fn pair_answer(&self, r: &PairRequest) -> PairAnswer {
        let (a, b) = (r.first.to_lowercase(), r.second.to_lowercase());
        let per: Vec<(i64, i64)> = r
            .criteria
            .iter()
            .map(|c| (self.criterion_score(c, &a), self.criterion_score(c, &b)))
            .collect();
        let pref = |x: i64, y: i64| match x.cmp(&y) {
            std::cmp::Ordering::Greater => Preference::A,
            std::cmp::Ordering::Less => Preference::B,
            std::cmp::Ordering::Equal => Preference::Same,
        };
        let (sa, sb) = per.iter().fold((0, 0), |(x, y), (p, q)| (x + p, y + q));
        let (verdict, reason) = if sa != sb {
            (pref(sa, sb), format!("criterion score sums {sa} vs {sb}"))
        } else {
            let terms = self.anchor_terms(r);
            let count = |text: &str| terms.iter().filter(|t| contains_phrase(text, t)).count();
            let (ta, tb) = (count(&a), count(&b));
            let (ra, rb) = (repeated_words(&a), repeated_words(&b));
            let (ea, eb) = (ta as i64 - ra as i64, tb as i64 - rb as i64);
            let (verdict, why) = match ea.abs_diff(eb) {
                0 => (Preference::Same, "no difference"),
                d if d >= PAIR_MARGIN as u64 => (pref(ea, eb), "clear difference"),
                _ => (
                    Preference::A,
                    "difference below the margin: the first shown is preferred",
                ),
            };
            let reason = format!(
                "criterion score sums {sa} vs {sb}; anchor terms {ta} vs {tb}, repeated words {ra} vs {rb}: evidence {ea} vs {eb} (margin {PAIR_MARGIN}): {why}"
            );
            (verdict, reason)
        };
        PairAnswer {
            verdict,
            criteria: per.iter().map(|&(x, y)| pref(x, y)).collect(),
            confidence: Some(1.0),
            reason: Some(reason),
        }
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
        let answer = self.pair_answer(r);
        let raw = serde_json::to_string(&answer).expect("answer serialises");
        PairVerdict {
            answer: Some(answer),
            error: None,
            raw_outputs: vec![raw],
            attempts: 1,
            latency_ms: start.elapsed().as_secs_f64() * 1e3,
            cached: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::judge::{compare_both_orders, PairOutcome};

    const CALL: &str = "The response recommends calling emergency services.";
    const ASPIRIN: &str = "The response mentions aspirin dosing.";

    fn judge() -> (LexicalJudge, Vec<String>) {
        let j = LexicalJudge::default().with_keywords(
            CALL,
            &["call 911", "emergency services"],
            &["wait and see"],
        );
        (j, vec![CALL.to_string(), ASPIRIN.to_string()])
    }

    #[test]
    fn keywords_contradictions_and_fallback_words() {
        let (j, crit) = judge();
        use Label::*;
        assert_eq!(
            j.labels(
                "Call 911 now. Aspirin dosing: 300 mg.",
                &crit,
                ScoringMode::ThreeState
            ),
            vec![Correct, Correct]
        );
        assert_eq!(
            j.labels(
                "Better wait and see; call 911 if worse.",
                &crit,
                ScoringMode::ThreeState
            ),
            vec![Wrong, Missing]
        );
        assert_eq!(
            j.labels("recall 9110", &crit, ScoringMode::Binary),
            vec![No, No],
            "word boundaries"
        );
    }

    #[test]
    fn keyword_files_are_the_judges_own_data() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("kw.jsonl");
        std::fs::write(&p, format!("{{\"criterion\": \"{CALL}\", \"keywords\": [\"call 911\"], \"contradictions\": [\"wait and see\"]}}\n")).unwrap();
        let j = LexicalJudge::from_file(&p).unwrap();
        assert!(j.knows(CALL) && !j.knows(ASPIRIN) && j.len() == 1);
        let crit = vec![CALL.to_string()];
        assert_eq!(
            j.labels("wait and see", &crit, ScoringMode::ThreeState),
            vec![Label::Wrong]
        );

        std::fs::write(
            &p,
            format!("{{\"criterion\": \"{CALL}\", \"keyword\": [\"x\"]}}\n"),
        )
        .unwrap();
        let e = LexicalJudge::from_file(&p).unwrap_err().to_string();
        assert!(
            e.starts_with("keywords: ")
                && e.contains("kw.jsonl:1: keyword: unknown field `keyword`"),
            "{e}"
        );
        std::fs::write(&p, format!("{{\"criterion\": \"{CALL}\", \"keywords\": [\"a\"]}}\n\n{{\"criterion\": \"{CALL}\", \"keywords\": [\"b\"]}}\n")).unwrap();
        let e = LexicalJudge::from_file(&p).unwrap_err().to_string();
        assert!(
            e.contains("kw.jsonl:3: criterion already listed on line 1"),
            "{e}"
        );
        std::fs::write(&p, format!("{{\"criterion\": \"{CALL}\"}}\n")).unwrap();
        assert!(LexicalJudge::from_file(&p)
            .unwrap_err()
            .to_string()
            .contains("neither `keywords` nor `contradictions`"));
    }

    /// The sample keyword file covers every content criterion of the sample rubrics.
    #[test]
    fn sample_keyword_file_matches_the_sample_rubrics() {
        let samples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/samples");
        let j = LexicalJudge::from_file(&samples.join("lexical-keywords.jsonl")).unwrap();
        let rubrics = conrub_rubric::read_rubrics(&samples.join("rubrics.jsonl")).unwrap();
        let content: Vec<&str> = rubrics
            .iter()
            .flat_map(|r| &r.criteria)
            .filter(|c| c.kind == conrub_rubric::CriterionKind::Content)
            .map(|c| c.text.as_str())
            .collect();
        assert_eq!(content.len(), 36);
        assert!(
            content.iter().all(|c| j.knows(c)),
            "every content criterion has keywords"
        );
        assert_eq!(j.len(), content.len(), "and no entry is stale");
    }

    #[tokio::test]
    async fn pairwise_prefers_the_higher_criterion_score_in_both_orders() {
        let (j, crit) = judge();
        let c = compare_both_orders(&j, "q", &crit, "Call 911.", "Rest at home.").await;
        assert_eq!(c.outcome, PairOutcome::PreferA);
        let c = compare_both_orders(&j, "q", &crit, "Rest at home.", "Call 911.").await;
        assert_eq!(c.outcome, PairOutcome::PreferB);
    }

    /// Equal criterion scores (a tied group): the anchor-term rule decides.
    #[tokio::test]
    async fn pairwise_on_equal_scores_accepts_clear_differences_flips_small_ones() {
        let (j, crit) = judge();
        let q = "My father has chest pain and sweating. What should we do?";
        // Both miss both criteria (score sums 0 vs 0).
        let scores = |r: &str| j.labels(r, &crit, ScoringMode::ThreeState);
        let rich = "Chest pain with sweating in your father needs urgent care.";
        let poor = "Rest and drink water.";
        let one_more = "Chest pain and sweating need care.";
        let one_less = "Chest pain needs care.";
        for r in [rich, poor, one_more, one_less] {
            assert_eq!(scores(r), vec![Label::Missing, Label::Missing], "{r}");
        }
        // A clear difference (chest, sweating, father vs none): the same response in both orders,
        // accepted by the bidirectional check.
        let c = compare_both_orders(&j, q, &crit, rich, poor).await;
        assert_eq!(c.outcome, PairOutcome::PreferA, "{:?}", c.forward.answer);
        assert_eq!(
            compare_both_orders(&j, q, &crit, poor, rich).await.outcome,
            PairOutcome::PreferB
        );
        // One anchor term apart (sweating): below the margin, the first shown wins each time: an order flip.
        let c = compare_both_orders(&j, q, &crit, one_more, one_less).await;
        assert_eq!(c.outcome, PairOutcome::OrderFlip);
        let (f, b) = (c.forward.answer.unwrap(), c.backward.answer.unwrap());
        assert_eq!((f.verdict, b.verdict), (Preference::A, Preference::A));
        assert!(f
            .reason
            .unwrap()
            .contains("anchor terms 2 vs 1, repeated words 0 vs 0: evidence 2 vs 1 (margin 2)"));
        // No difference: same.
        let c = compare_both_orders(&j, q, &crit, "Rest.", "Sleep.").await;
        assert_eq!(c.outcome, PairOutcome::Same);
        let c = compare_both_orders(&j, q, &crit, one_less, "Care for the chest.").await;
        assert_eq!(c.outcome, PairOutcome::Same);
    }

    /// The criteria's keywords are anchor terms too, beyond the first one that made a criterion correct.
    #[test]
    fn keywords_count_as_anchor_terms() {
        let j = LexicalJudge::default().with_keywords(
            "The response says t7.",
            &["t7", "t8", "t9"],
            &[],
        );
        let r = |first: &str, second: &str| PairRequest {
            question: "q".into(),
            criteria: vec!["The response says t7.".into()],
            first: first.into(),
            second: second.into(),
        };
        // Both correct on the criterion (sums 1 vs 1); three keywords against one: a clear difference.
        let a = j.pair_answer(&r("t7 t8 t9", "t7"));
        assert_eq!(a.verdict, Preference::A);
        assert_eq!(
            a.reason.as_deref(),
            Some("criterion score sums 1 vs 1; anchor terms 3 vs 1, repeated words 0 vs 0: evidence 3 vs 1 (margin 2): clear difference")
        );
        assert_eq!(j.pair_answer(&r("t7", "t7 t8 t9")).verdict, Preference::B);
        // Two against one: below the margin, the first shown wins in either order.
        assert_eq!(j.pair_answer(&r("t7 t8", "t7")).verdict, Preference::A);
        assert_eq!(j.pair_answer(&r("t7", "t7 t8")).verdict, Preference::A);
        assert_eq!(
            j.pair_answer(&r("t8 t7", "t7 t8")).verdict,
            Preference::Same
        );
    }

    /// Immediately repeated words count against a candidate (degenerate text is not a clear, usable
    /// answer): two repeats against none is a clear difference, one is below the margin.
    #[tokio::test]
    async fn repeated_words_count_against_a_candidate() {
        let (j, crit) = judge();
        let q = "My father has chest pain.";
        let c = compare_both_orders(&j, q, &crit, "Chest pain pain, pain.", "Chest pain.").await;
        assert_eq!(c.outcome, PairOutcome::PreferB, "{:?}", c.forward.answer);
        let reason = c.forward.answer.unwrap().reason.unwrap();
        assert!(reason.ends_with("anchor terms 1 vs 1, repeated words 2 vs 0: evidence -1 vs 1 (margin 2): clear difference"), "{reason}");
        let c = compare_both_orders(&j, q, &crit, "Chest chest pain.", "Chest pain.").await;
        assert_eq!(c.outcome, PairOutcome::OrderFlip);
        assert_eq!(repeated_words("a a a b, b c"), 3);
    }
}
