//! `conrub eval`: benchmarks on our generation engine.

use conrub_judge::JudgeBuild;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use conrub_eval::{
    extract_choice, load_items, read_eval_examples, EvalExample, McqFormat, McqSummary,
};
use conrub_judge::{CriterionRequest, CriterionVerdict};
use conrub_kernels::KernelOps;
use conrub_models::{ChatOptions, Pretrained};
use conrub_rollout::{Decoding, SamplingConfig};
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
    /// HealthBench-format JSONL (`prompt` messages, `rubrics[{criterion, points, tags}]`, `example_tags`)
    /// or our rubric JSONL (`question`, `criteria`); the two may be mixed line by line.
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
    /// Compute precision: `f32` or `bf16-mixed` (bf16 activations, f32 weights and statistics).
    #[arg(long, default_value = "f32", value_parser = crate::backend::parse_precision)]
    pub precision: conrub_models::Precision,
    /// Attention kernels on CubeCL devices: `auto`, `tensor-core` (an error without cooperative
    /// matrices) or `portable`.
    #[arg(long, default_value = "auto", value_parser = crate::backend::parse_attention_kernels)]
    pub attention_kernels: conrub_models::AttentionKernelChoice,
    /// Grade only the points rubric, not our three-state score.
    #[arg(long)]
    pub skip_three_state: bool,
}

/// What the report says about the model: the argument, the directory it resolved to, and the
/// training step when it is a `checkpoint-NNNNNN` folder.
fn model_info(arg: &str, dir: &std::path::Path) -> serde_json::Value {
    let step = dir
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("checkpoint-"))
        .and_then(|s| s.parse::<u64>().ok());
    json!({"id": arg, "dir": dir.display().to_string(), "checkpoint_step": step})
}

impl BackendTask for RubricArgs {
    fn run<B: KernelOps>(self, device: B::Device) -> Result<()> {
        let mut rows = read_eval_examples(&self.data)?;
        if let Some(n) = self.limit {
            rows.truncate(n);
        }
        if rows.is_empty() {
            bail!("{}: no examples", self.data.display());
        }
        // The grader config is read before the model loads, so a bad config fails fast.
        let grader = crate::commands::judging::load_config(&self.grader)?;
        let qwen = Pretrained::<B>::load(&self.model, &device)?.with_execution(
            crate::backend::inference_execution::<B>(
                self.precision,
                self.attention_kernels,
                &device,
            )?,
        );
        let start = Instant::now();
        let gen = generate_responses(&self, &qwen, &rows, &device)?;
        let empty = conrub_rubric::RubricSet::from_records("none", vec![])?;
        let judges = grader.build_on::<B>(&device, &empty)?;
        let graded = grade(&self, &judges, &rows, &gen)?;
        let t = tabulate(&self, &rows, &gen, &graded);
        write_rubric_report(
            &self,
            &qwen.dir,
            judges.criterion.id(),
            &gen,
            &graded,
            &t,
            start,
        )
    }
}

/// The policy's responses of a rubric eval: `(example index, text, tokens)` each.
struct Generated {
    responses: Vec<(usize, String, usize)>,
    secs: f64,
    tokens: usize,
}

/// `--samples` responses per example (greedy for one), each example's prompt through the chat
/// template without thinking.
fn generate_responses<B: KernelOps>(
    args: &RubricArgs,
    qwen: &Pretrained<B>,
    rows: &[EvalExample],
    device: &B::Device,
) -> Result<Generated> {
    let start = Instant::now();
    let tok = qwen
        .tokenizer
        .as_ref()
        .with_context(|| format!("{}: no tokenizer.json", qwen.dir.display()))?;
    let greedy = args.samples <= 1;
    let cfg = SamplingConfig {
        max_new_tokens: args.max_new_tokens,
        decoding: if greedy {
            Decoding::Greedy
        } else {
            Decoding::default()
        },
        seed: args.seed,
        stop_ids: qwen.stop_ids(),
        first_stream: 0,
    };
    let mut responses: Vec<(usize, String, usize)> = Vec::new();
    for (k, row) in rows.iter().enumerate() {
        let ids = tok.apply_chat_template(
            &row.prompt,
            ChatOptions {
                add_generation_prompt: true,
                enable_thinking: Some(false),
            },
        )?;
        let prompts = vec![ids; args.samples.max(1)];
        for g in qwen.generate(&prompts, &cfg, device)? {
            responses.push((k, tok.decode(&g.tokens, true)?, g.tokens.len()));
        }
        tracing::info!("{}/{} examples generated", k + 1, rows.len());
    }
    let secs = start.elapsed().as_secs_f64();
    let tokens: usize = responses.iter().map(|r| r.2).sum();
    Ok(Generated {
        responses,
        secs,
        tokens,
    })
}

