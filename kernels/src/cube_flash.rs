//! Causal attention on tensor cores: tiled forward, dQ and dK/dV kernels whose matrix products
//! run as warp-wide 16x16x16 `cmma` (WMMA) tiles with f32 accumulation, chosen by
//! [`AttentionKernels::TensorCore`] for bf16 and f16 inputs (f32 inputs keep the portable
//! kernels of `cube_attention.rs`, so f32 training stays exact to f32).
//!
//! # Geometry
//! A cube owns `rows` rows of its side (queries for the forward and dQ, keys for dK/dV), 16 per
//! warp, and walks the other side `tile` rows at a time. Everything a warp multiplies is staged in
//! shared memory: the operands in the input dtype F, the products in f32. Per staged tile:
//!
//! - forward: `S = Q Kᵀ` (one warp product per warp over its 16 query rows), the online softmax
//!   by one unit per row (the row's max and sum stay in that unit; `P` is written back as F),
//!   the warp's rows of the f32 output accumulator rescaled, then `O += P V`;
//! - dQ: `S = Q Kᵀ` and `dP = dO Vᵀ`, then `dS = P ∘ (dP − δ)` with `P = exp(scale·S − lse)`
//!   recomputed from the forward's `lse`, then `dQ += dS K`; each row's `δ = dO · O` is formed
//!   once and written for the dK/dV kernel;
//! - dK/dV: for each query head of the key/value head's group and each query tile that can see
//!   the cube's keys, `Sᵀ = K Qᵀ`, `dPᵀ = V dOᵀ`, then `dV += Pᵀ dO` and `dK += dSᵀ Q`.
//!
//! Tiles entirely above the diagonal are never staged: the forward and dQ stop at the last key
//! the cube's last row sees, dK/dV starts at the first query row that sees the cube's first key.
//! Inside the diagonal tile the causal mask and padded keys (`key_valid`) zero `P`, as in the
//! portable kernels; the contract (a row that sees no key has `out = 0` and
//! `lse = ATTENTION_MASKED_LSE`, and gets and gives no gradient) is the same.
//!
//! Nothing is shared between cubes, so no atomics: dQ and dK/dV are separate kernels that each
//! recompute `S` (FlashAttention-2's backward fuses them with atomic adds to dQ).
//!
//! # The products without tensor cores
//! Every product goes through [`warp_product`]. With `tensor_cores` it loads WMMA fragments from
//! shared memory, multiplies and stores the f32 result; without, the warp's 32 units compute the
//! same 16x16 result tiles with f32 dot products ([`AttentionKernels::TiledUnits`]). The second
//! form exists so the tiling, masking, online softmax and gradient algebra of these kernels run
//! and are checked on devices with no cooperative matrices (lavapipe in CI); only the
//! fragment loads, stores and `mma` differ on a GPU.
//!
//! # Shared memory
//! Sized by [`Tiles::shared_bytes`] and chosen per kernel by [`tiles`]: the largest of
//! 64x64, 64x32, 32x32, 32x16 and 16x16 (rows x tile) that leaves room for two cubes per SM,
//! else the largest that fits one. CubeCL's CUDA runtime launches with dynamic shared memory
//! and raises the kernel's limit, so these kernels use up to the device's 227 KiB (H100/H200).
//! Each kernel keeps two shared buffers: one of F (the products' operands: the staged rows, `P`,
//! `dS`) and one of f32 (the products' results, the accumulators, the per-row statistics), with
//! every region at a fixed offset that is a multiple of 16 elements, so each WMMA operand starts
//! 32-byte aligned. Two buffers rather than one per region keep the address arithmetic (and the
//! registers it holds) small, and the layout the same from one compile to the next (CubeCL lays
//! out separate shared arrays in hash-map order).

use burn::tensor::{DType, Shape};
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::ir::{DeviceProperties, ElemType, FloatKind, MatrixIdent, MatrixLayout, StorageType};
use cubecl::prelude::*;

use crate::cube_prologue::{
    first_query, key_block, warp_query_row, KeyBlock, QueryRow, WarpQueryRow,
};
use crate::{AttentionKernels, AttentionLayout};

/// An uninitialised tensor on `like`'s device.
pub(crate) fn empty<R: CubeRuntime>(
    like: &CubeTensor<R>,
    shape: Shape,
    dtype: DType,
) -> CubeTensor<R> {
    empty_device_dtype::<R>(like.client.clone(), like.device.clone(), shape, dtype)
}

/// The sizes of one attention call: batch, query and key/value heads, queries, keys, head
/// dimension.
#[derive(Clone, Copy)]
pub(crate) struct Dims {
    pub(crate) b: usize,
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) t: usize,
    pub(crate) s: usize,
    pub(crate) d: usize,
}

/// The masked-score sentinel and the `lse` of a row that sees no key.
const NEG: f32 = crate::ATTENTION_MASKED_LSE;
/// Edge of a WMMA tile (m = n = k = 16 for f16/bf16 inputs).
const EDGE: usize = 16;
/// Units per warp on NVIDIA GPUs (and the units of one warp product in the portable form).
const WARP: usize = 32;
/// Result tiles a warp keeps in accumulator fragments at once, at most (8 f32 registers each).
const GROUP: usize = 4;

/// Result tiles per accumulator group for `tiles` result tiles: the largest count up to
/// [`GROUP`] that divides it, so the groups cover every tile (head_dim 96 has 6: two groups
/// of 3).
fn group_of(tiles: usize) -> usize {
    (1..=GROUP)
        .rev()
        .find(|g| tiles.is_multiple_of(*g))
        .unwrap_or(1)
}

