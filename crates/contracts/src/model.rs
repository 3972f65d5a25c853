//! What the engine needs from a model: its KV layout and one forward pass over the paged pool.

use burn::tensor::Tensor;
use conrub_kernels::KernelOps;

use crate::batch::ForwardBatch;
use crate::paged::{KvLayout, PagedKv, PagedPass};

/// A causal language model the engine (`conrub_rollout::rollout`) can drive.
///
/// Two kinds of pass go through [`PagedModel::forward_paged`]:
/// - a **prefill**: one unpadded prompt (`batch` is `[1, len]`, `pass.read` is `None`); its keys
///   and values go to `pass.write_slots` and it attends to its own tokens;
/// - a **decode step**: one new token per row (`batch` is `[rows, 1]`); the new keys go to
///   `pass.write_slots` and each row attends to the positions its block table in `pass.read` names.
///
/// A prefill may also read a cached prefix (`pass.prefix`): then its tokens attend to those
/// positions first, as if they came before the batch (the local judge's shared prompt).
pub trait PagedModel<B: KernelOps> {
    /// The layout of the pool this model reads and writes.
    fn kv_layout(&self) -> KvLayout;

    /// Vocabulary size (prompts are checked against it).
    fn vocab_size(&self) -> usize;

    /// Next-token logits `[rows, vocab]` after the last position of every row of `batch`.
    fn forward_paged(
        &self,
        batch: &ForwardBatch<B>,
        kv: &mut PagedKv<B>,
        pass: &PagedPass<B>,
    ) -> Tensor<B, 2>;
}
