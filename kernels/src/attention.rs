//! The attention family: [`AttentionOps`], fused causal attention (the public entry point and
//! the portable block-wise implementation) and decode attention over a paged KV pool.
//!
//! The fallback works on blocks of [`QUERY_BLOCK`] query rows: a block's scores are formed only
//! against the keys it can see (causality cuts the key range at the block's last row), turned into
//! probabilities in f32, used, and dropped. Nothing of size `t x s` outlives a block, so the
//! forward keeps `out` and `lse` only, and the backward rebuilds each block's probabilities from
//! `lse` (FlashAttention-2's recomputation at block granularity). Grouped-query attention folds
//! the query heads of one key/value head into the rows of one matrix product, so K and V are never
//! repeated.
//!
//! Paged decode attention is one new query per row against the row's cached keys, read through
//! its block table. The pool is every position of every sequence in fixed-size blocks: `k_pool`
//! and `v_pool` are `[slots, kv_heads * head_dim]` (slot `b * block_size + o` is offset `o` of
//! block `b`), and row `r`'s key `p` sits in slot `tables[r, p / block_size] * block_size + p %
//! block_size`. CubeCL backends read the pool in place with one kernel (`cube_paged`); the
//! portable fallback gathers each row's keys into a dense `[rows, kv_heads, keys, head_dim]` copy
//! and runs [`AttentionOps::attention_forward`] on it.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Tensor};
pub use conrub_settings::AttentionKernelChoice;

use burn::tensor::ops::IntTensor;
use burn::tensor::Int;

use crate::error::KernelError;
use crate::prim::{float, int};

/// Causal attention (training and prefill) and paged decode attention (the rollout engine).
/// Defaults in this file; kernels in `cube_attention.rs` and
/// `cube_paged.rs`; the backward of [`AttentionOps::causal_attention`] in `autodiff.rs`.
pub trait AttentionOps: Backend {
    /// Forward of causal attention: `[out, lse]`. `q` is `[batch, heads, t, head_dim]`, `k` and `v`
    /// are `[batch, kv_heads, s, head_dim]` (`heads` a multiple of `kv_heads`; query head `h` reads
    /// key/value head `h / (heads / kv_heads)`), `key_valid` is `[batch, s]` f32 (1 = the key may
    /// be attended, 0 = padding). Query row `i` sits at key position `layout.past + i` and sees the
    /// valid keys `0..=past + i`. `out` has `q`'s shape and dtype; `lse` is `[batch, heads, t]` f32,
    /// the natural log of the row's softmax denominator over the scaled scores. A row with no
    /// visible key has `out = 0`, `lse = ATTENTION_MASKED_LSE` and gets and gives no gradient.
    /// Inputs may be strided views. Scores, softmax and accumulation are f32 whatever the dtype.
    fn attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_valid: FloatTensor<Self>,
        layout: AttentionLayout,
    ) -> [FloatTensor<Self>; 2] {
        fallback_forward::<Self>(q, k, v, key_valid, layout)
    }

    /// Backward of [`Self::attention_forward`]: `[dq, dk, dv]` (shapes and dtypes of `q`, `k`,
    /// `v`) from the forward's inputs, its `out` and `lse`, and `d_out` (the shape of `out`).
    #[allow(clippy::too_many_arguments)]
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
        fallback_backward::<Self>(q, k, v, key_valid, out, lse, d_out, layout)
    }

    /// Decode attention of one query per row against its keys in a paged KV pool (see
    /// [`paged_decode_attention`] for shapes): `[rows, heads, 1, head_dim]` in `q`'s dtype. The
    /// default gathers each row's keys and runs [`Self::attention_forward`]; CubeCL backends
    /// read the block table in place. Not differentiable.
    fn paged_decode_attention(
        q: FloatTensor<Self>,
        k_pool: FloatTensor<Self>,
        v_pool: FloatTensor<Self>,
        tables: IntTensor<Self>,
        lens: IntTensor<Self>,
        layout: PagedLayout,
    ) -> FloatTensor<Self> {
        fallback_paged_decode::<Self>(q, k_pool, v_pool, tables, lens, layout)
    }

    /// Whether this backend on `device` runs `kernels`: `Err` names what is missing. The default
    /// (CPU backends) has only [`AttentionKernels::Portable`]; CubeCL backends have the tiled
    /// kernels everywhere and the tensor-core ones where the device has cooperative matrices.
    fn check_attention_kernels(
        device: &Self::Device,
        kernels: AttentionKernels,
    ) -> Result<(), KernelError> {
        let _ = device;
        match kernels {
            AttentionKernels::Portable => Ok(()),
            other => Err(KernelError::NoAttentionKernels {
                kernels: other.name(),
                reason: format!(
                    "the {} backend has no `{}` attention kernels (they are CubeCL kernels: cuda or wgpu)",
                    Self::name(device),
                    other.name()
                ),
            }),
        }
    }

    /// Causal attention's output; under autodiff it is differentiable with respect to `q`, `k`, `v`
    /// (only `out` and `lse` are kept for the backward).
    fn causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_valid: FloatTensor<Self>,
        layout: AttentionLayout,
    ) -> FloatTensor<Self> {
        let [out, _lse] = Self::attention_forward(q, k, v, key_valid, layout);
        out
    }
}