/// `c[c_off..] (+)= a[a_off..] · B` for one warp: `a` holds 16 rows of `depth` values (row
/// stride `lda`), the result is 16 rows of `width` f32 values (row stride `ldc`). `B` is
/// `depth x width`: with `b_transposed` its column `n` is row `n` of `b` (`B[k][n] = b[b_off +
/// n·ldb + k]`, a K or V tile read as its transpose), else `B[k][n] = b[b_off + k·ldb + n]`.
/// Every unit of the warp calls it with its `lane`; the warp's control flow must be uniform.
#[cube]
#[allow(clippy::too_many_arguments)]
fn warp_product<F: Float>(
    a: &SharedMemory<F>,
    a_off: usize,
    #[comptime] lda: usize,
    b: &SharedMemory<F>,
    b_off: usize,
    #[comptime] ldb: usize,
    c: &mut SharedMemory<f32>,
    c_off: usize,
    #[comptime] ldc: usize,
    lane: usize,
    #[comptime] depth: usize,
    #[comptime] width: usize,
    #[comptime] b_transposed: bool,
    #[comptime] accumulate: bool,
    #[comptime] tensor_cores: bool,
) {
    if tensor_cores {
        // Up to GROUP result tiles at a time stay in accumulator fragments while the A fragment
        // of each k step is loaded once for all of them.
        let group = comptime!(group_of(width / EDGE));
        for g in 0..comptime!(width / (EDGE * group)) {
            let mut accs = Sequence::<cmma::Matrix<f32>>::new();
            #[unroll]
            for n in 0..group {
                let c_at = c_off + (g * group + n) * EDGE;
                let acc = unsafe {
                    cmma::Matrix::<f32>::uninitialized(
                        MatrixIdent::Accumulator,
                        EDGE,
                        EDGE,
                        EDGE,
                        MatrixLayout::Undefined,
                    )
                };
                if accumulate {
                    cmma::load_with_layout(
                        &acc,
                        &c.slice(c_at, c_at + comptime!(15 * ldc + EDGE)),
                        comptime!(ldc as u32),
                        MatrixLayout::RowMajor,
                    );
                } else {
                    cmma::fill(&acc, f32::new(0.0));
                }
                accs.push(acc);
            }
            for kk in 0..comptime!(depth / EDGE) {
                let a_at = a_off + kk * EDGE;
                let fa = unsafe {
                    cmma::Matrix::<F>::uninitialized(
                        MatrixIdent::A,
                        EDGE,
                        EDGE,
                        EDGE,
                        MatrixLayout::RowMajor,
                    )
                };
                cmma::load(
                    &fa,
                    &a.slice(a_at, a_at + comptime!(15 * lda + EDGE)),
                    comptime!(lda as u32),
                );
                #[unroll]
                for n in 0..group {
                    let col = (g * group + n) * EDGE;
                    let acc = accs.index(n);
                    if b_transposed {
                        let b_at = b_off + col * ldb + kk * EDGE;
                        let fb = unsafe {
                            cmma::Matrix::<F>::uninitialized(
                                MatrixIdent::B,
                                EDGE,
                                EDGE,
                                EDGE,
                                MatrixLayout::ColMajor,
                            )
                        };
                        cmma::load(
                            &fb,
                            &b.slice(b_at, b_at + comptime!(15 * ldb + EDGE)),
                            comptime!(ldb as u32),
                        );
                        cmma::execute::<F, F, f32, f32>(&fa, &fb, acc, acc);
                    } else {
                        let b_at = b_off + kk * EDGE * ldb + col;
                        let fb = unsafe {
                            cmma::Matrix::<F>::uninitialized(
                                MatrixIdent::B,
                                EDGE,
                                EDGE,
                                EDGE,
                                MatrixLayout::RowMajor,
                            )
                        };
                        cmma::load(
                            &fb,
                            &b.slice(b_at, b_at + comptime!(15 * ldb + EDGE)),
                            comptime!(ldb as u32),
                        );
                        cmma::execute::<F, F, f32, f32>(&fa, &fb, acc, acc);
                    }
                }
            }
            #[unroll]
            for n in 0..group {
                let c_at = c_off + (g * group + n) * EDGE;
                cmma::store(
                    &mut c.slice_mut(c_at, c_at + comptime!(15 * ldc + EDGE)),
                    accs.index(n),
                    comptime!(ldc as u32),
                    MatrixLayout::RowMajor,
                );
            }
        }
    } else {
        // Unit `lane` computes entries lane, lane + 32, ... of each 16x16 result tile.
        for n in 0..comptime!(width / EDGE) {
            for e in 0..comptime!(EDGE * EDGE / WARP) {
                let idx = lane + e * WARP;
                let r = idx / EDGE;
                let col = n * EDGE + idx % EDGE;
                let mut sum = f32::new(0.0);
                for kk in 0..depth {
                    let av = f32::cast_from(a[a_off + r * lda + kk]);
                    let bv = if b_transposed {
                        f32::cast_from(b[b_off + col * ldb + kk])
                    } else {
                        f32::cast_from(b[b_off + kk * ldb + col])
                    };
                    sum += av * bv;
                }
                let at = c_off + r * ldc + col;
                if accumulate {
                    c[at] += sum;
                } else {
                    c[at] = sum;
                }
            }
        }
    }
}

/// Rows `row0..row0 + count` of head `head` of batch row `bi` of `x` (`[b, heads, n, head_dim]`,
/// any strides) into `dst[at..]` as F, rows at or past `end` as zeros. All units take part.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_rows<F: Float>(
    x: &Tensor<F>,
    dst: &mut SharedMemory<F>,
    at: usize,
    bi: usize,
    head: usize,
    row0: usize,
    end: usize,
    #[comptime] count: usize,
    #[comptime] head_dim: usize,
) {
    let base = bi * x.stride(0) + head * x.stride(1);
    let s2 = x.stride(2);
    let s3 = x.stride(3);
    let mut idx = UNIT_POS_X as usize;
    while idx < comptime!(count * head_dim) {
        let row = row0 + idx / head_dim;
        let c = idx % head_dim;
        let mut val = F::cast_from(0.0f32);
        if row < end {
            val = x[base + row * s2 + c * s3];
        }
        dst[at + idx] = val;
        idx += CUBE_DIM_X as usize;
    }
}

