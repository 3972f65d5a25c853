//! `conrub samples RUN_DIR --step N`: a step's rollouts (or a validation round's answers) as the
//! run wrote them to `samples/`, printed for reading.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;
use conrub_trainer::samples::{
    eval_samples_path, format_eval, format_group, read_samples, step_samples_path, EvalSample,
    GroupSample,
};

/// Arguments of `conrub samples`.
#[derive(Args, Debug)]
pub struct SamplesArgs {
    /// A run directory (`run.output_dir` of a train config).
    pub run_dir: PathBuf,
    /// The step, 0-based as the metrics' `step`; with `--eval`, the steps done before the
    /// validation round (the eval line's `step`).
    #[arg(long)]
    pub step: u64,
    /// The validation round's answers instead of the step's rollouts.
    #[arg(long)]
    pub eval: bool,
    /// Only this group (its `group` number) of the step.
    #[arg(long, conflicts_with = "eval")]
    pub group: Option<usize>,
    /// The lines as written (JSONL), not the readable form.
    #[arg(long)]
    pub json: bool,
}

/// Prints the samples.
pub fn run(a: SamplesArgs) -> Result<()> {
    let path = if a.eval {
        eval_samples_path(&a.run_dir, a.step)
    } else {
        step_samples_path(&a.run_dir, a.step)
    };
    if !path.is_file() {
        bail!(
            "{}: no such samples file (steps are 0-based; run.sample_groups = 0 writes none)",
            path.display()
        );
    }
    let lines: Vec<String> = if a.eval {
        let answers: Vec<EvalSample> = read_samples(&path)?;
        answers
            .iter()
            .map(|s| render(s, a.json, format_eval))
            .collect::<Result<_>>()?
    } else {
        let groups: Vec<GroupSample> = read_samples(&path)?;
        let picked: Vec<&GroupSample> = groups
            .iter()
            .filter(|g| a.group.is_none_or(|n| g.group == n))
            .collect();
        if let (Some(n), true) = (a.group, picked.is_empty()) {
            bail!(
                "{}: no group {n} (it holds {})",
                path.display(),
                groups.len()
            );
        }
        picked
            .into_iter()
            .map(|g| render(g, a.json, format_group))
            .collect::<Result<_>>()?
    };
    super::print_lines(lines)
}

/// One sample as its JSON line or its readable form.
fn render<S: serde::Serialize>(s: &S, json: bool, text: fn(&S) -> String) -> Result<String> {
    if json {
        Ok(serde_json::to_string(s)?)
    } else {
        Ok(text(s))
    }
}
