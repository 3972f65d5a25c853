//! `conrub train`: GRPO with rubric rewards on a Qwen3 policy.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use burn::backend::Autodiff;
use burn::module::AutodiffModule;
use clap::Args;
use conrub_grpo::{
    sft_warmup, train, warmup_pairs, ChatTemplateCodec, GrpoError, JudgeRewards, Learner,
    LearnerConfig, PairwiseTieBreaker, RunConfig, RunHooks, TieMode,
};
use conrub_judge::{JudgeConfig, JudgeKind};
use conrub_kernels::GrpoOps;
use conrub_qwen3::{
    save_pretrained, AttentionImpl, EngineConfig, Execution, Precision, Qwen3, Qwen3Config,
    Qwen3ForCausalLM, SaveDtype,
};
use conrub_rubric::{read_rubrics, LengthPenalty, RubricDropout, ScoringMode};
use serde::Deserialize;

use crate::backend::{run_on_device, BackendTask};

/// Arguments of `conrub train`.
#[derive(Args)]
pub struct TrainArgs {
    /// Train config (TOML), e.g. `configs/demo-cpu.toml` or `configs/conrub-med-qwen3-4b.toml`.
    #[arg(long)]
    pub config: PathBuf,
    /// Continue from a checkpoint directory (`output_dir/checkpoint-NNNNNN`).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Device (overrides the config's `device`).
    #[arg(long)]
    pub device: Option<String>,
    /// Override a config value: `--set learner.lr=1e-6 --set run.max_steps=10` (TOML values).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Device memory for the memory plan checked before the first step (`conrub plan`); on
    /// `cuda` devices the default is an H200's 141 GB, elsewhere the plan is checked only when
    /// this is given.
    #[arg(long)]
    pub gpu_memory_gb: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TrainConfig {
    #[serde(default = "default_device")]
    device: String,
    /// `f32` or `bf16-mixed` (bf16 compute, f32 master weights and optimizer state).
    #[serde(default = "default_precision")]
    precision: String,
    model: ModelSection,
    data: DataSection,
    judge: toml::Table,
    #[serde(default)]
    reward: RewardSection,
    #[serde(default)]
    learner: LearnerConfig,
    #[serde(default)]
    run: RunConfig,
    #[serde(default)]
    warmup: Option<WarmupSection>,
    #[serde(default)]
    rollout: RolloutSection,
}

/// `[rollout]`: the rollout engine (`conrub_qwen3::engine`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RolloutSection {
    /// KV pool in decimal GB. Unset: on devices with a known size (`cuda`, or `--gpu-memory-gb`)
    /// the memory plan's budget rule (90% of what the rollout leaves free); elsewhere enough for
    /// every row of a call at full length.
    pub kv_cache_gb: Option<f64>,
    /// Positions per KV block.
    pub block_size: usize,
    /// Sequences decoded at once at most.
    pub max_rows: usize,
}

impl Default for RolloutSection {
    fn default() -> Self {
        let e = EngineConfig::default();
        Self {
            kv_cache_gb: None,
            block_size: e.block_size,
            max_rows: e.max_rows,
        }
    }
}

impl RolloutSection {
    /// Checks the values; errors name the key.
    pub(crate) fn validate(&self) -> Result<()> {
        if let Some(gb) = self.kv_cache_gb {
            if !(gb.is_finite() && gb > 0.0) {
                bail!("rollout.kv_cache_gb: {gb} must be a positive number of GB");
            }
        }
        for (key, v) in [("block_size", self.block_size), ("max_rows", self.max_rows)] {
            if v == 0 {
                bail!("rollout.{key}: must be at least 1");
            }
        }
        Ok(())
    }

    /// The engine settings, the pool left to the caller.
    pub(crate) fn engine(&self) -> EngineConfig {
        EngineConfig {
            block_size: self.block_size,
            kv_blocks: None,
            max_rows: self.max_rows,
        }
    }
}

fn default_device() -> String {
    "cpu".into()
}

fn default_precision() -> String {
    "f32".into()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelSection {
    /// Checkpoint directory or hub id.
    path: Option<String>,
    /// A random Qwen3 (demos, tests).
    random: Option<RandomModel>,
    /// Passed to the chat template (`false` for thinking-disabled runs).
    #[serde(default = "default_thinking")]
    enable_thinking: Option<bool>,
    /// Weights of exported checkpoints: `f32` or `bf16`.
    #[serde(default = "default_save_dtype")]
    save_dtype: String,
}

fn default_thinking() -> Option<bool> {
    Some(false)
}
fn default_save_dtype() -> String {
    "f32".into()
}

/// `[model.random]`: a randomly initialised Qwen3 of the given shape with a tokenizer from disk.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RandomModel {
    tokenizer: PathBuf,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: usize,
    head_dim: usize,
    #[serde(default = "default_std")]
    std: f64,
    #[serde(default)]
    seed: u64,
}

