//! What the loop drives: one [`Learner`], or a [`DataParallel`] group of them.

use std::borrow::Cow;
use std::future::Future;
use std::path::Path;

use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::DType;
use conrub_contracts::Policy;
use conrub_grpo::{
    load_state, DataParallel, Learner, Result, StateDraft, StepOutput, TrainingState,
};
use conrub_kernels::KernelOps;
use conrub_rewards::TaskPrompt;
use conrub_rubric::RubricRecord;

/// What [`train`](crate::train) drives: one [`Learner`], or a [`DataParallel`] group of them.
pub trait Trainee<B, P, T = RubricRecord>
where
    B: AutodiffBackend,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
    T: TaskPrompt,
{
    /// The learner whose step, settings and state the run reads (rank 0 of a group; every rank
    /// holds the same but in a sharded group: its policy then comes from
    /// [`Trainee::whole_policy`]).
    fn lead(&self) -> &Learner<B, P, T>;

    /// One training step on `records`, drawing from `reserve` under dynamic sampling
    /// ([`Learner::step_with_reserve`]).
    fn train_step<'a>(
        &'a mut self,
        records: &'a [&'a T],
        reserve: &'a [&'a T],
    ) -> impl Future<Output = Result<StepOutput>> + 'a;

    /// Loads a saved training state (into every learner of a group).
    fn load(&mut self, dir: &Path) -> Result<TrainingState>;

    /// Sets the run's length in training steps, which the learning-rate schedule counts from
    /// (every learner of a group; [`Learner::set_training_steps`]).
    fn set_training_steps(&mut self, steps: u64) -> Result<()>;

    /// Checks made before every checkpoint (a group: the replicas still agree).
    fn verify(&self) -> Result<()> {
        Ok(())
    }

    /// The whole policy, for exports and validation: a learner's own, or a
    /// `sharding = "full"` group's assembled from its ranks, weight matrices in `matrices`
    /// when set (see [`DataParallel::whole_policy`]).
    fn whole_policy(&self, matrices: Option<DType>) -> Result<Cow<'_, P>>;

    /// Writes the training state's files for `dir` ([`conrub_grpo::write_state`]; a sharded group
    /// writes every rank's part of the optimizer state, and a `full` group every rank's
    /// parameters); the caller seals the draft ([`StateDraft::seal`]).
    fn save(&self, data_cursor: serde_json::Value, dir: &Path) -> Result<StateDraft> {
        conrub_grpo::write_state(self.lead(), data_cursor, dir)
    }
}

impl<B, P, T> Trainee<B, P, T> for Learner<B, P, T>
where
    B: AutodiffBackend + KernelOps,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
    T: TaskPrompt,
{
    fn lead(&self) -> &Learner<B, P, T> {
        self
    }

    fn train_step<'a>(
        &'a mut self,
        records: &'a [&'a T],
        reserve: &'a [&'a T],
    ) -> impl Future<Output = Result<StepOutput>> + 'a {
        self.step_with_reserve(records, reserve)
    }

    fn load(&mut self, dir: &Path) -> Result<TrainingState> {
        load_state(self, dir)
    }

    fn set_training_steps(&mut self, steps: u64) -> Result<()> {
        Learner::set_training_steps(self, steps)
    }

    fn whole_policy(&self, _matrices: Option<DType>) -> Result<Cow<'_, P>> {
        Ok(Cow::Borrowed(self.policy()))
    }
}

impl<B, P, T> Trainee<B, P, T> for DataParallel<B, P, T>
where
    B: AutodiffBackend + KernelOps,
    P: Policy<B> + AutodiffModule<B> + Send,
    P::InnerModule: Policy<B::InnerBackend>,
    T: TaskPrompt,
{
    fn lead(&self) -> &Learner<B, P, T> {
        self.learner()
    }

    fn train_step<'a>(
        &'a mut self,
        records: &'a [&'a T],
        reserve: &'a [&'a T],
    ) -> impl Future<Output = Result<StepOutput>> + 'a {
        self.step_with_reserve(records, reserve)
    }

    fn load(&mut self, dir: &Path) -> Result<TrainingState> {
        self.load_state(dir)
    }

    fn set_training_steps(&mut self, steps: u64) -> Result<()> {
        DataParallel::set_training_steps(self, steps)
    }

    fn verify(&self) -> Result<()> {
        self.check_replicas()
    }

    fn whole_policy(&self, matrices: Option<DType>) -> Result<Cow<'_, P>> {
        DataParallel::whole_policy(self, matrices)
    }

    fn save(&self, data_cursor: serde_json::Value, dir: &Path) -> Result<StateDraft> {
        conrub_grpo::write_group_state(self.learners(), data_cursor, dir)
    }
}
