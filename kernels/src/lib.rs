//! conrub's burn backend extension: the learner's, the rollout engine's and the model's hot spots
//! on a 151,936-token vocabulary, generic over the backend, in three op families:
//!
//! - [`LossOps`] (log-probs and loss): [`token_logprobs`], per-token `log p(target)` (and
//!   entropy) from hidden states and the LM head, a chunk of tokens at a time, so the
//!   `[tokens, vocab]` logit matrix is never held whole (the backward recomputes each chunk's
//!   logits); [`clipped_surrogate`], the per-token clipped-ratio loss with asymmetric clipping and
//!   a mask, reduced per response, plus low/high clip counts.
//! - [`AttentionOps`]: [`causal_attention`], fused causal attention (online softmax in f32,
//!   key-padding mask, GQA without repeated K/V) that keeps only the output and the per-row
//!   log-sum-exp, with a backward that recomputes the probabilities block by block
//!   (FlashAttention-2's scheme); [`paged_decode_attention`] over the rollout engine's KV pool.
//! - [`DecodeOps`]: [`kv_write`] into the paged KV pool and on-device sampling ([`sampling`]).
//!
//! [`KernelOps`] is all three. Each family is implemented for burn's CubeCL backends with kernels
//! (one source for CUDA and wgpu; feature `cube`), for burn's fusion wrapper (the kernels run as
//! custom fusion operations), for the CPU backends (the fused host head, [`cpu_head`], for
//! log-probs) and libtorch through a fallback made of primitive tensor ops ([`fallback`]), and for
//! `Autodiff<B>` with hand-written backwards. [`reference`] holds the textbook formulas used as
//! the independent check in tests and as the naive baseline in benchmarks. kernels/README.md says
//! which files to touch to add an op. With feature `cuda`, [`NcclOps`] sums tensors across the
//! CUDA devices of one process (the data-parallel gradient all-reduce).

mod attention;
mod autodiff;
mod backends;
#[cfg(any(feature = "flex", feature = "ndarray"))]
pub mod cpu_head;
#[cfg(any(feature = "flex", feature = "ndarray"))]
mod host_head;
#[cfg(any(feature = "flex", feature = "ndarray"))]
pub use host_head::{host_head_enabled, set_host_head, HOST_HEAD_ENV};
#[cfg(feature = "cube")]
mod cube;
#[cfg(feature = "cube")]
mod cube_attention;
#[cfg(feature = "cube")]
pub mod cube_flash;
#[cfg(feature = "cube")]
mod cube_paged;
#[cfg(feature = "cube")]
mod cube_sampling;
pub mod events;
pub mod fallback;
#[cfg(feature = "cube")]
mod fusion;
pub mod gradients;
#[cfg(feature = "cube")]
pub mod kernel_cache;
#[cfg(feature = "cuda")]
mod nccl;
#[cfg(feature = "cuda-compile")]
pub mod offline;
#[cfg(feature = "cuda")]
pub use nccl::NcclOps;
#[cfg(feature = "checks")]
pub mod attention_bench;
mod error;
pub use error::KernelError;
pub mod kv;
pub mod paged_attention;
pub mod reference;
pub mod sampling;
#[cfg(feature = "checks")]
pub mod sampling_bench;
#[cfg(feature = "checks")]
pub mod sampling_check;
#[cfg(feature = "wgpu")]
mod wgpu_probe;
#[cfg(feature = "wgpu")]
pub use wgpu_probe::{skip_or_fail, wgpu_adapter_count, wgpu_adapter_or_skip, REQUIRE_WGPU_ENV};

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Int, Tensor, TensorPrimitive};

pub use attention::{
    causal_attention, resolve_attention_kernels, AttentionKernelChoice, AttentionKernels,
    AttentionLayout, ATTENTION_MASKED_LSE, TENSOR_CORE_KERNELS_VALIDATED,
};
pub use conrub_settings::Clip;
pub use paged_attention::{paged_decode_attention, PagedLayout};

/// How per-token losses are reduced within each response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduce {
    /// Per response: the sum over its masked tokens divided by their count (at least 1).
    MeanPerResponse,
    /// Per response: the sum over its masked tokens.
    SumPerResponse,
}

