//! Dynamic sampling (`learner.dynamic_sampling`, DAPO's `filter_groups`): groups without reward
//! variance dropped and the reserve's prompts rolled out and scored in their place, round by round.

use super::*;

impl<B, P, T> Learner<B, P, T>
where
    B: AutodiffBackend + KernelOps,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
    T: TaskPrompt,
{
    /// Dynamic sampling: drops the groups of `scored` whose scored rewards are all equal and
    /// rolls out prompts of `reserve` in their place, round after round, until every rank has
    /// its share of groups with variance, `dynamic_sampling_rounds` extra rounds are spent or the
    /// reserve is used up. Every rank takes part in every round (the counts are all-gathered, so
    /// all decide alike); a round's shortfall is drawn in rank order, so the prompts drawn, and
    /// their responses, are the ones one device would draw. Returns every group scored, the
    /// ones to train on, their shard of the step, and the counts. When no rank kept a group the
    /// step trains on its first groups (their advantages are zero).
    pub(super) async fn refill<'r>(
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
}

/// The groups `keep` of `scored`, in that order.
pub(super) fn select_scored<'r, T>(scored: Scored<'r, T>, keep: &[usize]) -> Scored<'r, T> {
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
