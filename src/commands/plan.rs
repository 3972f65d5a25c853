//! `conrub plan`: the predicted peak device memory of a `conrub train` run, and the largest
//! micro-batch and rollout call that fit (the arithmetic is `conrub_grpo::memory`).
//!
//! It reads the same TOML as `conrub train`, but only the keys it needs (unknown keys are ignored,
//! so a train config with newer sections still plans), and never loads weights: the model shape
//! comes from a local checkpoint's `config.json`, the hub cache's copy of it, or the built-in
//! table of released Qwen3 shapes.

use std::path::{Path, PathBuf};

use crate::commands::train::{apply_override, RandomModel, RolloutSection};
use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use conrub_grpo::memory::{
    MemoryPlan, MemoryPlanInput, ModelShape, DEFAULT_GPU_MEMORY_GB, DEFAULT_MAX_PROMPT_TOKENS, GB,
    KNOWN_SHAPES,
};
use conrub_qwen3::{Precision, Qwen3Config};
use serde::Deserialize;

/// Arguments of `conrub plan`.
#[derive(Args)]
pub struct PlanArgs {
    /// Train config (TOML), the one `conrub train --config` takes.
    #[arg(long)]
    pub config: PathBuf,
    /// Device memory in decimal GB (1 GB = 1e9 bytes); 141 is an H200.
    #[arg(long, default_value_t = DEFAULT_GPU_MEMORY_GB)]
    pub gpu_memory_gb: f64,
    /// Longest prompt in tokens (default: the config's `max_prompt_tokens`, else 1024).
    #[arg(long)]
    pub max_prompt_tokens: Option<usize>,
    /// Override a config value as `conrub train` does: `--set precision="bf16-mixed"`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// The keys of a train config that memory depends on; everything else is ignored.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct PlanConfig {
    device: Option<String>,
    precision: Option<String>,
    model: PlanModel,
    data: PlanData,
    learner: PlanLearner,
    run: PlanRun,
    rollout: RolloutSection,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct PlanModel {
    path: Option<String>,
    random: Option<RandomModel>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct PlanData {
    max_prompt_tokens: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct PlanLearner {
    group_size: Option<usize>,
    max_response_tokens: Option<usize>,
    max_prompt_tokens: Option<usize>,
    micro_batch_tokens: Option<usize>,
    mini_batches: Option<usize>,
    rollout_prompts_per_call: Option<usize>,
    activation_checkpointing: Option<bool>,
    kl_beta: Option<f64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct PlanRun {
    prompts_per_step: Option<usize>,
}

/// Where the model shape came from.
struct ModelSource {
    name: String,
    source: String,
    shape: ModelShape,
}

/// The hub cache's `config.json` of `model` (`owner/name`), without touching the network.
fn cached_hub_config(model: &str) -> Option<PathBuf> {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let hub = env("HF_HUB_CACHE")
        .or_else(|| env("HF_HOME").map(|h| h.join("hub")))
        .or_else(|| env("HOME").map(|h| h.join(".cache/huggingface/hub")))?;
    let repo = hub.join(format!("models--{}", model.replace('/', "--")));
    let snapshots = repo.join("snapshots");
    if let Ok(rev) = std::fs::read_to_string(repo.join("refs/main")) {
        let config = snapshots.join(rev.trim()).join("config.json");
        if config.is_file() {
            return Some(config);
        }
    }
    std::fs::read_dir(&snapshots)
        .ok()?
        .flatten()
        .map(|e| e.path().join("config.json"))
        .find(|p| p.is_file())
}

fn resolve_model(model: &PlanModel, rel: &dyn Fn(&Path) -> PathBuf) -> Result<ModelSource> {
    match (&model.path, &model.random) {
        (Some(p), None) => {
            let local = rel(Path::new(p));
            if local.is_dir() {
                let file = local.join("config.json");
                let config = Qwen3Config::from_file(&file)
                    .with_context(|| format!("model.path = \"{p}\""))?;
                return Ok(ModelSource {
                    name: p.clone(),
                    source: file.display().to_string(),
                    shape: ModelShape::from_config(&config),
                });
            }
            if let Some(file) = cached_hub_config(p) {
                let config = Qwen3Config::from_file(&file)
                    .with_context(|| format!("model.path = \"{p}\""))?;
                return Ok(ModelSource {
                    name: p.clone(),
                    source: format!("hub cache {}", file.display()),
                    shape: ModelShape::from_config(&config),
                });
            }
            if let Some(shape) = ModelShape::known(p) {
                return Ok(ModelSource {
                    name: p.clone(),
                    source: "built-in Qwen3 shape; no config.json on disk".into(),
                    shape,
                });
            }
            let known: Vec<&str> = KNOWN_SHAPES.iter().map(|(id, _)| *id).collect();
            bail!(
                "model.path = \"{p}\": not a local directory ({}), not in the hub cache, and not a known Qwen3 shape (known: {})",
                local.display(),
                known.join(", ")
            )
        }
        (None, Some(r)) => {
            // The same shape `conrub train` builds for `[model.random]`.
            let c = r.config();
            c.validate().map_err(|e| anyhow!("[model.random]: {e}"))?;
            Ok(ModelSource {
                name: "random Qwen3".into(),
                source: "[model.random]".into(),
                shape: ModelShape::from_config(&c),
            })
        }
        _ => bail!("[model] needs exactly one of `path` or `[model.random]`"),
    }
}

fn positive(key: &str, v: Option<usize>) -> Result<Option<usize>> {
    match v {
        Some(0) => bail!("{key}: must be at least 1"),
        other => Ok(other),
    }
}

/// Reads the config (with overrides) into a plan input; errors name the file and the key.
fn plan_input(a: &PlanArgs) -> Result<(MemoryPlanInput, ModelSource, PlanConfig)> {
    let path = &a.config;
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut table: toml::Table = toml::from_str(&text)
        .map_err(|e| anyhow!("{}: {}", path.display(), e.to_string().trim_end()))?;
    for o in &a.overrides {
        apply_override(&mut table, o)?;
    }
    let cfg: PlanConfig = table.try_into().map_err(|e: toml::de::Error| {
        anyhow!("{}: {}", path.display(), e.to_string().trim_end())
    })?;
    let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
    let rel = |p: &Path| {
        if p.is_absolute() {
            p.to_path_buf()
        } else {
            base.join(p)
        }
    };
    let model =
        resolve_model(&cfg.model, &rel).map_err(|e| anyhow!("{}: {e:#}", path.display()))?;
    let with_file = |r: Result<Option<usize>>| r.map_err(|e| anyhow!("{}: {e}", path.display()));
    let l = &cfg.learner;
    let mut input = MemoryPlanInput::new(model.shape);
    if let Some(p) = &cfg.precision {
        input.precision = Precision::parse(p).ok_or_else(|| {
            anyhow!(
                "{}: precision: `{p}` is not allowed (allowed: {})",
                path.display(),
                Precision::NAMES
            )
        })?;
    }
    if let Some(v) = l.activation_checkpointing {
        input.activation_checkpointing = v;
    }
    if let Some(v) = with_file(positive("learner.micro_batch_tokens", l.micro_batch_tokens))? {
        input.micro_batch_tokens = v;
    }
    if let Some(v) = with_file(positive("learner.mini_batches", l.mini_batches))? {
        input.mini_batches = v;
    }
    if let Some(v) = with_file(positive("learner.group_size", l.group_size))? {
        input.group_size = v;
    }
    if let Some(v) = with_file(positive(
        "learner.max_response_tokens",
        l.max_response_tokens,
    ))? {
        input.max_response_tokens = v;
    }
    if let Some(v) = with_file(positive(
        "learner.rollout_prompts_per_call",
        l.rollout_prompts_per_call,
    ))? {
        input.rollout_prompts_per_call = v;
    }
    if let Some(v) = with_file(positive("run.prompts_per_step", cfg.run.prompts_per_step))? {
        input.prompts_per_step = v;
    }
    if let Some(k) = l.kl_beta {
        input.keep_reference = k != 0.0;
    }
    let prompt = match a.max_prompt_tokens {
        Some(v) => with_file(positive("--max-prompt-tokens", Some(v)))?,
        None => {
            with_file(positive("learner.max_prompt_tokens", l.max_prompt_tokens))?.or(with_file(
                positive("data.max_prompt_tokens", cfg.data.max_prompt_tokens),
            )?)
        }
    };
    input.max_prompt_tokens = prompt.unwrap_or(DEFAULT_MAX_PROMPT_TOKENS);
    cfg.rollout
        .validate()
        .map_err(|e| anyhow!("{}: {e}", path.display()))?;
    input.kv_cache_gb = cfg.rollout.kv_cache_gb;
    input.kv_block_size = cfg.rollout.block_size;
    input.rollout_max_rows = cfg.rollout.max_rows;
    if !(a.gpu_memory_gb.is_finite() && a.gpu_memory_gb > 0.0) {
        bail!(
            "--gpu-memory-gb: {} must be a positive number of GB",
            a.gpu_memory_gb
        );
    }
    input.gpu_memory_gb = a.gpu_memory_gb;
    Ok((input, model, cfg))
}

/// The plan of a train config, for `conrub train` to check before its first step.
pub fn plan_for_config(
    config: &Path,
    overrides: &[String],
    gpu_memory_gb: f64,
) -> Result<MemoryPlan> {
    let args = PlanArgs {
        config: config.to_path_buf(),
        gpu_memory_gb,
        max_prompt_tokens: None,
        overrides: overrides.to_vec(),
        json: false,
    };
    Ok(MemoryPlan::new(plan_input(&args)?.0))
}

/// Runs `conrub plan`.
pub fn run(a: PlanArgs) -> Result<()> {
    let (input, model, cfg) = plan_input(&a)?;
    let device = cfg.device.clone().unwrap_or_else(|| "cpu".into());
    let plan = MemoryPlan::new(input);
    if a.json {
        let mut v = plan.to_json();
        v["config"] = a.config.display().to_string().into();
        v["device"] = device.into();
        v["model"] = serde_json::json!({ "path": model.name, "source": model.source });
        return super::print_lines([serde_json::to_string_pretty(&v)?]);
    }
    let i = &plan.input;
    let m = &i.model;
    let mut lines = vec![
        format!("memory plan of {} on a {:.0} GB device", a.config.display(), i.gpu_memory_gb),
        format!("model: {} ({})", model.name, model.source),
        format!(
            "  {:.3} B parameters: {} layers, hidden {}, intermediate {}, {}/{} heads of {}, vocab {}, {} embeddings",
            plan.parameters as f64 / GB,
            m.num_hidden_layers,
            m.hidden_size,
            m.intermediate_size,
            m.num_attention_heads,
            m.num_key_value_heads,
            m.head_dim,
            m.vocab_size,
            if m.tie_word_embeddings { "tied" } else { "untied" }
        ),
        format!("precision {}, activation checkpointing {}, device {device}", i.precision, if i.activation_checkpointing { "on" } else { "off" }),
        format!(
            "micro-batch: budget {} tokens -> {} rows x {} tokens (prompt {} + response {}) = {} tokens; LM head chunk {}",
            i.micro_batch_tokens,
            plan.micro_batch_rows,
            i.sequence_tokens(),
            i.max_prompt_tokens,
            i.max_response_tokens,
            plan.micro_batch_tokens_used,
            i.chunk_tokens
        ),
        format!(
            "rollout: {} prompts x {} per call = {} rows ({} decoding at once at most); step: {} prompts x {} = {} rows",
            i.rollout_prompts_per_call.min(i.prompts_per_step),
            i.group_size,
            plan.rollout_rows,
            i.decode_rows(),
            i.prompts_per_step,
            i.group_size,
            i.step_rows()
        ),
        format!(
            "KV pool: {} blocks of {} positions = {:.2} GB ({}), {} full-length rows of {} tokens at once",
            plan.kv_pool_blocks,
            i.kv_block_size,
            plan.kv_pool_bytes() / GB,
            if i.kv_cache_gb.is_some() { "rollout.kv_cache_gb" } else { "budget rule: 90% of what the rollout leaves free" },
            plan.max_rollout_rows,
            i.sequence_tokens()
        ),
        String::new(),
    ];
    lines.extend(plan.table().lines().map(str::to_string));
    let advice = plan.advice();
    if !advice.is_empty() {
        lines.push(String::new());
        lines.extend(advice.lines().map(str::to_string));
    }
    super::print_lines(lines)
}
