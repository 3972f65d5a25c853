//! The step itself: the stages in order (rollout, rewards, advantages, train batch, update,
//! weight sync) over a learner's share of the step's groups, and the learner's accessors.

use super::builder::LearnerBuilder;
use super::dynamic::select_scored;
use super::output::step_output;
use super::reward::reward_penalties;
use super::train_batch::BatchLogprobs;
use super::types::*;

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
    pub(super) fn gather_counts(&self, counts: Vec<f64>) -> Result<Vec<Vec<f64>>> {
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
