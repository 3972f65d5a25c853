//! Build input: prompts (id, question, optional reference answer, source stratum) from our prompt
//! JSONL, our rubric JSONL or any format `rubrics import` reads; duplicate prompts removed; source
//! quotas applied by a seeded, order-independent sample.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use conrub_rubric::import::{import_file, prompt_key, ImportFormat, ImportOptions};
use conrub_rubric::io::parse_line;
use conrub_rubric::{Message, RubricError, RubricRecord, SourceProvenance};
use serde::{Deserialize, Deserializer, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{ConstructError, Result};

/// One prompt to build a rubric for.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PromptInput {
    /// Unique prompt id.
    pub id: String,
    /// The prompt as chat messages.
    pub question: Vec<Message>,
    /// Optional reference answer (generators and the reviewer see it; judges never do).
    pub reference_answer: Option<String>,
    /// Source stratum, e.g. `rar-medicine`.
    pub source: Option<String>,
    /// Where the prompt was read.
    pub provenance: SourceProvenance,
}

impl PromptInput {
    /// The stratum name used by quotas and statistics (`(none)` when unset).
    pub fn stratum(&self) -> &str {
        self.source.as_deref().unwrap_or("(none)")
    }

    /// The question as plain text for a prompt.
    pub fn question_text(&self) -> String {
        conrub_rubric::record::messages_text(&self.question)
    }
}

/// Input file formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum InputFormat {
    /// Our prompt JSONL: `{id, question | messages, reference_answer?, source?}` per line.
    Prompts,
    /// Our rubric JSONL (criteria are ignored).
    Rubrics,
    /// A public format `rubrics import` reads (its criteria are ignored).
    Import(ImportFormat),
}

impl std::str::FromStr for InputFormat {
    type Err = ConstructError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "prompts" => Ok(Self::Prompts),
            "rubrics" => Ok(Self::Rubrics),
            other => other.parse().map(Self::Import).map_err(|_| {
                ConstructError::config(
                    "format",
                    format!("`{other}` is not a known input format (allowed: prompts, rubrics, rar, rubrichub, healthbench)"),
                )
            }),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PromptRow {
    id: IdValue,
    #[serde(
        default,
        alias = "messages",
        alias = "prompt",
        deserialize_with = "opt_messages"
    )]
    question: Option<Vec<Message>>,
    #[serde(default, alias = "reference")]
    reference_answer: Option<String>,
    #[serde(default, alias = "stratum")]
    source: Option<String>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum IdValue {
    Text(String),
    Number(u64),
}

fn opt_messages<'de, D: Deserializer<'de>>(
    d: D,
) -> std::result::Result<Option<Vec<Message>>, D::Error> {
    conrub_rubric::record::question_messages(d).map(Some)
}

/// Counts of one source stratum.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct StratumCount {
    /// Unique prompts read.
    pub read: usize,
    /// Its quota (`None`: no quota, all taken).
    pub quota: Option<usize>,
    /// Prompts selected for the build.
    pub selected: usize,
}

/// What reading the input did.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct InputReport {
    /// Rows read.
    pub rows: usize,
    /// Rows dropped because their normalised prompt came earlier.
    pub duplicate_prompts: usize,
    /// Per source stratum.
    pub by_source: BTreeMap<String, StratumCount>,
    /// Prompts of strata without a quota when quotas are given.
    pub skipped_no_quota: usize,
    /// Prompts left out because their stratum was over its quota.
    pub over_quota: usize,
    /// Prompts left out by `--limit`.
    pub over_limit: usize,
    /// Prompts selected.
    pub selected: usize,
}

fn from_record(r: RubricRecord) -> PromptInput {
    PromptInput {
        provenance: r.provenance.clone().unwrap_or(SourceProvenance {
            format: "conrub".into(),
            file: String::new(),
            line: 0,
            original_id: None,
            extra: None,
        }),
        id: r.id,
        question: r.question,
        reference_answer: r.reference_answer.filter(|s| !s.trim().is_empty()),
        source: r.source,
    }
}

