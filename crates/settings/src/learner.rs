//! The `[learner]` table: the method's, the optimizer's, the loss's and the system's settings,
//! and the enums they name. Range checks name the dotted key ([`SettingsError::Key`]).

use serde::{Deserialize, Serialize};

use crate::error::{Result, SettingsError};
use crate::flat::{flat_by_derive, flat_fields, read_groups, Flat, FlatGroup};
use crate::sampling::SamplingParams;

/// The most responses a group may have: beyond it a step's arrays and plans are not worth
/// sizing (a `group_size` near 2^63 made `plan` scan for minutes).
pub const MAX_GROUP_SIZE: usize = 4096;

/// `learner.estimator` unless set: group-relative advantages (GRPO; Dr. GRPO with
/// `scale_rewards = "none"`).
pub const DEFAULT_ESTIMATOR: &str = "group-relative";
/// `learner.loss` unless set: the clipped surrogate with its aggregation (`sequence-mean`,
/// `global-token-mean`, `dr-grpo`), the k3 KL term and truncated importance sampling.
pub const DEFAULT_LOSS: &str = "clipped-surrogate";
/// `learner.loss = "gspo"`: the clipped surrogate with one importance ratio per response, the
/// exponential of its mean token log-ratio (GSPO; TRL's `importance_sampling_level =
/// "sequence"`), with the same parameters as [`DEFAULT_LOSS`].
pub const GSPO_LOSS: &str = "gspo";

/// Learner settings (the `[learner]` table of a train config). Defaults are the published run's.
///
/// Split by concern: the method's own keys here, the rollout's sampling rule
/// ([`SamplingParams`]), the optimizer ([`OptimizerSettings`]), the policy loss
/// ([`ObjectiveSettings`]) and how the update runs ([`SystemSettings`]). The table stays flat:
/// every key sits directly in `[learner]` and goes to the struct that declares it (`flat.rs`);
/// serde's derive reads this struct's own keys, as `remote = "Self"` makes it an inherent
/// function the flat reader calls.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(remote = "Self", deny_unknown_fields, default)]
pub struct LearnerConfig {
    /// Responses per prompt (k).
    pub group_size: usize,
    /// Longest response in tokens (Lmax; also Dr. GRPO's length normaliser).
    pub max_response_tokens: usize,
    /// The rollout's sampling rule (`temperature`, `top_p`, `top_k`, `min_p`,
    /// `repetition_penalty`: keys of `[learner]` itself).
    #[serde(skip)]
    pub sampling: SamplingParams,
    /// Stop strings: a response ends where its text first contains one (the token completing
    /// it kept, the rest dropped, the judges reading the text before it), on every engine and
    /// backend. The tokenizer's end-of-turn ids stop responses as well.
    pub stop: Vec<String>,
    /// How the update runs, not what it computes: generation-call and micro-batch sizes, activation checkpointing, the all-reduce buckets, what a non-finite gradient does.
    /// (Keys of `[learner]` itself: `micro_batch_tokens`, `activation_checkpointing`, ....)
    #[serde(skip)]
    pub system: SystemSettings,
    /// The optimizer: AdamW, its learning rate and the rate's schedule, the gradient clip.
    /// (Keys of `[learner]` itself: `lr`, `lr_schedule`, `lr_warmup_steps`, ....)
    #[serde(skip)]
    pub optimizer: OptimizerSettings,
    /// The policy loss and its terms: which loss, its ratio clipping and aggregation, the KL and entropy terms, truncated importance sampling, the GRPO+DPO baseline's beta.
    /// (Keys of `[learner]` itself: `loss`, `clip`, `aggregation`, ....)
    #[serde(skip)]
    pub objective: ObjectiveSettings,
    /// Advantage scaling: `group` (divide by the group's sample std, the method) or `none`.
    pub scale_rewards: ScaleRewards,
    /// The advantage estimator of non-tied groups, by its `conrub_grpo::Registry` name
    /// (`group-relative`: GRPO, with `scale_rewards` as its parameter).
    pub estimator: String,
    /// KL in the reward (verl's `use_kl_in_reward`; 0: off): each scored response's reward
    /// less this times its summed per-token KL (`kl_estimator`, the rollout policy against the
    /// initial one) before the advantages. Exact ties are still found on the rewards before the
    /// penalty; a tie broken pairwise takes the tie breaker's advantages.
    pub kl_in_reward: f64,
    /// What happens to exactly tied groups.
    pub tie_mode: TieMode,
    /// Dynamic sampling (DAPO's `filter_groups`, verl's `algorithm.filter_groups`): a group whose
    /// scored rewards are all equal (no variance, so no GRPO signal) is dropped after scoring,
    /// and prompts drawn next in the data order are rolled out and scored in its place, round
    /// after round, until the step has `run.prompts_per_step` groups with variance or
    /// `dynamic_sampling_rounds` extra rounds are spent (the step then trains on what it has).
    /// An alternative to pairwise ties: it needs `tie_mode = "off"`.
    pub dynamic_sampling: bool,
    /// Extra rollout rounds a dynamic-sampling step may draw (0: drop only, never refill).
    pub dynamic_sampling_rounds: usize,
    /// Passes over each rollout batch.
    pub ppo_epochs: usize,
    /// Optimizer steps per pass (the batch is split into this many mini-batches).
    pub mini_batches: usize,
    /// Run seed.
    pub seed: u64,
    /// A step whose share of scored responses (over every rank) is below this does not update
    /// the policy; `max_unscored_steps` such steps in a row stop the run with the judge's last
    /// error. Set from `reward.min_scored_share` / `reward.max_unscored_steps` (not `[learner]`
    /// keys).
    #[serde(skip)]
    pub min_scored_share: f64,
    /// See `min_scored_share`.
    #[serde(skip)]
    pub max_unscored_steps: usize,
}

