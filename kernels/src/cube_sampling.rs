//! Sampling on the CubeCL backends in one pass of work per row: [`sample_kernel`] applies
//! [`crate::sampling::sample_row`]'s rule for greedy decoding and for a draw from the whole
//! (temperature-scaled) distribution, without a cumulative sum over the vocabulary.
//!
//! burn-cubecl 0.21's `cumsum` re-reads every earlier element for each output (O(vocab²) per
//! row: ~1.15e10 reads per row per token at Qwen3's 151,936 tokens), which is what the tensor
//! rule ([`crate::sampling::sample_rows_by_tensors`]) used; this kernel reads each logit twice.
//! One cube per row:
//!
//! 1. every unit walks a strided slice of the row for its maximum (first index on ties); a tree
//!    merge in shared memory gives the row's max and argmax;
//! 2. every unit sums `exp((x - max) / T)` over one contiguous chunk of ids (chunk `u` is ids
//!    `u * chunk .. (u + 1) * chunk`), so the chunk sums, in unit order, are the cumulative
//!    distribution at chunk boundaries;
//! 3. unit 0 adds the chunk sums in order (the total), finds the chunk where `u x total` is
//!    crossed, and walks that chunk alone to the token: `chunk` exponentials, not `vocab`.
//!
//! The token is the host rule's up to f32 rounding of the partial sums (the host adds in f64);
//! its log-probability is `(x - max) / T - ln(total)`. Greedy rows take the argmax and report
//! `-ln(total)` at temperature 1, the model's own log-probability of it.

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, FloatDType, Shape, TensorData, TensorMetadata};
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

use crate::sampling::SampleParams;

/// See the module docs. `logits` `[rows, vocab]` in any float dtype, `uniforms` `[rows]` f32
/// (unread when greedy), `tokens` `[rows]` in the backend's int dtype, `logp` `[rows]` f32.
#[cube(launch)]
// `div_ceil` has no CubeCL expansion; `vocab - vocab` is a run-time zero (see below).
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil, clippy::eq_op)]
fn sample_kernel<F: Float, I: Numeric>(
    logits: &Tensor<F>,
    uniforms: &Tensor<f32>,
    tokens: &mut Tensor<I>,
    logp: &mut Tensor<f32>,
    inv_temp: f32,
    #[comptime] block: u32,
    #[comptime] greedy: bool,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let row = CUBE_POS_X as usize;
    let unit = UNIT_POS_X as usize;
    let step = block as usize;
    let vocab = logits.shape(1);
    let base = row * logits.stride(0);
    let cs = logits.stride(1);

    // 1. Max and first argmax of the row.
    let mut m = f32::cast_from(F::min_value());
    let mut arg = vocab;
    let mut v = unit;
    while v < vocab {
        let x = f32::cast_from(logits[base + v * cs]);
        if x > m || arg == vocab {
            m = x;
            arg = v;
        }
        v += step;
    }
    let mut sm = SharedMemory::<f32>::new(step);
    let mut sa = SharedMemory::<u32>::new(step);
    sm[unit] = m;
    sa[unit] = arg as u32;
    sync_cube();
    let mut half = (CUBE_DIM_X / 2) as usize;
    while half > 0 {
        if unit < half {
            let m1 = sm[unit];
            let a1 = sa[unit];
            let m2 = sm[unit + half];
            let a2 = sa[unit + half];
            let none = vocab as u32;
            // An empty slice (arg == vocab) never wins; else the larger value, then the lower id.
            let take = a2 < none && (a1 >= none || m2 > m1 || (m2 == m1 && a2 < a1));
            if take {
                sm[unit] = m2;
                sa[unit] = a2;
            }
        }
        sync_cube();
        half /= 2;
    }
    let max = sm[0];
    let argmax = sa[0] as usize;

    // 2. Weight sums of contiguous chunks of ids.
    let chunk = (vocab + step - 1) / step;
    let start = unit * chunk;
    let mut end = start + chunk;
    if end > vocab {
        end = vocab;
    }
    let mut s = 0.0f32;
    let mut j = start;
    while j < end {
        s += ((f32::cast_from(logits[base + j * cs]) - max) * inv_temp).exp();
        j += 1;
    }
    let mut ss = SharedMemory::<f32>::new(step);
    ss[unit] = s;
    sync_cube();

    // 3. The total, the crossing chunk and the token.
    if unit == 0 {
        let mut total = 0.0f32;
        for i in 0..step {
            total += ss[i];
        }
        let out = row * tokens.stride(0);
        let lp_out = row * logp.stride(0);
        if greedy {
            let mut tok = argmax;
            if tok >= vocab {
                tok = 0;
            }
            tokens[out] = I::cast_from(tok as u32);
            logp[lp_out] = 0.0f32 - total.ln();
        } else {
            let target = uniforms[row * uniforms.stride(0)] * total;
            // The first chunk whose inclusive sum passes the target; past the end (rounding),
            // the last chunk with any weight.
            // The first chunk whose inclusive sum passes the target, and the sum before it;
            // past the end (a draw that rounds to the total), the last chunk with any weight.
            let mut run = 0.0f32;
            let mut acc = 0.0f32;
            let mut before_last = 0.0f32;
            let mut found = false;
            // (`vocab - vocab`: a runtime zero; a literal would be a compile-time constant.)
            let mut c = vocab - vocab;
            let mut last = vocab - vocab;
            for i in 0..step {
                if ss[i] > 0.0f32 {
                    last = i;
                    before_last = run;
                }
                if !found && run + ss[i] > target {
                    c = i;
                    acc = run;
                    found = true;
                }
                run += ss[i];
            }
            if !found {
                c = last;
                acc = before_last;
            }
            let lo = c * chunk;
            let mut hi = lo + chunk;
            if hi > vocab {
                hi = vocab;
            }
            let mut tok = vocab;
            let mut positive = lo;
            let mut k = lo;
            while k < hi {
                let w = ((f32::cast_from(logits[base + k * cs]) - max) * inv_temp).exp();
                if w > 0.0f32 {
                    positive = k;
                }
                if tok == vocab {
                    acc += w;
                    if acc > target {
                        tok = k;
                    }
                }
                k += 1;
            }
            // Rounding left the target past the chunk: its last token with any weight.
            if tok == vocab {
                tok = positive;
            }
            tokens[out] = I::cast_from(tok as u32);
            logp[lp_out] = (f32::cast_from(logits[base + tok * cs]) - max) * inv_temp - total.ln();
        }
    }
}

