//! One GRPO step as a list of stages: rollout, rewards, advantages (with tie breaking), the
//! device-resident train batch (old and reference log-probs), and the update (mini-batches, PPO
//! epochs, token-budget micro-batches, global grad-norm clipping, AdamW). Each stage is a type or
//! trait of its own that a user can replace through [`LearnerBuilder`].
//!
//! Host/device traffic of one step: the rollout's token ids and the decoded texts; one upload of
//! the teacher-forcing layout and one of the advantages (plus small row-index uploads for the
//! GRPO+DPO pairs); old and reference log-probs never leave the device; every micro-batch is a
//! slice of the train batch; the step's metrics and gradient norms come back in one transfer at
//! the end.

use std::ops::Range;
use std::time::Instant;

use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor, TensorData};
use conrub_contracts::{
    gathered_as, FinishReason, Gradients, Policy, ResponseLogprobs, RolloutBatch, RolloutEngine,
    RolloutRequest, RolloutStats, SamplingConfig, StepMetrics, TextCodec, TokenBatch, WeightSync,
};
use conrub_kernels::KernelOps;
use conrub_rubric::{ResponseScore, RubricRecord};

use conrub_rewards::TaskPrompt;

use crate::advantages::{stable_seed, AdvantageEstimator};
use crate::batch::{micro_batch_widths, pad_columns, plan_micro_batches, row_index, TrainBatch};
use crate::error::{GrpoError, Result};
use crate::group::{record_group, reward_bin, GroupOutcome, TieAwareAdvantages, TieMode};
use crate::loss::{dpo_pair_loss, kl_per_token, PolicyObjective, SurrogateBatch};
use crate::registry::Registry;
use crate::rollout::GroupSampler;
use crate::schedule::LrSchedule;
use crate::stop::cut_at_stop_strings;
use crate::ties::{NoTieBreaker, TieBreaker, TiedGroup};
use crate::update::{Update, UpdateConfig};
pub use conrub_contracts::{
    LearnerConfig, ObjectiveSettings, OnNonFinite, OptimizerSettings, SystemSettings,
};
use conrub_parallel::sharding::{CommStats, RankGather, ShardedSum};
use conrub_parallel::RankSlot;
use conrub_rewards::{GroupScores, RewardSource};

mod advantage;
mod builder;
mod dynamic;
mod output;
mod reward;
mod rollout;
mod train_batch;
mod update;
mod warm;

pub use builder::LearnerBuilder;
use dynamic::*;
pub(crate) use output::step_output;
use output::*;
use reward::*;
use train_batch::*;
use update::*;

/// What one step produced besides metrics (for audit logs).
#[derive(Debug, Clone)]
pub struct StepOutput {
    /// Metrics.
    pub metrics: StepMetrics,
    /// Per group: its prompt's index among the step's candidates, the records then the reserve
    /// ([`Learner::step_with_reserve`]): `0..records` unless dynamic sampling dropped groups.
    pub prompts: Vec<usize>,
    /// Per group: the scores.
    pub scores: Vec<Vec<ResponseScore>>,
    /// Per group: advantages and pairs.
    pub outcomes: Vec<GroupOutcome>,
    /// Per group: the decoded responses.
    pub responses: Vec<Vec<String>>,
    /// Per group: the criteria the responses were scored against (after rubric dropout).
    pub criteria: Vec<Vec<String>>,
    /// Per group: each response's length in tokens.
    pub response_tokens: Vec<Vec<usize>>,
    /// Per group: why each response ended.
    pub finish_reasons: Vec<Vec<FinishReason>>,
}

/// The inner-backend model of a policy.
type Inner<B, P> = <P as AutodiffModule<B>>::InnerModule;

/// The rollout stage of a learner.
type RolloutStage<B, P> = Box<dyn RolloutEngine<<B as AutodiffBackend>::InnerBackend, Inner<B, P>>>;

