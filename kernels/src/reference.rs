//! The textbook formulas, written with ordinary tensor ops so burn's autodiff differentiates them:
//! the independent check of the fused ops in tests, and the naive baseline in benchmarks.

use burn::tensor::activation::log_softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};

use crate::{Clip, Reduce};

/// `log_softmax(h · Wᵀ).gather(targets)`: materialises the whole `[tokens, vocab]` matrix (twice).
pub fn naive_token_logprobs<B: Backend>(hidden: Tensor<B, 2>, weight: Tensor<B, 2>, targets: Tensor<B, 1, Int>) -> Tensor<B, 1> {
    let [n, _] = hidden.dims();
    let logits = hidden.matmul(weight.transpose());
    log_softmax(logits, 1).gather(1, targets.reshape([n, 1])).reshape([n])
}

/// Entropy `-sum p log p` of each row's softmax.
pub fn naive_entropy<B: Backend>(hidden: Tensor<B, 2>, weight: Tensor<B, 2>) -> Tensor<B, 1> {
    let [n, _] = hidden.dims();
    let lp = log_softmax(hidden.matmul(weight.transpose()), 1);
    (lp.clone().exp() * lp).sum_dim(1).neg().reshape([n])
}

/// `-min(rho * A, clip(rho) * A)` per token, masked, reduced per response.
pub fn naive_clipped_surrogate<B: Backend>(
    logp: Tensor<B, 2>,
    logp_old: Tensor<B, 2>,
    advantages: Tensor<B, 1>,
    mask: Tensor<B, 2>,
    clip: Clip,
    reduce: Reduce,
) -> Tensor<B, 1> {
    let [n, _] = logp.dims();
    let a = advantages.reshape([n, 1]);
    let ratio = (logp - logp_old).exp();
    let per = (ratio.clone() * a.clone()).min_pair(ratio.clamp(1.0 - clip.low, 1.0 + clip.high) * a).neg();
    let sum = (per * mask.clone()).sum_dim(1);
    let out = match reduce {
        Reduce::TokenSum => sum,
        Reduce::TokenMean => sum / mask.sum_dim(1).clamp_min(1.0),
    };
    out.reshape([n])
}
