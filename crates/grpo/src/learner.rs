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
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor, TensorData};
use conrub_kernels::{Clip, GrpoOps};
use conrub_rollout::{Decoding, SamplingConfig};
use conrub_rubric::{ResponseScore, RubricRecord};
use serde::{Deserialize, Serialize};

use crate::advantages::{stable_seed, AdvantageEstimator, GroupRelative, ScaleRewards};
use crate::batch::{
    longest, pad_columns, plan_micro_batches, RolloutBatch, TokenBatch, TrainBatch,
};
use crate::codec::TextCodec;
use crate::error::{GrpoError, Result};
use crate::group::{reward_bin, GroupOutcome, TieAwareAdvantages, TieMode, TieStats};
use crate::loss::{dpo_pair_loss, Aggregation, PolicyLoss, SurrogateBatch};
use crate::policy::{row_index, Policy};
use crate::reward::{GroupScores, RewardSource};
use crate::rollout::{GroupSampler, RolloutEngine, RolloutRequest};
use crate::ties::{NoTieBreaker, TieBreaker, TiedGroup};
use crate::update::{Update, UpdateConfig};

/// Learner settings (the `[learner]` table of a train config). Defaults are the published run's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LearnerConfig {
    /// Responses per prompt (k).
    pub group_size: usize,
    /// Longest response in tokens (Lmax; also Dr. GRPO's length normaliser).
    pub max_response_tokens: usize,
    /// Rollout temperature.
    pub temperature: f64,
    /// Rollout nucleus threshold.
    pub top_p: f64,
    /// Rollout top-k (none by default).
    pub top_k: Option<usize>,
    /// Prompts sampled together in one generation call (rows = prompts x k).
    pub rollout_prompts_per_call: usize,
    /// Learning rate.
    pub lr: f64,
    /// AdamW weight decay.
    pub weight_decay: f64,
    /// AdamW beta1.
    pub beta1: f64,
    /// AdamW beta2.
    pub beta2: f64,
    /// AdamW epsilon.
    pub adam_eps: f64,
    /// Global gradient-norm clip (0 disables).
    pub max_grad_norm: f64,
    /// Ratio clipping.
    pub clip: Clip,
    /// Loss aggregation: `sequence-mean` (the method), `global-token-mean` or `dr-grpo`.
    pub aggregation: Aggregation,
    /// Advantage scaling: `group` (divide by the group's sample std, the method) or `none`.
    pub scale_rewards: ScaleRewards,
    /// Weight of the k3 KL to the initial policy (0: no reference model is kept).
    pub kl_beta: f64,
    /// What happens to exactly tied groups.
    pub tie_mode: TieMode,
    /// Beta of the GRPO+DPO baseline.
    pub dpo_beta: f64,
    /// Passes over each rollout batch.
    pub ppo_epochs: usize,
    /// Optimizer steps per pass (the batch is split into this many mini-batches).
    pub mini_batches: usize,
    /// Token budget (prompt + response, padded) of one micro-batch; gradients are accumulated
    /// over them.
    pub micro_batch_tokens: usize,
    /// Activation checkpointing per decoder layer: keep only each layer's input and recompute
    /// its forward during the backward (one extra forward per micro-batch; memory linear in
    /// layers x tokens x hidden). `true` makes [`LearnerBuilder::build`] call
    /// [`Policy::enable_activation_checkpointing`] (an error for a policy that cannot); `false`
    /// leaves the policy as it was built (a Qwen3 built with checkpointing in its `Execution`
    /// keeps it).
    pub activation_checkpointing: bool,
    /// Run seed.
    pub seed: u64,
}

impl Default for LearnerConfig {
    fn default() -> Self {
        Self {
            group_size: 8,
            max_response_tokens: 8192,
            temperature: 1.0,
            top_p: 1.0,
            top_k: None,
            rollout_prompts_per_call: 32,
            lr: 3e-6,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            adam_eps: 1e-8,
            max_grad_norm: 1.0,
            clip: Clip::default(),
            aggregation: Aggregation::SequenceMean,
            scale_rewards: ScaleRewards::Group,
            kl_beta: 0.0,
            tie_mode: TieMode::Pairwise,
            dpo_beta: 2.0,
            ppo_epochs: 1,
            mini_batches: 1,
            micro_batch_tokens: 16_384,
            activation_checkpointing: false,
            seed: 1234,
        }
    }
}