/// The learner: a policy, its collaborators (one per stage) and the step counter. Built with
/// [`Learner::builder`].
pub struct Learner<B, P, T = RubricRecord>
where
    B: AutodiffBackend,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
    T: TaskPrompt,
{
    pub(crate) policy: P,
    pub(crate) update: Update<B, P>,
    pub(crate) cfg: LearnerConfig,
    pub(crate) device: B::Device,
    pub(crate) reference: Option<P::InnerModule>,
    pub(crate) step: u64,
    codec: Box<dyn TextCodec>,
    rewards: Box<dyn RewardSource<T>>,
    advantages: TieAwareAdvantages,
    rollout: RolloutStage<B, P>,
    loss: Box<dyn PolicyObjective<B>>,
    stop_ids: Vec<u32>,
    pub(crate) rank: Option<RankSlot<B::InnerBackend>>,
    /// Optimizer steps skipped in a row for a non-finite gradient norm
    /// (`learner.on_nonfinite = "skip-step"`).
    skipped_in_a_row: usize,
    /// Steps in a row whose scored share fell below `min_scored_share`.
    unscored_in_a_row: usize,
    /// The learning-rate schedule is in place (one that needs the run's length waits for
    /// [`Learner::set_training_steps`]).
    schedule_ready: bool,
}

/// Which of the step's groups a learner handles: `first..first + records.len()` of `total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Shard {
    pub first: usize,
    pub total: usize,
}

/// Groups rolled out and scored, one per candidate prompt, in order.
pub(crate) struct Scored<'r, T> {
    /// Per group: the prompt and its index among the step's candidates.
    pub prompts: Vec<(usize, &'r T)>,
    pub rollout: RolloutBatch,
    pub texts: Vec<String>,
    pub scores: Vec<GroupScores>,
}

/// What dynamic sampling did on one rank in one step.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Refilled {
    /// Groups scored on this rank and not trained on.
    pub dropped: usize,
    /// Prompts drawn from the reserve, over every rank.
    pub drawn: usize,
    /// Rollout rounds, the first included.
    pub rounds: usize,
    /// Responses of this rank's dropped groups left unscored.
    pub unscored: usize,
}

/// One rank's share of a step, before the step's metrics are computed.
pub(crate) struct StepParts {
    /// Per group: the index of its prompt among the step's candidates.
    pub prompts: Vec<usize>,
    /// With dynamic sampling: this rank's dropped groups, and the step's extra prompts and
    /// rounds (the same on every rank).
    pub dynamic: Option<Refilled>,
    pub rollout: RolloutBatch,
    pub texts: Vec<String>,
    pub scores: Vec<GroupScores>,
    pub outcomes: Vec<GroupOutcome>,
    pub update: UpdateStats,
    pub dpo_pairs: usize,
    pub rollout_secs: f64,
    pub judge_secs: f64,
    pub update_secs: f64,
    pub weight_sync: WeightSync,
    pub logprob_gap: LogprobGap,
    /// Per scored response, the penalty `learner.kl_in_reward` took from its reward.
    pub reward_kl: Vec<f64>,
    /// Bytes the backend's memory pools hold on this rank's device after the step, where the
    /// backend reports it.
    pub device_memory: Option<u64>,
}

