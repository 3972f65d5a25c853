//! `conrub eval`: benchmarks on our generation engine.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use burn::tensor::backend::Backend;
use clap::{Args, Subcommand};
use conrub_eval::{extract_choice, load_items, McqFormat, McqSummary};
use conrub_qwen3::{ChatMessage, ChatOptions, Qwen3, SamplingConfig};
use conrub_rubric::io::{write_bytes_atomic, write_jsonl_atomic};
use serde_json::json;

use crate::backend::{run_on_device, BackendTask};

/// `conrub eval ...`.
#[derive(Subcommand)]
pub enum EvalCommand {
    /// Multiple-choice accuracy (MedMCQA, PubMedQA, MMLU) under greedy decoding.
    Mcq(McqArgs),
    /// Two reports side by side (e.g. base vs trained): every numeric summary field, with B - A.
    Compare(CompareArgs),
    /// HealthBench-style rubric grading (points met over positive points, clipped mean, bootstrap).
    Rubric(RubricArgs),
}

/// Arguments of `eval rubric`.
#[derive(Args, Clone)]
pub struct RubricArgs {
    /// HealthBench-format JSONL (`prompt` messages, `rubrics[{criterion, points, tags}]`, `example_tags`).
    #[arg(long)]
    pub data: PathBuf,
    /// Model directory (a training checkpoint works as is) or hub id.
    #[arg(long)]
    pub model: String,
    /// Grader config (the judge TOML of `conrub score`): each rubric item is graded met / not met.
    #[arg(long)]
    pub grader: PathBuf,
    /// Responses sampled per example (1 = greedy).
    #[arg(long, default_value_t = 1)]
    pub samples: usize,
    /// Seed for sampling and the bootstrap.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Longest response in tokens.
    #[arg(long, default_value_t = 1024)]
    pub max_new_tokens: usize,
    /// Evaluate only the first N examples.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Output directory.
    #[arg(long, default_value = "runs/eval-rubric")]
    pub out: PathBuf,
    /// Device.
    #[arg(long, default_value = "cpu")]
    pub device: String,
}

#[derive(serde::Deserialize)]
struct HbItem {
    criterion: String,
    points: f64,
    #[serde(default)]
    tags: Vec<String>,
}

#[derive(serde::Deserialize)]
struct HbRow {
    #[serde(default)]
    prompt_id: Option<String>,
    prompt: Vec<conrub_rubric::Message>,
    rubrics: Vec<HbItem>,
    #[serde(default)]
    example_tags: Vec<String>,
}