/// `len` zeros into `dst[at..]`, all units taking part.
#[cube]
fn zero_f32(dst: &mut SharedMemory<f32>, at: usize, #[comptime] len: usize) {
    let mut idx = UNIT_POS_X as usize;
    while idx < len {
        dst[at + idx] = f32::new(0.0);
        idx += CUBE_DIM_X as usize;
    }
}

/// `key_valid` of keys `j0..j0 + count` of batch row `bi` into `dst[at..]` (0 at or past `end`).
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_valid(
    key_valid: &Tensor<f32>,
    dst: &mut SharedMemory<f32>,
    at: usize,
    bi: usize,
    j0: usize,
    end: usize,
    #[comptime] count: usize,
) {
    let mut jj = UNIT_POS_X as usize;
    while jj < count {
        let j = j0 + jj;
        let mut w = f32::new(0.0);
        if j < end {
            w = key_valid[bi * key_valid.stride(0) + j * key_valid.stride(1)];
        }
        dst[at + jj] = w;
        jj += CUBE_DIM_X as usize;
    }
}

/// Scales warp `warp`'s 16 rows of `head_dim` f32 values at `x[acc..]` by `x[factor + row]`.
#[cube]
fn scale_warp_rows(
    x: &mut SharedMemory<f32>,
    acc: usize,
    factor: usize,
    warp: usize,
    lane: usize,
    #[comptime] head_dim: usize,
) {
    let mut idx = lane;
    while idx < comptime!(EDGE * head_dim) {
        let r = warp * EDGE + idx / head_dim;
        let at = acc + r * head_dim + idx % head_dim;
        x[at] = x[at] * x[factor + r];
        idx += WARP;
    }
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn flash_forward_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    key_valid: &Tensor<f32>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    past: u32,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] rows: usize,
    #[comptime] tile: usize,
    #[comptime] tensor_cores: bool,
    #[define(F)] _dtype: StorageType,
) {
    // Lanes 0..16 of each warp own one row of the softmax.
    #[rustfmt::skip]
    let WarpQueryRow { warp, lane, owner, r, row, .. } = warp_query_row(q, k, past, rows, WARP, EDGE);
    #[rustfmt::skip]
    let QueryRow { h, bi, t, hk, i0, i, row_ok, kend, my_end, .. } = row;

    // F: Q (rows x d), K, V (tile x d), P (rows x tile).
    let q_at = 0usize;
    let k_at = comptime!(rows * head_dim);
    let v_at = comptime!(rows * head_dim + tile * head_dim);
    let p_at = comptime!(rows * head_dim + 2 * tile * head_dim);
    let mut fs = SharedMemory::<F>::new_aligned(
        comptime!(rows * head_dim + 2 * tile * head_dim + rows * tile),
        32usize,
    );
    // f32: S (rows x tile), O (rows x d), the tile's key mask, the rows' factors.
    let s_at = 0usize;
    let o_at = comptime!(rows * tile);
    let ok_at = comptime!(rows * tile + rows * head_dim);
    let f_at = comptime!(rows * tile + rows * head_dim + tile);
    let mut xs = SharedMemory::<f32>::new_aligned(
        comptime!(rows * tile + rows * head_dim + tile + rows),
        32usize,
    );

    stage_rows::<F>(q, &mut fs, q_at, bi, h, i0, t, rows, head_dim);
    zero_f32(&mut xs, o_at, comptime!(rows * head_dim));
    let mut m = f32::new(NEG);
    let mut l = f32::new(0.0);
    let mut j0 = 0usize;
    while j0 < kend {
        stage_rows::<F>(k, &mut fs, k_at, bi, hk, j0, kend, tile, head_dim);
        stage_rows::<F>(v, &mut fs, v_at, bi, hk, j0, kend, tile, head_dim);
        stage_valid(key_valid, &mut xs, ok_at, bi, j0, kend, tile);
        sync_cube();
        // S = Q Kᵀ for the warp's 16 rows.
        warp_product::<F>(
            &fs,
            q_at + warp * EDGE * head_dim,
            head_dim,
            &fs,
            k_at,
            head_dim,
            &mut xs,
            s_at + warp * EDGE * tile,
            tile,
            lane,
            head_dim,
            tile,
            true,
            false,
            tensor_cores,
        );
        sync_cube();
        if owner {
            let mut tmax = f32::new(NEG);
            for jj in 0..tile {
                if row_ok && j0 + jj < my_end && xs[ok_at + jj] > f32::new(0.5) {
                    tmax = f32::max(tmax, xs[s_at + r * tile + jj] * scale);
                }
            }
            let mn = f32::max(m, tmax);
            let alpha = (m - mn).exp();
            let mut sum = f32::new(0.0);
            for jj in 0..tile {
                let mut p = f32::new(0.0);
                if row_ok && j0 + jj < my_end && xs[ok_at + jj] > f32::new(0.5) {
                    p = (xs[s_at + r * tile + jj] * scale - mn).exp();
                }
                sum += p;
                fs[p_at + r * tile + jj] = F::cast_from(p);
            }
            l = l * alpha + sum;
            m = mn;
            xs[f_at + r] = alpha;
        }
        sync_cube();
        scale_warp_rows(&mut xs, o_at, f_at, warp, lane, head_dim);
        sync_cube();
        // O += P V.
        warp_product::<F>(
            &fs,
            p_at + warp * EDGE * tile,
            tile,
            &fs,
            v_at,
            head_dim,
            &mut xs,
            o_at + warp * EDGE * head_dim,
            head_dim,
            lane,
            tile,
            head_dim,
            false,
            true,
            tensor_cores,
        );
        sync_cube();
        j0 += tile;
    }

    if owner {
        let mut inv = f32::new(0.0);
        let mut lv = f32::new(NEG);
        if l > f32::new(0.0) {
            inv = f32::new(1.0) / l;
            lv = m + l.ln();
        }
        xs[f_at + r] = inv;
        if row_ok {
            lse[bi * lse.stride(0) + h * lse.stride(1) + i * lse.stride(2)] = lv;
        }
    }
    sync_cube();
    let ob = bi * out.stride(0) + h * out.stride(1);
    let mut idx = lane;
    while idx < comptime!(EDGE * head_dim) {
        let rr = warp * EDGE + idx / head_dim;
        let c = idx % head_dim;
        let ii = i0 + rr;
        if ii < t {
            out[ob + ii * out.stride(2) + c * out.stride(3)] =
                F::cast_from(xs[o_at + rr * head_dim + c] * xs[f_at + rr]);
        }
        idx += WARP;
    }
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn flash_dq_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    key_valid: &Tensor<f32>,
    out: &Tensor<F>,
    lse: &Tensor<f32>,
    d_out: &Tensor<F>,
    dq: &mut Tensor<F>,
    delta: &mut Tensor<f32>,
    past: u32,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] rows: usize,
    #[comptime] tile: usize,
    #[comptime] tensor_cores: bool,
    #[define(F)] _dtype: StorageType,
) {
    // Lanes 0..16 of each warp own one row of the softmax.
    #[rustfmt::skip]
    let WarpQueryRow { warp, lane, owner, r, row, .. } = warp_query_row(q, k, past, rows, WARP, EDGE);
    #[rustfmt::skip]
    let QueryRow { h, bi, t, hk, i0, i, row_ok, kend, my_end, .. } = row;

    // F: Q, dO (rows x d), K, V (tile x d), dS (rows x tile).
    let q_at = 0usize;
    let g_at = comptime!(rows * head_dim);
    let k_at = comptime!(2 * rows * head_dim);
    let v_at = comptime!(2 * rows * head_dim + tile * head_dim);
    let ds_at = comptime!(2 * rows * head_dim + 2 * tile * head_dim);
    let mut fs = SharedMemory::<F>::new_aligned(
        comptime!(2 * rows * head_dim + 2 * tile * head_dim + rows * tile),
        32usize,
    );
    // f32: S, dP (rows x tile), dQ (rows x d), the tile's key mask.
    let s_at = 0usize;
    let dp_at = comptime!(rows * tile);
    let dq_at = comptime!(2 * rows * tile);
    let ok_at = comptime!(2 * rows * tile + rows * head_dim);
    let mut xs = SharedMemory::<f32>::new_aligned(
        comptime!(2 * rows * tile + rows * head_dim + tile),
        32usize,
    );

    stage_rows::<F>(q, &mut fs, q_at, bi, h, i0, t, rows, head_dim);
    stage_rows::<F>(d_out, &mut fs, g_at, bi, h, i0, t, rows, head_dim);
    zero_f32(&mut xs, dq_at, comptime!(rows * head_dim));
    // δ = dO · O of the unit's row, and its lse.
    let mut dl = f32::new(0.0);
    let mut lr = f32::new(0.0);
    if row_ok {
        let ob = bi * out.stride(0) + h * out.stride(1) + i * out.stride(2);
        let gb = bi * d_out.stride(0) + h * d_out.stride(1) + i * d_out.stride(2);
        for c0 in 0..comptime!(head_dim / 8) {
            #[unroll]
            for u in 0..8 {
                let c = c0 * 8 + u;
                dl += f32::cast_from(d_out[gb + c * d_out.stride(3)])
                    * f32::cast_from(out[ob + c * out.stride(3)]);
            }
        }
        lr = lse[bi * lse.stride(0) + h * lse.stride(1) + i * lse.stride(2)];
        delta[bi * delta.stride(0) + h * delta.stride(1) + i * delta.stride(2)] = dl;
    }

    let rows_at = warp * EDGE * head_dim;
    let prod_at = warp * EDGE * tile;
    let mut j0 = 0usize;
    while j0 < kend {
        stage_rows::<F>(k, &mut fs, k_at, bi, hk, j0, kend, tile, head_dim);
        stage_rows::<F>(v, &mut fs, v_at, bi, hk, j0, kend, tile, head_dim);
        stage_valid(key_valid, &mut xs, ok_at, bi, j0, kend, tile);
        sync_cube();
        // S = Q Kᵀ and dP = dO Vᵀ.
        warp_product::<F>(
            &fs,
            q_at + rows_at,
            head_dim,
            &fs,
            k_at,
            head_dim,
            &mut xs,
            s_at + prod_at,
            tile,
            lane,
            head_dim,
            tile,
            true,
            false,
            tensor_cores,
        );
        warp_product::<F>(
            &fs,
            g_at + rows_at,
            head_dim,
            &fs,
            v_at,
            head_dim,
            &mut xs,
            dp_at + prod_at,
            tile,
            lane,
            head_dim,
            tile,
            true,
            false,
            tensor_cores,
        );
        sync_cube();
        if owner {
            for jj in 0..tile {
                let mut ds = f32::new(0.0);
                if row_ok && j0 + jj < my_end && xs[ok_at + jj] > f32::new(0.5) {
                    let p = (xs[s_at + r * tile + jj] * scale - lr).exp();
                    ds = p * (xs[dp_at + r * tile + jj] - dl);
                }
                fs[ds_at + r * tile + jj] = F::cast_from(ds);
            }
        }
        sync_cube();
        // dQ += dS K (scaled once at the end).
        warp_product::<F>(
            &fs,
            ds_at + prod_at,
            tile,
            &fs,
            k_at,
            head_dim,
            &mut xs,
            dq_at + rows_at,
            head_dim,
            lane,
            tile,
            head_dim,
            false,
            true,
            tensor_cores,
        );
        sync_cube();
        j0 += tile;
    }

    let db = bi * dq.stride(0) + h * dq.stride(1);
    let mut idx = lane;
    while idx < comptime!(EDGE * head_dim) {
        let rr = warp * EDGE + idx / head_dim;
        let c = idx % head_dim;
        let ii = i0 + rr;
        if ii < t {
            dq[db + ii * dq.stride(2) + c * dq.stride(3)] =
                F::cast_from(xs[dq_at + rr * head_dim + c] * scale);
        }
        idx += WARP;
    }
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn flash_dkdv_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    key_valid: &Tensor<f32>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    d_out: &Tensor<F>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    past: u32,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] rows: usize,
    #[comptime] tile: usize,
    #[comptime] tensor_cores: bool,
    #[define(F)] _dtype: StorageType,
) {
    let unit = UNIT_POS_X as usize;
    let warp = unit / WARP;
    let lane = unit % WARP;
    #[rustfmt::skip]
    let KeyBlock { hk, bi, t, s, group, past, j0 } = key_block(q, k, past, rows);
    let owner = lane < EDGE;
    let r = warp * EDGE + lane;
    let j = j0 + r;

    // F: K, V (rows x d), Q, dO (tile x d), Pᵀ, dSᵀ (rows x tile).
    let k_at = 0usize;
    let v_at = comptime!(rows * head_dim);
    let q_at = comptime!(2 * rows * head_dim);
    let g_at = comptime!(2 * rows * head_dim + tile * head_dim);
    let pt_at = comptime!(2 * rows * head_dim + 2 * tile * head_dim);
    let dst_at = comptime!(2 * rows * head_dim + 2 * tile * head_dim + rows * tile);
    let mut fs = SharedMemory::<F>::new_aligned(
        comptime!(2 * rows * head_dim + 2 * tile * head_dim + 2 * rows * tile),
        32usize,
    );
    // f32: Sᵀ, dPᵀ (rows x tile), dK, dV (rows x d), lse and δ of the tile's queries.
    let s_at = 0usize;
    let dp_at = comptime!(rows * tile);
    let dk_at = comptime!(2 * rows * tile);
    let dv_at = comptime!(2 * rows * tile + rows * head_dim);
    let l_at = comptime!(2 * rows * tile + 2 * rows * head_dim);
    let d_at = comptime!(2 * rows * tile + 2 * rows * head_dim + tile);
    let mut xs = SharedMemory::<f32>::new_aligned(
        comptime!(2 * rows * tile + 2 * rows * head_dim + 2 * tile),
        32usize,
    );

    stage_rows::<F>(k, &mut fs, k_at, bi, hk, j0, s, rows, head_dim);
    stage_rows::<F>(v, &mut fs, v_at, bi, hk, j0, s, rows, head_dim);
    zero_f32(&mut xs, dk_at, comptime!(2 * rows * head_dim));
    let mut key_ok = false;
    if owner && j < s {
        key_ok = key_valid[bi * key_valid.stride(0) + j * key_valid.stride(1)] > f32::new(0.5);
    }
    let i_start = first_query(j0, past);

    let rows_at = warp * EDGE * head_dim;
    let prod_at = warp * EDGE * tile;
    for g in 0..group {
        let h = hk * group + g;
        let lb = bi * lse.stride(0) + h * lse.stride(1);
        let db = bi * delta.stride(0) + h * delta.stride(1);
        let mut it = i_start;
        while it < t {
            stage_rows::<F>(q, &mut fs, q_at, bi, h, it, t, tile, head_dim);
            stage_rows::<F>(d_out, &mut fs, g_at, bi, h, it, t, tile, head_dim);
            let mut ii = unit;
            while ii < tile {
                let i = it + ii;
                let mut lx = f32::new(0.0);
                let mut dx = f32::new(0.0);
                if i < t {
                    lx = lse[lb + i * lse.stride(2)];
                    dx = delta[db + i * delta.stride(2)];
                }
                xs[l_at + ii] = lx;
                xs[d_at + ii] = dx;
                ii += CUBE_DIM_X as usize;
            }
            sync_cube();
            // Sᵀ = K Qᵀ and dPᵀ = V dOᵀ for the warp's 16 keys.
            warp_product::<F>(
                &fs,
                k_at + rows_at,
                head_dim,
                &fs,
                q_at,
                head_dim,
                &mut xs,
                s_at + prod_at,
                tile,
                lane,
                head_dim,
                tile,
                true,
                false,
                tensor_cores,
            );
            warp_product::<F>(
                &fs,
                v_at + rows_at,
                head_dim,
                &fs,
                g_at,
                head_dim,
                &mut xs,
                dp_at + prod_at,
                tile,
                lane,
                head_dim,
                tile,
                true,
                false,
                tensor_cores,
            );
            sync_cube();
            if owner {
                for ii in 0..tile {
                    let i = it + ii;
                    let mut p = f32::new(0.0);
                    let mut dsv = f32::new(0.0);
                    if key_ok && i < t && past + i >= j {
                        p = (xs[s_at + r * tile + ii] * scale - xs[l_at + ii]).exp();
                        dsv = p * (xs[dp_at + r * tile + ii] - xs[d_at + ii]);
                    }
                    fs[pt_at + r * tile + ii] = F::cast_from(p);
                    fs[dst_at + r * tile + ii] = F::cast_from(dsv);
                }
            }
            sync_cube();
            // dV += Pᵀ dO and dK += dSᵀ Q (dK scaled once at the end).
            warp_product::<F>(
                &fs,
                pt_at + prod_at,
                tile,
                &fs,
                g_at,
                head_dim,
                &mut xs,
                dv_at + rows_at,
                head_dim,
                lane,
                tile,
                head_dim,
                false,
                true,
                tensor_cores,
            );
            warp_product::<F>(
                &fs,
                dst_at + prod_at,
                tile,
                &fs,
                q_at,
                head_dim,
                &mut xs,
                dk_at + rows_at,
                head_dim,
                lane,
                tile,
                head_dim,
                false,
                true,
                tensor_cores,
            );
            sync_cube();
            it += tile;
        }
    }

    // The query loop may not run at all (no query sees these keys): the zeroed accumulators
    // must still be visible to every warp before they are read.
    sync_cube();
    let kb = bi * dk.stride(0) + hk * dk.stride(1);
    let vb = bi * dv.stride(0) + hk * dv.stride(1);
    let mut idx = lane;
    while idx < comptime!(EDGE * head_dim) {
        let rr = warp * EDGE + idx / head_dim;
        let c = idx % head_dim;
        let jj = j0 + rr;
        if jj < s {
            dk[kb + jj * dk.stride(2) + c * dk.stride(3)] =
                F::cast_from(xs[dk_at + rr * head_dim + c] * scale);
            dv[vb + jj * dv.stride(2) + c * dv.stride(3)] =
                F::cast_from(xs[dv_at + rr * head_dim + c]);
        }
        idx += WARP;
    }
}

