//! Fused causal attention as CubeCL kernels (FlashAttention-2's algorithm, one source for CUDA,
//! HIP and wgpu), used by `AttentionOps::attention_forward` / `attention_backward` for `CubeBackend`.
//!
//! Three kernels, each one cube per (block of rows, head, batch) with one unit per row, and the
//! tile of the other side staged in shared memory (f32) a block at a time:
//!
//! - forward: units own query rows; K/V tiles of the keys the cube's rows can see are staged, each
//!   unit keeps its scaled query row and an f32 accumulator of `head_dim` values and runs the
//!   online softmax (one rescale per tile), then writes `out` (dtype F) and `lse` (f32);
//! - dQ: the same geometry; each unit also forms `delta = dO · O` for its row (written to a side
//!   tensor for the dK/dV kernel) and accumulates `dq += scale · p (dO·v_j - delta) k_j` over the
//!   keys it sees, with `p = exp(scale q·k_j - lse)` recomputed;
//! - dK/dV: units own key rows of one key/value head; the cube walks the query heads of its group
//!   and the query rows that can see its keys (`past + i >= j`), staging Q / dO tiles with their
//!   `lse` and `delta`, and accumulates `dv += p dO_i`, `dk += scale ds q_i`. Nothing is shared
//!   between cubes, so no atomics are needed.
//!
//! Launch geometry: forward and dQ run `CubeCount(ceil(t / rows), heads, batch)` cubes of `rows`
//! units (64, fewer where the device caps a cube lower); dK/dV runs `CubeCount(ceil(s / rows),
//! kv_heads, batch)`. A staged tile holds `tile` rows, `(2 · tile · head_dim + 2 · tile) · 4`
//! bytes of shared memory sized to the device's limit (at most 48 KiB, at most 64 rows): 63 rows
//! for `head_dim` 64 and 31 for 128 under a 32 KiB limit. `head_dim` is a compile-time value (one
//! kernel per head dimension, any value up to [`MAX_HEAD_DIM`]); the per-row vectors are local
//! f32 arrays of that size.
//!
//! Scores, softmax and accumulation are f32 whatever F is (loads cast to f32, stores cast back).
//! Every tensor, outputs included, is indexed through its strides. Memory outside the kernels is
//! O(t): `out`, `lse` and `delta`.
//!
//! Mesa's lavapipe (22.3, the CI device) silently ends every loop of an invocation once 65,535
//! loop iterations have run in all (gallivm's loop limiter): a kernel that loops `head_dim` times
//! per key gives wrong rows past ~250 keys there. The head-dimension loops are therefore unrolled
//! by 8 (see [`unroll_factor`]): about `4 · head_dim / 8 + 4` iterations per (query, key) pair a
//! unit visits, so lavapipe stays correct up to ~1,800 visible keys per query row (forward, dQ)
//! and ~1,800 (query head, row) pairs per key (dK/dV) at head_dim 128, twice that at 64. GPU
//! drivers have no such limit. On such CPU devices the loops also take their trip count at run
//! time (see [`head_steps`]): unrolled whole, they cost lavapipe minutes of compiling.

use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::kernel::cast;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::ir::HardwareProperties;
use cubecl::prelude::*;

use crate::cube_flash::{empty, Dims};
use crate::cube_prologue::{first_query, key_block, unit_query_row, KeyBlock, QueryRow};
use crate::AttentionLayout;

/// Units (rows) per cube, at most; fewer where the device allows fewer.
const ROWS_PER_CUBE: usize = 64;
/// Rows of a staged tile, at most.
const MAX_TILE: usize = 64;
/// Shared memory a kernel asks for, at most (CUDA's static limit without opt-in).
pub(crate) const MAX_SHARED_BYTES: usize = 48 * 1024;
/// Largest supported head dimension (the local arrays are sized at compile time).
pub const MAX_HEAD_DIM: usize = 256;

