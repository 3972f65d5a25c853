//! CubeCL kernels (one source for CUDA, HIP and wgpu) and the op families for `CubeBackend`.
//!
//! Every tensor is indexed through its strides, outputs included: CUDA allocates row-pitched
//! buffers, and logits may arrive as transposed views.

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::ir::HardwareProperties;
use cubecl::prelude::*;

use crate::cube_prologue::{row_start, RowStart};

use crate::{AttentionKernels, AttentionLayout, AttentionOps, Clip, LossOps, PagedLayout, Reduce};

/// Threads per cube of the row kernels (a power of two).
const ROW_BLOCK: u32 = 256;

/// One cube per logit row: an online log-sum-exp over the vocabulary (each thread walks a strided
/// tile of it keeping a running max `m`, `sum exp(x - m)` and `sum exp(x - m) * x`), a tree merge
/// of the per-thread states in shared memory, then the target's log-probability and the entropy.
#[cube(launch)]
fn row_stats_kernel<F: Float, I: Numeric>(
    logits: &Tensor<F>,
    targets: &Tensor<I>,
    logp: &mut Tensor<F>,
    entropy: &mut Tensor<F>,
    lse: &mut Tensor<F>,
    #[comptime] block: u32,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let step = block as usize;
    #[rustfmt::skip]
    let RowStart { row, unit, len: vocab, base, cs } = row_start(logits);
    let one = F::new(1.0);
    // The dtype's lowest finite value: -1e30 overflows f16 (CubeCL then prints `-inf`, which
    // NVRTC rejects; `conrub kernels-compile` found it).
    let mut m = F::min_value();
    let mut s = F::new(0.0);
    let mut t = F::new(0.0);
    let mut v = unit;
    while v < vocab {
        let x = logits[base + v * cs];
        if x > m {
            let scale = (m - x).exp();
            s = s * scale + one;
            t = t * scale + x;
            m = x;
        } else {
            let e = (x - m).exp();
            s += e;
            t += e * x;
        }
        v += step;
    }
    let mut sm = SharedMemory::<F>::new(step);
    let mut ss = SharedMemory::<F>::new(step);
    let mut st = SharedMemory::<F>::new(step);
    sm[unit] = m;
    ss[unit] = s;
    st[unit] = t;
    sync_cube();
    let mut half = (CUBE_DIM_X / 2) as usize;
    while half > 0 {
        if unit < half {
            let m1 = sm[unit];
            let m2 = sm[unit + half];
            let mx = F::max(m1, m2);
            let a = (m1 - mx).exp();
            let b = (m2 - mx).exp();
            ss[unit] = ss[unit] * a + ss[unit + half] * b;
            st[unit] = st[unit] * a + st[unit + half] * b;
            sm[unit] = mx;
        }
        sync_cube();
        half /= 2;
    }
    if unit == 0 {
        let l = sm[0] + ss[0].ln();
        let tgt = u32::cast_from(targets[row * targets.stride(0)]) as usize;
        // An out-of-range target cannot be read; it gets a log-probability no real token has.
        let mut lp = F::min_value();
        if tgt < vocab {
            lp = logits[base + tgt * cs] - l;
        }
        logp[row * logp.stride(0)] = lp;
        entropy[row * entropy.stride(0)] = l - st[0] / ss[0];
        lse[row * lse.stride(0)] = l;
    }
}

/// `grad[r] * (onehot(target_r) - exp(x - lse_r))`, one unit per logit: cubes along x cover the
/// vocabulary, along y the rows.
#[cube(launch)]
fn logits_grad_kernel<F: Float, I: Numeric>(
    logits: &Tensor<F>,
    targets: &Tensor<I>,
    lse: &Tensor<F>,
    grad: &Tensor<F>,
    out: &mut Tensor<F>,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let row = CUBE_POS_Y as usize;
    let v = (CUBE_POS_X * CUBE_DIM_X + UNIT_POS_X) as usize;
    if v >= logits.shape(1) {
        terminate!();
    }
    let x = logits[row * logits.stride(0) + v * logits.stride(1)];
    let p = (x - lse[row * lse.stride(0)]).exp();
    let tgt = u32::cast_from(targets[row * targets.stride(0)]) as usize;
    let mut d = F::new(0.0) - p;
    if v == tgt {
        d += F::new(1.0);
    }
    out[row * out.stride(0) + v * out.stride(1)] = grad[row * grad.stride(0)] * d;
}

