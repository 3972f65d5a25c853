//! The attention bias of a padded pass (the token batches themselves are
//! [`conrub_rollout::ForwardBatch`] and [`conrub_rollout::PaddedBatch`]).

use burn::tensor::backend::Backend;
use burn::tensor::{Bool, Int, Tensor};

/// Value added to attention scores of masked keys. Finite, so a query row whose keys are all masked
/// (a padding position) yields a uniform distribution instead of NaNs that would leak into values.
pub(crate) const MASKED_SCORE: f32 = -1.0e30;

/// Additive attention bias `[batch, 1, new, past + new]`: 0 where query `i` (at cache index
/// `past + i`) may read key `j` (causal and valid), [`MASKED_SCORE`] elsewhere. `None` when every key
/// is visible (a single new token and no padding).
pub fn attention_bias<B: Backend>(
    batch: usize,
    new: usize,
    past: usize,
    key_mask: Option<Tensor<B, 2, Bool>>,
    device: &B::Device,
) -> Option<Tensor<B, 4>> {
    let s = past + new;
    if new == 1 && key_mask.is_none() {
        return None;
    }
    let q = Tensor::<B, 1, Int>::arange(past as i64..s as i64, device)
        .reshape([new, 1])
        .expand([new, s]);
    let k = Tensor::<B, 1, Int>::arange(0..s as i64, device)
        .reshape([1, s])
        .expand([new, s]);
    let mut allowed = k
        .lower_equal(q)
        .reshape([1, 1, new, s])
        .expand([batch, 1, new, s]);
    if let Some(mask) = key_mask {
        allowed = allowed.bool_and(mask.reshape([batch, 1, 1, s]).expand([batch, 1, new, s]));
    }
    Some(allowed.bool_not().float().mul_scalar(MASKED_SCORE))
}