fn default_std() -> f64 {
    0.02
}

impl RandomModel {
    /// The Qwen3 config of this shape (Qwen3's vocabulary; the rest as `Qwen3Config::tiny`).
    pub(crate) fn config(&self) -> Qwen3Config {
        let mut c = Qwen3Config::tiny(151_936);
        c.hidden_size = self.hidden_size;
        c.intermediate_size = self.intermediate_size;
        c.num_hidden_layers = self.num_hidden_layers;
        c.num_attention_heads = self.num_attention_heads;
        c.num_key_value_heads = Some(self.num_key_value_heads);
        c.head_dim = Some(self.head_dim);
        c
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DataSection {
    rubrics: PathBuf,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RewardSection {
    mode: ScoringMode,
    length_penalty: bool,
    length_buffer_tokens: u32,
    dropout: Option<RubricDropout>,
}

impl Default for RewardSection {
    fn default() -> Self {
        Self {
            mode: ScoringMode::ThreeState,
            length_penalty: true,
            length_buffer_tokens: 1024,
            dropout: None,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct WarmupSection {
    steps: usize,
    lr: f64,
}

/// Sets `a.b.c = value` in a TOML table (the value parsed as TOML, else taken as a string); also
/// `conrub plan --set`.
pub(crate) fn apply_override(table: &mut toml::Table, spec: &str) -> Result<()> {
    let (key, raw) = spec
        .split_once('=')
        .ok_or_else(|| anyhow!("--set {spec}: expected KEY=VALUE"))?;
    let value: toml::Value = match toml::from_str::<toml::Table>(&format!("v = {raw}")) {
        Ok(mut t) => t.remove("v").expect("parsed"),
        Err(_) => toml::Value::String(raw.to_string()),
    };
    let parts: Vec<&str> = key.trim().split('.').collect();
    let mut cur = table;
    for p in &parts[..parts.len() - 1] {
        cur = cur
            .entry(p.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()))
            .as_table_mut()
            .ok_or_else(|| anyhow!("--set {key}: `{p}` is not a table"))?;
    }
    cur.insert(parts[parts.len() - 1].to_string(), value);
    Ok(())
}

fn load_config(path: &Path, overrides: &[String]) -> Result<(TrainConfig, PathBuf)> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut table: toml::Table = toml::from_str(&text)
        .map_err(|e| anyhow!("{}: {}", path.display(), e.to_string().trim_end()))?;
    for o in overrides {
        apply_override(&mut table, o)?;
    }
    let cfg: TrainConfig = table.clone().try_into().map_err(|e: toml::de::Error| {
        anyhow!("{}: {}", path.display(), e.to_string().trim_end())
    })?;
    cfg.learner
        .validate()
        .map_err(|e| anyhow!("{}: {e}", path.display()))?;
    cfg.rollout
        .validate()
        .map_err(|e| anyhow!("{}: {e}", path.display()))?;
    let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
    Ok((cfg, base))
}

/// Runs `conrub train`.
pub fn run(a: TrainArgs) -> Result<()> {
    let (cfg, base) = load_config(&a.config, &a.overrides)?;
    let device = a.device.clone().unwrap_or_else(|| cfg.device.clone());
    let gpu_gb = a
        .gpu_memory_gb
        .or_else(|| device.starts_with("cuda").then_some(141.0));
    let mut kv_pool_blocks = None;
    if let Some(gb) = gpu_gb {
        // Stop before loading anything when the run cannot fit (the table says what to change).
        let mut overrides = a.overrides.clone();
        overrides.push(format!("device=\"{device}\""));
        let plan = super::plan::plan_for_config(&a.config, &overrides, gb)?;
        plan.check((gb * 1e9) as u64).map_err(|e| {
            anyhow!(
                "{}: the run does not fit in {gb} GB:\n{e}",
                a.config.display()
            )
        })?;
        // The engine gets the pool the plan budgeted.
        kv_pool_blocks = Some(plan.kv_pool_blocks);
    }
    run_on_device(
        &device,
        TrainTask {
            cfg,
            base,
            resume: a.resume,
            device_name: device.clone(),
            kv_pool_blocks,
        },
    )
}

struct TrainTask {
    cfg: TrainConfig,
    base: PathBuf,
    resume: Option<PathBuf>,
    device_name: String,
    /// The memory plan's KV pool, when the device size is known.
    kv_pool_blocks: Option<usize>,
}

impl BackendTask for TrainTask {
    fn run<B: GrpoOps>(self, device: B::Device) -> Result<()> {
        train_on::<B>(self, device)
    }
}

/// Loads the policy named by `[model]` (a checkpoint directory or hub id, or a random Qwen3 with
/// the given tokenizer) with its configs and tokenizer.
fn load_policy<B: GrpoOps>(
    model: &ModelSection,
    rel: &dyn Fn(&Path) -> PathBuf,
    device: &B::Device,
) -> Result<Qwen3<Autodiff<B>>> {
    let q = match (&model.path, &model.random) {
        (Some(p), None) => {
            let local = rel(Path::new(p));
            if local.is_dir() {
                Qwen3::<Autodiff<B>>::load_dir(&local, device)?
            } else {
                Qwen3::<Autodiff<B>>::load(p, device)?
            }
        }
        (None, Some(r)) => Qwen3::random(r.config(), &rel(&r.tokenizer), r.std, r.seed, device)?,
        _ => bail!("[model] needs exactly one of `path` or `[model.random]`"),
    };
    if q.tokenizer.is_none() {
        bail!("[model]: {} has no tokenizer.json", q.dir.display());
    }
    Ok(q)
}

/// The judge config of `[judge]`: either `config = "FILE"` alone or the judge table inline. `conrub
/// train` runs a local judge on the training device, so a `device` key is an error.
fn judge_config(
    table: &toml::Table,
    base: &Path,
    rel: &dyn Fn(&Path) -> PathBuf,
    device: &str,
) -> Result<JudgeConfig> {
    let cfg = match table.get("config").and_then(toml::Value::as_str) {
        Some(path) if table.len() == 1 => JudgeConfig::from_file(&rel(Path::new(path)))?,
        _ => JudgeConfig::from_toml(&toml::to_string(table)?, base)
            .map_err(|e| anyhow!("[judge]: {e}"))?,
    };
    if let Some(d) = &cfg.device {
        bail!(
            "[judge] device = \"{d}\": `conrub train` runs the local judge on the training device ({device}) and a served judge has no device; remove the key (it is used by `conrub score` and `conrub judge-pair`)"
        );
    }
    Ok(cfg)
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
            None if done % self.total.div_ceil(10).max(1) == 0 && done < self.total => {
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

/// Exports checkpoints as Hugging Face directories and prints progress lines.
struct Hooks<B: burn::tensor::backend::Backend> {
    config: Qwen3Config,
    generation_config: Option<conrub_qwen3::GenerationConfig>,
    tokenizer_dir: PathBuf,
    dtype: SaveDtype,
    _b: std::marker::PhantomData<B>,
}

impl<B: GrpoOps> RunHooks<Qwen3ForCausalLM<Autodiff<B>>> for Hooks<B> {
    fn export(
        &mut self,
        policy: &Qwen3ForCausalLM<Autodiff<B>>,
        dir: &Path,
    ) -> conrub_grpo::Result<()> {
        save_pretrained(
            &policy.valid(),
            &self.config,
            self.generation_config.as_ref(),
            Some(&self.tokenizer_dir),
            dir,
            self.dtype,
        )
        .map_err(|e| GrpoError::Export {
            path: dir.to_path_buf(),
            message: e.to_string(),
        })
    }

    fn progress(&mut self, line: &str) {
        eprintln!("{line}");
    }
}

fn train_on<B: GrpoOps>(task: TrainTask, device: B::Device) -> Result<()> {
    let TrainTask {
        mut cfg,
        base,
        resume,
        device_name,
        kv_pool_blocks,
    } = task;
    let rel = |p: &Path| {
        if p.is_absolute() {
            p.to_path_buf()
        } else {
            base.join(p)
        }
    };
    let rubrics = read_rubrics(&rel(&cfg.data.rubrics))?;
    let records: Vec<_> = rubrics.iter().cloned().collect();
    let save_dtype = match cfg.model.save_dtype.as_str() {
        "f32" => SaveDtype::F32,
        "bf16" => SaveDtype::Bf16,
        other => bail!("model.save_dtype: `{other}` is not allowed (allowed: f32, bf16)"),
    };
    let judge_cfg = judge_config(&cfg.judge, &base, &rel, &device_name)?;

    let precision = Precision::parse(&cfg.precision).ok_or_else(|| {
        anyhow!(
            "precision: `{}` is not allowed (allowed: {})",
            cfg.precision,
            Precision::NAMES
        )
    })?;
    let exec = Execution {
        precision,
        attention: AttentionImpl::Fused,
        activation_checkpointing: cfg.learner.activation_checkpointing,
    };
    let qwen = load_policy::<B>(&cfg.model, &rel, &device)?.with_execution(exec);
    let stop_ids = qwen.stop_ids();
    let Qwen3 {
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
        Some(r) => rel(&r.tokenizer),
        None => model_dir,
    };

    let judges = match judge_cfg.kind {
        JudgeKind::Local => judge_cfg.build_local::<B>(&device)?,
        _ => judge_cfg.build(&rubrics)?,
    };
    let penalty = LengthPenalty {
        enabled: cfg.reward.length_penalty,
        max_tokens: cfg.learner.max_response_tokens as u32,
        buffer_tokens: cfg
            .reward
            .length_buffer_tokens
            .min(cfg.learner.max_response_tokens as u32),
    };
    penalty.validate()?;
    if let Some(d) = &cfg.reward.dropout {
        d.validate()?;
    }
    let rewards = JudgeRewards {
        judge: judges.criterion.clone(),
        mode: cfg.reward.mode,
        penalty,
        dropout: cfg.reward.dropout,
        seed: cfg.learner.seed,
    };

    // Optional supervised warm-up on reference answers (fresh runs only).
    let mut model = model;
    if let (Some(w), None) = (&cfg.warmup, &resume) {
        let pairs =
            warmup_pairs(&records, &codec, &stop_ids).map_err(|e| anyhow!("[warmup]: {e}"))?;
        if pairs.is_empty() {
            bail!(
                "[warmup]: no record in {} has a reference_answer",
                cfg.data.rubrics.display()
            );
        }
        let (m, losses) = {
            let mut progress = PhaseProgress::new("warm-up", w.steps);
            sft_warmup(model, &pairs, w.steps, w.lr, &device, &mut |done, loss| {
                progress.update(done, &format!("loss {loss:.3}"))
            })
        };
        model = m;
        eprintln!(
            "warm-up: {} steps on {} reference answers, loss {:.3} -> {:.3}",
            w.steps,
            pairs.len(),
            losses.first().copied().unwrap_or(f64::NAN),
            losses.last().copied().unwrap_or(f64::NAN)
        );
    }

    // The rollout engine's KV pool: `kv_cache_gb`, else the plan's, else every row at full length.
    let mut engine = cfg.rollout.engine();
    engine = match cfg.rollout.kv_cache_gb {
        Some(gb) => engine.with_kv_bytes((gb * 1e9) as u64, &model),
        None => EngineConfig {
            kv_blocks: kv_pool_blocks,
            ..engine
        },
    };
    if let Some(blocks) = engine.kv_blocks {
        eprintln!(
            "rollout KV pool: {blocks} blocks of {} positions ({:.2} GB)",
            engine.block_size,
            blocks as f64 * conrub_qwen3::kv_block_bytes(&model, engine.block_size) as f64 / 1e9
        );
    }
    cfg.learner.rollout_engine = engine;
    let builder = Learner::builder(model, cfg.learner.clone(), device.clone())
        .codec(codec)
        .rewards(rewards)
        .stop_ids(stop_ids);
    let mut learner = match cfg.learner.tie_mode {
        TieMode::Off => builder.build(),
        _ => builder
            .tie_breaker(PairwiseTieBreaker::new(
                judges.pairwise.clone(),
                cfg.learner.seed,
            ))
            .build(),
    }
    .map_err(|e| anyhow!("{e}"))?;
    let mut run = cfg.run;
    run.output_dir = rel(&run.output_dir);
    let mut hooks = Hooks::<B> {
        config: model_config,
        generation_config,
        tokenizer_dir,
        dtype: save_dtype,
        _b: std::marker::PhantomData,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    eprintln!(
        "training on {} prompts from {} with judge {} ({} mode, ties: {:?}) -> {}",
        records.len(),
        cfg.data.rubrics.display(),
        judges.criterion.id(),
        cfg.reward.mode.as_str(),
        cfg.learner.tie_mode,
        run.output_dir.display()
    );
    let summary = rt
        .block_on(train(
            &mut learner,
            &records,
            &run,
            resume.as_deref(),
            &mut hooks,
        ))
        .map_err(|e| anyhow!(e))?;
    for e in &summary.epochs {
        eprintln!(
            "epoch {}: {} steps, reward {:+.3}, ties {}/{} ({} accepted, {} same, {} order flips, {} invalid), mean length {:.1}",
            e.epoch, e.steps, e.reward_mean, e.ties.tied_groups, e.ties.groups, e.ties.accepted, e.ties.same, e.ties.order_flips, e.ties.invalid, e.response_len_mean
        );
    }
    eprintln!(
        "done: {} steps ({} this run); metrics {}, plots in {}, checkpoint {}",
        summary.total_steps,
        summary.steps_run,
        run.output_dir.join("metrics.jsonl").display(),
        run.output_dir.display(),
        summary
            .last_checkpoint
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_default()
    );
    Ok(())
}
