//! The lines of a run's `metrics.jsonl`: what a learner step, an epoch, a validation round and a
//! kernel warm-up report. The learner writes them (`conrub_grpo`'s metrics log); `conrub-plot` and
//! users' own tools read them with these types, without the learner.

use std::collections::BTreeMap;

pub use conrub_settings::ValidationDecoding;
use serde::{Deserialize, Serialize};

/// JSON has no NaN or infinity, so serde_json writes a non-finite `f64` as `null`; the metrics
/// types read that `null` back as NaN, so every line conrub writes reads again (a resume, a plot
/// or a user's tool would otherwise skip a step whose loss overflowed).
mod nullable {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Deserializer};

    /// An `f64` that may be `null` (NaN).
    pub fn f64<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
    }

    /// A list of `f64`s, any of them `null` (NaN).
    pub fn f64s<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<f64>, D::Error> {
        let values = Vec::<Option<f64>>::deserialize(d)?;
        Ok(values.into_iter().map(|v| v.unwrap_or(f64::NAN)).collect())
    }

    /// A map to `f64`s, any of them `null` (NaN).
    pub fn f64_map<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<String, f64>, D::Error> {
        let values = BTreeMap::<String, Option<f64>>::deserialize(d)?;
        Ok(values
            .into_iter()
            .map(|(k, v)| (k, v.unwrap_or(f64::NAN)))
            .collect())
    }
}

/// One line of the metrics file.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum MetricsLine {
    /// A training step.
    Step {
        /// Epoch the step belongs to.
        epoch: usize,
        /// The step's metrics.
        #[serde(flatten)]
        metrics: Box<StepMetrics>,
    },
    /// A finished epoch.
    Epoch(EpochSummary),
    /// A validation round (`[eval]`): the policy after `step` steps on held-out prompts.
    Eval(ValidationLine),
    /// A kernel warm-up before the first step (`conrub train` on a CubeCL backend with a cold
    /// kernel cache): what it compiled and how long it took.
    KernelWarmup(KernelWarmupLine),
}

/// What a kernel warm-up did: one step of the run's shapes (and its supervised warm-up's first
/// steps when it has one) on weights that are then restored, before the run's first step.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct KernelWarmupLine {
    /// Whether the run was resumed from a checkpoint (else it ran before step 0).
    pub resumed: bool,
    /// What ran, in words.
    pub ran: String,
    /// What it did not walk, in words: shapes a step compiles when it first meets them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub left: Vec<String>,
    /// Seconds it took.
    #[serde(deserialize_with = "nullable::f64")]
    pub secs: f64,
    /// Kernels compiled, loaded from the kernel cache and autotune runs during it.
    #[serde(flatten, default)]
    pub kernels: Option<conrub_kernels::events::KernelEvents>,
}

/// Per-epoch totals.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct EpochSummary {
    /// Epoch index.
    pub epoch: usize,
    /// Steps in the epoch.
    pub steps: usize,
    /// Mean reward over scored responses.
    #[serde(deserialize_with = "nullable::f64")]
    pub reward_mean: f64,
    /// Scored responses.
    pub scored: usize,
    /// Unscored responses.
    pub unscored: usize,
    /// Tie statistics summed over the epoch.
    pub ties: TieStats,
    /// Mean response length.
    #[serde(deserialize_with = "nullable::f64")]
    pub response_len_mean: f64,
    /// Truncated responses.
    pub truncated: usize,
}

