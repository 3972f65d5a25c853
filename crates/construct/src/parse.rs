//! Parsers for the four construction answers. Each takes the last JSON value in the output that
//! has the expected shape (models sometimes echo the example first); a missing or unusable answer
//! is an error that the client turns into a retry. Item-level problems in a generator answer are
//! kept for the deterministic checks, which count them.

use conrub_judge::{json_values, OutputError};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One proposed criterion as the generator wrote it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RawCandidate {
    /// Its text (`None` when the item had none).
    pub text: Option<String>,
    /// Its coverage tag as written: `yes`, `no`, `null` or anything else.
    pub coverage: Option<String>,
}

fn last_matching<T>(
    text: &str,
    what: &str,
    f: impl Fn(&Value) -> Result<T, OutputError>,
) -> Result<T, OutputError> {
    let values = json_values(text);
    if values.is_empty() {
        return Err(format!("no JSON found (expected {what})").into());
    }
    let mut last_err = OutputError(String::new());
    for v in values.iter().rev() {
        match f(v) {
            Ok(t) => return Ok(t),
            Err(e) => last_err = e,
        }
    }
    Err(last_err)
}

fn field<'a>(o: &'a serde_json::Map<String, Value>, names: &[&str]) -> Option<&'a Value> {
    names.iter().find_map(|k| o.get(*k))
}

/// The list in `v`: `v` itself, or its first field named in `keys`.
fn list_in<'a>(v: &'a Value, keys: &[&str]) -> Result<&'a Vec<Value>, OutputError> {
    match v {
        Value::Array(a) => Ok(a),
        Value::Object(o) => match field(o, keys) {
            Some(Value::Array(a)) => Ok(a),
            _ => Err(format!("no `{}` list", keys[0]).into()),
        },
        _ => Err("not a list or an object".into()),
    }
}

fn coverage_text(v: &Value) -> Option<String> {
    match v {
        Value::Null => None,
        Value::Bool(b) => Some(if *b { "yes" } else { "no" }.into()),
        Value::String(s) => Some(s.trim().to_ascii_lowercase()),
        other => Some(other.to_string()),
    }
}

/// A generator answer: `{"criteria": [{"text", "coverage"}, ...]}`, a bare list of such objects,
/// or a list of strings.
pub fn parse_generation(text: &str) -> Result<Vec<RawCandidate>, OutputError> {
    last_matching(text, "{\"criteria\": [...]}", |v| {
        let list = list_in(v, &["criteria", "rubric", "items"])?;
        if list.is_empty() {
            return Err("the criteria list is empty".into());
        }
        Ok(list
            .iter()
            .map(|item| match item {
                Value::String(s) => RawCandidate {
                    text: Some(s.clone()),
                    coverage: None,
                },
                Value::Object(o) => RawCandidate {
                    text: field(o, &["text", "criterion", "description"])
                        .and_then(Value::as_str)
                        .map(str::to_string),
                    coverage: field(o, &["coverage", "reference_coverage", "covered", "tag"])
                        .and_then(coverage_text),
                },
                _ => RawCandidate {
                    text: None,
                    coverage: None,
                },
            })
            .collect())
    })
}

/// The reviewer's verdict on one sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReviewVerdict {
    /// No serious error, contradiction or conflict with the reference.
    Consistent,
    /// A serious error, contradiction or conflict: the sample is rejected.
    Contradiction,
}

/// A sample review.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReviewAnswer {
    /// The verdict.
    pub verdict: ReviewVerdict,
    /// Alignment score 0-10.
    pub score: u32,
    /// Problems the reviewer listed.
    pub problems: Vec<String>,
}

fn as_score(v: &Value) -> Option<u32> {
    let x = match v {
        Value::Number(n) => n.as_f64()?,
        Value::String(s) => s.trim().trim_end_matches("/10").trim().parse().ok()?,
        _ => return None,
    };
    (x.is_finite() && (0.0..=10.0).contains(&x) && x.fract() == 0.0).then_some(x as u32)
}

