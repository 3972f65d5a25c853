//! `conrub score`: judge responses against their rubrics and write rewards.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use conrub_judge::{score_jobs, CriterionRequest, Judges, ScoreJob, ScoredJob, ScoringSummary};
use conrub_models::ChatTokenizer;
use conrub_rubric::io::parse_line;
use conrub_rubric::{
    read_rubrics, write_jsonl_atomic, LengthPenalty, ResponseScore, RubricSet, ScoringMode,
};
use serde::{Deserialize, Serialize};

use super::judging::{load_config, runtime, with_judges};

/// Arguments of `conrub score`.
#[derive(Args)]
pub struct ScoreArgs {
    /// Rubric JSONL file.
    #[arg(long)]
    pub rubrics: PathBuf,
    /// Responses JSONL: `{prompt_id, response}` or `{prompt_id, responses: [...]}` per line;
    /// an optional `response_tokens` gives the length for the overlength penalty.
    #[arg(long)]
    pub responses: PathBuf,
    /// Judge config (TOML): kind = openai | local | lexical, urls, model, concurrency, cache, ...
    #[arg(long)]
    pub judge: PathBuf,
    /// Scoring mode: three-state (default) or binary.
    #[arg(long, default_value = "three-state")]
    pub mode: String,
    /// Output JSONL (written atomically); without it, rows go to standard output.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Tokenizer directory used to count response tokens for the overlength penalty when rows do
    /// not carry `response_tokens`.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Lmax of the overlength penalty (the rollout's response limit).
    #[arg(long, default_value_t = 8192)]
    pub max_response_tokens: u32,
    /// Lbuf of the overlength penalty.
    #[arg(long, default_value_t = 1024)]
    pub length_buffer: u32,
    /// Do not apply the overlength penalty.
    #[arg(long)]
    pub no_length_penalty: bool,
    /// Device of an in-process judge (overrides the config's `device`).
    #[arg(long)]
    pub device: Option<String>,
}

#[derive(Deserialize)]
struct ResponseRow {
    prompt_id: String,
    #[serde(default)]
    response: Option<String>,
    #[serde(default)]
    responses: Option<Vec<String>>,
    #[serde(default)]
    response_tokens: Option<u32>,
}

/// One output row.
#[derive(Serialize)]
struct ScoreRow<'a> {
    prompt_id: &'a str,
    line: usize,
    index: usize,
    #[serde(flatten)]
    score: &'a ResponseScore,
    response_tokens: Option<u32>,
    /// Judge attempts; an unscored row carries them in its reason (one `attempts` key).
    #[serde(skip_serializing_if = "Option::is_none")]
    attempts: Option<u32>,
    cached: bool,
    judge_latency_ms: f64,
    #[serde(skip_serializing_if = "<[f64]>::is_empty")]
    margins: &'a [f64],
    raw_outputs: &'a [String],
}

/// Runs `conrub score`: reads the jobs, judges them, writes the rows, reports.
pub fn run(a: ScoreArgs) -> Result<()> {
    if let Some(out) = &a.out {
        let inputs = [
            ("--responses", a.responses.as_path()),
            ("--rubrics", a.rubrics.as_path()),
            ("--judge", a.judge.as_path()),
        ];
        super::refuse_output_over_inputs(out, &inputs)?;
    }
    let mode: ScoringMode = a.mode.parse()?;
    let penalty = length_penalty(&a)?;
    let rubrics = read_rubrics(&a.rubrics)?;
    let jobs = read_jobs(&a, &rubrics, mode)?;
    let cfg = load_config(&a.judge)?;
    let rt = runtime()?;
    with_judges(&cfg, &rubrics, a.device.as_deref(), |judges| {
        let bar = indicatif::ProgressBar::new(jobs.jobs.len() as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "judging {bar:30} {pos}/{len} responses, {per_sec}, ETA {eta}",
            )
            .expect("valid template"),
        );
        let progress = {
            let bar = bar.clone();
            move |done: usize| bar.set_position(done as u64)
        };
        let (results, summary) = rt.block_on(score_jobs(
            judges.criterion.as_ref(),
            &jobs.jobs,
            &penalty,
            cfg_batch(&cfg),
            4 * cfg.concurrency().max(1),
            &progress,
        ));
        bar.finish_and_clear();
        write_rows(&a, &jobs, &results)?;
        tracing::info!(
            "scored {}/{} responses ({} unscored), mean reward {:.4} ({} mode), {} from cache, {} judge retries, mean judge latency {:.1} ms, {:.2} s ({:.1} responses/s) with judge {}",
            summary.scored,
            summary.responses,
            summary.unscored,
            summary.reward_mean,
            mode.as_str(),
            summary.cached,
            summary.retries,
            summary.latency_ms_mean,
            summary.wall_secs,
            summary.responses as f64 / summary.wall_secs.max(1e-9),
            judges.criterion.id()
        );
        if summary.deferred > 0 {
            tracing::info!(
                "{} criteria went to the probe's fallback judge (top class probability under abstain_below)",
                summary.deferred
            );
        }
        report_inputs(&a, &jobs, &penalty);
        report_judges(&judges);
        report_unscored(&a, &jobs, &results, &summary)
    })
}