/// Masked-key sentinel inside the kernels and the `lse` of a row that sees no key.
const NEG: f32 = crate::ATTENTION_MASKED_LSE;

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn attention_forward_kernel<F: Float>(
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
    #[comptime] unroll: usize,
    #[comptime] runtime_steps: bool,
    #[define(F)] _dtype: StorageType,
) {
    let unit = UNIT_POS_X as usize;
    let steps = head_steps(q.shape(3), head_dim, unroll, runtime_steps);
    // Keys any row of this cube sees end at `kend`; this unit's row sees keys below `my_end`.
    #[rustfmt::skip]
    let QueryRow { h, bi, hk, i, row_ok, kend, my_end, .. } = unit_query_row(q, k, past, unit, rows);

    let qb = bi * q.stride(0) + h * q.stride(1) + i * q.stride(2);
    let qs = q.stride(3);
    let mut qr = Array::<f32>::new(head_dim);
    let mut acc = Array::<f32>::new(head_dim);
    for c0 in 0..steps {
        #[unroll]
        for u in 0..unroll {
            let c = c0 * unroll + u;
            let mut x = f32::new(0.0);
            if row_ok {
                x = f32::cast_from(q[qb + c * qs]) * scale;
            }
            qr[c] = x;
            acc[c] = f32::new(0.0);
        }
    }

    let kb = bi * k.stride(0) + hk * k.stride(1);
    let k2 = k.stride(2);
    let k3 = k.stride(3);
    let vb = bi * v.stride(0) + hk * v.stride(1);
    let v2 = v.stride(2);
    let v3 = v.stride(3);
    let mb = bi * key_valid.stride(0);
    let m1 = key_valid.stride(1);

    let mut ks = SharedMemory::<f32>::new(comptime!(tile * head_dim));
    let mut vs = SharedMemory::<f32>::new(comptime!(tile * head_dim));
    let mut ok = SharedMemory::<f32>::new(tile);
    let mut scores = Array::<f32>::new(tile);

    let mut m = f32::new(NEG);
    let mut l = f32::new(0.0);
    let mut j0 = 0usize;
    while j0 < kend {
        let mut idx = unit;
        while idx < comptime!(tile * head_dim) {
            let j = j0 + idx / head_dim;
            let c = idx % head_dim;
            let mut kx = f32::new(0.0);
            let mut vx = f32::new(0.0);
            if j < kend {
                kx = f32::cast_from(k[kb + j * k2 + c * k3]);
                vx = f32::cast_from(v[vb + j * v2 + c * v3]);
            }
            ks[idx] = kx;
            vs[idx] = vx;
            idx += rows;
        }
        let mut jj = unit;
        while jj < tile {
            let j = j0 + jj;
            let mut w = f32::new(0.0);
            if j < kend {
                w = key_valid[mb + j * m1];
            }
            ok[jj] = w;
            jj += rows;
        }
        sync_cube();

        if row_ok {
            let mut tmax = f32::new(NEG);
            let mut any = false;
            for jj in 0..tile {
                let mut sc = f32::new(NEG);
                if j0 + jj < my_end && ok[jj] > f32::new(0.5) {
                    let mut dot = f32::new(0.0);
                    for c0 in 0..steps {
                        #[unroll]
                        for u in 0..unroll {
                            let c = c0 * unroll + u;
                            dot += qr[c] * ks[jj * head_dim + c];
                        }
                    }
                    sc = dot;
                    tmax = f32::max(tmax, dot);
                    any = true;
                }
                scores[jj] = sc;
            }
            if any {
                let mn = f32::max(m, tmax);
                let alpha = (m - mn).exp();
                l *= alpha;
                for c0 in 0..steps {
                    #[unroll]
                    for u in 0..unroll {
                        let c = c0 * unroll + u;
                        acc[c] = acc[c] * alpha;
                    }
                }
                for jj in 0..tile {
                    if j0 + jj < my_end && ok[jj] > f32::new(0.5) {
                        let p = (scores[jj] - mn).exp();
                        l += p;
                        for c0 in 0..steps {
                            #[unroll]
                            for u in 0..unroll {
                                let c = c0 * unroll + u;
                                acc[c] += p * vs[jj * head_dim + c];
                            }
                        }
                    }
                }
                m = mn;
            }
        }
        sync_cube();
        j0 += tile;
    }

    if row_ok {
        let mut inv = f32::new(0.0);
        let mut lv = f32::new(NEG);
        if l > f32::new(0.0) {
            inv = f32::new(1.0) / l;
            lv = m + l.ln();
        }
        let ob = bi * out.stride(0) + h * out.stride(1) + i * out.stride(2);
        let os = out.stride(3);
        for c0 in 0..steps {
            #[unroll]
            for u in 0..unroll {
                let c = c0 * unroll + u;
                out[ob + c * os] = F::cast_from(acc[c] * inv);
            }
        }
        lse[bi * lse.stride(0) + h * lse.stride(1) + i * lse.stride(2)] = lv;
    }
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn attention_dq_kernel<F: Float>(
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
    #[comptime] unroll: usize,
    #[comptime] runtime_steps: bool,
    #[define(F)] _dtype: StorageType,
) {
    let unit = UNIT_POS_X as usize;
    let steps = head_steps(q.shape(3), head_dim, unroll, runtime_steps);
    #[rustfmt::skip]
    let QueryRow { h, bi, hk, i, row_ok, kend, my_end, .. } = unit_query_row(q, k, past, unit, rows);

    let qb = bi * q.stride(0) + h * q.stride(1) + i * q.stride(2);
    let qs = q.stride(3);
    let ob = bi * out.stride(0) + h * out.stride(1) + i * out.stride(2);
    let os = out.stride(3);
    let gb = bi * d_out.stride(0) + h * d_out.stride(1) + i * d_out.stride(2);
    let gs = d_out.stride(3);
    let mut qr = Array::<f32>::new(head_dim);
    let mut gr = Array::<f32>::new(head_dim);
    let mut acc = Array::<f32>::new(head_dim);
    let mut dl = f32::new(0.0);
    let mut lr = f32::new(0.0);
    for c0 in 0..steps {
        #[unroll]
        for u in 0..unroll {
            let c = c0 * unroll + u;
            let mut x = f32::new(0.0);
            let mut g = f32::new(0.0);
            if row_ok {
                x = f32::cast_from(q[qb + c * qs]) * scale;
                g = f32::cast_from(d_out[gb + c * gs]);
                dl += g * f32::cast_from(out[ob + c * os]);
            }
            qr[c] = x;
            gr[c] = g;
            acc[c] = f32::new(0.0);
        }
    }
    if row_ok {
        lr = lse[bi * lse.stride(0) + h * lse.stride(1) + i * lse.stride(2)];
    }

    let kb = bi * k.stride(0) + hk * k.stride(1);
    let k2 = k.stride(2);
    let k3 = k.stride(3);
    let vb = bi * v.stride(0) + hk * v.stride(1);
    let v2 = v.stride(2);
    let v3 = v.stride(3);
    let mb = bi * key_valid.stride(0);
    let m1 = key_valid.stride(1);

    let mut ks = SharedMemory::<f32>::new(comptime!(tile * head_dim));
    let mut vs = SharedMemory::<f32>::new(comptime!(tile * head_dim));
    let mut ok = SharedMemory::<f32>::new(tile);

    let mut j0 = 0usize;
    while j0 < kend {
        let mut idx = unit;
        while idx < comptime!(tile * head_dim) {
            let j = j0 + idx / head_dim;
            let c = idx % head_dim;
            let mut kx = f32::new(0.0);
            let mut vx = f32::new(0.0);
            if j < kend {
                kx = f32::cast_from(k[kb + j * k2 + c * k3]);
                vx = f32::cast_from(v[vb + j * v2 + c * v3]);
            }
            ks[idx] = kx;
            vs[idx] = vx;
            idx += rows;
        }
        let mut jj = unit;
        while jj < tile {
            let j = j0 + jj;
            let mut w = f32::new(0.0);
            if j < kend {
                w = key_valid[mb + j * m1];
            }
            ok[jj] = w;
            jj += rows;
        }
        sync_cube();

        if row_ok {
            for jj in 0..tile {
                if j0 + jj < my_end && ok[jj] > f32::new(0.5) {
                    let mut s = f32::new(0.0);
                    let mut dp = f32::new(0.0);
                    for c0 in 0..steps {
                        #[unroll]
                        for u in 0..unroll {
                            let c = c0 * unroll + u;
                            s += qr[c] * ks[jj * head_dim + c];
                            dp += gr[c] * vs[jj * head_dim + c];
                        }
                    }
                    let p = (s - lr).exp();
                    let ds = p * (dp - dl);
                    for c0 in 0..steps {
                        #[unroll]
                        for u in 0..unroll {
                            let c = c0 * unroll + u;
                            acc[c] += ds * ks[jj * head_dim + c];
                        }
                    }
                }
            }
        }
        sync_cube();
        j0 += tile;
    }

    if row_ok {
        let db = bi * dq.stride(0) + h * dq.stride(1) + i * dq.stride(2);
        let ds = dq.stride(3);
        for c0 in 0..steps {
            #[unroll]
            for u in 0..unroll {
                let c = c0 * unroll + u;
                dq[db + c * ds] = F::cast_from(acc[c] * scale);
            }
        }
        delta[bi * delta.stride(0) + h * delta.stride(1) + i * delta.stride(2)] = dl;
    }
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn attention_dkdv_kernel<F: Float>(
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
    #[comptime] unroll: usize,
    #[comptime] runtime_steps: bool,
    #[define(F)] _dtype: StorageType,
) {
    let unit = UNIT_POS_X as usize;
    let steps = head_steps(q.shape(3), head_dim, unroll, runtime_steps);
    #[rustfmt::skip]
    let KeyBlock { hk, bi, t, s, group, past, j0 } = key_block(q, k, past, rows);
    let j = j0 + unit;
    let mut key_ok = false;
    if j < s {
        key_ok = key_valid[bi * key_valid.stride(0) + j * key_valid.stride(1)] > f32::new(0.5);
    }

    let kb = bi * k.stride(0) + hk * k.stride(1) + j * k.stride(2);
    let k3 = k.stride(3);
    let vb = bi * v.stride(0) + hk * v.stride(1) + j * v.stride(2);
    let v3 = v.stride(3);
    let mut kr = Array::<f32>::new(head_dim);
    let mut vr = Array::<f32>::new(head_dim);
    let mut dka = Array::<f32>::new(head_dim);
    let mut dva = Array::<f32>::new(head_dim);
    for c0 in 0..steps {
        #[unroll]
        for u in 0..unroll {
            let c = c0 * unroll + u;
            let mut kx = f32::new(0.0);
            let mut vx = f32::new(0.0);
            if key_ok {
                kx = f32::cast_from(k[kb + c * k3]) * scale;
                vx = f32::cast_from(v[vb + c * v3]);
            }
            kr[c] = kx;
            vr[c] = vx;
            dka[c] = f32::new(0.0);
            dva[c] = f32::new(0.0);
        }
    }

    let i_start = first_query(j0, past);

    let mut qs = SharedMemory::<f32>::new(comptime!(tile * head_dim));
    let mut gs = SharedMemory::<f32>::new(comptime!(tile * head_dim));
    let mut ls = SharedMemory::<f32>::new(tile);
    let mut ds_ = SharedMemory::<f32>::new(tile);

    let q2 = q.stride(2);
    let q3 = q.stride(3);
    let g2 = d_out.stride(2);
    let g3 = d_out.stride(3);
    for g in 0..group {
        let h = hk * group + g;
        let qb = bi * q.stride(0) + h * q.stride(1);
        let gb = bi * d_out.stride(0) + h * d_out.stride(1);
        let lb = bi * lse.stride(0) + h * lse.stride(1);
        let l2 = lse.stride(2);
        let db = bi * delta.stride(0) + h * delta.stride(1);
        let d2 = delta.stride(2);
        let mut it = i_start;
        while it < t {
            let mut idx = unit;
            while idx < comptime!(tile * head_dim) {
                let i = it + idx / head_dim;
                let c = idx % head_dim;
                let mut qx = f32::new(0.0);
                let mut gx = f32::new(0.0);
                if i < t {
                    qx = f32::cast_from(q[qb + i * q2 + c * q3]);
                    gx = f32::cast_from(d_out[gb + i * g2 + c * g3]);
                }
                qs[idx] = qx;
                gs[idx] = gx;
                idx += rows;
            }
            let mut ii = unit;
            while ii < tile {
                let i = it + ii;
                let mut lx = f32::new(0.0);
                let mut dx = f32::new(0.0);
                if i < t {
                    lx = lse[lb + i * l2];
                    dx = delta[db + i * d2];
                }
                ls[ii] = lx;
                ds_[ii] = dx;
                ii += rows;
            }
            sync_cube();

            if key_ok {
                for ii in 0..tile {
                    let i = it + ii;
                    if i < t && past + i >= j {
                        let mut sc = f32::new(0.0);
                        let mut dp = f32::new(0.0);
                        for c0 in 0..steps {
                            #[unroll]
                            for u in 0..unroll {
                                let c = c0 * unroll + u;
                                sc += kr[c] * qs[ii * head_dim + c];
                                dp += vr[c] * gs[ii * head_dim + c];
                            }
                        }
                        let p = (sc - ls[ii]).exp();
                        let dsc = p * (dp - ds_[ii]);
                        for c0 in 0..steps {
                            #[unroll]
                            for u in 0..unroll {
                                let c = c0 * unroll + u;
                                dva[c] += p * gs[ii * head_dim + c];
                                dka[c] += dsc * qs[ii * head_dim + c];
                            }
                        }
                    }
                }
            }
            sync_cube();
            it += tile;
        }
    }

    if j < s {
        let kob = bi * dk.stride(0) + hk * dk.stride(1) + j * dk.stride(2);
        let ko3 = dk.stride(3);
        let vob = bi * dv.stride(0) + hk * dv.stride(1) + j * dv.stride(2);
        let vo3 = dv.stride(3);
        for c0 in 0..steps {
            #[unroll]
            for u in 0..unroll {
                let c = c0 * unroll + u;
                dk[kob + c * ko3] = F::cast_from(dka[c] * scale);
                dv[vob + c * vo3] = F::cast_from(dva[c]);
            }
        }
    }
}

/// Units per cube and tile rows for `head_dim` on a device: shared memory holds two
/// `tile x head_dim` f32 tiles and two `tile` f32 vectors.
pub(crate) fn geometry(hw: &HardwareProperties, head_dim: usize) -> (usize, usize) {
    let mut rows = ROWS_PER_CUBE;
    while rows > 1 && (rows as u32 > hw.max_cube_dim.0 || rows as u32 > hw.max_units_per_cube) {
        rows /= 2;
    }
    let budget = hw.max_shared_memory_size.clamp(4 * 1024, MAX_SHARED_BYTES);
    let tile = (budget / (4 * (2 * head_dim + 2))).clamp(1, MAX_TILE);
    (rows, tile)
}

/// The head-dimension loops run `head_dim / unroll` times over an unrolled body of `unroll`
/// steps: fewer loop iterations (Mesa's lavapipe, the CI device, ends every loop of an invocation
/// once 65,535 iterations have run in all) without the compile time of a full unroll.
pub(crate) fn unroll_factor(head_dim: usize) -> usize {
    [8, 4, 2, 1]
        .into_iter()
        .find(|u| head_dim.is_multiple_of(*u))
        .unwrap_or(1)
}

/// Trip count of the head-dimension loops, `head_dim / unroll`: a compile-time constant, or where
/// `runtime_steps` the same number computed from `dim` (the tensors' head dimension) at run time.
///
/// A constant trip count lets the device compiler unroll the loops whole and keep the per-row
/// vectors in registers, which GPUs want. Mesa's llvmpipe (lavapipe) unrolls them too, turns each
/// vector into `head_dim` scalars, and runs every invocation of a cube with barriers as an LLVM
/// coroutine, whose frame-building pass then takes minutes over the scalars that live across each
/// `sync_cube` (the three kernels at head_dim 128 took 143 s to compile on a CI CPU, 2.5 s with
/// a run-time count).
#[cube]
fn head_steps(
    dim: usize,
    #[comptime] head_dim: usize,
    #[comptime] unroll: usize,
    #[comptime] runtime_steps: bool,
) -> usize {
    if comptime!(runtime_steps) {
        dim / unroll
    } else {
        comptime!(head_dim / unroll).runtime()
    }
}

/// Whether the head-dimension loops take their trip count at run time (see [`head_steps`]): on
/// devices whose kernels compile through a CPU JIT. cubecl reports no device type; its wgpu
/// runtime withholds plane operations from CPU adapters alone, and CUDA and HIP always have them,
/// so a device without plane operations (or one that says it is a CPU) is taken for one. A GPU
/// without subgroups pays a slower loop and gets the same results.
pub(crate) fn runtime_steps<R: Runtime>(client: &ComputeClient<R>) -> bool {
    let props = client.properties();
    props.hardware.num_cpu_cores.is_some()
        || !props
            .features
            .plane
            .contains(cubecl::ir::features::Plane::Ops)
}

pub(crate) fn to_dtype<R: CubeRuntime>(t: CubeTensor<R>, dtype: DType) -> CubeTensor<R> {
    if t.dtype == dtype {
        t
    } else {
        cast(t, dtype)
    }
}

fn dims<R: CubeRuntime>(
    q: &CubeTensor<R>,
    k: &CubeTensor<R>,
    v: &CubeTensor<R>,
    key_valid: &CubeTensor<R>,
    layout: AttentionLayout,
) -> Dims {
    let [b, heads, t, d] = q.shape().dims::<4>();
    let [bk, kv_heads, s, dk] = k.shape().dims::<4>();
    assert!(
        bk == b && dk == d && v.shape().dims::<4>() == [b, kv_heads, s, d],
        "attention: q {:?}, k {:?}, v {:?}",
        q.shape(),
        k.shape(),
        v.shape()
    );
    assert!(
        kv_heads > 0 && heads % kv_heads == 0,
        "attention: {heads} query heads are not a multiple of {kv_heads} key/value heads"
    );
    assert!(
        layout.past + t <= s,
        "attention: {t} queries after {} past keys need at least that many keys, got {s}",
        layout.past
    );
    assert_eq!(
        key_valid.shape().dims::<2>(),
        [b, s],
        "attention: key_valid must be [batch, keys]"
    );
    assert!(
        (1..=MAX_HEAD_DIM).contains(&d),
        "attention: head_dim {d} outside 1..={MAX_HEAD_DIM}"
    );
    Dims {
        b,
        heads,
        kv_heads,
        t,
        s,
        d,
    }
}

/// `[out, lse]` of causal attention (see `AttentionOps::attention_forward`).
pub(crate) fn forward<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    key_valid: CubeTensor<R>,
    layout: AttentionLayout,
) -> [CubeTensor<R>; 2] {
    let dims = dims(&q, &k, &v, &key_valid, layout);
    let Dims { b, heads, t, d, .. } = dims;
    let dtype = q.dtype;
    let (k, v, key_valid) = (
        to_dtype(k, dtype),
        to_dtype(v, dtype),
        to_dtype(key_valid, DType::F32),
    );
    if let Some(tensor_cores) =
        crate::cube_flash::route(q.client.properties(), layout.kernels, dtype, d)
    {
        return crate::cube_flash::forward([q, k, v, key_valid], &dims, layout, tensor_cores);
    }
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
    launch_forward(&client, &dims, layout, dtype.into(), args);
    [out, lse]
}

/// `[dq, dk, dv]` of causal attention (see `AttentionOps::attention_backward`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    key_valid: CubeTensor<R>,
    out: CubeTensor<R>,
    lse: CubeTensor<R>,
    d_out: CubeTensor<R>,
    layout: AttentionLayout,
) -> [CubeTensor<R>; 3] {
    let dims = dims(&q, &k, &v, &key_valid, layout);
    let Dims {
        b,
        heads,
        kv_heads,
        t,
        s,
        d,
    } = dims;
    assert_eq!(
        out.shape().dims::<4>(),
        [b, heads, t, d],
        "attention_backward: out must have q's shape"
    );
    assert_eq!(
        d_out.shape().dims::<4>(),
        [b, heads, t, d],
        "attention_backward: d_out must have q's shape"
    );
    assert_eq!(
        lse.shape().dims::<3>(),
        [b, heads, t],
        "attention_backward: lse must be [batch, heads, t]"
    );
    let dtype = q.dtype;
    let (k_dtype, v_dtype) = (k.dtype, v.dtype);
    let (k, v) = (to_dtype(k, dtype), to_dtype(v, dtype));
    let (out, d_out) = (to_dtype(out, dtype), to_dtype(d_out, dtype));
    let (key_valid, lse) = (to_dtype(key_valid, DType::F32), to_dtype(lse, DType::F32));
    if let Some(tensor_cores) =
        crate::cube_flash::route(q.client.properties(), layout.kernels, dtype, d)
    {
        let [dq, dk, dv] = crate::cube_flash::backward(
            [q, k, v, key_valid, out, lse, d_out],
            &dims,
            layout,
            tensor_cores,
        );
        return [dq, to_dtype(dk, k_dtype), to_dtype(dv, v_dtype)];
    }
    let dq = empty(&q, Shape::new([b, heads, t, d]), dtype);
    let dk = empty(&q, Shape::new([b, kv_heads, s, d]), dtype);
    let dv = empty(&q, Shape::new([b, kv_heads, s, d]), dtype);
    let delta = empty(&q, Shape::new([b, heads, t]), DType::F32);
    let client = q.client.clone();
    let dtype = dtype.into();
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
        launch_dq(&client, &dims, layout, dtype, args);
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
        launch_dkdv(&client, &dims, layout, dtype, args);
    }
    [dq, to_dtype(dk, k_dtype), to_dtype(dv, v_dtype)]
}