/// The learning rate's shape over a run (`learner.lr_schedule`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LrScheduleKind {
    /// `lr` throughout (after any warm-up).
    #[default]
    Constant,
    /// A straight line from `lr` to `min_lr_ratio x lr`.
    Linear,
    /// Half a cosine from `lr` to `min_lr_ratio x lr`.
    Cosine,
}

impl LrScheduleKind {
    /// The config's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Self::Constant => "constant",
            Self::Linear => "linear",
            Self::Cosine => "cosine",
        }
    }
}

/// What a non-finite gradient norm does (`learner.on_nonfinite`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OnNonFinite {
    /// Stop the run with an error naming the step.
    #[default]
    Stop,
    /// Drop the optimizer step and go on (at most `learner.max_skipped_steps` in a row).
    SkipStep,
}

impl Default for LearnerConfig {
    fn default() -> Self {
        Self {
            group_size: 8,
            max_response_tokens: 8192,
            sampling: SamplingParams::default(),
            stop: Vec::new(),
            system: SystemSettings::default(),
            optimizer: OptimizerSettings::default(),
            objective: ObjectiveSettings::default(),
            scale_rewards: ScaleRewards::Group,
            estimator: DEFAULT_ESTIMATOR.into(),
            kl_in_reward: 0.0,
            tie_mode: TieMode::Pairwise,
            dynamic_sampling: false,
            dynamic_sampling_rounds: 4,
            ppo_epochs: 1,
            mini_batches: 1,
            seed: 1234,
            min_scored_share: 0.5,
            max_unscored_steps: 3,
        }
    }
}

/// The optimizer: AdamW, its learning rate and the rate's schedule, the gradient clip. Keys of the `[learner]` table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimizerSettings {
    /// Learning rate (the peak of a schedule).
    pub lr: f64,
    /// The rate's shape over the run, counted in optimizer steps: `constant`, `linear` or
    /// `cosine` (decaying to `min_lr_ratio x lr` at the run's last optimizer step), after the
    /// warm-up (`conrub_grpo::LrSchedule` has the formulas).
    pub lr_schedule: LrScheduleKind,
    /// Optimizer steps of a linear warm-up of the rate (not the `[warmup]` supervised steps).
    pub lr_warmup_steps: Option<usize>,
    /// The warm-up as a share of the run's optimizer steps (rounded up); the alternative of
    /// `lr_warmup_steps`.
    pub lr_warmup_ratio: Option<f64>,
    /// Floor of a `linear` or `cosine` decay as a share of `lr`.
    pub min_lr_ratio: f64,
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
}

impl Default for OptimizerSettings {
    fn default() -> Self {
        Self {
            lr: 3e-6,
            lr_schedule: LrScheduleKind::Constant,
            lr_warmup_steps: None,
            lr_warmup_ratio: None,
            min_lr_ratio: 0.0,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            adam_eps: 1e-8,
            max_grad_norm: 1.0,
        }
    }
}