impl LearnerConfig {
    /// Checks ranges, naming the key.
    pub fn validate(&self) -> Result<()> {
        let bad = |k: &str, m: &str| Err(GrpoError::config(format!("learner.{k}"), m));
        if self.group_size < 2 {
            return bad("group_size", "must be at least 2");
        }
        if self.max_response_tokens == 0 {
            return bad("max_response_tokens", "must be at least 1");
        }
        if !(self.temperature > 0.0) {
            return bad("temperature", "must be > 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", "must be in (0, 1]");
        }
        if self.top_k == Some(0) {
            return bad("top_k", "must be at least 1");
        }
        if !(self.lr > 0.0) {
            return bad("lr", "must be > 0");
        }
        for (key, v) in [
            ("ppo_epochs", self.ppo_epochs),
            ("mini_batches", self.mini_batches),
            ("rollout_prompts_per_call", self.rollout_prompts_per_call),
        ] {
            if v == 0 {
                return bad(key, "must be at least 1");
            }
        }
        if !(self.clip.low > 0.0 && self.clip.low < 1.0 && self.clip.high > 0.0) {
            return bad("clip", "need 0 < low < 1 and high > 0");
        }
        Ok(())
    }

    /// The rollout's sampling settings at `seed` (stop ids as given).
    pub fn sampling(&self, seed: u64, stop_ids: &[u32]) -> SamplingConfig {
        SamplingConfig {
            max_new_tokens: self.max_response_tokens,
            decoding: Decoding::Sample {
                temperature: self.temperature,
                top_p: self.top_p,
                top_k: self.top_k,
            },
            seed,
            stop_ids: stop_ids.to_vec(),
        }
    }
}

/// Everything docs/METHOD.md §7 logs for one step.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// Step index (0-based, counted over the run).
    pub step: u64,
    /// Prompts in the step.
    pub prompts: usize,
    /// Responses in the step.
    pub responses: usize,
    /// Scored responses.
    pub scored: usize,
    /// Unscored responses.
    pub unscored: usize,
    /// Mean reward over scored responses.
    pub reward_mean: f64,
    /// *Population* standard deviation of the step's scored rewards (divides by n). The
    /// advantages' per-group std is the *sample* one (Bessel), see [`ScaleRewards::Group`].
    #[serde(alias = "reward_std")]
    pub reward_std_population: f64,
    /// Reward histogram, 0.1-wide bins over [-1, 1] (20 bins; -1 and 1 fall in the end bins).
    pub reward_histogram: Vec<u64>,
    /// Tie statistics.
    pub ties: TieStats,
    /// Mean response length in tokens.
    pub response_len_mean: f64,
    /// 90th percentile of response lengths.
    pub response_len_p90: usize,
    /// Longest response.
    pub response_len_max: usize,
    /// Responses cut at the length limit.
    pub truncated: usize,
    /// Token-weighted fraction clipped low (last PPO epoch, averaged over micro-batches).
    pub clip_low: f64,
    /// Token-weighted fraction clipped high.
    pub clip_high: f64,
    /// Policy loss (mean over micro-batches of the last PPO epoch, before scaling).
    pub loss: f64,
    /// Mean k3 KL to the reference (when `kl_beta > 0`).
    pub kl: Option<f64>,
    /// Mean next-token entropy over response tokens (last PPO epoch), when the policy reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entropy: Option<f64>,
    /// Global gradient norm before clipping, per optimizer step.
    pub grad_norms: Vec<f64>,
    /// Optimizer steps taken.
    pub optimizer_steps: usize,
    /// Accepted pairs used by the DPO term (GRPO+DPO mode).
    pub dpo_pairs: usize,
    /// Judge attempts beyond the first.
    pub judge_retries: u64,
    /// Mean judge latency per response, milliseconds.
    pub judge_latency_ms: f64,
    /// Response tokens sampled.
    pub response_tokens: usize,
    /// Seconds sampling.
    pub rollout_secs: f64,
    /// Rollout engine: sequences preempted (their KV blocks given back and recomputed later).
    #[serde(default)]
    pub rollout_preemptions: usize,
    /// Rollout engine: blocks in the KV pool.
    #[serde(default)]
    pub rollout_kv_blocks: usize,
    /// Rollout engine: most KV blocks in use at once.
    #[serde(default)]
    pub rollout_peak_kv_blocks: usize,
    /// Rollout engine: most sequences decoded in one step.
    #[serde(default)]
    pub rollout_peak_running_rows: usize,
    /// Rollout engine: mean sequences per decode step.
    #[serde(default)]
    pub rollout_mean_running_rows: f64,
    /// Rollout engine: tokens through prefill passes (prompts once each, plus recomputation).
    #[serde(default)]
    pub rollout_prefill_tokens: usize,
    /// Rollout engine: decode steps.
    #[serde(default)]
    pub rollout_decode_steps: usize,
    /// Seconds judging (rewards and tie breaking).
    pub judge_secs: f64,
    /// Seconds of optimisation (old log-probs included).
    pub update_secs: f64,
}

