//! Where a run's outputs go: the loop hands each event to a list of sinks (burn-train's event
//! processors), so a new output is one [`RunSink`] impl and one line in [`default_sinks`] (or in
//! an embedder's [`RunHooks::sinks`](crate::RunHooks::sinks)). The built-in sinks, in the order
//! they hear an event:
//!
//! | sink | writes |
//! |---|---|
//! | [`SamplesSink`] | each step's first groups (`samples/step-NNNNNN.jsonl`) and each validation round's answers |
//! | [`MetricsFile`] | every line of `metrics.jsonl` |
//! | [`TensorBoardSink`] | the lines' scalars, each step's reward histogram and first group (`run.tensorboard`) |
//! | [`ProgressSink`] | the progress line after each step and validation round (`tracing` events) |
//!
//! A step's samples are in place before its metrics line: the loop hands [`RunEvent::Step`] to
//! every sink before [`RunEvent::Line`].

use std::path::{Path, PathBuf};
use std::time::Instant;

use conrub_contracts::{MetricsLine, RunConfig};
use conrub_grpo::StepOutput;

use crate::error::Result;
use crate::samples::{
    eval_samples_path, step_samples_path, write_samples, EvalSample, GroupSample,
};
use crate::telemetry::{progress_line, validation_progress_line, MetricsLog};
use crate::tensorboard::Dashboard;

/// What happened in a run, in the order the loop hands it to the sinks.
pub enum RunEvent<'a> {
    /// A line for `metrics.jsonl` alone, before the first step (the kernel warm-up's).
    Opening(&'a MetricsLine),
    /// A step trained: its output and its first groups as samples (`run.sample_groups` of them).
    Step {
        /// The learner's output.
        output: &'a StepOutput,
        /// Its first groups.
        samples: &'a [GroupSample],
    },
    /// A validation round answered and was judged, after `steps_done` steps.
    Validation {
        /// Steps done.
        steps_done: u64,
        /// Every answer with both judges' verdicts.
        answers: &'a [EvalSample],
    },
    /// A metrics line (a step's, an epoch's, a validation round's), after `steps_done` steps.
    Line {
        /// The line.
        line: &'a MetricsLine,
        /// Steps done when it was written.
        steps_done: u64,
    },
}

/// One output of a run.
pub trait RunSink {
    /// Records `event`; an error stops the run.
    fn event(&mut self, event: &RunEvent<'_>) -> Result<()>;
}

/// The built-in sinks of a run of `total_steps` steps into `run.output_dir`, resumed after
/// `resume_step` steps (or fresh): samples, `metrics.jsonl` (opened as [`MetricsLog::open`]
/// says), TensorBoard when `run.tensorboard`, progress.
pub fn default_sinks(
    run: &RunConfig,
    log: MetricsLog,
    resume_step: Option<u64>,
    total_steps: u64,
) -> Result<Vec<Box<dyn RunSink>>> {
    let mut sinks: Vec<Box<dyn RunSink>> = vec![
        Box::new(SamplesSink::new(&run.output_dir, run.sample_groups)),
        Box::new(MetricsFile(log)),
    ];
    if run.tensorboard {
        let board = Dashboard::open(&run.output_dir, resume_step)?;
        sinks.push(Box::new(TensorBoardSink(board)));
    }
    sinks.push(Box::new(ProgressSink::new(total_steps)));
    Ok(sinks)
}

/// Every line of `metrics.jsonl`, appended and flushed.
pub struct MetricsFile(pub MetricsLog);

impl RunSink for MetricsFile {
    fn event(&mut self, event: &RunEvent<'_>) -> Result<()> {
        match event {
            RunEvent::Opening(line) | RunEvent::Line { line, .. } => self.0.append(line),
            _ => Ok(()),
        }
    }
}

/// The TensorBoard event file of `run.tensorboard`.
pub struct TensorBoardSink(pub Dashboard);

impl RunSink for TensorBoardSink {
    fn event(&mut self, event: &RunEvent<'_>) -> Result<()> {
        match event {
            RunEvent::Step { output, samples } => self.0.step_details(output, samples.first()),
            RunEvent::Line { line, steps_done } => self.0.line(line, *steps_done),
            _ => Ok(()),
        }
    }
}

/// Each step's first groups and each validation round's answers under `samples/`.
pub struct SamplesSink {
    output_dir: PathBuf,
    groups: usize,
}

impl SamplesSink {
    /// Samples of `groups` groups a step (none: no step file) in `output_dir/samples`.
    pub fn new(output_dir: &Path, groups: usize) -> Self {
        Self {
            output_dir: output_dir.to_path_buf(),
            groups,
        }
    }
}

impl RunSink for SamplesSink {
    fn event(&mut self, event: &RunEvent<'_>) -> Result<()> {
        match event {
            RunEvent::Step { output, samples } if self.groups > 0 => {
                let path = step_samples_path(&self.output_dir, output.metrics.step);
                write_samples(&path, samples)
            }
            RunEvent::Validation {
                steps_done,
                answers,
            } => write_samples(&eval_samples_path(&self.output_dir, *steps_done), answers),
            _ => Ok(()),
        }
    }
}

/// The progress line after each step (with the ETA from this run's mean step time) and after
/// each validation round, as `tracing` info events.
pub struct ProgressSink {
    total_steps: u64,
    started: Instant,
    steps: u64,
}

impl ProgressSink {
    /// Progress of a run of `total_steps` steps, timed from now.
    pub fn new(total_steps: u64) -> Self {
        Self {
            total_steps,
            started: Instant::now(),
            steps: 0,
        }
    }
}

impl RunSink for ProgressSink {
    fn event(&mut self, event: &RunEvent<'_>) -> Result<()> {
        match event {
            RunEvent::Line {
                line: MetricsLine::Step { metrics, .. },
                ..
            } => {
                self.steps += 1;
                let per_step = self.started.elapsed().as_secs_f64() / self.steps as f64;
                tracing::info!("{}", progress_line(metrics, self.total_steps, per_step));
            }
            RunEvent::Line {
                line: MetricsLine::Eval(v),
                ..
            } => tracing::info!("{}", validation_progress_line(v)),
            _ => {}
        }
        Ok(())
    }
}