/// The policy loss and its terms: which loss, its ratio clipping and aggregation, the KL and entropy terms, truncated importance sampling, the GRPO+DPO baseline's beta. Keys of the `[learner]` table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ObjectiveSettings {
    /// The policy loss, by its `conrub_grpo::Registry` name (`clipped-surrogate`, with `clip`,
    /// `aggregation`, `kl_beta` and `tis_cap` as its parameters).
    pub loss: String,
    /// Ratio clipping.
    pub clip: Clip,
    /// Loss aggregation: `sequence-mean` (the method), `global-token-mean` or `dr-grpo`.
    pub aggregation: Aggregation,
    /// Weight of the KL to the initial policy (0: no reference model is kept).
    pub kl_beta: f64,
    /// The per-token KL estimator of that term, with `d = logp_ref - logp`: `k1` (`-d`), `k2`
    /// (`d^2 / 2`) or `k3` (`exp(d) - d - 1`, TRL's and the method's).
    pub kl_estimator: KlEstimator,
    /// Entropy bonus (verl's `entropy_coeff`; 0: off): the policy's next-token entropy at each
    /// response token, aggregated as the policy loss is (`aggregation`), times this, taken from
    /// the loss, with its gradient (the policy must support `Policy::enable_entropy_gradient`).
    pub entropy_coeff: f64,
    /// Leave responses cut at `max_response_tokens` out of the loss (TRL's
    /// `mask_truncated_completions`): their tokens are masked, so they add no gradient and no
    /// tokens to a token mean, while still counting as responses of their group.
    pub mask_truncated: bool,
    /// Truncated importance sampling (off when unset): each token's policy loss is weighted by
    /// `min(exp(logp_old - logp_engine), tis_cap)`, the learner's old probability of the sampled
    /// token over the rollout engine's, capped (TRL's and verl's correction for an engine whose
    /// numerics differ from the trainer's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tis_cap: Option<f64>,
    /// Beta of the GRPO+DPO baseline.
    pub dpo_beta: f64,
}

impl Default for ObjectiveSettings {
    fn default() -> Self {
        Self {
            loss: DEFAULT_LOSS.into(),
            clip: Clip::default(),
            aggregation: Aggregation::SequenceMean,
            kl_beta: 0.0,
            kl_estimator: KlEstimator::K3,
            entropy_coeff: 0.0,
            mask_truncated: false,
            tis_cap: None,
            dpo_beta: 2.0,
        }
    }
}

/// How the update runs, not what it computes: generation-call and micro-batch sizes, activation checkpointing, the all-reduce buckets, what a non-finite gradient does. Keys of the `[learner]` table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SystemSettings {
    /// Prompts sampled together in one generation call (rows = prompts x k).
    pub rollout_prompts_per_call: usize,
    /// Token budget (prompt + response, padded) of one micro-batch; gradients are accumulated
    /// over them. A micro-batch holds rows of one group only (so data-parallel ranks, which own
    /// whole groups, run exactly one device's micro-batches).
    pub micro_batch_tokens: usize,
    /// Activation checkpointing per decoder layer: keep only each layer's input and recompute
    /// its forward during the backward (one extra forward per micro-batch; memory linear in
    /// layers x tokens x hidden). `true` makes `conrub_grpo::LearnerBuilder::build` call
    /// `Policy::enable_activation_checkpointing` (an error for a policy that cannot); `false`
    /// leaves the policy as it was built (a `conrub_models` policy built with checkpointing in its `Execution`
    /// keeps it).
    pub activation_checkpointing: bool,
    /// Data-parallel runs: megabytes (2^20 bytes) of flattened f32 gradients per all-reduced
    /// bucket (one all-reduce call each, per optimizer step).
    pub allreduce_bucket_mb: f64,
    /// What a non-finite gradient norm (from a NaN or infinite loss or gradient) does: `stop`
    /// the run with an error naming the step, before that optimizer step and before any
    /// checkpoint of it; or `skip-step`: drop that optimizer step, count it in the step's
    /// `skipped_optimizer_steps`, and stop once more than `max_skipped_steps` were dropped in a
    /// row. A non-finite weight after an update always stops the run.
    pub on_nonfinite: OnNonFinite,
    /// See `on_nonfinite`.
    pub max_skipped_steps: usize,
}

impl Default for SystemSettings {
    fn default() -> Self {
        Self {
            rollout_prompts_per_call: 32,
            micro_batch_tokens: 16_384,
            activation_checkpointing: false,
            allreduce_bucket_mb: 64.0,
            on_nonfinite: OnNonFinite::Stop,
            max_skipped_steps: 3,
        }
    }
}

impl LearnerConfig {
    /// Checks ranges, naming the key.
    pub fn validate(&self) -> Result<()> {
        self.check_method()?;
        self.check_rollout()?;
        self.optimizer.validate()?;
        self.objective.validate()?;
        self.system.validate()
    }