impl EpochSummary {
    /// Sums steps.
    pub fn from_steps(epoch: usize, steps: &[StepMetrics]) -> Self {
        let mut s = EpochSummary {
            epoch,
            steps: steps.len(),
            ..Default::default()
        };
        let (mut reward, mut len, mut n) = (0.0, 0.0, 0usize);
        for m in steps {
            reward += m.reward_mean * m.scored as f64;
            len += m.response_len_mean * m.responses as f64;
            n += m.responses;
            s.scored += m.scored;
            s.unscored += m.unscored;
            s.truncated += m.truncated;
            s.ties.merge(&m.ties);
        }
        s.reward_mean = if s.scored > 0 {
            reward / s.scored as f64
        } else {
            0.0
        };
        s.response_len_mean = if n > 0 { len / n as f64 } else { 0.0 };
        s
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
    #[serde(deserialize_with = "nullable::f64")]
    pub reward_mean: f64,
    /// *Population* standard deviation of the step's scored rewards (divides by n). The
    /// advantages' per-group std is the *sample* one (Bessel), see `conrub_grpo::ScaleRewards::Group`.
    #[serde(alias = "reward_std")]
    #[serde(deserialize_with = "nullable::f64")]
    pub reward_std_population: f64,
    /// Reward histogram, 0.1-wide bins over [-1, 1] (20 bins; -1 and 1 fall in the end bins).
    pub reward_histogram: Vec<u64>,
    /// Tie statistics.
    pub ties: TieStats,
    /// Mean response length in tokens.
    #[serde(deserialize_with = "nullable::f64")]
    pub response_len_mean: f64,
    /// 90th percentile of response lengths.
    pub response_len_p90: usize,
    /// Longest response.
    pub response_len_max: usize,
    /// Responses cut at the length limit.
    pub truncated: usize,
    /// Token-weighted fraction clipped low (last PPO epoch, averaged over micro-batches).
    #[serde(deserialize_with = "nullable::f64")]
    pub clip_low: f64,
    /// Token-weighted fraction clipped high.
    #[serde(deserialize_with = "nullable::f64")]
    pub clip_high: f64,
    /// Policy loss of the last PPO epoch: per mini-batch, the aggregate its gradient is taken of
    /// (the micro-batches' losses weighted as in the update), averaged over mini-batches. The
    /// same number whatever the micro-batch split or the number of data-parallel ranks.
    #[serde(deserialize_with = "nullable::f64")]
    pub loss: f64,
    /// Mean k3 KL to the reference (when `kl_beta > 0`).
    pub kl: Option<f64>,
    /// Mean next-token entropy over response tokens (last PPO epoch), when the policy reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entropy: Option<f64>,
    /// Global gradient norm before clipping, per optimizer step.
    #[serde(deserialize_with = "nullable::f64s")]
    pub grad_norms: Vec<f64>,
    /// Optimizer steps taken.
    pub optimizer_steps: usize,
    /// Optimizer steps dropped for a non-finite gradient norm (`learner.on_nonfinite =
    /// "skip-step"`).
    #[serde(default)]
    pub skipped_optimizer_steps: usize,
    /// The learning rate of the step's last optimizer step (of the run's last before it when
    /// the step took none; `learner.lr_schedule`).
    #[serde(default)]
    #[serde(deserialize_with = "nullable::f64")]
    pub lr: f64,
    /// Accepted pairs used by the DPO term (GRPO+DPO mode).
    pub dpo_pairs: usize,
    /// Judge attempts beyond the first.
    pub judge_retries: u64,
    /// Mean judge latency per response, milliseconds.
    #[serde(deserialize_with = "nullable::f64")]
    pub judge_latency_ms: f64,
    /// Criteria the judge handed to its fallback judge (a probe judge's abstentions).
    #[serde(default)]
    pub judge_deferred: u64,
    /// `judge_deferred` over the criteria judged this step (responses × criteria).
    #[serde(default)]
    #[serde(deserialize_with = "nullable::f64")]
    pub judge_deferred_share: f64,
    /// Response tokens sampled.
    pub response_tokens: usize,
    /// Seconds sampling.
    #[serde(deserialize_with = "nullable::f64")]
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
    #[serde(deserialize_with = "nullable::f64")]
    pub rollout_mean_running_rows: f64,
    /// Rollout engine: tokens through prefill passes (prompts once each, plus recomputation).
    #[serde(default)]
    pub rollout_prefill_tokens: usize,
    /// Rollout engine: decode steps.
    #[serde(default)]
    pub rollout_decode_steps: usize,
    /// Token positions the update's forward passes computed, over every PPO epoch and rank
    /// (micro-batches padded to their length bucket, `conrub_rollout::bucket_len`), and the
    /// real `prompt ++ response` tokens among them: the cost of a finite set of shapes.
    #[serde(default)]
    pub update_tokens_computed: u64,
    /// See `update_tokens_computed`.
    #[serde(default)]
    pub update_tokens_needed: u64,
    /// Token positions the rollout engine's forward passes computed (prefills padded to their
    /// length bucket, decode steps to their row bucket: `conrub_rollout::bucket_rows`), and the
    /// real ones among them.
    #[serde(default)]
    pub rollout_tokens_computed: u64,
    /// See `rollout_tokens_computed`.
    #[serde(default)]
    pub rollout_tokens_needed: u64,
    /// Seconds judging (rewards and tie breaking).
    #[serde(deserialize_with = "nullable::f64")]
    pub judge_secs: f64,
    /// Seconds of optimisation (old log-probs included).
    #[serde(deserialize_with = "nullable::f64")]
    pub update_secs: f64,
    /// CubeCL kernels compiled, loaded from the kernel cache and autotune runs during the step
    /// (`kernel_compiles`, `kernel_cache_loads`, `autotune_runs`; absent when the process does
    /// not count them: see `conrub_kernels::events`). A warm run compiles nothing after its
    /// first steps.
    #[serde(flatten, default)]
    pub kernels: Option<conrub_kernels::events::KernelEvents>,
    /// Data-parallel ranks that ran the step (1 on one device).
    #[serde(default = "one")]
    pub ranks: usize,
    /// Bytes each rank sent through the gradient all-reduce (0 on one device).
    #[serde(default)]
    pub allreduce_bytes: u64,
    /// Seconds each rank spent in the gradient all-reduce (the slowest rank's).
    #[serde(default)]
    #[serde(deserialize_with = "nullable::f64")]
    pub allreduce_secs: f64,
    /// Sharded runs: bytes a rank put into gradient reduce-scatters (whole buckets; the
    /// busiest rank's).
    #[serde(default)]
    pub reduce_scatter_bytes: u64,
    /// Seconds in gradient reduce-scatters (the slowest rank's).
    #[serde(default)]
    #[serde(deserialize_with = "nullable::f64")]
    pub reduce_scatter_secs: f64,
    /// Sharded runs: bytes of updated weights a rank put into all-gathers (its own parameters;
    /// the busiest rank's).
    #[serde(default)]
    pub all_gather_bytes: u64,
    /// Seconds in weight all-gathers (the slowest rank's).
    #[serde(default)]
    #[serde(deserialize_with = "nullable::f64")]
    pub all_gather_secs: f64,
    /// Each rank's device memory held by the backend's pools after the step, rank 0 first (their
    /// high-water mark: the step's peak as the allocator saw it), where the backend reports it
    /// (CUDA, wgpu); absent on the CPU backends.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_memory_reserved_bytes: Vec<u64>,
    /// The slowest and the fastest rank's rollout seconds (equal on one device).
    #[serde(default)]
    #[serde(deserialize_with = "nullable::f64")]
    pub rollout_secs_rank_max: f64,
    /// See `rollout_secs_rank_max`.
    #[serde(default)]
    #[serde(deserialize_with = "nullable::f64")]
    pub rollout_secs_rank_min: f64,
    /// The slowest and the fastest rank's update seconds (equal on one device).
    #[serde(default)]
    #[serde(deserialize_with = "nullable::f64")]
    pub update_secs_rank_max: f64,
    /// See `update_secs_rank_max`.
    #[serde(default)]
    #[serde(deserialize_with = "nullable::f64")]
    pub update_secs_rank_min: f64,
    /// Seconds spent handing the policy's weights to the rollout engine (0 in process).
    #[serde(default)]
    #[serde(deserialize_with = "nullable::f64")]
    pub weight_sync_secs: f64,
    /// Bytes of weights written for the rollout engine (0 in process).
    #[serde(default)]
    pub weight_sync_bytes: u64,
    /// Mean over response tokens of `|logp_learner - logp_engine|`, the learner's recomputed
    /// old log-prob against the one the engine reported for the token it sampled.
    #[serde(default)]
    #[serde(deserialize_with = "nullable::f64")]
    pub rollout_logprob_diff_mean: f64,
    /// Largest `|logp_learner - logp_engine|` of the step.
    #[serde(default)]
    #[serde(deserialize_with = "nullable::f64")]
    pub rollout_logprob_diff_max: f64,
    /// k3 estimate of KL(engine || learner) per response token (see `rollout_logprob_diff_mean`).
    #[serde(default)]
    #[serde(deserialize_with = "nullable::f64")]
    pub rollout_kl: f64,
    /// With `learner.kl_in_reward`: the mean over scored responses of the penalty taken from
    /// their rewards (`kl_in_reward x` the summed per-token KL); `reward_mean` is before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reward_kl_penalty: Option<f64>,
    /// With `learner.dynamic_sampling`: the groups rolled out and scored this step but not
    /// trained on (their scored rewards were all equal), over every round and rank.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dynamic_groups_dropped: Option<usize>,
    /// With `learner.dynamic_sampling`: prompts drawn beyond `run.prompts_per_step` (the data
    /// cursor moves by `prompts_per_step` plus these).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dynamic_prompts_drawn: Option<usize>,
    /// With `learner.dynamic_sampling`: rollout rounds of the step, the first included.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dynamic_rounds: Option<usize>,
    /// With `learner.dynamic_sampling`: responses of the dropped groups left unscored (`scored`
    /// and `unscored` count the groups trained on; the scored-share check counts both).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dynamic_unscored: Option<usize>,
}

/// Tie telemetry over a step or an epoch (docs/METHOD.md §7).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TieStats {
    /// Groups seen.
    pub groups: u64,
    /// Exactly tied groups.
    pub tied_groups: u64,
    /// Reward histogram of tied groups, 0.1-wide bins over [-1, 1] (20 bins).
    pub tied_reward_histogram: Vec<u64>,
    /// Pairwise judge calls (two per pair).
    pub pairwise_calls: u64,
    /// Pairs accepted.
    pub accepted: u64,
    /// Pairs judged `same`.
    pub same: u64,
    /// Pairs with an order flip.
    pub order_flips: u64,
    /// Pairs with invalid output.
    pub invalid: u64,
    /// Groups that got at least one nonzero pairwise advantage.
    pub groups_with_direction: u64,
    /// Responses that got a nonzero pairwise advantage.
    pub responses_with_direction: u64,
    /// Accepted pairs whose winner is the longer response.
    pub winner_longer: u64,
}