fn read_all(path: &Path, format: InputFormat) -> Result<(Vec<(usize, PromptInput)>, usize)> {
    let file = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    match format {
        InputFormat::Prompts => {
            let text = std::fs::read_to_string(path).map_err(|e| ConstructError::file(path, e))?;
            let mut out = Vec::new();
            for (i, line) in text
                .lines()
                .enumerate()
                .filter(|(_, l)| !l.trim().is_empty())
            {
                let row: PromptRow = parse_line(line, path, i + 1)?;
                let id = match row.id {
                    IdValue::Text(s) => s,
                    IdValue::Number(n) => n.to_string(),
                };
                let invalid = |message: &str| RubricError::Invalid {
                    path: path.into(),
                    line: i + 1,
                    message: message.into(),
                };
                let question = row.question.ok_or_else(|| {
                    invalid("question: missing (also read as `messages` or `prompt`)")
                })?;
                if id.trim().is_empty() {
                    return Err(invalid("id: empty").into());
                }
                if question.iter().all(|m| m.content.trim().is_empty()) {
                    return Err(invalid("question: empty").into());
                }
                let provenance = SourceProvenance {
                    format: "prompts".into(),
                    file: file.clone(),
                    line: i + 1,
                    original_id: Some(id.clone()),
                    extra: None,
                };
                let reference_answer = row.reference_answer.filter(|s| !s.trim().is_empty());
                out.push((
                    i + 1,
                    PromptInput {
                        id,
                        question,
                        reference_answer,
                        source: row.source,
                        provenance,
                    },
                ));
            }
            let n = out.len();
            Ok((out, n))
        }
        InputFormat::Rubrics => {
            let rows: Vec<(usize, RubricRecord)> = conrub_rubric::read_jsonl(path)?;
            let n = rows.len();
            Ok((
                rows.into_iter().map(|(l, r)| (l, from_record(r))).collect(),
                n,
            ))
        }
        InputFormat::Import(f) => {
            let opts = ImportOptions {
                format: f,
                add_global_controls: false,
                keep_negative: true,
                max_content: None,
            };
            let (records, rep) = import_file(path, &opts)?;
            let rows = records
                .into_iter()
                .map(|r| (r.provenance.as_ref().map_or(0, |p| p.line), from_record(r)))
                .collect();
            Ok((rows, rep.rows))
        }
    }
}

/// A stable rank of a prompt id under a seed (the quota sample keeps the smallest ranks).
fn rank(seed: u64, id: &str) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(seed.to_le_bytes());
    h.update(id.as_bytes());
    h.finalize().into()
}