/// Tokens per chunk of [`token_logprobs`] unless told otherwise: 512 x 151,936 f32 logits are
/// 311 MB, against 2.5 GB for the whole matrix of 4,096 tokens.
pub const DEFAULT_CHUNK_TOKENS: usize = 512;

/// Log-probabilities of the targets and the clipped loss: the learner's hot spots. Every method
/// has a portable default made of primitive tensor ops ([`fallback`]); CubeCL backends replace the
/// per-row work with kernels (`cube.rs`, forwarded through `fusion.rs`), the CPU backends run the
/// fused host head (`host_head.rs`, [`cpu_head`]), and `Autodiff<B>` makes
/// [`LossOps::token_logprobs`] and [`LossOps::clipped_surrogate`] differentiable (`autodiff.rs`).
pub trait LossOps: Backend {
    /// A contiguous copy of a (transposed) view when the backend's matmul needs one: burn 0.21's
    /// CubeCL matmul gives wrong results for some transposed-view operands (seen on wgpu with a
    /// 16-row chunk against a 70,000-row head), so the CubeCL backends copy; the CPU backends
    /// read views correctly and return the tensor as it is.
    fn contiguous(tensor: FloatTensor<Self>) -> FloatTensor<Self> {
        tensor
    }

    /// Logits `[rows, vocab]` of hidden states `[rows, hidden]` against the head `[vocab, hidden]`.
    fn chunk_logits(hidden: FloatTensor<Self>, weight: FloatTensor<Self>) -> FloatTensor<Self> {
        fallback::chunk_logits::<Self>(hidden, weight)
    }