/// Whether [`sample_kernel`] applies `params`: greedy, or a draw from the whole distribution
/// (top-k and top-p rows take the tensor rule).
pub(crate) fn kernel_applies(params: &SampleParams, vocab: usize) -> bool {
    params.greedy || (params.top_k.is_none_or(|k| k >= vocab) && params.top_p >= 1.0)
}

/// Launches [`sample_kernel`] over `rows` rows: `[logits, uniforms, tokens, logp]`, dtypes
/// `[logits' float, tokens' int]`. The backend and the offline CUDA compile both launch here.
pub(crate) fn launch_sample<R: Runtime>(
    client: &ComputeClient<R>,
    rows: usize,
    [logits, uniforms, tokens, logp]: [TensorArg<R>; 4],
    params: &SampleParams,
    dtypes: [StorageType; 2],
) {
    let block = crate::cube::row_block(&client.properties().hardware);
    let inv_temp = if params.greedy {
        1.0
    } else {
        (1.0 / params.temperature) as f32
    };
    sample_kernel::launch::<R>(
        client,
        CubeCount::Static(rows as u32, 1, 1),
        CubeDim::new_1d(block),
        logits,
        uniforms,
        tokens,
        logp,
        inv_temp,
        block,
        params.greedy,
        dtypes,
    );
}

/// `sample_rows` on a CubeCL backend with the draws already on the device (`uniforms` `[rows]`
/// f32): the kernel where it applies, else the tensor rule on the host's copy of the draws.
pub(crate) fn sample_rows_on<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    logits: CubeTensor<R>,
    uniforms: CubeTensor<R>,
    params: &SampleParams,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let [rows, vocab] = logits.shape().dims::<2>();
    if rows == 0 || !kernel_applies(params, vocab) {
        let u = crate::sampling::host_uniforms::<CubeBackend<R, F, I, BT>>(uniforms);
        return crate::sampling::sample_rows_by_tensor_ops::<CubeBackend<R, F, I, BT>>(
            logits, params, &u,
        );
    }
    let client = logits.client.clone();
    let device = logits.device.clone();
    let tokens = empty_device_dtype::<R>(
        client.clone(),
        device.clone(),
        Shape::new([rows]),
        I::dtype(),
    );
    let logp = empty_device_dtype::<R>(client.clone(), device, Shape::new([rows]), DType::F32);
    let dtypes = [logits.dtype.into(), I::dtype().into()];
    let args = [
        logits.into_tensor_arg(),
        uniforms.into_tensor_arg(),
        tokens.clone().into_tensor_arg(),
        logp.clone().into_tensor_arg(),
    ];
    launch_sample(&client, rows, args, params, dtypes);
    (tokens, logp)
}

/// The rows' draws as an f32 tensor `[rows]` on `logits`' device (zeros when greedy: unread).
pub(crate) fn uniforms_tensor<B: burn::tensor::backend::Backend>(
    rows: usize,
    params: &SampleParams,
    uniforms: &[f64],
    device: &B::Device,
) -> FloatTensor<B> {
    let u: Vec<f32> = if params.greedy {
        vec![0.0; rows]
    } else {
        assert_eq!(uniforms.len(), rows, "one uniform draw per row");
        // Below 1 after the f32 rounding too, so that `u x total` stays inside the distribution.
        let below_one = f32::from_bits(0x3f7f_ffff);
        uniforms
            .iter()
            .map(|&x| (x as f32).min(below_one))
            .collect()
    };
    B::float_cast(
        B::float_from_data(TensorData::new(u, [rows]), device),
        FloatDType::F32,
    )
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> crate::DecodeOps
    for CubeBackend<R, F, I, BT>
{
    fn sample_rows(
        logits: FloatTensor<Self>,
        params: &SampleParams,
        uniforms: &[f64],
    ) -> (IntTensor<Self>, FloatTensor<Self>) {
        let [rows, vocab] = logits.shape().dims::<2>();
        if rows == 0 || !kernel_applies(params, vocab) {
            return crate::sampling::sample_rows_by_tensor_ops::<Self>(logits, params, uniforms);
        }
        let u = uniforms_tensor::<Self>(rows, params, uniforms, &logits.device);
        sample_rows_on::<R, F, I, BT>(logits, u, params)
    }

    fn sample_rows_on(
        logits: FloatTensor<Self>,
        uniforms: FloatTensor<Self>,
        params: &SampleParams,
    ) -> (IntTensor<Self>, FloatTensor<Self>) {
        sample_rows_on::<R, F, I, BT>(logits, uniforms, params)
    }
}
