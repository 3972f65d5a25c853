//! `conrub train`: GRPO with rubric rewards on a policy of any `conrub_models` family. The config is
//! [`conrub_config::TrainConfig`]; this file wires its sections to the crates, one function per
//! stage of the set-up.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use burn::backend::Autodiff;
use burn::module::Module;
use clap::Args;
use conrub_config::{RolloutEngineKind, TrainConfig};
use conrub_grpo::{
    sft_warmup, train, warmup_pairs, DataParallel, GrpoError, HeldOutPrompt, InProcessEngine,
    JudgeRewards, Learner, LearnerBuilder, PairwiseTieBreaker, RolloutEngine, RunHooks, TieMode,
    Validator,
};
use conrub_judge::Judges;
use conrub_kernels::GrpoOps;
use conrub_models::{
    save_pretrained, CausalLm, ChatTemplateCodec, HfExport, ModelConfig, Pretrained, SaveDtype,
};
use conrub_remote::{SglangConfig, SglangEngine, WeightWriter};
use conrub_rollout::{EngineConfig, PagedModel};
use conrub_rubric::{read_rubrics, RubricRecord, RubricSet};

use crate::backend::{run_on_devices, DevicesTask, RankCollective};

/// Arguments of `conrub train`.
#[derive(Args)]
pub struct TrainArgs {
    /// Train config (TOML), e.g. `configs/demo-cpu.toml` or `configs/conrub-med-qwen3-4b.toml`.
    #[arg(long)]
    pub config: PathBuf,
    /// Continue from a checkpoint directory (`output_dir/checkpoint-NNNNNN`).
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
    let warmup = a.kernel_warmup;
    run_with(a, warmup)
}

/// `conrub train`'s set-up, with the kernel warm-up as `warmup` says.
pub(crate) fn run_with(a: TrainArgs, warmup: KernelWarmup) -> Result<()> {
    let mut cfg = TrainConfig::from_file(&a.config, &a.overrides)?;
    if let Some(ds) = a.devices.or(a.device.map(|d| vec![d])) {
        cfg.set_devices(ds)?;
    }
    // Fail before loading anything when training needs what the file lacks, or on records
    // `conrub rubrics validate` rejects.
    check_rubrics(&cfg.rubrics_path()?)?;
    cfg.judge()?;
    cfg.check_builtin_plugins()?;
    cfg.run.overwrite = a.overwrite;
    if warmup != KernelWarmup::Only {
        // A run folder that is a file, cannot be written, is in use or holds an earlier run
        // fails now, not after the model loads and the kernel warm-up.
        if cfg.run.output_dir.as_os_str().is_empty() {
            return Err(GrpoError::config(
                "run.output_dir",
                "is empty (name the folder the run writes to)",
            )
            .into());
        }
        let dir = cfg.resolve(&cfg.run.output_dir);
        conrub_grpo::run_folder::check_start(&dir, a.resume.is_some(), a.overwrite)?;
    }
    let gpu_gb = match a.gpu_memory_gb {
        Some(gb) => Some(gb),
        None => crate::backend::device_memory_bytes(&cfg.device)?.map(|b| b as f64 / 1e9),
    };
    let mut kv_pool_blocks = None;
    if let Some(gb) = gpu_gb {
        // Stop before loading anything when the run cannot fit (the table says what to change).
        let plan = super::plan::plan_for_config(&cfg, gb)?;
        plan.check((gb * 1e9) as u64).map_err(|e| {
            anyhow!(
                "{}: the run does not fit in {gb} GB:\n{e}",
                a.config.display()
            )
        })?;
        // The engine gets the pool the plan budgeted.
        kv_pool_blocks = Some(plan.kv_pool_blocks);
    } else if let Some(avail) = crate::backend::host_memory_for(&cfg.devices) {
        // CPU ranks share the host's memory: each gets its part of what is available now. The
        // engine keeps its CPU pool (every row at full length); only the check is the plan's.
        let gb = avail as f64 / 1e9;
        let plan = super::plan::plan_for_config(&cfg, gb)?;
        plan.check(avail).map_err(|e| {
            anyhow!(
                "{}: the run does not fit in the {gb:.1} GB of host memory available to each of its {} CPU rank(s):\n{e}",
                a.config.display(),
                cfg.devices.len()
            )
        })?;
    }
    crate::backend::set_kernel_cache_config(cfg.kernel_cache.clone());
    let devices = cfg.devices.clone();
    run_on_devices(
        &devices,
        TrainTask {
            cfg,
            resume: a.resume,
            kv_pool_blocks,
            warmup,
        },
    )
}