/// One kernel's tiling: rows per cube (16 per warp) and rows of the other side per staged tile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tiles {
    /// Rows of the cube's own side (queries for the forward and dQ, keys for dK/dV).
    pub rows: usize,
    /// Rows of the other side staged at a time.
    pub tile: usize,
}

/// Which of the three tiled kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlashKernel {
    /// [`flash_forward_kernel`].
    Forward,
    /// [`flash_dq_kernel`].
    Dq,
    /// [`flash_dkdv_kernel`].
    Dkdv,
}

impl Tiles {
    /// Units per cube: one warp per 16 rows.
    pub fn units(self) -> usize {
        self.rows / EDGE * WARP
    }

    /// Shared memory of `kernel` at this tiling, bytes, for inputs of `elem` bytes.
    pub fn shared_bytes(self, kernel: FlashKernel, head_dim: usize, elem: usize) -> usize {
        let Self { rows, tile } = self;
        let (own, other, products) = (rows * head_dim, tile * head_dim, rows * tile);
        match kernel {
            // Q, K, V, P (F); S, O (f32); the tile's mask and the rows' factors.
            Forward => {
                (own + 2 * other + products) * elem + (products + own) * 4 + (tile + rows) * 4
            }
            // Q, dO, K, V, dS (F); S, dP, dQ (f32); the mask.
            Dq => (2 * own + 2 * other + products) * elem + (2 * products + own) * 4 + tile * 4,
            // K, V, Q, dO, Pᵀ, dSᵀ (F); Sᵀ, dPᵀ, dK, dV (f32); lse and δ of the tile.
            Dkdv => {
                (2 * own + 2 * other + 2 * products) * elem
                    + (2 * products + 2 * own) * 4
                    + 2 * tile * 4
            }
        }
    }
}

