//! `conrub rubrics validate` and `conrub rubrics import`.

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
    }
}

fn validate(a: ValidateArgs) -> Result<()> {
    let records: Vec<(usize, RubricRecord)> = read_jsonl(&a.file)?;
    let report = validate_records(&records);
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!("{}: {report}", a.file.display());
    }
    if !report.is_ok() {
        bail!("{}: {} errors", a.file.display(), report.errors());
    }
    Ok(())
}

fn import(a: ImportArgs) -> Result<()> {
    let format: ImportFormat = a.format.parse()?;
    let opts = ImportOptions {
        format,
        add_global_controls: !a.no_global_controls,
        keep_negative: a.keep_negative,
        max_content: a.max_content,
    };
    let (records, rep) = import_file(&a.input, &opts)?;
    write_jsonl_atomic(&a.output, &records).with_context(|| format!("writing {}", a.output.display()))?;
    println!(
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
    let numbered: Vec<(usize, RubricRecord)> = records.into_iter().enumerate().map(|(i, r)| (i + 1, r)).collect();
    let report = validate_records(&numbered);
    println!(
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
