//! Decode attention over a paged KV pool: one new query per row against the row's cached keys,
//! read through its block table.
//!
//! The pool is every position of every sequence in fixed-size blocks: `k_pool` and `v_pool` are
//! `[slots, kv_heads * head_dim]` (slot `b * block_size + o` is offset `o` of block `b`), and row
//! `r`'s key `p` sits in slot `tables[r, p / block_size] * block_size + p % block_size`. CubeCL
//! backends read the pool in place with one kernel (`cube_paged`); the portable fallback here
//! gathers each row's keys into a dense `[rows, kv_heads, keys, head_dim]` copy and runs
//! [`AttentionOps::attention_forward`] on it.

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Int, Tensor};

use crate::{float, int, AttentionLayout, AttentionOps};

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
