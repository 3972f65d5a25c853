//! The policy a run trains and what comes with it: its codec, stop ids and writers.
//! [`load_policy`] makes one from `[model]` for every `conrub_models` family; an embedder with
//! its own burn model fills [`PolicyParts`] by hand.

use std::path::Path;
use std::sync::Arc;

use burn::backend::Autodiff;
use burn::module::AutodiffModule;
use conrub_config::TrainConfig;
use conrub_contracts::{Export, TextCodec};
use conrub_kernels::KernelOps;
use conrub_models::{
    save_pretrained_sharded, AttentionImpl, AttentionKernels, CausalLm, ChatTemplateCodec,
    Execution, HfExport, ModelConfig, Precision, Pretrained, SaveDtype,
};
use conrub_remote::WeightWriter;

use crate::error::{Result, TrainerError};

/// A policy with what a run needs besides its weights.
pub struct PolicyParts<B: KernelOps, P: AutodiffModule<Autodiff<B>>> {
    /// The network, on the first device.
    pub model: P,
    /// Renders prompts and decodes responses.
    pub codec: Arc<dyn TextCodec>,
    /// Ids that end a response.
    pub stop_ids: Vec<u32>,
    /// Writes a checkpoint's deployable copy (a Hugging Face directory for `conrub_models`).
    pub export: Arc<dyn Export<P>>,
    /// Writes the weights an SGLang server loads after every step (`rollout.engine =
    /// "sglang"`); `None`: this policy cannot roll out on SGLang.
    pub rollout_weights: Option<WeightWriter<P::InnerModule>>,
}

/// The policy of `[model]` (a checkpoint directory or hub id, or `[model.random]`) on `device`,
/// with the execution settings of the config, the family's chat template and Hugging Face
/// writers.
pub fn load_policy<B: KernelOps>(
    cfg: &TrainConfig,
    device: &B::Device,
) -> Result<PolicyParts<B, CausalLm<Autodiff<B>>>> {
    let pretrained = read_pretrained::<B>(cfg, device)?;
    let kernels = conrub_kernels::resolve_attention_kernels::<B>(cfg.attention_kernels, device)
        .map_err(|why| TrainerError::Setup(format!("{}: {why}", cfg.path.display())))?;
    if kernels == AttentionKernels::TensorCore && cfg.precision == Precision::F32 {
        tracing::warn!(
            "attention_kernels = \"tensor-core\" with precision f32: f32 attention keeps \
             the portable kernels (the tensor-core ones take bf16 and f16)"
        );
    }
    // Activation checkpointing and the entropy gradient are the learner's to turn on when it
    // is built (`learner.activation_checkpointing`, `learner.entropy_coeff`).
    let pretrained = pretrained.with_execution(Execution {
        precision: cfg.precision,
        attention: AttentionImpl::Fused,
        activation_checkpointing: false,
        attention_kernels: kernels,
        entropy_gradient: false,
    });
    let stop_ids = pretrained.stop_ids();
    let Pretrained {
        model,
        config,
        generation_config,
        tokenizer,
        dir,
    } = pretrained;
    let tokenizer = tokenizer.ok_or_else(|| {
        TrainerError::Setup(format!("[model]: {} has no tokenizer.json", dir.display()))
    })?;
    let tokenizer_dir = match &cfg.model.random {
        Some(r) => cfg.resolve(&r.tokenizer),
        None => dir,
    };
    let (weights_config, weights_tokenizer) = (config.clone(), tokenizer_dir.clone());
    let max_shard_bytes = cfg.model.max_shard_bytes();
    let rollout_weights: WeightWriter<CausalLm<B>> = Arc::new(move |policy, dir: &Path| {
        Ok(save_pretrained_sharded(
            policy,
            &weights_config,
            None,
            Some(&weights_tokenizer),
            dir,
            SaveDtype::Bf16,
            Some(max_shard_bytes),
        )?)
    });
    Ok(PolicyParts {
        model,
        codec: Arc::new(ChatTemplateCodec {
            tokenizer,
            enable_thinking: cfg.model.enable_thinking,
        }),
        stop_ids,
        export: Arc::new(HfExport {
            config,
            generation_config,
            tokenizer_dir: Some(tokenizer_dir),
            dtype: cfg.model.save_dtype,
            max_shard_bytes: Some(max_shard_bytes),
        }),
        rollout_weights: Some(rollout_weights),
    })
}

/// The checkpoint or random model of `[model]`.
fn read_pretrained<B: KernelOps>(
    cfg: &TrainConfig,
    device: &B::Device,
) -> Result<Pretrained<Autodiff<B>>> {
    let model = &cfg.model;
    Ok(match (&model.path, &model.random) {
        (Some(p), None) => {
            let local = cfg.resolve(Path::new(p));
            if local.is_dir() {
                Pretrained::load_dir(&local, device)?
            } else {
                Pretrained::load(p, device)?
            }
        }
        (None, Some(r)) => Pretrained::random(
            ModelConfig::random(r),
            &cfg.resolve(&r.tokenizer),
            r.std,
            r.seed,
            device,
        )?,
        _ => {
            return Err(TrainerError::Input {
                path: cfg.path.clone(),
                message: "[model] needs exactly one of `path` or `[model.random]`".into(),
            })
        }
    })
}