/// The overlength penalty the arguments ask for.
fn length_penalty(a: &ScoreArgs) -> Result<LengthPenalty> {
    let penalty = if a.no_length_penalty {
        LengthPenalty::disabled()
    } else {
        LengthPenalty {
            enabled: true,
            max_tokens: a.max_response_tokens,
            buffer_tokens: a.length_buffer,
        }
    };
    penalty.validate()?;
    Ok(penalty)
}

/// The responses file as judge jobs, each with where it came from.
struct Jobs {
    jobs: Vec<ScoreJob>,
    /// `(prompt_id, line, index in the line's group)` per job.
    meta: Vec<(String, usize, usize)>,
    /// Jobs whose token count came from `--tokenizer`.
    counted: usize,
}

/// Reads `--responses` against the rubrics: one job per response, its token count from the row
/// or from `--tokenizer`.
fn read_jobs(a: &ScoreArgs, rubrics: &RubricSet, mode: ScoringMode) -> Result<Jobs> {
    let tokenizer = a
        .tokenizer
        .as_ref()
        .map(|d| ChatTokenizer::from_dir(d))
        .transpose()
        .context("--tokenizer")?;
    let text = std::fs::read_to_string(&a.responses)
        .with_context(|| format!("cannot read {}", a.responses.display()))?;
    let mut jobs = Vec::new();
    let mut meta: Vec<(String, usize, usize)> = Vec::new();
    let mut counted = 0usize;
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let row: ResponseRow = parse_line(line, &a.responses, i + 1)?;
        let record = rubrics.get(&row.prompt_id).with_context(|| {
            format!(
                "{}:{}: prompt_id `{}` is not in {}",
                a.responses.display(),
                i + 1,
                row.prompt_id,
                a.rubrics.display()
            )
        })?;
        let group = match (row.response, row.responses) {
            (Some(r), None) => vec![r],
            (None, Some(g)) if !g.is_empty() => g,
            _ => bail!(
                "{}:{}: give exactly one of `response` or a non-empty `responses`",
                a.responses.display(),
                i + 1
            ),
        };
        let single = group.len() == 1;
        for (k, response) in group.into_iter().enumerate() {
            let tokens = match (&tokenizer, row.response_tokens) {
                (_, Some(t)) if single => Some(t),
                (Some(tok), _) => {
                    counted += 1;
                    Some(
                        tok.encode(&response)
                            .map_err(|e| anyhow::anyhow!("{e}"))?
                            .len() as u32,
                    )
                }
                _ => None,
            };
            jobs.push(ScoreJob {
                request: CriterionRequest {
                    question: record.question_text(),
                    response,
                    criteria: record.criterion_texts(),
                    mode,
                },
                response_tokens: tokens,
            });
            meta.push((row.prompt_id.clone(), i + 1, k));
        }
    }
    if jobs.is_empty() {
        bail!("{}: no responses", a.responses.display());
    }
    Ok(Jobs {
        jobs,
        meta,
        counted,
    })
}

