//! Robust parsing of judge output: JSON wrapped in prose, code fences or `<think>` blocks, Python-style
//! quotes and trailing commas; strict about the number of labels and their values.

use conrub_rubric::{Label, ScoringMode};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A pairwise preference, in the order the candidates were shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Preference {
    /// The first candidate shown (A).
    #[serde(rename = "A")]
    A,
    /// The second candidate shown (B).
    #[serde(rename = "B")]
    B,
    /// Neither is clearly better.
    #[serde(rename = "same")]
    Same,
}

impl Preference {
    fn parse(v: &Value) -> Option<Self> {
        let s = v
            .as_str()?
            .trim()
            .trim_matches(|c: char| c == '"' || c == '\'' || c == '.' || c == '*');
        match s.to_ascii_lowercase().as_str() {
            "a" | "response a" => Some(Self::A),
            "b" | "response b" => Some(Self::B),
            "same" | "tie" | "equal" | "neither" | "both" => Some(Self::Same),
            _ => None,
        }
    }
}

/// A parsed pairwise answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PairAnswer {
    /// The overall verdict.
    pub verdict: Preference,
    /// Per-criterion comparisons (empty when the judge gave none).
    pub criteria: Vec<Preference>,
    /// Self-reported confidence in [0, 1], if given.
    pub confidence: Option<f64>,
    /// Short reason, if given.
    pub reason: Option<String>,
}

/// Removes `<think>...</think>` blocks (an unterminated one removes the rest).
pub fn strip_thinking(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("<think>") {
        out.push_str(&rest[..i]);
        match rest[i..].find("</think>") {
            Some(j) => rest = &rest[i + j + "</think>".len()..],
            None => {
                rest = "";
                break;
            }
        }
    }
    out.push_str(rest);
    out
}

/// Every balanced `[...]` or `{...}` span (string-aware), in order of their start.
fn json_spans(text: &str) -> Vec<&str> {
    let bytes = text.as_bytes();
    let mut spans = Vec::new();
    let mut start = 0;
    while start < bytes.len() {
        if bytes[start] == b'[' || bytes[start] == b'{' {
            let mut depth = 0i32;
            let mut in_str: Option<u8> = None;
            let mut escaped = false;
            let mut end = None;
            for (k, &c) in bytes[start..].iter().enumerate() {
                if let Some(q) = in_str {
                    if escaped {
                        escaped = false;
                    } else if c == b'\\' {
                        escaped = true;
                    } else if c == q {
                        in_str = None;
                    }
                    continue;
                }
                match c {
                    b'"' | b'\'' if depth > 0 => in_str = Some(c),
                    b'[' | b'{' => depth += 1,
                    b']' | b'}' => {
                        depth -= 1;
                        if depth == 0 {
                            end = Some(start + k + 1);
                            break;
                        }
                    }
                    _ => {}
                }
            }
            if let Some(e) = end {
                spans.push(&text[start..e]);
            }
        }
        start += 1;
    }
    spans
}

/// Parses a JSON span, then a repaired version (single quotes, trailing commas, Python literals).
fn parse_lenient(span: &str) -> Option<Value> {
    if let Ok(v) = serde_json::from_str(span) {
        return Some(v);
    }
    let mut s = span.to_string();
    if !s.contains('"') {
        s = s.replace('\'', "\"");
    }
    s = s
        .replace("True", "true")
        .replace("False", "false")
        .replace("None", "null");
    // Trailing commas before a closing bracket.
    let mut repaired = String::with_capacity(s.len());
    let chars: Vec<char> = s.chars().collect();
    for (i, &c) in chars.iter().enumerate() {
        if c == ',' {
            let next = chars[i + 1..].iter().find(|c| !c.is_whitespace());
            if matches!(next, Some(']') | Some('}')) {
                continue;
            }
        }
        repaired.push(c);
    }
    serde_json::from_str(&repaired).ok()
}

/// Candidate JSON values in model output, after removing `<think>` blocks: fenced blocks first,
/// then every top-level balanced span, both in order; single quotes, trailing commas and Python
/// literals are repaired.
pub fn json_values(text: &str) -> Vec<Value> {
    let text = strip_thinking(text);
    let mut out = Vec::new();
    let mut rest = text.as_str();
    while let Some(i) = rest.find("```") {
        let after = &rest[i + 3..];
        let body_start = after.find('\n').map(|n| n + 1).unwrap_or(0);
        match after[body_start..].find("```") {
            Some(j) => {
                let body = &after[body_start..body_start + j];
                out.extend(json_spans(body).into_iter().filter_map(parse_lenient));
                rest = &after[body_start + j + 3..];
            }
            None => break,
        }
    }
    // Only top-level spans: skip spans nested inside an earlier accepted one.
    let mut covered_until = 0usize;
    let base = text.as_ptr() as usize;
    for span in json_spans(&text) {
        let at = span.as_ptr() as usize - base;
        if at < covered_until {
            continue;
        }
        if let Some(v) = parse_lenient(span) {
            covered_until = at + span.len();
            out.push(v);
        }
    }
    out
}

