//! What a step reports: its metrics line and its output, merged over ranks.

use super::*;

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
    if !scored.is_empty() {
        let mean = scored.iter().sum::<f64>() / scored.len() as f64;
        m.reward_mean = mean;
        m.reward_std_population = (scored.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>()
            / scored.len() as f64)
            .sqrt();
    }
    m.reward_histogram = vec![0; 20];
    for r in &scored {
        m.reward_histogram[reward_bin(*r)] += 1;
    }
    for (g, o) in outcomes.iter().enumerate() {
        record_group(&mut m.ties, o, rewards[g].first().copied().flatten());
    }
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
    let e = &rollout.telemetry;
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
    m.judge_retries = scores.iter().map(|g| g.judge_retries as u64).sum();
    m.judge_deferred = scores.iter().map(|g| g.judge_deferred).sum();
    let criteria: usize = scores
        .iter()
        .map(|g| g.scores.len() * g.criteria.len())
        .sum();
    m.judge_deferred_share = m.judge_deferred as f64 / criteria.max(1) as f64;
    m.judge_latency_ms = scores.iter().map(|g| g.judge_latency_ms).sum::<f64>() / n.max(1) as f64;
    m
}

/// The sequence lengths of a whole step's rows, the tokens each adds to the loss (its response
/// length, 0 for a masked truncated response), and the index among them of a learner's first.
pub(crate) struct GlobalRows {
    pub seq_lens: Vec<usize>,
    pub lens: Vec<usize>,
    pub first: usize,
}

/// The step's output from the parts of its ranks, in rank order (one part on one device): the
/// rollouts, scores and outcomes concatenated, the update's numbers (the same on every rank)
/// from rank 0, the stage times of the slowest rank, and the stragglers' times.
pub(crate) fn step_output(step: u64, k: usize, ranks: usize, parts: Vec<StepParts>) -> StepOutput {
    let max = |f: fn(&StepParts) -> f64| parts.iter().map(f).fold(0.0, f64::max);
    let min = |f: fn(&StepParts) -> f64| parts.iter().map(f).fold(f64::INFINITY, f64::min);
    let (rollout_max, rollout_min) = (max(|p| p.rollout_secs), min(|p| p.rollout_secs));
    let (update_max, update_min) = (max(|p| p.update_secs), min(|p| p.update_secs));
    let judge_secs = max(|p| p.judge_secs);
    // The busiest rank's bytes and seconds of each collective kind.
    let comm = parts
        .iter()
        .map(|p| p.update.comm)
        .fold(CommStats::default(), |a, b| CommStats {
            allreduce_bytes: a.allreduce_bytes.max(b.allreduce_bytes),
            allreduce_secs: a.allreduce_secs.max(b.allreduce_secs),
            reduce_scatter_bytes: a.reduce_scatter_bytes.max(b.reduce_scatter_bytes),
            reduce_scatter_secs: a.reduce_scatter_secs.max(b.reduce_scatter_secs),
            all_gather_bytes: a.all_gather_bytes.max(b.all_gather_bytes),
            all_gather_secs: a.all_gather_secs.max(b.all_gather_secs),
        });
    let dpo_pairs = parts.iter().map(|p| p.dpo_pairs).sum();
    // Shared engines sync once for all ranks: the slowest rank's sync is the step's.
    let weight_sync = parts
        .iter()
        .map(|p| p.weight_sync)
        .fold(WeightSync::default(), |a, b| WeightSync {
            secs: a.secs.max(b.secs),
            bytes: a.bytes.max(b.bytes),
        });
    let gap = LogprobGap::merge(parts.iter().map(|p| p.logprob_gap));
    let penalties: Vec<f64> = parts.iter().flat_map(|p| p.reward_kl.clone()).collect();
    let reward_kl_penalty =
        (!penalties.is_empty()).then(|| penalties.iter().sum::<f64>() / penalties.len() as f64);
    let device_memory: Vec<u64> = parts.iter().filter_map(|p| p.device_memory).collect();
    let prompts: Vec<usize> = parts.iter().flat_map(|p| p.prompts.clone()).collect();
    let dynamic = parts[0].dynamic.map(|d| Refilled {
        dropped: parts
            .iter()
            .filter_map(|p| p.dynamic)
            .map(|d| d.dropped)
            .sum(),
        unscored: parts
            .iter()
            .filter_map(|p| p.dynamic)
            .map(|d| d.unscored)
            .sum(),
        ..d
    });
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
    metrics.dpo_pairs = dpo_pairs;
    (
        metrics.rollout_secs,
        metrics.judge_secs,
        metrics.update_secs,
    ) = (rollout_max, judge_secs, update_max);
    metrics.ranks = ranks;
    metrics.device_memory_reserved_bytes = device_memory;
    (metrics.allreduce_bytes, metrics.allreduce_secs) = (comm.allreduce_bytes, comm.allreduce_secs);
    (metrics.reduce_scatter_bytes, metrics.reduce_scatter_secs) =
        (comm.reduce_scatter_bytes, comm.reduce_scatter_secs);
    (metrics.all_gather_bytes, metrics.all_gather_secs) =
        (comm.all_gather_bytes, comm.all_gather_secs);
    (metrics.weight_sync_secs, metrics.weight_sync_bytes) = (weight_sync.secs, weight_sync.bytes);
    let tokens = gap.tokens.max(1) as f64;
    metrics.rollout_logprob_diff_mean = gap.abs_sum / tokens;
    metrics.rollout_logprob_diff_max = gap.abs_max;
    metrics.rollout_kl = gap.k3_sum / tokens;
    metrics.reward_kl_penalty = reward_kl_penalty;
    if let Some(d) = dynamic {
        metrics.dynamic_groups_dropped = Some(d.dropped);
        metrics.dynamic_prompts_drawn = Some(d.drawn);
        metrics.dynamic_rounds = Some(d.rounds);
        metrics.dynamic_unscored = Some(d.unscored);
    }
    (metrics.rollout_secs_rank_max, metrics.rollout_secs_rank_min) = (rollout_max, rollout_min);
    (metrics.update_secs_rank_max, metrics.update_secs_rank_min) = (update_max, update_min);
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
