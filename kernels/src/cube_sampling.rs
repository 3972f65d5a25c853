//! Sampling on the CubeCL backends: [`sample_kernel`] applies
//! [`crate::sampling::sample_row`]'s rule for greedy decoding and for a draw from the whole
//! (temperature-scaled) distribution, without a cumulative sum over the vocabulary;
//! [`sample_restricted_kernel`] applies it with top-k and/or top-p, without a sort.
//!
//! burn-cubecl 0.21's `cumsum` re-reads every earlier element for each output (O(vocab²) per
//! row: ~1.15e10 reads per row per token at a 151,936-token vocabulary), which is what the tensor
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

use crate::cube_prologue::{row_start, RowStart};

use crate::sampling::Decoding;

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
    let step = block as usize;
    #[rustfmt::skip]
    let RowStart { row, unit, len: vocab, base, cs } = row_start(logits);

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

/// Candidates [`prefix_search`] tests per pass: the 16 values of the next 4 bits of the key.
const CANDIDATES: usize = 16;

/// A logit's place in the descending order as a `u32` that orders like `f32::total_cmp` (a
/// larger key is a larger logit).
#[cube]
fn order_key(x: f32) -> u32 {
    let b = u32::reinterpret(x);
    let mut key = b | 0x8000_0000u32;
    if (b >> 31u32) == 1u32 {
        key = b ^ 0xFFFF_FFFFu32;
    }
    key
}

/// Whether the id `id` with key `key` is in the prefix `{key > set_key} ∪ {key == set_key, id
/// <= set_id}` of the order (descending logit, ties by ascending id); `(0, vocab)` is the
/// whole row.
#[cube]
fn in_prefix(key: u32, id: u32, set_key: u32, set_id: u32) -> bool {
    key > set_key || (key == set_key && id <= set_id)
}

/// What a search or a sum adds per id: 1 (a count) or the id's weight `exp((x - max) / T)`.
#[cube]
fn measure(x: f32, max: f32, inv_temp: f32, #[comptime] count: bool) -> f32 {
    let mut f = 1.0f32;
    if !count {
        f = ((x - max) * inv_temp).exp();
    }
    f
}

/// The cube's sum of every unit's `value` (a tree in `red`, `block` floats).
#[cube]
fn cube_sum(red: &mut SharedMemory<f32>, value: f32) -> f32 {
    let unit = UNIT_POS_X as usize;
    red[unit] = value;
    sync_cube();
    let mut half = (CUBE_DIM_X / 2) as usize;
    while half > 0 {
        if unit < half {
            let other = red[unit + half];
            red[unit] += other;
        }
        sync_cube();
        half /= 2;
    }
    let total = red[0];
    sync_cube();
    total
}

/// The count or weight (`count`) of the ids of a row in the prefix `(set_key, set_id)`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn prefix_sum<F: Float>(
    logits: &Tensor<F>,
    base: usize,
    max: f32,
    inv_temp: f32,
    set_key: u32,
    set_id: u32,
    red: &mut SharedMemory<f32>,
    #[comptime] block: u32,
    #[comptime] count: bool,
) -> f32 {
    let vocab = logits.shape(1);
    let cs = logits.stride(1);
    let mut s = 0.0f32;
    let mut v = UNIT_POS_X as usize;
    while v < vocab {
        let x = f32::cast_from(logits[base + v * cs]);
        if in_prefix(order_key(x), v as u32, set_key, set_id) {
            s += measure(x, max, inv_temp, count);
        }
        v += block as usize;
    }
    cube_sum(red, s)
}

/// How many ids of the prefix `(set_key, set_id)` have `(x - max) / T >= ln_min_p` (min-p).
#[cube]
#[allow(clippy::too_many_arguments)]
fn likely_count<F: Float>(
    logits: &Tensor<F>,
    base: usize,
    max: f32,
    inv_temp: f32,
    set_key: u32,
    set_id: u32,
    ln_min_p: f32,
    red: &mut SharedMemory<f32>,
    #[comptime] block: u32,
) -> f32 {
    let vocab = logits.shape(1);
    let cs = logits.stride(1);
    let mut s = 0.0f32;
    let mut v = UNIT_POS_X as usize;
    while v < vocab {
        let x = f32::cast_from(logits[base + v * cs]);
        if in_prefix(order_key(x), v as u32, set_key, set_id) && (x - max) * inv_temp >= ln_min_p {
            s += 1.0f32;
        }
        v += block as usize;
    }
    cube_sum(red, s)
}