    /// Per row of `logits` `[rows, vocab]`: `[log p(target), entropy, log-sum-exp]`, each `[rows]`.
    fn logits_row_stats(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> [FloatTensor<Self>; 3] {
        fallback::logits_row_stats::<Self>(logits, targets)
    }

    /// `d/dlogits sum_r grad[r] * log p(target_r)`: `grad[r] * (onehot(target_r) - softmax(logits_r))`.
    fn logits_grad(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        fallback::logits_grad::<Self>(logits, targets, lse, grad)
    }

    /// Forward of the clipped surrogate on `[responses, tokens]` inputs: `[loss, clip_low, clip_high]`,
    /// each `[responses]` (the loss reduced per `reduce`; the clip counts are masked token counts).
    fn surrogate_forward(
        logp: FloatTensor<Self>,
        logp_old: FloatTensor<Self>,
        advantages: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        clip: Clip,
        reduce: Reduce,
    ) -> [FloatTensor<Self>; 3] {
        fallback::surrogate_forward::<Self>(logp, logp_old, advantages, mask, clip, reduce)
    }

    /// Gradient of `sum_b scale[b] * sum_t mask[b,t] * loss[b,t]` with respect to `logp`.
    fn surrogate_backward(
        logp: FloatTensor<Self>,
        logp_old: FloatTensor<Self>,
        advantages: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        clip: Clip,
        scale: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        fallback::surrogate_backward::<Self>(logp, logp_old, advantages, mask, clip, scale)
    }

    /// Chunked forward: `[log p(target), entropy, log-sum-exp]`, each `[tokens]`.
    fn token_logprobs(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        targets: IntTensor<Self>,
        chunk_tokens: usize,
    ) -> [FloatTensor<Self>; 3] {
        fallback::token_logprobs::<Self>(hidden, weight, targets, chunk_tokens)
    }

    /// Chunked backward of `sum_t grad[t] * log p(target_t)`: `(d hidden, d weight)`, each computed
    /// only when asked for.
    #[allow(clippy::too_many_arguments)]
    fn token_logprobs_backward(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        chunk_tokens: usize,
        want: (bool, bool),
    ) -> (Option<FloatTensor<Self>>, Option<FloatTensor<Self>>) {
        fallback::token_logprobs_backward::<Self>(
            hidden,
            weight,
            targets,
            lse,
            grad,
            chunk_tokens,
            want,
        )
    }

    /// [`Self::token_logprobs`] whose entropy is differentiable too under autodiff (an entropy
    /// bonus in the loss); elsewhere the same.
    fn token_logprobs_with_entropy(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        targets: IntTensor<Self>,
        chunk_tokens: usize,
    ) -> [FloatTensor<Self>; 3] {
        Self::token_logprobs(hidden, weight, targets, chunk_tokens)
    }

    /// Chunked backward of `sum_t grad[t] * log p(target_t) + grad_entropy[t] * H_t` (`entropy`
    /// the forward's `H` per token): `(d hidden, d weight)`. The portable driver
    /// ([`fallback::token_logprobs_entropy_backward`]) with this backend's logits and log-prob
    /// gradient hooks, the entropy's part as tensor ops.
    #[allow(clippy::too_many_arguments)]
    fn token_logprobs_entropy_backward(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        entropy: FloatTensor<Self>,
        grads: (FloatTensor<Self>, FloatTensor<Self>),
        chunk_tokens: usize,
        want: (bool, bool),
    ) -> (Option<FloatTensor<Self>>, Option<FloatTensor<Self>>) {
        fallback::token_logprobs_entropy_backward::<Self>(
            hidden,
            weight,
            targets,
            lse,
            entropy,
            grads,
            chunk_tokens,
            want,
        )
    }

    /// The clipped surrogate; under autodiff the loss is differentiable with respect to `logp`.
    fn clipped_surrogate(
        logp: FloatTensor<Self>,
        logp_old: FloatTensor<Self>,
        advantages: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        clip: Clip,
        reduce: Reduce,
    ) -> [FloatTensor<Self>; 3] {
        Self::surrogate_forward(logp, logp_old, advantages, mask, clip, reduce)
    }
}

/// Causal attention (training and prefill) and paged decode attention (the rollout engine).
/// Defaults in `attention.rs` and `paged_attention.rs`; kernels in `cube_attention.rs` and
/// `cube_paged.rs`; the backward of [`AttentionOps::causal_attention`] in `autodiff.rs`.
pub trait AttentionOps: Backend {
    /// Forward of causal attention: `[out, lse]`. `q` is `[batch, heads, t, head_dim]`, `k` and `v`
    /// are `[batch, kv_heads, s, head_dim]` (`heads` a multiple of `kv_heads`; query head `h` reads
    /// key/value head `h / (heads / kv_heads)`), `key_valid` is `[batch, s]` f32 (1 = the key may
    /// be attended, 0 = padding). Query row `i` sits at key position `layout.past + i` and sees the
    /// valid keys `0..=past + i`. `out` has `q`'s shape and dtype; `lse` is `[batch, heads, t]` f32,
    /// the natural log of the row's softmax denominator over the scaled scores. A row with no
    /// visible key has `out = 0`, `lse = ATTENTION_MASKED_LSE` and gets and gives no gradient.
    /// Inputs may be strided views. Scores, softmax and accumulation are f32 whatever the dtype.
    fn attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_valid: FloatTensor<Self>,
        layout: AttentionLayout,
    ) -> [FloatTensor<Self>; 2] {
        attention::fallback_forward::<Self>(q, k, v, key_valid, layout)
    }

    /// Backward of [`Self::attention_forward`]: `[dq, dk, dv]` (shapes and dtypes of `q`, `k`,
    /// `v`) from the forward's inputs, its `out` and `lse`, and `d_out` (the shape of `out`).
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_valid: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_out: FloatTensor<Self>,
        layout: AttentionLayout,
    ) -> [FloatTensor<Self>; 3] {
        attention::fallback_backward::<Self>(q, k, v, key_valid, out, lse, d_out, layout)
    }

    /// Decode attention of one query per row against its keys in a paged KV pool (see
    /// [`paged_decode_attention`] for shapes): `[rows, heads, 1, head_dim]` in `q`'s dtype. The
    /// default gathers each row's keys and runs [`Self::attention_forward`]; CubeCL backends
    /// read the block table in place. Not differentiable.
    fn paged_decode_attention(
        q: FloatTensor<Self>,
        k_pool: FloatTensor<Self>,
        v_pool: FloatTensor<Self>,
        tables: IntTensor<Self>,
        lens: IntTensor<Self>,
        layout: PagedLayout,
    ) -> FloatTensor<Self> {
        paged_attention::fallback_paged_decode::<Self>(q, k_pool, v_pool, tables, lens, layout)
    }

    /// Whether this backend on `device` runs `kernels`: `Err` names what is missing. The default
    /// (CPU backends) has only [`AttentionKernels::Portable`]; CubeCL backends have the tiled
    /// kernels everywhere and the tensor-core ones where the device has cooperative matrices.
    fn check_attention_kernels(
        device: &Self::Device,
        kernels: AttentionKernels,
    ) -> Result<(), KernelError> {
        let _ = device;
        match kernels {
            AttentionKernels::Portable => Ok(()),
            other => Err(KernelError::NoAttentionKernels {
                kernels: other.name(),
                reason: format!(
                    "the {} backend has no `{}` attention kernels (they are CubeCL kernels: cuda or wgpu)",
                    Self::name(device),
                    other.name()
                ),
            }),
        }
    }

    /// Causal attention's output; under autodiff it is differentiable with respect to `q`, `k`, `v`
    /// (only `out` and `lse` are kept for the backward).
    fn causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_valid: FloatTensor<Self>,
        layout: AttentionLayout,
    ) -> FloatTensor<Self> {
        let [out, _lse] = Self::attention_forward(q, k, v, key_valid, layout);
        out
    }
}

