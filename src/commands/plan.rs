//! `conrub plan`: the predicted peak device memory of a `conrub train` run, and the largest
//! micro-batch and rollout call that fit (the arithmetic is `conrub_memory`).
//!
//! It reads the config `conrub train` reads ([`conrub_config::TrainConfig`], the same schema and
//! the same errors) and never loads weights: the model shape comes from a local checkpoint's
//! `config.json`, the hub cache's copy of it, or the built-in table of released shapes (`conrub_models::KNOWN_SHAPES`).

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use conrub_config::{ModelSection, RolloutEngineKind, TrainConfig};
use conrub_contracts::Sharding;
use conrub_memory::{MemoryPlan, ModelShape, Phase, DEFAULT_GPU_MEMORY_GB, GB};
use conrub_models::ModelConfig;
use conrub_models::{known_shape, KNOWN_SHAPES};

/// Arguments of `conrub plan`.
#[derive(Args)]
pub struct PlanArgs {
    /// Train config (TOML), the one `conrub train --config` takes.
    #[arg(long)]
    pub config: PathBuf,
    /// Device memory in decimal GB (1 GB = 1e9 bytes); 141 is an H200.
    #[arg(long, default_value_t = DEFAULT_GPU_MEMORY_GB)]
    pub gpu_memory_gb: f64,
    /// Longest prompt in tokens (default: the config's `data.max_prompt_tokens`, else 1024).
    #[arg(long)]
    pub max_prompt_tokens: Option<usize>,
    /// Override a config value as `conrub train` does: `--set precision="bf16-mixed"`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
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

fn resolve_model(model: &ModelSection, rel: &dyn Fn(&Path) -> PathBuf) -> Result<ModelSource> {
    match (&model.path, &model.random) {
        (Some(p), None) => {
            let local = rel(Path::new(p));
            if local.is_dir() {
                let file = local.join("config.json");
                let config = ModelConfig::from_file(&file)
                    .with_context(|| format!("model.path = \"{p}\""))?;
                return Ok(ModelSource {
                    name: p.clone(),
                    source: file.display().to_string(),
                    shape: config.shape(),
                });
            }
            if let Some(file) = cached_hub_config(p) {
                let config = ModelConfig::from_file(&file)
                    .with_context(|| format!("model.path = \"{p}\""))?;
                return Ok(ModelSource {
                    name: p.clone(),
                    source: format!("hub cache {}", file.display()),
                    shape: config.shape(),
                });
            }
            if let Some(shape) = known_shape(p) {
                return Ok(ModelSource {
                    name: p.clone(),
                    source: "built-in shape of a released checkpoint; no config.json on disk"
                        .into(),
                    shape,
                });
            }
            let known: Vec<&str> = KNOWN_SHAPES.iter().map(|(id, _)| *id).collect();
            bail!(
                "model.path = \"{p}\": not a local directory ({}), not in the hub cache, and not a known released shape (known: {})",
                local.display(),
                known.join(", ")
            )
        }
        (None, Some(r)) => {
            // The same shape `conrub train` builds for `[model.random]` (checked when the
            // config was read).
            let c = conrub_models::ModelConfig::random(r);
            Ok(ModelSource {
                name: format!("random {}", r.family),
                source: "[model.random]".into(),
                shape: c.shape(),
            })
        }
        _ => bail!("[model] needs exactly one of `path` or `[model.random]`"),
    }
}

/// The plan of `cfg` on a device of `gpu_memory_gb` and where its model shape came from.
fn plan_of(
    cfg: &TrainConfig,
    gpu_memory_gb: f64,
    max_prompt_tokens: Option<usize>,
) -> Result<(MemoryPlan, ModelSource)> {
    if !(gpu_memory_gb.is_finite() && gpu_memory_gb > 0.0) {
        bail!("--gpu-memory-gb: {gpu_memory_gb} must be a positive number of GB");
    }
    if max_prompt_tokens == Some(0) {
        bail!("--max-prompt-tokens: must be at least 1");
    }
    let model = resolve_model(&cfg.model, &|p| cfg.resolve(p))
        .map_err(|e| anyhow!("{}: {e:#}", cfg.path.display()))?;
    let input =
        conrub_memory::MemoryPlanInput::for_run(cfg, model.shape, gpu_memory_gb, max_prompt_tokens);
    Ok((MemoryPlan::new(input), model))
}

/// The plan of a train config, for `conrub train` to check before its first step.
pub fn plan_for_config(cfg: &TrainConfig, gpu_memory_gb: f64) -> Result<MemoryPlan> {
    Ok(plan_of(cfg, gpu_memory_gb, None)?.0)
}

/// The check `conrub train` makes before loading anything: the run's memory plan against the
/// device's memory (`gpu_memory_gb`, else a cuda device's own total), or, on CPU ranks, against
/// each rank's share of the host memory available now. Returns the KV pool the plan budgeted
/// when the device size is known (the engine gets it).
pub fn check_run_fits(
    cfg: &TrainConfig,
    gpu_memory_gb: Option<f64>,
    config_path: &std::path::Path,
) -> Result<Option<usize>> {
    let gpu_gb = match gpu_memory_gb {
        Some(gb) => Some(gb),
        None => crate::backend::device_memory_bytes(&cfg.device)?.map(|b| b as f64 / 1e9),
    };
    if let Some(gb) = gpu_gb {
        let plan = plan_for_config(cfg, gb)?;
        plan.check((gb * 1e9) as u64).map_err(|e| {
            anyhow::anyhow!(
                "{}: the run does not fit in {gb} GB:\n{e}",
                config_path.display()
            )
        })?;
        return Ok(Some(plan.kv_pool_blocks));
    }
    if let Some(avail) = crate::backend::host_memory_for(&cfg.devices) {
        // CPU ranks share the host's memory; the engine keeps its CPU pool (every row at full
        // length), only the check is the plan's.
        let gb = avail as f64 / 1e9;
        plan_for_config(cfg, gb)?.check(avail).map_err(|e| {
            anyhow::anyhow!(
                "{}: the run does not fit in the {gb:.1} GB of host memory available to each of its {} CPU rank(s):\n{e}",
                config_path.display(),
                cfg.devices.len()
            )
        })?;
    }
    Ok(None)
}

/// With `rollout.engine = "sglang"`: the rollout line of the plan. The learner holds no KV pool
/// or sampling buffers (the plan has no rollout parts); colocated servers get what the
/// learner's resident parts leave of the device.
fn remote_rollout(cfg: &TrainConfig, plan: &MemoryPlan) -> Option<String> {
    if cfg.rollout.engine != RolloutEngineKind::Sglang {
        return None;
    }
    let mut line = format!(
        "rollout: on SGLang servers ({}): no KV pool or rollout buffers on the learner's side; its peak is the training peak, {:.2} GB",
        cfg.rollout.urls.join(", "),
        plan.training_peak / GB
    );
    if cfg.rollout.colocate {
        let resident: f64 = plan
            .parts
            .iter()
            .filter(|p| p.phase == Phase::Always)
            .map(|p| p.bytes)
            .sum();
        let gpu = plan.input.gpu_bytes();
        let share = (gpu - resident).max(0.0);
        line.push_str(&format!(
            "\ncolocated: while the servers decode, the learner keeps its resident {:.2} GB (weights, optimizer moments); a server on this device may take {:.2} GB ({:.0}% of {:.0} GB: SGLang's --mem-fraction-static at most {:.2}); it releases that memory before each update stage",
            resident / GB,
            share / GB,
            100.0 * share / gpu,
            gpu / GB,
            share / gpu
        ));
    }
    Some(line)
}

/// Runs `conrub plan`.
pub fn run(a: PlanArgs) -> Result<()> {
    let cfg = TrainConfig::from_file(&a.config, &a.overrides)?;
    super::check_plugins(&cfg)?;
    let (plan, model) = plan_of(&cfg, a.gpu_memory_gb, a.max_prompt_tokens)?;
    let device = cfg.device.clone();
    if a.json {
        let mut v = plan.to_json();
        v["config"] = a.config.display().to_string().into();
        v["device"] = device.into();
        v["devices"] = cfg.devices.clone().into();
        v["prompts_per_rank"] = cfg.prompts_per_rank().into();
        v["model"] = serde_json::json!({ "path": model.name, "source": model.source });
        v["rollout_engine"] = serde_json::to_value(cfg.rollout.engine)?;
        if let Some(r) = remote_rollout(&cfg, &plan) {
            v["rollout_remote"] = r.into();
        }
        return super::print_lines([serde_json::to_string_pretty(&v)?]);
    }
    let i = &plan.input;
    let m = &i.model;
    let remote = remote_rollout(&cfg, &plan);
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
        if cfg.devices.len() > 1 {
            format!(
                "data parallel: {} ranks ({}), sharding = \"{}\"; every figure below is per rank: at most {} of the step's {} prompts ({} rows), {}, and a gradient {} of {:.2} GB per optimizer step in buckets of {:.0} MiB",
                cfg.devices.len(),
                cfg.devices.join(", "),
                cfg.sharding.name(),
                cfg.prompts_per_rank(),
                cfg.run.prompts_per_step,
                cfg.prompts_per_rank() * i.group_size,
                match cfg.sharding {
                    Sharding::None => "a replica of the weights and AdamW",
                    Sharding::Optimizer => "a replica of the weights, 1/N of AdamW",
                    Sharding::Gradients => "a replica of the weights, 1/N of AdamW and the gradient sums",
                    Sharding::Full => "1/N of the weights, AdamW and the gradient sums",
                },
                if cfg.sharding.shards_optimizer() { "reduce-scatter" } else { "all-reduce" },
                plan.parameters as f64 * 4.0 / GB,
                cfg.learner.system.allreduce_bucket_mb
            )
        } else {
            "one device (no data parallelism)".to_string()
        },
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
    ];
    match remote {
        Some(r) => lines.push(r),
        None => lines.extend([
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
        ]),
    }
    lines.push(String::new());
    lines.extend(plan.table().lines().map(str::to_string));
    let advice = plan.advice();
    if !advice.is_empty() {
        lines.push(String::new());
        lines.extend(advice.lines().map(str::to_string));
    }
    super::print_lines(lines)
}
