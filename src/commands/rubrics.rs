//! `conrub rubrics validate`, `conrub rubrics import` and `conrub rubrics build`.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use conrub_rubric::import::{import_file, ImportFormat, ImportOptions};
use conrub_rubric::{read_jsonl, validate_records, write_jsonl_atomic, RubricRecord};

/// `conrub rubrics ...`.
#[derive(Subcommand)]
pub enum RubricsCommand {
    /// Check a rubric JSONL file: unique ids, 1-10 content criteria plus exactly 2 global controls,
    /// non-empty positive criteria, tag values; prints counts. Exits non-zero on errors.
    Validate(ValidateArgs),
    /// Convert RaR, RubricHub (verl rows) or HealthBench data into rubric records.
    Import(ImportArgs),
    /// Build consensus rubrics (docs/METHOD.md §3): three generator LLMs propose criteria, a reviewer
    /// reviews, groups and audits them, plain code keeps the unanimous ones. Every call is cached:
    /// kill it and run it again to resume.
    Build(BuildArgs),
}

/// Arguments of `rubrics build`.
#[derive(Args)]
pub struct BuildArgs {
    /// Build config (TOML): [generators.A|B|C], [reviewer], [build], [quotas], [dimensions].
    #[arg(long)]
    pub config: PathBuf,
    /// Prompt file.
    pub input: PathBuf,
    /// Output folder: rubrics.jsonl, raw.jsonl, clusters.jsonl, validation.json, stats.json,
    /// card.md, manifest.json (and cache.sqlite unless the config names another cache).
    #[arg(long)]
    pub out: PathBuf,
    /// Input format: prompts (`{id, question, reference_answer?, source?}` JSONL), rubrics, rar,
    /// rubrichub, healthbench.
    #[arg(long, default_value = "prompts")]
    pub format: String,
    /// Build only the first N selected prompts.
    #[arg(long)]
    pub limit: Option<usize>,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

/// Arguments of `rubrics validate`.
#[derive(Args)]
pub struct ValidateArgs {
    /// Rubric JSONL file.
    pub file: PathBuf,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `rubrics import`.
#[derive(Args)]
pub struct ImportArgs {
    /// Input format: rar, rubrichub, healthbench.
    #[arg(long)]
    pub format: String,
    /// Input file (JSONL or a JSON array).
    pub input: PathBuf,
    /// Output rubric JSONL (written atomically).
    pub output: PathBuf,
    /// Keep negative-weight items (they reward absence; dropped by default).
    #[arg(long)]
    pub keep_negative: bool,
    /// Do not append the two global controls.
    #[arg(long)]
    pub no_global_controls: bool,
    /// Keep at most N content criteria per prompt, highest weight first.
    #[arg(long)]
    pub max_content: Option<usize>,
}

/// Runs a `rubrics` subcommand.
pub fn run(cmd: RubricsCommand) -> Result<()> {
    match cmd {
        RubricsCommand::Validate(a) => validate(a),
        RubricsCommand::Import(a) => import(a),
        RubricsCommand::Build(a) => build(a),
    }
}

fn build(a: BuildArgs) -> Result<()> {
    use conrub_construct::{BuildConfig, BuildRequest, InputFormat, Progress};
    use std::sync::atomic::Ordering;
    use std::sync::Arc;

    let cfg = BuildConfig::from_file(&a.config).context("build config")?;
    let format: InputFormat = a.format.parse()?;
    let req = BuildRequest {
        input: a.input.clone(),
        format,
        out_dir: a.out.clone(),
        limit: a.limit,
    };
    let progress = Arc::new(Progress::default());
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let ticker = (!a.quiet).then(|| {
        let (progress, done) = (progress.clone(), done.clone());
        std::thread::spawn(move || {
            let bar = indicatif::ProgressBar::new(0);
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "building {bar:30} {pos}/{len} prompts, {per_sec}, ETA {eta}\n{msg}",
                )
                .expect("valid template"),
            );
            while !done.load(Ordering::Relaxed) {
                bar.set_length(progress.total.load(Ordering::Relaxed));
                bar.set_position(progress.done.load(Ordering::Relaxed));
                bar.set_message(progress.line());
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
            bar.finish_and_clear();
        })
    });
    let result =
        super::judging::runtime()?.block_on(conrub_construct::build(cfg, &req, progress.clone()));
    done.store(true, Ordering::Relaxed);
    if let Some(t) = ticker {
        let _ = t.join();
    }
    let summary = result?;
    let s = &summary.stats;
    let calls: Vec<String> = summary
        .roles
        .iter()
        .map(|(k, r)| {
            format!(
                "{k} {} calls ({} cached, {} failed, {} retries)",
                r.calls, r.cached, r.failed, r.retries
            )
        })
        .collect();
    outln!(
        "{}: {} prompts -> {} rubrics ({} dropped, {} failed); {} content criteria + {} global controls; per prompt mean {:.2}, median {}, p90 {}, max {}; validation {} errors, {} warnings; {:.1} s",
        summary.out_dir.display(),
        s.counts.prompts,
        s.records,
        s.counts.prompts_dropped,
        s.counts.prompts_failed,
        s.content_criteria,
        s.global_controls,
        s.criteria_per_prompt.mean,
        s.criteria_per_prompt.median,
        s.criteria_per_prompt.p90,
        s.criteria_per_prompt.max,
        s.validation_errors,
        s.validation_warnings,
        summary.seconds
    );
    outln!("calls: {}", calls.join("; "));
    if summary.failed() > 0 {
        bail!(
            "{} prompts stopped on failed model calls (see raw.jsonl); run the same command again to retry them: answered calls come from the cache",
            summary.failed()
        );
    }
    if s.validation_errors > 0 {
        bail!(
            "the validator found {} errors in {} (see validation.json)",
            s.validation_errors,
            summary.out_dir.join("rubrics.jsonl").display()
        );
    }
    Ok(())
}

fn validate(a: ValidateArgs) -> Result<()> {
    let records: Vec<(usize, RubricRecord)> = read_jsonl(&a.file)?;
    let report = validate_records(&records);
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        outln!("{}: {report}", a.file.display());
    }
    if !report.is_ok() {
        bail!("{}: {} errors", a.file.display(), report.errors());
    }
    Ok(())
}