/// The grader's verdicts: points-based (binary) per response and, unless skipped, three-state.
struct Graded {
    points: Vec<CriterionVerdict>,
    three: Vec<CriterionVerdict>,
    secs: f64,
    from_cache: usize,
    calls: u32,
}

/// Grades every response against its example's rubric items, both ways at once.
fn grade(
    args: &RubricArgs,
    judges: &conrub_judge::Judges,
    rows: &[EvalExample],
    gen: &Generated,
) -> Result<Graded> {
    use conrub_rubric::ScoringMode;
    let responses = &gen.responses;
    let request =
        |k: usize, response: &str, criteria: Vec<String>, mode: ScoringMode| CriterionRequest {
            question: conrub_rubric::record::messages_text(&rows[k].prompt),
            response: response.to_string(),
            criteria,
            mode,
        };
    let points_requests: Vec<CriterionRequest> = responses
        .iter()
        .map(|(k, r, _)| {
            request(
                *k,
                r,
                rows[*k].items.iter().map(|i| i.criterion.clone()).collect(),
                ScoringMode::Binary,
            )
        })
        .collect();
    let three_requests: Vec<CriterionRequest> = if args.skip_three_state {
        Vec::new()
    } else {
        responses
            .iter()
            .map(|(k, r, _)| request(*k, r, rows[*k].criteria.clone(), ScoringMode::ThreeState))
            .collect()
    };
    let start = Instant::now();
    let rt = crate::commands::judging::runtime()?;
    let (points_verdicts, three_verdicts) = rt.block_on(async {
        tokio::join!(
            judges.criterion.judge_batch(&points_requests),
            judges.criterion.judge_batch(&three_requests)
        )
    });
    let secs = start.elapsed().as_secs_f64();
    let from_cache = points_verdicts
        .iter()
        .chain(&three_verdicts)
        .filter(|v| v.cached)
        .count();
    let grader_calls: u32 = points_verdicts
        .iter()
        .chain(&three_verdicts)
        .map(|v| v.attempts)
        .sum();
    Ok(Graded {
        points: points_verdicts,
        three: three_verdicts,
        secs,
        from_cache,
        calls: grader_calls,
    })
}

/// Per-response rows and the inputs of the summaries.
struct Tabulated {
    examples: Vec<(Vec<String>, Vec<conrub_eval::GradedItem>)>,
    three_rows: Vec<(Vec<String>, Vec<conrub_rubric::Label>)>,
    out_rows: Vec<serde_json::Value>,
    ungraded: usize,
}

/// One `examples.jsonl` row per response, with its graded items and three-state labels.
fn tabulate(
    args: &RubricArgs,
    rows: &[EvalExample],
    gen: &Generated,
    graded: &Graded,
) -> Tabulated {
    use conrub_eval::GradedItem;
    use conrub_rubric::Label;
    let mut examples = Vec::new();
    let mut three_rows = Vec::new();
    let mut out_rows = Vec::new();
    let mut ungraded = 0usize;
    for (n, ((k, response, tokens), v)) in gen.responses.iter().zip(&graded.points).enumerate() {
        let row = &rows[*k];
        let mut out = json!({"id": row.id, "sample": n % args.samples.max(1), "response": response, "response_tokens": tokens});
        match &v.labels {
            Some(labels) => {
                let items: Vec<GradedItem> = row
                    .items
                    .iter()
                    .zip(labels)
                    .map(|(i, l)| GradedItem {
                        points: i.points,
                        met: *l == Label::Yes,
                        tags: i.tags.clone(),
                    })
                    .collect();
                out["graded"] = json!(true);
                out["score"] = json!(conrub_eval::example_score(&items));
                out["items"] = json!(items);
                examples.push((row.example_tags.clone(), items));
            }
            None => {
                ungraded += 1;
                out["graded"] = json!(false);
                out["error"] = json!(v.error);
            }
        }
        if let Some(t) = graded.three.get(n) {
            match &t.labels {
                Some(labels) => {
                    out["three_state"] =
                        json!({"labels": labels, "score": conrub_eval::three_state_score(labels)});
                    three_rows.push((row.example_tags.clone(), labels.clone()));
                }
                None => out["three_state"] = json!({"error": t.error}),
            }
        }
        out_rows.push(out);
    }
    Tabulated {
        examples,
        three_rows,
        out_rows,
        ungraded,
    }
}

