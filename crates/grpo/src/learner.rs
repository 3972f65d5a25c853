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
use std::sync::Arc;
use std::time::Instant;

use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor, TensorData};
use conrub_contracts::{
    gathered_as, FinishReason, Policy, ResponseLogprobs, RolloutBatch, RolloutEngine,
    RolloutRequest, SamplingConfig, StepMetrics, TextCodec, TokenBatch, WeightSync,
};
use conrub_kernels::GrpoOps;
use conrub_rubric::{ResponseScore, RubricRecord};

use conrub_rewards::TaskPrompt;

use crate::advantages::{stable_seed, AdvantageEstimator};
use crate::batch::{micro_batch_widths, pad_columns, plan_micro_batches, row_index, TrainBatch};
use crate::collective::Collective;
use crate::error::{GrpoError, Result};
use crate::group::{record_group, reward_bin, GroupOutcome, TieAwareAdvantages, TieMode};
use crate::loss::{dpo_pair_loss, kl_per_token, PolicyObjective, SurrogateBatch};
use crate::registry::Registry;
use crate::rollout::GroupSampler;
use crate::schedule::LrSchedule;
use crate::sharding::{CommStats, RankGather, ShardLayout, ShardedSum, Sharding};
use crate::stop::cut_at_stop_strings;
use crate::ties::{NoTieBreaker, TieBreaker, TiedGroup};
use crate::update::{Update, UpdateConfig};
pub use conrub_contracts::{LearnerConfig, OnNonFinite};
use conrub_rewards::{GroupScores, RewardSource};

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

/// A learner's place in a group of data-parallel ranks (see [`crate::DataParallel`]): its
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
    pub(crate) fn sharded(&self) -> Option<&ShardLayout> {
        self.layout
            .as_deref()
            .filter(|_| self.sharding.shards_optimizer())
    }

    /// The layout when a rank keeps only its own parameters (`sharding = "full"`).
    pub(crate) fn parameters_sharded(&self) -> Option<&ShardLayout> {
        self.sharded().filter(|_| self.sharding.shards_parameters())
    }
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

/// The step's rows on the device with their old (and reference) log-probs: the train batch
/// before its advantages.
pub(crate) struct BatchLogprobs<B: burn::tensor::backend::Backend> {
    logp_old: Tensor<B, 2>,
    logp_ref: Option<Tensor<B, 2>>,
    tokens: TokenBatch<B>,
    seq_lens: Vec<usize>,
    response_lens: Vec<usize>,
}

/// Per row of `logp` (`[rows, R]`, right-padded with 0 like `logp_ref`), the summed per-token
/// KL estimate `estimator` to the reference, on the host.
fn sequence_kl<B: burn::tensor::backend::Backend>(
    estimator: crate::loss::KlEstimator,
    logp: Tensor<B, 2>,
    logp_ref: Tensor<B, 2>,
) -> Vec<f64> {
    if logp.dims()[0] == 0 {
        return vec![];
    }
    kl_per_token(estimator, logp, logp_ref)
        .sum_dim(1)
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("f32 sums")
        .into_iter()
        .map(f64::from)
        .collect()
}

/// Per scored response, the penalty `kl_in_reward` takes from its reward (empty when off).
fn reward_penalties(scores: &[GroupScores], kl: Option<&[f64]>, beta: f64) -> Vec<f64> {
    let Some(kl) = kl else {
        return vec![];
    };
    scores
        .iter()
        .flat_map(|g| &g.scores)
        .zip(kl)
        .filter(|(s, _)| s.is_scored())
        .map(|(_, kl)| beta * kl)
        .collect()
}

/// The learner's old log-probs against the engine's for the same sampled tokens, summed over
/// response tokens: `d = logp_learner - logp_engine`, `|d|` (sum and max) and the k3 estimate
/// of KL(engine || learner), `exp(d) - d - 1` (non-negative, unbiased under the engine's samples).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct LogprobGap {
    pub abs_sum: f64,
    pub abs_max: f64,
    pub k3_sum: f64,
    pub tokens: usize,
}

impl LogprobGap {
    /// The gap of `batch`'s old log-probs (read to the host once) and `rollout`'s.
    fn of<B: burn::tensor::backend::Backend>(
        batch: &TrainBatch<B>,
        rollout: &RolloutBatch,
    ) -> Self {
        let [_, width] = batch.logp_old.dims();
        let old: Vec<f32> = batch
            .logp_old
            .clone()
            .into_data()
            .convert::<f32>()
            .into_vec()
            .unwrap_or_default();
        let mut gap = Self::default();
        for (r, engine) in rollout.logprobs.iter().enumerate() {
            for (t, e) in engine.iter().enumerate().take(width) {
                let Some(l) = old.get(r * width + t) else {
                    continue;
                };
                let d = (*l as f64) - (*e as f64);
                gap.abs_sum += d.abs();
                gap.abs_max = gap.abs_max.max(d.abs());
                gap.k3_sum += d.exp() - d - 1.0;
                gap.tokens += 1;
            }
        }
        gap
    }

    /// The gaps of several ranks as one.
    fn merge(parts: impl IntoIterator<Item = LogprobGap>) -> Self {
        parts.into_iter().fold(Self::default(), |a, b| Self {
            abs_sum: a.abs_sum + b.abs_sum,
            abs_max: a.abs_max.max(b.abs_max),
            k3_sum: a.k3_sum + b.k3_sum,
            tokens: a.tokens + b.tokens,
        })
    }
}

/// Builds a [`Learner`]: the policy, its settings and device, a [`TextCodec`] and a
/// [`RewardSource`] are required; the rest defaults to the method's stages.
pub struct LearnerBuilder<B, P, T = RubricRecord>
where
    B: AutodiffBackend,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
    T: TaskPrompt,
{
    pub(crate) policy: P,
    cfg: LearnerConfig,
    device: B::Device,
    codec: Option<Box<dyn TextCodec>>,
    rewards: Option<Box<dyn RewardSource<T>>>,
    tie_breaker: Option<Box<dyn TieBreaker>>,
    estimator: Option<Box<dyn AdvantageEstimator>>,
    registry: Option<Registry<B>>,
    rollout: Option<RolloutStage<B, P>>,
    stop_ids: Vec<u32>,
    rank: Option<RankSlot<B::InnerBackend>>,
}

