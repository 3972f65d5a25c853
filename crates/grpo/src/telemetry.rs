//! Telemetry: a JSONL metrics file (one line per step, one per finished epoch), a live progress line,
//! and SVG plots of reward, tie rate, accepted pairs and response length next to the metrics.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{GrpoError, Result};
use crate::group::TieStats;
use crate::learner::StepMetrics;

/// One line of the metrics file.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum MetricsLine {
    /// A training step.
    Step {
        /// Epoch the step belongs to.
        epoch: usize,
        /// The step's metrics.
        #[serde(flatten)]
        metrics: Box<StepMetrics>,
    },
    /// A finished epoch.
    Epoch(EpochSummary),
}

/// Per-epoch totals.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct EpochSummary {
    /// Epoch index.
    pub epoch: usize,
    /// Steps in the epoch.
    pub steps: usize,
    /// Mean reward over scored responses.
    pub reward_mean: f64,
    /// Scored responses.
    pub scored: usize,
    /// Unscored responses.
    pub unscored: usize,
    /// Tie statistics summed over the epoch.
    pub ties: TieStats,
    /// Mean response length.
    pub response_len_mean: f64,
    /// Truncated responses.
    pub truncated: usize,
}

impl EpochSummary {
    /// Sums steps.
    pub fn from_steps(epoch: usize, steps: &[StepMetrics]) -> Self {
        let mut s = EpochSummary {
            epoch,
            steps: steps.len(),
            ..Default::default()
        };
        let (mut reward, mut len, mut n) = (0.0, 0.0, 0usize);
        for m in steps {
            reward += m.reward_mean * m.scored as f64;
            len += m.response_len_mean * m.responses as f64;
            n += m.responses;
            s.scored += m.scored;
            s.unscored += m.unscored;
            s.truncated += m.truncated;
            s.ties.merge(&m.ties);
        }
        s.reward_mean = if s.scored > 0 {
            reward / s.scored as f64
        } else {
            0.0
        };
        s.response_len_mean = if n > 0 { len / n as f64 } else { 0.0 };
        s
    }
}

/// The metrics file.
pub struct MetricsLog {
    path: PathBuf,
}

impl MetricsLog {
    /// Opens `path`. When resuming at `resume_step` (steps completed by the restored state) for a
    /// run of `total_steps`, lines that the resumed run writes again are dropped, so the file ends
    /// with exactly one line per step and per epoch: step lines of later steps, summaries ending
    /// after `resume_step`, and summaries of a partial epoch (written when a run stopped early)
    /// unless the resumed run ends right there (`steps_per_epoch` steps per epoch).
    pub fn open(
        path: &Path,
        resume_step: Option<u64>,
        steps_per_epoch: u64,
        total_steps: u64,
    ) -> Result<Self> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| GrpoError::io(dir, e))?;
        }
        match resume_step {
            Some(step) if path.exists() => {
                let text = std::fs::read_to_string(path).map_err(|e| GrpoError::io(path, e))?;
                let kept: Vec<&str> = text
                    .lines()
                    .filter(|l| match serde_json::from_str::<MetricsLine>(l) {
                        Ok(MetricsLine::Step { metrics, .. }) => metrics.step < step,
                        Ok(MetricsLine::Epoch(e)) => {
                            let end = e.epoch as u64 * steps_per_epoch + e.steps as u64;
                            end <= step && (e.steps as u64 == steps_per_epoch || end >= total_steps)
                        }
                        Err(_) => false,
                    })
                    .collect();
                let mut body = kept.join("\n");
                if !body.is_empty() {
                    body.push('\n');
                }
                conrub_rubric::io::write_bytes_atomic(path, body.as_bytes())
                    .map_err(|e| GrpoError::io(path, e))?;
            }
            Some(_) => {}
            None => {
                conrub_rubric::io::write_bytes_atomic(path, b"")
                    .map_err(|e| GrpoError::io(path, e))?;
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
            .map_err(|e| GrpoError::io(&self.path, e))?;
        let mut s = serde_json::to_string(line).map_err(|e| GrpoError::io(&self.path, e))?;
        s.push('\n');
        f.write_all(s.as_bytes())
            .and_then(|_| f.sync_data())
            .map_err(|e| GrpoError::io(&self.path, e))
    }

    /// All step metrics in the file, in order.
    pub fn steps(&self) -> Result<Vec<StepMetrics>> {
        let text = std::fs::read_to_string(&self.path).map_err(|e| GrpoError::io(&self.path, e))?;
        Ok(text
            .lines()
            .filter_map(|l| match serde_json::from_str::<MetricsLine>(l) {
                Ok(MetricsLine::Step { metrics, .. }) => Some(*metrics),
                _ => None,
            })
            .collect())
    }
}

/// The live progress line: step, reward, tie rate, tokens/s and ETA.
pub fn progress_line(m: &StepMetrics, total_steps: u64, secs_per_step: f64) -> String {
    let done = m.step + 1;
    let eta = secs_per_step * total_steps.saturating_sub(done) as f64;
    let secs = m.rollout_secs + m.judge_secs + m.update_secs;
    format!(
        "step {done}/{total_steps}  reward {:+.3} (pop. std {:.3})  ties {}/{} ({:.1}%)  accepted {}  len {:.0}  unscored {}  {:.0} tok/s  grad {:.3}  ETA {}",
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
        format_secs(eta)
    )
}

