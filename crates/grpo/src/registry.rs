//! Plug-ins chosen by name from the config, as verl's registries are: `learner.estimator` names
//! the advantage estimator of the groups that are not exact ties, `learner.loss` the policy loss.
//! The built-in entries read today's keys as their parameters (`scale_rewards` for
//! `group-relative`; `clip`, `aggregation`, `kl_beta`, `tis_cap` for `clipped-surrogate`); the tie
//! handling around the estimator stays `tie_mode`'s (`pairwise`, `dpo`, `off`). An embedder adds
//! entries to a [`Registry`] and hands it to
//! [`LearnerBuilder::registry`](crate::LearnerBuilder::registry); a config then selects them by
//! name like the built-in ones.

use std::collections::BTreeMap;
use std::sync::Arc;

use burn::tensor::backend::Backend;
use conrub_kernels::KernelOps;

use crate::advantages::{AdvantageEstimator, GroupRelative};
use crate::error::{GrpoError, Result};
use crate::loss::{PolicyLoss, PolicyObjective};
use conrub_contracts::LearnerConfig;
pub use conrub_contracts::{DEFAULT_ESTIMATOR, DEFAULT_LOSS, GSPO_LOSS};

/// Builds an advantage estimator from the learner's settings.
pub type EstimatorFactory =
    Arc<dyn Fn(&LearnerConfig) -> Result<Box<dyn AdvantageEstimator>> + Send + Sync>;
/// Builds a policy loss from the learner's settings.
pub type LossFactory<B> =
    Arc<dyn Fn(&LearnerConfig) -> Result<Box<dyn PolicyObjective<B>>> + Send + Sync>;

/// The named estimators and losses a learner can be configured with.
pub struct Registry<B: Backend> {
    estimators: BTreeMap<String, EstimatorFactory>,
    losses: BTreeMap<String, LossFactory<B>>,
}

impl<B: Backend> Clone for Registry<B> {
    fn clone(&self) -> Self {
        Self {
            estimators: self.estimators.clone(),
            losses: self.losses.clone(),
        }
    }
}

impl<B: KernelOps> Default for Registry<B> {
    fn default() -> Self {
        Self::builtin()
    }
}

impl<B: KernelOps> Registry<B> {
    /// The built-in entries: [`DEFAULT_ESTIMATOR`], [`DEFAULT_LOSS`] and [`GSPO_LOSS`].
    pub fn builtin() -> Self {
        let mut r = Self {
            estimators: BTreeMap::new(),
            losses: BTreeMap::new(),
        };
        r.register_estimator(DEFAULT_ESTIMATOR, |cfg| {
            Ok(Box::new(GroupRelative {
                scale: cfg.scale_rewards,
            }))
        });
        r.register_loss(DEFAULT_LOSS, |cfg| {
            Ok(Box::new(PolicyLoss::from_config(cfg)))
        });
        r.register_loss(GSPO_LOSS, |cfg| Ok(Box::new(PolicyLoss::gspo(cfg))));
        r
    }
}

impl<B: Backend> Registry<B> {
    /// Adds (or replaces) the estimator called `name`.
    pub fn register_estimator(
        &mut self,
        name: &str,
        factory: impl Fn(&LearnerConfig) -> Result<Box<dyn AdvantageEstimator>> + Send + Sync + 'static,
    ) -> &mut Self {
        self.estimators.insert(name.to_string(), Arc::new(factory));
        self
    }

    /// Adds (or replaces) the loss called `name`.
    pub fn register_loss(
        &mut self,
        name: &str,
        factory: impl Fn(&LearnerConfig) -> Result<Box<dyn PolicyObjective<B>>> + Send + Sync + 'static,
    ) -> &mut Self {
        self.losses.insert(name.to_string(), Arc::new(factory));
        self
    }

    /// The registered estimator names, sorted.
    pub fn estimator_names(&self) -> Vec<&str> {
        self.estimators.keys().map(String::as_str).collect()
    }

    /// The registered loss names, sorted.
    pub fn loss_names(&self) -> Vec<&str> {
        self.losses.keys().map(String::as_str).collect()
    }

    /// Whether `cfg.estimator` and `cfg.loss` are registered, without building them: what
    /// `conrub train` and `conrub plan` check before loading anything (against
    /// [`Registry::builtin`]; a learner checks its own registry when it is built).
    pub fn check_names(&self, cfg: &LearnerConfig) -> Result<()> {
        if !self.estimators.contains_key(&cfg.estimator) {
            return Err(unknown(
                "learner.estimator",
                &cfg.estimator,
                &self.estimator_names(),
            ));
        }
        if !self.losses.contains_key(&cfg.objective.loss) {
            return Err(unknown(
                "learner.loss",
                &cfg.objective.loss,
                &self.loss_names(),
            ));
        }
        Ok(())
    }