impl<B, P, T> Learner<B, P, T>
where
    B: AutodiffBackend + KernelOps,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
    T: TaskPrompt,
{
    /// Starts building a learner for `policy`.
    pub fn builder(policy: P, cfg: LearnerConfig, device: B::Device) -> LearnerBuilder<B, P, T> {
        LearnerBuilder {
            policy,
            cfg,
            device,
            codec: None,
            rewards: None,
            tie_breaker: None,
            estimator: None,
            registry: None,
            rollout: None,
            stop_ids: Vec::new(),
            rank: None,
        }
    }

    /// The policy being trained. On a rank of a `sharding = "full"` group it holds the rank's
    /// own parameters only (the others are placeholders): the group's
    /// [`crate::DataParallel::whole_policy`] assembles the whole.
    pub fn policy(&self) -> &P {
        &self.policy
    }

    /// The settings.
    pub fn config(&self) -> &LearnerConfig {
        &self.cfg
    }

    /// Steps completed.
    pub fn steps_done(&self) -> u64 {
        self.step
    }

    /// Sets the run's length in training steps, which `learner.lr_schedule = "linear" |
    /// "cosine"` and `learner.lr_warmup_ratio` count their horizon from ([`LrSchedule`]; each
    /// step is `ppo_epochs x mini_batches` optimizer steps). The schedule keeps its position.
    /// `conrub_trainer::train` calls it; a learner stepped by hand with such a schedule must.
    pub fn set_training_steps(&mut self, steps: u64) -> Result<()> {
        self.update
            .set_schedule(LrSchedule::new(&self.cfg, Some(steps))?);
        self.schedule_ready = true;
        Ok(())
    }

    /// Optimizer steps taken so far (the learning-rate schedule's position; one dropped for a
    /// non-finite gradient counts).
    pub fn optimizer_steps(&self) -> u64 {
        self.update.optimizer_steps()
    }

    /// The rate of the last optimizer step taken (of the first, before any).
    pub fn lr(&self) -> f64 {
        self.update.last_lr()
    }

    /// The token ids that end a response.
    pub fn stop_ids(&self) -> &[u32] {
        &self.stop_ids
    }

    /// The policy, the learner dropped (a kernel warm-up takes its policy back this way; a
    /// `full` rank's holds placeholders, see [`Learner::policy`]).
    pub fn into_policy(self) -> P {
        self.policy
    }

    /// One training step on `records` (one group of `group_size` responses per record).
    pub async fn step(&mut self, records: &[&T]) -> Result<StepOutput> {
        self.step_with_reserve(records, &[]).await
    }

    /// One training step on `records`; with `learner.dynamic_sampling`, groups without reward
    /// variance are dropped and prompts of `reserve` (the ones next in the data order, in that
    /// order) are drawn in their place ([`StepOutput::prompts`] says which were trained on,
    /// `dynamic_prompts_drawn` how many of `reserve` were used).
    pub async fn step_with_reserve(
        &mut self,
        records: &[&T],
        reserve: &[&T],
    ) -> Result<StepOutput> {
        let shard = Shard {
            first: 0,
            total: records.len(),
        };
        let parts = self.step_parts(records, reserve, shard).await?;
        self.step += 1;
        Ok(step_output(
            self.step - 1,
            self.cfg.group_size,
            1,
            vec![parts],
        ))
    }

    /// The stages of one step on this learner's `shard` of the step's groups (`records`). With
    /// a rank slot, the train batch's global counts and every optimizer step's gradients are
    /// shared with the other ranks; the step counter is not advanced.
    pub(crate) async fn step_parts(
        &mut self,
        records: &[&T],
        reserve: &[&T],
        shard: Shard,
    ) -> Result<StepParts> {
        self.check_ready(shard)?;
        let k = self.cfg.group_size;
        let t0 = Instant::now();
        let (inner, gather_comm) = self.whole_inner()?;
        // An engine outside the process may not hold the policy's weights yet (a first step, a
        // resume, a warm-up); one that does skips this.
        let mut weight_sync = self.rollout.sync_weights(&inner, self.step)?;
        // Rollout seconds include the gather and the sync before them.
        let mut times = (t0.elapsed().as_secs_f64(), 0.0);
        let (scored, shard, dynamic, all_scores) = self
            .scored_groups(&inner, records, reserve, shard, &mut times)
            .await?;
        let (rollout_secs, judge_secs) = times;
        let prompts: Vec<usize> = scored.prompts.iter().map(|(i, _)| *i).collect();
        let records: Vec<&T> = scored.prompts.iter().map(|(_, r)| *r).collect();
        let records = records.as_slice();
        let (rollout, texts, scores) = (scored.rollout, scored.texts, scored.scores);
        let all_scores = all_scores.as_ref().unwrap_or(&scores);
        let t2 = Instant::now();
        let early = self.logprobs_for_reward(&inner, &rollout, shard)?;
        let kl = early.as_ref().map(|(_, l)| self.sequence_kl(l));
        let before_advantages = t2.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let outcomes = self
            .advantage_stage(records, &rollout, &texts, &scores, kl.as_deref())
            .await;
        check_advantages(records, &outcomes, k)?;
        let judge_secs = judge_secs + t1.elapsed().as_secs_f64();

        let t2 = Instant::now();
        let (rows, logprobs) = match early {
            Some(done) => done,
            None => self.rows_and_logprobs(&inner, &rollout, shard)?,
        };
        let batch = self.train_batch(&rollout, &outcomes, logprobs);
        // A `full` rank's gathered weights go before the backward passes gather their segments.
        drop(inner);
        let logprob_gap = LogprobGap::of(&batch, &rollout);
        let dpo_pairs = match self.cfg.tie_mode {
            TieMode::GrpoDpo => dpo_pairs(&outcomes, k),
            _ => Vec::new(),
        };
        let mut update = if self.enough_scored(all_scores)? {
            self.update_stage(&batch, &dpo_pairs, &rows)?
        } else {
            UpdateStats::default()
        };
        update.comm.add(&gather_comm);
        update.lr = self.update.last_lr();
        weight_sync = weight_sync.plus(self.sync_updated_weights()?);
        let update_secs = before_advantages + t2.elapsed().as_secs_f64();
        let reward_kl = reward_penalties(&scores, kl.as_deref(), self.cfg.kl_in_reward);
        Ok(StepParts {
            prompts,
            dynamic,
            rollout,
            texts,
            scores,
            outcomes,
            update,
            dpo_pairs: dpo_pairs.len(),
            rollout_secs,
            judge_secs,
            update_secs,
            weight_sync,
            logprob_gap,
            reward_kl,
            device_memory: <B as conrub_kernels::DecodeOps>::device_memory_reserved(&self.device),
        })
    }

    /// The step's groups, rolled out and scored: this learner's `records` (`shard` of the
    /// step's groups) and, under dynamic sampling, the refill from `reserve` that replaces the
    /// groups without reward variance. Returns the groups to train on, their shard, what the
    /// refill did, and (under dynamic sampling) the scores of every response drawn, which the
    /// scored share counts whether trained on or not.
    async fn scored_groups<'r>(
        &self,
        inner: &P::InnerModule,
        records: &[&'r T],
        reserve: &[&'r T],
        shard: Shard,
        times: &mut (f64, f64),
    ) -> Result<(
        Scored<'r, T>,
        Shard,
        Option<Refilled>,
        Option<Vec<GroupScores>>,
    )> {
        let candidates: Vec<(usize, &T)> = records
            .iter()
            .enumerate()
            .map(|(i, r)| (shard.first + i, *r))
            .collect();
        let first = self.rollout_and_score(inner, candidates, times).await?;
        if !self.cfg.dynamic_sampling {
            return Ok((first, shard, None, None));
        }
        let (scored, kept, shard, refilled) =
            self.refill(inner, first, reserve, shard, times).await?;
        let all_scores = scored.scores.clone();
        Ok((
            select_scored(scored, &kept),
            shard,
            Some(refilled),
            Some(all_scores),
        ))
    }

    /// Refuses a step with no group, or one whose learning-rate schedule cannot be made yet.
    fn check_ready(&self, shard: Shard) -> Result<()> {
        if shard.total == 0 {
            return Err(GrpoError::NoRecords);
        }
        if !self.schedule_ready {
            LrSchedule::new(&self.cfg, None)?;
        }
        Ok(())
    }

    /// With KL in the reward, the rows of every rank and the old and reference log-probs,
    /// computed before the advantages; otherwise `None` (they come after, as the update's first
    /// part).
    fn logprobs_for_reward(
        &self,
        inner: &P::InnerModule,
        rollout: &RolloutBatch,
        shard: Shard,
    ) -> Result<Option<(GlobalRows, BatchLogprobs<B>)>> {
        match self.cfg.kl_in_reward != 0.0 {
            true => Ok(Some(self.rows_and_logprobs(inner, rollout, shard)?)),
            false => Ok(None),
        }
    }

    /// The new weights to the engine before the next rollout reads them (a `full` rank holds no
    /// whole weights here: its next step syncs the ones it gathers).
    fn sync_updated_weights(&self) -> Result<WeightSync> {
        if self.parameters_sharded() {
            return Ok(WeightSync::default());
        }
        Ok(self
            .rollout
            .sync_weights(&self.policy.valid(), self.step + 1)?)
    }

    /// `counts` of every rank, in rank order (this learner's alone when it is not a rank).
    fn gather_counts(&self, counts: Vec<f64>) -> Result<Vec<Vec<f64>>> {
        match &self.rank {
            Some(slot) => Ok(slot.collective.all_gather(slot.rank, counts)?),
            None => Ok(vec![counts]),
        }
    }

    /// Whether this learner is a `sharding = "full"` rank (it keeps its own parameters only).
    fn parameters_sharded(&self) -> bool {
        self.rank
            .as_ref()
            .is_some_and(|s| s.parameters_sharded().is_some())
    }

    /// The policy's whole weights without autodiff, for the step's rollouts and old
    /// log-probabilities: its own, or on a `full` rank all-gathered from every rank (each rank
    /// gathers at the start of every step) and dropped once the train batch is built.
    pub(super) fn whole_inner(&self) -> Result<(P::InnerModule, CommStats)> {
        let slot = self.rank.as_ref();
        let Some((slot, layout)) = slot.and_then(|s| s.parameters_sharded().map(|l| (s, l))) else {
            return Ok((self.policy.valid(), CommStats::default()));
        };
        let matrices = self.policy.matrix_dtype();
        let mut source = RankGather::new(&self.policy, slot, layout).casting(matrices);
        let whole = gathered_as(&self.policy.clone().no_grad(), &mut source, matrices)?;
        Ok((whole.valid(), source.comm))
    }
}

/// Refuses an estimator's outcome of the wrong size: every group has `k` advantages.
fn check_advantages<T: TaskPrompt>(
    records: &[&T],
    outcomes: &[GroupOutcome],
    k: usize,
) -> Result<()> {
    match outcomes
        .iter()
        .enumerate()
        .find(|(_, o)| o.advantages.len() != k)
    {
        Some((g, o)) => Err(GrpoError::Stage(format!(
            "advantages of group {g} ({}): {} values for {k} responses",
            records[g].id(),
            o.advantages.len()
        ))),
        None => Ok(()),
    }
}

/// GRPO+DPO's pairs: every accepted tie pair as `(winner, loser)` rows of the step's batch.
fn dpo_pairs(outcomes: &[GroupOutcome], k: usize) -> Vec<(usize, usize)> {
    outcomes
        .iter()
        .enumerate()
        .flat_map(|(g, o)| {
            o.accepted_pairs()
                .into_iter()
                .map(move |(w, l)| (g * k + w, g * k + l))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::advantages::GroupRelative;
    use crate::loss::KlEstimator;
    use burn::backend::Flex;

    /// `learner.kl_in_reward`'s per-response KL by hand: rows `[-1, -2, pad]` and `[-0.5, pad,
    /// pad]` against the reference's `[-1.5, -1, pad]` and `[-0.5, pad, pad]`: `d = ref - old`
    /// is `[-0.5, 1, 0]` and `[0, 0, 0]`, so k1 sums `0.5 - 1 = -0.5`, k2 `(0.25 + 1) / 2`, k3
    /// `(e^-0.5 + 0.5 - 1) + (e - 1 - 1)`; the second row (the same log-probs) is 0 under each.
    #[test]
    fn kl_in_reward_sums_the_estimator_over_each_response() {
        let t = |v: [f32; 6]| {
            Tensor::<Flex, 2>::from_data(TensorData::new(v.to_vec(), [2, 3]), &Default::default())
        };
        let old = t([-1.0, -2.0, 0.0, -0.5, 0.0, 0.0]);
        let reference = t([-1.5, -1.0, 0.0, -0.5, 0.0, 0.0]);
        let k3 = ((-0.5f64).exp() + 0.5 - 1.0) + (1f64.exp() - 1.0 - 1.0);
        for (estimator, want) in [
            (KlEstimator::K1, -0.5),
            (KlEstimator::K2, (0.25 + 1.0) / 2.0),
            (KlEstimator::K3, k3),
        ] {
            let got = sequence_kl(estimator, old.clone(), reference.clone());
            assert!(
                (got[0] - want).abs() < 1e-6 && got[1] == 0.0,
                "{estimator:?}: {got:?}"
            );
        }
        // The penalty of each scored response only: beta x its KL.
        let scores = vec![GroupScores::direct(vec![
            ResponseScore::exact(1, 1),
            ResponseScore::unscored("judge down", 2),
        ])];
        assert_eq!(reward_penalties(&scores, Some(&[0.5, 9.0]), 0.2), vec![0.1]);
        assert!(reward_penalties(&scores, None, 0.2).is_empty());
    }

    /// Advantages of the shaped rewards, ties of the raw ones: rewards 1, 0, 1, 0 less penalties
    /// 0.1, 0, 0, 0.2 give the group-relative advantages of 0.9, 0, 1, -0.2 (mean 0.425, the
    /// sample standard deviation by hand); rewards all 1 are a tie whatever the penalties, and
    /// with tie breaking off get the advantages of their equal rewards, 0.
    #[test]
    fn kl_shaped_rewards_set_advantages_and_raw_rewards_set_ties() {
        let advantages = TieAwareAdvantages::new(
            Box::new(GroupRelative::default()),
            TieMode::Off,
            Box::new(NoTieBreaker),
        );
        let responses = vec![String::new(); 4];
        let group = TiedGroup {
            group_key: "g",
            question: "q",
            criteria: &[],
            responses: &responses,
            lengths: &[1, 1, 1, 1],
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let raw = [Some(1.0), Some(0.0), Some(1.0), Some(0.0)];
        let shaped = [Some(0.9), Some(0.0), Some(1.0), Some(-0.2)];
        let o = rt.block_on(advantages.group_shaped(&raw, Some(&shaped), 4, &group));
        let mean = (0.9 + 0.0 + 1.0 - 0.2) / 4.0;
        let var = [0.9f64, 0.0, 1.0, -0.2]
            .iter()
            .map(|x| (x - mean) * (x - mean))
            .sum::<f64>()
            / 3.0;
        for (a, x) in o.advantages.iter().zip([0.9, 0.0, 1.0, -0.2]) {
            let want = (x - mean) / (var.sqrt() + 1e-4);
            assert!((a - want).abs() < 1e-12, "{:?}", o.advantages);
        }
        assert_eq!(o.status, crate::TieStatus::NotTied);
        let tied = [Some(1.0); 4];
        let o = rt.block_on(advantages.group_shaped(&tied, Some(&shaped), 4, &group));
        assert_eq!(o.status, crate::TieStatus::TiedUnbroken);
        assert_eq!(o.advantages, vec![0.0; 4], "a tie's penalties move nothing");
        // Equal scored rewards beside an unscored one: no tie (incomplete), and no signal for
        // the penalties to scale up either.
        let equal = [Some(1.0), Some(1.0), None, Some(1.0)];
        let o = rt.block_on(advantages.group_shaped(&equal, Some(&shaped), 4, &group));
        assert_eq!(o.status, crate::TieStatus::NotTied);
        assert_eq!(o.advantages, vec![0.0; 4]);
    }
}