use FlashKernel::{Dkdv, Dq, Forward};

/// The tilings tried, largest first.
const CANDIDATES: [Tiles; 5] = [
    Tiles { rows: 64, tile: 64 },
    Tiles { rows: 64, tile: 32 },
    Tiles { rows: 32, tile: 32 },
    Tiles { rows: 32, tile: 16 },
    Tiles { rows: 16, tile: 16 },
];

/// The tiling of `kernel` on a device with `max_shared` bytes of shared memory per cube and
/// `max_units` units: the largest candidate that leaves room for two cubes per SM (1 KiB of
/// each block's shared memory is the system's), else the largest that fits one; `None` when
/// none fits.
pub fn tiles(
    kernel: FlashKernel,
    head_dim: usize,
    elem: usize,
    max_shared: usize,
    max_units: usize,
) -> Option<Tiles> {
    let fits = |c: &Tiles, budget: usize| {
        c.units() <= max_units && c.shared_bytes(kernel, head_dim, elem) <= budget
    };
    let half = (max_shared / 2).saturating_sub(1024);
    CANDIDATES
        .iter()
        .find(|c| fits(c, half))
        .or_else(|| CANDIDATES.iter().find(|c| fits(c, max_shared)))
        .copied()
}

/// Whether the device runs these kernels' 16x16x16 WMMA tiles of `dtype` (bf16 or f16) inputs
/// with f32 accumulation: the cooperative-matrix shape in its features, 32-lane warps (the
/// kernels map units to warps as `unit / 32`), and for bf16 an sm_80-class device (CubeCL lists
/// bf16 WMMA from sm_70, where NVRTC rejects it; its TF32 16x16x8 entry starts at sm_80).
pub fn device_has_cmma(props: &DeviceProperties, dtype: DType) -> bool {
    let kind = match dtype {
        DType::BF16 => FloatKind::BF16,
        DType::F16 => FloatKind::F16,
        _ => return false,
    };
    let has = |input: FloatKind, (m, n, k): (u32, u32, u32)| {
        let input: StorageType = ElemType::Float(input).into();
        let acc: StorageType = ElemType::Float(FloatKind::F32).into();
        props.features.matmul.cmma.iter().any(|c| {
            c.a_type == input
                && c.b_type == input
                && c.cd_type == acc
                && (c.m, c.n, c.k) == (m, n, k)
        })
    };
    let hw = &props.hardware;
    let warp32 = hw.plane_size_min == WARP as u32 && hw.plane_size_max == WARP as u32;
    let edge = EDGE as u32;
    warp32
        && has(kind, (edge, edge, edge))
        && (kind != FloatKind::BF16 || has(FloatKind::TF32, (16, 16, 8)))
}

