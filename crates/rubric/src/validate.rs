//! The independent rubric validator behind `conrub rubrics validate`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;

use serde::Serialize;

use crate::record::{CriterionKind, RubricRecord};

/// Most content criteria a record may have.
pub const MAX_CONTENT: usize = 10;
/// Global controls every record must have.
pub const GLOBAL_CONTROLS: usize = 2;

/// How bad an issue is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    /// The record is not fit for training.
    Error,
    /// Suspicious but allowed.
    Warning,
}

/// One finding, located by line, record id and field.
#[derive(Debug, Clone, Serialize)]
pub struct ValidationIssue {
    /// Error or warning.
    pub severity: Severity,
    /// 1-based line of the record.
    pub line: usize,
    /// The record's id.
    pub id: String,
    /// The field, e.g. `criteria[3].text`.
    pub field: String,
    /// What is wrong.
    pub message: String,
}

/// Summary statistics of the criteria per prompt.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PerPromptStats {
    /// Mean.
    pub mean: f64,
    /// Median.
    pub median: f64,
    /// 90th percentile (nearest rank).
    pub p90: usize,
    /// Minimum.
    pub min: usize,
    /// Maximum.
    pub max: usize,
}

impl PerPromptStats {
    /// Mean, median, p90 (nearest rank), min and max of `counts` (all zero when empty).
    pub fn of(mut counts: Vec<usize>) -> Self {
        if counts.is_empty() {
            return Self::default();
        }
        counts.sort_unstable();
        let n = counts.len();
        let median = if n % 2 == 1 {
            counts[n / 2] as f64
        } else {
            (counts[n / 2 - 1] + counts[n / 2]) as f64 / 2.0
        };
        let p90 = counts[((0.9 * n as f64).ceil() as usize).clamp(1, n) - 1];
        Self {
            mean: counts.iter().sum::<usize>() as f64 / n as f64,
            median,
            p90,
            min: counts[0],
            max: counts[n - 1],
        }
    }
}

/// What the validator found.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ValidationReport {
    /// Records read.
    pub records: usize,
    /// Content criteria in all records.
    pub content_criteria: usize,
    /// Global controls in all records.
    pub global_controls: usize,
    /// Criteria per prompt (content + global).
    pub criteria_per_prompt: PerPromptStats,
    /// Records per source stratum (`(none)` when unset).
    pub by_source: BTreeMap<String, usize>,
    /// Content criteria per reference-coverage tag (`yes`, `no`, `null`).
    pub coverage_tags: BTreeMap<String, usize>,
    /// Records with a reference answer.
    pub with_reference: usize,
    /// Everything found, in file order.
    pub issues: Vec<ValidationIssue>,
}

impl ValidationReport {
    /// Number of errors.
    pub fn errors(&self) -> usize {
        self.issues
            .iter()
            .filter(|i| i.severity == Severity::Error)
            .count()
    }

    /// Number of warnings.
    pub fn warnings(&self) -> usize {
        self.issues.len() - self.errors()
    }

    /// True when there is no error.
    pub fn is_ok(&self) -> bool {
        self.errors() == 0
    }
}

impl fmt::Display for ValidationReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for i in &self.issues {
            let sev = match i.severity {
                Severity::Error => "error",
                Severity::Warning => "warning",
            };
            writeln!(
                f,
                "{sev}: line {} (id {}): {}: {}",
                i.line, i.id, i.field, i.message
            )?;
        }
        let s = &self.criteria_per_prompt;
        writeln!(
            f,
            "{} records, {} criteria ({} content + {} global controls); per prompt mean {:.2}, median {}, p90 {}, min {}, max {}",
            self.records,
            self.content_criteria + self.global_controls,
            self.content_criteria,
            self.global_controls,
            s.mean,
            s.median,
            s.p90,
            s.min,
            s.max
        )?;
        let sources: Vec<String> = self
            .by_source
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        let tags: Vec<String> = self
            .coverage_tags
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        writeln!(f, "sources: {}", sources.join(", "))?;
        writeln!(
            f,
            "content coverage tags: {}; records with a reference answer: {}",
            tags.join(", "),
            self.with_reference
        )?;
        write!(f, "{} errors, {} warnings", self.errors(), self.warnings())
    }
}

