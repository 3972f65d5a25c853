//! Import adapters for the public rubric formats of docs/METHOD.md §2.
//!
//! - `rar`: RaR rows `{question, reference_answer, rubric: [{title, description, weight}]}`
//!   (`rubric` may also be a JSON string, as in some exports; `question_source` becomes the stratum).
//! - `rubrichub`: verl-style rows `{data_source, prompt: [messages], reward_model: {rubrics:
//!   [{criterion, points}], ground_truth}}` (`reward_model` may be a JSON string).
//! - `healthbench`: `{prompt_id, prompt: [messages], rubrics: [{criterion, points, tags}],
//!   example_tags, ideal_completions_data}`.
//!
//! Input is JSONL, a JSON array or parquet (rows read as JSON objects, [`crate::parquet`]). Every
//! imported criterion is a content criterion (the method weighs all criteria equally; the original
//! weight or points are kept in its provenance); negative-weight items reward the absence of
//! something and are dropped unless asked for; the two global controls are appended. Prompts are
//! de-duplicated by their normalised text.

use std::collections::HashSet;
use std::path::Path;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

use crate::error::{Result, RubricError};
use crate::io::{parse_line, parse_value};
use crate::record::{
    global_controls, Criterion, CriterionProvenance, Message, RubricRecord, SourceProvenance,
};

/// A public rubric format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ImportFormat {
    /// Rubrics-as-Rewards (RaR-Medicine, RaR-Science).
    Rar,
    /// RubricHub / verl parquet-style rows.
    Rubrichub,
    /// OpenAI HealthBench.
    Healthbench,
}

impl ImportFormat {
    /// The format's name on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            ImportFormat::Rar => "rar",
            ImportFormat::Rubrichub => "rubrichub",
            ImportFormat::Healthbench => "healthbench",
        }
    }
}

impl std::str::FromStr for ImportFormat {
    type Err = RubricError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "rar" => Ok(Self::Rar),
            "rubrichub" | "verl" => Ok(Self::Rubrichub),
            "healthbench" => Ok(Self::Healthbench),
            other => Err(RubricError::Config {
                field: "format".into(),
                message: format!(
                    "`{other}` is not a known format (allowed: rar, rubrichub, healthbench)"
                ),
            }),
        }
    }
}

/// Import settings.
#[derive(Debug, Clone)]
pub struct ImportOptions {
    /// The input format.
    pub format: ImportFormat,
    /// Append the two global controls (default true).
    pub add_global_controls: bool,
    /// Keep negative-weight items (rewarding absence); dropped by default.
    pub keep_negative: bool,
    /// Keep at most this many content criteria per prompt, highest weight first (ties in source
    /// order), source order preserved. `None` keeps all (then `rubrics build` should consolidate).
    pub max_content: Option<usize>,
}

impl ImportOptions {
    /// Defaults for a format.
    pub fn new(format: ImportFormat) -> Self {
        Self {
            format,
            add_global_controls: true,
            keep_negative: false,
            max_content: None,
        }
    }
}

/// What an import did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ImportReport {
    /// Input rows read.
    pub rows: usize,
    /// Records written.
    pub records: usize,
    /// Rows skipped because their normalised prompt was already imported.
    pub duplicate_prompts: usize,
    /// Content criteria kept.
    pub criteria_kept: usize,
    /// Items with negative weight or points that were dropped.
    pub negative_dropped: usize,
    /// Empty items dropped.
    pub empty_dropped: usize,
    /// Items dropped by `max_content`.
    pub capped_dropped: usize,
    /// Records left with more than 10 content criteria.
    pub over_ten: usize,
    /// Rows skipped because no criterion survived.
    pub no_criteria: usize,
}

/// Parses a row whose `field` may hold its value as a JSON string (some exports store RaR's
/// `rubric` and verl's `reward_model` that way): the string is parsed and put in place first, so that
/// an error inside it names the whole path (`rubric[1].weight`), as it would for a plain list.
fn parse_row_with_json_string<T: DeserializeOwned>(
    text: &str,
    path: &Path,
    line: usize,
    field: &str,
) -> Result<T> {
    let mut v: Value = parse_line(text, path, line)?;
    if let Some(slot) = v.get_mut(field) {
        if let Value::String(inner) = slot {
            *slot = serde_json::from_str(inner).map_err(|e| RubricError::Parse {
                path: path.to_path_buf(),
                line,
                field: field.to_string(),
                message: format!("a string here must hold JSON: {e}"),
            })?;
        }
    }
    parse_value(v, path, line)
}

