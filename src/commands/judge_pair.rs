//! `conrub judge-pair`: one bidirectional pairwise comparison.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use conrub_judge::{compare_both_orders, PairVerdict};
use conrub_rubric::read_rubrics;

use super::judging::{load_config, runtime, with_judges};

/// Arguments of `conrub judge-pair`.
#[derive(Args)]
pub struct JudgePairArgs {
    /// Rubric JSONL file.
    #[arg(long)]
    pub rubrics: PathBuf,
    /// The prompt whose criteria anchor the comparison.
    #[arg(long)]
    pub prompt_id: String,
    /// File with response A (plain text).
    #[arg(long)]
    pub a: PathBuf,
    /// File with response B (plain text).
    #[arg(long)]
    pub b: PathBuf,
    /// Judge config (TOML).
    #[arg(long)]
    pub judge: PathBuf,
    /// Device of an in-process judge.
    #[arg(long)]
    pub device: Option<String>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

fn describe(name: &str, v: &PairVerdict) -> String {
    match &v.answer {
        Some(a) => format!(
            "{name}: verdict {:?}, per criterion {:?}, confidence {}, reason: {}{}",
            a.verdict,
            a.criteria,
            a.confidence
                .map(|c| format!("{c:.2}"))
                .unwrap_or_else(|| "-".into()),
            a.reason.as_deref().unwrap_or("-"),
            if v.cached { " (cached)" } else { "" }
        ),
        None => format!(
            "{name}: invalid after {} attempts: {}",
            v.attempts,
            v.error.as_deref().unwrap_or("-")
        ),
    }
}

/// Runs `conrub judge-pair`.
pub fn run(a: JudgePairArgs) -> Result<()> {
    let rubrics = read_rubrics(&a.rubrics)?;
    let record = rubrics
        .get(&a.prompt_id)
        .with_context(|| {
            format!(
                "prompt_id `{}` is not in {}",
                a.prompt_id,
                a.rubrics.display()
            )
        })?
        .clone();
    let read = |p: &PathBuf| {
        std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))
    };
    let (ra, rb) = (read(&a.a)?, read(&a.b)?);
    let cfg = load_config(&a.judge)?;
    let rt = runtime()?;
    with_judges(&cfg, &rubrics, a.device.as_deref(), |judges| {
        let c = rt.block_on(compare_both_orders(
            judges.pairwise.as_ref(),
            &record.question_text(),
            &record.criterion_texts(),
            ra.trim(),
            rb.trim(),
        ));
        if a.json {
            outln!("{}", serde_json::to_string_pretty(&c)?);
        } else {
            outln!("{}", describe("A shown first", &c.forward));
            for raw in &c.forward.raw_outputs {
                outln!("  raw: {}", raw.replace('\n', "\n       "));
            }
            outln!("{}", describe("B shown first", &c.backward));
            for raw in &c.backward.raw_outputs {
                outln!("  raw: {}", raw.replace('\n', "\n       "));
            }
            let (adv_a, adv_b) = c.outcome.advantages();
            outln!(
                "accepted: {:?} (advantages A {adv_a:+}, B {adv_b:+})",
                c.outcome
            );
        }
        Ok(())
    })
}
