//! A rank's place in its group.

use std::sync::Arc;

use crate::collective::Collective;
use crate::layout::ShardLayout;
use conrub_contracts::Sharding;

/// A learner's place in a group of data-parallel ranks (see `conrub_grpo::DataParallel`): its
/// index, the group's collective and the size of the gradient buckets it all-reduces.
#[derive(Clone)]
pub struct RankSlot<B: burn::tensor::backend::Backend> {
    /// This rank, `0..world`.
    pub rank: usize,
    /// The collective shared by the group.
    pub collective: Arc<dyn Collective<B>>,
    /// Bytes per bucket of flattened gradients (or weights) in one collective call.
    pub bucket_bytes: usize,
    /// How the group divides the training state.
    pub sharding: Sharding,
    /// Who owns which parameter (sharded groups; the same on every rank).
    pub layout: Option<Arc<ShardLayout>>,
}

impl<B: burn::tensor::backend::Backend> RankSlot<B> {
    /// The layout when the group shards (`sharding` other than `none`).
    pub fn sharded(&self) -> Option<&ShardLayout> {
        self.layout
            .as_deref()
            .filter(|_| self.sharding.shards_optimizer())
    }

    /// The layout when a rank keeps only its own parameters (`sharding = "full"`).
    pub fn parameters_sharded(&self) -> Option<&ShardLayout> {
        self.sharded().filter(|_| self.sharding.shards_parameters())
    }
}