/// Launches [`attention_forward_kernel`]: `[q, k, v, key_valid, out, lse]` (`dims.kv_heads` and
/// `dims.s` unused). The backend and the offline CUDA compile both launch here.
pub(crate) fn launch_forward<R: Runtime>(
    client: &ComputeClient<R>,
    dims: &Dims,
    layout: AttentionLayout,
    dtype: StorageType,
    [q, k, v, key_valid, out, lse]: [TensorArg<R>; 6],
) {
    let (rows, tile) = geometry(&client.properties().hardware, dims.d);
    attention_forward_kernel::launch::<R>(
        client,
        CubeCount::Static(
            dims.t.div_ceil(rows) as u32,
            dims.heads as u32,
            dims.b as u32,
        ),
        CubeDim::new_1d(rows as u32),
        q,
        k,
        v,
        key_valid,
        out,
        lse,
        layout.past as u32,
        layout.scale as f32,
        dims.d,
        rows,
        tile,
        unroll_factor(dims.d),
        runtime_steps(client),
        dtype,
    );
}

/// Launches [`attention_dq_kernel`]: `[q, k, v, key_valid, out, lse, d_out, dq, delta]`.
pub(crate) fn launch_dq<R: Runtime>(
    client: &ComputeClient<R>,
    dims: &Dims,
    layout: AttentionLayout,
    dtype: StorageType,
    [q, k, v, key_valid, out, lse, d_out, dq, delta]: [TensorArg<R>; 9],
) {
    let (rows, tile) = geometry(&client.properties().hardware, dims.d);
    attention_dq_kernel::launch::<R>(
        client,
        CubeCount::Static(
            dims.t.div_ceil(rows) as u32,
            dims.heads as u32,
            dims.b as u32,
        ),
        CubeDim::new_1d(rows as u32),
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
        rows,
        tile,
        unroll_factor(dims.d),
        runtime_steps(client),
        dtype,
    );
}

/// Launches [`attention_dkdv_kernel`]: `[q, k, v, key_valid, lse, delta, d_out, dk, dv]`.
pub(crate) fn launch_dkdv<R: Runtime>(
    client: &ComputeClient<R>,
    dims: &Dims,
    layout: AttentionLayout,
    dtype: StorageType,
    [q, k, v, key_valid, lse, delta, d_out, dk, dv]: [TensorArg<R>; 9],
) {
    let (rows, tile) = geometry(&client.properties().hardware, dims.d);
    attention_dkdv_kernel::launch::<R>(
        client,
        CubeCount::Static(
            dims.s.div_ceil(rows) as u32,
            dims.kv_heads as u32,
            dims.b as u32,
        ),
        CubeDim::new_1d(rows as u32),
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
        rows,
        tile,
        unroll_factor(dims.d),
        runtime_steps(client),
        dtype,
    );
}
