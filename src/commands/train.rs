//! `conrub train`: GRPO with rubric rewards on a policy of any `conrub_models` family. The config is
//! [`conrub_config::TrainConfig`]; the run is [`conrub_trainer::Trainer`]. This file parses the
//! arguments, makes the checks that need no model (the records, the run folder, the memory plan),
//! picks the backend and decides the kernel warm-up.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use conrub_config::{RolloutEngineKind, TrainConfig};
use conrub_grpo::GrpoError;
use conrub_trainer::Trainer;

use crate::backend::{run_on_devices, DevicesTask, RankCollective};

/// Arguments of `conrub train`.
#[derive(Args)]
pub struct TrainArgs {
    /// Train config (TOML), e.g. `configs/demo-cpu.toml` or `configs/conrub-med-qwen3-4b.toml`.
    #[arg(long)]
    pub config: PathBuf,
    /// Continue from a checkpoint directory (`output_dir/checkpoint-NNNNNN`), or `auto`: the
    /// newest complete checkpoint of `run.output_dir`, or a fresh run when it holds none (the
    /// same command restarts a preempted job).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Start a fresh run in an output folder that holds an earlier run, deleting its metrics and
    /// checkpoints (without it such a folder is refused; `--resume` continues it instead).
    #[arg(long, conflicts_with = "resume")]
    pub overwrite: bool,
    /// Device (overrides the config's `device` or `devices`).
    #[arg(long, conflicts_with = "devices")]
    pub device: Option<String>,
    /// Data-parallel devices, one rank each, all of one backend: `cuda:0,cuda:1,cuda:2,cuda:3`
    /// (`cpu,cpu` simulates two ranks); overrides the config's `device` or `devices`.
    #[arg(long, value_delimiter = ',')]
    pub devices: Option<Vec<String>>,
    /// Override a config value: `--set learner.lr=1e-6 --set run.max_steps=10` (TOML values).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Device memory for the memory plan checked before the first step (`conrub plan`); on
    /// `cuda` devices the default is the device's own total memory as its driver reports it (an
    /// 80 GB H100 is checked against 80 GB, not an H200's 141), elsewhere the plan is checked
    /// only when this is given.
    #[arg(long)]
    pub gpu_memory_gb: Option<f64>,
    /// The kernel warm-up before the first step: `auto` (on cuda and wgpu when the device's
    /// kernel cache holds nothing, with the in-process rollout engine), `always` (any backend),
    /// `never`. See `conrub kernels-warmup`.
    #[arg(long, value_enum, default_value = "auto")]
    pub kernel_warmup: KernelWarmup,
}

/// When the kernel warm-up runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KernelWarmup {
    /// Before the first step when the kernel cache was cold (CubeCL backends, in-process
    /// rollouts).
    Auto,
    /// Before the first step, on any backend.
    Always,
    /// Never.
    Never,
    /// The warm-up alone, then exit (`conrub kernels-warmup`).
    #[value(skip)]
    Only,
}

/// Runs `conrub train`.
pub fn run(a: TrainArgs) -> Result<()> {
    let kernel_warmup = a.kernel_warmup;
    run_with(a, kernel_warmup)
}

/// `conrub train`'s checks and set-up, with the kernel warm-up as `kernel_warmup` says.
pub(crate) fn run_with(a: TrainArgs, kernel_warmup: KernelWarmup) -> Result<()> {
    let mut cfg = TrainConfig::from_file(&a.config, &a.overrides)?;
    if let Some(ds) = a.devices.or(a.device.map(|d| vec![d])) {
        cfg.set_devices(ds)?;
    }
    // Fail before loading anything when training needs what the file lacks, or on records
    // `conrub rubrics validate` rejects.
    let checked = conrub_trainer::check_data(&cfg)?;
    cfg.judge()?;
    super::check_plugins(&cfg)?;
    cfg.run.overwrite = a.overwrite;
    let mut resume = a.resume;
    if kernel_warmup != KernelWarmup::Only {
        // A run folder that is a file, cannot be written, is in use or holds an earlier run
        // fails now, not after the model loads and the kernel warm-up.
        if cfg.run.output_dir.as_os_str().is_empty() {
            let why = "is empty (name the folder the run writes to)";
            return Err(GrpoError::config("run.output_dir", why).into());
        }
        let dir = cfg.resolve(&cfg.run.output_dir);
        if resume.as_deref() == Some(std::path::Path::new("auto")) {
            resume = resume_auto(&dir)?;
            // No checkpoint: a fresh run, an earlier attempt's files set aside under the lock.
            cfg.run.set_aside = resume.is_none();
        }
        let replace = a.overwrite || cfg.run.set_aside;
        conrub_trainer::run_folder::check_start(&dir, resume.is_some(), replace)?;
    }
    // Stop before loading anything when the run cannot fit (the table says what to change).
    let kv_pool_blocks = super::plan::check_run_fits(&cfg, a.gpu_memory_gb, &a.config)?;
    crate::backend::set_kernel_cache_config(cfg.kernel_cache.clone());
    let devices = cfg.devices.clone();
    let task = TrainTask {
        cfg,
        checked,
        resume,
        kv_pool_blocks,
        kernel_warmup,
    };
    run_on_devices(&devices, task)
}

/// `--resume auto`: the newest complete checkpoint of the run folder `dir`; `None` (a fresh
/// run, whose claim of the folder sets an earlier attempt's files aside in
/// `dir/attempt-SECONDS/`: nothing is deleted) when it holds none.
fn resume_auto(dir: &std::path::Path) -> Result<Option<PathBuf>> {
    let found = conrub_trainer::run_folder::latest_checkpoint(dir)?;
    match &found {
        Some(ckpt) => tracing::info!("--resume auto: continuing from {}", ckpt.display()),
        None => tracing::info!(
            "--resume auto: {} holds no complete checkpoint; starting a fresh run",
            dir.display()
        ),
    }
    Ok(found)
}

struct TrainTask {
    cfg: TrainConfig,
    /// The records `check_data` read and checked: the trainer does not read them again.
    checked: conrub_trainer::CheckedData,
    resume: Option<PathBuf>,
    /// The memory plan's KV pool, when the device size is known.
    kv_pool_blocks: Option<usize>,
    kernel_warmup: KernelWarmup,
}

impl DevicesTask for TrainTask {
    fn run<B: RankCollective>(self, devices: Vec<B::Device>) -> Result<()> {
        let warm = match self.kernel_warmup {
            KernelWarmup::Only | KernelWarmup::Always => true,
            // With SGLang rollouts the servers compile their own kernels, and a warm-up's weight
            // syncs would leave the engine at a version the run's own first sync could skip.
            KernelWarmup::Auto => {
                crate::backend::kernel_cache_was_cold()
                    && self.cfg.rollout.engine == RolloutEngineKind::Paged
            }
            KernelWarmup::Never => false,
        };
        let collective = (devices.len() > 1).then(|| B::rank_collective(&devices));
        let mut trainer = Trainer::<B>::from_checked(self.cfg, devices, self.checked)?
            .resume_from(self.resume)
            .with_kv_pool_blocks(self.kv_pool_blocks);
        if let Some(c) = collective {
            trainer = trainer.with_collective(c);
        }
        if warm {
            trainer = trainer.warm_kernels()?;
        }
        if self.kernel_warmup != KernelWarmup::Only {
            trainer.run()?;
        }
        Ok(())
    }
}
