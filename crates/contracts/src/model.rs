//! What the engine needs from a model: its KV layout and one forward pass over the paged pool.

use burn::tensor::{DType, Tensor};
use conrub_kernels::KernelOps;

use crate::batch::ForwardBatch;
use crate::paged::{PagedKv, PagedPass};

/// The shape of a model's cached keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    /// Layers with a KV cache.
    pub layers: usize,
    /// Key (and value) width of one position in one layer: `kv_heads * head_dim`.
    pub width: usize,
    /// Element type of the cache (the model's compute dtype).
    pub dtype: DType,
}

impl KvLayout {
    /// Device bytes of one block of `block_size` positions (keys and values of every layer).
    pub fn block_bytes(&self, block_size: usize) -> u64 {
        (self.layers * 2 * block_size * self.width * self.dtype.size()) as u64
    }
}

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
