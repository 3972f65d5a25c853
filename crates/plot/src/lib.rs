//! Training curves of a conrub run, drawn from its `metrics.jsonl` (the learner writes metrics;
//! plotting is a separate step, run at checkpoints, at the end and by `conrub plot RUN_DIR`).
//!
//! [`plot_run`] reads `RUN_DIR/metrics.jsonl` and writes one SVG per curve of [`CURVES`] into the
//! same directory (atomically: a reader never sees half a file); [`plot_steps`] draws given steps.

use std::path::{Path, PathBuf};

use conrub_grpo::{MetricsLine, StepMetrics};
use plotters::prelude::*;

/// What can go wrong while plotting a run.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// The metrics file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A chart could not be written (the error names the file).
    #[error(transparent)]
    Write(conrub_rubric::RubricError),
    /// A line of the metrics file is not a metrics line.
    #[error("{path}:{line}: not a metrics line: {source}")]
    Line {
        /// The metrics file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The cause.
        source: serde_json::Error,
    },
    /// plotters failed to draw a chart.
    #[error("{path}: drawing failed: {source}")]
    Draw {
        /// The chart's file.
        path: PathBuf,
        /// plotters' error.
        source: DrawError,
    },
}

/// What plotters reports when a chart cannot be drawn.
pub type DrawError = Box<dyn std::error::Error + Send + Sync>;

/// One curve: its file name, title, y-axis label and the value it plots per step.
#[derive(Clone, Copy)]
pub struct Curve {
    /// File name in the run directory.
    pub file: &'static str,
    /// Chart title.
    pub title: &'static str,
    /// Y-axis label.
    pub y_label: &'static str,
    /// The plotted value of a step.
    pub value: fn(&StepMetrics) -> f64,
}

/// The curves of a run (docs/METHOD.md §7's telemetry).
pub const CURVES: [Curve; 4] = [
    Curve {
        file: "reward.svg",
        title: "Mean reward",
        y_label: "reward",
        value: |m| m.reward_mean,
    },
    Curve {
        file: "tie_rate.svg",
        title: "Exact-tie rate",
        y_label: "tied groups / groups",
        value: |m| m.ties.tie_rate(),
    },
    Curve {
        file: "accepted_pairs.svg",
        title: "Accepted pairwise preferences",
        y_label: "pairs",
        value: |m| m.ties.accepted as f64,
    },
    Curve {
        file: "response_length.svg",
        title: "Mean response length",
        y_label: "tokens",
        value: |m| m.response_len_mean,
    },
];

/// The step lines of a metrics file, in order (epoch summaries skipped).
pub fn read_steps(metrics: &Path) -> Result<Vec<StepMetrics>, PlotError> {
    let text = std::fs::read_to_string(metrics).map_err(|source| PlotError::Io {
        path: metrics.to_path_buf(),
        source,
    })?;
    let mut steps = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<MetricsLine>(line) {
            Ok(MetricsLine::Step { metrics, .. }) => steps.push(*metrics),
            Ok(MetricsLine::Epoch(_)) => {}
            Err(source) => {
                return Err(PlotError::Line {
                    path: metrics.to_path_buf(),
                    line: i + 1,
                    source,
                })
            }
        }
    }
    Ok(steps)
}

/// Draws every curve of `run_dir/metrics.jsonl` into `run_dir`; returns the files written.
pub fn plot_run(run_dir: &Path) -> Result<Vec<PathBuf>, PlotError> {
    let steps = read_steps(&run_dir.join("metrics.jsonl"))?;
    plot_steps(&steps, run_dir)
}

/// Draws every curve of `steps` into `dir`; returns the files written.
pub fn plot_steps(steps: &[StepMetrics], dir: &Path) -> Result<Vec<PathBuf>, PlotError> {
    CURVES
        .iter()
        .map(|c| {
            let path = dir.join(c.file);
            let points: Vec<(f64, f64)> = steps
                .iter()
                .map(|m| ((m.step + 1) as f64, (c.value)(m)))
                .collect();
            let svg = line_chart(c, &points).map_err(|source| PlotError::Draw {
                path: path.clone(),
                source,
            })?;
            conrub_rubric::io::write_bytes_atomic(&path, svg.as_bytes())
                .map_err(PlotError::Write)?;
            Ok(path)
        })
        .collect()
}