/// Query rows per block of the portable implementation. 256 rows of scores against 8k keys for 32
/// heads are 268 MB in f32, against 8.6 GB for the whole `[heads, 8k, 8k]` matrix.
pub const QUERY_BLOCK: usize = 256;

/// The `lse` of a query row that sees no key (a padding row): finite, so nothing downstream
/// turns into NaN.
pub const ATTENTION_MASKED_LSE: f32 = -1.0e30;

/// Where the queries sit among the keys, the score scale, and which kernels run the call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionLayout {
    /// Keys before the first query (a KV cache's length; 0 in training, where `s == t`).
    pub past: usize,
    /// Multiplier of `q · k` (`1 / sqrt(head_dim)` in every family we run).
    pub scale: f64,
    /// The CubeCL kernels a CubeCL backend runs (other backends ignore it).
    pub kernels: AttentionKernels,
}

impl AttentionLayout {
    /// `past` keys before the queries, scores scaled by `scale`, the portable kernels.
    pub fn new(past: usize, scale: f64) -> Self {
        Self {
            past,
            scale,
            kernels: AttentionKernels::Portable,
        }
    }
}

/// Which CubeCL kernels run causal attention (forward and backward) on a CubeCL backend.
///
/// Chosen once per run from the run config's `attention_kernels` by
/// [`AttentionOps::check_attention_kernels`]; CPU backends ignore it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum AttentionKernels {
    /// One unit per row (`cube_attention.rs`): every CubeCL device, every dtype.
    #[default]
    Portable,
    /// The tiled kernels of `cube_flash.rs` with their products on tensor cores (WMMA, f32
    /// accumulation) for bf16 and f16 inputs whose head dimension is a multiple of 16; f32
    /// inputs and other head dimensions keep the portable kernels. Needs cooperative matrices.
    TensorCore,
    /// The same tiled kernels with their products computed by plain units: the tensor-core
    /// kernels' algorithm on any device and dtype (the CI check of that algorithm on lavapipe;
    /// slower than `Portable`, never chosen by a run config).
    TiledUnits,
}

/// Whether a parity run of the tensor-core kernels on a GPU has passed (`scripts/gpu-check.sh`
/// section `parity`). Until one has, `auto` keeps the portable kernels everywhere and the
/// tensor-core ones run only when asked for by name.
pub const TENSOR_CORE_KERNELS_VALIDATED: bool = false;

/// The kernels backend `B` runs on `device` under the run config's `choice`; `Err` names the
/// missing device feature when `tensor-core` cannot run there.
pub fn resolve_attention_kernels<B: AttentionOps>(
    choice: AttentionKernelChoice,
    device: &B::Device,
) -> Result<AttentionKernels, KernelError> {
    match choice {
        AttentionKernelChoice::Portable => Ok(AttentionKernels::Portable),
        AttentionKernelChoice::TensorCore => {
            B::check_attention_kernels(device, AttentionKernels::TensorCore).map_err(|why| {
                KernelError::AttentionChoice {
                    kernels: AttentionKernels::TensorCore.name(),
                    reason: why.to_string(),
                }
            })?;
            Ok(AttentionKernels::TensorCore)
        }
        AttentionKernelChoice::Auto => Ok(
            if TENSOR_CORE_KERNELS_VALIDATED
                && B::check_attention_kernels(device, AttentionKernels::TensorCore).is_ok()
            {
                AttentionKernels::TensorCore
            } else {
                AttentionKernels::Portable
            },
        ),
    }
}

