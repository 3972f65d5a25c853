//! What a step reports: its metrics line and its output, merged over ranks.

use super::types::*;

/// Stage 6: the step's metrics (host arithmetic on what the stages returned).
pub(super) fn step_metrics(
    step: u64,
    rollout: &RolloutBatch,
    scores: &[GroupScores],
    outcomes: &[GroupOutcome],
    u: UpdateStats,
) -> StepMetrics {
    let n = rollout.rows();
    let rewards: Vec<Vec<Option<f64>>> = scores
        .iter()
        .map(|g| g.scores.iter().map(ResponseScore::reward).collect())
        .collect();
    let scored: Vec<f64> = rewards.iter().flatten().flatten().copied().collect();
    let mut m = StepMetrics {
        step,
        prompts: rollout.prompts.len(),
        responses: n,
        scored: scored.len(),
        unscored: n - scored.len(),
        grad_norms: u.grad_norms,
        optimizer_steps: u.optimizer_steps,
        skipped_optimizer_steps: u.skipped_optimizer_steps,
        loss: u.loss,
        clip_low: u.clip_low,
        clip_high: u.clip_high,
        kl: u.kl,
        entropy: u.entropy,
        update_tokens_computed: u.tokens_computed,
        update_tokens_needed: u.tokens_needed,
        lr: u.lr,
        ..Default::default()
    };
    reward_stats(&mut m, &scored);
    for (g, o) in outcomes.iter().enumerate() {
        record_group(&mut m.ties, o, rewards[g].first().copied().flatten());
    }
    response_stats(&mut m, rollout);
    engine_stats(&mut m, &rollout.telemetry);
    judge_stats(&mut m, scores, n);
    m
}

/// The scored rewards' mean, population standard deviation and histogram.
fn reward_stats(m: &mut StepMetrics, scored: &[f64]) {
    if !scored.is_empty() {
        let mean = scored.iter().sum::<f64>() / scored.len() as f64;
        m.reward_mean = mean;
        m.reward_std_population = (scored.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>()
            / scored.len() as f64)
            .sqrt();
    }
    m.reward_histogram = vec![0; 20];
    for r in scored {
        m.reward_histogram[reward_bin(*r)] += 1;
    }
}

/// The responses' token counts (total, mean, p90, max) and truncations.
fn response_stats(m: &mut StepMetrics, rollout: &RolloutBatch) {
    let n = rollout.rows();
    let mut lens: Vec<usize> = rollout.responses.iter().map(Vec::len).collect();
    lens.sort_unstable();
    m.response_tokens = lens.iter().sum();
    m.response_len_mean = m.response_tokens as f64 / n.max(1) as f64;
    m.response_len_p90 = lens
        .get(((0.9 * n as f64).ceil() as usize).clamp(1, n.max(1)) - 1)
        .copied()
        .unwrap_or(0);
    m.response_len_max = lens.last().copied().unwrap_or(0);
    m.truncated = rollout.truncated().filter(|t| *t).count();
}

/// What the rollout engine reported: preemptions, KV blocks, running rows and tokens.
fn engine_stats(m: &mut StepMetrics, e: &RolloutStats) {
    (
        m.rollout_preemptions,
        m.rollout_kv_blocks,
        m.rollout_peak_kv_blocks,
        m.rollout_peak_running_rows,
    ) = (
        e.preemptions,
        e.kv_blocks,
        e.peak_kv_blocks,
        e.peak_running_rows,
    );
    (
        m.rollout_mean_running_rows,
        m.rollout_prefill_tokens,
        m.rollout_decode_steps,
    ) = (e.mean_running_rows, e.prefill_tokens, e.decode_steps);
    (m.rollout_tokens_computed, m.rollout_tokens_needed) =
        (e.tokens_computed as u64, e.tokens_needed as u64);
}

/// The judges' retries, deferred criteria and mean latency per response (`n` responses).
fn judge_stats(m: &mut StepMetrics, scores: &[GroupScores], n: usize) {
    m.judge_retries = scores.iter().map(|g| g.judge_retries as u64).sum();
    m.judge_deferred = scores.iter().map(|g| g.judge_deferred).sum();
    let criteria: usize = scores
        .iter()
        .map(|g| g.scores.len() * g.criteria.len())
        .sum();
    m.judge_deferred_share = m.judge_deferred as f64 / criteria.max(1) as f64;
    m.judge_latency_ms = scores.iter().map(|g| g.judge_latency_ms).sum::<f64>() / n.max(1) as f64;
}