/// Refuses a rubric file that `conrub rubrics validate` rejects (its errors name line and field).
fn check_rubrics(path: &Path) -> Result<()> {
    let records: Vec<(usize, RubricRecord)> = conrub_rubric::read_jsonl(path)?;
    let report = conrub_rubric::validate_records(&records);
    if !report.is_ok() {
        let errors: Vec<String> = report
            .to_string()
            .lines()
            .filter(|l| l.starts_with("error: "))
            .map(|l| format!("  {}: {}", path.display(), &l["error: ".len()..]))
            .collect();
        bail!(
            "{}: {} errors that `conrub rubrics validate` rejects; training refuses them:\n{}",
            path.display(),
            report.errors(),
            errors.join("\n")
        );
    }
    Ok(())
}

struct TrainTask {
    cfg: TrainConfig,
    resume: Option<PathBuf>,
    /// The memory plan's KV pool, when the device size is known.
    kv_pool_blocks: Option<usize>,
    warmup: KernelWarmup,
}

impl DevicesTask for TrainTask {
    fn run<B: RankCollective>(self, devices: Vec<B::Device>) -> Result<()> {
        train_on::<B>(self, devices)
    }
}

/// Loads the policy named by `[model]` (a checkpoint directory or hub id, or a random model with
/// the given tokenizer) with its configs and tokenizer, running as the config says.
fn load_policy<B: GrpoOps>(
    cfg: &TrainConfig,
    device: &B::Device,
) -> Result<Pretrained<Autodiff<B>>> {
    let model = &cfg.model;
    let q = match (&model.path, &model.random) {
        (Some(p), None) => {
            let local = cfg.resolve(Path::new(p));
            if local.is_dir() {
                Pretrained::<Autodiff<B>>::load_dir(&local, device)?
            } else {
                Pretrained::<Autodiff<B>>::load(p, device)?
            }
        }
        (None, Some(r)) => Pretrained::random(
            r.config(),
            &cfg.resolve(&r.tokenizer),
            r.std,
            r.seed,
            device,
        )?,
        _ => bail!("[model] needs exactly one of `path` or `[model.random]`"),
    };
    if q.tokenizer.is_none() {
        bail!("[model]: {} has no tokenizer.json", q.dir.display());
    }
    let kernels = cfg
        .attention_kernels
        .resolve::<B>(device)
        .map_err(|why| anyhow::anyhow!("{}: {why}", cfg.path.display()))?;
    if kernels == conrub_models::AttentionKernels::TensorCore
        && cfg.precision == conrub_models::Precision::F32
    {
        eprintln!(
            "warning: attention_kernels = \"tensor-core\" with precision f32: f32 attention keeps \
             the portable kernels (the tensor-core ones take bf16 and f16)"
        );
    }
    Ok(q.with_execution(cfg.execution(kernels)))
}

/// The judges of `[judge]` (an in-process judge on the training device) and the reward stage.
fn build_rewards<B: GrpoOps>(
    cfg: &TrainConfig,
    rubrics: &RubricSet,
    device: &B::Device,
) -> Result<(Judges, JudgeRewards)> {
    let judges = cfg.judge()?.build_on::<B>(device, rubrics)?;
    let rewards = JudgeRewards {
        judge: judges.criterion.clone(),
        mode: cfg.reward.mode,
        penalty: cfg.reward.length_penalty(cfg.learner.max_response_tokens),
        dropout: cfg.reward.dropout,
        seed: cfg.learner.seed,
    };
    Ok((judges, rewards))
}

/// Builds `[eval]`'s judges (in process on the training device, or clients) and reads its held-out
/// prompts: the validator, or `None` without `[eval]`.
fn build_validator<B: GrpoOps>(
    cfg: &TrainConfig,
    judges: &Judges,
    device: &B::Device,
) -> Result<Option<Validator>> {
    let Some(e) = &cfg.eval else {
        return Ok(None);
    };
    let data = cfg.resolve(&e.settings.data);
    let mut examples = conrub_eval::read_eval_examples(&data)?;
    if let Some(n) = e.settings.limit {
        examples.truncate(n);
    }
    if examples.is_empty() {
        bail!("[eval] data: {} has no examples", data.display());
    }
    let grader = e
        .grader
        .build_on::<B>(device, &RubricSet::from_records("eval", vec![])?)
        .context("[eval.grader]")?;
    let examples = examples
        .into_iter()
        .map(|e| HeldOutPrompt {
            prompt: e.prompt,
            criteria: e.criteria,
        })
        .collect();
    Ok(Some(Validator {
        cfg: e.settings.clone(),
        examples,
        mode: cfg.reward.mode,
        training: judges.criterion.clone(),
        grader: grader.criterion,
        seed: cfg.learner.seed,
    }))
}

