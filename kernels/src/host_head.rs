//! [`crate::cpu_head`] behind the [`LossOps`](crate::LossOps) signatures of the CPU backends:
//! reads the inputs as host f32 (zero-copy where the backend allows), runs the fused head and
//! returns the results in the inputs' dtypes (statistics in f32, as the fallback gives them).

use std::sync::atomic::{AtomicU8, Ordering};

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Int, Tensor, TensorData, TensorMetadata};

use crate::cpu_head::{self, HeadShape};
use crate::loss::LossOps;

/// The environment variable that switches the CPU backends back to the chunked fallback
/// (`CONRUB_HOST_HEAD=fallback`): for benchmarks that time both in one run, and for diagnosis.
pub const HOST_HEAD_ENV: &str = "CONRUB_HOST_HEAD";

/// 0: not yet read from the environment, 1: on, 2: off.
static STATE: AtomicU8 = AtomicU8::new(0);

/// Whether the CPU backends use the fused host head: on unless [`HOST_HEAD_ENV`] says `fallback`
/// or [`set_host_head`] turned it off.
pub fn host_head_enabled() -> bool {
    match STATE.load(Ordering::Relaxed) {
        0 => {
            let on = std::env::var(HOST_HEAD_ENV).map_or(true, |v| v != "fallback");
            STATE.store(if on { 1 } else { 2 }, Ordering::Relaxed);
            on
        }
        s => s == 1,
    }
}

/// Turns the fused host head on or off for the whole process (benchmarks time both in one run).
pub fn set_host_head(on: bool) {
    STATE.store(if on { 1 } else { 2 }, Ordering::Relaxed);
}

/// A backend whose float tensors can be read as host f32 slices.
pub(crate) trait HostF32: Backend {
    /// Calls `f` with the row-major f32 elements of `tensor`.
    fn with_f32<R>(tensor: FloatTensor<Self>, f: impl FnOnce(&[f32]) -> R) -> R;
}

/// A row-major f32 copy of any backend's float tensor.
#[cfg(feature = "ndarray")]
pub(crate) fn to_host_f32<B: Backend>(tensor: FloatTensor<B>) -> Vec<f32> {
    let dims = tensor.shape().num_elements();
    let t = Tensor::<B, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(tensor))
        .reshape([dims]);
    t.into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("f32 after convert")
}

fn targets_u32<B: Backend>(targets: IntTensor<B>) -> Vec<u32> {
    Tensor::<B, 1, Int>::from_primitive(targets)
        .into_data()
        .iter::<i64>()
        .map(|t| u32::try_from(t).expect("target ids are non-negative"))
        .collect()
}

fn dims2(shape: &burn::tensor::Shape, what: &str) -> [usize; 2] {
    assert_eq!(shape.num_dims(), 2, "{what} must be 2-D, got {shape:?}");
    [shape[0], shape[1]]
}

fn to_backend<B: Backend>(
    values: Vec<f32>,
    shape: [usize; 2],
    dtype: DType,
    device: &B::Device,
) -> FloatTensor<B> {
    let t = Tensor::<B, 2>::from_data(TensorData::new(values, shape), device);
    let t = if t.dtype() == dtype { t } else { t.cast(dtype) };
    t.into_primitive().tensor()
}

/// What the CPU backends run for [`LossOps::token_logprobs`](crate::LossOps::token_logprobs): the
/// fused host head, or the chunked fallback when [`host_head_enabled`] says no.
pub(crate) fn token_logprobs<B: HostF32 + LossOps>(
    hidden: FloatTensor<B>,
    weight: FloatTensor<B>,
    targets: IntTensor<B>,
    chunk_tokens: usize,
) -> [FloatTensor<B>; 3] {
    if host_head_enabled() {
        forward::<B>(hidden, weight, targets)
    } else {
        crate::loss::token_logprobs::<B>(hidden, weight, targets, chunk_tokens)
    }
}

/// What the CPU backends run for
/// [`LossOps::token_logprobs_backward`](crate::LossOps::token_logprobs_backward) (see
/// [`token_logprobs`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn token_logprobs_backward<B: HostF32 + LossOps>(
    hidden: FloatTensor<B>,
    weight: FloatTensor<B>,
    targets: IntTensor<B>,
    lse: FloatTensor<B>,
    grad: FloatTensor<B>,
    chunk_tokens: usize,
    want: (bool, bool),
) -> (Option<FloatTensor<B>>, Option<FloatTensor<B>>) {
    if host_head_enabled() {
        backward::<B>(hidden, weight, targets, lse, grad, want)
    } else {
        crate::loss::token_logprobs_backward::<B>(
            hidden,
            weight,
            targets,
            lse,
            grad,
            chunk_tokens,
            want,
        )
    }
}

/// The fused host head's forward: `[log p, entropy, lse]`.
fn forward<B: HostF32>(
    hidden: FloatTensor<B>,
    weight: FloatTensor<B>,
    targets: IntTensor<B>,
) -> [FloatTensor<B>; 3] {
    let [tokens, h] = dims2(&hidden.shape(), "hidden states");
    let [vocab, hw] = dims2(&weight.shape(), "LM head");
    assert_eq!(h, hw, "hidden size {h} against a head of width {hw}");
    let device = B::float_device(&hidden);
    let targets = targets_u32::<B>(targets);
    let shape = HeadShape {
        tokens,
        hidden: h,
        vocab,
    };
    let stats = B::with_f32(hidden, |hs| {
        B::with_f32(weight, |ws| cpu_head::forward(hs, ws, &targets, shape))
    });
    [stats.logprobs, stats.entropy, stats.lse].map(|v| {
        let t = Tensor::<B, 1>::from_data(TensorData::new(v, [tokens]), &device);
        let t = if t.dtype() == DType::F32 {
            t
        } else {
            t.cast(DType::F32)
        };
        t.into_primitive().tensor()
    })
}

/// The fused host head's backward.
fn backward<B: HostF32>(
    hidden: FloatTensor<B>,
    weight: FloatTensor<B>,
    targets: IntTensor<B>,
    lse: FloatTensor<B>,
    grad: FloatTensor<B>,
    want: (bool, bool),
) -> (Option<FloatTensor<B>>, Option<FloatTensor<B>>) {
    let [tokens, h] = dims2(&hidden.shape(), "hidden states");
    let [vocab, _] = dims2(&weight.shape(), "LM head");
    let (hd, wd) = (hidden.dtype(), weight.dtype());
    let device = B::float_device(&hidden);
    let targets = targets_u32::<B>(targets);
    let shape = HeadShape {
        tokens,
        hidden: h,
        vocab,
    };
    let (gh, gw) = B::with_f32(lse, |l| {
        B::with_f32(grad, |g| {
            B::with_f32(hidden, |hs| {
                B::with_f32(weight, |ws| {
                    cpu_head::backward(hs, ws, &targets, l, g, shape, want.0, want.1)
                })
            })
        })
    });
    (
        gh.map(|v| to_backend::<B>(v, [tokens, h], hd, &device)),
        gw.map(|v| to_backend::<B>(v, [vocab, h], wd, &device)),
    )
}