/// What one step produced besides metrics (for audit logs).
#[derive(Debug, Clone)]
pub struct StepOutput {
    /// Metrics.
    pub metrics: StepMetrics,
    /// Per group: the scores.
    pub scores: Vec<Vec<ResponseScore>>,
    /// Per group: advantages and pairs.
    pub outcomes: Vec<GroupOutcome>,
    /// Per group: the decoded responses.
    pub responses: Vec<Vec<String>>,
}

/// The inner-backend model of a policy.
type Inner<B, P> = <P as AutodiffModule<B>>::InnerModule;
/// The rollout stage of a learner.
type RolloutStage<B, P> = Box<dyn RolloutEngine<<B as AutodiffBackend>::InnerBackend, Inner<B, P>>>;

/// The learner: a policy, its collaborators (one per stage) and the step counter. Built with
/// [`Learner::builder`].
pub struct Learner<B, P>
where
    B: AutodiffBackend,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
{
    pub(crate) policy: P,
    pub(crate) update: Update<B, P>,
    pub(crate) cfg: LearnerConfig,
    pub(crate) device: B::Device,
    pub(crate) reference: Option<P::InnerModule>,
    pub(crate) step: u64,
    codec: Box<dyn TextCodec>,
    rewards: Box<dyn RewardSource>,
    advantages: TieAwareAdvantages,
    rollout: RolloutStage<B, P>,
    loss: PolicyLoss,
    stop_ids: Vec<u32>,
}

/// Builds a [`Learner`]: the policy, its settings and device, a [`TextCodec`] and a
/// [`RewardSource`] are required; the rest defaults to the method's stages.
pub struct LearnerBuilder<B, P>
where
    B: AutodiffBackend,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
{
    policy: P,
    cfg: LearnerConfig,
    device: B::Device,
    codec: Option<Box<dyn TextCodec>>,
    rewards: Option<Box<dyn RewardSource>>,
    tie_breaker: Option<Box<dyn TieBreaker>>,
    estimator: Option<Box<dyn AdvantageEstimator>>,
    rollout: Option<RolloutStage<B, P>>,
    stop_ids: Vec<u32>,
}

