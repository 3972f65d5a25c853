//! The rollout engine of `[rollout]`: conrub-rollout's paged engine in process, or SGLang servers
//! that load the policy's weights (written by
//! [`PolicyParts::rollout_weights`](crate::PolicyParts::rollout_weights)) after every step.

use std::sync::Arc;

use burn::backend::Autodiff;
use burn::module::AutodiffModule;
use conrub_config::{RolloutEngineKind, TrainConfig};
use conrub_contracts::{KvLayout, PagedModel, Policy};
use conrub_grpo::InProcessEngine;
use conrub_kernels::KernelOps;
use conrub_remote::{SglangConfig, SglangEngine, WeightWriter};
use conrub_rewards::TaskPrompt;
use conrub_rollout::EngineConfig;

use crate::error::{Result, TrainerError};
use crate::{Engine, Trainer};

impl<B, P, T> Trainer<B, P, T>
where
    B: KernelOps,
    P: Policy<Autodiff<B>> + AutodiffModule<Autodiff<B>> + Send + 'static,
    P::InnerModule: Policy<B> + PagedModel<B> + 'static,
    T: TaskPrompt + 'static,
{
    /// The run's engine, built on first use (the kernel warm-up and the run share it).
    pub(crate) fn engine_for(&mut self, model: &P) -> Result<Engine<B, P>> {
        if let Some(e) = &self.engine {
            return Ok(e.clone());
        }
        let engine: Engine<B, P> = match self.cfg.rollout.engine {
            RolloutEngineKind::Paged => {
                let layout = model.valid().kv_layout();
                Arc::new(InProcessEngine {
                    prompts_per_call: self.cfg.learner.system.rollout_prompts_per_call,
                    engine: paged_engine(&self.cfg, layout, self.kv_pool_blocks),
                })
            }
            _ => {
                let vocab_size = model.valid().vocab_size();
                sglang_engine::<B, P>(
                    &self.cfg,
                    self.rollout_weights.clone(),
                    vocab_size,
                    self.runtime.handle().clone(),
                )?
            }
        };
        self.engine = Some(engine.clone());
        Ok(engine)
    }
}

/// The paged engine's settings: the pool of `rollout.kv_cache_gb`, else the memory plan's
/// (`kv_pool_blocks`), else every row at full length.
fn paged_engine(
    cfg: &TrainConfig,
    layout: KvLayout,
    kv_pool_blocks: Option<usize>,
) -> EngineConfig {
    let engine = EngineConfig {
        block_size: cfg.rollout.block_size,
        kv_blocks: None,
        max_rows: cfg.rollout.max_rows,
    };
    let engine = match cfg.rollout.kv_cache_gb {
        Some(gb) => engine.with_kv_bytes((gb * 1e9) as u64, layout),
        None => EngineConfig {
            kv_blocks: kv_pool_blocks,
            ..engine
        },
    };
    if let Some(blocks) = engine.kv_blocks {
        tracing::info!(
            "rollout KV pool: {blocks} blocks of {} positions ({:.2} GB)",
            engine.block_size,
            blocks as f64 * layout.block_bytes(engine.block_size) as f64 / 1e9
        );
    }
    engine
}

/// SGLang servers on `rollout.urls`, given the policy as bf16 safetensors in
/// `output_dir/rollout-weights` after every step.
fn sglang_engine<B, P>(
    cfg: &TrainConfig,
    writer: Option<WeightWriter<P::InnerModule>>,
    vocab_size: usize,
    runtime: tokio::runtime::Handle,
) -> Result<Engine<B, P>>
where
    B: KernelOps,
    P: Policy<Autodiff<B>> + AutodiffModule<Autodiff<B>>,
    P::InnerModule: Policy<B> + PagedModel<B> + 'static,
{
    let r = &cfg.rollout;
    let writer = writer.ok_or_else(|| {
        TrainerError::Setup(
            "rollout.engine = \"sglang\": this policy has no weight writer (PolicyParts::rollout_weights)"
                .into(),
        )
    })?;
    let sglang = SglangConfig {
        urls: r.urls.clone(),
        timeout_secs: r.timeout_secs,
        max_retries: r.max_retries,
        backoff_secs: 1.0,
        concurrency: r.concurrency,
        colocate: r.colocate,
        vocab_size,
        weights_dir: cfg.resolve(&cfg.run.output_dir).join("rollout-weights"),
    };
    tracing::info!(
        "rollouts on SGLang: {} (weights in {}{})",
        r.urls
            .iter()
            .map(|u| conrub_base::shown_url(u))
            .collect::<Vec<_>>()
            .join(", "),
        sglang.weights_dir.display(),
        if r.colocate { ", colocated" } else { "" }
    );
    Ok(Arc::new(SglangEngine::new(sglang, writer, runtime)?))
}
