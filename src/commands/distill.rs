//! `conrub judge distill`: a probe judge distilled from a big judge's verdicts (its caches, or a
//! labels file). See `conrub_judge::probe`.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use conrub_judge::probe::{
    distill, examples_from_caches, read_labels, DistillConfig, DistillReport, Pooling,
    ProbeFeaturizer, ProbeTraining,
};
use conrub_judge::PromptSet;
use conrub_kernels::KernelOps;
use conrub_rubric::ScoringMode;

use crate::backend::{parse_precision, run_on_device, BackendTask};

/// `conrub judge ...`.
#[derive(Subcommand)]
pub enum JudgeCommand {
    /// Distil a probe judge from judge caches or a labels file.
    Distill(DistillArgs),
}

/// Arguments of `conrub judge distill`.
#[derive(Args)]
pub struct DistillArgs {
    /// Judge cache (SQLite) to learn from; repeat for several.
    #[arg(
        long = "cache",
        required_unless_present = "labels",
        conflicts_with = "labels"
    )]
    pub caches: Vec<PathBuf>,
    /// Labels file (JSONL of `{prompt_id, prompt, criterion, response, label}`).
    #[arg(long)]
    pub labels: Option<PathBuf>,
    /// The probe's base model: checkpoint directory or hub id (e.g. a local checkpoint directory, or a hub id).
    #[arg(long)]
    pub model: String,
    /// Output directory: probe.safetensors, report.json and the feature store.
    #[arg(long)]
    pub out: PathBuf,
    /// Feature layer (1..=N decoder layers; N = after the final norm); default: sweep.
    #[arg(long)]
    pub layer: Option<usize>,
    /// Feature pooling: last or mean; default: sweep.
    #[arg(long)]
    pub pooling: Option<Pooling>,
    /// Share of prompts held out.
    #[arg(long, default_value_t = 0.2)]
    pub holdout: f64,
    /// Seed of the splits.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// With several judges in the caches: the one to learn from.
    #[arg(long)]
    pub judge_id: Option<String>,
    /// With both label sets in the caches: binary or three-state.
    #[arg(long)]
    pub mode: Option<ScoringMode>,
    /// Fit steps of each probe.
    #[arg(long, default_value_t = ProbeTraining::default().epochs)]
    pub epochs: usize,
    /// L2 penalty of each probe.
    #[arg(long, default_value_t = ProbeTraining::default().l2)]
    pub l2: f64,
    /// Criterion rows per forward pass.
    #[arg(long, default_value_t = 16)]
    pub batch_size: usize,
    /// Device (cpu, wgpu, cuda:0, ...).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Model precision: f32 or bf16-mixed (recorded in the probe: its judge config's `precision`
    /// must be the same).
    #[arg(long, value_parser = parse_precision, default_value = "f32")]
    pub precision: conrub_models::Precision,
    /// Print one JSON report last.
    #[arg(long)]
    pub json: bool,
}

/// Runs `conrub judge ...`.
pub fn run(cmd: JudgeCommand) -> Result<()> {
    match cmd {
        JudgeCommand::Distill(a) => {
            if !(a.holdout > 0.0 && a.holdout < 1.0) {
                bail!("--holdout: {} is not a share in (0, 1)", a.holdout);
            }
            let device = a.device.clone();
            run_on_device(&device, a)
        }
    }
}

impl BackendTask for DistillArgs {
    fn run<B: KernelOps>(self, device: B::Device) -> Result<()> {
        let a = self;
        let (mode, examples, harvest) = match &a.labels {
            Some(p) => {
                let (mode, rows) = read_labels(p)?;
                (mode, rows, None)
            }
            None => {
                let (mode, rows, h) =
                    examples_from_caches(&a.caches, a.judge_id.as_deref(), a.mode)?;
                (mode, rows, Some(h))
            }
        };
        if let Some(h) = &harvest {
            tracing::info!(
                "read {} criterion verdicts ({} rows) from {} cache(s){}",
                h.used_verdicts,
                examples.len(),
                h.caches.len(),
                if h.without_request > 0 {
                    format!(
                        "; {} older verdicts without their request skipped",
                        h.without_request
                    )
                } else {
                    String::new()
                }
            );
        }
        let dir = PathBuf::from(&a.model);
        let qwen = if dir.is_dir() {
            conrub_models::Pretrained::<B>::load_dir(&dir, &device)
        } else {
            conrub_models::Pretrained::<B>::load(&a.model, &device)
        }
        .with_context(|| format!("loading {}", a.model))?;
        let exec = conrub_models::Execution {
            precision: a.precision,
            ..qwen.model.execution()
        };
        let featurizer = ProbeFeaturizer::new(
            qwen.with_execution(exec),
            device,
            PromptSet::default(),
            a.batch_size,
        )?;
        let cfg = DistillConfig {
            layer: a.layer,
            pooling: a.pooling,
            holdout: a.holdout,
            seed: a.seed,
            training: ProbeTraining {
                epochs: a.epochs,
                l2: a.l2,
                ..ProbeTraining::default()
            },
            ..DistillConfig::default()
        };
        let bar = indicatif::ProgressBar::new(examples.len() as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "features {bar:30} {pos}/{len} rows  {per_sec}  eta {eta}",
            )
            .expect("progress template"),
        );
        let report = distill(
            &featurizer,
            &a.model,
            mode,
            &examples,
            &cfg,
            &a.out,
            &mut |done, _| bar.set_position(done as u64),
        );
        bar.finish_and_clear();
        let report = report?;
        for line in describe(&report) {
            tracing::info!("{line}");
        }
        if a.json {
            let mut v = serde_json::to_value(&report)?;
            if let Some(h) = harvest {
                v["caches"] = serde_json::to_value(h)?;
            }
            outln!("{}", serde_json::to_string(&v)?);
        }
        Ok(())
    }
}

fn describe(r: &DistillReport) -> Vec<String> {
    let mut out = vec![format!(
        "features: {} computed, {} reused ({:.1} s); probes fitted in {:.1} s",
        r.features_computed, r.features_reused, r.feature_secs, r.fit_secs
    )];
    for s in &r.sweep {
        out.push(format!(
            "  sweep layer {:>3} {:<4}  validation macro-F1 {:.3}  kappa {:.3}",
            s.layer,
            s.pooling.as_str(),
            s.macro_f1,
            s.kappa
        ));
    }
    let h = &r.heldout;
    out.push(format!(
        "probe: layer {} {} ({}), {} training rows / {} prompts",
        r.probe.layer,
        r.probe.pooling.as_str(),
        r.chosen_by,
        r.train.rows,
        r.train.prompts
    ));
    out.push(format!(
        "held out ({} rows, {} prompts): accuracy {:.3}  macro-F1 {:.3}  kappa {:.3}  ECE {:.3}",
        h.rows, r.heldout_counts.prompts, h.accuracy, h.macro_f1, h.kappa, h.ece
    ));
    for (label, c) in &h.per_class {
        out.push(format!(
            "  {label:<8} support {:>5}  precision {:.3}  recall {:.3}  F1 {:.3}",
            c.support, c.precision, c.recall, c.f1
        ));
    }
    out.push(format!("wrote {}", r.probe_file.display()));
    out
}
