//! The advantage stage: the estimator's advantages with exact ties found and broken (pairwise
//! judge, or none).

use super::types::*;

impl<B, P, T> Learner<B, P, T>
where
    B: AutodiffBackend + KernelOps,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
    T: TaskPrompt,
{
    /// Stage 3: advantages of every group; exact ties go to the tie breaker (concurrently).
    pub(super) async fn advantage_stage(
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
}
