//! Data parallelism below the learner: the collectives a group of ranks calls, who owns which
//! parameter when the training state is sharded (ZeRO-1/2/3), and the gradient and weight paths
//! over flattened buckets.
//!
//! | piece | what |
//! |---|---|
//! | [`Collective`] | all-reduce, reduce-scatter, all-gather and abort of one group: [`HostCollective`] (threads of one process, sums in rank order), `NcclCollective` (CUDA, feature `cuda`) |
//! | [`RankSlot`] | a learner's place in its group: rank, collective, bucket size, [`Sharding`], [`ShardLayout`] |
//! | [`ShardLayout`] | which rank owns which parameter (balanced by size) |
//! | [`GradientPath`] | a rank's gradient path, chosen once: where each backward's gradients go, idle passes, the reduction before the optimizer step and the weights shared after it |
//! | [`buckets`] | gradients and weights as flat buckets: the all-reduce of replicated groups, the reduce-scatter to owners, the all-gather of updated weights |
//! | [`sharding`] | the sharded gradient sum as backward pieces arrive ([`sharding::ShardedSum`]), gathered layers for `full`, releasing what a rank does not own |
//! | [`RankGroup`] | a data-parallel group in one process: a worker per device, the collective, every rank run on its own thread with the failing rank's own error; [`split_groups`], [`check_replicas`] |
//! | [`on_rank_threads`] | a group's ranks as threads of one process: work per rank, panics caught, a failing rank aborting the collective |
//! | [`fixed_order_sum`] | a sum whose order does not depend on threads (ranks and reruns agree bit for bit) |
//!
//! The learner (`conrub-grpo`) takes a [`RankSlot`] and calls these; it never names a transport.

mod collective;
mod error;
mod group;
mod layout;
#[cfg(feature = "cuda")]
mod nccl;
mod path;
mod rank;
mod sum;
mod threads;

pub mod buckets;
pub mod sharding;

pub use collective::{Collective, HostCollective};
pub use error::{ParallelError, Result};
pub use group::{check_replicas, split_groups, RankGroup};
#[cfg(feature = "cuda")]
pub use nccl::NcclCollective;
pub use path::{GradientPath, Reduced, StepSum};
pub use rank::RankSlot;
pub use sharding::{ShardLayout, Sharding};
pub use sum::fixed_order_sum;
pub use threads::on_rank_threads;
