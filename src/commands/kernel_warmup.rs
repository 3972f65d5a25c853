//! `conrub kernels-warmup`: `conrub train`'s set-up, then the kernel warm-up alone
//! ([`conrub_trainer::Trainer::warm_kernels`], whose docs say what it runs and costs); the kernel
//! cache keeps what it compiled for the run that follows. `conrub train` runs the same warm-up
//! before its first step when the device's kernel cache held no compiled kernel (`backend.rs`).

use anyhow::Result;

/// Arguments of `conrub kernels-warmup`: those of `conrub train` that choose the run.
#[derive(clap::Args)]
pub struct KernelsWarmupArgs {
    /// Train config (TOML): the run whose kernels to compile.
    #[arg(long)]
    pub config: std::path::PathBuf,
    /// Device (overrides the config's).
    #[arg(long)]
    pub device: Option<String>,
    /// Override a config value (as `conrub train --set`).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
}

/// Runs `conrub kernels-warmup`: train's set-up (the memory check included), the warm-up, and
/// the counts; the kernel cache keeps what it compiled for the run that follows.
pub fn run_command(a: KernelsWarmupArgs) -> Result<()> {
    let args = super::train::TrainArgs {
        config: a.config,
        resume: None,
        overwrite: false,
        device: a.device,
        devices: None,
        overrides: a.overrides,
        gpu_memory_gb: None,
        kernel_warmup: super::train::KernelWarmup::Only,
    };
    super::train::run_with(args, super::train::KernelWarmup::Only)
}
