//! Sums whose order never depends on the thread count: what ranks (and reruns) agree on bit for
//! bit. burn-flex's parallel `sum()` of 4M+ elements combines rayon chunks in an order set by
//! work stealing; these are summed as `[rows, 65,536]` row sums (each row in order), then the row
//! sums.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};

/// Elements per row of [`fixed_order_sum`].
const SUM_ROW: usize = 65_536;

/// The sum of all elements of `t` in f32, in an order that does not depend on threads.
///
/// # Shapes
/// Any `[..]` in, `[1]` out.
pub fn fixed_order_sum<B: Backend, const D: usize>(t: Tensor<B, D>) -> Tensor<B, 1> {
    let n = t.shape().num_elements();
    let mut flat: Tensor<B, 1> = t.cast(DType::F32).reshape([n]);
    while flat.dims()[0] > SUM_ROW {
        let len = flat.dims()[0];
        let rows = len.div_ceil(SUM_ROW);
        if rows * SUM_ROW != len {
            let pad =
                Tensor::<B, 1>::zeros([rows * SUM_ROW - len], &flat.device()).cast(DType::F32);
            flat = Tensor::cat(vec![flat, pad], 0);
        }
        flat = flat.reshape([rows, SUM_ROW]).sum_dim(1).reshape([rows]);
    }
    flat.sum()
}