impl TieStats {
    /// The tie rate (tied / groups).
    pub fn tie_rate(&self) -> f64 {
        if self.groups == 0 {
            0.0
        } else {
            self.tied_groups as f64 / self.groups as f64
        }
    }

    /// Adds another set of statistics.
    pub fn merge(&mut self, other: &TieStats) {
        if self.tied_reward_histogram.is_empty() {
            self.tied_reward_histogram = vec![0; 20];
        }
        for (a, b) in self
            .tied_reward_histogram
            .iter_mut()
            .zip(other.tied_reward_histogram.iter())
        {
            *a += b;
        }
        self.groups += other.groups;
        self.tied_groups += other.tied_groups;
        self.pairwise_calls += other.pairwise_calls;
        self.accepted += other.accepted;
        self.same += other.same;
        self.order_flips += other.order_flips;
        self.invalid += other.invalid;
        self.groups_with_direction += other.groups_with_direction;
        self.responses_with_direction += other.responses_with_direction;
        self.winner_longer += other.winner_longer;
    }
}

/// One judge's view of a validation round.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct JudgeScore {
    /// The judge's id.
    pub judge: String,
    /// Mean score over the scored responses; `None` when none was scored.
    pub score: Option<f64>,
    /// Bootstrap standard deviation of `score`.
    pub score_std: Option<f64>,
    /// Responses scored.
    pub scored: usize,
    /// Responses the judge left unscored (failed calls, wrong label counts).
    pub unscored: usize,
    /// Share of each label over the scored responses' criteria.
    #[serde(deserialize_with = "nullable::f64_map")]
    pub labels: BTreeMap<String, f64>,
    /// Why responses went unscored (the first error), when any did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A `kind = "eval"` line of `metrics.jsonl`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ValidationLine {
    /// Training steps completed when the policy was validated.
    pub step: u64,
    /// Held-out prompts answered.
    pub prompts: usize,
    /// Responses generated (`prompts × samples`).
    pub responses: usize,
    /// `greedy` or `sampled`.
    pub decoding: ValidationDecoding,
    /// Mean response length in tokens.
    #[serde(deserialize_with = "nullable::f64")]
    pub response_len_mean: f64,
    /// Responses cut at the length limit.
    pub truncated: usize,
    /// The training judge's scores.
    pub training: JudgeScore,
    /// The grader's scores.
    pub grader: JudgeScore,
    /// Seconds generating.
    #[serde(deserialize_with = "nullable::f64")]
    pub generate_secs: f64,
    /// Seconds judging (both judges, concurrently).
    #[serde(deserialize_with = "nullable::f64")]
    pub judge_secs: f64,
    /// CubeCL kernels compiled, loaded from the cache and autotune runs during the round (see
    /// [`StepMetrics::kernels`]).
    #[serde(flatten, default)]
    pub kernels: Option<conrub_kernels::events::KernelEvents>,
}

fn one() -> usize {
    1
}