impl AttentionKernels {
    /// The run config's spelling: `portable`, `tensor-core`, `tiled-units`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Portable => "portable",
            Self::TensorCore => "tensor-core",
            Self::TiledUnits => "tiled-units",
        }
    }
}

fn prim<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

/// Causal attention with a key-padding mask: `softmax(scale · q kᵀ + mask) v` per head.
///
/// # Shapes
/// - `q`: `[batch, heads, t, head_dim]`; `k`, `v`: `[batch, kv_heads, s, head_dim]` with
///   `heads % kv_heads == 0` and `s >= t`;
/// - `key_valid`: `[batch, s]`, 1 for keys that may be attended and 0 for padding (any float
///   dtype; converted to f32);
/// - output: `[batch, heads, t, head_dim]` in `q`'s dtype.
///
/// Query row `i` sees the valid keys `0..=layout.past + i`. A row that sees none outputs zeros.
/// Under `Autodiff` the output is differentiable with respect to `q`, `k` and `v`.
pub fn causal_attention<B: AttentionOps>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    key_valid: Tensor<B, 2>,
    layout: AttentionLayout,
) -> Tensor<B, 4> {
    let [b, nh, t, d] = q.dims();
    let [bk, nkv, s, dk] = k.dims();
    assert!(
        bk == b && dk == d && v.dims() == k.dims(),
        "causal_attention: q {:?}, k {:?}, v {:?}",
        q.dims(),
        k.dims(),
        v.dims()
    );
    assert!(
        nkv > 0 && nh % nkv == 0,
        "causal_attention: {nh} query heads are not a multiple of {nkv} key/value heads"
    );
    assert!(
        s >= t && layout.past + t <= s,
        "causal_attention: {t} queries after {} past keys need at least that many keys, got {s}",
        layout.past
    );
    assert_eq!(
        key_valid.dims(),
        [b, s],
        "causal_attention: key_valid must be [batch, keys]"
    );
    let key_valid = key_valid.cast(DType::F32);
    float(B::causal_attention(
        prim(q),
        prim(k),
        prim(v),
        prim(key_valid),
        layout,
    ))
}

/// `[b, 1, 1, rows, keys]` additive f32 bias (0 visible, -1e30 hidden) and `[b, 1, rows]` 0/1 row
/// validity for query rows `i0..i1` against keys `0..s_end`.
fn block_mask<B: Backend>(
    key_valid: &Tensor<B, 2>,
    i0: usize,
    i1: usize,
    s_end: usize,
    past: usize,
) -> (Tensor<B, 5>, Tensor<B, 3>) {
    let [b, _] = key_valid.dims();
    let device = key_valid.device();
    let rows = i1 - i0;
    // causal[r, j] = 1 when key j <= past + i0 + r.
    let qpos =
        Tensor::<B, 1, burn::tensor::Int>::arange((past + i0) as i64..(past + i1) as i64, &device)
            .reshape([rows, 1]);
    let kpos =
        Tensor::<B, 1, burn::tensor::Int>::arange(0..s_end as i64, &device).reshape([1, s_end]);
    let causal = kpos.lower_equal(qpos).float().cast(DType::F32);
    let kv = key_valid
        .clone()
        .slice([0..b, 0..s_end])
        .reshape([b, 1, s_end]);
    let visible = causal.unsqueeze_dim::<3>(0) * kv; // [b, rows, s_end]
    let row_valid = visible.clone().max_dim(2).reshape([b, 1, rows]);
    let bias = (visible - 1.0)
        .mul_scalar(1.0e30)
        .reshape([b, 1, 1, rows, s_end]);
    (bias, row_valid)
}

/// Scaled, masked f32 scores of one query block: `[b, kv, group, rows, s_end]`.
fn block_scores<B: Backend>(
    qb: &Tensor<B, 4>,
    k: &Tensor<B, 4>,
    bias: &Tensor<B, 5>,
    group: usize,
    scale: f64,
) -> Tensor<B, 5> {
    let [b, nh, rows, d] = qb.dims();
    let [_, nkv, s_end, _] = k.dims();
    let _ = nh;
    let qf = qb.clone().reshape([b, nkv, group * rows, d]);
    let scores = qf
        .matmul(k.clone().swap_dims(2, 3))
        .cast(DType::F32)
        .mul_scalar(scale);
    scores.reshape([b, nkv, group, rows, s_end]) + bias.clone()
}

