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

use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::DType;
use conrub_kernels::KernelOps;
use conrub_rubric::RubricRecord;

use crate::error::{GrpoError, Result};
use crate::learner::{step_output, Learner, LearnerBuilder, Shard, StepOutput};
use conrub_contracts::{gathered_as, Policy};
use conrub_parallel::sharding::{release, Assembly, ShardLayout, Sharding};
use conrub_parallel::{check_replicas, split_groups, Collective, RankGroup, RankSlot};
use conrub_rewards::TaskPrompt;

/// The learners of a data-parallel group, rank 0 first: a [`RankGroup`] of learners (the
/// group's threads, collective and failure handling are `conrub_parallel`'s).
pub struct DataParallel<B, P, T = RubricRecord>
where
    B: AutodiffBackend,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
    T: TaskPrompt,
{
    group: RankGroup<Learner<B, P, T>, B::InnerBackend>,
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
        let world = devices.len();
        let mut layout: Option<Arc<ShardLayout>> = None;
        let ranks = devices
            .iter()
            .enumerate()
            .map(|(rank, device)| {
                let b = builder(rank, device)?;
                if sharding.shards_optimizer() && layout.is_none() {
                    layout = Some(Arc::new(ShardLayout::of(&b.policy, world)));
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
        Ok(Self {
            group: RankGroup::new(ranks, collective)?,
        })
    }

    /// The layout when the group keeps each parameter on its owner only (`full`).
    fn parameter_layout(&self) -> Option<Arc<ShardLayout>> {
        let slot = self.group.ranks()[0].rank.as_ref()?;
        slot.parameters_sharded()?;
        slot.layout.clone()
    }

    /// The whole policy: rank 0's (every rank holds the same), or in a `full` group assembled
    /// on rank 0's device from every rank's own parameters, weight matrices cast to `matrices`
    /// when set (exports and validation use it between steps; no collective runs). Rank 0's
    /// device then holds the whole weights beside its share of the state: an export in bf16
    /// asks for bf16 matrices.
    pub fn whole_policy(&self, matrices: Option<DType>) -> Result<Cow<'_, P>> {
        let lead = self.learner();
        let Some(layout) = self.parameter_layout() else {
            return Ok(Cow::Borrowed(&lead.policy));
        };
        let modules: Vec<&P> = self.group.ranks().iter().map(|l| &l.policy).collect();
        let mut parts = Assembly::<B>::new(&modules, layout, &lead.device, matrices);
        Ok(Cow::Owned(gathered_as(&lead.policy, &mut parts, matrices)?))
    }

    /// Ranks in the group.
    pub fn world_size(&self) -> usize {
        self.group.world_size()
    }

    /// Rank 0's learner (every rank holds the same policy and optimizer state, but in a
    /// sharded group; see [`DataParallel::whole_policy`]).
    pub fn learner(&self) -> &Learner<B, P, T> {
        &self.group.ranks()[0]
    }

    /// Every rank's learner, rank 0 first.
    pub fn learners(&self) -> &[Learner<B, P, T>] {
        self.group.ranks()
    }

    /// Sets the run's length on every rank ([`Learner::set_training_steps`]).
    pub fn set_training_steps(&mut self, steps: u64) -> Result<()> {
        self.group
            .ranks_mut()
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
        let world = self.group.world_size();
        let total = records.len();
        let parts = self
            .group
            .run(split_groups(total, world), |_, learner, range| {
                let shard = Shard {
                    first: range.start,
                    total,
                };
                learner.step_parts(&records[range], reserve, shard)
            })?;
        let lead = self.learner();
        let (step, group_size) = (lead.step, lead.cfg.group_size);
        for l in self.group.ranks_mut() {
            l.step += 1;
        }
        Ok(step_output(step, group_size, world, parts))
    }

    /// The kernel warm-up's walk ([`Learner::walk_shapes`]) on every rank at once, each with its
    /// share of a step of `groups` groups; returns rank 0's counts.
    pub fn walk_shapes(&mut self, prompt_lens: &[usize], groups: usize) -> Result<(usize, usize)> {
        let world = self.group.world_size();
        let most = split_groups(groups, world)
            .iter()
            .map(|r| r.len())
            .max()
            .unwrap_or(1);
        let counts = self
            .group
            .run(vec![(); world], |_, learner, ()| async move {
                learner.walk_shapes(prompt_lens, most)
            })?;
        Ok(counts[0])
    }

    /// Loads a saved training state into every rank (saved by any number of ranks, in any
    /// sharding mode), and checks that the replicas agree. A `full` rank keeps its own
    /// parameters: from a `full` group's state it reads the files holding them; from a state
    /// with one policy file it reads the whole policy, then lets the rest go (one rank after
    /// another).
    pub fn load_state(&mut self, dir: &std::path::Path) -> Result<crate::state::TrainingState> {
        let layout = self.parameter_layout();
        let mut state = None;
        for (rank, l) in self.group.ranks_mut().iter_mut().enumerate() {
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
        let replicas: Vec<&P> = self.group.ranks().iter().map(|l| &l.policy).collect();
        Ok(check_replicas(&replicas)?)
    }
}
