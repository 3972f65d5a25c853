//! Data-parallel training on the devices of one node: one [`Learner`] per device, each on a
//! thread of its own, with a replica of the policy and of the optimizer state, or with a share
//! of them ([`Sharding`]: the optimizer state, the gradient sums, the parameters).
//!
//! A step splits its prompt groups across the ranks in contiguous slices (a group never splits;
//! the first ranks take one more when the split is uneven). Each rank samples, scores and ranks
//! its own groups (exact ties and pairwise directions are per group, so they stay local), builds
//! its train batch, and for every optimizer step accumulates the gradients of its rows of the
//! mini-batch, weighted by the mini-batch's global counts. One all-reduce of flattened gradient
//! buckets per optimizer step sums them, so clipping and AdamW see what one device would compute
//! for the same rows, and every replica stays identical. Rollout streams follow the step's global
//! layout ([`crate::RolloutRequest::first_group`]), so responses, rewards and tie verdicts do not
//! depend on the number of ranks.
//!
//! A rank that fails (an error or a panic) aborts the group's [`Collective`]: the other ranks
//! stop at their next collective call, and the step returns the failing rank's error.

use std::borrow::Cow;
use std::sync::Arc;

use burn::module::{AutodiffModule, Module, ModuleVisitor, Param};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Tensor};
use conrub_kernels::KernelOps;
use conrub_rubric::RubricRecord;

use crate::error::{GrpoError, Result};
use crate::learner::{step_output, Learner, LearnerBuilder, Shard, StepOutput};
use conrub_contracts::{gathered_as, Policy};
use conrub_parallel::sharding::{release, Assembly, ShardLayout, Sharding};
use conrub_parallel::{Collective, RankSlot};
use conrub_rewards::TaskPrompt;

/// The learners of a data-parallel group, rank 0 first.
pub struct DataParallel<B, P, T = RubricRecord>
where
    B: AutodiffBackend,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
    T: TaskPrompt,
{
    ranks: Vec<Learner<B, P, T>>,
    collective: Arc<dyn Collective<B::InnerBackend>>,
}

