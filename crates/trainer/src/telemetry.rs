//! Telemetry: the JSONL metrics file (its line types are `conrub_contracts`' [`MetricsLine`]) and
//! a live progress line. Curves are drawn from the file by conrub-plot (at checkpoints through
//! [`RunHooks::checkpointed`](crate::RunHooks::checkpointed), and by `conrub plot`).

use std::io::Write;
use std::path::{Path, PathBuf};

use conrub_contracts::{MetricsLine, StepMetrics, ValidationLine};

use crate::error::{Result, TrainerError};

/// The metrics file.
#[derive(Debug, Clone)]
pub struct MetricsLog {
    path: PathBuf,
}

impl MetricsLog {
    /// Opens `path`. When resuming at `resume_step` (steps completed by the restored state) for a
    /// run of `total_steps`, lines that the resumed run writes again are dropped, so the file ends
    /// with exactly one line per step, per epoch and per validation round: step lines of later
    /// steps, validation lines after `resume_step`, summaries ending
    /// after `resume_step`, and summaries of a partial epoch (written when a run stopped early)
    /// unless the resumed run ends right there (`steps_per_epoch` steps per epoch).
    pub fn open(
        path: &Path,
        resume_step: Option<u64>,
        steps_per_epoch: u64,
        total_steps: u64,
    ) -> Result<Self> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| TrainerError::io(dir, e))?;
        }
        match resume_step {
            Some(step) if path.exists() => {
                let text = std::fs::read_to_string(path).map_err(|e| TrainerError::io(path, e))?;
                let kept: Vec<&str> = text
                    .lines()
                    .enumerate()
                    .filter(|(i, l)| {
                        kept_on_resume(path, *i, l, step, steps_per_epoch, total_steps)
                    })
                    .map(|(_, l)| l)
                    .collect();
                let mut body = kept.join("\n");
                if !body.is_empty() {
                    body.push('\n');
                }
                conrub_rubric::io::write_bytes_atomic(path, body.as_bytes())
                    .map_err(|e| TrainerError::io(path, e))?;
                if step > 0 && !kept.iter().any(|l| l.contains("\"kind\":\"step\"")) {
                    tracing::warn!(
                        "{}: no step lines before step {step} (the file was emptied): this run's lines start there",
                        path.display()
                    );
                }
            }
            // Resuming into a folder without the file (another run's checkpoint, or the file
            // deleted): the history starts at the resumed step.
            Some(step) => {
                if step > 0 {
                    tracing::warn!(
                        "{}: not found; the metrics of the {step} steps before the resume are not in this folder",
                        path.display()
                    );
                }
                conrub_rubric::io::write_bytes_atomic(path, b"")
                    .map_err(|e| TrainerError::io(path, e))?;
            }
            None => {
                conrub_rubric::io::write_bytes_atomic(path, b"")
                    .map_err(|e| TrainerError::io(path, e))?;
            }
        }
        Ok(Self {
            path: path.to_path_buf(),
        })
    }

    /// Appends one line and flushes it.
    pub fn append(&self, line: &MetricsLine) -> Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(&self.path)
            .map_err(|e| TrainerError::io(&self.path, e))?;
        let mut s = serde_json::to_string(line).map_err(|e| TrainerError::io(&self.path, e))?;
        s.push('\n');
        f.write_all(s.as_bytes())
            .and_then(|_| f.sync_data())
            .map_err(|e| TrainerError::io(&self.path, e))
    }

    /// All step metrics in the file, in order.
    pub fn steps(&self) -> Result<Vec<StepMetrics>> {
        let text =
            std::fs::read_to_string(&self.path).map_err(|e| TrainerError::io(&self.path, e))?;
        Ok(text
            .lines()
            .filter_map(|l| match serde_json::from_str::<MetricsLine>(l) {
                Ok(MetricsLine::Step { metrics, .. }) => Some(*metrics),
                _ => None,
            })
            .collect())
    }

    /// All validation rounds (`kind = "eval"` lines) in the file, in order.
    pub fn evals(&self) -> Result<Vec<ValidationLine>> {
        let text =
            std::fs::read_to_string(&self.path).map_err(|e| TrainerError::io(&self.path, e))?;
        Ok(text
            .lines()
            .filter_map(|l| match serde_json::from_str::<MetricsLine>(l) {
                Ok(MetricsLine::Eval(e)) => Some(e),
                _ => None,
            })
            .collect())
    }
}