impl<B, P> LearnerBuilder<B, P>
where
    B: AutodiffBackend + GrpoOps,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
{
    /// Prompt rendering and response decoding (required).
    pub fn codec(mut self, codec: impl TextCodec + 'static) -> Self {
        self.codec = Some(Box::new(codec));
        self
    }

    /// Rewards of a group (required).
    pub fn rewards(mut self, rewards: impl RewardSource + 'static) -> Self {
        self.rewards = Some(Box::new(rewards));
        self
    }

    /// What breaks exact ties (required unless `tie_mode = "off"`).
    pub fn tie_breaker(mut self, breaker: impl TieBreaker + 'static) -> Self {
        self.tie_breaker = Some(Box::new(breaker));
        self
    }

    /// Advantages of non-tied groups (default: [`GroupRelative`] with `scale_rewards`).
    pub fn estimator(mut self, estimator: impl AdvantageEstimator + 'static) -> Self {
        self.estimator = Some(Box::new(estimator));
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

    /// Ids that end a response (for Qwen3: `Qwen3::stop_ids()`). Without them (the default) every
    /// response runs to `max_response_tokens`.
    pub fn stop_ids(mut self, ids: Vec<u32>) -> Self {
        self.stop_ids = ids;
        self
    }

    /// The learner, with a fresh AdamW.
    pub fn build(mut self) -> Result<Learner<B, P>> {
        let cfg = self.cfg;
        cfg.validate()?;
        if cfg.activation_checkpointing {
            self.policy.enable_activation_checkpointing()?;
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
        let estimator = self.estimator.unwrap_or_else(|| {
            Box::new(GroupRelative {
                scale: cfg.scale_rewards,
            })
        });
        let rollout = self.rollout.unwrap_or_else(|| {
            Box::new(GroupSampler {
                prompts_per_call: cfg.rollout_prompts_per_call,
            })
        });
        let update = Update::new(UpdateConfig {
            lr: cfg.lr,
            weight_decay: cfg.weight_decay,
            beta1: cfg.beta1,
            beta2: cfg.beta2,
            eps: cfg.adam_eps,
            max_grad_norm: cfg.max_grad_norm,
        });
        let loss = PolicyLoss {
            clip: cfg.clip,
            aggregation: cfg.aggregation,
            kl_beta: cfg.kl_beta,
            max_response_tokens: cfg.max_response_tokens,
        };
        let reference = (cfg.kl_beta != 0.0).then(|| self.policy.valid());
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
        })
    }
}

/// What the update stage measured, read from the device in one transfer.
struct UpdateStats {
    grad_norms: Vec<f64>,
    optimizer_steps: usize,
    loss: f64,
    clip_low: f64,
    clip_high: f64,
    kl: Option<f64>,
    entropy: Option<f64>,
}

