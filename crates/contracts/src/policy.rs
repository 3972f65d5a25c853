//! The `Policy` trait: what the learner needs from a model. Every model family of `models/`
//! implements it; a user's own burn model can too, with two methods (log-probs of given responses,
//! next-token logits): sampling then follows the contracts' rules ([`SamplingConfig`],
//! per-sequence seeded streams).

use burn::module::{AutodiffModule, Module};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Tensor};

use conrub_kernels::sampling::SeenIds;

use crate::error::{ContractError, Result};
use crate::gather::{gathered, ParamGather};
use crate::sampling::{sample_token, sequence_rng, Generation, SamplingConfig};
use crate::tokens::TokenBatch;

/// Per-token log-probabilities of given responses, and (where the model computes it in the same
/// pass) the entropy of each next-token distribution.
///
/// # Shapes
/// `logprobs` and `entropy` are `[rows, R]` like the batch's `targets`, 0 on padding slots.
#[derive(Debug, Clone)]
pub struct ResponseLogprobs<B: Backend> {
    /// `log p(response[j] | prompt, response[..j])`, differentiable.
    pub logprobs: Tensor<B, 2>,
    /// Next-token entropy: telemetry, differentiable after [`Policy::enable_entropy_gradient`].
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
    /// every new token through [`Policy::next_token_logits`] and samples with the contracts'
    /// rules; models with a KV cache override it (the `models/` families run
    /// `conrub_rollout::generate`).
    fn sample(
        &self,
        prompts: &[Vec<u32>],
        cfg: &SamplingConfig,
        device: &B::Device,
    ) -> Result<Vec<Generation>> {
        sample_by_recomputation(self, prompts, cfg, device)
    }

    /// The parameters' gradients of `loss(self.response_logprobs(batch))`. The default is one
    /// backward through the whole graph; a model may split it to save memory (the `models/` families with
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
    /// once the backward is done; a policy that makes its gradients piece by piece (the `models/` families with
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

    /// [`Policy::loss_gradients`] handed to `sink` piece by piece as the backward makes them:
    /// the default hands over the whole set once; a policy that makes its gradients a segment
    /// at a time (the `models/` families with activation checkpointing: the head, each layer
    /// from the top, the embedding) hands over each segment's. A sharded data-parallel rank
    /// reduce-scatters each piece as it comes, so neither a micro-batch's whole set nor a
    /// whole running sum exists on it. Every call on a given policy hands over the same
    /// sequence of parameter sets (the ranks of a group call collectives in step).
    fn loss_gradients_each(
        &self,
        batch: &TokenBatch<B>,
        loss: &mut dyn FnMut(ResponseLogprobs<B>) -> Tensor<B, 1>,
        sink: &mut dyn FnMut(GradientsParams),
    ) where
        B: AutodiffBackend,
        Self: AutodiffModule<B>,
    {
        sink(self.loss_gradients(batch, loss));
    }

    /// [`Policy::loss_gradients_each`] of a policy whose parameters are sharded over
    /// data-parallel ranks (`sharding = "full"`: the parameters this rank does not own are
    /// placeholders): whole values come from `source` as they are needed. The default gathers
    /// the whole policy once and drops it after the backward; the `models/` families with
    /// activation checkpointing gather one segment at a time (the embedding and head, then each
    /// decoder layer for its forward and again for its backward), so one layer's whole weights
    /// are alive beside the shards. Every call makes the same gathers, whatever `batch` holds.
    fn loss_gradients_gathered(
        &self,
        batch: &TokenBatch<B>,
        loss: &mut dyn FnMut(ResponseLogprobs<B>) -> Tensor<B, 1>,
        sink: &mut dyn FnMut(GradientsParams),
        source: &mut dyn ParamGather<B>,
    ) -> Result<()>
    where
        B: AutodiffBackend,
        Self: AutodiffModule<B>,
    {
        let whole = gathered(self, source)?;
        whole.loss_gradients_each(batch, loss, sink);
        Ok(())
    }

    /// The dtype every weight matrix (a parameter of two or more dimensions) is cast to when
    /// the forward uses it (bf16 under bf16-mixed), or `None` when matrices are used as stored
    /// (the default). A `sharding = "full"` rank gathers the whole weights for its rollouts in
    /// it: the same outputs for half the bytes.
    fn matrix_dtype(&self) -> Option<DType> {
        None
    }

    /// Turns per-layer activation checkpointing on for [`Policy::loss_gradients`]
    /// (`conrub_grpo`'s `learner.activation_checkpointing` calls it when the learner
    /// is built). `Err` says why the model cannot; the default (no layers to recompute) always
    /// refuses.
    fn enable_activation_checkpointing(&mut self) -> Result<()> {
        Err(ContractError::Unsupported {
            key: "learner.activation_checkpointing".into(),
            message: "this policy does not implement Policy::enable_activation_checkpointing (per-layer recomputation in loss_gradients)".into(),
        })
    }

    /// Makes [`ResponseLogprobs::entropy`] differentiable in [`Policy::loss_gradients`] (and its
    /// variants), for an entropy bonus in the loss (`conrub_grpo`'s `learner.entropy_coeff` calls
    /// it when the learner is built). `Err` says why the policy cannot; the default refuses.
    fn enable_entropy_gradient(&mut self) -> Result<()> {
        Err(ContractError::Unsupported {
            key: "learner.entropy_coeff".into(),
            message: "this policy does not implement Policy::enable_entropy_gradient (entropies with gradients in ResponseLogprobs)".into(),
        })
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
    cfg.validate()?;
    let mut out: Vec<Generation> = prompts.iter().map(|_| Generation::new()).collect();
    let mut rngs: Vec<_> = (0..prompts.len())
        .map(|i| sequence_rng(cfg.seed, cfg.first_stream + i as u64))
        .collect();
    let penalty = cfg.decoding.repetition_penalty();
    let mut seen: Vec<SeenIds> = prompts
        .iter()
        .map(|p| SeenIds::for_penalty(p, penalty))
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
            .map_err(|e| ContractError::Readback(format!("{e:?}")))?;
        let mut still = Vec::with_capacity(active.len());
        for (row, &i) in active.iter().enumerate() {
            let row_logits = &host[row * v..(row + 1) * v];
            let (tok, lp) = sample_token(row_logits, seen[i].ids(), cfg, &mut rngs[i]);
            seen[i].insert(tok);
            if out[i].push(tok, lp, cfg) {
                still.push(i);
            }
        }
        active = still;
    }
    Ok(out)
}

/// [`Policy::loss_gradients_into`] by default (and for a model's own implementation when it
/// computes the whole set at once): the whole set of `loss`'s gradients, then added
/// into `sum`.
pub fn whole_gradients_into<B, P>(
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
