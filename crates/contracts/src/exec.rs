//! How a model runs: compute precision, attention implementation and kernels, activation
//! checkpointing. Every family of `models/` takes an [`Execution`]; it is not part of checkpoints.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
pub use conrub_kernels::{AttentionKernelChoice, AttentionKernels};

/// Numeric precision of the forward and backward passes.
///
/// The parameters are what the model holds (f32 master weights when built or loaded by this
/// crate); the compute dtype is what activations and matrix products use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Precision {
    /// Compute in the parameters' own dtype (f32 for f32 weights).
    #[default]
    F32,
    /// bf16 activations and matrix products (weights are cast where they are used, and the cast's
    /// backward returns f32 gradients to the f32 master weights); norms' statistics, softmax,
    /// attention accumulation, log-probabilities and the loss stay in f32.
    Bf16Mixed,
}

impl Precision {
    /// Every accepted spelling, for error messages.
    pub const NAMES: &'static str = "f32, bf16-mixed";

    /// Parses `f32` or `bf16-mixed`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "f32" => Some(Self::F32),
            "bf16-mixed" => Some(Self::Bf16Mixed),
            _ => None,
        }
    }

    /// Bytes per element of the activations (and of a rollout KV cache).
    pub fn compute_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::Bf16Mixed => 2,
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::F32 => "f32",
            Self::Bf16Mixed => "bf16-mixed",
        })
    }
}

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
