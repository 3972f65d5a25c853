//! The reward stage: each group scored by the reward source, the scored share checked, and
//! `kl_in_reward`'s penalties.

use super::*;

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
