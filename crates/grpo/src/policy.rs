//! The `Policy` trait: what the learner needs from a model. Qwen3 implements it; a user's own burn
//! model can too, with two methods (log-probs of given responses, next-token logits): sampling then
//! follows conrub-rollout's rules ([`SamplingConfig`], per-sequence seeded streams).

use burn::module::{AutodiffModule, Module};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Int, Tensor, TensorData};
use conrub_kernels::{token_logprobs, GrpoOps, DEFAULT_CHUNK_TOKENS};
use conrub_qwen3::Qwen3ForCausalLM;
use conrub_rollout::{
    sample_token, sequence_rng, ForwardBatch, Generation, PaddedBatch, Padding, RolloutError,
    SamplingConfig,
};

use crate::batch::TokenBatch;
use crate::error::{GrpoError, Result};

/// Per-token log-probabilities of given responses, and (where the model computes it in the same
/// pass) the entropy of each next-token distribution.
///
/// # Shapes
/// `logprobs` and `entropy` are `[rows, R]` like the batch's `targets`, 0 on padding slots.
#[derive(Debug, Clone)]
pub struct ResponseLogprobs<B: Backend> {
    /// `log p(response[j] | prompt, response[..j])`, differentiable.
    pub logprobs: Tensor<B, 2>,
    /// Next-token entropy (telemetry only).
    pub entropy: Option<Tensor<B, 2>>,
}

/// What the learner needs from a model.
pub trait Policy<B: Backend>: Module<B> {
    /// Log-probabilities of the batch's response tokens (see [`TokenBatch`] for the layout).
    ///
    /// # Shapes
    /// `batch.tokens` `[rows, S]` in, `[rows, R]` out.
    fn response_logprobs(&self, batch: &TokenBatch<B>) -> ResponseLogprobs<B>;

    /// Logits of the token after each sequence.
    ///
    /// # Shapes
    /// `[sequences, vocab]`.
    fn next_token_logits(&self, sequences: &[Vec<u32>], device: &B::Device) -> Tensor<B, 2>;

    /// Samples one continuation per prompt under `cfg`. The default recomputes the whole prefix for
    /// every new token through [`Policy::next_token_logits`] and samples with conrub-rollout's
    /// rules; models with a KV cache override it (Qwen3 runs `conrub_rollout::generate`).
    fn sample(
        &self,
        prompts: &[Vec<u32>],
        cfg: &SamplingConfig,
        device: &B::Device,
    ) -> Result<Vec<Generation>> {
        sample_by_recomputation(self, prompts, cfg, device)
    }

    /// The parameters' gradients of `loss(self.response_logprobs(batch))`. The default is one
    /// backward through the whole graph; a model may split it to save memory (Qwen3 with
    /// `activation_checkpointing` goes one decoder layer at a time). `loss` runs exactly once.
    fn loss_gradients(
        &self,
        batch: &TokenBatch<B>,
        loss: &mut dyn FnMut(ResponseLogprobs<B>) -> Tensor<B, 1>,
    ) -> GradientsParams
    where
        B: AutodiffBackend,
        Self: AutodiffModule<B>,
    {
        GradientsParams::from_grads(loss(self.response_logprobs(batch)).backward(), self)
    }

    /// [`Policy::loss_gradients`] added into `sum`, the running sum of an optimizer step's
    /// micro-batches (empty for the first); returns the new sum. The default adds the whole set
    /// once the backward is done; a policy that makes its gradients piece by piece (Qwen3 with
    /// activation checkpointing: the head, then a layer at a time) adds each piece as it is
    /// made, so a micro-batch's full set never exists beside the sum (conrub plan counts one
    /// layer's gradients there instead of a whole model's).
    fn loss_gradients_into(
        &self,
        batch: &TokenBatch<B>,
        loss: &mut dyn FnMut(ResponseLogprobs<B>) -> Tensor<B, 1>,
        sum: GradientsParams,
    ) -> GradientsParams
    where
        B: AutodiffBackend,
        Self: AutodiffModule<B>,
    {
        whole_gradients_into(self, batch, loss, sum)
    }

