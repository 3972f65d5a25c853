//! The output folder of a build. Every file is written atomically (temporary file, fsync,
//! rename), so an interrupted build leaves the previous complete artifacts or none.
//!
//! | file | contents | same bytes on a cached rerun |
//! |---|---|---|
//! | `rubrics.jsonl` | the consensus rubric records, ready for `conrub train` | yes |
//! | `raw.jsonl` | per prompt: every raw generator, review, grouping and audit output, attempts | yes |
//! | `clusters.jsonl` | per prompt: samples, checked candidates, clusters, support sets, tags, audit and finish decisions | yes |
//! | `validation.json` | the independent validator's report on `rubrics.jsonl` | yes |
//! | `stats.json`, `card.md` | statistics in the shape of a dataset card | yes |
//! | `manifest.json` | models, prompt versions, settings, seed, input hash, timings, call and cache counters, file hashes | no (timings) |

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use conrub_rubric::io::{write_bytes_atomic, AtomicFile};
use conrub_rubric::validate::PerPromptStats;
use conrub_rubric::{CriterionKind, RubricRecord, ValidationReport};
use serde::Serialize;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::counts::StageCounts;
use crate::error::{ConstructError, Result};
use crate::input::InputReport;
use crate::pipeline::PromptResult;

/// Per-stratum outcome counts.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct SourceOutcome {
    /// Unique prompts in the input.
    pub input: usize,
    /// Quota, if any.
    pub quota: Option<usize>,
    /// Prompts built.
    pub selected: usize,
    /// With a final rubric.
    pub kept: usize,
    /// Dropped by a filter.
    pub dropped: usize,
    /// Stopped by a failed call.
    pub failed: usize,
}

/// The statistics of a build (`stats.json`; `card.md` renders it).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct BuildStats {
    /// Input reading, dedup and quotas.
    pub input: InputReport,
    /// Per source stratum.
    pub by_source: BTreeMap<String, SourceOutcome>,
    /// Filter counts at every step.
    pub counts: StageCounts,
    /// Final records.
    pub records: usize,
    /// Content criteria in final records.
    pub content_criteria: usize,
    /// Global controls in final records.
    pub global_controls: usize,
    /// Criteria per prompt (content + global).
    pub criteria_per_prompt: PerPromptStats,
    /// Content criteria per prompt.
    pub content_per_prompt: PerPromptStats,
    /// Share of kept content criteria supported by all three generators.
    pub three_generator_support: f64,
    /// Kept content criteria per coverage tag.
    pub coverage_tags: BTreeMap<String, usize>,
    /// Kept content criteria per audit dimension.
    pub dimensions: BTreeMap<String, usize>,
    /// Audit categories of every audited representative.
    pub audit_categories: BTreeMap<String, usize>,
    /// Prompts not kept, by `status/stage`.
    pub not_kept: BTreeMap<String, usize>,
    /// Validator errors and warnings on the final file.
    pub validation_errors: usize,
    /// Validator warnings.
    pub validation_warnings: usize,
}

/// Statistics accumulated prompt by prompt, so a build never holds every result.
#[derive(Debug, Default)]
pub struct StatsAcc {
    st: BuildStats,
    contents: Vec<usize>,
    full_support: usize,
}

impl StatsAcc {
    /// Starts from the input report.
    pub fn new(input: &InputReport) -> Self {
        let mut st = BuildStats {
            input: input.clone(),
            ..Default::default()
        };
        for (name, c) in &input.by_source {
            st.by_source.insert(
                name.clone(),
                SourceOutcome {
                    input: c.read,
                    quota: c.quota,
                    selected: c.selected,
                    ..Default::default()
                },
            );
        }
        Self {
            st,
            ..Default::default()
        }
    }

    /// Adds one finished prompt.
    pub fn add(&mut self, r: &PromptResult) {
        let st = &mut self.st;
        st.counts.add(&r.counts);
        let src = st
            .by_source
            .entry(r.clusters.source.clone().unwrap_or_else(|| "(none)".into()))
            .or_default();
        match r.clusters.outcome.status {
            "kept" => src.kept += 1,
            "failed" => src.failed += 1,
            _ => src.dropped += 1,
        }
        if r.clusters.outcome.status != "kept" {
            *st.not_kept
                .entry(format!(
                    "{}/{}",
                    r.clusters.outcome.status, r.clusters.outcome.stage
                ))
                .or_default() += 1;
        }
        for c in &r.clusters.clusters {
            if let Some(a) = &c.audit {
                *st.audit_categories
                    .entry(if a.category.is_empty() {
                        "(none)".into()
                    } else {
                        a.category.clone()
                    })
                    .or_default() += 1;
                if c.outcome == "kept" {
                    *st.dimensions.entry(a.dimension.clone()).or_default() += 1;
                }
            }
        }
        if let Some(rec) = &r.record {
            let content: Vec<_> = rec
                .criteria
                .iter()
                .filter(|c| c.kind == CriterionKind::Content)
                .collect();
            self.full_support += content
                .iter()
                .filter(|c| c.provenance.generators.len() == 3)
                .count();
            self.contents.push(content.len());
        }
    }

