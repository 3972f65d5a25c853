//! `conrub plot RUN_DIR`: the run's curves from its metrics.jsonl (what `train` draws at every
//! checkpoint), on demand, e.g. for a run still in progress.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

/// Arguments of `conrub plot`.
#[derive(Args, Debug)]
pub struct PlotArgs {
    /// A run directory (`run.output_dir` of a train config) holding metrics.jsonl.
    pub run_dir: PathBuf,
}

/// Draws the curves and prints the files written, one a line.
pub fn run(args: PlotArgs) -> Result<()> {
    let files = conrub_plot::plot_run(&args.run_dir)?;
    let lines: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
    super::print_lines(lines)
}