/// A review answer: `{"verdict": "consistent"|"contradiction", "score": 0-10, "problems": [...]}`.
pub fn parse_review(text: &str) -> Result<ReviewAnswer, OutputError> {
    last_matching(text, "{\"verdict\", \"score\"}", |v| {
        let o = v.as_object().ok_or("not an object")?;
        let verdict = match field(o, &["verdict", "decision"])
            .and_then(Value::as_str)
            .map(|s| s.trim().to_ascii_lowercase())
        {
            Some(s) if s == "consistent" || s == "pass" || s == "ok" => ReviewVerdict::Consistent,
            Some(s) if s.starts_with("contradict") || s == "reject" => ReviewVerdict::Contradiction,
            Some(s) => {
                return Err(format!("verdict `{s}` is not consistent or contradiction").into())
            }
            None => return Err("no `verdict`".into()),
        };
        let score = field(o, &["score", "alignment"]).ok_or("no `score`")?;
        let score = as_score(score)
            .ok_or_else(|| format!("score `{score}` is not a whole number from 0 to 10"))?;
        let problems = match field(o, &["problems", "issues"]) {
            Some(Value::Array(a)) => a
                .iter()
                .map(|p| p.as_str().map_or_else(|| p.to_string(), str::to_string))
                .collect(),
            Some(Value::String(s)) if !s.trim().is_empty() => vec![s.clone()],
            _ => vec![],
        };
        Ok(ReviewAnswer {
            verdict,
            score,
            problems,
        })
    })
}

/// A grouping answer: `{"groups": [["A1", "B4"], ...]}`, `{"clusters": ...}`, a bare list, or
/// groups given as `{"members": [...]}` objects. Ids are upper-cased and trimmed.
pub fn parse_grouping(text: &str) -> Result<Vec<Vec<String>>, OutputError> {
    last_matching(text, "{\"groups\": [[...]]}", |v| {
        let list = list_in(v, &["groups", "clusters"])?;
        list.iter()
            .map(|g| {
                let members = match g {
                    Value::Array(m) => m,
                    Value::Object(o) => match field(o, &["members", "ids", "criteria"]) {
                        Some(Value::Array(m)) => m,
                        _ => return Err("a group object has no `members`".to_string().into()),
                    },
                    _ => return Err("a group is not a list".to_string().into()),
                };
                members
                    .iter()
                    .map(|m| {
                        m.as_str()
                            .map(|s| s.trim().to_ascii_uppercase())
                            .ok_or_else(|| OutputError(format!("member `{m}` is not an id")))
                    })
                    .collect()
            })
            .collect()
    })
}

/// An audit decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AuditDecision {
    /// Kept as written.
    Keep,
    /// Kept with the audit's rewrite.
    Rewrite,
    /// Removed.
    Drop,
    /// Removed: needs an expert.
    ManualReview,
}

/// The audit of one representative.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AuditItem {
    /// `R1`, `R2`, ...
    pub id: String,
    /// The category named by the auditor.
    pub category: String,
    /// The dimension named by the auditor.
    pub dimension: String,
    /// The decision.
    pub decision: AuditDecision,
    /// The new text when rewriting.
    pub rewrite: Option<String>,
}

/// An audit answer, or a refusal to engage with the clinical content.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AuditAnswer {
    /// One item per criterion (possibly fewer: missing ones are handled by the pipeline).
    Items(Vec<AuditItem>),
    /// The endpoint refused; the audit is asked again without the question and reference.
    Refused,
}

const REFUSAL_MARKERS: &[&str] = &[
    "i can't",
    "i cannot",
    "i can not",
    "i'm sorry",
    "i am sorry",
    "i'm unable",
    "i am unable",
    "not able to help",
    "can't assist",
    "cannot assist",
    "can't help",
    "cannot help",
    "unable to provide",
    "not able to provide",
];

/// True when output without JSON reads as a refusal.
pub fn is_refusal(text: &str) -> bool {
    let lower = text.to_lowercase();
    json_values(text).is_empty() && REFUSAL_MARKERS.iter().any(|m| lower.contains(m))
}

fn decision_of(s: &str) -> Option<AuditDecision> {
    match s
        .trim()
        .to_ascii_lowercase()
        .replace(['-', ' '], "_")
        .as_str()
    {
        "keep" => Some(AuditDecision::Keep),
        "rewrite" => Some(AuditDecision::Rewrite),
        "drop" => Some(AuditDecision::Drop),
        "manual_review" | "review" => Some(AuditDecision::ManualReview),
        _ => None,
    }
}

