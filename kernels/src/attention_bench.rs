//! Causal attention kernels timed against each other in one process: what `conrub bench
//! attention` reports (on the GPU machine through `scripts/gpu-check.sh`, next to torch's
//! `scaled_dot_product_attention` from `benches/gpu/sdpa.py` on the same GPU).
//!
//! [`training_timings`] times `AttentionOps::attention_forward` and forward + backward under each
//! [`AttentionKernels`] asked for (the portable kernels are the baseline) and reports TFLOP/s by
//! the usual convention: a causal forward is `2 · 2 · b · heads · t² · head_dim / 2` FLOPs (two
//! matrix products over the lower triangle) and forward + backward 3.5 times that (the backward's
//! five products), whatever a kernel actually recomputes. [`decode_timings`] times
//! `AttentionOps::paged_decode_attention` with the backend's key splits, without splits, and
//! the gather fallback, over a pool whose blocks are interleaved between rows.

use burn::tensor::{DType, Int, Tensor, TensorData};

use crate::attention::fallback_paged_decode;
use crate::reference::seeded_uniform;
use crate::sampling_bench::median;
use crate::{AttentionKernels, AttentionLayout, KernelOps, PagedLayout};

/// One timed operation.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionTiming {
    /// `forward`, `forward+backward`, or `decode`.
    pub op: &'static str,
    /// The kernels: an [`AttentionKernels::name`], or for decode `split`, `unsplit`, `gather`.
    pub kernels: &'static str,
    /// Queries per sequence (training) or keys per row (decode).
    pub tokens: usize,
    /// Sequences (training) or rows (decode).
    pub rows: usize,
    /// Median seconds of one call.
    pub secs: f64,
    /// Useful TFLOP/s (training only; see the module docs).
    pub tflops: Option<f64>,
}

/// FLOPs of one causal forward (see the module docs).
pub fn causal_forward_flops(batch: usize, heads: usize, t: usize, head_dim: usize) -> f64 {
    2.0 * (batch * heads) as f64 * (t as f64) * (t as f64) * head_dim as f64
}

fn seeded<B: KernelOps>(
    shape: [usize; 4],
    seed: u64,
    dtype: DType,
    device: &B::Device,
) -> Tensor<B, 4> {
    let n = shape.iter().product();
    Tensor::<B, 4>::from_data(TensorData::new(seeded_uniform(n, seed, 1.0), shape), device)
        .cast(dtype)
}

/// Reads one element of `t`: the device has finished everything before it.
fn wait<B: KernelOps, const D: usize>(t: Tensor<B, D>) {
    let _ = t.flatten::<1>(0, D - 1).slice(0..1).into_data();
}

/// Forward and forward + backward of causal attention, `[batch, heads, kv_heads, t, head_dim]`
/// in `dtype` (every key valid), under each of `kernels`; medians of `iters` calls.
pub fn training_timings<B: KernelOps>(
    device: &B::Device,
    [batch, heads, kv_heads, t, d]: [usize; 5],
    dtype: DType,
    kernels: &[AttentionKernels],
    iters: usize,
) -> Vec<AttentionTiming> {
    let q = seeded::<B>([batch, heads, t, d], 41, dtype, device);
    let k = seeded::<B>([batch, kv_heads, t, d], 42, dtype, device);
    let v = seeded::<B>([batch, kv_heads, t, d], 43, dtype, device);
    let g = seeded::<B>([batch, heads, t, d], 44, dtype, device);
    let valid = Tensor::<B, 2>::ones([batch, t], device);
    let prim = |x: &Tensor<B, 4>| x.clone().into_primitive().tensor();
    let flops = causal_forward_flops(batch, heads, t, d);
    let mut out = Vec::new();
    for &kind in kernels {
        let layout = AttentionLayout {
            kernels: kind,
            ..AttentionLayout::new(0, 1.0 / (d as f64).sqrt())
        };
        let forward = || {
            B::attention_forward(
                prim(&q),
                prim(&k),
                prim(&v),
                valid.clone().into_primitive().tensor(),
                layout,
            )
        };
        let secs = median(iters, || {
            let [o, _] = forward();
            wait(Tensor::<B, 4>::from_primitive(
                burn::tensor::TensorPrimitive::Float(o),
            ));
        });
        out.push(AttentionTiming {
            op: "forward",
            kernels: kind.name(),
            tokens: t,
            rows: batch,
            secs,
            tflops: Some(flops / secs / 1e12),
        });
        let secs = median(iters, || {
            let [o, lse] = forward();
            let [dq, _, _] = B::attention_backward(
                prim(&q),
                prim(&k),
                prim(&v),
                valid.clone().into_primitive().tensor(),
                o,
                lse,
                prim(&g),
                layout,
            );
            wait(Tensor::<B, 4>::from_primitive(
                burn::tensor::TensorPrimitive::Float(dq),
            ));
        });
        out.push(AttentionTiming {
            op: "forward+backward",
            kernels: kind.name(),
            tokens: t,
            rows: batch,
            secs,
            tflops: Some(3.5 * flops / secs / 1e12),
        });
    }
    out
}

/// Decode attention of `rows` rows of `keys` keys each (the 4B shape's heads by default: `heads` over `kv_heads`,
/// `head_dim`) in `dtype`, blocks of 16 interleaved between rows: the backend's op with its
/// key splits, with `kv_splits = 1`, and the gather fallback; medians of `iters` calls.
pub fn decode_timings<B: KernelOps>(
    device: &B::Device,
    [rows, keys, heads, kv_heads, d]: [usize; 5],
    dtype: DType,
    iters: usize,
) -> Vec<AttentionTiming> {
    let bs = 16usize;
    let blocks = keys.div_ceil(bs);
    let slots = rows * blocks * bs;
    let q = seeded::<B>([rows, heads, 1, d], 51, dtype, device);
    let pool = |seed| {
        Tensor::<B, 2>::from_data(
            TensorData::new(
                seeded_uniform(slots * kv_heads * d, seed, 1.0),
                [slots, kv_heads * d],
            ),
            device,
        )
        .cast(dtype)
    };
    let (kp, vp) = (pool(52), pool(53));
    let ids: Vec<i64> = (0..rows)
        .flat_map(|r| (0..blocks).map(move |j| (j * rows + r) as i64))
        .collect();
    let tables = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [rows, blocks]), device);
    let lens =
        Tensor::<B, 1, Int>::from_data(TensorData::new(vec![keys as i64; rows], [rows]), device);
    let auto = PagedLayout::new(bs, 1.0 / (d as f64).sqrt());
    let run = |how: &'static str| {
        let (q, k, v, t, l) = (
            q.clone().into_primitive().tensor(),
            kp.clone().into_primitive().tensor(),
            vp.clone().into_primitive().tensor(),
            tables.clone().into_primitive(),
            lens.clone().into_primitive(),
        );
        let o = match how {
            "split" => B::paged_decode_attention(q, k, v, t, l, auto),
            "unsplit" => B::paged_decode_attention(
                q,
                k,
                v,
                t,
                l,
                PagedLayout {
                    kv_splits: 1,
                    ..auto
                },
            ),
            _ => fallback_paged_decode::<B>(q, k, v, t, l, auto),
        };
        wait(Tensor::<B, 4>::from_primitive(
            burn::tensor::TensorPrimitive::Float(o),
        ));
    };
    ["split", "unsplit", "gather"]
        .into_iter()
        .map(|how| AttentionTiming {
            op: "decode",
            kernels: how,
            tokens: keys,
            rows,
            secs: median(iters, || run(how)),
            tflops: None,
        })
        .collect()
}