fn text_or_messages<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Message>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum P {
        Text(String),
        Messages(Vec<Message>),
    }
    Ok(match P::deserialize(d)? {
        P::Text(t) => vec![Message::user(t)],
        P::Messages(m) => m,
    })
}

#[derive(Deserialize)]
struct RarRow {
    #[serde(default)]
    id: Option<Value>,
    question: String,
    #[serde(default)]
    reference_answer: Option<String>,
    #[serde(default)]
    question_source: Option<String>,
    /// A list, or a JSON string holding one (see [`parse_row_with_json_string`]).
    rubric: Vec<RarItem>,
}

#[derive(Deserialize)]
struct RarItem {
    #[serde(default)]
    title: Option<String>,
    description: String,
    #[serde(default)]
    weight: Option<f64>,
}

#[derive(Deserialize)]
struct VerlRow {
    #[serde(default)]
    data_source: Option<String>,
    #[serde(deserialize_with = "text_or_messages")]
    prompt: Vec<Message>,
    /// An object, or a JSON string holding one (see [`parse_row_with_json_string`]).
    reward_model: VerlReward,
    #[serde(default)]
    extra_info: Option<Value>,
}

#[derive(Deserialize)]
struct VerlReward {
    rubrics: Vec<PointsItem>,
    #[serde(default)]
    ground_truth: Option<Value>,
}

#[derive(Deserialize)]
struct PointsItem {
    criterion: String,
    #[serde(default, alias = "weight")]
    points: Option<f64>,
    #[serde(default)]
    tags: Vec<String>,
}

/// One OpenAI HealthBench row: `{prompt_id, prompt: [messages], rubrics: [{criterion, points, tags}],
/// example_tags, ideal_completions_data}`. The one HealthBench reader of the workspace: `rubrics
/// import --format healthbench` turns rows into rubric records, `eval rubric` grades against their
/// points. Read a line with [`HealthBenchRow::parse`]; errors name the file, line and field
/// (`hb.jsonl:3: rubrics[1].points: invalid type: string "high", expected f64`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HealthBenchRow {
    /// The row's id.
    #[serde(default)]
    pub prompt_id: Option<String>,
    /// The conversation; a plain string is read as one user message.
    #[serde(deserialize_with = "text_or_messages")]
    pub prompt: Vec<Message>,
    /// The points-weighted rubric items (negative points describe behaviour to avoid).
    pub rubrics: Vec<HealthBenchItem>,
    /// Example tags such as `theme:emergency_referrals`.
    #[serde(default)]
    pub example_tags: Vec<String>,
    /// Physician-written completions; `ideal_completion` becomes an imported reference answer.
    #[serde(default)]
    pub ideal_completions_data: Option<Value>,
}

/// One HealthBench rubric item.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HealthBenchItem {
    /// The item text.
    pub criterion: String,
    /// Points: positive for desired behaviour, negative for behaviour to avoid.
    pub points: f64,
    /// Item tags (`axis:accuracy`, `level:example`, ...).
    #[serde(default)]
    pub tags: Vec<String>,
}

impl HealthBenchRow {
    /// Parses one JSONL line (`line` is 1-based, for the error message).
    pub fn parse(text: &str, path: &Path, line: usize) -> Result<Self> {
        parse_line(text, path, line)
    }

    /// The non-empty `ideal_completions_data.ideal_completion`, if any.
    pub fn ideal_completion(&self) -> Option<&str> {
        self.ideal_completions_data
            .as_ref()
            .and_then(|d| d.get("ideal_completion"))
            .and_then(Value::as_str)
            .filter(|s| !s.trim().is_empty())
    }
}

/// One source item before filtering.
struct Item {
    text: String,
    weight: Option<f64>,
    title: Option<String>,
    tags: Vec<String>,
}

