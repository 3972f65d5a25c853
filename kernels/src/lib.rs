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
//! log-probs) and libtorch through a fallback made of primitive tensor ops (each family's file:
//! [`loss`], `attention.rs`, [`kv`], [`sampling`]), and for
//! `Autodiff<B>` with hand-written backwards. [`reference`] holds the textbook formulas used as
//! the independent check in tests and as the naive baseline in benchmarks. kernels/README.md says
//! which files to touch to add an op. With feature `cuda`, [`NcclOps`] sums tensors across the
//! CUDA devices of one process (the data-parallel gradient all-reduce).

pub mod attention;
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
mod cube_prologue;
#[cfg(feature = "cube")]
mod cube_sampling;
pub mod events;
#[cfg(feature = "cube")]
mod fusion;
pub mod gradients;
#[cfg(feature = "cube")]
pub mod kernel_cache;
pub mod loss;
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
mod prim;
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

use prim::float;

pub use attention::{
    causal_attention, paged_decode_attention, resolve_attention_kernels, AttentionKernelChoice,
    AttentionKernels, AttentionLayout, AttentionOps, PagedLayout, ATTENTION_MASKED_LSE,
    TENSOR_CORE_KERNELS_VALIDATED,
};
pub use conrub_settings::Clip;
pub use loss::{LossOps, Reduce};

/// Tokens per chunk of [`token_logprobs`] unless told otherwise: 512 x 151,936 f32 logits are
/// 311 MB, against 2.5 GB for the whole matrix of 4,096 tokens.
pub const DEFAULT_CHUNK_TOKENS: usize = 512;

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

/// `(bytes in use, bytes reserved)` by the CubeCL runtime's memory pools on `device`; the reserved
/// figure is the pools' high-water mark, which benchmarks read as peak device memory.
#[cfg(feature = "cube")]
pub fn cube_memory_usage<R: cubecl::Runtime>(device: &R::Device) -> Option<(u64, u64)> {
    let usage = R::client(device).memory_usage().ok()?;
    Some((usage.bytes_in_use, usage.bytes_reserved))
}