/// The rollout engine's per-step device work besides attention: KV-cache writes and sampling.
/// Defaults in `kv.rs` and `sampling.rs`; the CPU backends write in place (`backends.rs`).
pub trait DecodeOps: Backend {
    /// Writes `values` `[n, width]` into rows `slots` of a paged KV cache pool `[slots, width]`
    /// (in place where the backend can; see [`kv`]). Slots are distinct.
    fn kv_write(
        pool: FloatTensor<Self>,
        slots: &[u32],
        values: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        kv::write_by_scatter::<Self>(pool, slots, values)
    }

    /// One token per row of `logits` `[rows, vocab]` and its log-probability under `params`
    /// (`uniforms[r]` is row `r`'s draw; see [`sampling`]), computed where the logits are: only
    /// `rows` ids and `rows` f32 leave the device.
    fn sample_rows(
        logits: FloatTensor<Self>,
        params: &sampling::Decoding,
        uniforms: &[f64],
    ) -> (IntTensor<Self>, FloatTensor<Self>) {
        sampling::sample_rows_by_tensor_ops::<Self>(logits, params, uniforms)
    }

    /// [`Self::sample_rows`] with the draws already on the device (`uniforms` `[rows]` f32): how
    /// the fusion wrapper hands a sampling step to its inner backend. The default reads the
    /// draws back and calls [`Self::sample_rows`]; the CubeCL backends launch their kernel.
    fn sample_rows_on(
        logits: FloatTensor<Self>,
        uniforms: FloatTensor<Self>,
        params: &sampling::Decoding,
    ) -> (IntTensor<Self>, FloatTensor<Self>) {
        let u = sampling::host_uniforms::<Self>(uniforms);
        Self::sample_rows(logits, params, &u)
    }

    /// Bytes the backend's memory pools hold on `device` (their high-water mark: pools keep
    /// what they once needed), where the backend reports it: the CubeCL backends (CUDA, wgpu);
    /// `None` for the CPU backends and libtorch.
    fn device_memory_reserved(_device: &Self::Device) -> Option<u64> {
        None
    }

    /// Whether the backend compiles its kernels at run time (the CubeCL backends: CUDA, wgpu),
    /// so that a kernel warm-up has something to do; false for the CPU backends and libtorch.
    fn compiles_kernels() -> bool {
        false
    }
}

/// Every family of conrub's backend extension: what the model, the rollout engine and the learner
/// ask of a backend. Implemented for every backend that implements [`LossOps`], [`AttentionOps`]
/// and [`DecodeOps`] (burn's CubeCL backends, their fusion wrapper, flex, ndarray, libtorch, and
/// `Autodiff` over any of them); write `B: KernelOps` unless a function needs one family only.
pub trait KernelOps: LossOps + AttentionOps + DecodeOps {}

impl<B: LossOps + AttentionOps + DecodeOps> KernelOps for B {}

/// Per-token outputs of [`token_logprobs`].
#[derive(Debug, Clone)]
pub struct TokenLogprobs<B: Backend> {
    /// `log p(target)` per token `[tokens]` (differentiable under autodiff).
    pub logprobs: Tensor<B, 1>,
    /// Entropy of the next-token distribution per token `[tokens]` (telemetry, not
    /// differentiable; differentiable from [`token_logprobs_with_entropy`]).
    pub entropy: Tensor<B, 1>,
}

