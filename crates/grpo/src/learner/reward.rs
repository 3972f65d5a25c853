//! The reward stage: each group scored by the reward source, the scored share checked, and
//! `kl_in_reward`'s penalties.

use super::types::*;

impl<B, P, T> Learner<B, P, T>
where
    B: AutodiffBackend + KernelOps,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
    T: TaskPrompt,
{
    /// Whether the step's scored share (responses whose every reward part was scored, over every
    /// rank) reaches `min_scored_share`; below it the step does not update the policy, and the
    /// `max_unscored_steps`-th such step in a row is an error with the judge's last message.
    pub(super) fn enough_scored(&mut self, scores: &[GroupScores]) -> Result<bool> {
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

    /// Stage 2: the rewards of every group, concurrently.
    pub(super) async fn reward_stage(
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
}

/// Per row of `logp` (`[rows, R]`, right-padded with 0 like `logp_ref`), the summed per-token
/// KL estimate `estimator` to the reference, on the host.
pub(super) fn sequence_kl<B: burn::tensor::backend::Backend>(
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
pub(super) fn reward_penalties(scores: &[GroupScores], kl: Option<&[f64]>, beta: f64) -> Vec<f64> {
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
