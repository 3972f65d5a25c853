//! Criterion-level labelled examples for distilling a probe: read from a labels file or from the
//! verdicts stored in judge caches, and split into training and held-out sets by prompt.

use std::collections::{BTreeMap, BTreeSet};
use std::io::BufRead;
use std::path::{Path, PathBuf};

use conrub_rubric::{Label, ScoringMode};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::cache::{hex, CacheKey, JudgeCache};
use crate::error::{JudgeError, Result};

/// One criterion of one response with the label a judge gave it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LabelledExample {
    /// The prompt the response answers; the held-out split never separates one prompt's rows.
    pub prompt_id: String,
    /// The question text.
    pub prompt: String,
    /// The criterion text.
    pub criterion: String,
    /// The response text.
    pub response: String,
    /// The label.
    pub label: Label,
}

impl LabelledExample {
    /// The feature-store key of this row: what the features depend on besides the model.
    pub fn feature_key(&self, mode: ScoringMode) -> CacheKey {
        CacheKey::of(&[
            "probe-features",
            mode.as_str(),
            &self.prompt,
            &self.response,
            self.criterion.trim(),
        ])
    }
}

/// Reads a label as a labels file writes it: `correct | missing | wrong` (three-state) or
/// `met | unmet` (binary; `yes | no` too), ignoring case and surrounding space. Unlike
/// [`Label::parse`] it needs no label set (the label says which) and strips no quotes or periods.
pub fn parse_label(s: &str) -> Option<Label> {
    match s.trim().to_ascii_lowercase().as_str() {
        "met" => Some(Label::Yes),
        "unmet" => Some(Label::No),
        t => [ScoringMode::ThreeState, ScoringMode::Binary]
            .into_iter()
            .flat_map(ScoringMode::labels)
            .copied()
            .find(|l| l.as_str() == t),
    }
}

