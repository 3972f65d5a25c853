//! One GRPO step: rollout, rewards, advantages (with tie breaking), then clipped-surrogate updates
//! with mini-batches, PPO epochs, token-budget micro-batches, global grad-norm clipping and AdamW.

use std::time::Instant;

use burn::module::AutodiffModule;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{AdamW, AdamWConfig, GradientsAccumulator, GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, Tensor, TensorData};
use conrub_rubric::{ResponseScore, RubricRecord};
use serde::{Deserialize, Serialize};

use crate::advantages::stable_seed;
use crate::codec::TextCodec;
use crate::grad_norm::clip_global_norm;
use crate::group::{group_outcome, reward_bin, GroupOutcome, TieMode, TieStats};
use crate::loss::{clipped_surrogate, dpo_pair_loss, Aggregation, ClipRange, SurrogateBatch};
use crate::policy::{Policy, RolloutTokens, SampleSettings};
use crate::reward::RewardSource;
use crate::ties::{TieBreaker, TiedGroup};

/// Learner settings (the `[learner]` table of a train config). Defaults are the published run's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LearnerConfig {
    /// Responses per prompt (k).
    pub group_size: usize,
    /// Longest response in tokens (Lmax).
    pub max_response_tokens: usize,
    /// Rollout temperature.
    pub temperature: f64,
    /// Rollout nucleus threshold.
    pub top_p: f64,
    /// Rollout top-k (none by default).
    pub top_k: Option<usize>,
    /// Prompts sampled together in one generation call (rows = prompts x k).
    pub rollout_prompts_per_call: usize,
    /// Learning rate.
    pub lr: f64,
    /// AdamW weight decay.
    pub weight_decay: f64,
    /// AdamW beta1.
    pub beta1: f64,
    /// AdamW beta2.
    pub beta2: f64,
    /// AdamW epsilon.
    pub adam_eps: f64,
    /// Global gradient-norm clip (0 disables).
    pub max_grad_norm: f64,
    /// Ratio clipping.
    pub clip: ClipRange,
    /// Loss aggregation.
    pub aggregation: Aggregation,
    /// Weight of the k3 KL to the initial policy (0: no reference model is kept).
    pub kl_beta: f64,
    /// What happens to exactly tied groups.
    pub tie_mode: TieMode,
    /// Beta of the GRPO+DPO baseline.
    pub dpo_beta: f64,
    /// Passes over each rollout batch.
    pub ppo_epochs: usize,
    /// Optimizer steps per pass (the batch is split into this many mini-batches).
    pub mini_batches: usize,
    /// Token budget (prompt + response) of one micro-batch; gradients are accumulated over them.
    pub micro_batch_tokens: usize,
    /// Run seed.
    pub seed: u64,
}

impl Default for LearnerConfig {
    fn default() -> Self {
        Self {
            group_size: 8,
            max_response_tokens: 8192,
            temperature: 1.0,
            top_p: 1.0,
            top_k: None,
            rollout_prompts_per_call: 32,
            lr: 3e-6,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            adam_eps: 1e-8,
            max_grad_norm: 1.0,
            clip: ClipRange::default(),
            aggregation: Aggregation::SequenceMean,
            kl_beta: 0.0,
            tie_mode: TieMode::Pairwise,
            dpo_beta: 2.0,
            ppo_epochs: 1,
            mini_batches: 1,
            micro_batch_tokens: 16_384,
            seed: 1234,
        }
    }
}

impl LearnerConfig {
    /// Checks ranges, naming the key.
    pub fn validate(&self) -> Result<(), String> {
        let bad = |k: &str, m: &str| Err(format!("learner.{k}: {m}"));
        if self.group_size < 2 {
            return bad("group_size", "must be at least 2");
        }
        if self.max_response_tokens == 0 {
            return bad("max_response_tokens", "must be at least 1");
        }
        if !(self.temperature > 0.0) {
            return bad("temperature", "must be > 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", "must be in (0, 1]");
        }
        if !(self.lr > 0.0) {
            return bad("lr", "must be > 0");
        }
        if self.ppo_epochs == 0 || self.mini_batches == 0 || self.rollout_prompts_per_call == 0 {
            return bad("ppo_epochs / mini_batches / rollout_prompts_per_call", "must be at least 1");
        }
        if !(self.clip.low > 0.0 && self.clip.low < 1.0 && self.clip.high > 0.0) {
            return bad("clip", "need 0 < low < 1 and high > 0");
        }
        Ok(())
    }
}

