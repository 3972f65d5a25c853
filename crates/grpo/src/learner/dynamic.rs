//! Dynamic sampling (`learner.dynamic_sampling`, DAPO's `filter_groups`): groups without reward
//! variance dropped and the reserve's prompts rolled out and scored in their place, round by round.

use super::types::*;

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
        let mut kept: Vec<usize> = (0..target)
            .filter(|&g| has_variance(&scored.scores[g]))
            .collect();
        let (mut drawn, mut rounds) = (0usize, 1usize);
        // The scored and all responses this rank drew so far.
        let mut drawn_scores = tally(&scored.scores);
        let rank = self.rank.as_ref().map_or(0, |s| s.rank);
        let counts = loop {
            // Per rank: [groups still needed, groups kept, scored responses, responses].
            let counts = self.gather_counts(vec![
                (target - kept.len()) as f64,
                kept.len() as f64,
                drawn_scores.0,
                drawn_scores.1,
            ])?;
            let total_need: usize = counts.iter().map(|c| c[0] as usize).sum();
            if self.refill_done(&counts, total_need, rounds, drawn >= reserve.len()) {
                break counts;
            }
            let before: usize = counts[..rank].iter().map(|c| c[0] as usize).sum();
            let start = (drawn + before).min(reserve.len());
            let end = (drawn + before + target - kept.len()).min(reserve.len());
            if start < end {
                // Reserve prompts' streams follow the step's groups: index `total + position`.
                let extra: Vec<(usize, &T)> = (start..end)
                    .map(|p| (shard.total + p, reserve[p]))
                    .collect();
                let more = self.rollout_and_score(inner, extra, times).await?;
                let round = tally(&more.scores);
                drawn_scores = (drawn_scores.0 + round.0, drawn_scores.1 + round.1);
                append_groups(&mut scored, &mut kept, more);
            }
            drawn = (drawn + total_need).min(reserve.len());
            rounds += 1;
        };
        let (kept, shard) = settle_shard(kept, shard, &counts, rank, target);
        let refilled = Refilled {
            dropped: scored.prompts.len() - kept.len(),
            drawn,
            rounds,
            unscored: unscored_outside(&scored, &kept),
        };
        Ok((scored, kept, shard, refilled))
    }

    /// Whether refilling stops: nothing is needed, the extra rounds are spent, the reserve is
    /// used up, or the judges failed on too many of the responses drawn so far (the step is then
    /// not refilled: its groups dropped for want of scores, not of variance, and the scored-share
    /// check counts them).
    fn refill_done(
        &self,
        counts: &[Vec<f64>],
        total_need: usize,
        rounds: usize,
        reserve_spent: bool,
    ) -> bool {
        let spent = rounds > self.cfg.dynamic_sampling_rounds;
        let (round_scored, round_all) = counts
            .iter()
            .fold((0.0, 0.0), |(s, a), c| (s + c[2], a + c[3]));
        let failing = round_all > 0.0 && round_scored / round_all < self.cfg.min_scored_share;
        total_need == 0 || spent || failing || reserve_spent
    }
}

/// Whether a group's scored rewards differ (a group without variance teaches nothing).
fn has_variance(s: &GroupScores) -> bool {
    let rewards: Vec<Option<f64>> = s.scores.iter().map(ResponseScore::reward).collect();
    crate::group::scored_rewards_differ(&rewards)
}

/// The scored responses and all responses of `scores`.
fn tally(scores: &[GroupScores]) -> (f64, f64) {
    let all = scores.iter().flat_map(|g| &g.scores);
    let scored = all.clone().filter(|s| s.is_scored()).count();
    (scored as f64, all.count() as f64)
}

/// Appends a round's groups to `scored`, and those with variance to `kept`.
fn append_groups<'r, T>(scored: &mut Scored<'r, T>, kept: &mut Vec<usize>, more: Scored<'r, T>) {
    let offset = scored.prompts.len();
    kept.extend(
        (0..more.prompts.len())
            .filter(|&g| has_variance(&more.scores[g]))
            .map(|g| offset + g),
    );
    scored.prompts.extend(more.prompts);
    scored.rollout.append(more.rollout);
    scored.texts.extend(more.texts);
    scored.scores.extend(more.scores);
}

/// The groups this rank trains on and their shard of the step: the kept ones, or, when no rank
/// kept a group, the step's first `target` groups as drawn.
fn settle_shard(
    kept: Vec<usize>,
    shard: Shard,
    counts: &[Vec<f64>],
    rank: usize,
    target: usize,
) -> (Vec<usize>, Shard) {
    let kept_total: usize = counts.iter().map(|c| c[1] as usize).sum();
    if kept_total == 0 {
        return ((0..target).collect(), shard);
    }
    let first = counts[..rank].iter().map(|c| c[1] as usize).sum();
    (
        kept,
        Shard {
            first,
            total: kept_total,
        },
    )
}

/// Responses of the groups not trained on that were left unscored.
fn unscored_outside<T>(scored: &Scored<'_, T>, kept: &[usize]) -> usize {
    let mut trained = vec![false; scored.prompts.len()];
    kept.iter().for_each(|&g| trained[g] = true);
    (0..trained.len())
        .filter(|&g| !trained[g])
        .flat_map(|g| &scored.scores[g].scores)
        .filter(|s| !s.is_scored())
        .count()
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