/// A range that contains `values` with a margin, and is never empty.
fn padded_range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), v| {
            (l.min(v), h.max(v))
        });
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    let pad = ((hi - lo) * 0.05)
        .max(1e-9)
        .max(if hi == lo { 0.5 } else { 0.0 });
    (lo - pad, hi + pad)
}

/// One line chart of `points` (step, value) as an SVG document.
fn line_chart(curve: &Curve, points: &[(f64, f64)]) -> Result<String, DrawError> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (640, 360)).into_drawing_area();
        root.fill(&WHITE)?;
        let (x0, x1) = match (points.first(), points.last()) {
            (Some(a), Some(b)) if b.0 > a.0 => (a.0, b.0),
            (Some(a), _) => (a.0 - 0.5, a.0 + 0.5),
            _ => (0.0, 1.0),
        };
        let (y0, y1) = padded_range(points.iter().map(|p| p.1));
        let mut chart = ChartBuilder::on(&root)
            .caption(curve.title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(x0..x1, y0..y1)?;
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc(curve.y_label)
            .light_line_style(WHITE.mix(0.0))
            .draw()?;
        chart.draw_series(LineSeries::new(
            points.iter().copied(),
            BLUE.stroke_width(2),
        ))?;
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 3, BLUE.filled())))?;
        root.present()?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(i: u64, reward: f64) -> StepMetrics {
        StepMetrics {
            step: i,
            reward_mean: reward,
            response_len_mean: 10.0 + i as f64,
            ..Default::default()
        }
    }

    fn metrics_file(dir: &Path, steps: &[StepMetrics]) -> PathBuf {
        let lines: Vec<String> = steps
            .iter()
            .map(|m| {
                serde_json::to_string(&MetricsLine::Step {
                    epoch: 0,
                    metrics: Box::new(m.clone()),
                })
                .unwrap()
            })
            .collect();
        let path = dir.join("metrics.jsonl");
        std::fs::write(&path, lines.join("\n") + "\n").unwrap();
        path
    }

    #[test]
    fn a_run_directory_gets_one_svg_per_curve_with_every_step() {
        let d = tempfile::tempdir().unwrap();
        metrics_file(d.path(), &[step(0, -0.5), step(1, 0.25), step(2, 0.75)]);
        let files = plot_run(d.path()).unwrap();
        assert_eq!(files.len(), CURVES.len());
        let svg = std::fs::read_to_string(d.path().join("reward.svg")).unwrap();
        assert!(svg.contains("<svg") && svg.contains("Mean reward"), "{svg}");
        // The line passes through three points, each also drawn as a marker.
        let line = svg
            .lines()
            .find(|l| l.contains("<polyline") && l.contains("#0000FF"))
            .expect("the data line (blue)");
        assert_eq!(line.matches(',').count(), 3, "{line}");
        assert_eq!(svg.matches("<circle").count(), 3);
    }

    #[test]
    fn a_bad_line_is_an_error_naming_file_and_line() {
        let d = tempfile::tempdir().unwrap();
        let path = metrics_file(d.path(), &[step(0, 0.1)]);
        let mut text = std::fs::read_to_string(&path).unwrap();
        text.push_str("{\"kind\": \"step\", \"step\": \"x\"}\n");
        std::fs::write(&path, text).unwrap();
        let e = plot_run(d.path()).unwrap_err().to_string();
        assert!(e.contains("metrics.jsonl:2:"), "{e}");
    }

    #[test]
    fn one_step_and_flat_curves_still_draw() {
        let d = tempfile::tempdir().unwrap();
        let files = plot_steps(&[step(0, 0.0)], d.path()).unwrap();
        assert_eq!(files.len(), 4);
        let none = plot_steps(&[], d.path()).unwrap();
        assert_eq!(none.len(), 4);
    }
}