/// One cube per response: the masked per-token loss summed over the response's tokens (divided by
/// their count for the token mean) and the low/high clip counts, merged in shared memory.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn surrogate_forward_kernel<F: Float>(
    logp: &Tensor<F>,
    logp_old: &Tensor<F>,
    adv: &Tensor<F>,
    mask: &Tensor<F>,
    loss: &mut Tensor<F>,
    low: &mut Tensor<F>,
    high: &mut Tensor<F>,
    eps_low: f32,
    eps_high: f32,
    mean: u32,
    #[comptime] block: u32,
    #[define(F)] _dtype: StorageType,
) {
    let row = CUBE_POS_X as usize;
    let unit = UNIT_POS_X as usize;
    let step = block as usize;
    let len = logp.shape(1);
    let zero = F::new(0.0);
    let a = adv[row * adv.stride(0)];
    let lo = F::cast_from(1.0 - eps_low);
    let hi = F::cast_from(1.0 + eps_high);
    let mut sum = zero;
    let mut count = zero;
    let mut n_low = zero;
    let mut n_high = zero;
    let mut j = unit;
    while j < len {
        let w = mask[row * mask.stride(0) + j * mask.stride(1)];
        let r = (logp[row * logp.stride(0) + j * logp.stride(1)]
            - logp_old[row * logp_old.stride(0) + j * logp_old.stride(1)])
        .exp();
        let un = r * a;
        let cl = F::min(F::max(r, lo), hi) * a;
        sum += (zero - F::min(un, cl)) * w;
        count += w;
        if r < lo && a < zero {
            n_low += w;
        }
        if r > hi && a > zero {
            n_high += w;
        }
        j += step;
    }
    let mut s0 = SharedMemory::<F>::new(step);
    let mut s1 = SharedMemory::<F>::new(step);
    let mut s2 = SharedMemory::<F>::new(step);
    let mut s3 = SharedMemory::<F>::new(step);
    s0[unit] = sum;
    s1[unit] = count;
    s2[unit] = n_low;
    s3[unit] = n_high;
    sync_cube();
    let mut half = (CUBE_DIM_X / 2) as usize;
    while half > 0 {
        if unit < half {
            s0[unit] = s0[unit] + s0[unit + half];
            s1[unit] = s1[unit] + s1[unit + half];
            s2[unit] = s2[unit] + s2[unit + half];
            s3[unit] = s3[unit] + s3[unit + half];
        }
        sync_cube();
        half /= 2;
    }
    if unit == 0 {
        let mut out = s0[0];
        if mean == 1 {
            out = s0[0] / F::max(s1[0], F::new(1.0));
        }
        loss[row * loss.stride(0)] = out;
        low[row * low.stride(0)] = s2[0];
        high[row * high.stride(0)] = s3[0];
    }
}

/// `-A * rho * mask * scale[b]` where the unclipped term is the minimum, else 0; one unit per
/// token (cubes along x cover the tokens, along y the responses).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn surrogate_backward_kernel<F: Float>(
    logp: &Tensor<F>,
    logp_old: &Tensor<F>,
    adv: &Tensor<F>,
    mask: &Tensor<F>,
    scale: &Tensor<F>,
    out: &mut Tensor<F>,
    eps_low: f32,
    eps_high: f32,
    #[define(F)] _dtype: StorageType,
) {
    let row = CUBE_POS_Y as usize;
    let j = (CUBE_POS_X * CUBE_DIM_X + UNIT_POS_X) as usize;
    if j >= logp.shape(1) {
        terminate!();
    }
    let a = adv[row * adv.stride(0)];
    let r = (logp[row * logp.stride(0) + j * logp.stride(1)]
        - logp_old[row * logp_old.stride(0) + j * logp_old.stride(1)])
    .exp();
    let un = r * a;
    let cl = F::min(
        F::max(r, F::cast_from(1.0 - eps_low)),
        F::cast_from(1.0 + eps_high),
    ) * a;
    let mut g = F::new(0.0);
    if un <= cl {
        g = (F::new(0.0) - un)
            * mask[row * mask.stride(0) + j * mask.stride(1)]
            * scale[row * scale.stride(0)];
    }
    out[row * out.stride(0) + j * out.stride(1)] = g;
}