/// `Essential Criteria: Identifies X` -> `Identifies X` (RaR descriptions repeat the category).
fn strip_category(text: &str) -> &str {
    let t = text.trim();
    match t.split_once(':') {
        Some((head, rest))
            if head.len() <= 40 && head.to_ascii_lowercase().ends_with("criteria") =>
        {
            rest.trim()
        }
        _ => t,
    }
}

/// Lower-cased, whitespace-collapsed text used to find duplicate prompts.
fn normalise(text: &str) -> String {
    text.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .to_lowercase()
}

/// The normalised form of a prompt under which duplicates are found: each message's role and its
/// lower-cased, whitespace-collapsed text.
pub fn prompt_key(question: &[Message]) -> String {
    question
        .iter()
        .map(|m| format!("{}:{}", m.role, normalise(&m.content)))
        .collect::<Vec<_>>()
        .join("\n")
}

/// 16 hex digits of FNV-1a: a stable id from the normalised prompt.
fn stable_id(prefix: &str, text: &str) -> String {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in text.as_bytes() {
        h ^= *b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    format!("{prefix}-{h:016x}")
}

fn value_to_id(v: &Value) -> Option<String> {
    match v {
        Value::String(s) if !s.is_empty() => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

fn read_rows(path: &Path) -> Result<Vec<(usize, String)>> {
    if crate::parquet::is_parquet(path) {
        let rows = crate::parquet::read_parquet_rows(path)?;
        return Ok(rows.into_iter().map(|(i, v)| (i, v.to_string())).collect());
    }
    let bytes = std::fs::read(path).map_err(|err| RubricError::Io {
        path: path.to_path_buf(),
        err,
    })?;
    let text = crate::io::utf8_text(&bytes, path, 1)?;
    if text.trim_start().starts_with('[') {
        let rows: Vec<Value> = serde_json::from_str(text).map_err(|e| RubricError::Parse {
            path: path.to_path_buf(),
            line: e.line(),
            field: format!("column {}", e.column()),
            message: e.to_string(),
        })?;
        return Ok(rows
            .into_iter()
            .enumerate()
            .map(|(i, v)| (i + 1, v.to_string()))
            .collect());
    }
    Ok(text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| (i + 1, l.to_string()))
        .collect())
}

/// Imports `input` into rubric records.
pub fn import_file(
    input: &Path,
    opts: &ImportOptions,
) -> Result<(Vec<RubricRecord>, ImportReport)> {
    let file_name = input
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let fmt = opts.format.as_str();
    let mut rep = ImportReport::default();
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for (line, row) in read_rows(input)? {
        rep.rows += 1;
        let (original_id, question, reference, source, items, extra) = match opts.format {
            ImportFormat::Rar => {
                let r: RarRow = parse_row_with_json_string(&row, input, line, "rubric")?;
                let items = r
                    .rubric
                    .into_iter()
                    .map(|i| Item {
                        text: strip_category(&i.description).to_string(),
                        weight: i.weight,
                        title: i.title,
                        tags: vec![],
                    })
                    .collect::<Vec<_>>();
                let source = Some(match r.question_source {
                    Some(s) if !s.is_empty() => format!("rar-{s}"),
                    _ => "rar".to_string(),
                });
                (
                    r.id.as_ref().and_then(value_to_id),
                    vec![Message::user(r.question)],
                    r.reference_answer,
                    source,
                    items,
                    None,
                )
            }
            ImportFormat::Rubrichub => {
                let r: VerlRow = parse_row_with_json_string(&row, input, line, "reward_model")?;
                let id = r
                    .extra_info
                    .as_ref()
                    .and_then(|e| e.get("index").or_else(|| e.get("id")))
                    .and_then(value_to_id);
                let reference = match r.reward_model.ground_truth {
                    Some(Value::String(s)) if !s.trim().is_empty() => Some(s),
                    _ => None,
                };
                let items = r
                    .reward_model
                    .rubrics
                    .into_iter()
                    .map(|i| Item {
                        text: i.criterion.trim().to_string(),
                        weight: i.points,
                        title: None,
                        tags: i.tags,
                    })
                    .collect();
                (
                    id,
                    r.prompt,
                    reference,
                    Some(r.data_source.unwrap_or_else(|| "rubrichub".into())),
                    items,
                    r.extra_info,
                )
            }
            ImportFormat::Healthbench => {
                let r = HealthBenchRow::parse(&row, input, line)?;
                let reference = r.ideal_completion().map(str::to_string);
                let theme = r
                    .example_tags
                    .iter()
                    .find_map(|t| t.strip_prefix("theme:"))
                    .map(|t| format!("healthbench-{t}"));
                let items = r
                    .rubrics
                    .into_iter()
                    .map(|i| Item {
                        text: i.criterion.trim().to_string(),
                        weight: Some(i.points),
                        title: None,
                        tags: i.tags,
                    })
                    .collect();
                let extra = (!r.example_tags.is_empty())
                    .then(|| serde_json::json!({ "example_tags": r.example_tags }));
                (
                    r.prompt_id,
                    r.prompt,
                    reference,
                    Some(theme.unwrap_or_else(|| "healthbench".into())),
                    items,
                    extra,
                )
            }
        };
        let key = prompt_key(&question);
        if !seen.insert(key.clone()) {
            rep.duplicate_prompts += 1;
            continue;
        }
        let mut kept: Vec<Item> = Vec::new();
        for it in items {
            if it.text.is_empty() {
                rep.empty_dropped += 1;
            } else if it.weight.is_some_and(|w| w < 0.0) && !opts.keep_negative {
                rep.negative_dropped += 1;
            } else {
                kept.push(it);
            }
        }
        if let Some(cap) = opts.max_content {
            if kept.len() > cap {
                let mut order: Vec<usize> = (0..kept.len()).collect();
                order.sort_by(|&a, &b| {
                    let (wa, wb) = (kept[a].weight.unwrap_or(0.0), kept[b].weight.unwrap_or(0.0));
                    wb.partial_cmp(&wa)
                        .unwrap_or(std::cmp::Ordering::Equal)
                        .then(a.cmp(&b))
                });
                let keep: HashSet<usize> = order.into_iter().take(cap).collect();
                rep.capped_dropped += kept.len() - cap;
                kept = kept
                    .into_iter()
                    .enumerate()
                    .filter(|(i, _)| keep.contains(i))
                    .map(|(_, it)| it)
                    .collect();
            }
        }
        if kept.is_empty() {
            rep.no_criteria += 1;
            continue;
        }
        rep.criteria_kept += kept.len();
        rep.over_ten += (kept.len() > 10) as usize;
        let mut criteria: Vec<Criterion> = kept
            .into_iter()
            .enumerate()
            .map(|(i, it)| Criterion {
                id: Some(format!("c{}", i + 1)),
                provenance: CriterionProvenance {
                    source_points: it.weight,
                    source_title: it.title,
                    source_tags: it.tags,
                    ..Default::default()
                },
                ..Criterion::content(it.text)
            })
            .collect();
        if opts.add_global_controls {
            criteria.extend(global_controls());
        }
        let id = original_id.clone().unwrap_or_else(|| stable_id(fmt, &key));
        out.push(RubricRecord {
            id,
            question,
            reference_answer: reference,
            ground_truth: None,
            source,
            criteria,
            provenance: Some(SourceProvenance {
                format: fmt.into(),
                file: file_name.clone(),
                line,
                original_id,
                extra,
            }),
        });
    }
    rep.records = out.len();
    Ok((out, rep))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn rar_rows_keep_provenance_and_drop_negatives() {
        let d = tempfile::tempdir().unwrap();
        let p = write(
            d.path(),
            "rar.jsonl",
            concat!(
                r#"{"question":"Q1?","reference_answer":"R1","question_source":"medqa","rubric":[{"title":"Essential Criteria: dx","description":"Essential Criteria: The response names X.","weight":5},{"title":"Pitfall","description":"Pitfall Criteria: Does not mention Y.","weight":-1}]}"#,
                "\n",
                r#"{"question":"  q1? ","rubric":"[{\"title\":\"t\",\"description\":\"The response Z.\",\"weight\":1}]"}"#,
                "\n",
                r#"{"question":"Q2?","rubric":"[{\"title\":\"t\",\"description\":\"The response Z.\",\"weight\":1}]"}"#,
                "\n"
            ),
        );
        let (recs, rep) = import_file(&p, &ImportOptions::new(ImportFormat::Rar)).unwrap();
        assert_eq!(
            (
                rep.rows,
                rep.records,
                rep.duplicate_prompts,
                rep.negative_dropped
            ),
            (3, 2, 1, 1)
        );
        let r = &recs[0];
        assert_eq!(r.criteria[0].text, "The response names X.");
        assert_eq!(r.criteria[0].provenance.source_points, Some(5.0));
        assert_eq!(r.criteria.len(), 3, "one content + two global controls");
        assert_eq!(r.source.as_deref(), Some("rar-medqa"));
        assert_eq!(r.reference_answer.as_deref(), Some("R1"));
        let prov = r.provenance.as_ref().unwrap();
        assert_eq!(
            (prov.format.as_str(), prov.file.as_str(), prov.line),
            ("rar", "rar.jsonl", 1)
        );
        assert!(r.id.starts_with("rar-") && r.id.len() == 20);
        assert_eq!(recs[1].provenance.as_ref().unwrap().line, 3);
    }

    #[test]
    fn verl_and_healthbench_rows() {
        let d = tempfile::tempdir().unwrap();
        let p = write(
            d.path(),
            "hub.jsonl",
            r#"{"data_source":"rubrichub_medical","prompt":[{"role":"user","content":"Q"}],"reward_model":"{\"rubrics\":[{\"criterion\":\"A\",\"points\":3},{\"criterion\":\"B\",\"points\":9},{\"criterion\":\"C\",\"points\":5}],\"ground_truth\":\"\"}","extra_info":{"index":17}}"#,
        );
        let mut opts = ImportOptions::new(ImportFormat::Rubrichub);
        opts.max_content = Some(2);
        let (recs, rep) = import_file(&p, &opts).unwrap();
        assert_eq!(rep.capped_dropped, 1);
        assert_eq!(recs[0].id, "17");
        let texts: Vec<&str> = recs[0].criteria.iter().map(|c| c.text.as_str()).collect();
        assert_eq!(
            &texts[..2],
            &["B", "C"],
            "highest points kept, source order preserved"
        );
        assert_eq!(recs[0].reference_answer, None);

        let p = write(
            d.path(),
            "hb.json",
            r#"[{"prompt_id":"hb1","prompt":[{"role":"user","content":"Q"}],"rubrics":[{"criterion":"Advises ER.","points":8,"tags":["axis:completeness"]},{"criterion":"Recommends opioids.","points":-6,"tags":[]}],"example_tags":["theme:emergency_referrals"],"ideal_completions_data":null}]"#,
        );
        let (recs, rep) = import_file(&p, &ImportOptions::new(ImportFormat::Healthbench)).unwrap();
        assert_eq!(rep.negative_dropped, 1);
        assert_eq!(recs[0].id, "hb1");
        assert_eq!(
            recs[0].source.as_deref(),
            Some("healthbench-emergency_referrals")
        );
        assert_eq!(
            recs[0].criteria[0].provenance.source_tags,
            vec!["axis:completeness".to_string()]
        );
    }

    #[test]
    fn errors_name_line_and_field() {
        let d = tempfile::tempdir().unwrap();
        let p = write(d.path(), "bad.jsonl", "{\"question\":\"q\",\"rubric\":[]}\n{\"question\":\"q2\",\"rubric\":[{\"title\":\"t\"}]}\n");
        let e = import_file(&p, &ImportOptions::new(ImportFormat::Rar))
            .unwrap_err()
            .to_string();
        assert!(
            e.ends_with("bad.jsonl:2: rubric[0]: missing field `description`"),
            "{e}"
        );
    }

    #[test]
    fn errors_inside_a_json_string_name_the_whole_path() {
        let d = tempfile::tempdir().unwrap();
        let good = r#"{"question":"q","rubric":[{"title":"t","description":"The response Z.","weight":1}]}"#;
        let rar = ImportOptions::new(ImportFormat::Rar);
        // `rubric` as a JSON string (as some exports write it) and as a plain list: the same message.
        let as_string = r#"{"question":"q2","rubric":"[{\"description\":\"The response A.\",\"weight\":1},{\"description\":\"The response B.\",\"weight\":\"high\"}]"}"#;
        let as_list = r#"{"question":"q2","rubric":[{"description":"The response A.","weight":1},{"description":"The response B.","weight":"high"}]}"#;
        for row in [as_string, as_list] {
            let p = write(d.path(), "file", &format!("{good}\n{row}\n"));
            let e = import_file(&p, &rar).unwrap_err().to_string();
            assert_eq!(
                e,
                format!(
                    "{}:2: rubric[1].weight: invalid type: string \"high\", expected f64",
                    p.display()
                )
            );
        }
        let p = write(
            d.path(),
            "file",
            &format!(
                "{good}\n{}\n",
                r#"{"question":"q2","rubric":"[{\"description\": }]"}"#
            ),
        );
        let e = import_file(&p, &rar).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!(
                "{}:2: rubric: a string here must hold JSON: expected value",
                p.display()
            )),
            "{e}"
        );
        // verl rows: `reward_model` as a JSON string.
        let p = write(
            d.path(),
            "hub.jsonl",
            r#"{"prompt":"Q","reward_model":"{\"rubrics\":[{\"criterion\":\"A\",\"points\":3},{\"criterion\":7}]}"}"#,
        );
        let e = import_file(&p, &ImportOptions::new(ImportFormat::Rubrichub))
            .unwrap_err()
            .to_string();
        assert_eq!(e, format!("{}:1: reward_model.rubrics[1].criterion: invalid type: integer `7`, expected a string", p.display()));
    }

    #[test]
    fn healthbench_rows_parse_in_one_place() {
        let d = tempfile::tempdir().unwrap();
        let p = write(
            d.path(),
            "hb.jsonl",
            r#"{"prompt_id":"hb1","prompt":"Q?","rubrics":[{"criterion":"A.","points":3},{"criterion":"B.","points":"high"}]}"#,
        );
        let e = import_file(&p, &ImportOptions::new(ImportFormat::Healthbench))
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            format!(
                "{}:1: rubrics[1].points: invalid type: string \"high\", expected f64",
                p.display()
            )
        );
        let row = HealthBenchRow::parse(
            r#"{"prompt":"Q?","rubrics":[{"criterion":"A.","points":3,"tags":["axis:accuracy"]}],"ideal_completions_data":{"ideal_completion":"R"}}"#,
            &p,
            1,
        )
        .unwrap();
        assert_eq!(row.prompt, vec![Message::user("Q?")]);
        assert_eq!(
            row.rubrics,
            vec![HealthBenchItem {
                criterion: "A.".into(),
                points: 3.0,
                tags: vec!["axis:accuracy".into()]
            }]
        );
        assert_eq!(row.ideal_completion(), Some("R"));
        let e = HealthBenchRow::parse(r#"{"prompt":"Q?","rubrics":[{"criterion":"A."}]}"#, &p, 4)
            .unwrap_err()
            .to_string();
        assert!(
            e.ends_with("hb.jsonl:4: rubrics[0]: missing field `points`"),
            "{e}"
        );
    }

    /// `data/samples/parquet/` holds the JSONL samples written by pyarrow
    /// (scripts/make-parquet-samples.py): each imports to the same records, but for the file name
    /// in the provenance.
    #[test]
    fn parquet_samples_import_as_their_jsonl() {
        let samples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/samples");
        for fmt in [
            ImportFormat::Rar,
            ImportFormat::Rubrichub,
            ImportFormat::Healthbench,
        ] {
            let name = fmt.as_str();
            let import = |file: &str| {
                let (recs, rep) =
                    import_file(&samples.join(file), &ImportOptions::new(fmt)).unwrap();
                let text = serde_json::to_string(&recs).unwrap();
                let base = file.rsplit('/').next().unwrap();
                (
                    text.replace(base, "FILE"),
                    serde_json::to_string(&rep).unwrap(),
                )
            };
            let jsonl = import(&format!("{name}.jsonl"));
            assert!(jsonl.0.contains("criteria"), "{name}: {}", jsonl.0);
            let parquet = import(&format!("parquet/{name}.parquet"));
            assert_eq!(jsonl, parquet, "{name}");
        }
    }
}