/// An audit answer: `{"audit": [{"id", "category", "dimension", "decision", "rewrite"}]}` or a
/// bare list; a refusal without JSON is [`AuditAnswer::Refused`].
pub fn parse_audit(text: &str) -> Result<AuditAnswer, OutputError> {
    if is_refusal(text) {
        return Ok(AuditAnswer::Refused);
    }
    last_matching(text, "{\"audit\": [...]}", |v| {
        let list = list_in(v, &["audit", "criteria", "items"])?;
        let items = list
            .iter()
            .enumerate()
            .map(|(i, it)| {
                let o = it.as_object().ok_or_else(|| format!("item {} is not an object", i + 1))?;
                let s = |names: &[&str]| field(o, names).and_then(Value::as_str).map(|s| s.trim().to_string());
                let decision = s(&["decision", "action"]).ok_or_else(|| format!("item {} has no `decision`", i + 1))?;
                let decision = decision_of(&decision)
                    .ok_or_else(|| format!("item {}: decision `{decision}` is not keep, rewrite, drop or manual_review", i + 1))?;
                Ok(AuditItem {
                    id: s(&["id"]).map(|x| x.to_ascii_uppercase()).unwrap_or_else(|| format!("R{}", i + 1)),
                    category: s(&["category"]).unwrap_or_default().to_ascii_lowercase(),
                    dimension: s(&["dimension"]).unwrap_or_default().to_ascii_lowercase(),
                    decision,
                    rewrite: s(&["rewrite", "rewritten", "new_text"]).filter(|t| !t.is_empty()),
                })
            })
            .collect::<Result<Vec<_>, OutputError>>()?;
        Ok(AuditAnswer::Items(items))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_answers_in_several_shapes() {
        let g = parse_generation(
            "Sure!\n```json\n{\"criteria\": [{\"text\": \"The response names X.\", \"coverage\": \"Yes\"}, {\"criterion\": \"The response gives Y.\", \"covered\": false}, {\"coverage\": \"yes\"}]}\n```",
        )
        .unwrap();
        assert_eq!(
            g[0],
            RawCandidate {
                text: Some("The response names X.".into()),
                coverage: Some("yes".into())
            }
        );
        assert_eq!(g[1].coverage.as_deref(), Some("no"));
        assert_eq!(g[2].text, None);
        assert_eq!(
            parse_generation("[\"The response a b c.\"]").unwrap()[0].coverage,
            None
        );
        assert!(parse_generation("I think the criteria are obvious.")
            .unwrap_err()
            .to_string()
            .contains("no JSON"));
        assert!(parse_generation("{\"criteria\": []}").is_err());
    }

    #[test]
    fn reviews_groupings_and_audits() {
        let r = parse_review("{\"verdict\": \"consistent\", \"score\": \"9\", \"problems\": []}")
            .unwrap();
        assert_eq!((r.verdict, r.score), (ReviewVerdict::Consistent, 9));
        assert_eq!(
            parse_review("{'verdict': 'Contradiction', 'score': 3}")
                .unwrap()
                .verdict,
            ReviewVerdict::Contradiction
        );
        assert!(parse_review("{\"verdict\": \"consistent\", \"score\": 11}")
            .unwrap_err()
            .to_string()
            .contains("0 to 10"));
        assert_eq!(
            parse_grouping("{\"groups\": [[\"a1\", \"B2 \"], {\"members\": [\"C3\"]}]}").unwrap(),
            vec![vec!["A1", "B2"], vec!["C3"]]
        );
        let a = parse_audit("{\"audit\": [{\"id\": \"R1\", \"category\": \"Safety_constraint\", \"dimension\": \"Safety\", \"decision\": \"Manual review\"}]}")
            .unwrap();
        assert_eq!(
            a,
            AuditAnswer::Items(vec![AuditItem {
                id: "R1".into(),
                category: "safety_constraint".into(),
                dimension: "safety".into(),
                decision: AuditDecision::ManualReview,
                rewrite: None
            }])
        );
        assert_eq!(
            parse_audit("I'm sorry, but I can't help with medical dosing questions.").unwrap(),
            AuditAnswer::Refused
        );
        assert!(
            parse_audit("{\"audit\": [{\"id\": \"R1\", \"decision\": \"maybe\"}]}")
                .unwrap_err()
                .to_string()
                .contains("maybe")
        );
    }
}
