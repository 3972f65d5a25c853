//! Scoring many responses through a judge: labels from the judge, rewards from the rubric rules.

use std::time::Instant;

use conrub_rubric::{score_labels, LengthPenalty, ResponseScore, UnscoredReason};
use futures::StreamExt;
use serde::Serialize;

use crate::judge::{CriterionJudge, CriterionRequest, CriterionVerdict};

/// One response to score: the judge request and the response length in tokens (for the
/// overlength penalty; `None` applies no penalty).
#[derive(Debug, Clone)]
pub struct ScoreJob {
    /// What the judge sees.
    pub request: CriterionRequest,
    /// Response length in tokens.
    pub response_tokens: Option<u32>,
}

/// A judged and scored response.
#[derive(Debug, Clone, Serialize)]
pub struct ScoredJob {
    /// The judge's verdict (labels, raw outputs, attempts, latency).
    pub verdict: CriterionVerdict,
    /// Reward or unscored.
    pub score: ResponseScore,
}

/// Totals over a scoring run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct ScoringSummary {
    /// Responses.
    pub responses: usize,
    /// Scored responses.
    pub scored: usize,
    /// Unscored responses.
    pub unscored: usize,
    /// Verdicts served from the cache.
    pub cached: usize,
    /// Mean reward of scored responses.
    pub reward_mean: f64,
    /// Judge attempts beyond the first, over all responses.
    pub retries: u64,
    /// Criteria the judge handed to its fallback (a probe judge abstaining).
    pub deferred: u64,
    /// Mean judge latency per response, milliseconds.
    pub latency_ms_mean: f64,
    /// Wall time of the run, seconds.
    pub wall_secs: f64,
}

/// Turns a verdict into a score.
pub fn score_verdict(
    verdict: &CriterionVerdict,
    job: &ScoreJob,
    penalty: &LengthPenalty,
) -> ResponseScore {
    let pen = if job.response_tokens.is_some() {
        *penalty
    } else {
        LengthPenalty::disabled()
    };
    match &verdict.labels {
        Some(labels) => match score_labels(
            labels,
            job.request.criteria.len(),
            job.request.mode,
            job.response_tokens.unwrap_or(0),
            &pen,
        ) {
            Ok(s) => ResponseScore::Scored(s),
            Err(e) => ResponseScore::Unscored(UnscoredReason {
                message: e.to_string(),
                attempts: verdict.attempts,
            }),
        },
        None => ResponseScore::Unscored(UnscoredReason {
            message: verdict.error.clone().unwrap_or_else(|| "no labels".into()),
            attempts: verdict.attempts,
        }),
    }
}

/// Judges and scores every job, in order. Judges that batch on a device get chunks of `batch`
/// through [`CriterionJudge::judge_batch`]; others get a window of `window` calls in flight (the
/// client enforces its own concurrency). `on_progress(done)` is called as results arrive.
pub async fn score_jobs(
    judge: &dyn CriterionJudge,
    jobs: &[ScoreJob],
    penalty: &LengthPenalty,
    batch: Option<usize>,
    window: usize,
    on_progress: &(dyn Fn(usize) + Send + Sync),
) -> (Vec<ScoredJob>, ScoringSummary) {
    let start = Instant::now();
    let verdicts: Vec<CriterionVerdict> = match batch {
        Some(n) => {
            let mut out = Vec::with_capacity(jobs.len());
            for chunk in jobs.chunks(n.max(1)) {
                let reqs: Vec<CriterionRequest> = chunk.iter().map(|j| j.request.clone()).collect();
                out.extend(judge.judge_batch(&reqs).await);
                on_progress(out.len());
            }
            out
        }
        None => {
            let mut done = 0;
            // The futures are made first so the stream holds no closure (a closure there makes the
            // whole future not `Send` for callers inside `async_trait` methods).
            let calls: Vec<_> = jobs.iter().map(|j| judge.judge(&j.request)).collect();
            let mut stream = futures::stream::iter(calls).buffered(window.max(1));
            let mut out = Vec::with_capacity(jobs.len());
            while let Some(v) = stream.next().await {
                out.push(v);
                done += 1;
                on_progress(done);
            }
            out
        }
    };
    let results: Vec<ScoredJob> = verdicts
        .into_iter()
        .zip(jobs)
        .map(|(verdict, job)| ScoredJob {
            score: score_verdict(&verdict, job, penalty),
            verdict,
        })
        .collect();
    let mut s = ScoringSummary {
        responses: results.len(),
        wall_secs: start.elapsed().as_secs_f64(),
        ..Default::default()
    };
    let mut sum = 0.0;
    let mut lat = 0.0;
    for r in &results {
        if let Some(x) = r.score.reward() {
            s.scored += 1;
            sum += x;
        }
        s.cached += r.verdict.cached as usize;
        s.retries += r.verdict.attempts.saturating_sub(1) as u64;
        s.deferred += r.verdict.deferred as u64;
        lat += r.verdict.latency_ms;
    }
    s.unscored = s.responses - s.scored;
    s.reward_mean = if s.scored > 0 {
        sum / s.scored as f64
    } else {
        f64::NAN
    };
    s.latency_ms_mean = if s.responses > 0 {
        lat / s.responses as f64
    } else {
        0.0
    };
    (results, s)
}