/// Writes one row per job to `--out` (atomically) or standard output.
fn write_rows(a: &ScoreArgs, jobs: &Jobs, results: &[ScoredJob]) -> Result<()> {
    let rows: Vec<ScoreRow> = results
        .iter()
        .zip(&jobs.meta)
        .zip(&jobs.jobs)
        .map(
            |((r, (pid, line, k)), job): ((&ScoredJob, _), &ScoreJob)| ScoreRow {
                prompt_id: pid,
                line: *line,
                index: *k,
                score: &r.score,
                response_tokens: job.response_tokens,
                attempts: r.score.is_scored().then_some(r.verdict.attempts),
                cached: r.verdict.cached,
                judge_latency_ms: r.verdict.latency_ms,
                margins: &r.verdict.margins,
                raw_outputs: &r.verdict.raw_outputs,
            },
        )
        .collect();
    match &a.out {
        Some(path) => write_jsonl_atomic(path, &rows)
            .with_context(|| format!("writing {}", path.display()))?,
        None => super::print_lines(
            rows.iter()
                .map(|r| serde_json::to_string(r).expect("rows serialise")),
        )?,
    }
    Ok(())
}

/// Where the token counts came from, or that some responses had none.
fn report_inputs(a: &ScoreArgs, jobs: &Jobs, penalty: &LengthPenalty) {
    let without_length = jobs
        .jobs
        .iter()
        .filter(|j| j.response_tokens.is_none())
        .count();
    if without_length > 0 && penalty.enabled {
        tracing::info!(
            "note: {without_length} responses have no token count (no `response_tokens`, no --tokenizer): no overlength penalty for them"
        );
    } else if jobs.counted > 0 {
        tracing::info!(
            "token counts from {}",
            a.tokenizer
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default()
        );
    }
}

/// The HTTP client's and the cache's counters, where the judge has them.
fn report_judges(judges: &Judges) {
    if let Some(c) = &judges.client {
        let s = c.stats();
        tracing::info!(
                "http: {} requests, {} retries ({} transport errors, {} 408/429/5xx, {} unparseable), {} failed calls",
                s.requests, s.retries, s.transport_errors, s.retryable_status, s.parse_errors, s.failures
            );
    }
    if let Some(c) = &judges.cache {
        let s = c.stats();
        tracing::info!(
            "cache {}: {} hits, {} misses, {} writes, {} database errors",
            c.path().display(),
            s.hits,
            s.misses,
            s.writes,
            s.errors
        );
    }
}

/// How many responses ended unscored, and why the first one did (always said); an error when
/// none could be scored.
fn report_unscored(
    a: &ScoreArgs,
    jobs: &Jobs,
    results: &[ScoredJob],
    summary: &ScoringSummary,
) -> Result<()> {
    let first_unscored = results
        .iter()
        .zip(&jobs.meta)
        .find_map(|(r, m)| match &r.score {
            ResponseScore::Unscored(u) => Some((m, u)),
            _ => None,
        });
    match first_unscored {
            Some(((pid, line, k), u)) => tracing::info!(
                "unscored: {} of {} responses (no valid judge output within the retry budget); first: {}:{line} (prompt_id `{pid}`, response {k}) after {} attempts: {}",
                summary.unscored,
                summary.responses,
                a.responses.display(),
                u.attempts,
                u.message
            ),
            None => tracing::info!("unscored: 0 of {} responses", summary.responses),
        }
    if summary.scored == 0 {
        bail!(
            "no response could be scored ({} of {} unscored); the unscored rows were written to {}",
            summary.unscored,
            summary.responses,
            a.out
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_else(|| "standard output".into())
        );
    }
    Ok(())
}

/// Responses per in-process judging chunk (a few device batches, so progress moves); `None` for
/// the other kinds.
fn cfg_batch(cfg: &conrub_judge::JudgeConfig) -> Option<usize> {
    match &cfg.spec {
        conrub_judge::JudgeSpec::Local(l) => Some(l.local.batch_size.max(1) * 4),
        conrub_judge::JudgeSpec::Probe(p) => Some(p.batch_size.max(1) * 4),
        _ => None,
    }
}