    /// Groups, ties, dynamic sampling, the reward's KL term and the update's passes.
    fn check_method(&self) -> Result<()> {
        let bad = |k: &str, m: &str| Err(SettingsError::key(format!("learner.{k}"), m));
        if !(2..=MAX_GROUP_SIZE).contains(&self.group_size) {
            return bad("group_size", &format!("must be from 2 to {MAX_GROUP_SIZE}"));
        }
        if self.dynamic_sampling && self.tie_mode != TieMode::Off {
            // Pairwise ties give tied groups directions; dynamic sampling drops them instead
            // (and under grpo-dpo the pairs come only from the tied groups it would drop).
            return bad(
                "dynamic_sampling",
                &format!(
                    "needs learner.tie_mode = \"off\" (it is \"{}\"): dynamic sampling drops the \
                     tied groups that the tie modes give directions to",
                    self.tie_mode.as_str()
                ),
            );
        }
        if self.dynamic_sampling_rounds > 64 {
            return bad(
                "dynamic_sampling_rounds",
                "must be at most 64 (each round rolls out and scores up to a step's groups)",
            );
        }
        if !(self.kl_in_reward.is_finite() && self.kl_in_reward >= 0.0) {
            return bad(
                "kl_in_reward",
                "must be a finite number >= 0 (0 turns it off)",
            );
        }
        for (key, v) in [
            ("ppo_epochs", self.ppo_epochs),
            ("mini_batches", self.mini_batches),
        ] {
            if v == 0 {
                return bad(key, "must be at least 1");
            }
        }
        Ok(())
    }

    /// The rollout: its length, its sampling rule, its stop strings.
    fn check_rollout(&self) -> Result<()> {
        let bad = |k: &str, m: &str| Err(SettingsError::key(format!("learner.{k}"), m));
        if self.max_response_tokens == 0 {
            return bad("max_response_tokens", "must be at least 1");
        }
        self.sampling.validate("learner.")?;
        // A partial UTF-8 sequence decodes to U+FFFD until its last byte arrives, so a stop
        // string holding one could match a prefix and vanish from the longer text.
        if self
            .stop
            .iter()
            .any(|s| s.is_empty() || s.contains('\u{FFFD}'))
        {
            return bad(
                "stop",
                "stop strings must be non-empty and hold no U+FFFD replacement character",
            );
        }
        Ok(())
    }
}

/// A key's error under `learner.`.
fn bad(key: &str, message: &str) -> Result<()> {
    Err(SettingsError::key(format!("learner.{key}"), message))
}

impl OptimizerSettings {
    /// Checks ranges, naming the key under `learner.`.
    pub fn validate(&self) -> Result<()> {
        if !(self.lr > 0.0 && self.lr.is_finite()) {
            return bad("lr", "must be a finite number > 0");
        }
        if self.lr_warmup_steps.is_some() && self.lr_warmup_ratio.is_some() {
            return bad(
                "lr_warmup_ratio",
                "give lr_warmup_steps or lr_warmup_ratio, not both",
            );
        }
        if let Some(r) = self.lr_warmup_ratio {
            if !(0.0..1.0).contains(&r) {
                return bad("lr_warmup_ratio", "must be in [0, 1)");
            }
        }
        if !(0.0..=1.0).contains(&self.min_lr_ratio) {
            return bad("min_lr_ratio", "must be in [0, 1]");
        }
        if !(self.weight_decay >= 0.0 && self.weight_decay.is_finite()) {
            return bad(
                "weight_decay",
                "must be a finite number >= 0 (0 turns it off)",
            );
        }
        for (key, beta) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&beta) {
                return bad(key, "must be in [0, 1)");
            }
        }
        if !(self.adam_eps > 0.0 && self.adam_eps.is_finite()) {
            return bad("adam_eps", "must be a finite number > 0");
        }
        if !(self.max_grad_norm >= 0.0 && self.max_grad_norm.is_finite()) {
            return bad(
                "max_grad_norm",
                "must be a finite number >= 0 (0 turns clipping off)",
            );
        }
        Ok(())
    }
}

impl ObjectiveSettings {
    /// Checks ranges, naming the key under `learner.`.
    pub fn validate(&self) -> Result<()> {
        if !(self.clip.low > 0.0 && self.clip.low < 1.0 && self.clip.high > 0.0) {
            return bad("clip", "need 0 < low < 1 and high > 0");
        }
        if !self.entropy_coeff.is_finite() {
            return bad(
                "entropy_coeff",
                "must be a finite number (0 turns it off; > 0 rewards entropy)",
            );
        }
        if !(self.kl_beta.is_finite() && self.kl_beta >= 0.0) {
            // A negative weight would reward moving away from the reference.
            return bad("kl_beta", "must be a finite number >= 0 (0 turns it off)");
        }
        if let Some(cap) = self.tis_cap {
            if !(cap > 0.0 && cap.is_finite()) {
                return bad("tis_cap", "must be a positive number");
            }
        }
        Ok(())
    }
}