/// The optional supervised warm-up on reference answers (fresh runs only).
fn warm_up<B: GrpoOps>(
    cfg: &TrainConfig,
    model: CausalLm<Autodiff<B>>,
    records: &[RubricRecord],
    codec: &ChatTemplateCodec,
    stop_ids: &[u32],
    device: &B::Device,
) -> Result<CausalLm<Autodiff<B>>> {
    let Some(w) = &cfg.warmup else {
        return Ok(model);
    };
    let pairs = warmup_pairs(records, codec, stop_ids).map_err(|e| anyhow!("[warmup]: {e}"))?;
    if pairs.is_empty() {
        bail!(
            "[warmup]: no record in {} has a reference_answer",
            cfg.rubrics_path()?.display()
        );
    }
    let (model, losses) = {
        let mut progress = PhaseProgress::new("warm-up", w.steps);
        sft_warmup(model, &pairs, w.steps, w.lr, device, &mut |done, loss| {
            progress.update(done, &format!("loss {loss:.3}"))
        })?
    };
    eprintln!(
        "warm-up: {} steps on {} reference answers, loss {:.3} -> {:.3}",
        w.steps,
        pairs.len(),
        losses.first().copied().unwrap_or(f64::NAN),
        losses.last().copied().unwrap_or(f64::NAN)
    );
    Ok(model)
}

/// The rollout engine's settings: the pool of `rollout.kv_cache_gb`, else the memory plan's, else
/// every row at full length.
fn rollout_engine<B: GrpoOps>(
    cfg: &TrainConfig,
    model: &CausalLm<Autodiff<B>>,
    kv_pool_blocks: Option<usize>,
) -> EngineConfig {
    let engine = cfg.rollout.engine();
    let engine = match cfg.rollout.kv_cache_gb {
        Some(gb) => engine.with_kv_bytes((gb * 1e9) as u64, model.kv_layout()),
        None => EngineConfig {
            kv_blocks: kv_pool_blocks,
            ..engine
        },
    };
    if let Some(blocks) = engine.kv_blocks {
        eprintln!(
            "rollout KV pool: {blocks} blocks of {} positions ({:.2} GB)",
            engine.block_size,
            blocks as f64 * model.kv_layout().block_bytes(engine.block_size) as f64 / 1e9
        );
    }
    engine
}

/// Progress of a phase that takes more than a few seconds: a bar with an ETA on a terminal, else a
/// plain line with the ETA about every 10% (so a log file shows it too).
struct PhaseProgress {
    name: &'static str,
    total: usize,
    bar: Option<indicatif::ProgressBar>,
    started: std::time::Instant,
}

impl PhaseProgress {
    fn new(name: &'static str, total: usize) -> Self {
        use std::io::IsTerminal;
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = indicatif::ProgressBar::new(total as u64);
            let template = format!("{name} {{bar:30}} {{pos}}/{{len}} steps, {{msg}}, ETA {{eta}}");
            bar.set_style(
                indicatif::ProgressStyle::with_template(&template).expect("valid template"),
            );
            bar
        });
        Self {
            name,
            total,
            bar,
            started: std::time::Instant::now(),
        }
    }

    fn update(&mut self, done: usize, message: &str) {
        match &self.bar {
            Some(bar) => {
                bar.set_message(message.to_string());
                bar.set_position(done as u64);
                if done == self.total {
                    bar.finish_and_clear();
                }
            }
            None if done.is_multiple_of(self.total.div_ceil(10).max(1)) && done < self.total => {
                let eta =
                    self.started.elapsed().as_secs_f64() / done as f64 * (self.total - done) as f64;
                eprintln!(
                    "{}: {done}/{} steps, {message}, ETA {:.0} s",
                    self.name, self.total, eta
                );
            }
            None => {}
        }
    }
}

/// Exports checkpoints as Hugging Face directories (the family's [`HfExport`]) and prints
/// progress lines.
struct Hooks<B: burn::tensor::backend::Backend> {
    export: HfExport,
    /// The kernel warm-up's line, written once `metrics.jsonl` is open.
    kernel_warmup: Option<conrub_grpo::KernelWarmupLine>,
    _b: std::marker::PhantomData<B>,
}