/// Why a model's output was not understood (the caller keeps the raw text; after the retry budget
/// the response ends unscored with this message).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct OutputError(pub String);

impl From<String> for OutputError {
    fn from(s: String) -> Self {
        Self(s)
    }
}

impl From<&str> for OutputError {
    fn from(s: &str) -> Self {
        Self(s.to_string())
    }
}

fn label_of(v: &Value, mode: ScoringMode) -> Result<Label, OutputError> {
    let as_text = match v {
        Value::String(s) => s.clone(),
        Value::Bool(b) if mode == ScoringMode::Binary => (if *b { "yes" } else { "no" }).into(),
        Value::Object(o) => {
            let field = [
                "label", "verdict", "grade", "answer", "result", "score", "status",
            ]
            .iter()
            .find_map(|k| o.get(*k))
            .ok_or("an object item has no label field")?;
            return label_of(field, mode);
        }
        other => return Err(format!("`{other}` is not a label").into()),
    };
    Label::parse(&as_text, mode).ok_or_else(|| {
        let allowed: Vec<&str> = mode.labels().iter().map(|l| l.as_str()).collect();
        OutputError(format!(
            "`{}` is not one of {}",
            as_text.trim(),
            allowed.join(", ")
        ))
    })
}

fn labels_from_value(v: &Value, n: usize, mode: ScoringMode) -> Result<Vec<Label>, OutputError> {
    let items: Vec<&Value> = match v {
        Value::Array(a) => a.iter().collect(),
        Value::Object(o) => {
            if let Some(inner) = [
                "labels", "grades", "verdicts", "results", "criteria", "answers",
            ]
            .iter()
            .find_map(|k| o.get(*k))
            {
                return labels_from_value(inner, n, mode);
            }
            // {"1": "correct", "2": "missing", ...}
            let mut keyed: Vec<(usize, &Value)> = Vec::new();
            for (k, val) in o {
                let idx: usize = k
                    .trim()
                    .parse()
                    .map_err(|_| OutputError(format!("unexpected key `{k}`")))?;
                keyed.push((idx, val));
            }
            keyed.sort_by_key(|(i, _)| *i);
            if keyed.iter().enumerate().any(|(pos, (i, _))| *i != pos + 1) {
                return Err("numbered keys are not 1..n".into());
            }
            keyed.into_iter().map(|(_, v)| v).collect()
        }
        _ => return Err("not an array or object".into()),
    };
    if items.len() != n {
        return Err(format!("expected {n} labels, got {}", items.len()).into());
    }
    items
        .iter()
        .enumerate()
        .map(|(i, v)| label_of(v, mode).map_err(|e| OutputError(format!("item {}: {e}", i + 1))))
        .collect()
}

/// Parses exactly `n` labels of `mode`. When several JSON values are present, the last valid one
/// wins (models sometimes echo the example first); the error describes the last failure.
pub fn parse_labels(text: &str, n: usize, mode: ScoringMode) -> Result<Vec<Label>, OutputError> {
    let mut last_err = OutputError::from("no JSON array or object found");
    let mut found = None;
    for v in json_values(text) {
        match labels_from_value(&v, n, mode) {
            Ok(l) => found = Some(l),
            Err(e) => last_err = e,
        }
    }
    found.ok_or(last_err)
}

fn pair_from_value(v: &Value, n: usize) -> Result<PairAnswer, OutputError> {
    let o = v.as_object().ok_or("not a JSON object")?;
    let verdict_v = ["verdict", "winner", "preference", "better"]
        .iter()
        .find_map(|k| o.get(*k))
        .ok_or("no `verdict` field")?;
    let verdict = Preference::parse(verdict_v)
        .ok_or_else(|| OutputError(format!("verdict `{verdict_v}` is not A, B or same")))?;
    let criteria = match o.get("criteria").or_else(|| o.get("per_criterion")) {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => {
            if a.len() != n {
                return Err(
                    format!("expected {n} per-criterion comparisons, got {}", a.len()).into(),
                );
            }
            a.iter()
                .enumerate()
                .map(|(i, x)| {
                    let x = x
                        .as_object()
                        .and_then(|m| m.get("better").or_else(|| m.get("winner")))
                        .unwrap_or(x);
                    Preference::parse(x).ok_or_else(|| {
                        OutputError(format!(
                            "criteria item {}: `{x}` is not A, B or same",
                            i + 1
                        ))
                    })
                })
                .collect::<Result<_, _>>()?
        }
        Some(other) => return Err(format!("`criteria` is not an array: {other}").into()),
    };
    let confidence = match o.get("confidence") {
        Some(Value::Number(x)) => x.as_f64().filter(|c| (0.0..=1.0).contains(c)),
        Some(Value::String(s)) => s
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|c| (0.0..=1.0).contains(c)),
        _ => None,
    };
    let reason = o.get("reason").and_then(Value::as_str).map(str::to_string);
    Ok(PairAnswer {
        verdict,
        criteria,
        confidence,
        reason,
    })
}