/// Whether the tiled kernels take a call in `dtype` at `head_dim` under `kernels`, and with
/// tensor cores or units: `None` for the portable kernels. The tensor-core form needs bf16 or f16
/// inputs on a device with WMMA, a head dimension that is a multiple of 16 and tiles that fit
/// the device's shared memory; otherwise the call runs the portable kernels (f32 attention
/// always does). [`AttentionKernels::TiledUnits`] is only ever asked for on purpose (tests,
/// benches), so a call it cannot take panics, naming why, instead of silently running
/// something else.
pub(crate) fn route(
    props: &DeviceProperties,
    kernels: AttentionKernels,
    dtype: DType,
    head_dim: usize,
) -> Option<bool> {
    let tensor_cores = match kernels {
        AttentionKernels::Portable => return None,
        AttentionKernels::TensorCore => true,
        AttentionKernels::TiledUnits => false,
    };
    let why_not = if !head_dim.is_multiple_of(EDGE) {
        Some(format!("head_dim {head_dim} is not a multiple of {EDGE}"))
    } else if tensor_cores && !device_has_cmma(props, dtype) {
        Some(format!(
            "no 16x16x16 WMMA tiles of {dtype:?} on this device"
        ))
    } else {
        let hw = &props.hardware;
        let units = hw.max_units_per_cube.min(hw.max_cube_dim.0) as usize;
        [Forward, Dq, Dkdv].iter().find_map(|&kernel| {
            let smallest = CANDIDATES[CANDIDATES.len() - 1];
            tiles(
                kernel,
                head_dim,
                dtype.size(),
                hw.max_shared_memory_size,
                units,
            )
            .is_none()
            .then(|| {
                format!(
                    "{kernel:?} at head_dim {head_dim} in {dtype:?} needs {} bytes of shared \
                         memory at the smallest tiling, the device has {}",
                    smallest.shared_bytes(kernel, head_dim, dtype.size()),
                    hw.max_shared_memory_size
                )
            })
        })
    };
    match why_not {
        None => Some(tensor_cores),
        Some(why) if !tensor_cores => panic!("AttentionKernels::TiledUnits: {why}"),
        Some(_) => None,
    }
}