/// [`DecodeOps::kv_write`] on tensors: rows `slots` of `pool` `[slots, width]` become `values`
/// `[slots.len(), width]`.
pub fn kv_write<B: DecodeOps>(
    pool: Tensor<B, 2>,
    slots: &[u32],
    values: Tensor<B, 2>,
) -> Tensor<B, 2> {
    Tensor::from_primitive(TensorPrimitive::Float(B::kv_write(
        pool.into_primitive().tensor(),
        slots,
        values.into_primitive().tensor(),
    )))
}

/// `log p(targets[t] | hidden[t])` for hidden states `[tokens, hidden]` and an LM head
/// `[vocab, hidden]` (the Hugging Face layout), `chunk_tokens` tokens at a time.
///
/// Targets must lie in `0..vocab`.
pub fn token_logprobs<B: LossOps>(
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    chunk_tokens: usize,
) -> TokenLogprobs<B> {
    let [lp, ent, _lse] = B::token_logprobs(
        hidden.into_primitive().tensor(),
        weight.into_primitive().tensor(),
        targets.into_primitive(),
        chunk_tokens.max(1),
    );
    TokenLogprobs {
        logprobs: float(lp),
        entropy: float(ent),
    }
}

/// [`token_logprobs`] whose entropy is differentiable as well (`d H / d logits_j =
/// -p_j (log p_j + H)`): for an entropy bonus in the loss. Under autodiff its forward and backward
/// run the portable chunked driver (the backend's logits and log-prob gradient hooks, the
/// entropy's part as tensor ops), not the CPU backends' fused host head: its values there agree
/// with [`token_logprobs`]'s to f32 rounding, not bit for bit.
pub fn token_logprobs_with_entropy<B: LossOps>(
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    chunk_tokens: usize,
) -> TokenLogprobs<B> {
    let [lp, ent, _lse] = B::token_logprobs_with_entropy(
        hidden.into_primitive().tensor(),
        weight.into_primitive().tensor(),
        targets.into_primitive(),
        chunk_tokens.max(1),
    );
    TokenLogprobs {
        logprobs: float(lp),
        entropy: float(ent),
    }
}

/// Outputs of [`clipped_surrogate`].
#[derive(Debug, Clone)]
pub struct SurrogateLoss<B: Backend> {
    /// The reduced loss per response `[responses]` (differentiable with respect to `logp`).
    pub per_response: Tensor<B, 1>,
    /// Masked tokens with `ratio < 1 - low` and a negative advantage, per response.
    pub clip_low: Tensor<B, 1>,
    /// Masked tokens with `ratio > 1 + high` and a positive advantage, per response.
    pub clip_high: Tensor<B, 1>,
}

/// `-min(rho * A, clip(rho, 1 - low, 1 + high) * A)` per token with `rho = exp(logp - logp_old)`,
/// `[responses, tokens]` inputs, one advantage per response, `mask` 1 on response tokens.
pub fn clipped_surrogate<B: LossOps>(
    logp: Tensor<B, 2>,
    logp_old: Tensor<B, 2>,
    advantages: Tensor<B, 1>,
    mask: Tensor<B, 2>,
    clip: Clip,
    reduce: Reduce,
) -> SurrogateLoss<B> {
    let [loss, low, high] = B::clipped_surrogate(
        logp.into_primitive().tensor(),
        logp_old.into_primitive().tensor(),
        advantages.into_primitive().tensor(),
        mask.into_primitive().tensor(),
        clip,
        reduce,
    );
    SurrogateLoss {
        per_response: float(loss),
        clip_low: float(low),
        clip_high: float(high),
    }
}

pub(crate) fn float<B: Backend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

pub(crate) fn int<B: Backend, const D: usize>(t: IntTensor<B>) -> Tensor<B, D, Int> {
    Tensor::from_primitive(t)
}

/// `(bytes in use, bytes reserved)` by the CubeCL runtime's memory pools on `device`; the reserved
/// figure is the pools' high-water mark, which benchmarks read as peak device memory.
#[cfg(feature = "cube")]
pub fn cube_memory_usage<R: cubecl::Runtime>(device: &R::Device) -> Option<(u64, u64)> {
    let usage = R::client(device).memory_usage().ok()?;
    Some((usage.bytes_in_use, usage.bytes_reserved))
}