/// Whether a resume at `step` keeps line `index` (0-based) of the metrics file: lines of the
/// steps, rounds and epochs the resumed run writes again go; a line that does not read as a
/// metrics line (a user's note, the torn tail of a killed write) is kept as it is, with a warning,
/// since nothing conrub cannot read is conrub's to delete.
fn kept_on_resume(
    path: &Path,
    index: usize,
    line: &str,
    step: u64,
    steps_per_epoch: u64,
    total_steps: u64,
) -> bool {
    match serde_json::from_str::<MetricsLine>(line) {
        Ok(MetricsLine::Step { metrics, .. }) => metrics.step < step,
        Ok(MetricsLine::Eval(e)) => e.step <= step,
        // The warm-ups of earlier attempts: what those processes compiled.
        Ok(MetricsLine::KernelWarmup(_)) => true,
        Ok(MetricsLine::Epoch(e)) => {
            let end = e.epoch as u64 * steps_per_epoch + e.steps as u64;
            end <= step && (e.steps as u64 == steps_per_epoch || end >= total_steps)
        }
        Err(_) if line.trim().is_empty() => false,
        Err(e) => {
            tracing::warn!(
                "{}:{}: not a metrics line ({e}); kept as it is",
                path.display(),
                index + 1
            );
            true
        }
    }
}

/// The live progress line: step, reward, tie rate, tokens/s and ETA.
pub fn progress_line(m: &StepMetrics, total_steps: u64, secs_per_step: f64) -> String {
    let done = m.step + 1;
    let eta = secs_per_step * total_steps.saturating_sub(done) as f64;
    let secs = m.rollout_secs + m.judge_secs + m.update_secs;
    // Dynamic sampling: what it dropped and drew.
    let dynamic = match (
        m.dynamic_groups_dropped,
        m.dynamic_prompts_drawn,
        m.dynamic_rounds,
    ) {
        (Some(d), Some(x), Some(r)) => format!("  dropped {d}, drew {x} (rounds {r})"),
        _ => String::new(),
    };
    format!(
        "step {done}/{total_steps}  reward {:+.3} (pop. std {:.3})  ties {}/{} ({:.1}%)  accepted {}{dynamic}  len {:.0}  unscored {}  {:.0} tok/s  grad {:.3}  lr {:.2e}  ETA {}",
        m.reward_mean,
        m.reward_std_population,
        m.ties.tied_groups,
        m.ties.groups,
        100.0 * m.ties.tie_rate(),
        m.ties.accepted,
        m.response_len_mean,
        m.unscored,
        m.response_tokens as f64 / secs.max(1e-9),
        m.grad_norms.last().copied().unwrap_or(0.0),
        m.lr,
        format_secs(eta)
    )
}

/// The line printed after a validation round: both judges' scores.
pub fn validation_progress_line(v: &ValidationLine) -> String {
    let score = |j: &conrub_contracts::JudgeScore| match (j.score, j.score_std) {
        (Some(s), Some(sd)) => format!("{s:+.3} ± {sd:.3} ({} scored)", j.scored),
        _ => format!(
            "unscored ({} of {}: {})",
            j.unscored,
            j.scored + j.unscored,
            j.error.as_deref().unwrap_or("no labels")
        ),
    };
    format!(
        "eval after step {}: {} prompts x {}  training judge {}  grader {}  len {:.0}",
        v.step,
        v.prompts,
        v.responses / v.prompts.max(1),
        score(&v.training),
        score(&v.grader),
        v.response_len_mean
    )
}

fn format_secs(s: f64) -> String {
    let s = s.max(0.0).round() as u64;
    format!("{}:{:02}:{:02}", s / 3600, (s / 60) % 60, s % 60)
}

#[cfg(test)]
mod tests {
    use super::*;
    use conrub_contracts::EpochSummary;

    fn step(i: u64, reward: f64) -> StepMetrics {
        StepMetrics {
            step: i,
            reward_mean: reward,
            responses: 8,
            scored: 8,
            ..Default::default()
        }
    }