    /// The statistics, with the validator's findings on the final file (which already counts
    /// records, criteria and criteria per prompt).
    pub fn finish(self, validation: &ValidationReport) -> BuildStats {
        let mut st = self.st;
        st.records = validation.records;
        st.content_criteria = validation.content_criteria;
        st.global_controls = validation.global_controls;
        st.criteria_per_prompt = validation.criteria_per_prompt.clone();
        st.content_per_prompt = PerPromptStats::of(self.contents);
        st.three_generator_support = if st.content_criteria > 0 {
            self.full_support as f64 / st.content_criteria as f64
        } else {
            0.0
        };
        st.coverage_tags = validation.coverage_tags.clone();
        st.validation_errors = validation.errors();
        st.validation_warnings = validation.warnings();
        st
    }
}

/// Streams `raw.jsonl` and `clusters.jsonl` prompt by prompt into temporary files that are renamed
/// into place only by [`StreamWriter::commit`]; hashes them on the way.
pub struct StreamWriter {
    raw: AtomicFile,
    clusters: AtomicFile,
    raw_hash: Sha256,
    clusters_hash: Sha256,
    line: Vec<u8>,
}

impl StreamWriter {
    /// Opens the temporary files in `dir`.
    pub fn create(dir: &Path) -> Result<Self> {
        Ok(Self {
            raw: AtomicFile::create(&dir.join("raw.jsonl"))?,
            clusters: AtomicFile::create(&dir.join("clusters.jsonl"))?,
            raw_hash: Sha256::new(),
            clusters_hash: Sha256::new(),
            line: Vec::new(),
        })
    }

    fn put<T: Serialize>(
        line: &mut Vec<u8>,
        out: &mut AtomicFile,
        hash: &mut Sha256,
        v: &T,
    ) -> Result<()> {
        line.clear();
        serde_json::to_writer(&mut *line, v).expect("serialisable");
        line.push(b'\n');
        hash.update(&line[..]);
        out.write_all(line)
            .map_err(|e| ConstructError::file(out.path(), e))
    }

    /// Appends one prompt's lines.
    pub fn push(&mut self, r: &PromptResult) -> Result<()> {
        Self::put(&mut self.line, &mut self.raw, &mut self.raw_hash, &r.raw)?;
        Self::put(
            &mut self.line,
            &mut self.clusters,
            &mut self.clusters_hash,
            &r.clusters,
        )
    }

    /// Syncs and renames both files; `(file name, sha256)` of each.
    pub fn commit(self) -> Result<Vec<(String, String)>> {
        self.raw.commit()?;
        self.clusters.commit()?;
        let hex = |h: Sha256| {
            h.finalize()
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        };
        Ok(vec![
            ("raw.jsonl".into(), hex(self.raw_hash)),
            ("clusters.jsonl".into(), hex(self.clusters_hash)),
        ])
    }
}

fn stats_line(s: &PerPromptStats) -> String {
    format!(
        "mean {:.2}, median {}, p90 {}, min {}, max {}",
        s.mean, s.median, s.p90, s.min, s.max
    )
}