impl<B, P> Learner<B, P>
where
    B: AutodiffBackend + GrpoOps,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
{
    /// Starts building a learner for `policy`.
    pub fn builder(policy: P, cfg: LearnerConfig, device: B::Device) -> LearnerBuilder<B, P> {
        LearnerBuilder {
            policy,
            cfg,
            device,
            codec: None,
            rewards: None,
            tie_breaker: None,
            estimator: None,
            rollout: None,
            stop_ids: Vec::new(),
        }
    }

    /// The policy being trained.
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

    /// One training step on `records` (one group of `group_size` responses per record).
    pub async fn step(&mut self, records: &[&RubricRecord]) -> Result<StepOutput> {
        if records.is_empty() {
            return Err(GrpoError::NoRecords);
        }
        let k = self.cfg.group_size;
        let t0 = Instant::now();
        let inner = self.policy.valid();
        let rollout = self.rollout_stage(&inner, records)?;
        rollout.check_shape(records.len(), k)?;
        let texts: Vec<String> = rollout
            .responses
            .iter()
            .map(|r| self.codec.decode(r))
            .collect::<Result<_>>()?;
        let rollout_secs = t0.elapsed().as_secs_f64();

        let t1 = Instant::now();
        let scores = self.reward_stage(records, &rollout, &texts).await;
        let outcomes = self
            .advantage_stage(records, &rollout, &texts, &scores)
            .await;
        if let Some((g, o)) = outcomes
            .iter()
            .enumerate()
            .find(|(_, o)| o.advantages.len() != k)
        {
            return Err(GrpoError::Stage(format!(
                "advantages of group {g} ({}): {} values for {k} responses",
                records[g].id,
                o.advantages.len()
            )));
        }
        if let Some((g, s)) = scores.iter().enumerate().find(|(_, s)| s.scores.len() != k) {
            return Err(GrpoError::Stage(format!(
                "rewards of group {g} ({}): {} scores for {k} responses",
                records[g].id,
                s.scores.len()
            )));
        }
        let judge_secs = t1.elapsed().as_secs_f64();

        let t2 = Instant::now();
        let batch = self.train_batch(&inner, &rollout, &outcomes);
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
        let update = self.update_stage(&batch, &dpo_pairs);
        // The new weights go to the engine before the next rollout reads them.
        self.rollout
            .sync_weights(&self.policy.valid(), self.step + 1)?;
        let update_secs = t2.elapsed().as_secs_f64();

        let mut metrics = self.step_metrics(&rollout, &scores, &outcomes, update);
        metrics.dpo_pairs = dpo_pairs.len();
        (
            metrics.rollout_secs,
            metrics.judge_secs,
            metrics.update_secs,
        ) = (rollout_secs, judge_secs, update_secs);
        self.step += 1;
        Ok(StepOutput {
            metrics,
            scores: scores.into_iter().map(|g| g.scores).collect(),
            outcomes,
            responses: texts.chunks(k).map(<[String]>::to_vec).collect(),
        })
    }

    /// Stage 1: `group_size` responses per record, sampled on the inner backend.
    fn rollout_stage(
        &self,
        inner: &P::InnerModule,
        records: &[&RubricRecord],
    ) -> Result<RolloutBatch> {
        let prompts: Vec<Vec<u32>> = records
            .iter()
            .map(|r| {
                self.codec
                    .encode_prompt(&r.question)
                    .map_err(|e| GrpoError::Prompt {
                        id: r.id.clone(),
                        message: match e {
                            GrpoError::Prompt { message, .. } => message,
                            other => other.to_string(),
                        },
                    })
            })
            .collect::<Result<_>>()?;
        if let Some(i) = prompts.iter().position(Vec::is_empty) {
            return Err(GrpoError::Prompt {
                id: records[i].id.clone(),
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
        };
        self.rollout.rollout(inner, &request, &self.device)
    }

    /// Stage 2: the rewards of every group, concurrently.
    async fn reward_stage(
        &self,
        records: &[&RubricRecord],
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
        records: &[&RubricRecord],
        rollout: &RolloutBatch,
        texts: &[String],
        scores: &[GroupScores],
    ) -> Vec<GroupOutcome> {
        let k = self.cfg.group_size;
        let lengths = rollout.lengths();
        let keys: Vec<String> = records
            .iter()
            .map(|r| format!("{}/{}", r.id, self.step))
            .collect();
        let questions: Vec<String> = records.iter().map(|r| r.question_text()).collect();
        let rewards: Vec<Vec<Option<f64>>> = scores
            .iter()
            .map(|g| g.scores.iter().map(ResponseScore::reward).collect())
            .collect();
        futures::future::join_all((0..records.len()).map(|g| {
            let group = TiedGroup {
                group_key: &keys[g],
                question: &questions[g],
                criteria: &scores[g].criteria,
                responses: &texts[g * k..(g + 1) * k],
                lengths: &lengths[g * k..(g + 1) * k],
            };
            let rewards = &rewards[g];
            async move { self.advantages.group(rewards, k, &group).await }
        }))
        .await
    }

    /// Stage 4: the train batch on the device: one upload of the layout and the advantages; old
    /// (and reference) log-probs computed micro-batch by micro-batch and kept on the device.
    fn train_batch(
        &self,
        inner: &P::InnerModule,
        rollout: &RolloutBatch,
        outcomes: &[GroupOutcome],
    ) -> TrainBatch<B> {
        let n = rollout.rows();
        let tokens = TokenBatch::<B>::new(
            (0..n).map(|r| (rollout.prompt(r), rollout.responses[r].as_slice())),
            &self.device,
        );
        let seq_lens: Vec<usize> = (0..n)
            .map(|r| rollout.prompt(r).len() + rollout.responses[r].len())
            .collect();
        let response_lens: Vec<usize> = rollout.responses.iter().map(Vec::len).collect();
        let width = tokens.positions.dims()[1];
        let inner_tokens = tokens.inner();
        let micro = plan_micro_batches(&seq_lens, 0..n, self.cfg.micro_batch_tokens);
        let logprobs = |model: &P::InnerModule| -> Tensor<B, 2> {
            let parts: Vec<_> = micro
                .iter()
                .map(|m| {
                    let (s, r) = (
                        longest(&seq_lens, m.clone()),
                        longest(&response_lens, m.clone()),
                    );
                    pad_columns(
                        model
                            .response_logprobs(&inner_tokens.slice(m.clone(), s, r))
                            .logprobs,
                        width,
                    )
                })
                .collect();
            Tensor::from_inner(Tensor::cat(parts, 0))
        };
        let advantages: Vec<f32> = outcomes
            .iter()
            .flat_map(|o| o.advantages.iter().map(|&a| a as f32))
            .collect();
        TrainBatch {
            logp_old: logprobs(inner),
            logp_ref: self.reference.as_ref().map(logprobs),
            advantages: Tensor::from_data(TensorData::new(advantages, [n]), &self.device),
            tokens,
            seq_lens,
            response_lens,
        }
    }

    /// Stage 5: PPO epochs over mini-batches; each mini-batch accumulates the gradients of its
    /// micro-batches (slices of `batch`), then clips globally and steps the optimizer.
    fn update_stage(&mut self, batch: &TrainBatch<B>, dpo_pairs: &[(usize, usize)]) -> UpdateStats {
        let n = batch.rows();
        let size = n.div_ceil(self.cfg.mini_batches).max(1);
        let minis: Vec<Range<usize>> = (0..n).step_by(size).map(|s| s..(s + size).min(n)).collect();
        let mut norms: Vec<Tensor<B::InnerBackend, 1>> = Vec::new();
        // Last PPO epoch, summed over micro-batches on the device: loss, clip_low x tokens,
        // clip_high x tokens, kl x tokens, entropy sum.
        let mut sums: Option<Tensor<B::InnerBackend, 1>> = None;
        let (mut micro_count, mut token_count, mut has_entropy) = (0usize, 0usize, false);
        for epoch in 0..self.cfg.ppo_epochs {
            let last = epoch + 1 == self.cfg.ppo_epochs;
            for mini in &minis {
                let mini_tokens: usize = batch.response_lens[mini.clone()].iter().sum();
                let mut acc = GradientsAccumulator::<P>::new();
                for micro in
                    plan_micro_batches(&batch.seq_lens, mini.clone(), self.cfg.micro_batch_tokens)
                {
                    let mb = batch.slice(micro.clone());
                    // Weights that make the sum over micro-batches the mini-batch's aggregate.
                    let weight = match self.cfg.aggregation {
                        Aggregation::GlobalTokenMean => {
                            mb.response_tokens() as f64 / mini_tokens.max(1) as f64
                        }
                        _ => micro.len() as f64 / mini.len() as f64,
                    };
                    let mut parts: Option<Tensor<B::InnerBackend, 1>> = None;
                    let loss = &self.loss;
                    let grads = self.policy.loss_gradients(&mb.tokens, &mut |out_lp| {
                        let out = loss.compute(SurrogateBatch {
                            logp: out_lp.logprobs,
                            logp_old: mb.logp_old.clone(),
                            advantages: mb.advantages.clone(),
                            mask: mb.tokens.mask.clone(),
                            logp_ref: mb.logp_ref.clone(),
                        });
                        if last {
                            let w = mb.response_tokens() as f64;
                            let f32_of = |t: Tensor<B, 1>| t.detach().inner().cast(DType::F32);
                            let zero = || {
                                Tensor::<B::InnerBackend, 1>::zeros([1], &out.clip_low.device())
                                    .cast(DType::F32)
                            };
                            has_entropy |= out_lp.entropy.is_some();
                            parts = Some(Tensor::cat(
                                vec![
                                    f32_of(out.loss.clone()),
                                    f32_of(out.clip_low.clone()) * w,
                                    f32_of(out.clip_high.clone()) * w,
                                    out.kl.clone().map(|k| f32_of(k) * w).unwrap_or_else(zero),
                                    out_lp.entropy.map(|e| f32_of(e.sum())).unwrap_or_else(zero),
                                ],
                                0,
                            ));
                        }
                        out.loss * weight
                    });
                    if let Some(v) = parts {
                        sums = Some(match sums.take() {
                            Some(s) => s + v,
                            None => v,
                        });
                        micro_count += 1;
                        token_count += mb.response_tokens();
                    }
                    acc.accumulate(&self.policy, grads);
                }
                let pairs: Vec<(usize, usize)> = dpo_pairs
                    .iter()
                    .copied()
                    .filter(|(w, _)| mini.contains(w))
                    .collect();
                if !pairs.is_empty() {
                    acc.accumulate(&self.policy, self.dpo_gradients(batch, &pairs));
                }
                let (policy, norm) = self.update.apply(self.policy.clone(), acc.grads());
                self.policy = policy;
                norms.push(norm);
            }
        }
        // The one read of the update's numbers.
        let steps = norms.len();
        let mut all = norms;
        all.push(sums.unwrap_or_else(|| {
            Tensor::<B, 1>::zeros([5], &self.device)
                .inner()
                .cast(DType::F32)
        }));
        let host: Vec<f64> = Tensor::cat(all, 0)
            .into_data()
            .convert::<f64>()
            .into_vec()
            .expect("f64 metrics");
        let (norms, s) = host.split_at(steps);
        let tokens = token_count.max(1) as f64;
        UpdateStats {
            grad_norms: norms.to_vec(),
            optimizer_steps: steps,
            loss: s[0] / micro_count.max(1) as f64,
            clip_low: s[1] / tokens,
            clip_high: s[2] / tokens,
            kl: (self.cfg.kl_beta != 0.0).then(|| s[3] / tokens),
            entropy: has_entropy.then(|| s[4] / tokens),
        }
    }

    /// Gradients of the GRPO+DPO baseline term for accepted `(winner, loser)` rows.
    fn dpo_gradients(&self, batch: &TrainBatch<B>, pairs: &[(usize, usize)]) -> GradientsParams {
        let rows: Vec<usize> = pairs.iter().flat_map(|&(w, l)| [w, l]).collect();
        let index = row_index::<B>(&rows, &self.device);
        // Padding cut to the longest of these rows, as for a micro-batch.
        let (seq_len, response_len) = (
            longest(&batch.seq_lens, rows.iter().copied()),
            longest(&batch.response_lens, rows.iter().copied()),
        );
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
        let (beta, total) = (self.cfg.dpo_beta, batch.rows());
        self.policy.loss_gradients(&tokens, &mut |lp| {
            let seq = lp.logprobs.sum_dim(1).reshape([rows.len()]);
            dpo_pair_loss(
                seq.clone().select(0, winners.clone()),
                seq.select(0, losers.clone()),
                old.clone().select(0, winners.clone()),
                old.clone().select(0, losers.clone()),
                beta,
                total,
            )
        })
    }

    /// Stage 6: the step's metrics (host arithmetic on what the stages returned).
    fn step_metrics(
        &self,
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
            step: self.step,
            prompts: rollout.prompts.len(),
            responses: n,
            scored: scored.len(),
            unscored: n - scored.len(),
            grad_norms: u.grad_norms,
            optimizer_steps: u.optimizer_steps,
            loss: u.loss,
            clip_low: u.clip_low,
            clip_high: u.clip_high,
            kl: u.kl,
            entropy: u.entropy,
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
            m.ties.add(o, rewards[g].first().copied().flatten());
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
        m.judge_retries = scores.iter().map(|g| g.judge_retries as u64).sum();
        m.judge_latency_ms =
            scores.iter().map(|g| g.judge_latency_ms).sum::<f64>() / n.max(1) as f64;
        m
    }
}