    #[test]
    fn resume_drops_lines_written_after_the_state() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("metrics.jsonl");
        let log = MetricsLog::open(&p, None, 2, 5).unwrap();
        // Two steps per epoch; a run of 5 steps wrote a partial summary of epoch 2 (1 step).
        for i in 0..5 {
            log.append(&MetricsLine::Step {
                epoch: i as usize / 2,
                metrics: Box::new(step(i, i as f64 / 10.0)),
            })
            .unwrap();
            if i % 2 == 1 || i == 4 {
                let steps = if i == 4 { 1 } else { 2 };
                log.append(&MetricsLine::Epoch(EpochSummary {
                    epoch: i as usize / 2,
                    steps,
                    ..Default::default()
                }))
                .unwrap();
            }
        }
        let epochs = |p: &Path| -> Vec<usize> {
            std::fs::read_to_string(p)
                .unwrap()
                .lines()
                .filter_map(|l| match serde_json::from_str::<MetricsLine>(l).unwrap() {
                    MetricsLine::Epoch(e) => Some(e.epoch),
                    _ => None,
                })
                .collect()
        };
        assert_eq!(epochs(&p), vec![0, 1, 2]);
        // Resumed at the end of that run (nothing left to run): every line stays.
        MetricsLog::open(&p, Some(5), 2, 5).unwrap();
        assert_eq!(epochs(&p), vec![0, 1, 2]);
        // Resumed at 5 for a longer run: the partial summary of epoch 2 goes (epoch 2 ends later).
        MetricsLog::open(&p, Some(5), 2, 6).unwrap();
        assert_eq!(epochs(&p), vec![0, 1]);
        // Resumed from the state after 3 steps: epoch 1 ends after 4, so only epoch 0's summary
        // survives, and steps 0-2.
        let log = MetricsLog::open(&p, Some(3), 2, 6).unwrap();
        assert_eq!(
            log.steps()
                .unwrap()
                .iter()
                .map(|m| m.step)
                .collect::<Vec<_>>(),
            vec![0, 1, 2]
        );
        assert_eq!(epochs(&p), vec![0]);
        let e = EpochSummary::from_steps(0, &[step(0, 0.5), step(1, 1.0)]);
        assert_eq!(e.reward_mean, 0.75);
    }

    /// Issue 53, item 1: a resume kept only the lines that parsed, and a step whose loss or
    /// reward std was not finite is written with `null` (JSON has no NaN), so it was deleted.
    #[test]
    fn resume_keeps_non_finite_metrics_and_lines_it_cannot_read() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("metrics.jsonl");
        let log = MetricsLog::open(&p, None, 10, 10).unwrap();
        for i in 0..3 {
            let mut m = step(i, 0.1);
            m.loss = if i == 0 { f64::NAN } else { 1.0 };
            m.reward_std_population = if i == 1 { f64::INFINITY } else { 0.5 };
            m.grad_norms = vec![f64::NAN, 2.0];
            let line = MetricsLine::Step {
                epoch: 0,
                metrics: Box::new(m),
            };
            log.append(&line).unwrap();
        }
        let text = std::fs::read_to_string(&p).unwrap();
        assert!(
            text.lines().next().unwrap().contains("\"loss\":null"),
            "{text}"
        );
        // A user's note between the lines, and the torn tail of a write killed mid-line.
        let mut lines: Vec<&str> = text.lines().collect();
        lines.insert(1, "# tried lr 3e-6 here");
        let torn = "{\"kind\":\"step\",\"epoch\":0,\"ste";
        let text = format!("{}\n{torn}", lines.join("\n"));
        std::fs::write(&p, &text).unwrap();

        let log = MetricsLog::open(&p, Some(2), 10, 10).unwrap();
        let after = std::fs::read_to_string(&p).unwrap();
        assert!(
            after.contains("# tried lr 3e-6 here") && after.contains(torn),
            "{after}"
        );
        let steps = log.steps().unwrap();
        let ids: Vec<u64> = steps.iter().map(|m| m.step).collect();
        assert_eq!(
            ids,
            vec![0, 1],
            "step 2 goes (the resumed run writes it again)"
        );
        assert!(steps[0].loss.is_nan() && steps[0].grad_norms[0].is_nan());
        assert!(steps[1].reward_std_population.is_nan(), "null reads as NaN");
        assert_eq!(steps[1].loss, 1.0);
    }

    #[test]
    fn the_progress_line_says_step_reward_and_eta() {
        let mut m = step(2, 0.75);
        m.lr = 3e-6;
        let line = progress_line(&m, 10, 2.0);
        assert!(
            line.starts_with("step 3/10  reward +0.750")
                && line.contains("lr 3.00e-6")
                && line.contains("ETA 0:00:14"),
            "{line}"
        );
    }
}