impl<B, P, T> DataParallel<B, P, T>
where
    B: AutodiffBackend + KernelOps,
    P: Policy<B> + AutodiffModule<B> + Send,
    P::InnerModule: Policy<B::InnerBackend>,
    T: TaskPrompt,
{
    /// One learner per device: `builder(rank, device)` returns the builder of that rank's
    /// learner (the same policy weights and settings on every rank, moved to its device); the
    /// group adds each rank's slot in `collective`.
    pub fn build(
        devices: &[B::Device],
        collective: Arc<dyn Collective<B::InnerBackend>>,
        bucket_bytes: usize,
        builder: impl FnMut(usize, &B::Device) -> Result<LearnerBuilder<B, P, T>>,
    ) -> Result<Self> {
        Self::build_sharded(devices, collective, bucket_bytes, Sharding::None, builder)
    }

    /// [`DataParallel::build`] with the training state divided as `sharding` says (see
    /// [`crate::ShardLayout`] for who owns what). With `Sharding::Full` each rank's policy
    /// keeps its own parameters only once its learner is built (the others become
    /// placeholders; [`DataParallel::whole_policy`] assembles the whole). Its backward passes
    /// gather one decoder layer at a time only when the policy splits its backward by layer
    /// (`learner.activation_checkpointing` for the `models/` families; `conrub train` requires
    /// it); otherwise every pass gathers the whole policy
    /// ([`conrub_contracts::whole_backward`] into [`conrub_contracts::Gradients::Gathered`]). The builder hands
    /// each rank its own copy: give the last rank the caller's policy itself, so no whole copy
    /// outlives the build.
    pub fn build_sharded(
        devices: &[B::Device],
        collective: Arc<dyn Collective<B::InnerBackend>>,
        bucket_bytes: usize,
        sharding: Sharding,
        mut builder: impl FnMut(usize, &B::Device) -> Result<LearnerBuilder<B, P, T>>,
    ) -> Result<Self> {
        if devices.len() != collective.world_size() {
            return Err(GrpoError::config(
                "devices",
                format!(
                    "{} devices for a collective of {} ranks",
                    devices.len(),
                    collective.world_size()
                ),
            ));
        }
        let mut layout: Option<Arc<ShardLayout>> = None;
        let ranks = devices
            .iter()
            .enumerate()
            .map(|(rank, device)| {
                let b = builder(rank, device)?;
                if sharding.shards_optimizer() && layout.is_none() {
                    layout = Some(Arc::new(ShardLayout::of(&b.policy, devices.len())));
                }
                let slot = RankSlot {
                    rank,
                    collective: collective.clone(),
                    bucket_bytes,
                    sharding,
                    layout: layout.clone(),
                };
                let mut learner = b.rank(slot).build()?;
                if let Some(layout) = layout.as_ref().filter(|_| sharding.shards_parameters()) {
                    learner.policy = release(learner.policy, layout, rank);
                }
                Ok(learner)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { ranks, collective })
    }

    /// The layout when the group keeps each parameter on its owner only (`full`).
    fn parameter_layout(&self) -> Option<Arc<ShardLayout>> {
        let slot = self.ranks[0].rank.as_ref()?;
        slot.parameters_sharded()?;
        slot.layout.clone()
    }

    /// The whole policy: rank 0's (every rank holds the same), or in a `full` group assembled
    /// on rank 0's device from every rank's own parameters, weight matrices cast to `matrices`
    /// when set (exports and validation use it between steps; no collective runs). Rank 0's
    /// device then holds the whole weights beside its share of the state: an export in bf16
    /// asks for bf16 matrices.
    pub fn whole_policy(&self, matrices: Option<DType>) -> Result<Cow<'_, P>> {
        let lead = &self.ranks[0];
        let Some(layout) = self.parameter_layout() else {
            return Ok(Cow::Borrowed(&lead.policy));
        };
        let modules: Vec<&P> = self.ranks.iter().map(|l| &l.policy).collect();
        let mut parts = Assembly::<B>::new(&modules, layout, &lead.device, matrices);
        Ok(Cow::Owned(gathered_as(&lead.policy, &mut parts, matrices)?))
    }

    /// Ranks in the group.
    pub fn world_size(&self) -> usize {
        self.ranks.len()
    }

    /// Rank 0's learner (every rank holds the same policy and optimizer state, but in a
    /// sharded group; see [`DataParallel::whole_policy`]).
    pub fn learner(&self) -> &Learner<B, P, T> {
        &self.ranks[0]
    }

    /// Every rank's learner, rank 0 first.
    pub fn learners(&self) -> &[Learner<B, P, T>] {
        &self.ranks
    }

    /// Sets the run's length on every rank ([`Learner::set_training_steps`]).
    pub fn set_training_steps(&mut self, steps: u64) -> Result<()> {
        self.ranks
            .iter_mut()
            .try_for_each(|l| l.set_training_steps(steps))
    }

    /// One training step on `records`, split across the ranks. Ranks run on threads of their
    /// own; async stages (judging) run on the caller's tokio runtime when there is one (a
    /// served judge needs a multi-threaded runtime, whose worker this call blocks).
    pub async fn step(&mut self, records: &[&T]) -> Result<StepOutput> {
        self.step_with_reserve(records, &[]).await
    }

    /// [`DataParallel::step`] with the prompts dynamic sampling may draw
    /// ([`Learner::step_with_reserve`]): every rank sees the whole reserve and draws its part
    /// of each round's shortfall in rank order.
    pub async fn step_with_reserve(
        &mut self,
        records: &[&T],
        reserve: &[&T],
    ) -> Result<StepOutput> {
        if records.is_empty() {
            return Err(GrpoError::NoRecords);
        }
        let world = self.ranks.len();
        let total = records.len();
        let items: Vec<_> = self
            .ranks
            .iter_mut()
            .zip(split_groups(total, world))
            .collect();
        let collective = &self.collective;
        let results = conrub_parallel::on_rank_threads(
            items,
            |_, (learner, range)| {
                let shard = Shard {
                    first: range.start,
                    total,
                };
                learner.step_parts(&records[range], reserve, shard)
            },
            &|rank, error| collective.abort(rank, error),
        );
        let parts = own_error(results)?;
        let step = self.ranks[0].step;
        for l in &mut self.ranks {
            l.step += 1;
        }
        Ok(step_output(
            step,
            self.ranks[0].cfg.group_size,
            world,
            parts,
        ))
    }

    /// The kernel warm-up's walk ([`Learner::walk_shapes`]) on every rank at once, each with its
    /// share of a step of `groups` groups; returns rank 0's counts.
    pub fn walk_shapes(&mut self, prompt_lens: &[usize], groups: usize) -> Result<(usize, usize)> {
        let world = self.ranks.len();
        let most = split_groups(groups, world)
            .iter()
            .map(|r| r.len())
            .max()
            .unwrap_or(1);
        let collective = &self.collective;
        let results = conrub_parallel::on_rank_threads(
            self.ranks.iter_mut().collect(),
            |_, learner: &mut Learner<B, P, T>| async move { learner.walk_shapes(prompt_lens, most) },
            &|rank, error| collective.abort(rank, error),
        );
        Ok(own_error(results)?[0])
    }

    /// Loads a saved training state into every rank (saved by any number of ranks, in any
    /// sharding mode), and checks that the replicas agree. A `full` rank keeps its own
    /// parameters: from a `full` group's state it reads the files holding them; from a state
    /// with one policy file it reads the whole policy, then lets the rest go (one rank after
    /// another).
    pub fn load_state(&mut self, dir: &std::path::Path) -> Result<crate::TrainingState> {
        let layout = self.parameter_layout();
        let mut state = None;
        for (rank, l) in self.ranks.iter_mut().enumerate() {
            state = Some(crate::state::load_state(l, dir)?);
            if let Some(layout) = &layout {
                l.policy = release(l.policy.clone(), layout, rank);
            }
        }
        self.check_replicas()?;
        Ok(state.expect("a group has ranks"))
    }

    /// Compares a checksum of every rank's parameters with rank 0's; a difference is an error
    /// naming the rank that drifted (call it at checkpoints). A `full` group holds no replicas:
    /// nothing to compare.
    pub fn check_replicas(&self) -> Result<()> {
        if self.parameter_layout().is_some() {
            return Ok(());
        }
        let sums: Vec<u64> = self.ranks.iter().map(|l| checksum(&l.policy)).collect();
        match sums.iter().position(|s| *s != sums[0]) {
            None => Ok(()),
            Some(rank) => Err(GrpoError::Stage(format!(
                "rank {rank}'s parameters differ from rank 0's (checksum {:016x} vs {:016x})",
                sums[rank], sums[0]
            ))),
        }
    }
}

