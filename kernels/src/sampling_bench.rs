//! Sampling one token per row at a full vocabulary against one softmax over the same logits, in
//! one process: what `benches/sampling.rs` prints and `conrub bench sampling` reports (on the
//! GPU machine, through `scripts/gpu-check.sh`).
//!
//! [`sampling_timings`] times `DecodeOps::sample_rows` (the draws go up, the tokens come back,
//! as in every decode step) in four modes: greedy, a draw from the whole distribution
//! (temperature 1), top-k 50, and top-p 0.9 at temperature 0.7; on the CubeCL backends also top-k
//! the way it ran before `sample_restricted_kernel` (the tensor rule, which sorts on the host;
//! its top-p, a sort and an O(vocab²) cumsum, is not run). The baseline is `softmax` over the
//! same `[rows, vocab]` logits, read back by one element.

use std::time::Instant;

use burn::tensor::activation::softmax;
use burn::tensor::{Int, Tensor, TensorData};

use crate::reference::seeded_uniform;
use crate::sampling::Decoding;
use crate::KernelOps;

/// One timed operation.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingTiming {
    /// What was timed (`softmax` is the baseline).
    pub label: &'static str,
    /// Median seconds of one call over all rows.
    pub secs: f64,
}

/// The median of `iters` timings of `f`, after one untimed call (compiles, autotune); the
/// attention bench times with it too.
pub(crate) fn median(iters: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..iters.max(1))
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

/// The sampling modes timed, with their labels.
pub fn modes() -> [(&'static str, Decoding); 4] {
    [
        ("greedy", Decoding::Greedy),
        ("whole distribution", Decoding::draw(1.0, None, 1.0)),
        ("top-k 50", Decoding::draw(1.0, Some(50), 1.0)),
        ("top-p 0.9, T 0.7", Decoding::draw(0.7, None, 0.9)),
    ]
}

/// Times the softmax baseline (first), each of [`modes`], and, when `with_tensor_rule`, top-k 50
/// by the tensor rule (last), over `rows` rows of `vocab` seeded logits (about +-4, different in
/// every row) on `device`; medians of `iters` calls after one warm-up call each.
pub fn sampling_timings<B: KernelOps>(
    device: &B::Device,
    [rows, vocab]: [usize; 2],
    iters: usize,
    with_tensor_rule: bool,
) -> Vec<SamplingTiming> {
    let data = seeded_uniform(rows * vocab, 7, 4.0);
    let logits = Tensor::<B, 2>::from_data(TensorData::new(data, [rows, vocab]), device);
    let _ = logits.clone().slice([0..1, 0..1]).into_data();
    let mut out = vec![SamplingTiming {
        label: "softmax",
        secs: median(iters, || {
            let p = softmax(logits.clone(), 1);
            let _ = p.slice([0..1, 0..1]).into_data();
        }),
    }];
    let uniforms: Vec<f64> = (0..rows).map(|r| (r as f64 + 0.5) / rows as f64).collect();
    let draw = |rule: &dyn Fn(&Decoding) -> Tensor<B, 1, Int>, params: Decoding| {
        median(iters, || {
            let _ = rule(&params).into_data();
        })
    };
    let kernel = |params: &Decoding| {
        let (tok, _) = B::sample_rows(logits.clone().into_primitive().tensor(), params, &uniforms);
        Tensor::<B, 1, Int>::from_primitive(tok)
    };
    for (label, params) in modes() {
        out.push(SamplingTiming {
            label,
            secs: draw(&kernel, params),
        });
    }
    if with_tensor_rule {
        let tensors = |params: &Decoding| {
            let (tok, _) = crate::sampling::sample_rows_by_tensor_ops::<B>(
                logits.clone().into_primitive().tensor(),
                params,
                &uniforms,
            );
            Tensor::<B, 1, Int>::from_primitive(tok)
        };
        out.push(SamplingTiming {
            label: "top-k 50, tensor rule",
            secs: draw(&tensors, modes()[2].1),
        });
    }
    out
}