impl BackendTask for RubricArgs {
    fn run<B: Backend>(self, device: B::Device) -> Result<()> {
        use conrub_eval::{summarize, GradedItem};
        use conrub_judge::{CriterionRequest, JudgeKind};
        use conrub_rubric::{Label, ScoringMode};
        let text = std::fs::read_to_string(&self.data).with_context(|| format!("cannot read {}", self.data.display()))?;
        let mut rows: Vec<(usize, HbRow)> = Vec::new();
        for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            rows.push((i + 1, conrub_rubric::io::parse_line(line, &self.data, i + 1)?));
        }
        if let Some(n) = self.limit {
            rows.truncate(n);
        }
        if rows.is_empty() {
            bail!("{}: no examples", self.data.display());
        }
        let qwen = Qwen3::<B>::load(&self.model, &device)?;
        let tok = qwen.tokenizer.as_ref().with_context(|| format!("{}: no tokenizer.json", qwen.dir.display()))?;
        let greedy = self.samples <= 1;
        let cfg = SamplingConfig { max_new_tokens: self.max_new_tokens, greedy, seed: self.seed, stop_ids: qwen.stop_ids(), ..Default::default() };
        let start = Instant::now();
        let mut responses: Vec<(usize, String)> = Vec::new();
        for (k, (_, row)) in rows.iter().enumerate() {
            let msgs: Vec<ChatMessage> = row.prompt.iter().map(|m| ChatMessage::new(&m.role, &m.content)).collect();
            let ids = tok.apply_chat_template(&msgs, ChatOptions { add_generation_prompt: true, enable_thinking: Some(false) })?;
            let prompts = vec![ids; self.samples.max(1)];
            for g in qwen.generate(&prompts, &cfg, &device)? {
                responses.push((k, tok.decode(&g.tokens, true)?));
            }
        }
        let gen_secs = start.elapsed().as_secs_f64();
        let grader = crate::commands::judging::load_config(&self.grader)?;
        let empty = conrub_rubric::RubricSet::from_records("none", vec![])?;
        let judges = match grader.kind {
            JudgeKind::Local => grader.build_local::<B>(&device)?,
            _ => grader.build(&empty)?,
        };
        let requests: Vec<CriterionRequest> = responses
            .iter()
            .map(|(k, r)| {
                let row = &rows[*k].1;
                let question = conrub_rubric::record::messages_text(&row.prompt);
                CriterionRequest { question, response: r.clone(), criteria: row.rubrics.iter().map(|i| i.criterion.clone()).collect(), mode: ScoringMode::Binary }
            })
            .collect();
        let rt = crate::commands::judging::runtime()?;
        let verdicts = rt.block_on(judges.criterion.judge_batch(&requests));
        let mut examples = Vec::new();
        let mut out_rows = Vec::new();
        let mut ungraded = 0usize;
        for ((k, response), v) in responses.iter().zip(&verdicts) {
            let row = &rows[*k].1;
            let Some(labels) = &v.labels else {
                ungraded += 1;
                out_rows.push(json!({"prompt_id": row.prompt_id, "response": response, "graded": false, "error": v.error}));
                continue;
            };
            let items: Vec<GradedItem> = row
                .rubrics
                .iter()
                .zip(labels)
                .map(|(i, l)| GradedItem { points: i.points, met: *l == Label::Yes, tags: i.tags.clone() })
                .collect();
            out_rows.push(json!({
                "prompt_id": row.prompt_id,
                "response": response,
                "graded": true,
                "score": conrub_eval::example_score(&items),
                "items": items,
            }));
            examples.push((row.example_tags.clone(), items));
        }
        let summary = summarize(&examples, 1000, self.seed);
        let report = json!({
            "kind": "rubric",
            "data": self.data.display().to_string(),
            "model": self.model,
            "grader": judges.criterion.id(),
            "settings": {"samples": self.samples, "decoding": if greedy { "greedy" } else { "sampled" }, "seed": self.seed, "max_new_tokens": self.max_new_tokens},
            "summary": summary,
            "ungraded": ungraded,
            "timings": {"generation_seconds": gen_secs, "total_seconds": start.elapsed().as_secs_f64()},
        });
        std::fs::create_dir_all(&self.out).with_context(|| self.out.display().to_string())?;
        write_jsonl_atomic(&self.out.join("examples.jsonl"), &out_rows)?;
        write_bytes_atomic(&self.out.join("report.json"), serde_json::to_string_pretty(&report)?.as_bytes())?;
        println!(
            "rubric score {:.4} +- {:.4} (bootstrap std) on {} graded responses ({} ungraded); report {}",
            summary.score,
            summary.bootstrap_std,
            summary.examples,
            ungraded,
            self.out.join("report.json").display()
        );
        Ok(())
    }
}

/// Arguments of `eval compare`.
#[derive(Args, Clone)]
pub struct CompareArgs {
    /// First `report.json` (e.g. the base model).
    pub a: PathBuf,
    /// Second `report.json` (e.g. the trained checkpoint).
    pub b: PathBuf,
}