/// Contiguous group ranges of `groups` over `world` ranks; the first `groups % world` ranks take
/// one more.
pub fn split_groups(groups: usize, world: usize) -> Vec<std::ops::Range<usize>> {
    let (base, extra) = (groups / world, groups % world);
    let mut start = 0;
    (0..world)
        .map(|r| {
            let n = base + usize::from(r < extra);
            let range = start..start + n;
            start += n;
            range
        })
        .collect()
}

/// Every rank's output, or the failing rank's own error rather than the "rank r failed" of the
/// ranks it stopped.
fn own_error<O>(results: Vec<Result<O>>) -> Result<Vec<O>> {
    if results.iter().all(Result::is_ok) {
        return Ok(results.into_iter().map(|r| r.expect("checked")).collect());
    }
    let mut errors: Vec<GrpoError> = results.into_iter().filter_map(Result::err).collect();
    let own = errors
        .iter()
        .position(|e| {
            !matches!(
                e,
                GrpoError::Parallel(conrub_parallel::ParallelError::RankFailed { .. })
            )
        })
        .unwrap_or(0);
    Err(errors.swap_remove(own))
}

/// FNV-1a over the bits of every float parameter, in the module's order.
fn checksum<B: Backend, M: Module<B>>(module: &M) -> u64 {
    struct Sum(u64);
    impl<B: Backend> ModuleVisitor<B> for Sum {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let data = param.val().into_data().convert::<f32>();
            for x in data.iter::<f32>() {
                for b in x.to_bits().to_le_bytes() {
                    self.0 = (self.0 ^ b as u64).wrapping_mul(0x100_0000_01b3);
                }
            }
        }
    }
    let mut s = Sum(0xcbf2_9ce4_8422_2325);
    module.visit(&mut s);
    s.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_split_contiguously_with_the_remainder_first() {
        assert_eq!(split_groups(5, 2), vec![0..3, 3..5]);
        assert_eq!(split_groups(5, 3), vec![0..2, 2..4, 4..5]);
        assert_eq!(split_groups(2, 3), vec![0..1, 1..2, 2..2]);
    }
}