/// Everything SPEC section 7 logs for one step.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// Step index (0-based, counted over the run).
    pub step: u64,
    /// Prompts in the step.
    pub prompts: usize,
    /// Responses in the step.
    pub responses: usize,
    /// Scored responses.
    pub scored: usize,
    /// Unscored responses.
    pub unscored: usize,
    /// Mean reward over scored responses.
    pub reward_mean: f64,
    /// Standard deviation of scored rewards.
    pub reward_std: f64,
    /// Reward histogram, 0.1-wide bins over [-1, 1] (20 bins; -1 and 1 fall in the end bins).
    pub reward_histogram: Vec<u64>,
    /// Tie statistics.
    pub ties: TieStats,
    /// Mean response length in tokens.
    pub response_len_mean: f64,
    /// 90th percentile of response lengths.
    pub response_len_p90: usize,
    /// Longest response.
    pub response_len_max: usize,
    /// Responses cut at the length limit.
    pub truncated: usize,
    /// Token-weighted fraction clipped low (last PPO epoch, averaged over micro-batches).
    pub clip_low: f64,
    /// Token-weighted fraction clipped high.
    pub clip_high: f64,
    /// Policy loss (mean over micro-batches of the last PPO epoch, before scaling).
    pub loss: f64,
    /// Mean k3 KL to the reference (when `kl_beta > 0`).
    pub kl: Option<f64>,
    /// Mean next-token entropy over response tokens (last PPO epoch), when the policy reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entropy: Option<f64>,
    /// Global gradient norm before clipping, per optimizer step.
    pub grad_norms: Vec<f64>,
    /// Optimizer steps taken.
    pub optimizer_steps: usize,
    /// Accepted pairs used by the DPO term (GRPO+DPO mode).
    pub dpo_pairs: usize,
    /// Judge attempts beyond the first.
    pub judge_retries: u64,
    /// Mean judge latency per response, milliseconds.
    pub judge_latency_ms: f64,
    /// Response tokens sampled.
    pub response_tokens: usize,
    /// Seconds spent sampling, judging, and updating.
    pub rollout_secs: f64,
    /// Seconds judging.
    pub judge_secs: f64,
    /// Seconds of optimisation.
    pub update_secs: f64,
}

/// What one step produced besides metrics (for audit logs).
#[derive(Debug, Clone)]
pub struct StepOutput {
    /// Metrics.
    pub metrics: StepMetrics,
    /// Per group: the scores.
    pub scores: Vec<Vec<ResponseScore>>,
    /// Per group: advantages and pairs.
    pub outcomes: Vec<GroupOutcome>,
    /// Per group: the decoded responses.
    pub responses: Vec<Vec<String>>,
}

/// The learner: a policy, its optimizer, and the step counter.
pub struct Learner<B, P>
where
    B: AutodiffBackend,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
{
    /// The policy being trained.
    pub policy: P,
    /// AdamW.
    pub optim: OptimizerAdaptor<AdamW, P, B>,
    /// Settings.
    pub cfg: LearnerConfig,
    /// Device.
    pub device: B::Device,
    /// Frozen reference (initial policy), kept only when `kl_beta > 0`.
    pub reference: Option<P::InnerModule>,
    /// Steps completed.
    pub step: u64,
}

fn histogram(values: &[f64]) -> Vec<u64> {
    let mut h = vec![0u64; 20];
    for v in values {
        h[reward_bin(*v)] += 1;
    }
    h
}

