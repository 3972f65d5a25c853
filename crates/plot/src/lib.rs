//! Training curves of a conrub run, drawn from its `metrics.jsonl` (the learner writes metrics;
//! plotting is a separate step, run at checkpoints, at the end and by `conrub plot RUN_DIR`).
//!
//! [`plot_run`] reads `RUN_DIR/metrics.jsonl` and writes one SVG per curve of [`CURVES`] into the
//! same directory (atomically: a reader never sees half a file), plus `eval.svg` (the validation
//! scores of the training judge and of the grader, see `[eval]`) when the run validates;
//! [`plot_steps`] and [`plot_validation`] draw given lines.

use std::path::{Path, PathBuf};

use conrub_contracts::{MetricsLine, StepMetrics, ValidationLine};
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

/// The step lines of a metrics file, in order (epoch summaries and validation lines skipped).
pub fn read_steps(metrics: &Path) -> Result<Vec<StepMetrics>, PlotError> {
    Ok(read_run(metrics)?.0)
}

/// The step lines and the validation lines of a metrics file, each in order.
pub fn read_run(metrics: &Path) -> Result<(Vec<StepMetrics>, Vec<ValidationLine>), PlotError> {
    let text = std::fs::read_to_string(metrics).map_err(|source| PlotError::Io {
        path: metrics.to_path_buf(),
        source,
    })?;
    let (mut steps, mut evals) = (Vec::new(), Vec::new());
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<MetricsLine>(line) {
            Ok(MetricsLine::Step { metrics, .. }) => steps.push(*metrics),
            Ok(MetricsLine::Epoch(_) | MetricsLine::KernelWarmup(_)) => {}
            Ok(MetricsLine::Eval(e)) => evals.push(e),
            Err(source) => {
                return Err(PlotError::Line {
                    path: metrics.to_path_buf(),
                    line: i + 1,
                    source,
                })
            }
        }
    }
    Ok((steps, evals))
}

/// Draws every curve of `run_dir/metrics.jsonl` into `run_dir`; returns the files written.
pub fn plot_run(run_dir: &Path) -> Result<Vec<PathBuf>, PlotError> {
    let (steps, evals) = read_run(&run_dir.join("metrics.jsonl"))?;
    let mut files = plot_steps(&steps, run_dir)?;
    if !evals.is_empty() {
        files.push(plot_validation(&evals, run_dir)?);
    }
    Ok(files)
}

/// The file name of the validation chart.
pub const VALIDATION_CHART: &str = "eval.svg";

/// Draws the validation scores of `evals` (the training judge in red, the grader in blue; an
/// unscored round leaves a gap in its judge's points) into `dir/eval.svg`.
pub fn plot_validation(evals: &[ValidationLine], dir: &Path) -> Result<PathBuf, PlotError> {
    let points = |score: fn(&ValidationLine) -> Option<f64>| -> Vec<(f64, f64)> {
        evals
            .iter()
            .filter_map(|e| Some((e.step as f64, score(e)?)))
            .collect()
    };
    let series = [
        Series {
            name: "training judge",
            color: RED,
            points: points(|e| e.training.score),
        },
        Series {
            name: "grader",
            color: BLUE,
            points: points(|e| e.grader.score),
        },
    ];
    write_chart(
        &dir.join(VALIDATION_CHART),
        "Validation score (held-out prompts)",
        "score",
        &series,
    )
}

/// One line of a chart.
struct Series {
    name: &'static str,
    color: RGBColor,
    points: Vec<(f64, f64)>,
}

fn write_chart(
    path: &Path,
    title: &str,
    y_label: &str,
    series: &[Series],
) -> Result<PathBuf, PlotError> {
    let svg = line_chart(title, y_label, series).map_err(|source| PlotError::Draw {
        path: path.to_path_buf(),
        source,
    })?;
    conrub_rubric::io::write_bytes_atomic(path, svg.as_bytes()).map_err(PlotError::Write)?;
    Ok(path.to_path_buf())
}

/// Draws every curve of `steps` into `dir`; returns the files written.
pub fn plot_steps(steps: &[StepMetrics], dir: &Path) -> Result<Vec<PathBuf>, PlotError> {
    CURVES
        .iter()
        .map(|c| {
            let points: Vec<(f64, f64)> = steps
                .iter()
                .map(|m| ((m.step + 1) as f64, (c.value)(m)))
                .collect();
            let series = [Series {
                name: c.y_label,
                color: BLUE,
                points,
            }];
            write_chart(&dir.join(c.file), c.title, c.y_label, &series)
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

/// A line chart of `series` (step, value) as an SVG document; with two or more series, a legend
/// names them.
fn line_chart(title: &str, y_label: &str, series: &[Series]) -> Result<String, DrawError> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (640, 360)).into_drawing_area();
        root.fill(&WHITE)?;
        let all = || series.iter().flat_map(|s| s.points.iter());
        let lo = all().map(|p| p.0).fold(f64::INFINITY, f64::min);
        let hi = all().map(|p| p.0).fold(f64::NEG_INFINITY, f64::max);
        let (x0, x1) = match (lo.is_finite(), hi > lo) {
            (true, true) => (lo, hi),
            (true, false) => (lo - 0.5, lo + 0.5),
            _ => (0.0, 1.0),
        };
        let (y0, y1) = padded_range(all().map(|p| p.1));
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(x0..x1, y0..y1)?;
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc(y_label)
            .light_line_style(WHITE.mix(0.0))
            .draw()?;
        for s in series {
            let color = s.color;
            chart
                .draw_series(LineSeries::new(
                    s.points.iter().copied(),
                    color.stroke_width(2),
                ))?
                .label(s.name)
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color));
            chart.draw_series(s.points.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
        }
        if series.len() > 1 {
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .draw()?;
        }
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
    fn validation_lines_get_a_chart_with_both_judges() {
        let d = tempfile::tempdir().unwrap();
        let path = metrics_file(d.path(), &[step(0, 0.1), step(1, 0.2)]);
        let eval = |s: u64, grader: Option<f64>| {
            let mut e = ValidationLine {
                step: s,
                ..Default::default()
            };
            e.training.score = Some(0.1 * s as f64);
            e.grader.score = grader;
            serde_json::to_string(&MetricsLine::Eval(e)).unwrap()
        };
        let mut text = std::fs::read_to_string(&path).unwrap();
        text += &format!("{}\n{}\n", eval(1, Some(0.5)), eval(2, None));
        std::fs::write(&path, text).unwrap();
        let files = plot_run(d.path()).unwrap();
        assert_eq!(files.len(), CURVES.len() + 1);
        let svg = std::fs::read_to_string(d.path().join(VALIDATION_CHART)).unwrap();
        assert!(
            svg.contains("training judge") && svg.contains("grader"),
            "{svg}"
        );
        // Two training-judge points (red), one grader point (blue; the unscored round is a gap).
        assert_eq!(svg.matches("<circle").count(), 3, "{svg}");
        assert_eq!(svg.matches("fill=\"#FF0000\"").count(), 2, "{svg}");
        // Without validation lines, no chart.
        let e = tempfile::tempdir().unwrap();
        metrics_file(e.path(), &[step(0, 0.1)]);
        assert_eq!(plot_run(e.path()).unwrap().len(), CURVES.len());
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