fn tiles_for<R: Runtime>(
    client: &ComputeClient<R>,
    kernel: FlashKernel,
    dims: &Dims,
    dtype: StorageType,
) -> Tiles {
    let hw = &client.properties().hardware;
    tiles(
        kernel,
        dims.d,
        dtype.size(),
        hw.max_shared_memory_size,
        hw.max_units_per_cube.min(hw.max_cube_dim.0) as usize,
    )
    .expect("route() checked that every tiled kernel fits the device")
}

/// `[out, lse]` through [`flash_forward_kernel`] (the caller has validated the shapes).
pub(crate) fn forward<R: CubeRuntime>(
    [q, k, v, key_valid]: [CubeTensor<R>; 4],
    dims: &Dims,
    layout: AttentionLayout,
    tensor_cores: bool,
) -> [CubeTensor<R>; 2] {
    let Dims { b, heads, t, d, .. } = *dims;
    let dtype = q.dtype;
    let out = empty(&q, Shape::new([b, heads, t, d]), dtype);
    let lse = empty(&q, Shape::new([b, heads, t]), DType::F32);
    if b * heads * t == 0 {
        return [out, lse];
    }
    let client = q.client.clone();
    let args = [
        q.into_tensor_arg(),
        k.into_tensor_arg(),
        v.into_tensor_arg(),
        key_valid.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
    ];
    launch_flash_forward(&client, dims, layout, dtype.into(), tensor_cores, args);
    [out, lse]
}

/// `[dq, dk, dv]` (in `q`'s dtype) through [`flash_dq_kernel`] and [`flash_dkdv_kernel`].
pub(crate) fn backward<R: CubeRuntime>(
    [q, k, v, key_valid, out, lse, d_out]: [CubeTensor<R>; 7],
    dims: &Dims,
    layout: AttentionLayout,
    tensor_cores: bool,
) -> [CubeTensor<R>; 3] {
    let Dims {
        b,
        heads,
        kv_heads,
        t,
        s,
        d,
    } = *dims;
    let dtype = q.dtype;
    let dq = empty(&q, Shape::new([b, heads, t, d]), dtype);
    let dk = empty(&q, Shape::new([b, kv_heads, s, d]), dtype);
    let dv = empty(&q, Shape::new([b, kv_heads, s, d]), dtype);
    let delta = empty(&q, Shape::new([b, heads, t]), DType::F32);
    let client = q.client.clone();
    let storage: StorageType = dtype.into();
    if b * heads * t > 0 {
        let args = [
            q.clone().into_tensor_arg(),
            k.clone().into_tensor_arg(),
            v.clone().into_tensor_arg(),
            key_valid.clone().into_tensor_arg(),
            out.into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            d_out.clone().into_tensor_arg(),
            dq.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
        ];
        launch_flash_dq(&client, dims, layout, storage, tensor_cores, args);
    }
    if b * kv_heads * s > 0 {
        let args = [
            q.into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            key_valid.into_tensor_arg(),
            lse.into_tensor_arg(),
            delta.into_tensor_arg(),
            d_out.into_tensor_arg(),
            dk.clone().into_tensor_arg(),
            dv.clone().into_tensor_arg(),
        ];
        launch_flash_dkdv(&client, dims, layout, storage, tensor_cores, args);
    }
    [dq, dk, dv]
}

