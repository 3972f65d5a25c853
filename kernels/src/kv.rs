//! Writes into a paged KV cache pool: rows `slots[i]` of a `[slots, width]` tensor take
//! `values[i]`. The ways, chosen per backend in [`crate::DecodeOps::kv_write`]:
//!
//! - [`write_by_scatter`]: one `scatter_nd` (assign) of all rows. CubeCL and libtorch run it as one
//!   kernel; burn-flex copies the whole pool in it, which makes it O(pool) per write.
//! - [`write_by_runs`]: one `slice_assign` per run of consecutive slots (ndarray).
//! - [`write_flex`]: burn-flex, straight into the pool's buffer: O(rows x width) a step.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{IndexingUpdateOp, Int, Tensor, TensorData};

use burn::tensor::backend::Backend;

fn float<B: Backend>(t: FloatTensor<B>) -> Tensor<B, 2> {
    Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(t))
}

fn prim<B: Backend>(t: Tensor<B, 2>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

/// Runs of consecutive slots: `(first slot, first value row, length)`.
pub fn runs(slots: &[u32]) -> Vec<(usize, usize, usize)> {
    let mut out: Vec<(usize, usize, usize)> = Vec::new();
    for (i, &s) in slots.iter().enumerate() {
        match out.last_mut() {
            Some((start, row, len)) if *start + *len == s as usize && *row + *len == i => *len += 1,
            _ => out.push((s as usize, i, 1)),
        }
    }
    out
}

/// One `scatter_nd` of every row.
pub fn write_by_scatter<B: Backend>(
    pool: FloatTensor<B>,
    slots: &[u32],
    values: FloatTensor<B>,
) -> FloatTensor<B> {
    let pool = float::<B>(pool);
    let values = float::<B>(values);
    if slots.is_empty() {
        return prim(pool);
    }
    let device = pool.device();
    let idx: Vec<i64> = slots.iter().map(|&s| s as i64).collect();
    let idx = Tensor::<B, 2, Int>::from_data(TensorData::new(idx, [slots.len(), 1]), &device);
    let dtype = pool.dtype();
    prim(pool.scatter_nd(idx, values.cast(dtype), IndexingUpdateOp::Assign))
}

/// One `slice_assign` per run of consecutive slots.
pub fn write_by_runs<B: Backend>(
    pool: FloatTensor<B>,
    slots: &[u32],
    values: FloatTensor<B>,
) -> FloatTensor<B> {
    let mut pool = float::<B>(pool);
    let values = float::<B>(values).cast(pool.dtype());
    let w = pool.dims()[1];
    for (slot, row, len) in runs(slots) {
        pool = pool.slice_assign(
            [slot..slot + len, 0..w],
            values.clone().slice([row..row + len, 0..w]),
        );
    }
    prim(pool)
}

#[cfg(test)]
mod tests {
    use super::runs;

    #[test]
    fn runs_split_where_slots_or_rows_jump() {
        assert_eq!(
            runs(&[4, 5, 6, 9, 10, 2]),
            vec![(4, 0, 3), (9, 3, 2), (2, 5, 1)]
        );
        assert!(runs(&[]).is_empty());
    }
}

/// burn-flex in place: the rows are copied straight into the pool's buffer, which a decode step
/// owns alone (flex's `slice_assign` and `scatter_nd` both copy the whole pool on every call:
/// `slice_assign` keeps a second reference to its input while it writes). Falls back to
/// [`write_by_runs`] for a pool that is a view.
#[cfg(feature = "flex")]
pub fn write_flex(
    pool: FloatTensor<burn::backend::Flex>,
    slots: &[u32],
    values: FloatTensor<burn::backend::Flex>,
) -> FloatTensor<burn::backend::Flex> {
    use burn::backend::Flex;
    use burn::tensor::{bf16, f16, DType};
    let mut pool = pool;
    let whole = pool.is_contiguous() && pool.layout().start_offset() == 0;
    let values_t = float::<Flex>(values);
    let w = values_t.dims()[1];
    let dtype = pool.dtype();
    if !whole || !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
        return write_by_runs::<Flex>(pool, slots, prim(values_t));
    }
    let src = prim(values_t.cast(dtype)).to_contiguous();
    let offset = src.layout().start_offset();
    macro_rules! copy {
        ($e:ty) => {{
            let s = &src.storage::<$e>()[offset..offset + slots.len() * w];
            // Unique here, so no copy; a shared pool is copied once by `storage_mut`.
            let d = pool.storage_mut::<$e>();
            for (i, &slot) in slots.iter().enumerate() {
                let at = slot as usize * w;
                d[at..at + w].copy_from_slice(&s[i * w..(i + 1) * w]);
            }
        }};
    }
    match dtype {
        DType::F32 => copy!(f32),
        DType::BF16 => copy!(bf16),
        _ => copy!(f16),
    }
    pool
}

#[cfg(all(test, feature = "flex"))]
mod flex_tests {
    use burn::backend::Flex;
    use burn::tensor::{DType, Tensor, TensorData};

    /// The in-place write equals the portable ones, for f32 and bf16 pools.
    #[test]
    fn in_place_writes_equal_the_portable_ones() {
        let dev = Default::default();
        for dtype in [DType::F32, DType::BF16] {
            let pool = Tensor::<Flex, 2>::from_data(
                TensorData::new((0..40).map(|i| i as f32).collect::<Vec<_>>(), [10, 4]),
                &dev,
            )
            .cast(dtype);
            let values = Tensor::<Flex, 2>::from_data(
                TensorData::new((0..12).map(|i| -(i as f32)).collect::<Vec<_>>(), [3, 4]),
                &dev,
            );
            let slots = [7u32, 2, 3];
            let a = crate::kv_write::<Flex>(pool.clone(), &slots, values.clone());
            let b = Tensor::<Flex, 2>::from_primitive(burn::tensor::TensorPrimitive::Float(
                super::write_by_scatter::<Flex>(
                    pool.clone().into_primitive().tensor(),
                    &slots,
                    values.into_primitive().tensor(),
                ),
            ));
            assert_eq!(a.dtype(), dtype);
            assert_eq!(
                a.into_data().convert::<f32>().into_vec::<f32>().unwrap(),
                b.into_data().convert::<f32>().into_vec::<f32>().unwrap()
            );
            // The input pool (still referenced here) is not changed.
            assert_eq!(
                pool.into_data().convert::<f32>().into_vec::<f32>().unwrap()[28],
                28.0
            );
        }
    }
}
