//! Rubric evaluation examples: HealthBench rows or our rubric records, read from one JSONL file
//! (the two formats may be mixed line by line). `conrub eval rubric` and validation during
//! training (`[eval]` of a run config) read their data here.

use std::path::Path;

use conrub_rubric::import::{HealthBenchItem, HealthBenchRow};
use conrub_rubric::record::CriterionKind;
use conrub_rubric::{Message, RubricError, RubricRecord};

/// One evaluation example from either input format.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalExample {
    /// The row's id, when it has one.
    pub id: Option<String>,
    /// The conversation the policy answers.
    pub prompt: Vec<Message>,
    /// HealthBench's `example_tags` (our records: from their provenance).
    pub example_tags: Vec<String>,
    /// Points-weighted items graded met / not met (HealthBench style).
    pub items: Vec<HealthBenchItem>,
    /// Criteria graded correct / missing / wrong (content criteria plus the two global controls).
    pub criteria: Vec<String>,
}

impl EvalExample {
    /// A HealthBench row: every item is graded for points; the positive items plus our global
    /// controls form the three-state rubric (negative items describe behaviour to avoid, which
    /// our criteria never reward, docs/METHOD.md §2).
    pub fn from_healthbench(row: HealthBenchRow) -> Self {
        let mut criteria: Vec<String> = row
            .rubrics
            .iter()
            .filter(|i| i.points > 0.0)
            .map(|i| i.criterion.clone())
            .collect();
        criteria.extend(
            conrub_rubric::record::global_controls()
                .into_iter()
                .map(|c| c.text),
        );
        Self {
            id: row.prompt_id,
            prompt: row.prompt,
            example_tags: row.example_tags,
            items: row.rubrics,
            criteria,
        }
    }

    /// One of our rubric records: content criteria are the points items (their imported points,
    /// else 1 each); all criteria, the global controls included, form the three-state rubric.
    pub fn from_record(r: RubricRecord) -> Self {
        let items = r
            .criteria
            .iter()
            .filter(|c| c.kind == CriterionKind::Content)
            .map(|c| HealthBenchItem {
                criterion: c.text.clone(),
                points: c.provenance.source_points.unwrap_or(1.0),
                tags: c.provenance.source_tags.clone(),
            })
            .collect();
        let example_tags = r
            .provenance
            .as_ref()
            .and_then(|p| p.extra.as_ref())
            .and_then(|e| e.get("example_tags"))
            .and_then(|t| serde_json::from_value(t.clone()).ok())
            .unwrap_or_default();
        Self {
            criteria: r.criterion_texts(),
            id: Some(r.id),
            prompt: r.question,
            example_tags,
            items,
        }
    }
}

/// Reads HealthBench rows (with `rubrics`) or our rubric records (with `criteria`), line by line;
/// errors name the file and line (and the field, for a malformed row).
pub fn read_eval_examples(path: &Path) -> Result<Vec<EvalExample>, RubricError> {
    let text = std::fs::read_to_string(path).map_err(|err| RubricError::Io {
        path: path.to_path_buf(),
        err,
    })?;
    let invalid = |line: usize, message: &str| RubricError::Invalid {
        path: path.to_path_buf(),
        line,
        message: message.to_string(),
    };
    let mut out = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|_| invalid(i + 1, "not a JSON object"))?;
        if v.get("rubrics").is_some() {
            out.push(EvalExample::from_healthbench(HealthBenchRow::parse(
                line,
                path,
                i + 1,
            )?));
        } else if v.get("criteria").is_some() {
            out.push(EvalExample::from_record(conrub_rubric::io::parse_line(
                line,
                path,
                i + 1,
            )?));
        } else {
            return Err(invalid(
                i + 1,
                "neither a HealthBench row (`rubrics`) nor a rubric record (`criteria`)",
            ));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// HealthBench rows are read by conrub-rubric's reader (the one `rubrics import` uses): a
    /// plain-string prompt is one user message, and errors name the field.
    #[test]
    fn healthbench_rows_are_read_by_the_rubric_crate() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("hb.jsonl");
        let good = r#"{"prompt_id":"a","prompt":"Is it safe?","rubrics":[{"criterion":"Says yes.","points":5},{"criterion":"Is rude.","points":-2}],"example_tags":["theme:t"]}"#;
        std::fs::write(&p, format!("{good}\n")).unwrap();
        let rows = read_eval_examples(&p).unwrap();
        assert_eq!(rows[0].prompt, vec![Message::user("Is it safe?")]);
        assert_eq!(rows[0].items.len(), 2, "every item is graded for points");
        assert_eq!(
            rows[0].criteria.len(),
            1 + 2,
            "positive items plus the two global controls"
        );
        let bad = r#"{"prompt":[{"role":"user","content":"q"}],"rubrics":[{"criterion":"A.","points":1},{"criterion":"B.","points":"high"}]}"#;
        std::fs::write(&p, format!("{good}\n{bad}\n")).unwrap();
        let e = read_eval_examples(&p).err().unwrap().to_string();
        assert_eq!(
            e,
            format!(
                "{}:2: rubrics[1].points: invalid type: string \"high\", expected f64",
                p.display()
            )
        );
        std::fs::write(&p, "{\"question\": 1}\n").unwrap();
        let e = read_eval_examples(&p).err().unwrap().to_string();
        assert!(
            e.ends_with(
                ":1: neither a HealthBench row (`rubrics`) nor a rubric record (`criteria`)"
            ),
            "{e}"
        );
    }
}