/// The step's output from the parts of its ranks, in rank order (one part on one device): the
/// rollouts, scores and outcomes concatenated, the update's numbers (the same on every rank)
/// from rank 0, the stage times of the slowest rank, and the stragglers' times.
pub(crate) fn step_output(step: u64, k: usize, ranks: usize, parts: Vec<StepParts>) -> StepOutput {
    let across = AcrossRanks::of(&parts);
    let prompts: Vec<usize> = parts.iter().flat_map(|p| p.prompts.clone()).collect();
    let mut parts = parts.into_iter();
    let first = parts.next().expect("a step has at least one part");
    let update = first.update.clone();
    let (mut rollout, mut texts, mut scores, mut outcomes) =
        (first.rollout, first.texts, first.scores, first.outcomes);
    for p in parts {
        rollout.append(p.rollout);
        texts.extend(p.texts);
        scores.extend(p.scores);
        outcomes.extend(p.outcomes);
    }
    let mut metrics = step_metrics(step, &rollout, &scores, &outcomes, update);
    metrics.ranks = ranks;
    across.record(&mut metrics);
    let per_group = |rows: Vec<usize>| rows.chunks(k).map(<[usize]>::to_vec).collect();
    StepOutput {
        metrics,
        prompts,
        criteria: scores.iter().map(|g| g.criteria.clone()).collect(),
        scores: scores.into_iter().map(|g| g.scores).collect(),
        outcomes,
        responses: texts.chunks(k).map(<[String]>::to_vec).collect(),
        response_tokens: per_group(rollout.responses.iter().map(Vec::len).collect()),
        finish_reasons: rollout
            .finish_reasons
            .chunks(k)
            .map(<[FinishReason]>::to_vec)
            .collect(),
    }
}

/// What a step's ranks report beside their rows, merged: stage times (slowest and fastest
/// rank), the busiest rank's collectives, the slowest weight sync, log-prob gaps, KL penalties,
/// device memory, DPO pairs and dynamic sampling's counts.
struct AcrossRanks {
    rollout_secs: (f64, f64),
    update_secs: (f64, f64),
    judge_secs: f64,
    comm: CommStats,
    dpo_pairs: usize,
    weight_sync: WeightSync,
    gap: LogprobGap,
    reward_kl_penalty: Option<f64>,
    device_memory: Vec<u64>,
    dynamic: Option<Refilled>,
}

impl AcrossRanks {
    fn of(parts: &[StepParts]) -> Self {
        let max = |f: fn(&StepParts) -> f64| parts.iter().map(f).fold(0.0, f64::max);
        let min = |f: fn(&StepParts) -> f64| parts.iter().map(f).fold(f64::INFINITY, f64::min);
        let penalties: Vec<f64> = parts.iter().flat_map(|p| p.reward_kl.clone()).collect();
        let dynamic = parts[0].dynamic.map(|d| {
            let each = || parts.iter().filter_map(|p| p.dynamic);
            Refilled {
                dropped: each().map(|d| d.dropped).sum(),
                unscored: each().map(|d| d.unscored).sum(),
                ..d
            }
        });
        Self {
            rollout_secs: (max(|p| p.rollout_secs), min(|p| p.rollout_secs)),
            update_secs: (max(|p| p.update_secs), min(|p| p.update_secs)),
            judge_secs: max(|p| p.judge_secs),
            comm: parts
                .iter()
                .map(|p| p.update.comm)
                .fold(CommStats::default(), CommStats::busiest),
            dpo_pairs: parts.iter().map(|p| p.dpo_pairs).sum(),
            // Shared engines sync once for all ranks: the slowest rank's sync is the step's.
            weight_sync: parts
                .iter()
                .map(|p| p.weight_sync)
                .fold(WeightSync::default(), |a, b| WeightSync {
                    secs: a.secs.max(b.secs),
                    bytes: a.bytes.max(b.bytes),
                }),
            gap: LogprobGap::merge(parts.iter().map(|p| p.logprob_gap)),
            reward_kl_penalty: (!penalties.is_empty())
                .then(|| penalties.iter().sum::<f64>() / penalties.len() as f64),
            device_memory: parts.iter().filter_map(|p| p.device_memory).collect(),
            dynamic,
        }
    }

    /// Writes the merged numbers into the step's metrics.
    fn record(self, m: &mut StepMetrics) {
        let (rollout_max, rollout_min) = self.rollout_secs;
        let (update_max, update_min) = self.update_secs;
        m.dpo_pairs = self.dpo_pairs;
        (m.rollout_secs, m.judge_secs, m.update_secs) = (rollout_max, self.judge_secs, update_max);
        m.device_memory_reserved_bytes = self.device_memory;
        let comm = self.comm;
        (m.allreduce_bytes, m.allreduce_secs) = (comm.allreduce_bytes, comm.allreduce_secs);
        (m.reduce_scatter_bytes, m.reduce_scatter_secs) =
            (comm.reduce_scatter_bytes, comm.reduce_scatter_secs);
        (m.all_gather_bytes, m.all_gather_secs) = (comm.all_gather_bytes, comm.all_gather_secs);
        (m.weight_sync_secs, m.weight_sync_bytes) = (self.weight_sync.secs, self.weight_sync.bytes);
        let tokens = self.gap.tokens.max(1) as f64;
        m.rollout_logprob_diff_mean = self.gap.abs_sum / tokens;
        m.rollout_logprob_diff_max = self.gap.abs_max;
        m.rollout_kl = self.gap.k3_sum / tokens;
        m.reward_kl_penalty = self.reward_kl_penalty;
        if let Some(d) = self.dynamic {
            m.dynamic_groups_dropped = Some(d.dropped);
            m.dynamic_prompts_drawn = Some(d.drawn);
            m.dynamic_rounds = Some(d.rounds);
            m.dynamic_unscored = Some(d.unscored);
        }
        (m.rollout_secs_rank_max, m.rollout_secs_rank_min) = (rollout_max, rollout_min);
        (m.update_secs_rank_max, m.update_secs_rank_min) = (update_max, update_min);
    }
}