/// One block of query rows `i0..i1` with the keys it can see (`0..s_end`) and its masked f32 scores.
struct QueryBlock<B: Backend> {
    i1: usize,
    rows: usize,
    s_end: usize,
    /// `[b, 1, rows]`: 1 where the row sees at least one key.
    row_valid: Tensor<B, 3>,
    qb: Tensor<B, 4>,
    kb: Tensor<B, 4>,
    vb: Tensor<B, 4>,
    /// `[b, kv, group, rows, s_end]`.
    scores: Tensor<B, 5>,
}

fn query_block<B: Backend>(
    q: &Tensor<B, 4>,
    k: &Tensor<B, 4>,
    v: &Tensor<B, 4>,
    key_valid: &Tensor<B, 2>,
    i0: usize,
    layout: AttentionLayout,
) -> QueryBlock<B> {
    let [b, nh, t, d] = q.dims();
    let nkv = k.dims()[1];
    let i1 = (i0 + QUERY_BLOCK).min(t);
    let s_end = layout.past + i1;
    let (bias, row_valid) = block_mask(key_valid, i0, i1, s_end, layout.past);
    let kb = k.clone().slice([0..b, 0..nkv, 0..s_end, 0..d]);
    let vb = v.clone().slice([0..b, 0..nkv, 0..s_end, 0..d]);
    let qb = q.clone().slice([0..b, 0..nh, i0..i1, 0..d]);
    let scores = block_scores(&qb, &kb, &bias, nh / nkv, layout.scale);
    QueryBlock {
        i1,
        rows: i1 - i0,
        s_end,
        row_valid,
        qb,
        kb,
        vb,
        scores,
    }
}

/// The block-wise forward (see the module docs).
pub fn fallback_forward<B: AttentionOps>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    key_valid: FloatTensor<B>,
    layout: AttentionLayout,
) -> [FloatTensor<B>; 2] {
    let q: Tensor<B, 4> = float(q);
    let k: Tensor<B, 4> = float(k);
    let v: Tensor<B, 4> = float(v);
    let key_valid: Tensor<B, 2> = float::<B, 2>(key_valid).cast(DType::F32);
    let [b, nh, t, d] = q.dims();
    let [_, nkv, _, _] = k.dims();
    let group = nh / nkv;
    let dtype = q.dtype();
    let mut outs = Vec::new();
    let mut lses = Vec::new();
    for i0 in (0..t).step_by(QUERY_BLOCK) {
        let QueryBlock {
            rows,
            s_end,
            row_valid,
            vb,
            scores,
            ..
        } = query_block(&q, &k, &v, &key_valid, i0, layout);
        let m = scores.clone().max_dim(4);
        let e = (scores - m.clone()).exp();
        let l = e.clone().sum_dim(4);
        // Rows that see no key: probabilities 0, lse the masked sentinel.
        let rv = row_valid.reshape([b, 1, 1, rows, 1]);
        let p = (e / l.clone()) * rv.clone();
        let lse =
            (m + l.log()) * rv.clone() + (rv.neg() + 1.0).mul_scalar(ATTENTION_MASKED_LSE as f64);
        let out = p
            .cast(dtype)
            .reshape([b, nkv, group * rows, s_end])
            .matmul(vb)
            .reshape([b, nh, rows, d]);
        outs.push(out);
        lses.push(lse.reshape([b, nh, rows]));
    }
    [prim(Tensor::cat(outs, 2)), prim(Tensor::cat(lses, 2))]
}