/// Summaries (with bootstrap errors), `report.json` and `examples.jsonl` under `--out`, and the
/// one-line result.
fn write_rubric_report(
    args: &RubricArgs,
    model_dir: &std::path::Path,
    grader_id: String,
    gen: &Generated,
    graded: &Graded,
    t: &Tabulated,
    start: Instant,
) -> Result<()> {
    use conrub_eval::{summarize, summarize_three_state};
    let greedy = args.samples <= 1;
    let summary = summarize(&t.examples, 1000, args.seed);
    let three =
        (!args.skip_three_state).then(|| summarize_three_state(&t.three_rows, 1000, args.seed));
    let report = json!({
        "kind": "rubric",
        "data": args.data.display().to_string(),
        "model": model_info(&args.model, model_dir),
        "grader": grader_id,
        "settings": {
            "samples": args.samples, "decoding": if greedy { "greedy" } else { "sampled" }, "seed": args.seed,
            "max_new_tokens": args.max_new_tokens, "enable_thinking": false, "bootstrap_resamples": 1000,
        },
        "summary": summary,
        "three_state": three,
        "ungraded": t.ungraded,
        "three_state_ungraded": graded.three.len() - t.three_rows.len(),
        "timings": {
            "generation_seconds": gen.secs, "generated_tokens": gen.tokens,
            "tokens_per_second": gen.tokens as f64 / gen.secs.max(1e-9), "grading_seconds": graded.secs,
            "grader_answers_from_cache": graded.from_cache, "grader_calls": graded.calls, "total_seconds": start.elapsed().as_secs_f64(),
        },
    });
    std::fs::create_dir_all(&args.out).with_context(|| args.out.display().to_string())?;
    write_jsonl_atomic(&args.out.join("examples.jsonl"), &t.out_rows)?;
    write_bytes_atomic(
        &args.out.join("report.json"),
        serde_json::to_string_pretty(&report)?.as_bytes(),
    )?;
    let three_line = three
        .map(|t| format!("; three-state {:.4} +- {:.4}", t.mean, t.bootstrap_std))
        .unwrap_or_default();
    outln!(
            "rubric score {:.4} +- {:.4} (bootstrap std) on {} graded responses ({} ungraded){}; {} grader answers from cache, {} grader calls; report {}",
            summary.score,
            summary.bootstrap_std,
            summary.examples,
            t.ungraded,
            three_line,
            graded.from_cache,
            graded.calls,
            args.out.join("report.json").display()
        );
    Ok(())
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
        serde_json::Value::Number(n) => {
            out.push((prefix.to_string(), n.as_f64().unwrap_or(f64::NAN)))
        }
        serde_json::Value::Array(a) => a
            .iter()
            .enumerate()
            .for_each(|(i, x)| numeric_leaves(&format!("{prefix}[{i}]"), x, out)),
        serde_json::Value::Object(o) => o.iter().for_each(|(k, x)| {
            numeric_leaves(
                &if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                },
                x,
                out,
            )
        }),
        _ => {}
    }
}

/// The comparison table.
pub fn compare_reports(
    a: &serde_json::Value,
    b: &serde_json::Value,
    names: (&str, &str),
) -> String {
    let (mut la, mut lb) = (Vec::new(), Vec::new());
    numeric_leaves("", &a["summary"], &mut la);
    numeric_leaves("", &b["summary"], &mut lb);
    let width = la
        .iter()
        .chain(&lb)
        .map(|(k, _)| k.len())
        .max()
        .unwrap_or(6)
        .max(6);
    let mut t = format!(
        "{:width$}  {:>12}  {:>12}  {:>10}\n",
        "metric", names.0, names.1, "B - A"
    );
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
    /// Compute precision: `f32` or `bf16-mixed` (bf16 activations, f32 weights and statistics).
    #[arg(long, default_value = "f32", value_parser = crate::backend::parse_precision)]
    pub precision: conrub_models::Precision,
    /// Attention kernels on CubeCL devices: `auto`, `tensor-core` (an error without cooperative
    /// matrices) or `portable`.
    #[arg(long, default_value = "auto", value_parser = crate::backend::parse_attention_kernels)]
    pub attention_kernels: conrub_models::AttentionKernelChoice,
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
                serde_json::from_str(
                    &std::fs::read_to_string(p)
                        .with_context(|| format!("cannot read {}", p.display()))?,
                )
                .with_context(|| format!("{}: not a JSON report", p.display()))
            };
            let (a, b) = (read(&c.a)?, read(&c.b)?);
            if a["kind"] != b["kind"] {
                bail!(
                    "{} is a {} report but {} is a {} report",
                    c.a.display(),
                    a["kind"],
                    c.b.display(),
                    b["kind"]
                );
            }
            let model = |r: &serde_json::Value| {
                r["model"]["id"]
                    .as_str()
                    .or(r["model"].as_str())
                    .unwrap_or("?")
                    .to_string()
            };
            outln!(
                "A = {} ({})\nB = {} ({})",
                c.a.display(),
                model(&a),
                c.b.display(),
                model(&b)
            );
            out!("{}", compare_reports(&a, &b, ("A", "B")));
            Ok(())
        }
    }
}