fn format_secs(s: f64) -> String {
    let s = s.max(0.0).round() as u64;
    format!("{}:{:02}:{:02}", s / 3600, (s / 60) % 60, s % 60)
}

/// A line chart as a standalone SVG.
pub fn svg_line_chart(title: &str, y_label: &str, points: &[(f64, f64)]) -> String {
    let (w, h, left, right, top, bottom) = (640.0, 360.0, 64.0, 16.0, 36.0, 44.0);
    let (pw, ph) = (w - left - right, h - top - bottom);
    let xs = points.iter().map(|p| p.0);
    let ys = points.iter().map(|p| p.1).filter(|y| y.is_finite());
    let (x0, x1) = (
        xs.clone().fold(f64::INFINITY, f64::min),
        xs.fold(f64::NEG_INFINITY, f64::max),
    );
    let (mut y0, mut y1) = (
        ys.clone().fold(f64::INFINITY, f64::min),
        ys.fold(f64::NEG_INFINITY, f64::max),
    );
    if !y0.is_finite() {
        (y0, y1) = (0.0, 1.0);
    }
    if y1 - y0 < 1e-12 {
        y0 -= 0.5;
        y1 += 0.5;
    }
    let x1 = if x1 - x0 < 1e-12 { x0 + 1.0 } else { x1 };
    let px = |x: f64| left + (x - x0) / (x1 - x0) * pw;
    let py = |y: f64| top + (1.0 - (y - y0) / (y1 - y0)) * ph;
    let path: Vec<String> = points
        .iter()
        .filter(|p| p.1.is_finite())
        .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
        .collect();
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">{}</text>\n\
         <line x1=\"{left}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n\
         <line x1=\"{left}\" y1=\"{top}\" x2=\"{left}\" y2=\"{}\" stroke=\"black\"/>\n",
        w / 2.0,
        escape(title),
        top + ph,
        left + pw,
        top + ph,
        top + ph
    );
    for i in 0..=4 {
        let y = y0 + (y1 - y0) * i as f64 / 4.0;
        s += &format!(
            "<line x1=\"{left}\" y1=\"{0:.1}\" x2=\"{1}\" y2=\"{0:.1}\" stroke=\"#ddd\"/><text x=\"{2}\" y=\"{3:.1}\" text-anchor=\"end\">{4:.3}</text>\n",
            py(y),
            left + pw,
            left - 6.0,
            py(y) + 4.0,
            y
        );
    }
    for i in 0..=4 {
        let x = x0 + (x1 - x0) * i as f64 / 4.0;
        s += &format!(
            "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{:.0}</text>\n",
            px(x),
            top + ph + 16.0,
            x
        );
    }
    s += &format!(
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">step</text>\n",
        left + pw / 2.0,
        h - 8.0
    );
    s += &format!("<text x=\"14\" y=\"{}\" transform=\"rotate(-90 14 {})\" text-anchor=\"middle\">{}</text>\n", top + ph / 2.0, top + ph / 2.0, escape(y_label));
    if !path.is_empty() {
        s += &format!(
            "<polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"2\" points=\"{}\"/>\n",
            path.join(" ")
        );
    }
    s + "</svg>\n"
}

fn escape(t: &str) -> String {
    t.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Writes `reward.svg`, `tie_rate.svg`, `accepted_pairs.svg` and `response_length.svg` into `dir`.
pub fn write_plots(steps: &[StepMetrics], dir: &Path) -> Result<Vec<PathBuf>> {
    let series = |f: &dyn Fn(&StepMetrics) -> f64| -> Vec<(f64, f64)> {
        steps.iter().map(|m| ((m.step + 1) as f64, f(m))).collect()
    };
    let charts: [(&str, &str, &str, Vec<(f64, f64)>); 4] = [
        (
            "reward.svg",
            "Mean reward",
            "reward",
            series(&|m| m.reward_mean),
        ),
        (
            "tie_rate.svg",
            "Exact-tie rate",
            "tied groups / groups",
            series(&|m| m.ties.tie_rate()),
        ),
        (
            "accepted_pairs.svg",
            "Accepted pairwise preferences",
            "pairs",
            series(&|m| m.ties.accepted as f64),
        ),
        (
            "response_length.svg",
            "Mean response length",
            "tokens",
            series(&|m| m.response_len_mean),
        ),
    ];
    let mut written = Vec::new();
    for (name, title, label, pts) in charts {
        let path = dir.join(name);
        conrub_rubric::io::write_bytes_atomic(&path, svg_line_chart(title, label, &pts).as_bytes())
            .map_err(|e| GrpoError::io(&path, e))?;
        written.push(path);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn plots_are_svg_with_the_data() {
        let d = tempfile::tempdir().unwrap();
        let files = write_plots(&[step(0, -0.5), step(1, 0.25), step(2, 0.75)], d.path()).unwrap();
        assert_eq!(files.len(), 4);
        let svg = std::fs::read_to_string(d.path().join("reward.svg")).unwrap();
        assert!(
            svg.starts_with("<svg") && svg.contains("<polyline") && svg.contains("Mean reward")
        );
        assert!(svg.matches(',').count() >= 3, "three points");
        let line = progress_line(&step(2, 0.75), 10, 2.0);
        assert!(
            line.starts_with("step 3/10  reward +0.750") && line.contains("ETA 0:00:14"),
            "{line}"
        );
    }
}