impl<B, P> Learner<B, P>
where
    B: AutodiffBackend + conrub_kernels::GrpoOps,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
{
    /// A learner with a fresh AdamW.
    pub fn new(policy: P, cfg: LearnerConfig, device: B::Device) -> Result<Self, String> {
        cfg.validate()?;
        let optim = AdamWConfig::new()
            .with_beta_1(cfg.beta1 as f32)
            .with_beta_2(cfg.beta2 as f32)
            .with_epsilon(cfg.adam_eps as f32)
            .with_weight_decay(cfg.weight_decay as f32)
            .init::<B, P>();
        let reference = (cfg.kl_beta != 0.0).then(|| policy.valid());
        Ok(Self { policy, optim, cfg, device, reference, step: 0 })
    }

    /// Per-row log-probs (host) of `rows` under an inner-backend model, micro-batched.
    fn host_logprobs(&self, model: &P::InnerModule, tokens: &RolloutTokens, rows: &[usize]) -> Vec<Vec<f32>> {
        let mut out = vec![Vec::new(); tokens.prompts.len()];
        for chunk in self.micro_batches(tokens, rows) {
            let sub = subset(tokens, &chunk);
            let tf = sub.teacher_forcing();
            let lp: Vec<f32> = model.response_logprobs(&tf, &self.device).into_data().convert::<f32>().into_vec().expect("f32 data");
            for (k, &row) in chunk.iter().enumerate() {
                out[row] = lp[k * tf.response_len..k * tf.response_len + sub.responses[k].len()].to_vec();
            }
        }
        out
    }

    /// Splits `rows` into consecutive micro-batches within the token budget (at least one row each).
    fn micro_batches(&self, tokens: &RolloutTokens, rows: &[usize]) -> Vec<Vec<usize>> {
        let mut out: Vec<Vec<usize>> = Vec::new();
        let mut current = Vec::new();
        let mut max_len = 0usize;
        for &r in rows {
            let len = tokens.prompts[r].len() + tokens.responses[r].len();
            let new_max = max_len.max(len);
            // Padded cost of the micro-batch if this row joins it.
            if !current.is_empty() && new_max * (current.len() + 1) > self.cfg.micro_batch_tokens {
                out.push(std::mem::take(&mut current));
                max_len = len;
            } else {
                max_len = new_max;
            }
            current.push(r);
        }
        if !current.is_empty() {
            out.push(current);
        }
        out
    }

    /// One training step on `records` (one group of `group_size` responses per record).
    pub async fn step(
        &mut self,
        records: &[&RubricRecord],
        codec: &dyn TextCodec,
        rewards: &dyn RewardSource,
        ties: &dyn TieBreaker,
        stop_ids: &[u32],
    ) -> Result<StepOutput, String> {
        let k = self.cfg.group_size;
        let step_seed = stable_seed(self.cfg.seed, &format!("rollout/{}", self.step));
        let t0 = Instant::now();

        // 1. Rollout on the inner backend (no autodiff tape).
        let prompt_ids: Vec<Vec<u32>> =
            records.iter().map(|r| codec.encode_prompt(&r.question).map_err(|e| format!("prompt {}: {e}", r.id))).collect::<Result<_, _>>()?;
        let inner = self.policy.valid();
        let settings = |call: usize| SampleSettings {
            max_new_tokens: self.cfg.max_response_tokens,
            temperature: self.cfg.temperature,
            top_p: self.cfg.top_p,
            top_k: self.cfg.top_k,
            seed: step_seed.wrapping_add(call as u64),
            stop_ids: stop_ids.to_vec(),
        };
        let mut samples = Vec::with_capacity(records.len() * k);
        for (call, chunk) in prompt_ids.chunks(self.cfg.rollout_prompts_per_call).enumerate() {
            let rows: Vec<Vec<u32>> = chunk.iter().flat_map(|p| std::iter::repeat_n(p.clone(), k)).collect();
            samples.extend(inner.sample(&rows, &settings(call), &self.device)?);
        }
        let texts: Vec<String> = samples.iter().map(|s| codec.decode(&s.tokens)).collect::<Result<_, _>>()?;
        let lengths: Vec<u32> = samples.iter().map(|s| s.tokens.len() as u32).collect();
        let rollout_secs = t0.elapsed().as_secs_f64();

        // 2. Rewards, all groups concurrently.
        let t1 = Instant::now();
        let group_scores = futures::future::join_all(records.iter().enumerate().map(|(g, r)| {
            rewards.score_group(r, &texts[g * k..(g + 1) * k], &lengths[g * k..(g + 1) * k], self.step)
        }))
        .await;

        // 3. Advantages, tied groups to the tie breaker (concurrently).
        let keys: Vec<String> = records.iter().map(|r| format!("{}/{}", r.id, self.step)).collect();
        let questions: Vec<String> = records.iter().map(|r| r.question_text()).collect();
        let reward_opts: Vec<Vec<Option<f64>>> = group_scores.iter().map(|g| g.scores.iter().map(ResponseScore::reward).collect()).collect();
        let tie_mode = self.cfg.tie_mode;
        let outcomes = futures::future::join_all((0..records.len()).map(|g| {
            let group = TiedGroup {
                group_key: &keys[g],
                question: &questions[g],
                criteria: &group_scores[g].criteria,
                responses: &texts[g * k..(g + 1) * k],
                lengths: &lengths[g * k..(g + 1) * k],
            };
            let rewards = &reward_opts[g];
            async move { group_outcome(rewards, k, tie_mode, ties, &group).await }
        }))
        .await;
        let judge_secs = t1.elapsed().as_secs_f64();

        // 4. Old (and reference) log-probs.
        let t2 = Instant::now();
        let tokens = RolloutTokens {
            prompts: (0..samples.len()).map(|i| prompt_ids[i / k].clone()).collect(),
            responses: samples.iter().map(|s| s.tokens.clone()).collect(),
        };
        let n = samples.len();
        let all: Vec<usize> = (0..n).collect();
        let old = self.host_logprobs(&inner, &tokens, &all);
        let reference = self.reference.as_ref().map(|m| self.host_logprobs(m, &tokens, &all));
        let advantages: Vec<f64> = outcomes.iter().flat_map(|o| o.advantages.iter().copied()).collect();
        let dpo_pairs: Vec<(usize, usize)> = if self.cfg.tie_mode == TieMode::GrpoDpo {
            outcomes.iter().enumerate().flat_map(|(g, o)| o.accepted_pairs().into_iter().map(move |(w, l)| (g * k + w, g * k + l))).collect()
        } else {
            Vec::new()
        };

        // 5. Updates.
        let mut metrics = StepMetrics { step: self.step, prompts: records.len(), responses: n, dpo_pairs: dpo_pairs.len(), ..Default::default() };
        let minis: Vec<Vec<usize>> = {
            let size = n.div_ceil(self.cfg.mini_batches);
            all.chunks(size.max(1)).map(<[usize]>::to_vec).collect()
        };
        for epoch in 0..self.cfg.ppo_epochs {
            let last = epoch + 1 == self.cfg.ppo_epochs;
            let (mut loss_sum, mut low_sum, mut high_sum, mut kl_sum, mut micro_count, mut tok_sum) = (0.0, 0.0, 0.0, 0.0, 0usize, 0.0);
            let mut entropy_sum: Option<f64> = None;
            for mini in &minis {
                let mini_tokens: usize = mini.iter().map(|&r| tokens.responses[r].len()).sum();
                let mut acc = GradientsAccumulator::<P>::new();
                for micro in self.micro_batches(&tokens, mini) {
                    let sub = subset(&tokens, &micro);
                    let tf = sub.teacher_forcing();
                    let (rows, r) = (micro.len(), tf.response_len);
                    let pad = |v: &[Vec<f32>]| -> Tensor<B, 2> {
                        let mut flat = vec![0f32; rows * r];
                        for (i, &row) in micro.iter().enumerate() {
                            flat[i * r..i * r + v[row].len()].copy_from_slice(&v[row]);
                        }
                        Tensor::from_data(TensorData::new(flat, [rows, r]), &self.device)
                    };
                    let adv: Vec<f32> = micro.iter().map(|&row| advantages[row] as f32).collect();
                    let micro_tokens: usize = micro.iter().map(|&row| tokens.responses[row].len()).sum();
                    let (logp, entropy) = self.policy.response_logprobs_and_entropy(&tf, &self.device);
                    if let Some(e) = entropy {
                        *entropy_sum.get_or_insert(0.0) += e.sum().into_scalar().elem::<f64>();
                    }
                    let batch = SurrogateBatch {
                        logp,
                        logp_old: pad(&old),
                        advantages: Tensor::from_data(TensorData::new(adv, [rows]), &self.device),
                        mask: Tensor::from_data(TensorData::new(tf.mask.clone(), [rows, r]), &self.device),
                        logp_ref: reference.as_ref().map(|v| pad(v)),
                    };
                    let out = clipped_surrogate(batch, self.cfg.clip, self.cfg.aggregation, self.cfg.kl_beta);
                    // Weights that make the sum over micro-batches the mini-batch's aggregate.
                    let weight = match self.cfg.aggregation {
                        Aggregation::TokenMean => micro_tokens as f64 / mini_tokens.max(1) as f64,
                        _ => rows as f64 / mini.len() as f64,
                    };
                    let value: f64 = out.loss.clone().into_scalar().elem();
                    loss_sum += value;
                    let w_tok = micro_tokens as f64;
                    low_sum += out.clip_low.into_scalar().elem::<f64>() * w_tok;
                    high_sum += out.clip_high.into_scalar().elem::<f64>() * w_tok;
                    if let Some(kl) = out.kl {
                        kl_sum += kl.into_scalar().elem::<f64>() * w_tok;
                    }
                    tok_sum += w_tok;
                    micro_count += 1;
                    let grads = GradientsParams::from_grads((out.loss * weight).backward(), &self.policy);
                    acc.accumulate(&self.policy, grads);
                }
                // The GRPO+DPO baseline term for accepted pairs whose winner is in this mini-batch.
                let pairs: Vec<(usize, usize)> = dpo_pairs.iter().copied().filter(|(w, _)| mini.contains(w)).collect();
                if !pairs.is_empty() {
                    let rows: Vec<usize> = pairs.iter().flat_map(|&(w, l)| [w, l]).collect();
                    let sub = subset(&tokens, &rows);
                    let tf = sub.teacher_forcing();
                    let seq = self.policy.response_logprobs(&tf, &self.device).sum_dim(1).reshape([rows.len()]);
                    let old_seq: Vec<f32> = rows.iter().map(|&row| old[row].iter().sum()).collect();
                    let p = pairs.len();
                    let idx = |off: usize| {
                        Tensor::<B, 1, burn::tensor::Int>::from_data(
                            TensorData::new((0..p).map(|i| (2 * i + off) as i64).collect::<Vec<_>>(), [p]),
                            &self.device,
                        )
                    };
                    let old_t = Tensor::<B, 1>::from_data(TensorData::new(old_seq, [rows.len()]), &self.device);
                    let loss = dpo_pair_loss(
                        seq.clone().select(0, idx(0)),
                        seq.select(0, idx(1)),
                        old_t.clone().select(0, idx(0)),
                        old_t.select(0, idx(1)),
                        self.cfg.dpo_beta,
                        n,
                    );
                    acc.accumulate(&self.policy, GradientsParams::from_grads(loss.backward(), &self.policy));
                }
                let mut grads = acc.grads();
                let norm = if self.cfg.max_grad_norm > 0.0 {
                    clip_global_norm(&self.policy, &mut grads, self.cfg.max_grad_norm)
                } else {
                    crate::grad_norm::global_grad_norm(&self.policy, &grads)
                };
                metrics.grad_norms.push(norm);
                let policy = self.policy.clone();
                self.policy = self.optim.step(self.cfg.lr, policy, grads);
                metrics.optimizer_steps += 1;
            }
            if last {
                metrics.loss = loss_sum / micro_count.max(1) as f64;
                metrics.clip_low = low_sum / tok_sum.max(1.0);
                metrics.clip_high = high_sum / tok_sum.max(1.0);
                metrics.kl = (self.cfg.kl_beta != 0.0).then(|| kl_sum / tok_sum.max(1.0));
                metrics.entropy = entropy_sum.map(|e| e / tok_sum.max(1.0));
            }
        }
        let update_secs = t2.elapsed().as_secs_f64();

        // 6. Telemetry.
        let scored: Vec<f64> = reward_opts.iter().flatten().flatten().copied().collect();
        metrics.scored = scored.len();
        metrics.unscored = n - scored.len();
        if !scored.is_empty() {
            let m = scored.iter().sum::<f64>() / scored.len() as f64;
            metrics.reward_mean = m;
            metrics.reward_std = (scored.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / scored.len() as f64).sqrt();
        }
        metrics.reward_histogram = histogram(&scored);
        for (g, o) in outcomes.iter().enumerate() {
            metrics.ties.add(o, reward_opts[g].first().copied().flatten());
        }
        let mut lens: Vec<usize> = lengths.iter().map(|&l| l as usize).collect();
        lens.sort_unstable();
        metrics.response_tokens = lens.iter().sum();
        metrics.response_len_mean = metrics.response_tokens as f64 / n.max(1) as f64;
        metrics.response_len_p90 = lens.get(((0.9 * n as f64).ceil() as usize).clamp(1, n.max(1)) - 1).copied().unwrap_or(0);
        metrics.response_len_max = lens.last().copied().unwrap_or(0);
        metrics.truncated = samples.iter().filter(|s| s.truncated).count();
        metrics.judge_retries = group_scores.iter().map(|g| g.judge_retries as u64).sum();
        metrics.judge_latency_ms = group_scores.iter().map(|g| g.judge_latency_ms).sum::<f64>() / n.max(1) as f64;
        metrics.rollout_secs = rollout_secs;
        metrics.judge_secs = judge_secs;
        metrics.update_secs = update_secs;
        self.step += 1;
        Ok(StepOutput {
            metrics,
            scores: group_scores.into_iter().map(|g| g.scores).collect(),
            outcomes,
            responses: texts.chunks(k).map(<[String]>::to_vec).collect(),
        })
    }
}

fn subset(tokens: &RolloutTokens, rows: &[usize]) -> RolloutTokens {
    RolloutTokens {
        prompts: rows.iter().map(|&r| tokens.prompts[r].clone()).collect(),
        responses: rows.iter().map(|&r| tokens.responses[r].clone()).collect(),
    }
}
