//! The learner's types, shared by its stage files: the learner itself, a step's parts and
//! output, and the imports every stage uses (`use super::types::*`).

pub(super) use std::ops::Range;
pub(super) use std::time::Instant;

pub(super) use burn::module::AutodiffModule;
pub(super) use burn::tensor::backend::AutodiffBackend;
pub(super) use burn::tensor::{DType, Tensor, TensorData};
pub(super) use conrub_contracts::{
    gathered_as, FinishReason, Policy, ResponseLogprobs, RolloutBatch, RolloutEngine,
    RolloutRequest, RolloutStats, SamplingConfig, StepMetrics, TextCodec, TokenBatch, WeightSync,
};
pub(super) use conrub_kernels::KernelOps;
pub(super) use conrub_rubric::{ResponseScore, RubricRecord};

pub(super) use conrub_rewards::TaskPrompt;

pub(super) use crate::advantages::{stable_seed, AdvantageEstimator};
pub(super) use crate::batch::{
    micro_batch_widths, pad_columns, plan_micro_batches, row_index, TrainBatch,
};
pub(super) use crate::error::{GrpoError, Result};
pub(super) use crate::group::{
    record_group, reward_bin, GroupOutcome, TieAwareAdvantages, TieMode,
};
pub(super) use crate::loss::{dpo_pair_loss, kl_per_token, PolicyObjective, SurrogateBatch};
pub(super) use crate::registry::Registry;
pub(super) use crate::rollout::GroupSampler;
pub(super) use crate::schedule::LrSchedule;
pub(super) use crate::stop::cut_at_stop_strings;
pub(super) use crate::ties::{NoTieBreaker, TieBreaker, TiedGroup};
pub(super) use crate::update::{Update, UpdateConfig};
pub(super) use conrub_contracts::{LearnerConfig, OnNonFinite};
pub(super) use conrub_parallel::sharding::{CommStats, RankGather};
pub(super) use conrub_parallel::{GradientPath, RankSlot, StepSum};
pub(super) use conrub_rewards::{GroupScores, RewardSource};

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
pub(super) type Inner<B, P> = <P as AutodiffModule<B>>::InnerModule;

/// The rollout stage of a learner.
pub(super) type RolloutStage<B, P> =
    Box<dyn RolloutEngine<<B as AutodiffBackend>::InnerBackend, Inner<B, P>>>;

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
    pub(super) codec: Box<dyn TextCodec>,
    pub(super) rewards: Box<dyn RewardSource<T>>,
    pub(super) advantages: TieAwareAdvantages,
    pub(super) rollout: RolloutStage<B, P>,
    pub(super) loss: Box<dyn PolicyObjective<B>>,
    pub(super) stop_ids: Vec<u32>,
    pub(crate) rank: Option<RankSlot<B::InnerBackend>>,
    /// Where the rank's gradients go, chosen from its slot when the learner is built.
    pub(super) path: GradientPath<B>,
    /// Optimizer steps skipped in a row for a non-finite gradient norm
    /// (`learner.on_nonfinite = "skip-step"`).
    pub(super) skipped_in_a_row: usize,
    /// Steps in a row whose scored share fell below `min_scored_share`.
    pub(super) unscored_in_a_row: usize,
    /// The learning-rate schedule is in place (one that needs the run's length waits for
    /// [`Learner::set_training_steps`]).
    pub(super) schedule_ready: bool,
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

/// The sequence lengths of a whole step's rows, the tokens each adds to the loss (its response
/// length, 0 for a masked truncated response), and the index among them of a learner's first.
pub(crate) struct GlobalRows {
    pub seq_lens: Vec<usize>,
    pub lens: Vec<usize>,
    pub first: usize,
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
    pub(super) fn of<B: burn::tensor::backend::Backend>(
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
    pub(super) fn merge(parts: impl IntoIterator<Item = LogprobGap>) -> Self {
        parts.into_iter().fold(Self::default(), |a, b| Self {
            abs_sum: a.abs_sum + b.abs_sum,
            abs_max: a.abs_max.max(b.abs_max),
            k3_sum: a.k3_sum + b.k3_sum,
            tokens: a.tokens + b.tokens,
        })
    }
}

/// What the update stage measured (its gradient norms read one per optimizer step, the rest in
/// one transfer); all zero for a step that did not update.
#[derive(Debug, Clone, Default)]
pub(crate) struct UpdateStats {
    pub(super) grad_norms: Vec<f64>,
    pub(super) optimizer_steps: usize,
    pub(super) skipped_optimizer_steps: usize,
    pub(super) loss: f64,
    pub(super) clip_low: f64,
    pub(super) clip_high: f64,
    pub(super) kl: Option<f64>,
    pub(super) entropy: Option<f64>,
    pub(super) tokens_computed: u64,
    pub(super) tokens_needed: u64,
    pub comm: CommStats,
    /// The rate of the last optimizer step so far.
    pub(super) lr: f64,
}