/// Reads prompts, removes duplicates (normalised text; a repeated id is an error), applies the
/// source quotas (a seeded sample per stratum, input order kept) and then `limit`.
pub fn read_prompts(
    path: &Path,
    format: InputFormat,
    quotas: &BTreeMap<String, usize>,
    seed: u64,
    limit: Option<usize>,
) -> Result<(Vec<PromptInput>, InputReport)> {
    let (rows, n_rows) = read_all(path, format)?;
    let mut rep = InputReport {
        rows: n_rows,
        ..Default::default()
    };
    let mut ids: HashMap<String, usize> = HashMap::new();
    let mut seen = HashSet::new();
    let mut unique = Vec::new();
    for (line, p) in rows {
        if let Some(first) = ids.insert(p.id.clone(), line) {
            return Err(RubricError::Invalid {
                path: path.into(),
                line,
                message: format!("id `{}` repeats line {first}", p.id),
            }
            .into());
        }
        if !seen.insert(prompt_key(&p.question)) {
            rep.duplicate_prompts += 1;
            continue;
        }
        rep.by_source
            .entry(p.stratum().to_string())
            .or_default()
            .read += 1;
        unique.push(p);
    }
    // Per stratum, the ids with the `quota` smallest ranks are taken.
    let mut chosen: HashSet<String> = HashSet::new();
    for (stratum, count) in rep.by_source.iter_mut() {
        let members: Vec<&PromptInput> = unique.iter().filter(|p| p.stratum() == stratum).collect();
        let take = if quotas.is_empty() {
            members.len()
        } else {
            quotas.get(stratum).copied().unwrap_or(0).min(members.len())
        };
        count.quota = quotas.get(stratum).copied();
        let mut ranked: Vec<([u8; 32], &str)> = members
            .iter()
            .map(|p| (rank(seed, &p.id), p.id.as_str()))
            .collect();
        ranked.sort();
        chosen.extend(ranked.into_iter().take(take).map(|(_, id)| id.to_string()));
        if !quotas.is_empty() && !quotas.contains_key(stratum) {
            rep.skipped_no_quota += members.len();
        } else {
            rep.over_quota += members.len() - take;
        }
    }
    let mut selected: Vec<PromptInput> = unique
        .into_iter()
        .filter(|p| chosen.contains(&p.id))
        .collect();
    if let Some(n) = limit {
        rep.over_limit = selected.len().saturating_sub(n);
        selected.truncate(n);
    }
    for p in &selected {
        rep.by_source
            .get_mut(p.stratum())
            .expect("counted above")
            .selected += 1;
    }
    rep.selected = selected.len();
    Ok((selected, rep))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(lines: &[&str]) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), lines.join("\n")).unwrap();
        f
    }

    #[test]
    fn dedups_applies_quotas_and_names_bad_lines() {
        let f = write(&[
            r#"{"id":"a","question":"Q one","source":"x"}"#,
            r#"{"id":"b","question":"  q   ONE ","source":"x"}"#,
            r#"{"id":"c","messages":[{"role":"user","content":"Q two"}],"reference_answer":"R","source":"x"}"#,
            r#"{"id":"d","question":"Q three","source":"x"}"#,
            r#"{"id":7,"question":"Q four","source":"y"}"#,
            r#"{"id":"e","question":"Q five"}"#,
        ]);
        let (all, rep) =
            read_prompts(f.path(), InputFormat::Prompts, &BTreeMap::new(), 1, None).unwrap();
        assert_eq!(
            all.iter().map(|p| p.id.as_str()).collect::<Vec<_>>(),
            ["a", "c", "d", "7", "e"]
        );
        assert_eq!((rep.rows, rep.duplicate_prompts, rep.selected), (6, 1, 5));
        assert_eq!(all[1].reference_answer.as_deref(), Some("R"));
        assert_eq!(all[0].provenance.line, 1);

        let quotas: BTreeMap<String, usize> = [("x".to_string(), 2), ("y".to_string(), 5)].into();
        let (sel, rep) = read_prompts(f.path(), InputFormat::Prompts, &quotas, 1, None).unwrap();
        assert_eq!(sel.iter().filter(|p| p.stratum() == "x").count(), 2);
        assert_eq!(
            (
                rep.over_quota,
                rep.skipped_no_quota,
                rep.by_source["y"].selected
            ),
            (1, 1, 1)
        );
        // The sample depends on the seed and the ids only: the same under another file order.
        let g = write(&[
            r#"{"id":"d","question":"Q three","source":"x"}"#,
            r#"{"id":"c","question":"Q two","source":"x"}"#,
            r#"{"id":"a","question":"Q one","source":"x"}"#,
        ]);
        let (sel2, _) = read_prompts(g.path(), InputFormat::Prompts, &quotas, 1, None).unwrap();
        let mut ids1: Vec<_> = sel
            .iter()
            .filter(|p| p.stratum() == "x")
            .map(|p| p.id.clone())
            .collect();
        let mut ids2: Vec<_> = sel2.iter().map(|p| p.id.clone()).collect();
        ids1.sort();
        ids2.sort();
        assert_eq!(ids1, ids2);

        let bad = write(&[
            r#"{"id":"a","question":"Q"}"#,
            r#"{"id":"b","qestion":"Q"}"#,
        ]);
        let e = read_prompts(bad.path(), InputFormat::Prompts, &BTreeMap::new(), 1, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains(":2:") && e.contains("qestion"), "{e}");
        let rep_id = write(&[
            r#"{"id":"a","question":"Q"}"#,
            r#"{"id":"a","question":"R"}"#,
        ]);
        let e = read_prompts(
            rep_id.path(),
            InputFormat::Prompts,
            &BTreeMap::new(),
            1,
            None,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains(":2:") && e.contains("repeats line 1"), "{e}");
    }
}
