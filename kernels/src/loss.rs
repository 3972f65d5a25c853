//! The log-prob and loss family: [`LossOps`] and its portable implementation from primitive
//! tensor ops (every method's default: what the CPU backends and libtorch run, and what the
//! kernels are checked against).

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, IndexingUpdateOp, Tensor};

use conrub_settings::Clip;

use crate::prim::{float, int};

/// How per-token losses are reduced within each response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduce {
    /// Per response: the sum over its masked tokens divided by their count (at least 1).
    MeanPerResponse,
    /// Per response: the sum over its masked tokens.
    SumPerResponse,
}

/// Log-probabilities of the targets and the clipped loss: the learner's hot spots. Every method
/// has a portable default made of primitive tensor ops (this module's functions); CubeCL backends replace the
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
        chunk_logits::<Self>(hidden, weight)
    }

    /// Per row of `logits` `[rows, vocab]`: `[log p(target), entropy, log-sum-exp]`, each `[rows]`.
    fn logits_row_stats(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> [FloatTensor<Self>; 3] {
        logits_row_stats::<Self>(logits, targets)
    }

    /// `d/dlogits sum_r grad[r] * log p(target_r)`: `grad[r] * (onehot(target_r) - softmax(logits_r))`.
    fn logits_grad(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        logits_grad::<Self>(logits, targets, lse, grad)
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
        surrogate_forward::<Self>(logp, logp_old, advantages, mask, clip, reduce)
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
        surrogate_backward::<Self>(logp, logp_old, advantages, mask, clip, scale)
    }

    /// Chunked forward: `[log p(target), entropy, log-sum-exp]`, each `[tokens]`.
    fn token_logprobs(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        targets: IntTensor<Self>,
        chunk_tokens: usize,
    ) -> [FloatTensor<Self>; 3] {
        token_logprobs::<Self>(hidden, weight, targets, chunk_tokens)
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
        token_logprobs_backward::<Self>(hidden, weight, targets, lse, grad, chunk_tokens, want)
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
    /// ([`token_logprobs_entropy_backward`]) with this backend's logits and log-prob
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
        token_logprobs_entropy_backward::<Self>(
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

fn prim<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

/// `(W · hᵀ)ᵀ`: the `[vocab, hidden]` head is used in its stored layout (a matmul that needs
/// contiguous operands would otherwise copy the whole head per chunk) and only the small chunk is
/// transposed; the result is a `[rows, vocab]` view.
pub fn chunk_logits<B: LossOps>(hidden: FloatTensor<B>, weight: FloatTensor<B>) -> FloatTensor<B> {
    let ht = B::contiguous(prim(float::<B, 2>(hidden).transpose()));
    let w: Tensor<B, 2> = float(weight);
    prim(w.matmul(float(ht)).transpose())
}

/// Row max, log-sum-exp, target gather and entropy `lse - sum(p x)`.
pub fn logits_row_stats<B: Backend>(
    logits: FloatTensor<B>,
    targets: IntTensor<B>,
) -> [FloatTensor<B>; 3] {
    let x: Tensor<B, 2> = float(logits);
    let [rows, _] = x.dims();
    let t = int::<B, 1>(targets).reshape([rows, 1]);
    let m = x.clone().max_dim(1);
    let e = (x.clone() - m.clone()).exp();
    let s = e.clone().sum_dim(1);
    let lse = m + s.clone().log();
    let px = (e * x.clone()).sum_dim(1) / s;
    let logp = x.gather(1, t) - lse.clone();
    let entropy = lse.clone() - px;
    [
        prim(logp.reshape([rows])),
        prim(entropy.reshape([rows])),
        prim(lse.reshape([rows])),
    ]
}

/// `grad[r] * (onehot(target_r) - exp(logits_r - lse_r))`.
pub fn logits_grad<B: Backend>(
    logits: FloatTensor<B>,
    targets: IntTensor<B>,
    lse: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> FloatTensor<B> {
    let x: Tensor<B, 2> = float(logits);
    let [rows, _] = x.dims();
    let lse: Tensor<B, 2> = float::<B, 1>(lse).reshape([rows, 1]);
    let g: Tensor<B, 2> = float::<B, 1>(grad).reshape([rows, 1]);
    let t = int::<B, 1>(targets).reshape([rows, 1]);
    let minus_p = (x - lse).exp() * g.clone().neg();
    prim(minus_p.scatter(1, t, g, IndexingUpdateOp::Add))
}

/// The per-token loss, its masked reduction per response and the clip counts.
pub fn surrogate_forward<B: Backend>(
    logp: FloatTensor<B>,
    logp_old: FloatTensor<B>,
    advantages: FloatTensor<B>,
    mask: FloatTensor<B>,
    clip: Clip,
    reduce: Reduce,
) -> [FloatTensor<B>; 3] {
    let lp: Tensor<B, 2> = float(logp);
    let [n, _] = lp.dims();
    let mask: Tensor<B, 2> = float(mask);
    let a = float::<B, 1>(advantages).reshape([n, 1]);
    let ratio = (lp - float::<B, 2>(logp_old)).exp();
    let un = ratio.clone() * a.clone();
    let cl = ratio.clone().clamp(1.0 - clip.low, 1.0 + clip.high) * a.clone();
    let per = un.min_pair(cl).neg() * mask.clone();
    let mut loss = per.sum_dim(1);
    if reduce == Reduce::MeanPerResponse {
        loss = loss / mask.clone().sum_dim(1).clamp_min(1.0);
    }
    let low = ratio.clone().lower_elem(1.0 - clip.low).float()
        * a.clone().lower_elem(0.0).float()
        * mask.clone();
    let high = ratio.greater_elem(1.0 + clip.high).float() * a.greater_elem(0.0).float() * mask;
    [
        prim(loss.reshape([n])),
        prim(low.sum_dim(1).reshape([n])),
        prim(high.sum_dim(1).reshape([n])),
    ]
}

/// `d loss / d logp = -A * rho` where the unclipped term is the minimum, else 0; times
/// `mask * scale[b]`.
pub fn surrogate_backward<B: Backend>(
    logp: FloatTensor<B>,
    logp_old: FloatTensor<B>,
    advantages: FloatTensor<B>,
    mask: FloatTensor<B>,
    clip: Clip,
    scale: FloatTensor<B>,
) -> FloatTensor<B> {
    let lp: Tensor<B, 2> = float(logp);
    let [n, _] = lp.dims();
    let a = float::<B, 1>(advantages).reshape([n, 1]);
    let ratio = (lp - float::<B, 2>(logp_old)).exp();
    let un = ratio.clone() * a.clone();
    let cl = ratio.clamp(1.0 - clip.low, 1.0 + clip.high) * a;
    let active = un.clone().lower_equal(cl).float();
    let s = float::<B, 1>(scale).reshape([n, 1]);
    prim(un.neg() * active * float::<B, 2>(mask) * s)
}

/// Logits in f32: under mixed precision the head's product is bf16, its statistics are not.
fn to_f32<B: Backend>(logits: FloatTensor<B>) -> FloatTensor<B> {
    let t: Tensor<B, 2> = float(logits);
    if t.dtype() == DType::F32 {
        prim(t)
    } else {
        prim(t.cast(DType::F32))
    }
}

fn chunks(n: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..n)
        .step_by(chunk.max(1))
        .map(move |s| (s, (s + chunk.max(1)).min(n)))
}

/// The chunked forward through the backend's own row hooks.
pub fn token_logprobs<B: LossOps>(
    hidden: FloatTensor<B>,
    weight: FloatTensor<B>,
    targets: IntTensor<B>,
    chunk_tokens: usize,
) -> [FloatTensor<B>; 3] {
    let h: Tensor<B, 2> = float(hidden);
    let t = int::<B, 1>(targets);
    let [n, _] = h.dims();
    let mut outs: [Vec<Tensor<B, 1>>; 3] = Default::default();
    for (s, e) in chunks(n, chunk_tokens) {
        let logits = to_f32::<B>(B::chunk_logits(prim(h.clone().slice(s..e)), weight.clone()));
        let stats = B::logits_row_stats(logits, t.clone().slice(s..e).into_primitive());
        for (o, x) in outs.iter_mut().zip(stats) {
            o.push(float(x));
        }
    }
    outs.map(|v| prim(Tensor::cat(v, 0)))
}

/// `-grad_entropy[r] * p_rj * (log p_rj + H_r)`, the gradient of `sum_r grad_entropy[r] * H_r`
/// with respect to the logits (`log p = logits - lse`; each row sums to 0).
pub fn entropy_logits_grad<B: Backend>(
    logits: FloatTensor<B>,
    lse: FloatTensor<B>,
    entropy: FloatTensor<B>,
    grad_entropy: FloatTensor<B>,
) -> FloatTensor<B> {
    let x: Tensor<B, 2> = float(logits);
    let [rows, _] = x.dims();
    let col = |t: FloatTensor<B>| float::<B, 1>(t).reshape([rows, 1]);
    let logp = x - col(lse);
    let p = logp.clone().exp();
    let ge = col(grad_entropy);
    prim(p * (logp + col(entropy)) * ge.neg())
}

/// The chunked backward of the log-probabilities and their entropies: per chunk, the logits are
/// recomputed and turned into the log-prob gradient (the backend's hook) plus the entropy's
/// ([`entropy_logits_grad`]), then multiplied back into the hidden-state and head gradients.
#[allow(clippy::too_many_arguments)]
pub fn token_logprobs_entropy_backward<B: LossOps>(
    hidden: FloatTensor<B>,
    weight: FloatTensor<B>,
    targets: IntTensor<B>,
    lse: FloatTensor<B>,
    entropy: FloatTensor<B>,
    grads: (FloatTensor<B>, FloatTensor<B>),
    chunk_tokens: usize,
    want: (bool, bool),
) -> (Option<FloatTensor<B>>, Option<FloatTensor<B>>) {
    let ent: Tensor<B, 1> = float(entropy);
    let ge: Tensor<B, 1> = float(grads.1);
    chunked_backward::<B>(
        hidden,
        weight,
        targets,
        lse,
        grads.0,
        chunk_tokens,
        want,
        Some(&|(s, e), logits, lse| {
            entropy_logits_grad::<B>(
                logits,
                lse,
                prim(ent.clone().slice(s..e)),
                prim(ge.clone().slice(s..e).cast(DType::F32)),
            )
        }),
    )
}

/// The chunked backward: per chunk, logits are recomputed, turned into their gradient, and
/// multiplied back into the hidden-state and head gradients.
pub fn token_logprobs_backward<B: LossOps>(
    hidden: FloatTensor<B>,
    weight: FloatTensor<B>,
    targets: IntTensor<B>,
    lse: FloatTensor<B>,
    grad: FloatTensor<B>,
    chunk_tokens: usize,
    want: (bool, bool),
) -> (Option<FloatTensor<B>>, Option<FloatTensor<B>>) {
    chunked_backward::<B>(hidden, weight, targets, lse, grad, chunk_tokens, want, None)
}

/// A term added to a chunk's logit gradient: from the chunk's token range, its f32 logits and
/// their log-sum-exp.
type ExtraGrad<'a, B> =
    &'a dyn Fn((usize, usize), FloatTensor<B>, FloatTensor<B>) -> FloatTensor<B>;

/// The chunked driver of both backwards; `extra` (the entropy's gradient) adds a term to each
/// chunk's logit gradient.
#[allow(clippy::too_many_arguments)]
fn chunked_backward<B: LossOps>(
    hidden: FloatTensor<B>,
    weight: FloatTensor<B>,
    targets: IntTensor<B>,
    lse: FloatTensor<B>,
    grad: FloatTensor<B>,
    chunk_tokens: usize,
    want: (bool, bool),
    extra: Option<ExtraGrad<'_, B>>,
) -> (Option<FloatTensor<B>>, Option<FloatTensor<B>>) {
    let h: Tensor<B, 2> = float(hidden);
    let w: Tensor<B, 2> = float(weight.clone());
    let t = int::<B, 1>(targets);
    let lse: Tensor<B, 1> = float(lse);
    let g: Tensor<B, 1> = float(grad);
    let [n, _] = h.dims();
    let mut gh = Vec::new();
    let mut gw: Option<Tensor<B, 2>> = None;
    for (s, e) in chunks(n, chunk_tokens) {
        let hc = h.clone().slice(s..e);
        let logits = to_f32::<B>(B::chunk_logits(prim(hc.clone()), weight.clone()));
        let lse_chunk = prim(lse.clone().slice(s..e));
        // The logits stay the hook's own (a kernel may write its gradient over them) unless the
        // extra term reads them too.
        let kept = extra.map(|_| logits.clone());
        let mut gl: Tensor<B, 2> = float(B::logits_grad(
            logits,
            t.clone().slice(s..e).into_primitive(),
            lse_chunk.clone(),
            prim(g.clone().slice(s..e).cast(DType::F32)),
        ));
        if let (Some(extra), Some(logits)) = (extra, kept) {
            gl = gl + float::<B, 2>(extra((s, e), logits, lse_chunk));
        }
        // Back to the compute dtype for the two products (a no-op in f32).
        let gl = if gl.dtype() == hc.dtype() {
            gl
        } else {
            gl.cast(hc.dtype())
        };
        if want.0 {
            gh.push(gl.clone().matmul(w.clone()));
        }
        if want.1 {
            let glt: Tensor<B, 2> = float(B::contiguous(prim(gl.transpose())));
            let part = glt.matmul(hc);
            gw = Some(match gw {
                Some(acc) => acc + part,
                None => part,
            });
        }
    }
    let gh = want.0.then(|| prim(Tensor::cat(gh, 0)));
    let gw = if want.1 {
        Some(prim(gw.unwrap_or_else(|| w.zeros_like())))
    } else {
        None
    };
    (gh, gw)
}