impl BackendTask for McqArgs {
    fn run<B: KernelOps>(self, device: B::Device) -> Result<()> {
        let items = read_mcq_items(&self)?;
        let qwen = Pretrained::<B>::load(&self.model, &device)?.with_execution(
            crate::backend::inference_execution::<B>(
                self.precision,
                self.attention_kernels,
                &device,
            )?,
        );
        let tok = qwen
            .tokenizer
            .as_ref()
            .with_context(|| format!("{}: no tokenizer.json", qwen.dir.display()))?;
        let cfg = SamplingConfig {
            stop_ids: qwen.stop_ids(),
            ..SamplingConfig::greedy(self.max_new_tokens)
        };
        let start = Instant::now();
        let mut rows = Vec::with_capacity(items.len());
        let mut answers = Vec::with_capacity(items.len());
        let mut generated = 0usize;
        for chunk in items.chunks(self.batch_size.max(1)) {
            let prompts: Vec<Vec<u32>> = chunk
                .iter()
                .map(|it| {
                    tok.apply_chat_template(
                        &[conrub_rubric::Message::user(it.prompt.as_str())],
                        ChatOptions {
                            add_generation_prompt: true,
                            enable_thinking: Some(false),
                        },
                    )
                })
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
            tracing::info!("{}/{} questions", rows.len(), items.len());
        }
        let summary = McqSummary::from_answers(&answers);
        let by_subject = by_subject(&items, &answers);
        let secs = start.elapsed().as_secs_f64();
        let report = json!({
            "kind": "mcq",
            "format": self.format,
            "data": self.data.display().to_string(),
            "model": model_info(&self.model, &qwen.dir),
            "settings": {"decoding": "greedy", "max_new_tokens": self.max_new_tokens, "enable_thinking": false},
            "summary": summary,
            "by_subject": by_subject,
            "timings": {"seconds": secs, "generated_tokens": generated, "tokens_per_second": generated as f64 / secs.max(1e-9)},
        });
        std::fs::create_dir_all(&self.out).with_context(|| self.out.display().to_string())?;
        write_jsonl_atomic(&self.out.join("examples.jsonl"), &rows)?;
        write_bytes_atomic(
            &self.out.join("report.json"),
            serde_json::to_string_pretty(&report)?.as_bytes(),
        )?;
        outln!(
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

/// `--data` in `--format`, cut to `--limit`.
fn read_mcq_items(args: &McqArgs) -> Result<Vec<conrub_eval::McqItem>> {
    let format: McqFormat = args
        .format
        .parse()
        .map_err(anyhow::Error::msg)
        .context("--format")?;
    let text = std::fs::read_to_string(&args.data)
        .with_context(|| format!("cannot read {}", args.data.display()))?;
    let mut items = load_items(format, &text)
        .map_err(anyhow::Error::msg)
        .with_context(|| args.data.display().to_string())?;
    if let Some(n) = args.limit {
        items.truncate(n);
    }
    if items.is_empty() {
        bail!("{}: no questions", args.data.display());
    }
    Ok(items)
}

/// Accuracy per subject of the items that name one; `answers` is `(extracted, gold)` per item.
fn by_subject(
    items: &[conrub_eval::McqItem],
    answers: &[(Option<usize>, usize)],
) -> std::collections::BTreeMap<String, McqSummary> {
    let mut per_subject: std::collections::BTreeMap<String, Vec<(Option<usize>, usize)>> =
        Default::default();
    for (it, a) in items.iter().zip(answers) {
        if let Some(s) = &it.subject {
            per_subject.entry(s.clone()).or_default().push(*a);
        }
    }
    per_subject
        .into_iter()
        .map(|(k, v)| (k, McqSummary::from_answers(&v)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compare_lists_every_numeric_field_with_the_difference() {
        let a = json!({"summary": {"n": 100, "accuracy": 0.25, "ci95": [0.17, 0.34], "invalid_rate": 0.5}});
        let b = json!({"summary": {"n": 100, "accuracy": 0.40, "ci95": [0.31, 0.50], "invalid_rate": 0.1, "extra": 1}});
        let t = compare_reports(&a, &b, ("A", "B"));
        let line = |k: &str| {
            t.lines()
                .find(|l| l.starts_with(k))
                .unwrap_or_else(|| panic!("{k} missing:\n{t}"))
                .to_string()
        };
        assert!(line("accuracy").ends_with("+0.1500"), "{t}");
        assert!(line("invalid_rate").ends_with("-0.4000"), "{t}");
        assert!(line("ci95[1]").contains("0.5000"), "{t}");
        assert!(line("extra").contains(" - "), "{t}");
    }
}
