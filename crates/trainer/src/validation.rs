//! Validation during training (`[eval]` of a run config): every `every` steps the current policy
//! answers held-out prompts through the learner's own rollout engine and codec, and the answers
//! are scored on their full rubrics by two judges, the training judge and a *grader* (usually a
//! stronger one). A training judge whose score keeps rising while the grader's falls is the sign
//! of reward hacking that only a second judge shows. The trainer writes each result as a
//! `kind = "eval"` line of `metrics.jsonl` and keeps the checkpoint the grader scores best.
//!
//! Scores are the reward mode's criterion mean (three-state: in [-1, 1]; binary: the share met)
//! with no length penalty and no rubric dropout. A judge that fails never stops training: its
//! fields say how many responses went unscored and why.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use conrub_contracts::{Decoding, JudgeScore, Message, Policy, ValidationDecoding, ValidationLine};
use conrub_judge::{CriterionJudge, CriterionRequest, CriterionVerdict};
use conrub_kernels::KernelOps;
use conrub_rubric::bootstrap::bootstrap_std_clipped;
use conrub_rubric::{score_labels, LengthPenalty, ScoringMode};

use conrub_grpo::{stable_seed, Learner};
use conrub_rewards::TaskPrompt;

use crate::error::Result;
use crate::samples::{EvalSample, JudgedAnswer};
pub use conrub_contracts::ValidationConfig;

/// One held-out prompt and the criteria its answers are graded on (`conrub_eval`'s examples
/// carry both).
#[derive(Debug, Clone, PartialEq)]
pub struct HeldOutPrompt {
    /// The conversation the policy answers.
    pub prompt: Vec<Message>,
    /// The criteria graded correct / missing / wrong.
    pub criteria: Vec<String>,
}

/// Validates a learner's policy on held-out prompts with two judges.
pub struct Validator {
    /// The settings.
    pub cfg: ValidationConfig,
    /// The held-out prompts with their rubrics (`cfg.limit` already applied).
    pub examples: Vec<HeldOutPrompt>,
    /// The label set both judges grade with (the run's reward mode).
    pub mode: ScoringMode,
    /// The training judge.
    pub training: Arc<dyn CriterionJudge>,
    /// The grader.
    pub grader: Arc<dyn CriterionJudge>,
    /// The run seed (sampled decoding and the bootstrap).
    pub seed: u64,
}

impl Validator {
    /// True when the policy is validated after `steps_done` steps.
    pub fn due(&self, steps_done: u64) -> bool {
        steps_done > 0 && steps_done.is_multiple_of(self.cfg.every)
    }

    /// Generates with `learner`'s current policy and scores the answers with both judges.
    pub async fn validate<B, P, T>(&self, learner: &Learner<B, P, T>) -> Result<ValidationLine>
    where
        B: AutodiffBackend + KernelOps,
        P: Policy<B> + AutodiffModule<B>,
        P::InnerModule: Policy<B::InnerBackend>,
        T: TaskPrompt,
    {
        self.validate_policy(learner, &learner.policy().valid())
            .await
    }

    /// [`Validator::validate`] generating with `policy` (a sharded group's whole policy,
    /// assembled) through `learner`'s engine, codec and settings.
    pub async fn validate_policy<B, P, T>(
        &self,
        learner: &Learner<B, P, T>,
        policy: &P::InnerModule,
    ) -> Result<ValidationLine>
    where
        B: AutodiffBackend + KernelOps,
        P: Policy<B> + AutodiffModule<B>,
        P::InnerModule: Policy<B::InnerBackend>,
        T: TaskPrompt,
    {
        Ok(self.validate_round(learner, policy).await?.0)
    }

    /// [`Validator::validate_policy`], with every answer and both judges' verdicts on it (what
    /// the trainer writes to `samples/eval-step-NNNNNN.jsonl`).
    pub async fn validate_round<B, P, T>(
        &self,
        learner: &Learner<B, P, T>,
        policy: &P::InnerModule,
    ) -> Result<(ValidationLine, Vec<EvalSample>)>
    where
        B: AutodiffBackend + KernelOps,
        P: Policy<B> + AutodiffModule<B>,
        P::InnerModule: Policy<B::InnerBackend>,
        T: TaskPrompt,
    {
        let step = learner.steps_done();
        let started = Instant::now();
        let prompts: Vec<_> = self.examples.iter().map(|e| e.prompt.clone()).collect();
        let sampling = self.round_sampling(learner.config(), learner.stop_ids(), step);
        let answers = learner.generate_with(policy, &prompts, self.cfg.samples, &sampling)?;
        let generate_secs = started.elapsed().as_secs_f64();
        let requests: Vec<CriterionRequest> = answers
            .iter()
            .enumerate()
            .map(|(row, a)| {
                let ex = &self.examples[row / self.cfg.samples];
                CriterionRequest {
                    question: conrub_rubric::record::messages_text(&ex.prompt),
                    response: a.text.clone(),
                    criteria: ex.criteria.clone(),
                    mode: self.mode,
                }
            })
            .collect();
        let judged = Instant::now();
        let (training, grader) = futures::join!(
            self.training.judge_batch(&requests),
            self.grader.judge_batch(&requests)
        );
        let judge_secs = judged.elapsed().as_secs_f64();
        let n = answers.len();
        let samples = answers
            .iter()
            .enumerate()
            .map(|(row, a)| EvalSample {
                step,
                prompt_index: row / self.cfg.samples,
                sample: row % self.cfg.samples,
                prompt: requests[row].question.clone(),
                criteria: requests[row].criteria.clone(),
                text: a.text.clone(),
                tokens: a.tokens,
                truncated: a.truncated,
                training: self.judged(self.training.id(), &requests[row], &training[row]),
                grader: self.judged(self.grader.id(), &requests[row], &grader[row]),
            })
            .collect();
        let line = ValidationLine {
            step,
            prompts: self.examples.len(),
            responses: n,
            decoding: self.cfg.decoding,
            response_len_mean: answers.iter().map(|a| a.tokens).sum::<usize>() as f64
                / n.max(1) as f64,
            truncated: answers.iter().filter(|a| a.truncated).count(),
            training: self.judge_score(self.training.id(), &requests, &training, step),
            grader: self.judge_score(self.grader.id(), &requests, &grader, step),
            generate_secs,
            judge_secs,
            kernels: None,
        };
        Ok((line, samples))
    }

