//! [`LearnerBuilder`]: a learner's stages chosen before it is built.

use super::types::*;

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
    pub(super) cfg: LearnerConfig,
    pub(super) device: B::Device,
    pub(super) codec: Option<Box<dyn TextCodec>>,
    pub(super) rewards: Option<Box<dyn RewardSource<T>>>,
    pub(super) tie_breaker: Option<Box<dyn TieBreaker>>,
    pub(super) estimator: Option<Box<dyn AdvantageEstimator>>,
    pub(super) registry: Option<Registry<B>>,
    pub(super) rollout: Option<RolloutStage<B, P>>,
    pub(super) stop_ids: Vec<u32>,
    pub(super) rank: Option<RankSlot<B::InnerBackend>>,
}

impl<B, P, T> LearnerBuilder<B, P, T>
where
    B: AutodiffBackend + KernelOps,
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
        if cfg.system.activation_checkpointing {
            self.policy.enable_activation_checkpointing()?;
        }
        if cfg.objective.entropy_coeff != 0.0 {
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
                prompts_per_call: cfg.system.rollout_prompts_per_call,
            })
        });
        let mut update = Update::new(UpdateConfig {
            lr: cfg.optimizer.lr,
            weight_decay: cfg.optimizer.weight_decay,
            beta1: cfg.optimizer.beta1,
            beta2: cfg.optimizer.beta2,
            eps: cfg.optimizer.adam_eps,
            max_grad_norm: cfg.optimizer.max_grad_norm,
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
            (cfg.objective.kl_beta != 0.0 || cfg.kl_in_reward != 0.0).then(|| self.policy.valid());
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
            path: GradientPath::of(self.rank.clone()),
            rank: self.rank,
            skipped_in_a_row: 0,
            unscored_in_a_row: 0,
            schedule_ready,
        })
    }
}