/// The block-wise backward: per block, `p = exp(s - lse)`, `dv += pᵀ do`, `ds = p (do vᵀ - D)` with
/// `D = rowsum(do * out)`, `dq = scale ds k`, `dk += scale dsᵀ q`; dk and dv accumulate in f32.
#[allow(clippy::too_many_arguments)]
pub fn fallback_backward<B: AttentionOps>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    key_valid: FloatTensor<B>,
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    d_out: FloatTensor<B>,
    layout: AttentionLayout,
) -> [FloatTensor<B>; 3] {
    let q: Tensor<B, 4> = float(q);
    let k: Tensor<B, 4> = float(k);
    let v: Tensor<B, 4> = float(v);
    let key_valid: Tensor<B, 2> = float::<B, 2>(key_valid).cast(DType::F32);
    let out: Tensor<B, 4> = float(out);
    let lse: Tensor<B, 3> = float::<B, 3>(lse).cast(DType::F32);
    let d_out: Tensor<B, 4> = float(d_out);
    let [b, nh, t, d] = q.dims();
    let [_, nkv, s, _] = k.dims();
    let group = nh / nkv;
    let dtype = q.dtype();
    let device = q.device();
    let delta = (d_out.clone().cast(DType::F32) * out.cast(DType::F32)).sum_dim(3); // [b, nh, t, 1]
    let mut dk = Tensor::<B, 4>::zeros([b, nkv, s, d], &device).cast(DType::F32);
    let mut dv = dk.clone();
    let mut dqs = Vec::new();
    for i0 in (0..t).step_by(QUERY_BLOCK) {
        let QueryBlock {
            i1,
            rows,
            s_end,
            row_valid,
            qb,
            kb,
            vb,
            scores,
            ..
        } = query_block(&q, &k, &v, &key_valid, i0, layout);
        let dob = d_out.clone().slice([0..b, 0..nh, i0..i1, 0..d]);
        let lb = lse
            .clone()
            .slice([0..b, 0..nh, i0..i1])
            .reshape([b, nkv, group, rows, 1]);
        let rv = row_valid.reshape([b, 1, 1, rows, 1]);
        let p = (scores - lb).exp() * rv; // [b, kv, g, rows, s_end], f32
        let p2 = p.clone().reshape([b, nkv, group * rows, s_end]);
        let do2 = dob.reshape([b, nkv, group * rows, d]);
        // dv[:s_end] += pᵀ do (the GQA sum over the group is the sum over the folded rows).
        let dv_part = p2
            .clone()
            .cast(dtype)
            .swap_dims(2, 3)
            .matmul(do2.clone())
            .cast(DType::F32);
        let dp = do2
            .matmul(vb.swap_dims(2, 3))
            .cast(DType::F32)
            .reshape([b, nkv, group, rows, s_end]);
        let db = delta
            .clone()
            .slice([0..b, 0..nh, i0..i1, 0..1])
            .reshape([b, nkv, group, rows, 1]);
        let ds = (p * (dp - db))
            .mul_scalar(layout.scale)
            .reshape([b, nkv, group * rows, s_end])
            .cast(dtype);
        dqs.push(ds.clone().matmul(kb).reshape([b, nh, rows, d]));
        let qf = qb.reshape([b, nkv, group * rows, d]);
        let dk_part = ds.swap_dims(2, 3).matmul(qf).cast(DType::F32);
        let range = [0..b, 0..nkv, 0..s_end, 0..d];
        if s_end == s {
            dk = dk + dk_part;
            dv = dv + dv_part;
        } else {
            dk = dk
                .clone()
                .slice_assign(range.clone(), dk.slice(range.clone()) + dk_part);
            dv = dv
                .clone()
                .slice_assign(range.clone(), dv.slice(range) + dv_part);
        }
    }
    let dq = Tensor::cat(dqs, 2).cast(dtype);
    [prim(dq), prim(dk.cast(dtype)), prim(dv.cast(dtype))]
}

/// Shape of a paged pool and the score scale.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PagedLayout {
    /// Positions per block.
    pub block_size: usize,
    /// Multiplier of `q · k` (`1 / sqrt(head_dim)` in every family we run).
    pub scale: f64,
    /// Splits of each row's keys on CubeCL backends (flash-decoding: each split runs its own
    /// online softmax, a second kernel combines them): 0 lets the backend choose from the
    /// device and the batch (`cube_paged::kv_splits`: only where heads x rows leave the SMs short
    /// of two cubes each), 1 never splits. Other backends
    /// ignore it.
    pub kv_splits: usize,
}

impl PagedLayout {
    /// Blocks of `block_size` positions, scores scaled by `scale`, splits chosen by the backend.
    pub fn new(block_size: usize, scale: f64) -> Self {
        Self {
            block_size,
            scale,
            kv_splits: 0,
        }
    }
}

