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

    /// The backward pass of `loss(self.response_logprobs(batch))`, its parameters' gradients
    /// delivered as `into` asks (the learner picks the [`Gradients`] path once, when it is
    /// built: a running sum, pieces for a sharded rank, or pieces of a policy whose parameters
    /// are sharded). `loss` runs exactly once. The default is one backward through the whole
    /// graph ([`whole_backward`]); a model may split it to save memory (the `models/` families
    /// with `activation_checkpointing` go one decoder layer at a time, and hand over or add in
    /// each layer's gradients as they are made). Every call on a given policy hands the same
    /// sequence of parameter sets to a [`Gradients::Pieces`] sink, and makes the same gathers
    /// from a [`Gradients::Gathered`] source, whatever `batch` holds (the ranks of a group call
    /// collectives in step).
    fn backward(
        &self,
        batch: &TokenBatch<B>,
        loss: &mut dyn FnMut(ResponseLogprobs<B>) -> Tensor<B, 1>,
        into: Gradients<'_, B>,
    ) -> Result<()>
    where
        B: AutodiffBackend,
        Self: AutodiffModule<B>,
    {
        whole_backward(self, batch, loss, into)
    }

    /// The dtype every weight matrix (a parameter of two or more dimensions) is cast to when
    /// the forward uses it (bf16 under bf16-mixed), or `None` when matrices are used as stored
    /// (the default). A `sharding = "full"` rank gathers the whole weights for its rollouts in
    /// it: the same outputs for half the bytes.
    fn matrix_dtype(&self) -> Option<DType> {
        None
    }

    /// Turns per-layer activation checkpointing on for [`Policy::backward`]
    /// (`conrub_grpo`'s `learner.activation_checkpointing` calls it when the learner
    /// is built). `Err` says why the model cannot; the default (no layers to recompute) always
    /// refuses.
    fn enable_activation_checkpointing(&mut self) -> Result<()> {
        Err(ContractError::Unsupported {
            key: "learner.activation_checkpointing".into(),
            message: "this policy does not implement Policy::enable_activation_checkpointing (per-layer recomputation in backward)".into(),
        })
    }

    /// Makes [`ResponseLogprobs::entropy`] differentiable in [`Policy::backward`], for an entropy bonus in the loss (`conrub_grpo`'s `learner.entropy_coeff` calls
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

/// Where the gradients of a [`Policy::backward`] go.
pub enum Gradients<'a, B: Backend> {
    /// Added into `sum`, the running sum of an optimizer step's micro-batches (empty for the
    /// first). A policy that makes its gradients piece by piece adds each piece as it is made,
    /// so a micro-batch's full set never exists beside the sum (conrub plan counts one layer's
    /// gradients there instead of a whole model's).
    Sum(&'a mut GradientsParams),
    /// Handed to the sink piece by piece as the backward makes them (the whole set at once by
    /// default; a segment at a time under activation checkpointing: the head, each layer from
    /// the top, the embedding). A sharded data-parallel rank reduce-scatters each piece as it
    /// comes, so neither a micro-batch's whole set nor a whole running sum exists on it.
    Pieces(&'a mut dyn FnMut(GradientsParams)),
    /// [`Gradients::Pieces`] of a policy whose parameters are sharded over data-parallel ranks
    /// (`sharding = "full"`: the parameters this rank does not own are placeholders): whole
    /// values come from `source` as they are needed. By default the whole policy is gathered
    /// once and dropped after the backward; the `models/` families with activation
    /// checkpointing gather one segment at a time (the embedding and head, then each decoder
    /// layer for its forward and again for its backward), so one layer's whole weights are
    /// alive beside the shards.
    Gathered {
        /// Where each piece goes.
        pieces: &'a mut dyn FnMut(GradientsParams),
        /// Where whole parameter values come from.
        source: &'a mut dyn ParamGather<B>,
    },
}

/// [`Policy::backward`] by default, and for a model's own implementation when it computes the
/// whole set at once: one backward through the whole graph, its gradients added into the sum,
/// handed over as one piece, or (for sharded parameters) computed on the whole policy gathered
/// from the source.
pub fn whole_backward<B, P>(
    policy: &P,
    batch: &TokenBatch<B>,
    loss: &mut dyn FnMut(ResponseLogprobs<B>) -> Tensor<B, 1>,
    into: Gradients<'_, B>,
) -> Result<()>
where
    B: AutodiffBackend,
    P: Policy<B> + AutodiffModule<B>,
{
    let whole = |policy: &P, loss: &mut dyn FnMut(ResponseLogprobs<B>) -> Tensor<B, 1>| {
        GradientsParams::from_grads(loss(policy.response_logprobs(batch)).backward(), policy)
    };
    match into {
        Gradients::Sum(sum) => {
            let new = whole(policy, loss);
            *sum = add_gradients(policy, std::mem::take(sum), new);
        }
        Gradients::Pieces(sink) => sink(whole(policy, loss)),
        Gradients::Gathered { pieces, source } => {
            let gathered = gathered(policy, source)?;
            gathered.backward(batch, loss, Gradients::Pieces(pieces))?;
        }
    }
    Ok(())
}

/// The whole set of gradients of `loss(policy.response_logprobs(batch))` ([`Policy::backward`]
/// into an empty sum).
pub fn loss_gradients<B, P>(
    policy: &P,
    batch: &TokenBatch<B>,
    loss: &mut dyn FnMut(ResponseLogprobs<B>) -> Tensor<B, 1>,
) -> Result<GradientsParams>
where
    B: AutodiffBackend,
    P: Policy<B> + AutodiffModule<B>,
{
    let mut sum = GradientsParams::new();
    policy.backward(batch, loss, Gradients::Sum(&mut sum))?;
    Ok(sum)
}

/// See [`conrub_kernels::gradients::add_gradients`]: how a [`Gradients::Sum`] takes a piece.
pub use conrub_kernels::gradients::add_gradients;
