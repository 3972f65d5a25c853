//! How a model runs: compute precision, attention implementation and kernels, activation
//! checkpointing. Every family of `models/` takes an [`Execution`]; it is not part of checkpoints.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
pub use conrub_kernels::{AttentionKernelChoice, AttentionKernels};
pub use conrub_settings::Precision;

/// Which attention implementation multi-token passes (training, prefill, scoring) use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionImpl {
    /// [`conrub_kernels::causal_attention`]: no `[t, s]` matrix is kept; memory linear in `t`.
    #[default]
    Fused,
    /// Scores, softmax and the value product as separate tensor ops (the reference; quadratic
    /// memory under autodiff).
    Naive,
}

/// How the model runs: precision, attention, activation checkpointing. Not part of checkpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Execution {
    /// Compute precision.
    pub precision: Precision,
    /// Attention of multi-token passes (single-token decode steps read the KV cache directly).
    pub attention: AttentionImpl,
    /// Train one decoder layer at a time (a family's layer-wise gradients): keep only
    /// each layer's input from a forward pass without a graph, and recompute each layer's
    /// forward during the backward instead of keeping its activations. Used by the learner.
    pub activation_checkpointing: bool,
    /// The CubeCL kernels of fused attention (portable or tensor-core; CPU backends ignore it).
    /// Checked against the device by `AttentionOps::check_attention_kernels` where it is chosen.
    pub attention_kernels: AttentionKernels,
    /// The entropies of the response log-probabilities carry gradients (an entropy bonus in the
    /// loss, `learner.entropy_coeff`): the fused head's backward then runs the portable chunked
    /// driver (`conrub_kernels::token_logprobs_with_entropy`). Set by the learner.
    pub entropy_gradient: bool,
}

/// `t` in `dtype` (a no-op when it already is).
pub fn to_dtype<B: Backend, const D: usize>(t: Tensor<B, D>, dtype: DType) -> Tensor<B, D> {
    if t.dtype() == dtype {
        t
    } else {
        t.cast(dtype)
    }
}