/// Launches [`flash_forward_kernel`]: `[q, k, v, key_valid, out, lse]`. The backend and the
/// offline CUDA compile both launch here.
pub(crate) fn launch_flash_forward<R: Runtime>(
    client: &ComputeClient<R>,
    dims: &Dims,
    layout: AttentionLayout,
    dtype: StorageType,
    tensor_cores: bool,
    [q, k, v, key_valid, out, lse]: [TensorArg<R>; 6],
) {
    let tiles = tiles_for(client, Forward, dims, dtype);
    flash_forward_kernel::launch::<R>(
        client,
        CubeCount::Static(
            dims.t.div_ceil(tiles.rows) as u32,
            dims.heads as u32,
            dims.b as u32,
        ),
        CubeDim::new_1d(tiles.units() as u32),
        q,
        k,
        v,
        key_valid,
        out,
        lse,
        layout.past as u32,
        layout.scale as f32,
        dims.d,
        tiles.rows,
        tiles.tile,
        tensor_cores,
        dtype,
    );
}

/// Launches [`flash_dq_kernel`]: `[q, k, v, key_valid, out, lse, d_out, dq, delta]`.
pub(crate) fn launch_flash_dq<R: Runtime>(
    client: &ComputeClient<R>,
    dims: &Dims,
    layout: AttentionLayout,
    dtype: StorageType,
    tensor_cores: bool,
    [q, k, v, key_valid, out, lse, d_out, dq, delta]: [TensorArg<R>; 9],
) {
    let tiles = tiles_for(client, Dq, dims, dtype);
    flash_dq_kernel::launch::<R>(
        client,
        CubeCount::Static(
            dims.t.div_ceil(tiles.rows) as u32,
            dims.heads as u32,
            dims.b as u32,
        ),
        CubeDim::new_1d(tiles.units() as u32),
        q,
        k,
        v,
        key_valid,
        out,
        lse,
        d_out,
        dq,
        delta,
        layout.past as u32,
        layout.scale as f32,
        dims.d,
        tiles.rows,
        tiles.tile,
        tensor_cores,
        dtype,
    );
}

/// Launches [`flash_dkdv_kernel`]: `[q, k, v, key_valid, lse, delta, d_out, dk, dv]`.
pub(crate) fn launch_flash_dkdv<R: Runtime>(
    client: &ComputeClient<R>,
    dims: &Dims,
    layout: AttentionLayout,
    dtype: StorageType,
    tensor_cores: bool,
    [q, k, v, key_valid, lse, delta, d_out, dk, dv]: [TensorArg<R>; 9],
) {
    let tiles = tiles_for(client, Dkdv, dims, dtype);
    flash_dkdv_kernel::launch::<R>(
        client,
        CubeCount::Static(
            dims.s.div_ceil(tiles.rows) as u32,
            dims.kv_heads as u32,
            dims.b as u32,
        ),
        CubeDim::new_1d(tiles.units() as u32),
        q,
        k,
        v,
        key_valid,
        lse,
        delta,
        d_out,
        dk,
        dv,
        layout.past as u32,
        layout.scale as f32,
        dims.d,
        tiles.rows,
        tiles.tile,
        tensor_cores,
        dtype,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accumulator_groups_cover_every_result_tile() {
        // tile widths 16, 32, 64 and head_dim 64, 80, 96, 128, 256 (in 16-column tiles)
        for (tiles, group) in [(1, 1), (2, 2), (4, 4), (5, 1), (6, 3), (8, 4), (16, 4)] {
            assert_eq!(group_of(tiles), group, "{tiles} tiles");
            assert!(tiles.is_multiple_of(group_of(tiles)));
        }
    }

    /// What `cubecl-cuda` registers for sm_90 has the tiles; 64-lane warps or bf16 without
    /// an sm_80-class device do not.
    #[cfg(feature = "cuda-compile")]
    #[test]
    fn tensor_cores_need_wmma_32_lane_warps_and_sm_80_for_bf16() {
        let sm90 = crate::offline::runtime_device_properties(crate::offline::Arch::SM90);
        assert!(device_has_cmma(&sm90, DType::BF16));
        assert!(device_has_cmma(&sm90, DType::F16));
        assert!(!device_has_cmma(&sm90, DType::F32));
        let mut wide = sm90.clone();
        wide.hardware.plane_size_min = 64;
        wide.hardware.plane_size_max = 64;
        assert!(!device_has_cmma(&wide, DType::F16));
        let mut old = sm90.clone();
        let tf32: StorageType = ElemType::Float(FloatKind::TF32).into();
        old.features.matmul.cmma.retain(|c| c.a_type != tf32);
        assert!(!device_has_cmma(&old, DType::BF16));
        assert!(device_has_cmma(&old, DType::F16));
    }

    #[test]
    fn tilings_fit_an_h100_with_two_cubes_where_they_can() {
        let h100 = 227 * 1024;
        // Forward at head_dim 128, bf16: 64x64 is 104.5 KiB, two per SM.
        let f = tiles(Forward, 128, 2, h100, 1024).unwrap();
        assert_eq!(f, Tiles { rows: 64, tile: 64 });
        assert!(f.shared_bytes(Forward, 128, 2) <= h100 / 2 - 1024);
        // dK/dV at 128 needs the smaller tiling for two per SM.
        let kv = tiles(Dkdv, 128, 2, h100, 1024).unwrap();
        assert!(kv.shared_bytes(Dkdv, 128, 2) <= h100 / 2 - 1024, "{kv:?}");
        // head_dim 256 still fits.
        for kernel in [Forward, Dq, Dkdv] {
            assert!(tiles(kernel, 256, 2, h100, 1024).is_some(), "{kernel:?}");
        }
        // Nothing fits 4 KiB.
        assert_eq!(tiles(Forward, 128, 2, 4096, 1024), None);
    }
}