impl<B, P, T> LearnerBuilder<B, P, T>
where
    B: AutodiffBackend + GrpoOps,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
    T: TaskPrompt,
{
    /// Prompt rendering and response decoding (required).
    pub fn codec(mut self, codec: impl TextCodec + 'static) -> Self {
        self.codec = Some(Box::new(codec));
        self
    }

    /// Rewards of a group (required).
    pub fn rewards(mut self, rewards: impl RewardSource<T> + 'static) -> Self {
        self.rewards = Some(Box::new(rewards));
        self
    }

    /// What breaks exact ties (required unless `tie_mode = "off"`).
    pub fn tie_breaker(mut self, breaker: impl TieBreaker + 'static) -> Self {
        self.tie_breaker = Some(Box::new(breaker));
        self
    }

    /// Advantages of non-tied groups, given directly (default: the registry's entry that
    /// `learner.estimator` names, [`GroupRelative`](crate::GroupRelative) with `scale_rewards`
    /// unless set).
    pub fn estimator(mut self, estimator: impl AdvantageEstimator + 'static) -> Self {
        self.estimator = Some(Box::new(estimator));
        self
    }

    /// Where `learner.estimator` and `learner.loss` are looked up (default:
    /// [`Registry::builtin`]); a registry with an embedder's own entries makes them choosable
    /// from the config.
    pub fn registry(mut self, registry: Registry<B>) -> Self {
        self.registry = Some(registry);
        self
    }

    /// The rollout engine (default: [`GroupSampler`] with `rollout_prompts_per_call`, i.e.
    /// [`Policy::sample`]; `conrub train` sets an [`InProcessEngine`](crate::InProcessEngine)
    /// with the `[rollout]` table's pool).
    pub fn rollout(
        mut self,
        rollout: impl RolloutEngine<B::InnerBackend, P::InnerModule> + 'static,
    ) -> Self {
        self.rollout = Some(Box::new(rollout));
        self
    }

    /// Ids that end a response (for a `conrub_models` policy: `Pretrained::stop_ids()`). Without them (the default) every
    /// response runs to `max_response_tokens`.
    pub fn stop_ids(mut self, ids: Vec<u32>) -> Self {
        self.stop_ids = ids;
        self
    }

    /// Makes the learner one rank of a data-parallel group (used by [`crate::DataParallel`]).
    pub fn rank(mut self, slot: RankSlot<B::InnerBackend>) -> Self {
        self.rank = Some(slot);
        self
    }

    /// The learner, with a fresh AdamW.
    pub fn build(mut self) -> Result<Learner<B, P, T>> {
        let cfg = self.cfg;
        cfg.validate()?;
        if cfg.activation_checkpointing {
            self.policy.enable_activation_checkpointing()?;
        }
        if cfg.entropy_coeff != 0.0 {
            self.policy.enable_entropy_gradient()?;
        }
        let codec = self
            .codec
            .ok_or_else(|| GrpoError::config("learner", "no codec: call LearnerBuilder::codec"))?;
        let rewards = self.rewards.ok_or_else(|| {
            GrpoError::config("learner", "no reward source: call LearnerBuilder::rewards")
        })?;
        let breaker: Box<dyn TieBreaker> = match (self.tie_breaker, cfg.tie_mode) {
            (Some(b), _) => b,
            (None, TieMode::Off) => Box::new(NoTieBreaker),
            (None, mode) => {
                return Err(GrpoError::config(
                    "learner.tie_mode",
                    format!("{mode:?} needs a tie breaker: call LearnerBuilder::tie_breaker"),
                ))
            }
        };
        let registry = self.registry.unwrap_or_default();
        let estimator = match self.estimator {
            Some(e) => e,
            None => registry.estimator(&cfg)?,
        };
        let loss = registry.loss(&cfg)?;
        let rollout = self.rollout.unwrap_or_else(|| {
            Box::new(GroupSampler {
                prompts_per_call: cfg.rollout_prompts_per_call,
            })
        });
        let mut update = Update::new(UpdateConfig {
            lr: cfg.lr,
            weight_decay: cfg.weight_decay,
            beta1: cfg.beta1,
            beta2: cfg.beta2,
            eps: cfg.adam_eps,
            max_grad_norm: cfg.max_grad_norm,
        });
        // A schedule that needs the run's length waits for `Learner::set_training_steps`.
        let schedule_ready = match LrSchedule::new(&cfg, None) {
            Ok(schedule) => {
                update.set_schedule(schedule);
                true
            }
            Err(_) => false,
        };
        let reference =
            (cfg.kl_beta != 0.0 || cfg.kl_in_reward != 0.0).then(|| self.policy.valid());
        Ok(Learner {
            policy: self.policy,
            update,
            advantages: TieAwareAdvantages::new(estimator, cfg.tie_mode, breaker),
            cfg,
            device: self.device,
            reference,
            step: 0,
            codec,
            rewards,
            rollout,
            loss,
            stop_ids: self.stop_ids,
            rank: self.rank,
            skipped_in_a_row: 0,
            unscored_in_a_row: 0,
            schedule_ready,
        })
    }
}

/// Where a backward pass's gradients go.
enum GradTarget<'a, B: AutodiffBackend> {
    /// Added into the optimizer step's running sum.
    Sum(&'a mut GradientsParams),
    /// Reduce-scattered piece by piece into this rank's part of the sum (`sharding =
    /// "gradients"`).
    Scatter(&'a mut ShardedSum<B>, &'a mut CommStats),
}

/// What the update stage measured (its gradient norms read one per optimizer step, the rest in
/// one transfer); all zero for a step that did not update.
#[derive(Debug, Clone, Default)]
pub(crate) struct UpdateStats {
    grad_norms: Vec<f64>,
    optimizer_steps: usize,
    skipped_optimizer_steps: usize,
    loss: f64,
    clip_low: f64,
    clip_high: f64,
    kl: Option<f64>,
    entropy: Option<f64>,
    tokens_computed: u64,
    tokens_needed: u64,
    pub comm: CommStats,
    /// The rate of the last optimizer step so far.
    lr: f64,
}