    /// Turns per-layer activation checkpointing on for [`Policy::loss_gradients`]
    /// ([`LearnerConfig::activation_checkpointing`](crate::LearnerConfig) calls it when the learner
    /// is built). `Err` says why the model cannot; the default (no layers to recompute) always
    /// refuses.
    fn enable_activation_checkpointing(&mut self) -> Result<()> {
        Err(GrpoError::config(
            "learner.activation_checkpointing",
            "this policy does not implement Policy::enable_activation_checkpointing (per-layer recomputation in loss_gradients)",
        ))
    }
}

/// The default sampler of [`Policy::sample`]: row `i` draws from [`sequence_rng`]`(cfg.seed, i)`, so
/// its tokens do not depend on the other rows, and finished rows leave the batch.
pub fn sample_by_recomputation<B: Backend, P: Policy<B>>(
    policy: &P,
    prompts: &[Vec<u32>],
    cfg: &SamplingConfig,
    device: &B::Device,
) -> Result<Vec<Generation>> {
    cfg.validate().map_err(GrpoError::Sampling)?;
    let mut out: Vec<Generation> = prompts.iter().map(|_| Generation::new()).collect();
    let mut rngs: Vec<_> = (0..prompts.len())
        .map(|i| sequence_rng(cfg.seed, cfg.first_stream + i as u64))
        .collect();
    let mut active: Vec<usize> = if cfg.max_new_tokens == 0 {
        Vec::new()
    } else {
        (0..prompts.len()).collect()
    };
    while !active.is_empty() {
        let seqs: Vec<Vec<u32>> = active
            .iter()
            .map(|&i| prompts[i].iter().chain(&out[i].tokens).copied().collect())
            .collect();
        let logits = policy.next_token_logits(&seqs, device).cast(DType::F32);
        let v = logits.dims()[1];
        let host: Vec<f32> = logits
            .into_data()
            .convert::<f32>()
            .into_vec()
            .map_err(|e| GrpoError::Sampling(RolloutError::Readback(format!("{e:?}"))))?;
        let mut still = Vec::with_capacity(active.len());
        for (row, &i) in active.iter().enumerate() {
            let (tok, lp) = sample_token(&host[row * v..(row + 1) * v], cfg, &mut rngs[i]);
            if out[i].push(tok, lp, cfg) {
                still.push(i);
            }
        }
        active = still;
    }
    Ok(out)
}

/// The Qwen3 policy computes response log-probabilities with the fused, chunked
/// [`conrub_kernels::token_logprobs`]: only the response positions go through the head, a chunk of
/// [`conrub_kernels::DEFAULT_CHUNK_TOKENS`] tokens at a time, and the backward recomputes each
/// chunk instead of keeping `[tokens, vocab]` probabilities. Sampling runs conrub-rollout's engine.
impl<B: GrpoOps> Policy<B> for Qwen3ForCausalLM<B> {
    fn response_logprobs(&self, batch: &TokenBatch<B>) -> ResponseLogprobs<B> {
        head_logprobs(self, self.forward_hidden(&teacher_forcing(batch)), batch)
    }

    fn loss_gradients(
        &self,
        batch: &TokenBatch<B>,
        loss: &mut dyn FnMut(ResponseLogprobs<B>) -> Tensor<B, 1>,
    ) -> GradientsParams
    where
        B: AutodiffBackend,
        Self: AutodiffModule<B>,
    {
        if !self.exec.activation_checkpointing {
            return GradientsParams::from_grads(
                loss(self.response_logprobs(batch)).backward(),
                self,
            );
        }
        self.layerwise_gradients(&teacher_forcing(batch), &mut |hidden| {
            loss(head_logprobs(self, hidden, batch))
        })
    }