    /// The estimator `cfg.estimator` names, built from `cfg`.
    pub fn estimator(&self, cfg: &LearnerConfig) -> Result<Box<dyn AdvantageEstimator>> {
        let make = self
            .estimators
            .get(&cfg.estimator)
            .ok_or_else(|| unknown("learner.estimator", &cfg.estimator, &self.estimator_names()))?;
        make(cfg)
    }

    /// The loss `cfg.loss` names, built from `cfg`.
    pub fn loss(&self, cfg: &LearnerConfig) -> Result<Box<dyn PolicyObjective<B>>> {
        let make = self
            .losses
            .get(&cfg.objective.loss)
            .ok_or_else(|| unknown("learner.loss", &cfg.objective.loss, &self.loss_names()))?;
        make(cfg)
    }
}

fn unknown(key: &str, name: &str, registered: &[&str]) -> GrpoError {
    GrpoError::config(
        key,
        format!(
            "`{name}` is not registered (registered: {})",
            registered.join(", ")
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::advantages::ScaleRewards;
    use crate::learner::ObjectiveSettings;
    use crate::loss::SurrogateBatch;
    use burn::backend::Flex;
    use burn::tensor::Tensor;

    /// Advantages of +1 for the best response and -1 for the others.
    struct BestOfGroup;

    impl AdvantageEstimator for BestOfGroup {
        fn advantages(&self, rewards: &[Option<f64>]) -> Vec<f64> {
            let best = rewards
                .iter()
                .enumerate()
                .filter_map(|(i, r)| r.map(|r| (i, r)))
                .max_by(|a, b| a.1.total_cmp(&b.1))
                .map(|(i, _)| i);
            (0..rewards.len())
                .map(|i| if Some(i) == best { 1.0 } else { -1.0 })
                .collect()
        }
    }

    #[test]
    fn the_config_names_the_entry_and_its_keys_are_its_parameters() {
        let r = Registry::<Flex>::builtin();
        let mut cfg = LearnerConfig::default();
        assert_eq!(cfg.estimator, DEFAULT_ESTIMATOR);
        assert_eq!(cfg.objective.loss, DEFAULT_LOSS);
        let rewards = [Some(1.0), Some(0.0), Some(0.5), None];
        let grpo = r.estimator(&cfg).unwrap().advantages(&rewards);
        assert_eq!(
            grpo,
            GroupRelative {
                scale: ScaleRewards::Group
            }
            .advantages(&rewards)
        );
        cfg.scale_rewards = ScaleRewards::None;
        assert_eq!(r.estimator(&cfg).unwrap().advantages(&rewards)[0], 0.5);
        assert_eq!(r.estimator_names(), [DEFAULT_ESTIMATOR]);
        assert_eq!(r.loss_names(), [DEFAULT_LOSS, GSPO_LOSS]);
        r.check_names(&cfg).unwrap();
        cfg.objective.loss = "rloo".into();
        assert_eq!(
            r.check_names(&cfg).unwrap_err().to_string(),
            "learner.loss: `rloo` is not registered (registered: clipped-surrogate, gspo)"
        );
    }

    #[test]
    fn an_embedder_adds_entries_and_unknown_names_list_the_registered() {
        let mut r = Registry::<Flex>::builtin();
        r.register_estimator("best-of-group", |_| Ok(Box::new(BestOfGroup)));
        let cfg = LearnerConfig {
            estimator: "best-of-group".into(),
            ..Default::default()
        };
        let a = r
            .estimator(&cfg)
            .unwrap()
            .advantages(&[Some(0.2), Some(0.9), None]);
        assert_eq!(a, vec![-1.0, 1.0, -1.0]);
        let bad = LearnerConfig {
            objective: ObjectiveSettings {
                loss: "ppo-kl".into(),
                ..Default::default()
            },
            ..Default::default()
        };
        let e = r.loss(&bad).err().unwrap().to_string();
        assert_eq!(
            e,
            "learner.loss: `ppo-kl` is not registered (registered: clipped-surrogate, gspo)"
        );
        let e = r
            .estimator(&LearnerConfig {
                estimator: "rloo".into(),
                ..Default::default()
            })
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("best-of-group, group-relative"), "{e}");
    }

    #[test]
    fn the_builtin_loss_is_the_policy_loss() {
        let r = Registry::<Flex>::builtin();
        let cfg = LearnerConfig::default();
        let device = Default::default();
        let batch = || SurrogateBatch::<Flex> {
            logp: Tensor::from_floats([[-1.0, -2.0], [-0.5, 0.0]], &device),
            logp_old: Tensor::from_floats([[-1.1, -1.9], [-0.4, 0.0]], &device),
            advantages: Tensor::from_floats([1.0, -1.0], &device),
            mask: Tensor::from_floats([[1.0, 1.0], [1.0, 0.0]], &device),
            logp_ref: None,
            logp_engine: None,
        };
        let got = r.loss(&cfg).unwrap().compute(batch()).loss.into_scalar();
        let want = PolicyLoss::from_config(&cfg)
            .compute(batch())
            .loss
            .into_scalar();
        assert_eq!(got, want);
    }
}
