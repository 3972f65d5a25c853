//! Kernel warm-up (not the `[warmup]` supervised steps): before a run's first step on a CubeCL
//! backend, the run's first supervised steps (when it has `[warmup]`: two, so AdamW's step with
//! moments runs too) and one GRPO step, exactly as the run will take them (same learner
//! settings, learning rates and tie mode), on the run's first prompts; then the weights are put
//! back from a host copy taken before (f32, exact). Every kernel and autotune key of those steps
//! is compiled, tuned and kept in the kernel cache while a counter shows progress, instead of
//! during a silent first step. Its rewards and tie verdicts come from a lexical judge with no
//! keyword file (no server is called); nothing is written but the kernel cache.
//!
//! `conrub train` runs it when the device's kernel cache held no compiled kernel (see
//! `backend.rs`); `conrub kernels-warmup --config FILE` runs it alone (train's set-up, then the
//! warm-up, then exit). Its cost: about one step, plus a host copy of the weights (4 bytes per
//! parameter of host memory, and a transfer each way).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, Result};
use burn::backend::Autodiff;
use burn::module::Module;
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use conrub_config::TrainConfig;
use conrub_grpo::{
    sft_warmup, warmup_pairs, JudgeRewards, KernelWarmupLine, Learner, PairwiseTieBreaker,
    RolloutEngine, TieMode,
};
use conrub_judge::LexicalJudge;
use conrub_kernels::GrpoOps;
use conrub_models::{CausalLm, ChatTemplateCodec};
use conrub_rubric::RubricRecord;

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

/// Prints what the warm-up compiled so far while it runs: a spinner line on a terminal, else a
/// plain line every 15 s (a log file shows it too).
struct Ticker {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

fn counts_line(started: Instant) -> String {
    let e = conrub_kernels::events::snapshot().unwrap_or_default();
    format!(
        "kernel warm-up: {} kernels compiled, {} loaded from the cache, {} autotune runs, {:.0} s",
        e.kernel_compiles,
        e.kernel_cache_loads,
        e.autotune_runs,
        started.elapsed().as_secs_f64()
    )
}

impl Ticker {
    fn start() -> Self {
        use std::io::IsTerminal;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let started = Instant::now();
            let bar = std::io::stderr().is_terminal().then(|| {
                let bar = indicatif::ProgressBar::new_spinner();
                bar.enable_steady_tick(std::time::Duration::from_millis(200));
                bar
            });
            let mut last_line = Instant::now();
            while !flag.load(Ordering::Relaxed) {
                std::thread::sleep(std::time::Duration::from_millis(250));
                match &bar {
                    Some(bar) => bar.set_message(counts_line(started)),
                    None if last_line.elapsed().as_secs() >= 15 => {
                        eprintln!("{}", counts_line(started));
                        last_line = Instant::now();
                    }
                    None => {}
                }
            }
            if let Some(bar) = bar {
                bar.finish_and_clear();
            }
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What a warm-up needs of the run's set-up.
pub(super) struct WarmupInputs<'a, B: GrpoOps> {
    pub cfg: &'a TrainConfig,
    pub records: &'a [RubricRecord],
    pub codec: &'a ChatTemplateCodec,
    pub stop_ids: &'a [u32],
    pub engine: Arc<dyn RolloutEngine<B, CausalLm<B>>>,
    pub device: &'a B::Device,
    /// A resumed run: it has no supervised warm-up to warm.
    pub resumed: bool,
}

/// Runs the warm-up on `model` and gives it back unchanged, with the metrics line.
pub(super) fn run<B: GrpoOps>(
    model: CausalLm<Autodiff<B>>,
    inputs: WarmupInputs<'_, B>,
    rt: &tokio::runtime::Runtime,
) -> Result<(CausalLm<Autodiff<B>>, KernelWarmupLine)> {
    let started = Instant::now();
    let before = conrub_kernels::events::snapshot();
    let ticker = Ticker::start();
    let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
    let saved = recorder
        .record(model.clone().into_record(), ())
        .map_err(|e| anyhow!("kernel warm-up: copying the weights to the host: {e}"))?;
    let (model, ran) = steps(model, &inputs, rt)?;
    let record = recorder
        .load(saved, inputs.device)
        .map_err(|e| anyhow!("kernel warm-up: restoring the weights: {e}"))?;
    let model = model.load_record(record);
    drop(ticker);
    let line = KernelWarmupLine {
        resumed: inputs.resumed,
        ran,
        secs: started.elapsed().as_secs_f64(),
        kernels: before
            .zip(conrub_kernels::events::snapshot())
            .map(|(a, b)| b.since(&a)),
    };
    let e = line.kernels.unwrap_or_default();
    eprintln!(
        "kernel warm-up: {} in {:.1} s: {} kernels compiled, {} loaded from the cache, {} autotune runs",
        line.ran, line.secs, e.kernel_compiles, e.kernel_cache_loads, e.autotune_runs
    );
    Ok((model, line))
}

/// The steps of the warm-up (see the module docs); returns the policy they left and what ran.
fn steps<B: GrpoOps>(
    mut model: CausalLm<Autodiff<B>>,
    inputs: &WarmupInputs<'_, B>,
    rt: &tokio::runtime::Runtime,
) -> Result<(CausalLm<Autodiff<B>>, String)> {
    let cfg = inputs.cfg;
    let mut ran = Vec::new();
    if let (Some(w), false) = (&cfg.warmup, inputs.resumed) {
        let pairs = warmup_pairs(inputs.records, inputs.codec, inputs.stop_ids)
            .map_err(|e| anyhow!("[warmup]: {e}"))?;
        let n = w.steps.min(2);
        if !pairs.is_empty() && n > 0 {
            model = sft_warmup(model, &pairs, n, w.lr, inputs.device, &mut |_, _| {})?.0;
            ran.push(format!("{n} supervised steps of {} answers", pairs.len()));
        }
    }
    let judge = Arc::new(LexicalJudge::default());
    let rewards = JudgeRewards {
        judge: judge.clone(),
        mode: cfg.reward.mode,
        penalty: cfg.reward.length_penalty(cfg.learner.max_response_tokens),
        dropout: cfg.reward.dropout,
        seed: cfg.learner.seed,
    };
    let builder = Learner::builder(model, cfg.learner_config(), inputs.device.clone())
        .rollout(inputs.engine.clone())
        .codec(inputs.codec.clone())
        .rewards(rewards)
        .stop_ids(inputs.stop_ids.to_vec());
    let builder = match cfg.learner.tie_mode {
        TieMode::Off => builder,
        _ => builder.tie_breaker(PairwiseTieBreaker::new(judge, cfg.learner.seed)),
    };
    let mut learner = builder.build()?;
    let order = conrub_grpo::epoch_order(inputs.records.len(), cfg.learner.seed, 0);
    let batch: Vec<&RubricRecord> = order
        .iter()
        .take(cfg.run.prompts_per_step)
        .map(|&i| &inputs.records[i])
        .collect();
    rt.block_on(learner.step(&batch))?;
    ran.push(format!(
        "1 GRPO step of {} prompts x {} responses",
        batch.len(),
        cfg.learner.group_size
    ));
    Ok((learner.into_policy(), ran.join(", ")))
}