impl<B, P, T> Learner<B, P, T>
where
    B: AutodiffBackend + GrpoOps,
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

    /// `samples` answers of the current policy to each conversation of `prompts` (prompt-major),
    /// through this learner's rollout engine and codec, with `sampling`. Training state is
    /// untouched (validation during training uses it: `conrub_trainer::Validator`).
    pub fn generate(
        &self,
        prompts: &[Vec<conrub_rubric::Message>],
        samples: usize,
        sampling: &SamplingConfig,
    ) -> Result<Vec<crate::rollout::Answer>> {
        self.generate_with(&self.policy.valid(), prompts, samples, sampling)
    }

    /// [`Learner::generate`] from `inner` (a sharded group's whole policy) instead of this
    /// learner's own.
    pub fn generate_with(
        &self,
        inner: &P::InnerModule,
        prompts: &[Vec<conrub_rubric::Message>],
        samples: usize,
        sampling: &SamplingConfig,
    ) -> Result<Vec<crate::rollout::Answer>> {
        let ids: Vec<Vec<u32>> = prompts
            .iter()
            .map(|m| self.codec.encode_prompt(m))
            .collect::<conrub_contracts::Result<_>>()?;
        if ids.iter().any(Vec::is_empty) {
            return Err(GrpoError::Stage("a prompt renders to no tokens".into()));
        }
        self.rollout.sync_weights(inner, self.step)?;
        let request = RolloutRequest {
            prompts: &ids,
            group_size: samples,
            sampling,
            step: self.step,
            first_group: 0,
        };
        let mut batch = self.rollout.rollout(inner, &request, &self.device)?;
        batch.check_shape(prompts.len(), samples)?;
        let mut texts = self.decode_all(&batch)?;
        cut_at_stop_strings(&mut batch, &mut texts, self.codec.as_ref(), &self.cfg.stop)?;
        Ok(texts
            .into_iter()
            .zip(batch.responses.iter().zip(&batch.finish_reasons))
            .map(|(text, (r, &f))| crate::rollout::Answer::new(text, r.len(), f))
            .collect())
    }

    /// Every response of `batch` as text.
    fn decode_all(&self, batch: &RolloutBatch) -> Result<Vec<String>> {
        Ok(batch
            .responses
            .iter()
            .map(|r| self.codec.decode(r))
            .collect::<conrub_contracts::Result<_>>()?)
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
        if shard.total == 0 {
            return Err(GrpoError::NoRecords);
        }
        if !self.schedule_ready {
            LrSchedule::new(&self.cfg, None)?;
        }
        let k = self.cfg.group_size;
        let t0 = Instant::now();
        let (inner, gather_comm) = self.whole_inner()?;
        // An engine outside the process may not hold the policy's weights yet (a first step, a
        // resume, a warm-up); one that does skips this.
        let mut weight_sync = self.rollout.sync_weights(&inner, self.step)?;
        // Rollout seconds include the gather and the sync before them.
        let mut times = (t0.elapsed().as_secs_f64(), 0.0);
        let candidates: Vec<(usize, &T)> = records
            .iter()
            .enumerate()
            .map(|(i, r)| (shard.first + i, *r))
            .collect();
        let first = self
            .rollout_and_score(&inner, candidates, &mut times)
            .await?;
        // Every drawn response counts toward the scored share, trained on or not.
        let all_scores: Vec<GroupScores>;
        let (scored, shard, dynamic) = if self.cfg.dynamic_sampling {
            let (scored, kept, shard, refilled) = self
                .refill(&inner, first, reserve, shard, &mut times)
                .await?;
            all_scores = scored.scores.clone();
            (select_scored(scored, &kept), shard, Some(refilled))
        } else {
            all_scores = Vec::new();
            (first, shard, None)
        };
        let (rollout_secs, judge_secs) = times;
        let prompts: Vec<usize> = scored.prompts.iter().map(|(i, _)| *i).collect();
        let records: Vec<&T> = scored.prompts.iter().map(|(_, r)| *r).collect();
        let records = records.as_slice();
        let (rollout, texts, scores) = (scored.rollout, scored.texts, scored.scores);
        let all_scores = if dynamic.is_some() {
            &all_scores
        } else {
            &scores
        };
        // With KL in the reward, the old and reference log-probs come before the advantages
        // (and with them the rows of every rank); otherwise after, as the update's first part.
        let t2 = Instant::now();
        let early = match self.cfg.kl_in_reward != 0.0 {
            true => Some(self.rows_and_logprobs(&inner, &rollout, shard)?),
            false => None,
        };
        let kl = early.as_ref().map(|(_, l)| self.sequence_kl(l));
        let before_advantages = t2.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let outcomes = self
            .advantage_stage(records, &rollout, &texts, &scores, kl.as_deref())
            .await;
        if let Some((g, o)) = outcomes
            .iter()
            .enumerate()
            .find(|(_, o)| o.advantages.len() != k)
        {
            return Err(GrpoError::Stage(format!(
                "advantages of group {g} ({}): {} values for {k} responses",
                records[g].id(),
                o.advantages.len()
            )));
        }
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
        let dpo_pairs: Vec<(usize, usize)> = if self.cfg.tie_mode == TieMode::GrpoDpo {
            outcomes
                .iter()
                .enumerate()
                .flat_map(|(g, o)| {
                    o.accepted_pairs()
                        .into_iter()
                        .map(move |(w, l)| (g * k + w, g * k + l))
                })
                .collect()
        } else {
            Vec::new()
        };
        let mut update = if self.enough_scored(all_scores)? {
            self.update_stage(&batch, &dpo_pairs, &rows)?
        } else {
            UpdateStats::default()
        };
        update.comm.add(&gather_comm);
        update.lr = self.update.last_lr();
        // The new weights go to the engine before the next rollout reads them (a `full` rank
        // holds no whole weights here: its next step syncs the ones it gathers).
        if !self.parameters_sharded() {
            let synced = self
                .rollout
                .sync_weights(&self.policy.valid(), self.step + 1)?;
            weight_sync = weight_sync.plus(synced);
        }
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

    /// Stages 1 and 2 on `candidates`: their groups rolled out (streams by candidate index, so
    /// the same prompt gets the same responses on any number of ranks), cut at stop strings and
    /// scored. `times` gains the seconds of each stage.
    async fn rollout_and_score<'r>(
        &self,
        inner: &P::InnerModule,
        candidates: Vec<(usize, &'r T)>,
        times: &mut (f64, f64),
    ) -> Result<Scored<'r, T>> {
        let k = self.cfg.group_size;
        let records: Vec<&T> = candidates.iter().map(|(_, r)| *r).collect();
        let t0 = Instant::now();
        let first = candidates.first().map_or(0, |(i, _)| *i);
        let mut rollout = self.rollout_stage(inner, &records, first)?;
        rollout.check_shape(records.len(), k)?;
        let mut texts = self.decode_all(&rollout)?;
        cut_at_stop_strings(
            &mut rollout,
            &mut texts,
            self.codec.as_ref(),
            &self.cfg.stop,
        )?;
        times.0 += t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let scores = self.reward_stage(&records, &rollout, &texts).await;
        if let Some((g, s)) = scores.iter().enumerate().find(|(_, s)| s.scores.len() != k) {
            return Err(GrpoError::Stage(format!(
                "rewards of group {g} ({}): {} scores for {k} responses",
                records[g].id(),
                s.scores.len()
            )));
        }
        times.1 += t1.elapsed().as_secs_f64();
        Ok(Scored {
            prompts: candidates,
            rollout,
            texts,
            scores,
        })
    }

    /// Dynamic sampling: drops the groups of `scored` whose scored rewards are all equal and
    /// rolls out prompts of `reserve` in their place, round after round, until every rank has
    /// its share of groups with variance, `dynamic_sampling_rounds` extra rounds are spent or the
    /// reserve is used up. Every rank takes part in every round (the counts are all-gathered, so
    /// all decide alike); a round's shortfall is drawn in rank order, so the prompts drawn, and
    /// their responses, are the ones one device would draw. Returns every group scored, the
    /// ones to train on, their shard of the step, and the counts. When no rank kept a group the
    /// step trains on its first groups (their advantages are zero).
    async fn refill<'r>(
        &self,
        inner: &P::InnerModule,
        mut scored: Scored<'r, T>,
        reserve: &[&'r T],
        shard: Shard,
        times: &mut (f64, f64),
    ) -> Result<(Scored<'r, T>, Vec<usize>, Shard, Refilled)> {
        let target = scored.prompts.len();
        let varied = |s: &GroupScores| {
            let rewards: Vec<Option<f64>> = s.scores.iter().map(ResponseScore::reward).collect();
            crate::group::scored_rewards_differ(&rewards)
        };
        let mut kept: Vec<usize> = (0..target).filter(|&g| varied(&scored.scores[g])).collect();
        let (mut drawn, mut rounds) = (0usize, 1usize);
        // The scored and all responses this rank drew so far.
        let tally = |scores: &[GroupScores]| {
            let all = scores.iter().flat_map(|g| &g.scores);
            let scored = all.clone().filter(|s| s.is_scored()).count();
            (scored as f64, all.count() as f64)
        };
        let mut drawn_scores = tally(&scored.scores);
        let counts = loop {
            // Per rank: [groups still needed, groups kept, scored responses, responses].
            let counts = self.gather_counts(vec![
                (target - kept.len()) as f64,
                kept.len() as f64,
                drawn_scores.0,
                drawn_scores.1,
            ])?;
            let total_need: usize = counts.iter().map(|c| c[0] as usize).sum();
            let spent = rounds > self.cfg.dynamic_sampling_rounds;
            // When the judges failed on too many of the responses drawn so far, the step is not
            // refilled: its groups dropped for want of scores, not of variance (the scored-share
            // check then counts them).
            let (round_scored, round_all) = counts
                .iter()
                .fold((0.0, 0.0), |(s, a), c| (s + c[2], a + c[3]));
            let failing = round_all > 0.0 && round_scored / round_all < self.cfg.min_scored_share;
            if total_need == 0 || spent || failing || drawn >= reserve.len() {
                break counts;
            }
            let rank = self.rank.as_ref().map_or(0, |s| s.rank);
            let before: usize = counts[..rank].iter().map(|c| c[0] as usize).sum();
            let need = target - kept.len();
            let start = (drawn + before).min(reserve.len());
            let end = (drawn + before + need).min(reserve.len());
            if start < end {
                // Reserve prompts' streams follow the step's groups: index `total + position`.
                let extra: Vec<(usize, &T)> = (start..end)
                    .map(|p| (shard.total + p, reserve[p]))
                    .collect();
                let more = self.rollout_and_score(inner, extra, times).await?;
                let round = tally(&more.scores);
                drawn_scores = (drawn_scores.0 + round.0, drawn_scores.1 + round.1);
                let offset = scored.prompts.len();
                kept.extend(
                    (0..more.prompts.len())
                        .filter(|&g| varied(&more.scores[g]))
                        .map(|g| offset + g),
                );
                scored.prompts.extend(more.prompts);
                scored.rollout.append(more.rollout);
                scored.texts.extend(more.texts);
                scored.scores.extend(more.scores);
            }
            drawn = (drawn + total_need).min(reserve.len());
            rounds += 1;
        };
        let rank = self.rank.as_ref().map_or(0, |s| s.rank);
        let kept_total: usize = counts.iter().map(|c| c[1] as usize).sum();
        let (kept, shard) = if kept_total == 0 {
            ((0..target).collect(), shard)
        } else {
            let first = counts[..rank].iter().map(|c| c[1] as usize).sum();
            (
                kept,
                Shard {
                    first,
                    total: kept_total,
                },
            )
        };
        let mut trained = vec![false; scored.prompts.len()];
        kept.iter().for_each(|&g| trained[g] = true);
        let unscored = (0..trained.len())
            .filter(|&g| !trained[g])
            .flat_map(|g| &scored.scores[g].scores)
            .filter(|s| !s.is_scored())
            .count();
        let refilled = Refilled {
            dropped: scored.prompts.len() - kept.len(),
            drawn,
            rounds,
            unscored,
        };
        Ok((scored, kept, shard, refilled))
    }

    /// `counts` of every rank, in rank order (this learner's alone when it is not a rank).
    fn gather_counts(&self, counts: Vec<f64>) -> Result<Vec<Vec<f64>>> {
        match &self.rank {
            Some(slot) => Ok(slot.collective.all_gather(slot.rank, counts)?),
            None => Ok(vec![counts]),
        }
    }

    /// With `learner.entropy_coeff`: the term taken from each micro-batch's loss, from the
    /// policy's entropies `[responses, R]` and the loss mask (both masked alike): the coefficient
    /// times their aggregate under `learner.aggregation` ([`crate::aggregate_token_term`]).
    fn entropy_bonus<Bk: burn::tensor::backend::Backend>(
        &self,
    ) -> Option<impl Fn(Tensor<Bk, 2>, Tensor<Bk, 2>) -> Tensor<Bk, 1>> {
        let (coeff, aggregation, max) = (
            self.cfg.entropy_coeff,
            self.cfg.aggregation,
            self.cfg.max_response_tokens,
        );
        (coeff != 0.0).then_some(move |entropy: Tensor<Bk, 2>, mask: Tensor<Bk, 2>| {
            crate::loss::aggregate_token_term(entropy * mask.clone(), mask, aggregation, max)
                * coeff
        })
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
    fn whole_inner(&self) -> Result<(P::InnerModule, CommStats)> {
        let slot = self.rank.as_ref();
        let Some((slot, layout)) = slot.and_then(|s| s.parameters_sharded().map(|l| (s, l))) else {
            return Ok((self.policy.valid(), CommStats::default()));
        };
        let matrices = self.policy.matrix_dtype();
        let mut source = RankGather::new(&self.policy, slot, layout).casting(matrices);
        let whole = gathered_as(&self.policy.clone().no_grad(), &mut source, matrices)?;
        Ok((whole.valid(), source.comm))
    }

    /// Whether the step's scored share (responses whose every reward part was scored, over every
    /// rank) reaches `min_scored_share`; below it the step does not update the policy, and the
    /// `max_unscored_steps`-th such step in a row is an error with the judge's last message.
    fn enough_scored(&mut self, scores: &[GroupScores]) -> Result<bool> {
        let all = scores.iter().flat_map(|g| &g.scores);
        let mut counts = vec![
            all.clone().filter(|s| s.is_scored()).count() as f64,
            all.count() as f64,
        ];
        if let Some(slot) = &self.rank {
            let gathered = slot.collective.all_gather(slot.rank, counts)?;
            counts = vec![
                gathered.iter().map(|v| v[0]).sum(),
                gathered.iter().map(|v| v[1]).sum(),
            ];
        }
        let share = counts[0] / counts[1].max(1.0);
        if share >= self.cfg.min_scored_share {
            self.unscored_in_a_row = 0;
            return Ok(true);
        }
        self.unscored_in_a_row += 1;
        if self.unscored_in_a_row < self.cfg.max_unscored_steps {
            return Ok(false);
        }
        let last = scores
            .iter()
            .flat_map(|g| &g.scores)
            .rev()
            .find_map(|s| match s {
                ResponseScore::Unscored(r) => Some(r.message.clone()),
                _ => None,
            })
            .unwrap_or_else(|| "(on another rank)".into());
        Err(GrpoError::Unscored {
            step: self.step,
            steps: self.unscored_in_a_row,
            share,
            min: self.cfg.min_scored_share,
            last,
        })
    }

    /// The sequence and response lengths of the whole step's rows and where this learner's rows
    /// start among them (gathered from every rank when data-parallel).
    fn global_rows(&self, rollout: &RolloutBatch, shard: Shard) -> Result<GlobalRows> {
        let n = rollout.rows();
        let seq: Vec<usize> = (0..n)
            .map(|r| rollout.prompt(r).len() + rollout.responses[r].len())
            .collect();
        // The tokens each row adds to the loss (a masked truncated response none).
        let response: Vec<usize> = rollout
            .responses
            .iter()
            .zip(self.loss_rows(rollout))
            .map(|(r, kept)| if kept { r.len() } else { 0 })
            .collect();
        let Some(slot) = &self.rank else {
            return Ok(GlobalRows {
                seq_lens: seq,
                lens: response,
                first: 0,
            });
        };
        let mine: Vec<f64> = seq.iter().chain(&response).map(|&l| l as f64).collect();
        let gathered = slot.collective.all_gather(slot.rank, mine)?;
        let first = gathered[..slot.rank].iter().map(|v| v.len() / 2).sum();
        let (mut seq_lens, mut lens) = (Vec::new(), Vec::new());
        for v in &gathered {
            let (s, r) = v.split_at(v.len() / 2);
            seq_lens.extend(s.iter().map(|&l| l as usize));
            lens.extend(r.iter().map(|&l| l as usize));
        }
        if lens.len() != shard.total * self.cfg.group_size {
            return Err(GrpoError::Stage(format!(
                "rank {}: the ranks hold {} rows for {} groups of {}",
                slot.rank,
                lens.len(),
                shard.total,
                self.cfg.group_size
            )));
        }
        Ok(GlobalRows {
            seq_lens,
            lens,
            first,
        })
    }

    /// The micro-batches of the step's rows `range` (global indices) that hold this learner's
    /// rows, as indices into its train batch: the one-device plan of the whole step, cut to this
    /// learner's rows. Micro-batches never span two groups and ranks own whole groups, so the
    /// cut only drops other ranks' micro-batches.
    fn local_micro_batches(
        &self,
        rows: &GlobalRows,
        range: Range<usize>,
        local: usize,
    ) -> Vec<Range<usize>> {
        let end = rows.first + local;
        plan_micro_batches(
            &rows.seq_lens,
            range,
            self.cfg.micro_batch_tokens,
            self.cfg.group_size,
        )
        .into_iter()
        .filter_map(|m| {
            let (lo, hi) = (m.start.max(rows.first), m.end.min(end));
            (lo < hi).then(|| lo - rows.first..hi - rows.first)
        })
        .collect()
    }

    /// Stage 1: `group_size` responses per record, sampled on the inner backend.
    fn rollout_stage(
        &self,
        inner: &P::InnerModule,
        records: &[&T],
        first_group: usize,
    ) -> Result<RolloutBatch> {
        let prompts: Vec<Vec<u32>> = records
            .iter()
            .map(|r| {
                self.codec
                    .encode_prompt(r.messages())
                    .map_err(|e| GrpoError::Prompt {
                        id: r.id().to_string(),
                        message: match e {
                            conrub_contracts::ContractError::Prompt { message, .. } => message,
                            other => other.to_string(),
                        },
                    })
            })
            .collect::<Result<_>>()?;
        if let Some(i) = prompts.iter().position(Vec::is_empty) {
            return Err(GrpoError::Prompt {
                id: records[i].id().to_string(),
                message: "renders to no tokens".into(),
            });
        }
        let seed = stable_seed(self.cfg.seed, &format!("rollout/{}", self.step));
        let sampling = self.cfg.sampling(seed, &self.stop_ids);
        let request = RolloutRequest {
            prompts: &prompts,
            group_size: self.cfg.group_size,
            sampling: &sampling,
            step: self.step,
            first_group,
        };
        Ok(self.rollout.rollout(inner, &request, &self.device)?)
    }

    /// Stage 2: the rewards of every group, concurrently.
    async fn reward_stage(
        &self,
        records: &[&T],
        rollout: &RolloutBatch,
        texts: &[String],
    ) -> Vec<GroupScores> {
        let k = self.cfg.group_size;
        let lengths = rollout.lengths();
        futures::future::join_all(records.iter().enumerate().map(|(g, r)| {
            self.rewards.score_group(
                r,
                &texts[g * k..(g + 1) * k],
                &lengths[g * k..(g + 1) * k],
                self.step,
            )
        }))
        .await
    }

    /// Stage 3: advantages of every group; exact ties go to the tie breaker (concurrently).
    async fn advantage_stage(
        &self,
        records: &[&T],
        rollout: &RolloutBatch,
        texts: &[String],
        scores: &[GroupScores],
        kl: Option<&[f64]>,
    ) -> Vec<GroupOutcome> {
        let k = self.cfg.group_size;
        let lengths = rollout.lengths();
        let keys: Vec<String> = records
            .iter()
            .map(|r| format!("{}/{}", r.id(), self.step))
            .collect();
        let questions: Vec<String> = records.iter().map(|r| r.text()).collect();
        let rewards: Vec<Vec<Option<f64>>> = scores
            .iter()
            .map(|g| g.scores.iter().map(ResponseScore::reward).collect())
            .collect();
        // `learner.kl_in_reward`: each scored reward less its response's penalty.
        let shaped: Option<Vec<Vec<Option<f64>>>> = kl.map(|kl| {
            let beta = self.cfg.kl_in_reward;
            rewards
                .iter()
                .enumerate()
                .map(|(g, r)| {
                    r.iter()
                        .enumerate()
                        .map(|(i, x)| x.map(|x| x - beta * kl[g * k + i]))
                        .collect()
                })
                .collect()
        });
        futures::future::join_all((0..records.len()).map(|g| {
            let group = TiedGroup {
                group_key: &keys[g],
                question: &questions[g],
                criteria: &scores[g].criteria,
                responses: &texts[g * k..(g + 1) * k],
                lengths: &lengths[g * k..(g + 1) * k],
            };
            let rewards = &rewards[g];
            let shaped = shaped.as_ref().map(|s| s[g].as_slice());
            async move {
                self.advantages
                    .group_shaped(rewards, shaped, k, &group)
                    .await
            }
        }))
        .await
    }

    /// Stage 4: the train batch on the device: the tokens and old (and reference) log-probs of
    /// [`Self::batch_logprobs`], one upload of the advantages.
    fn train_batch(
        &self,
        rollout: &RolloutBatch,
        outcomes: &[GroupOutcome],
        logprobs: BatchLogprobs<B>,
    ) -> TrainBatch<B> {
        let n = rollout.rows();
        let width = logprobs.tokens.positions.dims()[1];
        let advantages: Vec<f32> = outcomes
            .iter()
            .flat_map(|o| o.advantages.iter().map(|&a| a as f32))
            .collect();
        // The engine's log-probs, right-padded like `logp_old` (only the TIS correction reads them).
        let logp_engine = self.cfg.tis_cap.map(|_| {
            let mut flat = vec![0f32; n * width];
            for (r, l) in rollout.logprobs.iter().enumerate() {
                let t = l.len().min(width);
                flat[r * width..r * width + t].copy_from_slice(&l[..t]);
            }
            Tensor::from_data(TensorData::new(flat, [n, width]), &self.device)
        });
        TrainBatch {
            logp_old: logprobs.logp_old,
            logp_ref: logprobs.logp_ref,
            logp_engine,
            advantages: Tensor::from_data(TensorData::new(advantages, [n]), &self.device),
            tokens: logprobs.tokens,
            seq_lens: logprobs.seq_lens,
            response_lens: logprobs.response_lens,
            micro_batch_tokens: self.cfg.micro_batch_tokens,
            loss_rows: self.loss_rows(rollout),
        }
    }

    /// Every rank's rows (a collective: each rank's rollouts are then done, and the engine's
    /// are released), and this rank's old (and reference) log-probs over them.
    fn rows_and_logprobs(
        &self,
        inner: &P::InnerModule,
        rollout: &RolloutBatch,
        shard: Shard,
    ) -> Result<(GlobalRows, BatchLogprobs<B>)> {
        let rows = self.global_rows(rollout, shard)?;
        self.rollout.release()?;
        let logprobs = self.batch_logprobs(inner, rollout, &rows);
        Ok((rows, logprobs))
    }

    /// Per row, its response's summed per-token KL to the reference (`learner.kl_estimator`
    /// over the old log-probs), read back to the host: what `learner.kl_in_reward` weighs.
    fn sequence_kl(&self, logprobs: &BatchLogprobs<B>) -> Vec<f64> {
        match &logprobs.logp_ref {
            Some(logp_ref) => sequence_kl(
                self.cfg.kl_estimator,
                logprobs.logp_old.clone(),
                logp_ref.clone(),
            ),
            None => vec![0.0; logprobs.seq_lens.len()],
        }
    }

    /// The tokens of the step's rows on the device and their old (and reference) log-probs,
    /// computed micro-batch by micro-batch and kept there.
    fn batch_logprobs(
        &self,
        inner: &P::InnerModule,
        rollout: &RolloutBatch,
        rows: &GlobalRows,
    ) -> BatchLogprobs<B> {
        let n = rollout.rows();
        let tokens = TokenBatch::<B>::bucketed(
            (0..n).map(|r| (rollout.prompt(r), rollout.responses[r].as_slice())),
            &self.device,
        );
        let seq_lens: Vec<usize> = (0..n)
            .map(|r| rollout.prompt(r).len() + rollout.responses[r].len())
            .collect();
        let response_lens: Vec<usize> = rollout.responses.iter().map(Vec::len).collect();
        let width = tokens.positions.dims()[1];
        let full = (tokens.tokens.dims()[1], width);
        let budget = self.cfg.micro_batch_tokens;
        let inner_tokens = tokens.inner();
        let micro = self.local_micro_batches(rows, rows.first..rows.first + n, n);
        let logprobs = |model: &P::InnerModule| -> Tensor<B, 2> {
            let parts: Vec<_> = micro
                .iter()
                .map(|m| {
                    // The widths the update's slices of these rows take (`TrainBatch::widths`).
                    let (s, r) =
                        micro_batch_widths((&seq_lens, &response_lens), m.clone(), budget, full);
                    pad_columns(
                        model
                            .response_logprobs(&inner_tokens.slice(m.clone(), s, r))
                            .logprobs,
                        width,
                    )
                })
                .collect();
            if parts.is_empty() {
                // A rank without a group this step (fewer groups than ranks).
                return Tensor::zeros([0, width], &self.device);
            }
            Tensor::from_inner(Tensor::cat(parts, 0))
        };
        BatchLogprobs {
            logp_old: logprobs(inner),
            logp_ref: self.reference.as_ref().map(logprobs),
            tokens,
            seq_lens,
            response_lens,
        }
    }

    /// Per row: whether the loss counts it (`learner.mask_truncated` leaves responses cut at
    /// the length limit out).
    fn loss_rows(&self, rollout: &RolloutBatch) -> Vec<bool> {
        rollout
            .finish_reasons
            .iter()
            .map(|f| !(self.cfg.mask_truncated && *f == FinishReason::Length))
            .collect()
    }

    /// Stage 5: PPO epochs over mini-batches; each mini-batch accumulates the gradients of its
    /// micro-batches (slices of `batch`), then clips globally and steps the optimizer.
    ///
    /// Mini-batches are cut from the whole step's rows (`rows`); a data-parallel rank takes its
    /// part of each (possibly none), weights its micro-batches by the mini-batch's global counts,
    /// and all-reduces the summed gradients before the optimizer step, so every rank applies the
    /// update one device would for the same rows.
    fn update_stage(
        &mut self,
        batch: &TrainBatch<B>,
        dpo_pairs: &[(usize, usize)],
        rows: &GlobalRows,
    ) -> Result<UpdateStats> {
        let n = rows.lens.len();
        let size = n.div_ceil(self.cfg.mini_batches).max(1);
        let minis: Vec<Range<usize>> = (0..n).step_by(size).map(|s| s..(s + size).min(n)).collect();
        let local = rows.first..rows.first + batch.rows();
        // Gradient norms of the optimizer steps taken (read one scalar per optimizer step, so a
        // non-finite norm stops or skips that step before it changes the weights).
        let mut norms: Vec<f64> = Vec::new();
        let mut skipped = 0usize;
        // Last PPO epoch, per micro-batch (kept on the device, read once, summed on the host in
        // f64): weighted loss, clip_low x tokens, clip_high x tokens, kl x tokens, entropy sum.
        let mut micro_parts: Vec<Tensor<B::InnerBackend, 1>> = Vec::new();
        let (mut token_count, mut has_entropy) = (0usize, false);
        // Token positions the policy's forward passes computed (padding included) and needed.
        let (mut computed, mut needed) = (0usize, 0usize);
        let mut comm = CommStats::default();
        // `sharding = "gradients"`: each micro-batch's gradients are reduce-scattered when its
        // backward is done, so the running sum holds this rank's parameters only.
        let scatter_each = self
            .rank
            .as_ref()
            .is_some_and(|s| s.sharding.shards_gradients() && s.sharded().is_some());
        for epoch in 0..self.cfg.ppo_epochs {
            let last = epoch + 1 == self.cfg.ppo_epochs;
            for mini in &minis {
                let mini_tokens: usize = rows.lens[mini.clone()].iter().sum();
                // This learner's rows of the mini-batch (maybe none), as indices into `batch`.
                let lo = mini.start.clamp(local.start, local.end);
                let mine = lo - rows.first..mini.end.clamp(lo, local.end) - rows.first;
                let pairs: Vec<(usize, usize)> = dpo_pairs
                    .iter()
                    .copied()
                    .filter(|(w, _)| mine.contains(w))
                    .collect();
                let micros = self.local_micro_batches(rows, mini.clone(), batch.rows());
                // Backward passes this rank makes, and the most any rank makes: with
                // `scatter_each` every pass reduce-scatters its pieces, so a rank with fewer
                // joins the others' reduce-scatters with zeros for the difference.
                let passes = micros.len() + usize::from(!pairs.is_empty());
                let rounds = if scatter_each {
                    self.most_on_any_rank(passes)?
                } else {
                    passes
                };
                // The running sum of the mini-batch's gradients: each micro-batch adds into it
                // as its backward goes (`Policy::loss_gradients_into`), or, with
                // `scatter_each`, this rank's reduced part of it.
                let mut acc = GradientsParams::new();
                let mut sharded = ShardedSum::<B>::new();
                for micro in micros {
                    let mb = batch.slice(micro.clone());
                    computed += mb.tokens.tokens.dims().iter().product::<usize>();
                    needed += mb.seq_lens.iter().sum::<usize>();
                    // Weights that make the sum over micro-batches the mini-batch's aggregate.
                    let weight = self.loss.micro_batch_weight(
                        micro.len(),
                        mini.len(),
                        mb.loss_tokens(),
                        mini_tokens,
                    );
                    let mut parts: Option<Tensor<B::InnerBackend, 1>> = None;
                    let loss = &self.loss;
                    let entropy_bonus = self.entropy_bonus::<B>();
                    let mut micro_loss = |out_lp: ResponseLogprobs<B>| {
                        // `learner.entropy_coeff`: the policy's entropies, aggregated as the loss
                        // is, times the coefficient, taken from the loss.
                        let bonus = entropy_bonus
                            .as_ref()
                            .zip(out_lp.entropy.clone())
                            .map(|(f, e)| f(e, mb.loss_mask()));
                        let mut out = loss.compute(SurrogateBatch {
                            logp: out_lp.logprobs,
                            logp_old: mb.logp_old.clone(),
                            advantages: mb.advantages.clone(),
                            mask: mb.loss_mask(),
                            logp_ref: mb.logp_ref.clone(),
                            logp_engine: mb.logp_engine.clone(),
                        });
                        if let Some(b) = bonus {
                            out.loss = out.loss - b;
                        }
                        if last {
                            let w = mb.loss_tokens() as f64;
                            let f32_of = |t: Tensor<B, 1>| t.detach().inner().cast(DType::F32);
                            let zero = || {
                                Tensor::<B::InnerBackend, 1>::zeros([1], &out.clip_low.device())
                                    .cast(DType::F32)
                            };
                            has_entropy |= out_lp.entropy.is_some();
                            parts = Some(Tensor::cat(
                                vec![
                                    f32_of(out.loss.clone()) * weight,
                                    f32_of(out.clip_low.clone()) * w,
                                    f32_of(out.clip_high.clone()) * w,
                                    out.kl.clone().map(|k| f32_of(k) * w).unwrap_or_else(zero),
                                    out_lp
                                        .entropy
                                        .map(|e| f32_of((e * mb.loss_mask()).sum()))
                                        .unwrap_or_else(zero),
                                ],
                                0,
                            ));
                        }
                        out.loss * weight
                    };
                    let target = if scatter_each {
                        GradTarget::Scatter(&mut sharded, &mut comm)
                    } else {
                        GradTarget::Sum(&mut acc)
                    };
                    self.gradients(&mb.tokens, &mut micro_loss, target)?;
                    if let Some(v) = parts {
                        micro_parts.push(v);
                        token_count += mb.loss_tokens();
                    }
                }
                if !pairs.is_empty() {
                    let target = if scatter_each {
                        GradTarget::Scatter(&mut sharded, &mut comm)
                    } else {
                        GradTarget::Sum(&mut acc)
                    };
                    self.dpo_gradients(batch, &pairs, n, target)?;
                }
                for _ in passes..rounds {
                    self.idle_pass(&mut sharded, &mut comm)?;
                }
                let (norm, stepped) =
                    self.reduce_and_step(acc, sharded, scatter_each, &mut comm)?;
                if stepped {
                    self.skipped_in_a_row = 0;
                    norms.push(norm);
                } else {
                    self.skip_nonfinite(norm)?;
                    skipped += 1;
                }
            }
        }
        if !norms.is_empty() {
            self.check_weights_finite()?;
        }
        // The one read of the update's other numbers.
        let steps = norms.len();
        let per_micro: Vec<f64> = if micro_parts.is_empty() {
            Vec::new()
        } else {
            Tensor::cat(micro_parts, 0)
                .into_data()
                .convert::<f64>()
                .into_vec()
                .expect("f64 metrics")
        };
        let mut s = vec![0f64; 5];
        for part in per_micro.chunks(5) {
            for (acc, x) in s.iter_mut().zip(part) {
                *acc += x;
            }
        }
        s.extend([
            token_count as f64,
            has_entropy as u8 as f64,
            computed as f64,
            needed as f64,
        ]);
        if let Some(slot) = &self.rank {
            // Every rank's sums, added in rank order: the same numbers on every rank.
            let all = slot.collective.all_gather(slot.rank, s)?;
            s = (0..all[0].len())
                .map(|i| all.iter().map(|v| v[i]).sum())
                .collect();
        }
        let tokens = s[5].max(1.0);
        Ok(UpdateStats {
            grad_norms: norms,
            optimizer_steps: steps,
            skipped_optimizer_steps: skipped,
            loss: s[0] / minis.len().max(1) as f64,
            clip_low: s[1] / tokens,
            clip_high: s[2] / tokens,
            kl: (self.cfg.kl_beta != 0.0).then(|| s[3] / tokens),
            entropy: (s[6] > 0.0).then(|| s[4] / tokens),
            tokens_computed: s[7] as u64,
            tokens_needed: s[8] as u64,
            comm,
            lr: self.update.last_lr(),
        })
    }

    /// The largest of every rank's `count` (one host exchange).
    fn most_on_any_rank(&self, count: usize) -> Result<usize> {
        let Some(slot) = &self.rank else {
            return Ok(count);
        };
        let all = slot.collective.all_gather(slot.rank, vec![count as f64])?;
        Ok(all.iter().map(|v| v[0] as usize).max().unwrap_or(count))
    }

    /// The gradients of `loss` on `tokens` into `target`: added into a running sum, or each
    /// piece reduce-scattered as the backward makes it ([`Policy::loss_gradients_each`]).
    fn gradients(
        &self,
        tokens: &TokenBatch<B>,
        loss: &mut dyn FnMut(ResponseLogprobs<B>) -> Tensor<B, 1>,
        target: GradTarget<'_, B>,
    ) -> Result<()> {
        match target {
            GradTarget::Sum(acc) => {
                let sum = std::mem::take(acc);
                *acc = self.policy.loss_gradients_into(tokens, loss, sum);
                Ok(())
            }
            GradTarget::Scatter(sum, comm) => {
                let slot = self.rank.as_ref().expect("a sharded rank");
                let layout = slot.sharded().expect("a sharded rank");
                let mut failed = None;
                let mut sink = |piece| {
                    if failed.is_none() {
                        failed = sum.add(&self.policy, piece, slot, layout, comm).err();
                    }
                };
                if slot.parameters_sharded().is_some() {
                    let mut source = RankGather::new(&self.policy, slot, layout);
                    let gathered =
                        self.policy
                            .loss_gradients_gathered(tokens, loss, &mut sink, &mut source);
                    comm.add(&source.comm);
                    if let (Err(e), None) = (gathered, &failed) {
                        failed = Some(e.into());
                    }
                } else {
                    self.policy.loss_gradients_each(tokens, loss, &mut sink);
                }
                match failed {
                    Some(e) => Err(e),
                    None => sum.end_pass(slot),
                }
            }
        }
    }

    /// A round in which this rank has no backward pass of its own (fewer micro-batches than
    /// another rank): it joins the others' reduce-scatters with zeros.
    ///
    /// A `full` rank instead runs a backward pass of zero loss on one token: the others'
    /// passes gather each segment from every rank, this one included, in the same order.
    fn idle_pass(&self, sum: &mut ShardedSum<B>, comm: &mut CommStats) -> Result<()> {
        let slot = self.rank.as_ref().expect("a sharded rank");
        if slot.parameters_sharded().is_some() {
            let one = TokenBatch::<B>::bucketed([(&[0u32][..], &[0u32][..])], &self.device);
            let mut zero = |lp: ResponseLogprobs<B>| lp.logprobs.sum() * 0.0;
            return self.gradients(&one, &mut zero, GradTarget::Scatter(sum, comm));
        }
        let layout = slot.sharded().expect("a sharded rank");
        sum.idle_pass(&self.policy, slot, layout, comm)
    }

    /// The optimizer step of a mini-batch whose gradients are `acc` (this rank's, unreduced)
    /// or, when `scattered`, already in `sharded`: reduced over the group's ranks as its
    /// sharding says, clipped by the global norm and applied (a sharded rank steps its own
    /// parameters, then gathers the others'). Returns the norm and whether the step was taken.
    fn reduce_and_step(
        &mut self,
        acc: GradientsParams,
        mut sharded: ShardedSum<B>,
        scattered: bool,
        comm: &mut CommStats,
    ) -> Result<(f64, bool)> {
        let Some(slot) = self.rank.clone() else {
            let (policy, norm, stepped) = self.update.apply_if_finite(self.policy.clone(), acc);
            self.policy = policy;
            return Ok((norm, stepped));
        };
        let Some(layout) = slot.sharded() else {
            let grads = crate::buckets::all_reduce(&self.policy, acc, &slot, comm)?;
            let (policy, norm, stepped) = self.update.apply_if_finite(self.policy.clone(), grads);
            self.policy = policy;
            return Ok((norm, stepped));
        };
        if !scattered {
            sharded.add(&self.policy, acc, &slot, layout, comm)?;
        }
        let (grads, norm, updated) = sharded.finish(&self.policy, &slot, layout)?;
        let (policy, norm, stepped) = self
            .update
            .apply_with_norm(self.policy.clone(), grads, norm);
        // A `full` rank keeps its own parameters only: the next uses gather them.
        self.policy = if stepped && !slot.sharding.shards_parameters() {
            crate::buckets::all_gather_weights(policy, &updated, &slot, layout, comm)?
        } else {
            policy
        };
        Ok((norm, stepped))
    }

    /// An optimizer step whose gradient norm is `norm` (non-finite) was not taken: an error
    /// under `learner.on_nonfinite = "stop"`, and under `"skip-step"` once
    /// `learner.max_skipped_steps` were skipped in a row.
    fn skip_nonfinite(&mut self, norm: f64) -> Result<()> {
        let at = format!("step {}", self.step);
        let what = format!("the gradient norm is {norm} (a non-finite loss or gradient)");
        match self.cfg.on_nonfinite {
            OnNonFinite::Stop => Err(GrpoError::NonFinite { at, what }),
            OnNonFinite::SkipStep => {
                self.skipped_in_a_row += 1;
                if self.skipped_in_a_row > self.cfg.max_skipped_steps {
                    return Err(GrpoError::NonFinite {
                        at,
                        what: format!(
                            "{what}, {} optimizer steps skipped in a row (learner.max_skipped_steps = {})",
                            self.skipped_in_a_row, self.cfg.max_skipped_steps
                        ),
                    });
                }
                Ok(())
            }
        }
    }

    /// Every weight of the policy is finite after the step's updates (one device reduction and
    /// one scalar read); a non-finite one stops the run whatever `learner.on_nonfinite` says.
    fn check_weights_finite(&self) -> Result<()> {
        let sum = crate::update::nonfinite_probe(&self.policy);
        if sum.is_finite() {
            return Ok(());
        }
        Err(GrpoError::NonFinite {
            at: format!("step {}", self.step),
            what: "a weight is not finite after the update".into(),
        })
    }

    /// Gradients of the GRPO+DPO baseline term for accepted `(winner, loser)` rows, added into
    /// `sum` (the mini-batch's running sum). `total` is the step's row count (the term is
    /// normalised by it).
    fn dpo_gradients(
        &self,
        batch: &TrainBatch<B>,
        pairs: &[(usize, usize)],
        total: usize,
        target: GradTarget<'_, B>,
    ) -> Result<()> {
        let rows: Vec<usize> = pairs.iter().flat_map(|&(w, l)| [w, l]).collect();
        let index = row_index::<B>(&rows, &self.device);
        // Padding cut to the bucket of the longest of these rows, as for a micro-batch.
        let (seq_len, response_len) = batch.widths(rows.iter().copied());
        let tokens = batch
            .tokens
            .select(index.clone())
            .slice(0..rows.len(), seq_len, response_len);
        let old = batch
            .logp_old
            .clone()
            .select(0, index)
            .sum_dim(1)
            .reshape([rows.len()]);
        let p = pairs.len();
        let winners = row_index::<B>(&(0..p).map(|i| 2 * i).collect::<Vec<_>>(), &self.device);
        let losers = row_index::<B>(&(0..p).map(|i| 2 * i + 1).collect::<Vec<_>>(), &self.device);
        let beta = self.cfg.dpo_beta;
        self.gradients(
            &tokens,
            &mut |lp| {
                let seq = lp.logprobs.sum_dim(1).reshape([rows.len()]);
                dpo_pair_loss(
                    seq.clone().select(0, winners.clone()),
                    seq.select(0, losers.clone()),
                    old.clone().select(0, winners.clone()),
                    old.clone().select(0, losers.clone()),
                    beta,
                    total,
                )
            },
            target,
        )
    }
}