/// Phrases that make a criterion reward silence ("does not mention X"): a problematic negative.
const NEGATIVE_OPENINGS: &[&str] = &[
    "does not",
    "doesn't",
    "do not",
    "never ",
    "avoids",
    "refrains",
    "omits",
    "fails to",
    "should not",
    "must not",
    "is not ",
    "makes no",
    "contains no",
    "excludes",
];

/// True when a criterion rewards silence ("does not mention X"): a problematic negative.
pub fn is_problematic_negative(text: &str) -> bool {
    let lower = text.trim().to_ascii_lowercase();
    let rest = lower
        .strip_prefix("the response")
        .map(str::trim_start)
        .unwrap_or(&lower);
    NEGATIVE_OPENINGS.iter().any(|n| rest.starts_with(n))
}

/// Checks records read as `(line, record)`.
pub fn validate_records(records: &[(usize, RubricRecord)]) -> ValidationReport {
    let mut rep = ValidationReport {
        records: records.len(),
        ..Default::default()
    };
    let mut ids: HashMap<&str, usize> = HashMap::new();
    let mut counts = Vec::with_capacity(records.len());
    for (line, r) in records {
        let mut issue = |severity, field: String, message: String| {
            rep.issues.push(ValidationIssue {
                severity,
                line: *line,
                id: r.id.clone(),
                field,
                message,
            })
        };
        if r.id.trim().is_empty() {
            issue(Severity::Error, "id".into(), "empty id".into());
        } else if let Some(prev) = ids.insert(&r.id, *line) {
            issue(
                Severity::Error,
                "id".into(),
                format!("duplicate id (first on line {prev})"),
            );
        }
        if r.question.is_empty() || r.question.iter().all(|m| m.content.trim().is_empty()) {
            issue(Severity::Error, "question".into(), "empty question".into());
        }
        for (i, m) in r.question.iter().enumerate() {
            if !matches!(m.role.as_str(), "system" | "user" | "assistant") {
                issue(
                    Severity::Error,
                    format!("question[{i}].role"),
                    format!("`{}` is not system, user or assistant", m.role),
                );
            }
        }
        let content = r.content_count();
        let global = r.global_count();
        if content == 0 || content > MAX_CONTENT {
            issue(
                Severity::Error,
                "criteria".into(),
                format!("{content} content criteria (need 1-{MAX_CONTENT})"),
            );
        }
        if global != GLOBAL_CONTROLS {
            issue(
                Severity::Error,
                "criteria".into(),
                format!("{global} global controls (need exactly {GLOBAL_CONTROLS})"),
            );
        } else if r.criteria[..content]
            .iter()
            .any(|c| c.kind != CriterionKind::Content)
        {
            issue(
                Severity::Warning,
                "criteria".into(),
                "global controls are not last".into(),
            );
        }
        let mut texts: HashMap<String, usize> = HashMap::new();
        let mut crit_ids: HashSet<&str> = HashSet::new();
        for (i, c) in r.criteria.iter().enumerate() {
            let field = |f: &str| format!("criteria[{i}].{f}");
            let text = c.text.trim();
            if text.is_empty() {
                issue(Severity::Error, field("text"), "empty criterion".into());
                continue;
            }
            if let Some(id) = &c.id {
                if !crit_ids.insert(id) {
                    issue(
                        Severity::Error,
                        field("id"),
                        format!("duplicate criterion id `{id}`"),
                    );
                }
            }
            if let Some(prev) = texts.insert(text.to_lowercase(), i) {
                issue(
                    Severity::Error,
                    field("text"),
                    format!("duplicate of criteria[{prev}]"),
                );
            }
            if is_problematic_negative(text) {
                issue(
                    Severity::Error,
                    field("text"),
                    "rewards absence (a problematic negative); state a positive requirement".into(),
                );
            } else if !text.starts_with("The response") {
                issue(
                    Severity::Warning,
                    field("text"),
                    "does not start with \"The response\"".into(),
                );
            }
            match (c.kind, c.reference_coverage, r.reference_answer.is_some()) {
                (CriterionKind::GlobalControl, Some(_), _) => issue(
                    Severity::Error,
                    field("reference_coverage"),
                    "must be null for a global control".into(),
                ),
                (CriterionKind::Content, Some(_), false) => issue(
                    Severity::Error,
                    field("reference_coverage"),
                    "tag given but the record has no reference answer".into(),
                ),
                (CriterionKind::Content, None, true) => issue(
                    Severity::Warning,
                    field("reference_coverage"),
                    "no tag although a reference answer exists".into(),
                ),
                _ => {}
            }
            if c.kind == CriterionKind::Content {
                let tag = match c.reference_coverage {
                    Some(crate::record::Coverage::Yes) => "yes",
                    Some(crate::record::Coverage::No) => "no",
                    None => "null",
                };
                *rep.coverage_tags.entry(tag.into()).or_default() += 1;
            }
        }
        rep.content_criteria += content;
        rep.global_controls += global;
        rep.with_reference += r.reference_answer.is_some() as usize;
        *rep.by_source
            .entry(r.source.clone().unwrap_or_else(|| "(none)".into()))
            .or_default() += 1;
        counts.push(r.criteria.len());
    }
    rep.criteria_per_prompt = PerPromptStats::of(counts);
    rep
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{global_controls, Coverage, Criterion, Message};

    fn record(id: &str, n: usize) -> RubricRecord {
        let mut criteria: Vec<Criterion> = (0..n)
            .map(|i| Criterion::content(format!("The response names point {i}.")))
            .collect();
        criteria.extend(global_controls());
        RubricRecord {
            id: id.into(),
            question: vec![Message::user("q?")],
            reference_answer: None,
            ground_truth: None,
            source: Some("s".into()),
            criteria,
            provenance: None,
        }
    }

    #[test]
    fn a_good_file_passes_with_counts() {
        let recs = vec![
            (1, record("a", 10)),
            (2, record("b", 4)),
            (3, record("c", 6)),
        ];
        let rep = validate_records(&recs);
        assert!(rep.is_ok(), "{rep}");
        assert_eq!((rep.content_criteria, rep.global_controls), (20, 6));
        assert_eq!(rep.criteria_per_prompt.max, 12);
        assert_eq!(rep.criteria_per_prompt.median, 8.0);
        assert_eq!(rep.coverage_tags["null"], 20);
    }

    #[test]
    fn each_rule_reports_its_field() {
        let mut bad = record("a", 11);
        bad.criteria[0].text = "  ".into();
        bad.criteria[1].text = "The response does not mention aspirin.".into();
        bad.criteria[2].text = "The response names point 3.".into();
        bad.criteria[4].reference_coverage = Some(Coverage::Yes);
        let n = bad.criteria.len();
        bad.criteria[n - 1].reference_coverage = Some(Coverage::No);
        let mut no_globals = record("a", 3);
        no_globals.criteria.truncate(4);
        no_globals.criteria[0].text = "Mentions dose.".into();
        let rep = validate_records(&[(1, bad), (2, no_globals)]);
        let find = |line: usize, field: &str, msg: &str| {
            rep.issues
                .iter()
                .any(|i| i.line == line && i.field == field && i.message.contains(msg))
        };
        assert!(find(1, "criteria", "11 content criteria"), "{rep}");
        assert!(find(1, "criteria[0].text", "empty criterion"), "{rep}");
        assert!(find(1, "criteria[1].text", "problematic negative"), "{rep}");
        assert!(
            find(1, "criteria[3].text", "duplicate of criteria[2]"),
            "{rep}"
        );
        assert!(
            find(1, "criteria[4].reference_coverage", "no reference answer"),
            "{rep}"
        );
        assert!(
            find(
                1,
                &format!("criteria[{}].reference_coverage", n - 1),
                "global control"
            ),
            "{rep}"
        );
        assert!(find(2, "id", "duplicate id (first on line 1)"), "{rep}");
        assert!(find(2, "criteria", "1 global controls"), "{rep}");
        assert!(rep.issues.iter().any(|i| i.line == 2
            && i.severity == Severity::Warning
            && i.field == "criteria[0].text"));
        // Stating a safety fact is a valid positive criterion.
        assert!(!is_problematic_negative(
            "The response states that ibuprofen is contraindicated in late pregnancy."
        ));
    }
}
