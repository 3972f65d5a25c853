//! Shared wiring for commands that use a judge: config loading, device choice, tokio runtime.

use conrub_judge::JudgeBuild;
use std::path::Path;

use anyhow::{Context, Result};
use conrub_judge::{JudgeConfig, Judges};
use conrub_kernels::KernelOps;
use conrub_rubric::RubricSet;

use crate::backend::{run_on_device, BackendTask};

/// Reads a judge config, naming the file in errors.
pub fn load_config(path: &Path) -> Result<JudgeConfig> {
    JudgeConfig::from_file(path).context("judge config")
}

/// A multi-threaded tokio runtime for judge calls.
pub fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}

struct LocalTask<'a, F> {
    cfg: &'a JudgeConfig,
    f: F,
}

impl<F: FnOnce(Judges) -> Result<()>> BackendTask for LocalTask<'_, F> {
    fn run<B: KernelOps>(self, device: B::Device) -> Result<()> {
        let judges = self
            .cfg
            .build_local::<B>(&device)
            .context("building the in-process judge")?;
        (self.f)(judges)
    }
}

/// Builds the configured judges and hands them to `f`. The in-process judge runs on
/// `device` (else the config's `device`, else the CPU).
pub fn with_judges(
    cfg: &JudgeConfig,
    rubrics: &RubricSet,
    device: Option<&str>,
    f: impl FnOnce(Judges) -> Result<()>,
) -> Result<()> {
    if cfg.kind().in_process() {
        let device = device.or(cfg.device()).unwrap_or("cpu").to_string();
        run_on_device(&device, LocalTask { cfg, f })
    } else {
        f(cfg.build(rubrics).context("building the judge")?)
    }
}