fn empty_like<R: CubeRuntime>(t: &CubeTensor<R>, shape: Shape) -> CubeTensor<R> {
    empty_device_dtype::<R>(t.client.clone(), t.device.clone(), shape, t.dtype)
}

/// Threads per cube of the row kernels on a device: [`ROW_BLOCK`], halved until it fits.
pub(crate) fn row_block(hw: &HardwareProperties) -> u32 {
    let mut b = ROW_BLOCK;
    while b > hw.max_cube_dim.0 || b > hw.max_units_per_cube {
        b /= 2;
    }
    b
}

fn elementwise_grid(cols: usize, rows: usize, block: u32) -> (CubeCount, CubeDim) {
    (
        CubeCount::Static((cols as u32).div_ceil(block), rows as u32, 1),
        CubeDim::new_1d(block),
    )
}

/// Launches [`row_stats_kernel`] over `rows` logit rows: `[logits, targets, logp, entropy,
/// lse]`, dtypes `[float, int]`. The backend and the offline CUDA compile both launch here.
pub(crate) fn launch_row_stats<R: Runtime>(
    client: &ComputeClient<R>,
    rows: usize,
    [logits, targets, logp, entropy, lse]: [TensorArg<R>; 5],
    dtypes: [StorageType; 2],
) {
    let block = row_block(&client.properties().hardware);
    row_stats_kernel::launch::<R>(
        client,
        CubeCount::Static(rows as u32, 1, 1),
        CubeDim::new_1d(block),
        logits,
        targets,
        logp,
        entropy,
        lse,
        block,
        dtypes,
    );
}

/// Launches [`logits_grad_kernel`] over `[rows, vocab]`: `[logits, targets, lse, grad, out]`.
pub(crate) fn launch_logits_grad<R: Runtime>(
    client: &ComputeClient<R>,
    [rows, vocab]: [usize; 2],
    [logits, targets, lse, grad, out]: [TensorArg<R>; 5],
    dtypes: [StorageType; 2],
) {
    let (count, dim) = elementwise_grid(vocab, rows, row_block(&client.properties().hardware));
    logits_grad_kernel::launch::<R>(client, count, dim, logits, targets, lse, grad, out, dtypes);
}

/// Launches [`surrogate_forward_kernel`] over `rows` responses: `[logp, logp_old, adv, mask,
/// loss, low, high]`.
pub(crate) fn launch_surrogate_forward<R: Runtime>(
    client: &ComputeClient<R>,
    rows: usize,
    [logp, logp_old, adv, mask, loss, low, high]: [TensorArg<R>; 7],
    (clip, reduce): (Clip, Reduce),
    dtype: StorageType,
) {
    let block = row_block(&client.properties().hardware);
    surrogate_forward_kernel::launch::<R>(
        client,
        CubeCount::Static(rows as u32, 1, 1),
        CubeDim::new_1d(block),
        logp,
        logp_old,
        adv,
        mask,
        loss,
        low,
        high,
        clip.low as f32,
        clip.high as f32,
        (reduce == Reduce::MeanPerResponse) as u32,
        block,
        dtype,
    );
}