/// The dataset card: sources, sizes, filter counts at every step, audit outcome and validation.
/// `models` are `(role, model)`; `versions` are `(prompt, version)`.
pub fn card(st: &BuildStats, models: &[(String, String)], versions: &[(&str, String)]) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# Consensus rubric dataset\n");
    let _ = writeln!(
        s,
        "{} prompts with rubrics ({} content criteria + {} global controls = {} criteria); criteria per prompt: {}; \
         content criteria per prompt: {}; {:.1}% of content criteria supported by all three generators.\n",
        st.records,
        st.content_criteria,
        st.global_controls,
        st.content_criteria + st.global_controls,
        stats_line(&st.criteria_per_prompt),
        stats_line(&st.content_per_prompt),
        100.0 * st.three_generator_support
    );
    let _ = writeln!(s, "## Models\n\n| role | model |\n|---|---|");
    for (r, m) in models {
        let _ = writeln!(s, "| {r} | `{m}` |");
    }
    let v: Vec<String> = versions.iter().map(|(k, v)| format!("{k} `{v}`")).collect();
    let _ = writeln!(s, "\nPrompt versions: {}.\n", v.join(", "));
    let _ = writeln!(s, "## Sources\n\n| source | unique prompts | quota | built | kept | dropped | failed |\n|---|---|---|---|---|---|---|");
    for (k, o) in &st.by_source {
        let q = o.quota.map_or("-".to_string(), |q| q.to_string());
        let _ = writeln!(
            s,
            "| {k} | {} | {q} | {} | {} | {} | {} |",
            o.input, o.selected, o.kept, o.dropped, o.failed
        );
    }
    let i = &st.input;
    let _ = writeln!(
        s,
        "\nInput rows {}, duplicate prompts removed {}, over quota {}, strata without a quota {}, over --limit {}.\n",
        i.rows, i.duplicate_prompts, i.over_quota, i.skipped_no_quota, i.over_limit
    );
    let _ = writeln!(
        s,
        "## Filter counts\n\n| step | counter | value |\n|---|---|---|"
    );
    for (k, v) in st.counts.pairs() {
        let step = match k {
            k if k.starts_with("prompts") => "prompts",
            "samples" | "samples_failed" | "candidates_proposed" => "1 generate",
            k if k.starts_with("candidates_") && k != "candidates_ungrouped"
                || k == "samples_under_specified" =>
            {
                "2 checks"
            }
            k if k.starts_with("review") || k.starts_with("samples_") => "3 review",
            k if k.starts_with("group") || k == "candidates_ungrouped" || k == "clusters" => {
                "4 grouping"
            }
            k if k.starts_with("clusters_") => "5 consensus",
            k if k.starts_with("audit") || k == "rewrites_invalid" || k == "negatives_dropped" => {
                "6 audit"
            }
            _ => "7 finish",
        };
        let _ = writeln!(s, "| {step} | {k} | {v} |");
    }
    let _ = writeln!(s, "\n## Not kept\n\n| status/step | prompts |\n|---|---|");
    for (k, v) in &st.not_kept {
        let _ = writeln!(s, "| {k} | {v} |");
    }
    let _ = writeln!(
        s,
        "\n## Kept criteria\n\n| dimension | criteria |\n|---|---|"
    );
    for (k, v) in &st.dimensions {
        let _ = writeln!(s, "| {k} | {v} |");
    }
    let tags: Vec<String> = st
        .coverage_tags
        .iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect();
    let cats: Vec<String> = st
        .audit_categories
        .iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect();
    let _ = writeln!(
        s,
        "\nReference-coverage tags: {}.\n\nAudit categories: {}.\n",
        tags.join(", "),
        cats.join(", ")
    );
    let _ = writeln!(
        s,
        "## Validation\n\n`conrub rubrics validate`: {} errors, {} warnings (report in `validation.json`).",
        st.validation_errors, st.validation_warnings
    );
    s
}

/// SHA-256 of bytes as hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Pretty JSON with a final newline.
fn pretty<T: Serialize + ?Sized>(v: &T) -> Vec<u8> {
    let mut out = serde_json::to_vec_pretty(v).expect("serialisable");
    out.push(b'\n');
    out
}

fn jsonl<T: Serialize>(items: impl Iterator<Item = T>) -> Vec<u8> {
    let mut buf = Vec::new();
    for it in items {
        serde_json::to_writer(&mut buf, &it).expect("serialisable");
        buf.push(b'\n');
    }
    buf
}

/// Writes the rest of the deterministic artifacts; returns `(file name, sha256)` of each.
pub fn write_outputs(
    dir: &Path,
    records: &[RubricRecord],
    validation: &ValidationReport,
    stats: &BuildStats,
    card_text: &str,
) -> Result<Vec<(String, String)>> {
    let files: Vec<(&str, Vec<u8>)> = vec![
        ("rubrics.jsonl", jsonl(records.iter())),
        ("validation.json", pretty(validation)),
        ("stats.json", pretty(stats)),
        ("card.md", card_text.as_bytes().to_vec()),
    ];
    let mut hashes = Vec::new();
    for (name, bytes) in files {
        write_bytes_atomic(&dir.join(name), &bytes)?;
        hashes.push((name.to_string(), sha256_hex(&bytes)));
    }
    Ok(hashes)
}

/// Writes `manifest.json` atomically.
pub fn write_manifest(dir: &Path, manifest: &Value) -> Result<PathBuf> {
    let path = dir.join("manifest.json");
    write_bytes_atomic(&path, &pretty(manifest))?;
    Ok(path)
}