/// Parses a pairwise answer over `n` criteria (the last valid JSON object wins).
pub fn parse_pair(text: &str, n: usize) -> Result<PairAnswer, OutputError> {
    let mut last_err = OutputError::from("no JSON object found");
    let mut found = None;
    for v in json_values(text) {
        match pair_from_value(&v, n) {
            Ok(p) => found = Some(p),
            Err(e) => last_err = e,
        }
    }
    // A bare one-word answer is a valid verdict without comparisons.
    if found.is_none() {
        let t = strip_thinking(text);
        if let Some(p) = Preference::parse(&Value::String(t.trim().to_string())) {
            return Ok(PairAnswer {
                verdict: p,
                criteria: Vec::new(),
                confidence: None,
                reason: None,
            });
        }
    }
    found.ok_or(last_err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use Label::*;
    use ScoringMode::*;

    #[test]
    fn ugly_real_world_outputs_parse() {
        let cases: &[(&str, usize, ScoringMode, Vec<Label>)] = &[
            (r#"["correct","missing","wrong"]"#, 3, ThreeState, vec![Correct, Missing, Wrong]),
            ("Sure! Here are the grades:\n```json\n[\n  \"Correct\",\n  \"MISSING\",\n  \"wrong\"\n]\n```\nLet me know.", 3, ThreeState, vec![Correct, Missing, Wrong]),
            ("<think>\nCriterion 1 says [x]...\n</think>\n\n[\"yes\", \"no\"]", 2, Binary, vec![Yes, No]),
            ("['yes', 'no', 'yes',]", 3, Binary, vec![Yes, No, Yes]),
            (r#"{"labels": ["correct", "correct"]}"#, 2, ThreeState, vec![Correct, Correct]),
            (r#"[{"criterion": 1, "label": "wrong"}, {"criterion": 2, "label": "missing"}]"#, 2, ThreeState, vec![Wrong, Missing]),
            (r#"{"1": "yes", "2": "no"}"#, 2, Binary, vec![Yes, No]),
            (r#"[true, false]"#, 2, Binary, vec![Yes, No]),
            // The model echoes the example, then answers: the last valid array wins.
            (r#"Format: ["correct", "missing", "wrong"]. Answer: ["wrong", "wrong", "correct"]"#, 3, ThreeState, vec![Wrong, Wrong, Correct]),
            ("```\n[\"correct.\", \"**missing**\"]\n```", 2, ThreeState, vec![Correct, Missing]),
        ];
        for (text, n, mode, want) in cases {
            assert_eq!(
                &parse_labels(text, *n, *mode).unwrap_or_else(|e| panic!("{text}: {e}")),
                want,
                "{text}"
            );
        }
    }

    #[test]
    fn wrong_lengths_unknown_labels_and_garbage_are_rejected() {
        let e = parse_labels(r#"["correct","missing"]"#, 3, ThreeState)
            .unwrap_err()
            .0;
        assert!(e.contains("expected 3 labels, got 2"), "{e}");
        let e = parse_labels(r#"["correct","partially correct"]"#, 2, ThreeState)
            .unwrap_err()
            .0;
        assert!(
            e.contains("item 2") && e.contains("partially correct"),
            "{e}"
        );
        assert!(
            parse_labels(r#"["yes","no"]"#, 2, ThreeState).is_err(),
            "binary labels in three-state mode"
        );
        assert!(parse_labels("I cannot grade this response.", 2, Binary)
            .unwrap_err()
            .to_string()
            .contains("no JSON"));
        assert!(
            parse_labels("[\"yes\", \"no\"", 2, Binary).is_err(),
            "truncated output"
        );
        assert!(
            parse_labels("<think>[\"yes\", \"no\"]", 2, Binary).is_err(),
            "only inside an unfinished think block"
        );
        assert!(parse_labels(r#"{"1":"yes","3":"no"}"#, 2, Binary).is_err());
    }

    #[test]
    fn pairwise_answers() {
        let p = parse_pair(
            "Comparison done.\n```json\n{\"criteria\": [\"A\", \"same\"], \"verdict\": \"A\", \"confidence\": 0.7, \"reason\": \"A names the dose.\"}\n```",
            2,
        )
        .unwrap();
        assert_eq!(p.verdict, Preference::A);
        assert_eq!(p.criteria, vec![Preference::A, Preference::Same]);
        assert_eq!(p.confidence, Some(0.7));
        assert_eq!(
            parse_pair(r#"{"verdict": "Response B"}"#, 3)
                .unwrap()
                .verdict,
            Preference::B
        );
        assert_eq!(parse_pair("same", 3).unwrap().verdict, Preference::Same);
        assert!(parse_pair(r#"{"verdict": "C"}"#, 1).is_err());
        assert!(parse_pair(r#"{"criteria": ["A"], "verdict": "A"}"#, 2)
            .unwrap_err()
            .to_string()
            .contains("expected 2"));
        assert!(parse_pair("Both have merits.", 2).is_err());
    }
}