/// The shortest prefix of the row's order (descending logit, ties by id), among the ids in
/// the prefix `(set_key, set_id)`, whose count or weight (`count`) reaches `target` (`>=`, or
/// `>` when `strict`). Writes `res = [key, id, found]`: the prefix is `{key' > key} ∪ {key' ==
/// key, id' <= id}`; `found` is 0 when even the whole set falls short (f32 rounding).
///
/// Eight passes fix the crossing logit's 32-bit key 4 bits at a time (each unit sums the
/// measure above the 15 candidate values of the next 4 bits; a tree sums them over the cube);
/// a ninth sums what lies above that key and, per contiguous chunk of ids, what lies at it, and
/// unit 0 walks the one chunk where the ties cross.
#[cube]
// `div_ceil` has no CubeCL expansion; `vocab - vocab` is a run-time zero (as in `sample_kernel`).
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil, clippy::eq_op)]
fn prefix_search<F: Float>(
    logits: &Tensor<F>,
    base: usize,
    max: f32,
    inv_temp: f32,
    set_key: u32,
    set_id: u32,
    target: f32,
    hist: &mut SharedMemory<f32>,
    red: &mut SharedMemory<f32>,
    res: &mut SharedMemory<u32>,
    #[comptime] block: u32,
    #[comptime] count: bool,
    #[comptime] strict: bool,
) {
    let unit = UNIT_POS_X as usize;
    let step = block as usize;
    let vocab = logits.shape(1);
    let cs = logits.stride(1);
    let mut prefix = 0u32;
    for pass in 0..8u32 {
        let shift = 28u32 - pass * 4u32;
        let top = (prefix >> shift) >> 4u32;
        let mut acc = Array::<f32>::new(CANDIDATES);
        #[unroll]
        for c in 0..CANDIDATES {
            acc[c] = 0.0f32;
        }
        let mut v = unit;
        while v < vocab {
            let x = f32::cast_from(logits[base + v * cs]);
            let key = order_key(x);
            if in_prefix(key, v as u32, set_key, set_id) {
                let hi = key >> shift;
                let mut level = 0u32;
                if (hi >> 4u32) > top {
                    level = 15u32;
                } else if (hi >> 4u32) == top {
                    level = hi & 15u32;
                }
                let f = measure(x, max, inv_temp, count);
                #[unroll]
                for c in 1..CANDIDATES {
                    if level >= c as u32 {
                        acc[c] += f;
                    }
                }
            }
            v += step;
        }
        #[unroll]
        for c in 1..CANDIDATES {
            hist[c * step + unit] = acc[c];
        }
        sync_cube();
        let mut half = (CUBE_DIM_X / 2) as usize;
        while half > 0 {
            if unit < half {
                #[unroll]
                for c in 1..CANDIDATES {
                    let other = hist[c * step + unit + half];
                    hist[c * step + unit] += other;
                }
            }
            sync_cube();
            half /= 2;
        }
        // The measure above a candidate falls as the candidate rises (sums of non-negative
        // terms in one order round monotonically): the last that still reaches the target.
        let mut best = 0u32;
        #[unroll]
        for c in 1..CANDIDATES {
            let g = hist[c * step];
            let mut reaches = g >= target;
            if strict {
                reaches = g > target;
            }
            if reaches {
                best = c as u32;
            }
        }
        sync_cube();
        prefix |= best << shift;
    }

    // What lies above the key, and at it per contiguous chunk of ids.
    let key_at = prefix;
    let mut above = 0.0f32;
    let mut v = unit;
    while v < vocab {
        let x = f32::cast_from(logits[base + v * cs]);
        let key = order_key(x);
        if key > key_at && in_prefix(key, v as u32, set_key, set_id) {
            above += measure(x, max, inv_temp, count);
        }
        v += step;
    }
    let above = cube_sum(red, above);
    let chunk = (vocab + step - 1) / step;
    let start = unit * chunk;
    let mut end = start + chunk;
    if end > vocab {
        end = vocab;
    }
    let mut s = 0.0f32;
    let mut j = start;
    while j < end {
        let x = f32::cast_from(logits[base + j * cs]);
        let key = order_key(x);
        if key == key_at && in_prefix(key, j as u32, set_key, set_id) {
            s += measure(x, max, inv_temp, count);
        }
        j += 1;
    }
    hist[unit] = s;
    sync_cube();
    if unit == 0 {
        let mut run = above;
        let mut acc = 0.0f32;
        let mut found = false;
        let mut c = vocab - vocab;
        let mut last = vocab - vocab;
        let mut before_last = above;
        for i in 0..step {
            if hist[i] > 0.0f32 {
                last = i;
                before_last = run;
            }
            let mut reaches = run + hist[i] >= target;
            if strict {
                reaches = run + hist[i] > target;
            }
            if !found && reaches {
                c = i;
                acc = run;
                found = true;
            }
            run += hist[i];
        }
        res[2] = 1u32;
        if !found {
            // Short by rounding, or the whole set is short: the set's last tie chunk.
            c = last;
            acc = before_last;
            res[2] = 0u32;
        }
        let lo = c * chunk;
        let mut hi = lo + chunk;
        if hi > vocab {
            hi = vocab;
        }
        let mut id = vocab;
        let mut last_tie = lo;
        let mut k = lo;
        while k < hi {
            let x = f32::cast_from(logits[base + k * cs]);
            let key = order_key(x);
            if key == key_at && in_prefix(key, k as u32, set_key, set_id) {
                let f = measure(x, max, inv_temp, count);
                if f > 0.0f32 {
                    last_tie = k;
                }
                if id == vocab {
                    acc += f;
                    let mut reaches = acc >= target;
                    if strict {
                        reaches = acc > target;
                    }
                    if reaches {
                        id = k;
                    }
                }
            }
            k += 1;
        }
        if id == vocab {
            id = last_tie;
        }
        res[0] = key_at;
        res[1] = id as u32;
    }
    sync_cube();
}