fn import(a: ImportArgs) -> Result<()> {
    super::refuse_output_over_inputs(&a.output, &[("input", &a.input)])?;
    let format: ImportFormat = a.format.parse()?;
    let opts = ImportOptions {
        format,
        add_global_controls: !a.no_global_controls,
        keep_negative: a.keep_negative,
        max_content: a.max_content,
    };
    let (records, rep) = import_file(&a.input, &opts)?;
    write_jsonl_atomic(&a.output, &records)
        .with_context(|| format!("writing {}", a.output.display()))?;
    outln!(
        "{} -> {}: {} rows, {} records, {} content criteria; dropped: {} duplicate prompts, {} negative items, {} empty items, {} over --max-content, {} rows without criteria",
        a.input.display(),
        a.output.display(),
        rep.rows,
        rep.records,
        rep.criteria_kept,
        rep.duplicate_prompts,
        rep.negative_dropped,
        rep.empty_dropped,
        rep.capped_dropped,
        rep.no_criteria
    );
    let numbered: Vec<(usize, RubricRecord)> = records
        .into_iter()
        .enumerate()
        .map(|(i, r)| (i + 1, r))
        .collect();
    let report = validate_records(&numbered);
    outln!(
        "validation: {} errors, {} warnings{}",
        report.errors(),
        report.warnings(),
        if rep.over_ten > 0 {
            format!(
                "; {} records have more than 10 content criteria (use --max-content 10 or `rubrics build` to consolidate)",
                rep.over_ten
            )
        } else {
            String::new()
        }
    );
    Ok(())
}