impl<B: GrpoOps> RunHooks<CausalLm<Autodiff<B>>> for Hooks<B> {
    fn opening_lines(&mut self) -> Vec<conrub_grpo::MetricsLine> {
        self.kernel_warmup
            .take()
            .map(conrub_grpo::MetricsLine::KernelWarmup)
            .into_iter()
            .collect()
    }

    fn export(&mut self, policy: &CausalLm<Autodiff<B>>, dir: &Path) -> conrub_grpo::Result<()> {
        Ok(conrub_contracts::Export::export(&self.export, policy, dir)?)
    }

    fn progress(&mut self, line: &str) {
        eprintln!("{line}");
    }

    fn checkpointed(&mut self, run_dir: &Path, _checkpoint: &Path) -> conrub_grpo::Result<()> {
        conrub_plot::plot_run(run_dir).map_err(|e| GrpoError::Hook(Box::new(e)))?;
        Ok(())
    }
}

/// Trains on `devices`: one learner, or one data-parallel rank per device.
fn train_on<B: RankCollective>(task: TrainTask, devices: Vec<B::Device>) -> Result<()> {
    let TrainTask {
        cfg,
        resume,
        kv_pool_blocks,
        warmup,
    } = task;
    let device = devices[0].clone();
    let rubrics_path = cfg.rubrics_path()?;
    let rubrics = read_rubrics(&rubrics_path)?;
    let records: Vec<_> = rubrics.iter().cloned().collect();
    let (judges, rewards) = build_rewards::<B>(&cfg, &rubrics, &device)?;
    let validator = build_validator::<B>(&cfg, &judges, &device)?;

    let qwen = load_policy::<B>(&cfg, &device)?;
    let stop_ids = qwen.stop_ids();
    let Pretrained {
        model,
        config: model_config,
        generation_config,
        tokenizer,
        dir: model_dir,
    } = qwen;
    let codec = ChatTemplateCodec {
        tokenizer: tokenizer.expect("checked in load_policy"),
        enable_thinking: cfg.model.enable_thinking,
    };
    let tokenizer_dir = match &cfg.model.random {
        Some(r) => cfg.resolve(&r.tokenizer),
        None => model_dir,
    };
    let mut run = cfg.run.clone();
    run.output_dir = cfg.resolve(&run.output_dir);
    let engine = rollout_engine_of::<B>(
        &cfg,
        &model,
        kv_pool_blocks,
        &model_config,
        &tokenizer_dir,
        &run.output_dir,
    )?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let run_warmup = match warmup {
        KernelWarmup::Only | KernelWarmup::Always => true,
        // With SGLang rollouts the servers compile their own kernels, and a warm-up's weight
        // syncs would leave the engine at a version the run's own first sync could then skip.
        KernelWarmup::Auto => {
            crate::backend::kernel_cache_was_cold()
                && cfg.rollout.engine == RolloutEngineKind::Paged
        }
        KernelWarmup::Never => false,
    };
    let (model, warmup_line) = if run_warmup {
        let inputs = super::kernel_warmup::WarmupInputs {
            cfg: &cfg,
            records: &records,
            codec: &codec,
            stop_ids: &stop_ids,
            engine: engine.clone(),
            device: &device,
            resumed: resume.is_some(),
        };
        let (model, line) = super::kernel_warmup::run::<B>(model, inputs, &rt)?;
        (model, Some(line))
    } else {
        (model, None)
    };
    if warmup == KernelWarmup::Only {
        return Ok(());
    }
    let model = match &resume {
        None => warm_up::<B>(&cfg, model, &records, &codec, &stop_ids, &device)?,
        Some(_) => model,
    };

    // One judge (client, concurrency limit, cache) for every rank.
    let breaker = PairwiseTieBreaker::new(judges.pairwise.clone(), cfg.learner.seed);
    let builder = |model, device: &B::Device| -> LearnerBuilder<Autodiff<B>, _> {
        let b = Learner::builder(model, cfg.learner_config(), device.clone())
            .rollout(engine.clone())
            .codec(codec.clone())
            .rewards(rewards.clone())
            .stop_ids(stop_ids.clone());
        match cfg.learner.tie_mode {
            TieMode::Off => b,
            _ => b.tie_breaker(breaker.clone()),
        }
    };
    let mut hooks = Hooks::<B> {
        export: HfExport {
            config: model_config,
            generation_config,
            tokenizer_dir: Some(tokenizer_dir),
            dtype: cfg.model.save_dtype,
        },
        kernel_warmup: warmup_line,
        _b: std::marker::PhantomData,
    };
    eprintln!(
        "training on {} prompts from {} with judge {} ({} mode, ties: {:?}) -> {}",
        records.len(),
        rubrics_path.display(),
        judges.criterion.id(),
        cfg.reward.mode.as_str(),
        cfg.learner.tie_mode,
        run.output_dir.display()
    );
    let resume = resume.as_deref();
    let summary = if devices.len() == 1 {
        let mut learner = builder(model, &device).build()?;
        rt.block_on(train(
            &mut learner,
            &records,
            &run,
            resume,
            validator.as_ref(),
            &mut hooks,
        ))
    } else {
        eprintln!(
            "data parallel: {} ranks on {}",
            devices.len(),
            cfg.devices.join(", ")
        );
        let collective = B::rank_collective(&devices);
        let bucket = cfg.learner.allreduce_bucket_bytes();
        let mut group = DataParallel::build(&devices, collective, bucket, |_, d| {
            Ok(builder(model.clone().fork(d), d))
        })?;
        rt.block_on(train(
            &mut group,
            &records,
            &run,
            resume,
            validator.as_ref(),
            &mut hooks,
        ))
    }
    .map_err(|e| anyhow!(e))?;
    report(&summary, &run.output_dir);
    Ok(())
}