    fn loss_gradients_into(
        &self,
        batch: &TokenBatch<B>,
        loss: &mut dyn FnMut(ResponseLogprobs<B>) -> Tensor<B, 1>,
        sum: GradientsParams,
    ) -> GradientsParams
    where
        B: AutodiffBackend,
        Self: AutodiffModule<B>,
    {
        if !self.exec.activation_checkpointing {
            return whole_gradients_into(self, batch, loss, sum);
        }
        self.layerwise_gradients_into(
            &teacher_forcing(batch),
            &mut |hidden| loss(head_logprobs(self, hidden, batch)),
            sum,
        )
    }

    fn enable_activation_checkpointing(&mut self) -> Result<()> {
        self.exec.activation_checkpointing = true;
        Ok(())
    }

    fn next_token_logits(&self, sequences: &[Vec<u32>], device: &B::Device) -> Tensor<B, 2> {
        let padded = PaddedBatch::new(sequences, 0, Padding::Left);
        self.forward_last(&padded.to_device(device))
    }

    fn sample(
        &self,
        prompts: &[Vec<u32>],
        cfg: &SamplingConfig,
        device: &B::Device,
    ) -> Result<Vec<Generation>> {
        conrub_rollout::generate(self, prompts, cfg, device).map_err(GrpoError::Sampling)
    }
}

/// The model inputs of a right-padded token batch: every real token sees only real tokens before
/// it under the causal mask, so no key mask is needed and positions are the column index.
fn teacher_forcing<B: Backend>(batch: &TokenBatch<B>) -> ForwardBatch<B> {
    let [n, s] = batch.tokens.dims();
    let device = batch.tokens.device();
    let position_ids = Tensor::<B, 1, Int>::arange(0..s as i64, &device)
        .reshape([1, s])
        .expand([n, s]);
    ForwardBatch {
        input_ids: batch.tokens.clone(),
        position_ids,
        key_mask: None,
    }
}

/// Log-probabilities of the response tokens from the final hidden states `[rows, S, hidden]`:
/// only response positions go through the fused head (f32 statistics whatever the precision).
fn head_logprobs<B: GrpoOps>(
    model: &Qwen3ForCausalLM<B>,
    hidden: Tensor<B, 3>,
    batch: &TokenBatch<B>,
) -> ResponseLogprobs<B> {
    let [n, _, h] = hidden.dims();
    let r = batch.positions.dims()[1];
    let pos = batch.positions.clone().reshape([n, r, 1]).repeat_dim(2, h);
    let picked = hidden.gather(1, pos).reshape([n * r, h]);
    let head = conrub_qwen3::model::to_dtype(model.head_weight(), picked.dtype());
    let out = token_logprobs(
        picked,
        head,
        batch.targets.clone().reshape([n * r]),
        DEFAULT_CHUNK_TOKENS,
    );
    ResponseLogprobs {
        logprobs: out.logprobs.reshape([n, r]) * batch.mask.clone(),
        entropy: Some(out.entropy.reshape([n, r]) * batch.mask.clone()),
    }
}

/// Row ids as a device index.
pub(crate) fn row_index<B: Backend>(rows: &[usize], device: &B::Device) -> Tensor<B, 1, Int> {
    let ids: Vec<i64> = rows.iter().map(|&r| r as i64).collect();
    Tensor::from_data(TensorData::new(ids, [rows.len()]), device)
}

/// [`Policy::loss_gradients_into`] by default: the whole set of `loss`'s gradients, then added
/// into `sum`.
fn whole_gradients_into<B, P>(
    policy: &P,
    batch: &TokenBatch<B>,
    loss: &mut dyn FnMut(ResponseLogprobs<B>) -> Tensor<B, 1>,
    sum: GradientsParams,
) -> GradientsParams
where
    B: AutodiffBackend,
    P: Policy<B> + AutodiffModule<B>,
{
    let new = policy.loss_gradients(batch, loss);
    add_gradients(policy, sum, new)
}

/// See [`conrub_kernels::gradients::add_gradients`]: what [`Policy::loss_gradients_into`] does
/// with a whole set.
pub use conrub_kernels::gradients::add_gradients;