/// Numeric leaves of a JSON value as `(dotted path, value)`, in document order.
fn numeric_leaves(prefix: &str, v: &serde_json::Value, out: &mut Vec<(String, f64)>) {
    match v {
        serde_json::Value::Number(n) => out.push((prefix.to_string(), n.as_f64().unwrap_or(f64::NAN))),
        serde_json::Value::Array(a) => a.iter().enumerate().for_each(|(i, x)| numeric_leaves(&format!("{prefix}[{i}]"), x, out)),
        serde_json::Value::Object(o) => o.iter().for_each(|(k, x)| numeric_leaves(&if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") }, x, out)),
        _ => {}
    }
}

/// The comparison table.
pub fn compare_reports(a: &serde_json::Value, b: &serde_json::Value, names: (&str, &str)) -> String {
    let (mut la, mut lb) = (Vec::new(), Vec::new());
    numeric_leaves("", &a["summary"], &mut la);
    numeric_leaves("", &b["summary"], &mut lb);
    let width = la.iter().chain(&lb).map(|(k, _)| k.len()).max().unwrap_or(6).max(6);
    let mut t = format!("{:width$}  {:>12}  {:>12}  {:>10}\n", "metric", names.0, names.1, "B - A");
    for (k, x) in &la {
        match lb.iter().find(|(kb, _)| kb == k) {
            Some((_, y)) => t += &format!("{k:width$}  {x:>12.4}  {y:>12.4}  {:>+10.4}\n", y - x),
            None => t += &format!("{k:width$}  {x:>12.4}  {:>12}  {:>10}\n", "-", "-"),
        }
    }
    for (k, y) in lb.iter().filter(|(k, _)| !la.iter().any(|(ka, _)| ka == k)) {
        t += &format!("{k:width$}  {:>12}  {y:>12.4}  {:>10}\n", "-", "-");
    }
    t
}

/// Arguments of `eval mcq`.
#[derive(Args, Clone)]
pub struct McqArgs {
    /// Questions (JSONL).
    #[arg(long)]
    pub data: PathBuf,
    /// Row format: medmcqa, pubmedqa, mmlu.
    #[arg(long)]
    pub format: String,
    /// Model directory (a training checkpoint works as is) or hub id.
    #[arg(long)]
    pub model: String,
    /// Longest answer in tokens.
    #[arg(long, default_value_t = 512)]
    pub max_new_tokens: usize,
    /// Questions generated together.
    #[arg(long, default_value_t = 8)]
    pub batch_size: usize,
    /// Evaluate only the first N questions.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Output directory: `report.json` and `examples.jsonl`.
    #[arg(long, default_value = "runs/eval")]
    pub out: PathBuf,
    /// Device.
    #[arg(long, default_value = "cpu")]
    pub device: String,
}

/// Runs an `eval` subcommand.
pub fn run(cmd: EvalCommand) -> Result<()> {
    match cmd {
        EvalCommand::Mcq(a) => {
            let device = a.device.clone();
            run_on_device(&device, a)
        }
        EvalCommand::Rubric(a) => {
            let device = a.device.clone();
            run_on_device(&device, a)
        }
        EvalCommand::Compare(c) => {
            let read = |p: &PathBuf| -> Result<serde_json::Value> {
                serde_json::from_str(&std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))?)
                    .with_context(|| format!("{}: not a JSON report", p.display()))
            };
            let (a, b) = (read(&c.a)?, read(&c.b)?);
            if a["kind"] != b["kind"] {
                bail!("{} is a {} report but {} is a {} report", c.a.display(), a["kind"], c.b.display(), b["kind"]);
            }
            println!("A = {} ({})\nB = {} ({})", c.a.display(), a["model"], c.b.display(), b["model"]);
            print!("{}", compare_reports(&a, &b, ("A", "B")));
            Ok(())
        }
    }
}