/// Stage 6: the step's metrics (host arithmetic on what the stages returned).
fn step_metrics(
    step: u64,
    rollout: &RolloutBatch,
    scores: &[GroupScores],
    outcomes: &[GroupOutcome],
    u: UpdateStats,
) -> StepMetrics {
    let n = rollout.rows();
    let rewards: Vec<Vec<Option<f64>>> = scores
        .iter()
        .map(|g| g.scores.iter().map(ResponseScore::reward).collect())
        .collect();
    let scored: Vec<f64> = rewards.iter().flatten().flatten().copied().collect();
    let mut m = StepMetrics {
        step,
        prompts: rollout.prompts.len(),
        responses: n,
        scored: scored.len(),
        unscored: n - scored.len(),
        grad_norms: u.grad_norms,
        optimizer_steps: u.optimizer_steps,
        skipped_optimizer_steps: u.skipped_optimizer_steps,
        loss: u.loss,
        clip_low: u.clip_low,
        clip_high: u.clip_high,
        kl: u.kl,
        entropy: u.entropy,
        update_tokens_computed: u.tokens_computed,
        update_tokens_needed: u.tokens_needed,
        lr: u.lr,
        ..Default::default()
    };
    if !scored.is_empty() {
        let mean = scored.iter().sum::<f64>() / scored.len() as f64;
        m.reward_mean = mean;
        m.reward_std_population = (scored.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>()
            / scored.len() as f64)
            .sqrt();
    }
    m.reward_histogram = vec![0; 20];
    for r in &scored {
        m.reward_histogram[reward_bin(*r)] += 1;
    }
    for (g, o) in outcomes.iter().enumerate() {
        record_group(&mut m.ties, o, rewards[g].first().copied().flatten());
    }
    let mut lens: Vec<usize> = rollout.responses.iter().map(Vec::len).collect();
    lens.sort_unstable();
    m.response_tokens = lens.iter().sum();
    m.response_len_mean = m.response_tokens as f64 / n.max(1) as f64;
    m.response_len_p90 = lens
        .get(((0.9 * n as f64).ceil() as usize).clamp(1, n.max(1)) - 1)
        .copied()
        .unwrap_or(0);
    m.response_len_max = lens.last().copied().unwrap_or(0);
    m.truncated = rollout.truncated().filter(|t| *t).count();
    let e = &rollout.telemetry;
    (
        m.rollout_preemptions,
        m.rollout_kv_blocks,
        m.rollout_peak_kv_blocks,
        m.rollout_peak_running_rows,
    ) = (
        e.preemptions,
        e.kv_blocks,
        e.peak_kv_blocks,
        e.peak_running_rows,
    );
    (
        m.rollout_mean_running_rows,
        m.rollout_prefill_tokens,
        m.rollout_decode_steps,
    ) = (e.mean_running_rows, e.prefill_tokens, e.decode_steps);
    (m.rollout_tokens_computed, m.rollout_tokens_needed) =
        (e.tokens_computed as u64, e.tokens_needed as u64);
    m.judge_retries = scores.iter().map(|g| g.judge_retries as u64).sum();
    m.judge_deferred = scores.iter().map(|g| g.judge_deferred).sum();
    let criteria: usize = scores
        .iter()
        .map(|g| g.scores.len() * g.criteria.len())
        .sum();
    m.judge_deferred_share = m.judge_deferred as f64 / criteria.max(1) as f64;
    m.judge_latency_ms = scores.iter().map(|g| g.judge_latency_ms).sum::<f64>() / n.max(1) as f64;
    m
}