/// The label set a label belongs to.
pub fn mode_of(label: Label) -> ScoringMode {
    match label {
        Label::Yes | Label::No => ScoringMode::Binary,
        _ => ScoringMode::ThreeState,
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LabelLine {
    prompt_id: String,
    prompt: String,
    criterion: String,
    response: String,
    label: String,
}

/// Reads a labels file (JSONL of `{prompt_id, prompt, criterion, response, label}`); errors name
/// the file and line. Every label must come from one label set.
pub fn read_labels(path: &Path) -> Result<(ScoringMode, Vec<LabelledExample>)> {
    let file = std::fs::File::open(path).map_err(|e| JudgeError::File {
        path: path.into(),
        source: e,
    })?;
    let bad = |line: usize, message: String| {
        JudgeError::Probe(format!("{}:{line}: {message}", path.display()))
    };
    let mut out = Vec::new();
    let mut mode: Option<(ScoringMode, usize)> = None;
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let n = i + 1;
        let line = line.map_err(|e| JudgeError::File {
            path: path.into(),
            source: e,
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let row: LabelLine = serde_json::from_str(&line).map_err(|e| bad(n, e.to_string()))?;
        let label = parse_label(&row.label).ok_or_else(|| {
            bad(
                n,
                format!(
                    "label: `{}` is not one of correct, missing, wrong, met, unmet",
                    row.label
                ),
            )
        })?;
        let m = mode_of(label);
        match mode {
            None => mode = Some((m, n)),
            Some((first, at)) if first != m => {
                return Err(bad(
                    n,
                    format!(
                        "label: `{}` is {} but line {at} is {} (one label set per file)",
                        row.label,
                        m.as_str(),
                        first.as_str()
                    ),
                ))
            }
            _ => {}
        }
        out.push(LabelledExample {
            prompt_id: row.prompt_id,
            prompt: row.prompt,
            criterion: row.criterion,
            response: row.response,
            label,
        });
    }
    let (mode, _) = mode.ok_or_else(|| bad(0, "no labelled rows".into()))?;
    Ok((mode, out))
}

/// What was read from judge caches.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CacheHarvest {
    /// The caches read.
    pub caches: Vec<PathBuf>,
    /// Criterion verdicts per judge id found in them.
    pub verdicts_by_judge: BTreeMap<String, u64>,
    /// Verdicts stored without their request (written before conrub kept requests).
    pub without_request: u64,
    /// Verdicts used (of the chosen judge and label set).
    pub used_verdicts: u64,
}

/// A stable prompt id for a question text.
pub fn prompt_id_of(question: &str) -> String {
    let digest = Sha256::digest(question.as_bytes());
    hex(&digest[..8])
}

/// Reads the criterion verdicts in `caches` as labelled rows (one per criterion). With several
/// judges in the caches, `judge` names the one to learn from (its id as `conrub score` reports
/// it); with verdicts of both label sets, `mode` picks one. The same (prompt, response,
/// criterion) twice keeps the last verdict read.
pub fn examples_from_caches(
    caches: &[PathBuf],
    judge: Option<&str>,
    mode: Option<ScoringMode>,
) -> Result<(ScoringMode, Vec<LabelledExample>, CacheHarvest)> {
    let mut harvest = CacheHarvest {
        caches: caches.to_vec(),
        ..Default::default()
    };
    let mut all = Vec::new();
    for path in caches {
        if !path.exists() {
            return Err(JudgeError::Probe(format!(
                "{}: no such judge cache",
                path.display()
            )));
        }
        let (verdicts, bare) = JudgeCache::open(path)?.criterion_verdicts()?;
        harvest.without_request += bare;
        for (id, request, labels) in verdicts {
            *harvest.verdicts_by_judge.entry(id.clone()).or_default() += 1;
            all.push((id, request, labels));
        }
    }
    let judges: BTreeSet<&String> = harvest.verdicts_by_judge.keys().collect();
    let chosen = match judge {
        Some(j) if judges.contains(&j.to_string()) => j.to_string(),
        Some(j) => {
            return Err(JudgeError::Probe(format!(
                "no verdicts of judge `{j}` in the caches (they hold: {})",
                list(&harvest.verdicts_by_judge)
            )))
        }
        None if judges.len() == 1 => judges.into_iter().next().expect("one").clone(),
        None if judges.is_empty() => {
            let why = if harvest.without_request > 0 {
                format!(
                    "; {} verdicts were stored without their request by an older conrub: \
                     score again, or distill from a labels file",
                    harvest.without_request
                )
            } else {
                String::new()
            };
            return Err(JudgeError::Probe(format!(
                "the caches hold no criterion verdicts{why}"
            )));
        }
        None => {
            return Err(JudgeError::Probe(format!(
                "the caches hold verdicts of several judges ({}): name one with --judge-id",
                list(&harvest.verdicts_by_judge)
            )))
        }
    };
    let modes: BTreeSet<&str> = all
        .iter()
        .filter(|(id, ..)| *id == chosen)
        .map(|(_, r, _)| r.mode.as_str())
        .collect();
    let mode = match mode {
        Some(m) => m,
        None if modes.len() == 1 => all
            .iter()
            .find(|(id, ..)| *id == chosen)
            .map(|(_, r, _)| r.mode)
            .expect("one mode"),
        None => {
            return Err(JudgeError::Probe(
                "the caches hold binary and three-state verdicts: pick one with --mode".into(),
            ))
        }
    };
    let mut rows: BTreeMap<CacheKey, LabelledExample> = BTreeMap::new();
    for (id, request, labels) in all {
        if id != chosen || request.mode != mode || labels.len() != request.criteria.len() {
            continue;
        }
        harvest.used_verdicts += 1;
        let prompt_id = prompt_id_of(&request.question);
        for (criterion, label) in request.criteria.iter().zip(labels) {
            let ex = LabelledExample {
                prompt_id: prompt_id.clone(),
                prompt: request.question.clone(),
                criterion: criterion.clone(),
                response: request.response.clone(),
                label,
            };
            rows.insert(ex.feature_key(mode), ex);
        }
    }
    Ok((mode, rows.into_values().collect(), harvest))
}

fn list(counts: &BTreeMap<String, u64>) -> String {
    counts
        .iter()
        .map(|(k, v)| format!("{k}: {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Splits row indices into (training, held-out) by prompt: the prompts are ordered by a seeded
/// hash of their id and the first `⌈fraction · prompts⌉` are held out (at least one, and at least
/// one left to train on when there are two or more). Rows of one prompt never straddle the
/// split, so the held-out score is not inflated by near-duplicate rows of a training prompt.
pub fn split_by_prompt(
    examples: &[LabelledExample],
    fraction: f64,
    seed: u64,
) -> (Vec<usize>, Vec<usize>) {
    let prompts: BTreeSet<&str> = examples.iter().map(|e| e.prompt_id.as_str()).collect();
    let mut order: Vec<(Vec<u8>, &str)> = prompts
        .into_iter()
        .map(|p| {
            let mut h = Sha256::new();
            h.update(seed.to_le_bytes());
            h.update(p.as_bytes());
            (h.finalize().to_vec(), p)
        })
        .collect();
    order.sort();
    let n = order.len();
    let mut k = ((fraction * n as f64).ceil() as usize).max(1);
    if n >= 2 {
        k = k.min(n - 1);
    }
    let held: BTreeSet<&str> = order.iter().take(k).map(|(_, p)| *p).collect();
    let (mut train, mut heldout) = (Vec::new(), Vec::new());
    for (i, e) in examples.iter().enumerate() {
        if held.contains(e.prompt_id.as_str()) {
            heldout.push(i);
        } else {
            train.push(i);
        }
    }
    (train, heldout)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ex(prompt: &str, i: usize) -> LabelledExample {
        LabelledExample {
            prompt_id: prompt.into(),
            prompt: format!("q {prompt}"),
            criterion: format!("c{i}"),
            response: "r".into(),
            label: Label::Correct,
        }
    }

    #[test]
    fn the_split_never_separates_a_prompt() {
        let rows: Vec<_> = (0..40).map(|i| ex(&format!("p{}", i % 10), i)).collect();
        let (train, held) = split_by_prompt(&rows, 0.2, 7);
        assert_eq!(train.len() + held.len(), 40);
        let ids = |ix: &[usize]| -> BTreeSet<String> {
            ix.iter().map(|&i| rows[i].prompt_id.clone()).collect()
        };
        assert_eq!(ids(&held).len(), 2);
        assert!(ids(&held).is_disjoint(&ids(&train)));
        // Seeded, and independent of row order.
        let mut rev = rows.clone();
        rev.reverse();
        let (_, held2) = split_by_prompt(&rev, 0.2, 7);
        assert_eq!(
            ids(&held),
            held2.iter().map(|&i| rev[i].prompt_id.clone()).collect()
        );
        assert_ne!(ids(&held), ids(&split_by_prompt(&rows, 0.2, 8).1));
    }

    #[test]
    fn labels_files_name_the_line() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("l.jsonl");
        let line = |label: &str| {
            format!(
                "{{\"prompt_id\":\"a\",\"prompt\":\"q\",\"criterion\":\"c\",\"response\":\"r\",\"label\":\"{label}\"}}\n"
            )
        };
        std::fs::write(&p, line("correct") + &line("wrong")).unwrap();
        let (mode, rows) = read_labels(&p).unwrap();
        assert_eq!((mode, rows.len()), (ScoringMode::ThreeState, 2));
        std::fs::write(&p, line("met") + &line("unmet")).unwrap();
        assert_eq!(read_labels(&p).unwrap().0, ScoringMode::Binary);
        std::fs::write(&p, line("correct") + &line("maybe")).unwrap();
        let e = read_labels(&p).unwrap_err().to_string();
        assert!(e.contains("l.jsonl:2: label: `maybe`"), "{e}");
        std::fs::write(&p, line("correct") + &line("met")).unwrap();
        let e = read_labels(&p).unwrap_err().to_string();
        assert!(e.contains(":2: label: `met` is binary but line 1"), "{e}");
        std::fs::write(&p, "{\"prompt_id\":\"a\"}\n").unwrap();
        let e = read_labels(&p).unwrap_err().to_string();
        assert!(e.contains("l.jsonl:1: missing field"), "{e}");
    }
}