impl BackendTask for McqArgs {
    fn run<B: Backend>(self, device: B::Device) -> Result<()> {
        let format: McqFormat = self.format.parse().map_err(anyhow::Error::msg).context("--format")?;
        let text = std::fs::read_to_string(&self.data).with_context(|| format!("cannot read {}", self.data.display()))?;
        let mut items = load_items(format, &text).map_err(anyhow::Error::msg).with_context(|| self.data.display().to_string())?;
        if let Some(n) = self.limit {
            items.truncate(n);
        }
        if items.is_empty() {
            bail!("{}: no questions", self.data.display());
        }
        let qwen = Qwen3::<B>::load(&self.model, &device)?;
        let tok = qwen.tokenizer.as_ref().with_context(|| format!("{}: no tokenizer.json", qwen.dir.display()))?;
        let cfg = SamplingConfig { max_new_tokens: self.max_new_tokens, greedy: true, stop_ids: qwen.stop_ids(), ..Default::default() };
        let start = Instant::now();
        let mut rows = Vec::with_capacity(items.len());
        let mut answers = Vec::with_capacity(items.len());
        let mut generated = 0usize;
        for chunk in items.chunks(self.batch_size.max(1)) {
            let prompts: Vec<Vec<u32>> = chunk
                .iter()
                .map(|it| tok.apply_chat_template(&[ChatMessage::new("user", &it.prompt)], ChatOptions { add_generation_prompt: true, enable_thinking: Some(false) }))
                .collect::<Result<_, _>>()?;
            for (it, g) in chunk.iter().zip(qwen.generate(&prompts, &cfg, &device)?) {
                let response = tok.decode(&g.tokens, true)?;
                let labels: Vec<&str> = it.labels.iter().map(String::as_str).collect();
                let extracted = extract_choice(&response, &labels);
                generated += g.tokens.len();
                answers.push((extracted, it.gold));
                rows.push(json!({
                    "id": it.id,
                    "subject": it.subject,
                    "gold": it.labels[it.gold],
                    "extracted": extracted.map(|i| it.labels[i].clone()),
                    "correct": extracted == Some(it.gold),
                    "response": response,
                    "response_tokens": g.tokens.len(),
                }));
            }
            eprintln!("{}/{} questions", rows.len(), items.len());
        }
        let summary = McqSummary::from_answers(&answers);
        let secs = start.elapsed().as_secs_f64();
        let report = json!({
            "kind": "mcq",
            "format": self.format,
            "data": self.data.display().to_string(),
            "model": self.model,
            "settings": {"decoding": "greedy", "max_new_tokens": self.max_new_tokens, "enable_thinking": false},
            "summary": summary,
            "timings": {"seconds": secs, "generated_tokens": generated, "tokens_per_second": generated as f64 / secs.max(1e-9)},
        });
        std::fs::create_dir_all(&self.out).with_context(|| self.out.display().to_string())?;
        write_jsonl_atomic(&self.out.join("examples.jsonl"), &rows)?;
        write_bytes_atomic(&self.out.join("report.json"), serde_json::to_string_pretty(&report)?.as_bytes())?;
        println!(
            "{}: accuracy {:.2}% (95% CI {:.2}-{:.2}%) on {} questions, {} invalid ({:.1}%); report {}",
            self.format,
            100.0 * summary.accuracy,
            100.0 * summary.ci95.0,
            100.0 * summary.ci95.1,
            summary.n,
            summary.invalid,
            100.0 * summary.invalid_rate,
            self.out.join("report.json").display()
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compare_lists_every_numeric_field_with_the_difference() {
        let a = json!({"summary": {"n": 100, "accuracy": 0.25, "ci95": [0.17, 0.34], "invalid_rate": 0.5}});
        let b = json!({"summary": {"n": 100, "accuracy": 0.40, "ci95": [0.31, 0.50], "invalid_rate": 0.1, "extra": 1}});
        let t = compare_reports(&a, &b, ("A", "B"));
        let line = |k: &str| t.lines().find(|l| l.starts_with(k)).unwrap_or_else(|| panic!("{k} missing:\n{t}")).to_string();
        assert!(line("accuracy").ends_with("+0.1500"), "{t}");
        assert!(line("invalid_rate").ends_with("-0.4000"), "{t}");
        assert!(line("ci95[1]").contains("0.5000"), "{t}");
        assert!(line("extra").contains(" - "), "{t}");
    }
}