/// The sequence lengths of a whole step's rows, the tokens each adds to the loss (its response
/// length, 0 for a masked truncated response), and the index among them of a learner's first.
pub(crate) struct GlobalRows {
    pub seq_lens: Vec<usize>,
    pub lens: Vec<usize>,
    pub first: usize,
}

/// The groups `keep` of `scored`, in that order.
fn select_scored<'r, T>(scored: Scored<'r, T>, keep: &[usize]) -> Scored<'r, T> {
    let k = scored.rollout.group_size;
    Scored {
        prompts: keep.iter().map(|&g| scored.prompts[g]).collect(),
        texts: keep
            .iter()
            .flat_map(|&g| scored.texts[g * k..(g + 1) * k].iter().cloned())
            .collect(),
        scores: keep.iter().map(|&g| scored.scores[g].clone()).collect(),
        rollout: scored.rollout.select_groups(keep),
    }
}

/// The step's output from the parts of its ranks, in rank order (one part on one device): the
/// rollouts, scores and outcomes concatenated, the update's numbers (the same on every rank)
/// from rank 0, the stage times of the slowest rank, and the stragglers' times.
pub(crate) fn step_output(step: u64, k: usize, ranks: usize, parts: Vec<StepParts>) -> StepOutput {
    let max = |f: fn(&StepParts) -> f64| parts.iter().map(f).fold(0.0, f64::max);
    let min = |f: fn(&StepParts) -> f64| parts.iter().map(f).fold(f64::INFINITY, f64::min);
    let (rollout_max, rollout_min) = (max(|p| p.rollout_secs), min(|p| p.rollout_secs));
    let (update_max, update_min) = (max(|p| p.update_secs), min(|p| p.update_secs));
    let judge_secs = max(|p| p.judge_secs);
    // The busiest rank's bytes and seconds of each collective kind.
    let comm = parts
        .iter()
        .map(|p| p.update.comm)
        .fold(CommStats::default(), |a, b| CommStats {
            allreduce_bytes: a.allreduce_bytes.max(b.allreduce_bytes),
            allreduce_secs: a.allreduce_secs.max(b.allreduce_secs),
            reduce_scatter_bytes: a.reduce_scatter_bytes.max(b.reduce_scatter_bytes),
            reduce_scatter_secs: a.reduce_scatter_secs.max(b.reduce_scatter_secs),
            all_gather_bytes: a.all_gather_bytes.max(b.all_gather_bytes),
            all_gather_secs: a.all_gather_secs.max(b.all_gather_secs),
        });
    let dpo_pairs = parts.iter().map(|p| p.dpo_pairs).sum();
    // Shared engines sync once for all ranks: the slowest rank's sync is the step's.
    let weight_sync = parts
        .iter()
        .map(|p| p.weight_sync)
        .fold(WeightSync::default(), |a, b| WeightSync {
            secs: a.secs.max(b.secs),
            bytes: a.bytes.max(b.bytes),
        });
    let gap = LogprobGap::merge(parts.iter().map(|p| p.logprob_gap));
    let penalties: Vec<f64> = parts.iter().flat_map(|p| p.reward_kl.clone()).collect();
    let reward_kl_penalty =
        (!penalties.is_empty()).then(|| penalties.iter().sum::<f64>() / penalties.len() as f64);
    let device_memory: Vec<u64> = parts.iter().filter_map(|p| p.device_memory).collect();
    let prompts: Vec<usize> = parts.iter().flat_map(|p| p.prompts.clone()).collect();
    let dynamic = parts[0].dynamic.map(|d| Refilled {
        dropped: parts
            .iter()
            .filter_map(|p| p.dynamic)
            .map(|d| d.dropped)
            .sum(),
        unscored: parts
            .iter()
            .filter_map(|p| p.dynamic)
            .map(|d| d.unscored)
            .sum(),
        ..d
    });
    let mut parts = parts.into_iter();
    let first = parts.next().expect("a step has at least one part");
    let update = first.update.clone();
    let (mut rollout, mut texts, mut scores, mut outcomes) =
        (first.rollout, first.texts, first.scores, first.outcomes);
    for p in parts {
        rollout.append(p.rollout);
        texts.extend(p.texts);
        scores.extend(p.scores);
        outcomes.extend(p.outcomes);
    }
    let mut metrics = step_metrics(step, &rollout, &scores, &outcomes, update);
    metrics.dpo_pairs = dpo_pairs;
    (
        metrics.rollout_secs,
        metrics.judge_secs,
        metrics.update_secs,
    ) = (rollout_max, judge_secs, update_max);
    metrics.ranks = ranks;
    metrics.device_memory_reserved_bytes = device_memory;
    (metrics.allreduce_bytes, metrics.allreduce_secs) = (comm.allreduce_bytes, comm.allreduce_secs);
    (metrics.reduce_scatter_bytes, metrics.reduce_scatter_secs) =
        (comm.reduce_scatter_bytes, comm.reduce_scatter_secs);
    (metrics.all_gather_bytes, metrics.all_gather_secs) =
        (comm.all_gather_bytes, comm.all_gather_secs);
    (metrics.weight_sync_secs, metrics.weight_sync_bytes) = (weight_sync.secs, weight_sync.bytes);
    let tokens = gap.tokens.max(1) as f64;
    metrics.rollout_logprob_diff_mean = gap.abs_sum / tokens;
    metrics.rollout_logprob_diff_max = gap.abs_max;
    metrics.rollout_kl = gap.k3_sum / tokens;
    metrics.reward_kl_penalty = reward_kl_penalty;
    if let Some(d) = dynamic {
        metrics.dynamic_groups_dropped = Some(d.dropped);
        metrics.dynamic_prompts_drawn = Some(d.drawn);
        metrics.dynamic_rounds = Some(d.rounds);
        metrics.dynamic_unscored = Some(d.unscored);
    }
    (metrics.rollout_secs_rank_max, metrics.rollout_secs_rank_min) = (rollout_max, rollout_min);
    (metrics.update_secs_rank_max, metrics.update_secs_rank_min) = (update_max, update_min);
    let per_group = |rows: Vec<usize>| rows.chunks(k).map(<[usize]>::to_vec).collect();
    StepOutput {
        metrics,
        prompts,
        criteria: scores.iter().map(|g| g.criteria.clone()).collect(),
        scores: scores.into_iter().map(|g| g.scores).collect(),
        outcomes,
        responses: texts.chunks(k).map(<[String]>::to_vec).collect(),
        response_tokens: per_group(rollout.responses.iter().map(Vec::len).collect()),
        finish_reasons: rollout
            .finish_reasons
            .chunks(k)
            .map(<[FinishReason]>::to_vec)
            .collect(),
    }
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