/// `softmax(scale · q kᵀ) v` of each row's one query against its first `lens[r]` keys in the pool.
///
/// # Shapes
/// - `q`: `[rows, heads, 1, head_dim]` (a strided view is fine);
/// - `k_pool`, `v_pool`: `[slots, kv_heads * head_dim]` with `heads % kv_heads == 0` (query head
///   `h` reads key/value head `h / (heads / kv_heads)`);
/// - `tables`: `[rows, blocks]`, each row's block ids; entries past `ceil(lens[r] / block_size)`
///   are never read, but must name a block of the pool for the fallback's gather (0 is fine);
/// - `lens`: `[rows]`, the keys each row attends to (its cached positions and the new one),
///   at most `blocks * block_size`;
/// - output: `[rows, heads, 1, head_dim]` in `q`'s dtype. A row with `lens[r] == 0` gives zeros.
///
/// Scores, softmax and accumulation are f32 whatever the dtype. No gradient is defined (it is
/// the sampler's attention).
pub fn paged_decode_attention<B: AttentionOps>(
    q: Tensor<B, 4>,
    k_pool: Tensor<B, 2>,
    v_pool: Tensor<B, 2>,
    tables: Tensor<B, 2, Int>,
    lens: Tensor<B, 1, Int>,
    layout: PagedLayout,
) -> Tensor<B, 4> {
    let [rows, heads, t, d] = q.dims();
    let [_, width] = k_pool.dims();
    assert_eq!(t, 1, "paged_decode_attention: one query per row, got {t}");
    assert!(
        d > 0 && width % d == 0 && width > 0,
        "paged_decode_attention: pool width {width} is not a multiple of head_dim {d}"
    );
    assert!(
        heads % (width / d) == 0,
        "paged_decode_attention: {heads} query heads are not a multiple of {} key/value heads",
        width / d
    );
    assert_eq!(
        v_pool.dims(),
        k_pool.dims(),
        "paged_decode_attention: k_pool and v_pool differ"
    );
    assert!(
        tables.dims()[0] == rows && lens.dims() == [rows],
        "paged_decode_attention: tables {:?} and lens {:?} must have {rows} rows",
        tables.dims(),
        lens.dims()
    );
    assert!(
        layout.block_size > 0,
        "paged_decode_attention: block_size 0"
    );
    let out = B::paged_decode_attention(
        q.into_primitive().tensor(),
        k_pool.into_primitive().tensor(),
        v_pool.into_primitive().tensor(),
        tables.into_primitive(),
        lens.into_primitive(),
        layout,
    );
    float(out)
}

/// The portable implementation: gather every row's keys and values to `blocks * block_size`
/// positions, mask those at or past `lens[r]`, and attend with [`AttentionOps::attention_forward`].
pub fn fallback_paged_decode<B: AttentionOps>(
    q: FloatTensor<B>,
    k_pool: FloatTensor<B>,
    v_pool: FloatTensor<B>,
    tables: IntTensor<B>,
    lens: IntTensor<B>,
    layout: PagedLayout,
) -> FloatTensor<B> {
    let q: Tensor<B, 4> = float(q);
    let (k_pool, v_pool): (Tensor<B, 2>, Tensor<B, 2>) = (float(k_pool), float(v_pool));
    let (tables, lens): (Tensor<B, 2, Int>, Tensor<B, 1, Int>) = (int(tables), int(lens));
    let [n, _, _, d] = q.dims();
    let [_, blocks] = tables.dims();
    let nkv = k_pool.dims()[1] / d;
    let bs = layout.block_size;
    let keys = blocks * bs;
    let device = q.device();
    let offsets = Tensor::<B, 1, Int>::arange(0..bs as i64, &device).reshape([1, 1, bs]);
    let slots =
        (tables.reshape([n, blocks, 1]).mul_scalar(bs as i64) + offsets).reshape([n * keys]);
    let positions = Tensor::<B, 1, Int>::arange(0..keys as i64, &device).reshape([1, keys]);
    let valid = positions
        .lower(lens.reshape([n, 1]))
        .float()
        .cast(DType::F32);
    let gather = |pool: Tensor<B, 2>| {
        pool.select(0, slots.clone())
            .reshape([n, keys, nkv, d])
            .swap_dims(1, 2)
            .into_primitive()
            .tensor()
    };
    let [out, _lse] = B::attention_forward(
        q.into_primitive().tensor(),
        gather(k_pool),
        gather(v_pool),
        valid.into_primitive().tensor(),
        AttentionLayout::new(keys.saturating_sub(1), layout.scale),
    );
    out
}
