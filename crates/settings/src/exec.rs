//! How the policy runs, as a config names it: compute precision, the attention kernels and the
//! data-parallel sharding. The types that act on them (`conrub_contracts::Execution`,
//! `conrub_kernels::resolve_attention_kernels`) live with the code.

use serde::{Deserialize, Serialize};

/// Numeric precision of the forward and backward passes.
///
/// The parameters are what the model holds (f32 master weights when built or loaded by this
/// crate); the compute dtype is what activations and matrix products use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
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

/// The run config's `attention_kernels` (and `--attention-kernels`): `auto`, `tensor-core` or
/// `portable`, resolved against the device once per run by `conrub_kernels::resolve_attention_kernels`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AttentionKernelChoice {
    /// The tensor-core kernels where the device has cooperative matrices and
    /// `conrub_kernels::TENSOR_CORE_KERNELS_VALIDATED` is set, the portable ones elsewhere.
    #[default]
    Auto,
    /// the tensor-core kernels; an error on a device without cooperative matrices.
    TensorCore,
    /// The portable kernels.
    Portable,
}

impl AttentionKernelChoice {
    /// The accepted spellings, for messages.
    pub const NAMES: &'static str = "auto, tensor-core, portable";

    /// `auto`, `tensor-core` or `portable`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "auto" => Some(Self::Auto),
            "tensor-core" => Some(Self::TensorCore),
            "portable" => Some(Self::Portable),
            _ => None,
        }
    }
}

/// How the ranks of a data-parallel run divide the training state (`sharding`, beside
/// `devices`; ZeRO stages 1-3 in DeepSpeed's terms). Parameters are owned whole, each by one
/// rank, balanced by bytes (`conrub_parallel::ShardLayout`). On one device every mode is `none`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Sharding {
    /// Every rank holds a replica of the weights, the gradients and the AdamW moments; gradients
    /// are all-reduced once per optimizer step.
    #[default]
    None,
    /// ZeRO-1: a rank keeps the AdamW moments of the parameters it owns only. The optimizer
    /// step's gradients are reduce-scattered (each owner gets its parameters' sums), the owner
    /// updates them and the updated weights are all-gathered.
    Optimizer,
    /// ZeRO-2 (FSDP's SHARD_GRAD_OP): in addition, each micro-batch's gradients are
    /// reduce-scattered as soon as its backward is done, so the running sum a rank keeps
    /// between micro-batches holds its own parameters only.
    Gradients,
    /// ZeRO-3 (FULL_SHARD): in addition, a rank keeps only its own parameters between uses;
    /// the whole weights are gathered for the step's rollouts and old log-probabilities, then
    /// one segment at a time (the embedding and head, each decoder layer) for the forward and
    /// backward passes, and dropped after use. Needs activation checkpointing.
    Full,
}

impl Sharding {
    /// Every mode, `none` first.
    pub const ALL: [Sharding; 4] = [
        Sharding::None,
        Sharding::Optimizer,
        Sharding::Gradients,
        Sharding::Full,
    ];

    /// The name a config uses.
    pub fn name(self) -> &'static str {
        match self {
            Sharding::None => "none",
            Sharding::Optimizer => "optimizer",
            Sharding::Gradients => "gradients",
            Sharding::Full => "full",
        }
    }

    /// Whether a rank keeps the AdamW moments of its own parameters only.
    pub fn shards_optimizer(self) -> bool {
        self != Sharding::None
    }

    /// Whether a rank keeps summed gradients of its own parameters only.
    pub fn shards_gradients(self) -> bool {
        matches!(self, Sharding::Gradients | Sharding::Full)
    }

    /// Whether a rank keeps its own parameters only between uses.
    pub fn shards_parameters(self) -> bool {
        self == Sharding::Full
    }
}
