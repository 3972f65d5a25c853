//! The [`Policy`] of every family (one `CausalLm`): response log-probabilities through the fused, chunked head,
//! gradients one decoder layer at a time under activation checkpointing, sampling on the paged
//! engine.

use burn::module::AutodiffModule;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Int, Tensor};
use conrub_contracts::{
    whole_backward, ForwardBatch, Generation, Gradients, PaddedBatch, Padding, Policy,
    ResponseLogprobs, SamplingConfig, TokenBatch,
};
use conrub_kernels::{
    token_logprobs, token_logprobs_with_entropy, KernelOps, DEFAULT_CHUNK_TOKENS,
};

use crate::model::{to_dtype, CausalLm, Precision};

/// The policy computes response log-probabilities with the fused, chunked
/// [`conrub_kernels::token_logprobs`]: only the response positions go through the head, a chunk of
/// [`conrub_kernels::DEFAULT_CHUNK_TOKENS`] tokens at a time, and the backward recomputes each
/// chunk instead of keeping `[tokens, vocab]` probabilities. Sampling runs conrub-rollout's engine.
impl<B: KernelOps> Policy<B> for CausalLm<B> {
    fn response_logprobs(&self, batch: &TokenBatch<B>) -> ResponseLogprobs<B> {
        head_logprobs(self, self.forward_hidden(&teacher_forcing(batch)), batch)
    }

    fn backward(
        &self,
        batch: &TokenBatch<B>,
        loss: &mut dyn FnMut(ResponseLogprobs<B>) -> Tensor<B, 1>,
        into: Gradients<'_, B>,
    ) -> conrub_contracts::Result<()>
    where
        B: AutodiffBackend,
        Self: AutodiffModule<B>,
    {
        if !self.exec.activation_checkpointing {
            return whole_backward(self, batch, loss, into);
        }
        let forward = teacher_forcing(batch);
        match into {
            Gradients::Sum(sum) => {
                let running = std::mem::take(sum);
                *sum = self.layerwise_gradients_into(
                    &forward,
                    &mut |hidden| loss(head_logprobs(self, hidden, batch)),
                    running,
                );
            }
            Gradients::Pieces(sink) => self.layerwise_gradients_each(
                &forward,
                &mut |hidden| loss(head_logprobs(self, hidden, batch)),
                sink,
            ),
            Gradients::Gathered { pieces, source } => self.layerwise_gradients_gathered(
                &forward,
                &mut |model, hidden| loss(head_logprobs(model, hidden, batch)),
                pieces,
                source,
            )?,
        }
        Ok(())
    }

    /// Every projection, the embedding lookup and the head cast their matrix to the compute
    /// dtype (`project`, `embed`, `head_logprobs`); norms read their f32 scales.
    fn matrix_dtype(&self) -> Option<DType> {
        (self.exec.precision == Precision::Bf16Mixed).then_some(DType::BF16)
    }

    fn enable_activation_checkpointing(&mut self) -> conrub_contracts::Result<()> {
        self.exec.activation_checkpointing = true;
        Ok(())
    }

    fn enable_entropy_gradient(&mut self) -> conrub_contracts::Result<()> {
        self.exec.entropy_gradient = true;
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
    ) -> conrub_contracts::Result<Vec<Generation>> {
        conrub_rollout::generate(self, prompts, cfg, device)
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
fn head_logprobs<B: KernelOps>(
    model: &CausalLm<B>,
    hidden: Tensor<B, 3>,
    batch: &TokenBatch<B>,
) -> ResponseLogprobs<B> {
    let [n, _, h] = hidden.dims();
    let r = batch.positions.dims()[1];
    let pos = batch.positions.clone().reshape([n, r, 1]).repeat_dim(2, h);
    let picked = hidden.gather(1, pos).reshape([n * r, h]);
    let head = to_dtype(model.head_weight(), picked.dtype());
    let fused = match model.exec.entropy_gradient {
        true => token_logprobs_with_entropy,
        false => token_logprobs,
    };
    let out = fused(
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