    /// How the round at `step` decodes: the learner's sampling rule (or greedy), seeded by the
    /// run seed and the step, up to `max_new_tokens` (the learner's limit unless set).
    fn round_sampling(
        &self,
        learner: &conrub_contracts::LearnerConfig,
        stop_ids: &[u32],
        step: u64,
    ) -> conrub_contracts::SamplingConfig {
        let seed = stable_seed(self.seed, &format!("eval/{step}"));
        let mut sampling = conrub_contracts::SamplingConfig::from_learner(learner, seed, stop_ids);
        sampling.max_new_tokens = self
            .cfg
            .max_new_tokens
            .unwrap_or(learner.max_response_tokens);
        if self.cfg.decoding == ValidationDecoding::Greedy {
            sampling.decoding = Decoding::Greedy;
        }
        sampling
    }

    /// One judge's verdict on one answer, scored as the round scores it.
    fn judged(
        &self,
        judge: String,
        request: &CriterionRequest,
        verdict: &CriterionVerdict,
    ) -> JudgedAnswer {
        let (score, error) = match self.answer_score(request, verdict) {
            AnswerScore::Scored(_, score) => (Some(score), None),
            AnswerScore::Unscored(error) => (None, Some(error)),
        };
        JudgedAnswer {
            judge,
            labels: verdict.labels.clone(),
            score,
            error,
        }
    }

    /// An answer's criterion mean (no length penalty), or why it has none.
    fn answer_score<'v>(
        &self,
        request: &CriterionRequest,
        verdict: &'v CriterionVerdict,
    ) -> AnswerScore<'v> {
        let none = LengthPenalty::disabled();
        match &verdict.labels {
            Some(labels) => {
                match score_labels(labels, request.criteria.len(), self.mode, 0, &none) {
                    Ok(s) => AnswerScore::Scored(labels, s.criteria_mean),
                    Err(e) => AnswerScore::Unscored(e.to_string()),
                }
            }
            None => {
                AnswerScore::Unscored(verdict.error.clone().unwrap_or_else(|| "no labels".into()))
            }
        }
    }

    /// One judge's scores of the round's responses.
    fn judge_score(
        &self,
        judge: String,
        requests: &[CriterionRequest],
        verdicts: &[CriterionVerdict],
        step: u64,
    ) -> JudgeScore {
        let mut out = JudgeScore {
            judge,
            ..Default::default()
        };
        let mut scores = Vec::new();
        let mut counts: BTreeMap<&'static str, usize> = BTreeMap::new();
        for (r, v) in requests.iter().zip(verdicts) {
            match self.answer_score(r, v) {
                AnswerScore::Scored(labels, s) => {
                    scores.push(s);
                    for l in labels {
                        *counts.entry(l.as_str()).or_default() += 1;
                    }
                }
                AnswerScore::Unscored(e) => {
                    out.unscored += 1;
                    out.error.get_or_insert(e);
                }
            }
        }
        out.scored = scores.len();
        let total: usize = counts.values().sum();
        out.labels = counts
            .into_iter()
            .map(|(l, c)| (l.to_string(), c as f64 / total.max(1) as f64))
            .collect();
        if !scores.is_empty() {
            let range = match self.mode {
                ScoringMode::Binary => (0.0, 1.0),
                _ => (-1.0, 1.0),
            };
            let resamples = self.cfg.bootstrap_resamples;
            let seed = stable_seed(self.seed, &format!("eval-bootstrap/{step}"));
            out.score = Some(scores.iter().sum::<f64>() / scores.len() as f64);
            out.score_std = Some(bootstrap_std_clipped(&scores, resamples, seed, range));
        }
        out
    }
}

/// An answer's labels and criterion mean, or why it has none.
enum AnswerScore<'v> {
    Scored(&'v [conrub_rubric::Label], f64),
    Unscored(String),
}