/// [`crate::sampling::sample_row`]'s rule with top-k, top-p and/or min-p, without a sort: one
/// cube per row finds the top-k prefix of the order (descending logit, ties by id) by its count,
/// the top-p prefix of that by its weight, the min-p prefix of that by the count of its ids at
/// least `min_p` times as likely as the most likely one, and the draw's token by the weight of
/// the kept prefix before it, each with [`prefix_search`] (nine reads of the row), so the token
/// is the host rule's up to f32 rounding of the sums. `top_k` 0 is none; `top_p` 1 is none;
/// `min_p` 0 is none.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn sample_restricted_kernel<F: Float, I: Numeric>(
    logits: &Tensor<F>,
    uniforms: &Tensor<f32>,
    tokens: &mut Tensor<I>,
    logp: &mut Tensor<f32>,
    inv_temp: f32,
    top_k: u32,
    top_p: f32,
    min_p: f32,
    #[comptime] block: u32,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let step = block as usize;
    #[rustfmt::skip]
    let RowStart { row, unit, len: vocab, base, cs } = row_start(logits);
    let mut hist = SharedMemory::<f32>::new(CANDIDATES * step);
    let mut red = SharedMemory::<f32>::new(step);
    let mut res = SharedMemory::<u32>::new(3usize);

    // The row's maximum.
    let mut m = f32::cast_from(F::min_value());
    let mut v = unit;
    while v < vocab {
        let x = f32::cast_from(logits[base + v * cs]);
        if x > m {
            m = x;
        }
        v += step;
    }
    red[unit] = m;
    sync_cube();
    let mut half = (CUBE_DIM_X / 2) as usize;
    while half > 0 {
        if unit < half {
            let other = red[unit + half];
            if other > red[unit] {
                red[unit] = other;
            }
        }
        sync_cube();
        half /= 2;
    }
    let max = red[0];
    sync_cube();

    // Top-k: the first `top_k` ids of the order.
    let all_id = vocab as u32;
    let mut k_key = 0u32;
    let mut k_id = all_id;
    if top_k > 0u32 && (top_k as usize) < vocab {
        prefix_search(
            logits,
            base,
            max,
            inv_temp,
            0u32,
            all_id,
            f32::cast_from(top_k),
            &mut hist,
            &mut red,
            &mut res,
            block,
            true,
            false,
        );
        k_key = res[0];
        k_id = res[1];
        sync_cube();
    }
    let k_total = prefix_sum(
        logits, base, max, inv_temp, k_key, k_id, &mut red, block, false,
    );

    // Top-p: the shortest prefix of those whose share reaches `top_p`.
    let mut p_key = k_key;
    let mut p_id = k_id;
    let mut kept = k_total;
    if top_p < 1.0f32 {
        prefix_search(
            logits,
            base,
            max,
            inv_temp,
            k_key,
            k_id,
            top_p * k_total,
            &mut hist,
            &mut red,
            &mut res,
            block,
            false,
            false,
        );
        let found = res[2];
        let key = res[0];
        let id = res[1];
        sync_cube();
        if found == 1u32 {
            p_key = key;
            p_id = id;
            kept = prefix_sum(
                logits, base, max, inv_temp, p_key, p_id, &mut red, block, false,
            );
        }
    }

    // Min-p: the first ids of those (a prefix of the order) with `(x - max) / T >= ln(min_p)`.
    if min_p > 0.0f32 {
        let n = likely_count(
            logits,
            base,
            max,
            inv_temp,
            p_key,
            p_id,
            min_p.ln(),
            &mut red,
            block,
        );
        if n >= 1.0f32 {
            prefix_search(
                logits, base, max, inv_temp, p_key, p_id, n, &mut hist, &mut red, &mut res, block,
                true, false,
            );
            let found = res[2];
            let key = res[0];
            let id = res[1];
            sync_cube();
            if found == 1u32 {
                p_key = key;
                p_id = id;
                kept = prefix_sum(
                    logits, base, max, inv_temp, p_key, p_id, &mut red, block, false,
                );
            }
        }
    }

    // The draw: the first id of the kept prefix whose running weight passes `u x kept`; past
    // the end (rounding), the prefix's last id.
    let target = uniforms[row * uniforms.stride(0)] * kept;
    prefix_search(
        logits, base, max, inv_temp, p_key, p_id, target, &mut hist, &mut red, &mut res, block,
        false, true,
    );
    let found = res[2];
    let mut tok = res[1];
    sync_cube();
    if found == 0u32 {
        let n = prefix_sum(
            logits, base, max, inv_temp, p_key, p_id, &mut red, block, true,
        );
        prefix_search(
            logits, base, max, inv_temp, p_key, p_id, n, &mut hist, &mut red, &mut res, block,
            true, false,
        );
        tok = res[1];
    }
    if unit == 0 {
        let t = tok as usize;
        tokens[row * tokens.stride(0)] = I::cast_from(tok);
        logp[row * logp.stride(0)] =
            (f32::cast_from(logits[base + t * cs]) - max) * inv_temp - kept.ln();
    }
}