/// Launches [`surrogate_backward_kernel`] over `[rows, len]`: `[logp, logp_old, adv, mask,
/// scale, out]`.
pub(crate) fn launch_surrogate_backward<R: Runtime>(
    client: &ComputeClient<R>,
    [rows, len]: [usize; 2],
    [logp, logp_old, adv, mask, scale, out]: [TensorArg<R>; 6],
    clip: Clip,
    dtype: StorageType,
) {
    let (count, dim) = elementwise_grid(len, rows, row_block(&client.properties().hardware));
    surrogate_backward_kernel::launch::<R>(
        client,
        count,
        dim,
        logp,
        logp_old,
        adv,
        mask,
        scale,
        out,
        clip.low as f32,
        clip.high as f32,
        dtype,
    );
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> LossOps
    for CubeBackend<R, F, I, BT>
{
    fn contiguous(tensor: FloatTensor<Self>) -> FloatTensor<Self> {
        burn_cubecl::kernel::into_contiguous(tensor)
    }

    fn logits_row_stats(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> [FloatTensor<Self>; 3] {
        let rows = logits.shape().dims::<2>()[0];
        let outs = [(); 3].map(|_| empty_like(&logits, Shape::new([rows])));
        let dtypes = [logits.dtype.into(), targets.dtype.into()];
        let client = logits.client.clone();
        let args = [
            logits.into_tensor_arg(),
            targets.into_tensor_arg(),
            outs[0].clone().into_tensor_arg(),
            outs[1].clone().into_tensor_arg(),
            outs[2].clone().into_tensor_arg(),
        ];
        launch_row_stats(&client, rows, args, dtypes);
        outs
    }

    fn logits_grad(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let dims = logits.shape().dims::<2>();
        let out = empty_like(&logits, Shape::new(dims));
        let dtypes = [logits.dtype.into(), targets.dtype.into()];
        let client = logits.client.clone();
        let args = [
            logits.into_tensor_arg(),
            targets.into_tensor_arg(),
            lse.into_tensor_arg(),
            grad.into_tensor_arg(),
            out.clone().into_tensor_arg(),
        ];
        launch_logits_grad(&client, dims, args, dtypes);
        out
    }

    fn surrogate_forward(
        logp: FloatTensor<Self>,
        logp_old: FloatTensor<Self>,
        advantages: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        clip: Clip,
        reduce: Reduce,
    ) -> [FloatTensor<Self>; 3] {
        let rows = logp.shape().dims::<2>()[0];
        let outs = [(); 3].map(|_| empty_like(&logp, Shape::new([rows])));
        let dtype = logp.dtype.into();
        let client = logp.client.clone();
        let args = [
            logp.into_tensor_arg(),
            logp_old.into_tensor_arg(),
            advantages.into_tensor_arg(),
            mask.into_tensor_arg(),
            outs[0].clone().into_tensor_arg(),
            outs[1].clone().into_tensor_arg(),
            outs[2].clone().into_tensor_arg(),
        ];
        launch_surrogate_forward(&client, rows, args, (clip, reduce), dtype);
        outs
    }

    fn surrogate_backward(
        logp: FloatTensor<Self>,
        logp_old: FloatTensor<Self>,
        advantages: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        clip: Clip,
        scale: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let dims = logp.shape().dims::<2>();
        let out = empty_like(&logp, Shape::new(dims));
        let dtype = logp.dtype.into();
        let client = logp.client.clone();
        let args = [
            logp.into_tensor_arg(),
            logp_old.into_tensor_arg(),
            advantages.into_tensor_arg(),
            mask.into_tensor_arg(),
            scale.into_tensor_arg(),
            out.clone().into_tensor_arg(),
        ];
        launch_surrogate_backward(&client, dims, args, clip, dtype);
        out
    }
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> AttentionOps
    for CubeBackend<R, F, I, BT>
{
    fn check_attention_kernels(
        device: &Self::Device,
        kernels: AttentionKernels,
    ) -> Result<(), crate::KernelError> {
        if kernels != AttentionKernels::TensorCore {
            return Ok(());
        }
        let client = R::client(device);
        let props = client.properties();
        if [DType::BF16, DType::F16]
            .iter()
            .any(|&d| crate::cube_flash::device_has_cmma(props, d))
        {
            Ok(())
        } else {
            Err(crate::KernelError::NoAttentionKernels {
                kernels: kernels.name(),
                reason: format!(
                    "device {device:?} has no cooperative matrices (cmma/WMMA: 16x16x16 tiles of \
                     bf16 or f16 with f32 accumulation) in its features, which the `tensor-core` \
                     attention kernels need; use `portable` (or `auto`)"
                ),
            })
        }
    }

    fn attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_valid: FloatTensor<Self>,
        layout: AttentionLayout,
    ) -> [FloatTensor<Self>; 2] {
        crate::cube_attention::forward(q, k, v, key_valid, layout)
    }

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
        crate::cube_attention::backward(q, k, v, key_valid, out, lse, d_out, layout)
    }

    fn paged_decode_attention(
        q: FloatTensor<Self>,
        k_pool: FloatTensor<Self>,
        v_pool: FloatTensor<Self>,
        tables: IntTensor<Self>,
        lens: IntTensor<Self>,
        layout: PagedLayout,
    ) -> FloatTensor<Self> {
        crate::cube_paged::paged_decode(q, k_pool, v_pool, tables, lens, layout)
    }
}

// `DecodeOps` (sampling) is in `cube_sampling.rs`.
