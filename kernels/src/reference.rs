//! The textbook formulas, written with ordinary tensor ops so burn's autodiff differentiates them:
//! the independent check of the fused ops in tests, and the naive baseline in benchmarks.

use burn::tensor::activation::log_softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};

use crate::{Clip, Reduce};

/// `log_softmax(h · Wᵀ).gather(targets)`: materialises the whole `[tokens, vocab]` matrix (twice).
pub fn naive_token_logprobs<B: Backend>(
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
) -> Tensor<B, 1> {
    let [n, _] = hidden.dims();
    let logits = hidden.matmul(weight.transpose());
    log_softmax(logits, 1)
        .gather(1, targets.reshape([n, 1]))
        .reshape([n])
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
    let per = (ratio.clone() * a.clone())
        .min_pair(ratio.clamp(1.0 - clip.low, 1.0 + clip.high) * a)
        .neg();
    let sum = (per * mask.clone()).sum_dim(1);
    let out = match reduce {
        Reduce::SumPerResponse => sum,
        Reduce::MeanPerResponse => sum / mask.sum_dim(1).clamp_min(1.0),
    };
    out.reshape([n])
}

/// `n` uniform values in `[-scale, scale)` from a seeded xorshift: reproducible inputs for checks
/// and benchmarks without a random-number crate.
pub fn seeded_uniform(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e3779b97f4a7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * scale
        })
        .collect()
}

/// `max |got - want| / max |want|`, infinite when `got` holds a non-finite value.
pub fn relative_error(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "relative_error: lengths differ");
    if got.iter().any(|x| !x.is_finite()) {
        return f64::INFINITY;
    }
    let scale = want
        .iter()
        .fold(0f64, |m, x| m.max(x.abs() as f64))
        .max(1e-30);
    got.iter()
        .zip(want)
        .fold(0f64, |m, (a, b)| m.max((*a as f64 - *b as f64).abs()))
        / scale
}

/// Causal attention as the textbook writes it: K and V repeated to every query head, the full
/// `[batch, heads, t, s]` score matrix, an additive -1e30 mask (causal and key padding), softmax
/// in f32, times V. Rows that see no key come out as the uniform average of V here (the fused op
/// defines them as 0): compare visible rows only.
///
/// # Shapes
/// As [`crate::causal_attention`].
pub fn naive_causal_attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    key_valid: Tensor<B, 2>,
    layout: crate::AttentionLayout,
) -> Tensor<B, 4> {
    use burn::tensor::DType;
    let [b, nh, t, d] = q.dims();
    let [_, nkv, s, _] = k.dims();
    let group = nh / nkv;
    let dtype = q.dtype();
    let repeat = |x: Tensor<B, 4>| {
        x.reshape([b, nkv, 1, s, d])
            .repeat_dim(2, group)
            .reshape([b, nh, s, d])
    };
    let (k, v) = (repeat(k), repeat(v));
    let device = q.device();
    let qpos = Tensor::<B, 1, Int>::arange(layout.past as i64..(layout.past + t) as i64, &device)
        .reshape([t, 1]);
    let kpos = Tensor::<B, 1, Int>::arange(0..s as i64, &device).reshape([1, s]);
    let causal = kpos
        .lower_equal(qpos)
        .float()
        .cast(DType::F32)
        .reshape([1, 1, t, s]);
    let visible = causal * key_valid.cast(DType::F32).reshape([b, 1, 1, s]);
    let scores = q
        .matmul(k.swap_dims(2, 3))
        .cast(DType::F32)
        .mul_scalar(layout.scale)
        + (visible - 1.0).mul_scalar(1.0e30);
    burn::tensor::activation::softmax(scores, 3)
        .cast(dtype)
        .matmul(v)
}