/// Launches the sampling kernel `params` needs over `rows` rows of `vocab` ids: `[logits,
/// uniforms, tokens, logp]`, dtypes `[logits' float, tokens' int]`. The backend and the
/// offline CUDA compile both launch here.
pub(crate) fn launch_sample<R: Runtime>(
    client: &ComputeClient<R>,
    [rows, vocab]: [usize; 2],
    [logits, uniforms, tokens, logp]: [TensorArg<R>; 4],
    params: &Decoding,
    dtypes: [StorageType; 2],
) {
    let block = crate::cube::row_block(&client.properties().hardware);
    let inv_temp = if params.is_greedy() {
        1.0
    } else {
        (1.0 / params.params().temperature) as f32
    };
    let count = CubeCount::Static(rows as u32, 1, 1);
    // A restricted draw (top-k, top-p or min-p) takes `sample_restricted_kernel`.
    if crate::sampling::restricted(params, vocab) {
        let top_k = params.params().top_k.filter(|&k| k < vocab).unwrap_or(0) as u32;
        sample_restricted_kernel::launch::<R>(
            client,
            count,
            CubeDim::new_1d(block),
            logits,
            uniforms,
            tokens,
            logp,
            inv_temp,
            top_k,
            params.params().top_p.min(1.0) as f32,
            params.params().min_p as f32,
            block,
            dtypes,
        );
        return;
    }
    sample_kernel::launch::<R>(
        client,
        count,
        CubeDim::new_1d(block),
        logits,
        uniforms,
        tokens,
        logp,
        inv_temp,
        block,
        params.is_greedy(),
        dtypes,
    );
}

/// `sample_rows` on a CubeCL backend with the draws already on the device (`uniforms` `[rows]`
/// f32), by [`launch_sample`].
pub(crate) fn sample_rows_on<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    logits: CubeTensor<R>,
    uniforms: CubeTensor<R>,
    params: &Decoding,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let [rows, vocab] = logits.shape().dims::<2>();
    if rows == 0 {
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
    launch_sample(&client, [rows, vocab], args, params, dtypes);
    (tokens, logp)
}

/// The rows' draws as an f32 tensor `[rows]` on `logits`' device (zeros when greedy: unread).
pub(crate) fn uniforms_tensor<B: burn::tensor::backend::Backend>(
    rows: usize,
    params: &Decoding,
    uniforms: &[f64],
    device: &B::Device,
) -> FloatTensor<B> {
    let u: Vec<f32> = if params.is_greedy() {
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
    fn device_memory_reserved(device: &Self::Device) -> Option<u64> {
        crate::cube_memory_usage::<R>(device).map(|(_, reserved)| reserved)
    }

    fn compiles_kernels() -> bool {
        true
    }

    fn sample_rows(
        logits: FloatTensor<Self>,
        params: &Decoding,
        uniforms: &[f64],
    ) -> (IntTensor<Self>, FloatTensor<Self>) {
        let rows = logits.shape().dims::<2>()[0];
        if rows == 0 {
            return crate::sampling::sample_rows_by_tensor_ops::<Self>(logits, params, uniforms);
        }
        let u = uniforms_tensor::<Self>(rows, params, uniforms, &logits.device);
        sample_rows_on::<R, F, I, BT>(logits, u, params)
    }

    fn sample_rows_on(
        logits: FloatTensor<Self>,
        uniforms: FloatTensor<Self>,
        params: &Decoding,
    ) -> (IntTensor<Self>, FloatTensor<Self>) {
        sample_rows_on::<R, F, I, BT>(logits, uniforms, params)
    }
}