impl SystemSettings {
    /// Checks ranges, naming the key under `learner.`.
    pub fn validate(&self) -> Result<()> {
        if self.rollout_prompts_per_call == 0 {
            return bad("rollout_prompts_per_call", "must be at least 1");
        }
        if !(self.allreduce_bucket_mb > 0.0) {
            return bad("allreduce_bucket_mb", "must be > 0");
        }
        Ok(())
    }

    /// Bytes per all-reduced gradient bucket (`allreduce_bucket_mb`).
    pub fn allreduce_bucket_bytes(&self) -> usize {
        (self.allreduce_bucket_mb * (1u64 << 20) as f64) as usize
    }
}

/// The per-token estimator of the KL to the reference policy (Schulman's k1, k2, k3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KlEstimator {
    /// `logp - logp_ref`: unbiased, can be negative.
    K1,
    /// `(logp - logp_ref)^2 / 2`.
    K2,
    /// `exp(logp_ref - logp) - (logp_ref - logp) - 1`: unbiased and non-negative.
    #[default]
    K3,
}

/// How per-token losses become one number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Aggregation {
    /// The method's: token mean per response, then mean over responses (TRL `loss_type="grpo"`).
    #[default]
    SequenceMean,
    /// One mean over all response tokens of the (mini-)batch (TRL `bnpo`).
    GlobalTokenMean,
    /// Dr. GRPO: token sum divided by (responses x the rollout's maximum response length, i.e.
    /// `learner.max_response_tokens`) (TRL `dr_grpo`).
    DrGrpo,
}

/// How a group's rewards are scaled before they become advantages (TRL's `scale_rewards`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScaleRewards {
    /// Divide by the group's *sample* standard deviation (Bessel's correction, as TRL) plus
    /// 1e-4: the method's GRPO.
    #[default]
    Group,
    /// No scaling: `R_i - mean(R)` (the Dr. GRPO recipe).
    None,
}

/// What happens to exactly tied groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TieMode {
    /// The method: the pairwise tie breaker gives +1/-1 sequence advantages.
    #[default]
    Pairwise,
    /// The GRPO+DPO baseline: vanilla advantages (zero for ties) plus a DPO term on accepted pairs.
    GrpoDpo,
    /// Vanilla GRPO: ties keep zero advantages, no judge calls.
    Off,
}

impl TieMode {
    /// The mode as the config spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            TieMode::Pairwise => "pairwise",
            TieMode::GrpoDpo => "grpo-dpo",
            TieMode::Off => "off",
        }
    }
}

/// Asymmetric clipping of the probability ratio: `[1 - low, 1 + high]` (`learner.clip` in a train
/// config; the method's 0.20 / 0.28 by default).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Clip {
    /// `eps_low`: the ratio is clipped below at `1 - low`.
    pub low: f64,
    /// `eps_high`: the ratio is clipped above at `1 + high`.
    pub high: f64,
}

impl Default for Clip {
    fn default() -> Self {
        Self {
            low: 0.20,
            high: 0.28,
        }
    }
}

flat_by_derive!(OptimizerSettings, ObjectiveSettings, SystemSettings);

impl Flat for LearnerConfig {
    fn read<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        // The derive's reader (`remote = "Self"`): every key but the sampling rule's.
        LearnerConfig::deserialize(d)
    }
}

impl<'de> Deserialize<'de> for LearnerConfig {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let groups = [
            FlatGroup::of::<LearnerConfig>(),
            FlatGroup::of::<SamplingParams>(),
            FlatGroup::of::<OptimizerSettings>(),
            FlatGroup::of::<ObjectiveSettings>(),
            FlatGroup::of::<SystemSettings>(),
        ];
        let [own, sampling, optimizer, objective, system] = read_groups(d, groups)?;
        Ok(LearnerConfig {
            sampling: sampling.into_value()?,
            optimizer: optimizer.into_value()?,
            objective: objective.into_value()?,
            system: system.into_value()?,
            ..own.into_value()?
        })
    }
}

impl Serialize for LearnerConfig {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let own = LearnerConfig::serialize(self, serde_json::value::Serializer);
        flat_fields([
            own,
            serde_json::to_value(self.sampling),
            serde_json::to_value(&self.optimizer),
            serde_json::to_value(&self.objective),
            serde_json::to_value(&self.system),
        ])
        .map_err(serde::ser::Error::custom)?
        .serialize(s)
    }
}