/// The run's rollout engine: conrub-rollout's in process, or SGLang servers that get the
/// policy as bf16 safetensors in `output_dir/rollout-weights` after every step.
fn rollout_engine_of<B: GrpoOps>(
    cfg: &TrainConfig,
    model: &CausalLm<Autodiff<B>>,
    kv_pool_blocks: Option<usize>,
    model_config: &ModelConfig,
    tokenizer_dir: &Path,
    output_dir: &Path,
) -> Result<Arc<dyn RolloutEngine<B, CausalLm<B>>>> {
    let r = &cfg.rollout;
    if r.engine == RolloutEngineKind::Paged {
        return Ok(Arc::new(InProcessEngine {
            prompts_per_call: cfg.learner.rollout_prompts_per_call,
            engine: rollout_engine::<B>(cfg, model, kv_pool_blocks),
        }));
    }
    let (config, tokenizer) = (model_config.clone(), tokenizer_dir.to_path_buf());
    let writer: WeightWriter<CausalLm<B>> = Arc::new(move |policy, dir| {
        save_pretrained(
            policy,
            &config,
            None,
            Some(&tokenizer),
            dir,
            SaveDtype::Bf16,
        )?;
        Ok(std::fs::metadata(dir.join("model.safetensors"))?.len())
    });
    let sglang = SglangConfig {
        urls: r.urls.clone(),
        timeout_secs: r.timeout_secs,
        max_retries: r.max_retries,
        backoff_secs: 1.0,
        concurrency: r.concurrency,
        colocate: r.colocate,
        vocab_size: model_config.vocab_size,
        weights_dir: output_dir.join("rollout-weights"),
    };
    eprintln!(
        "rollouts on SGLang: {} (weights in {}{})",
        r.urls.join(", "),
        sglang.weights_dir.display(),
        if r.colocate { ", colocated" } else { "" }
    );
    Ok(Arc::new(SglangEngine::new(sglang, writer)?))
}

/// The closing lines: one per epoch, then where everything went.
fn report(summary: &conrub_grpo::RunSummary, output_dir: &Path) {
    for e in &summary.epochs {
        eprintln!(
            "epoch {}: {} steps, reward {:+.3}, ties {}/{} ({} accepted, {} same, {} order flips, {} invalid), mean length {:.1}",
            e.epoch,
            e.steps,
            e.reward_mean,
            e.ties.tied_groups,
            e.ties.groups,
            e.ties.accepted,
            e.ties.same,
            e.ties.order_flips,
            e.ties.invalid,
            e.response_len_mean
        );
    }
    if let Some(b) = &summary.best {
        eprintln!(
            "best checkpoint by the grader: {} (step {}, score {:+.4} ± {:.4}; {})",
            b.checkpoint.display(),
            b.step,
            b.grader_score,
            b.grader_score_std,
            conrub_grpo::best_checkpoint_path(output_dir).display()
        );
    }
    eprintln!(
        "done: {} steps ({} this run); metrics {}, plots in {}, checkpoint {}",
        summary.total_steps,
        summary.steps_run,
        output_dir.join("metrics.jsonl").display(),
        output_dir.display(),
        summary
            .last_checkpoint
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_default()
    );
}
