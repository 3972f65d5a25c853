//! The policy loss (docs/METHOD.md §6). The clipped-ratio part runs as one fused op of
//! `conrub-kernels` (a CubeCL kernel on GPU backends, primitive tensor ops elsewhere, a hand-written
//! backward under autodiff); the optional KL term is ordinary tensor code.
//!
//! Per token: `rho = exp(logp - logp_old)`, loss `-min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)`
//! (plus `beta * k3` when a reference model is given). Aggregation, by default: mean over each
//! response's own tokens, then mean over responses (the groups are equal-sized, so this is the mean
//! over the k responses of each group, then over the batch).

use burn::tensor::activation::log_sigmoid;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
pub use conrub_contracts::{Aggregation, KlEstimator};
use conrub_kernels::{Clip, KernelOps, Reduce, SurrogateLoss};

/// A policy loss, as the learner calls it: one (micro-)batch in, the loss and its diagnostics out.
/// The learner sums its micro-batches' gradients, each loss weighted by
/// [`PolicyObjective::micro_batch_weight`], so that the sum is the mini-batch's loss. Chosen by
/// name (`learner.loss`) from a [`Registry`](crate::Registry).
pub trait PolicyObjective<B: Backend>: Send + Sync {
    /// The loss of one (micro-)batch and its diagnostics.
    ///
    /// # Shapes
    /// See [`SurrogateBatch`] (in) and [`SurrogateOutput`] (out).
    fn compute(&self, batch: SurrogateBatch<B>) -> SurrogateOutput<B>;

    /// The weight of a micro-batch of `rows` responses and `tokens` response tokens in a
    /// mini-batch of `mini_rows` and `mini_tokens`: its share of the rows (right for a loss that
    /// is a mean over responses), unless the loss says otherwise.
    fn micro_batch_weight(
        &self,
        rows: usize,
        mini_rows: usize,
        tokens: usize,
        mini_tokens: usize,
    ) -> f64 {
        let _ = (tokens, mini_tokens);
        rows as f64 / mini_rows as f64
    }
}

/// The policy-loss stage: clipped surrogate, aggregation and the optional k3 KL term (the
/// `clipped-surrogate` entry of the registry).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PolicyLoss {
    /// Ratio clipping.
    pub clip: Clip,
    /// Aggregation.
    pub aggregation: Aggregation,
    /// Weight of the k3 KL term (used only when the batch has reference log-probs).
    pub kl_beta: f64,
    /// Dr. GRPO's constant length normaliser (the rollout's maximum response length).
    pub max_response_tokens: usize,
    /// Cap of the truncated importance-sampling weight (used only when the batch has the
    /// engine's log-probs): per token `w = min(exp(logp_old - logp_engine), cap)`, no gradient.
    pub tis_cap: Option<f64>,
    /// The KL term's per-token estimator.
    pub kl_estimator: KlEstimator,
    /// Where the importance ratio lives: per token (GRPO) or per response (GSPO).
    pub importance: ImportanceLevel,
}

/// Where the clipped surrogate's importance ratio is taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ImportanceLevel {
    /// `rho_t = exp(logp_t - logp_old_t)` per token.
    #[default]
    Token,
    /// One ratio per response, `exp(mean_t (logp_t - logp_old_t))` over its tokens, clipped and
    /// applied to every token (GSPO; the `gspo` loss).
    Sequence,
}

/// Inputs of one (micro-)batch.
///
/// # Shapes
/// `logp`, `logp_old`, `mask`, `logp_ref`: `[responses, R]` with right padding; `advantages`:
/// `[responses]`.
#[derive(Debug, Clone)]
pub struct SurrogateBatch<B: Backend> {
    /// Current per-token log-probabilities (with gradient).
    pub logp: Tensor<B, 2>,
    /// Log-probabilities under the policy that sampled the responses (no gradient).
    pub logp_old: Tensor<B, 2>,
    /// One sequence-level advantage per response, `[responses]`.
    pub advantages: Tensor<B, 1>,
    /// 1 for response tokens, 0 for padding.
    pub mask: Tensor<B, 2>,
    /// Reference-model log-probabilities for the optional KL term.
    pub logp_ref: Option<Tensor<B, 2>>,
    /// The rollout engine's log-probabilities of the sampled tokens, for the optional truncated
    /// importance-sampling weight.
    pub logp_engine: Option<Tensor<B, 2>>,
}

/// The loss and its diagnostics.
///
/// # Shapes
/// Every field is `[1]`.
#[derive(Debug, Clone)]
pub struct SurrogateOutput<B: Backend> {
    /// Scalar loss `[1]`.
    pub loss: Tensor<B, 1>,
    /// Fraction of tokens clipped at the low side with a negative advantage `[1]`.
    pub clip_low: Tensor<B, 1>,
    /// Fraction of tokens clipped at the high side with a positive advantage `[1]`.
    pub clip_high: Tensor<B, 1>,
    /// Mean per-token k3 KL to the reference, when one was given `[1]`.
    pub kl: Option<Tensor<B, 1>>,
}

impl<B: KernelOps> PolicyObjective<B> for PolicyLoss {
    fn compute(&self, batch: SurrogateBatch<B>) -> SurrogateOutput<B> {
        PolicyLoss::compute(self, batch)
    }

    /// `global-token-mean` weighs by tokens (one mean over the mini-batch's tokens); the
    /// per-response aggregations by rows.
    fn micro_batch_weight(
        &self,
        rows: usize,
        mini_rows: usize,
        tokens: usize,
        mini_tokens: usize,
    ) -> f64 {
        match self.aggregation {
            Aggregation::GlobalTokenMean => tokens as f64 / mini_tokens.max(1) as f64,
            _ => rows as f64 / mini_rows as f64,
        }
    }
}

impl PolicyLoss {
    /// The loss `cfg` describes (`clip`, `aggregation`, `kl_beta`, `max_response_tokens`,
    /// `tis_cap`).
    pub fn from_config(cfg: &conrub_contracts::LearnerConfig) -> Self {
        Self {
            clip: cfg.objective.clip,
            aggregation: cfg.objective.aggregation,
            kl_beta: cfg.objective.kl_beta,
            max_response_tokens: cfg.max_response_tokens,
            tis_cap: cfg.objective.tis_cap,
            kl_estimator: cfg.objective.kl_estimator,
            importance: ImportanceLevel::Token,
        }
    }

    /// The `gspo` loss of `cfg`: [`PolicyLoss::from_config`] with one importance ratio per
    /// response.
    pub fn gspo(cfg: &conrub_contracts::LearnerConfig) -> Self {
        Self {
            importance: ImportanceLevel::Sequence,
            ..Self::from_config(cfg)
        }
    }

    /// The loss of one (micro-)batch and its diagnostics.
    ///
    /// # Shapes
    /// See [`SurrogateBatch`] (in) and [`SurrogateOutput`] (out).
    pub fn compute<B: KernelOps>(&self, batch: SurrogateBatch<B>) -> SurrogateOutput<B> {
        let SurrogateBatch {
            logp,
            logp_old,
            advantages,
            mask,
            logp_ref,
            logp_engine,
        } = batch;
        let [n, t] = logp.dims();
        // GSPO: the ratio the surrogate sees is the response's mean log-ratio at every token,
        // `logp_old + mean(logp - logp_old)`, whose gradient reaches each token's `logp` as
        // 1 / len of the response's.
        let ratio_logp = match self.importance {
            ImportanceLevel::Token => logp.clone(),
            ImportanceLevel::Sequence => {
                let mean = ((logp.clone() - logp_old.clone()) * mask.clone()).sum_dim(1)
                    / mask.clone().sum_dim(1).clamp_min(1.0);
                logp_old.clone() + mean.expand([n, t])
            }
        };
        let reduce = match self.aggregation {
            Aggregation::SequenceMean => Reduce::MeanPerResponse,
            _ => Reduce::SumPerResponse,
        };
        let fused = match (self.tis_cap, logp_engine) {
            (Some(cap), Some(engine)) => {
                let weight = (logp_old.clone() - engine).exp().clamp_max(cap).detach();
                weighted_surrogate(
                    &ratio_logp,
                    logp_old,
                    advantages,
                    &mask,
                    &weight,
                    self.clip,
                    reduce,
                )
            }
            _ => conrub_kernels::clipped_surrogate(
                ratio_logp,
                logp_old,
                advantages,
                mask.clone(),
                self.clip,
                reduce,
            ),
        };
        let tokens = mask.clone().sum().clamp_min(1.0);
        // Per-response values -> the aggregate; the same rule then applies to the KL term.
        let aggregate = |per_response: Tensor<B, 1>| match self.aggregation {
            Aggregation::SequenceMean => per_response.mean(),
            Aggregation::GlobalTokenMean => per_response.sum() / tokens.clone(),
            Aggregation::DrGrpo => {
                per_response.sum() / (n * self.max_response_tokens.max(1)) as f64
            }
        };
        let mut loss = aggregate(fused.per_response);
        let kl = logp_ref
            .filter(|_| self.kl_beta != 0.0)
            .map(|r| kl_per_token(self.kl_estimator, logp, r) * mask.clone());
        if let Some(k) = &kl {
            let term = aggregate_token_term(
                k.clone(),
                mask.clone(),
                self.aggregation,
                self.max_response_tokens,
            );
            loss = loss + term * self.kl_beta;
        }
        let frac = |count: Tensor<B, 1>| (count.sum() / tokens.clone()).detach();
        let kl_mean = kl.map(|k| (k.sum() / tokens.clone()).detach());
        SurrogateOutput {
            loss,
            clip_low: frac(fused.clip_low),
            clip_high: frac(fused.clip_high),
            kl: kl_mean,
        }
    }
}

/// A per-token term of the loss (`values`, already masked, `[responses, R]`: the KL estimate, the
/// entropy) aggregated as `aggregation` aggregates the policy loss: summed per response (and
/// divided by the response's tokens under `sequence-mean`), then the mean over responses
/// (`sequence-mean`), the sum over the batch's tokens (`global-token-mean`) or over `responses x
/// max_response_tokens` (`dr-grpo`). `[1]`.
pub fn aggregate_token_term<B: Backend>(
    values: Tensor<B, 2>,
    mask: Tensor<B, 2>,
    aggregation: Aggregation,
    max_response_tokens: usize,
) -> Tensor<B, 1> {
    let [n, _] = values.dims();
    let mut per_response = values.sum_dim(1);
    if aggregation == Aggregation::SequenceMean {
        per_response = per_response / mask.clone().sum_dim(1).clamp_min(1.0);
    }
    let per_response = per_response.reshape([n]);
    match aggregation {
        Aggregation::SequenceMean => per_response.mean(),
        Aggregation::GlobalTokenMean => per_response.sum() / mask.sum().clamp_min(1.0),
        Aggregation::DrGrpo => per_response.sum() / (n * max_response_tokens.max(1)) as f64,
    }
}

/// The per-token KL estimate `estimator` of `logp` (`[responses, R]`) to the reference's
/// `logp_ref`, with `d = logp_ref - logp`: `k1` `-d`, `k2` `d^2 / 2`, `k3` `exp(d) - d - 1`.
/// Right padding (both 0) gives 0 under each.
pub(crate) fn kl_per_token<B: Backend>(
    estimator: KlEstimator,
    logp: Tensor<B, 2>,
    logp_ref: Tensor<B, 2>,
) -> Tensor<B, 2> {
    let d = logp_ref - logp;
    match estimator {
        KlEstimator::K1 => d.neg(),
        KlEstimator::K2 => d.powi_scalar(2) * 0.5,
        KlEstimator::K3 => d.clone().exp() - d - 1.0,
    }
}

/// The clipped surrogate with a per-token weight (the TIS correction), in plain tensor ops:
/// `-w * min(rho * A, clip(rho) * A)` per token, masked and reduced per response like the fused
/// op, whose clip counts it also returns.
fn weighted_surrogate<B: KernelOps>(
    logp: &Tensor<B, 2>,
    logp_old: Tensor<B, 2>,
    advantages: Tensor<B, 1>,
    mask: &Tensor<B, 2>,
    weight: &Tensor<B, 2>,
    clip: conrub_kernels::Clip,
    reduce: Reduce,
) -> SurrogateLoss<B> {
    let [n, t] = logp.dims();
    let a = advantages.reshape([n, 1]).expand([n, t]);
    let rho = (logp.clone() - logp_old).exp();
    let clipped = rho.clone().clamp(1.0 - clip.low, 1.0 + clip.high);
    let per_token = (rho.clone() * a.clone())
        .min_pair(clipped * a.clone())
        .neg()
        * weight.clone()
        * mask.clone();
    let mut per_response = per_token.sum_dim(1).reshape([n]);
    if reduce == Reduce::MeanPerResponse {
        per_response = per_response / mask.clone().sum_dim(1).clamp_min(1.0).reshape([n]);
    }
    let count = |hit: Tensor<B, 2, burn::tensor::Bool>| {
        (hit.float() * mask.clone())
            .sum_dim(1)
            .reshape([n])
            .detach()
    };
    let rho = rho.detach();
    let a = a.detach();
    SurrogateLoss {
        per_response,
        clip_low: count(
            rho.clone()
                .lower_elem(1.0 - clip.low)
                .bool_and(a.clone().lower_elem(0.0)),
        ),
        clip_high: count(
            rho.greater_elem(1.0 + clip.high)
                .bool_and(a.greater_elem(0.0)),
        ),
    }
}

/// The GRPO+DPO baseline term over accepted pairs: `-(1/B_global) * sum log sigmoid(beta *
/// (Delta_theta - Delta_old))`, `Delta = log pi(y+) - log pi(y-)` (sequence log-probabilities);
/// `global_batch` is B_global, the number of responses in the global batch.
///
/// # Shapes
/// Each input is `[pairs]`; the loss is `[1]`.
pub fn dpo_pair_loss<B: Backend>(
    winner: Tensor<B, 1>,
    loser: Tensor<B, 1>,
    winner_old: Tensor<B, 1>,
    loser_old: Tensor<B, 1>,
    beta: f64,
    global_batch: usize,
) -> Tensor<B, 1> {
    let delta = (winner - loser) - (winner_old - loser_old);
    log_sigmoid(delta * beta).sum().neg() / global_batch.max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, Flex};
    use burn::tensor::TensorData;

    type B = Autodiff<Flex>;

    fn t2(v: Vec<f32>, rows: usize) -> Tensor<B, 2> {
        let cols = v.len() / rows;
        Tensor::from_data(TensorData::new(v, [rows, cols]), &Default::default())
    }

    /// A per-token term (the entropy bonus's, the KL's) by hand under each aggregation: values
    /// `[[1, 2, -], [3, -, -]]` (masked): sequence-mean `(1.5 + 3) / 2`, global-token-mean
    /// `6 / 3`, dr-grpo over 2 responses x 4 tokens `6 / 8`.
    #[test]
    fn token_terms_aggregate_as_the_loss_by_hand() {
        let values = t2(vec![1.0, 2.0, 0.0, 3.0, 0.0, 0.0], 2);
        let mask = t2(vec![1.0, 1.0, 0.0, 1.0, 0.0, 0.0], 2);
        for (aggregation, want) in [
            (Aggregation::SequenceMean, 2.25),
            (Aggregation::GlobalTokenMean, 2.0),
            (Aggregation::DrGrpo, 0.75),
        ] {
            let got = aggregate_token_term(values.clone(), mask.clone(), aggregation, 4)
                .into_data()
                .convert::<f64>()
                .to_vec::<f64>()
                .unwrap()[0];
            assert!((got - want).abs() < 1e-6, "{aggregation:?}: {got}");
        }
    }

    /// Each KL estimator by hand: zero advantages leave `kl_beta x` the sequence-mean KL, with
    /// `d = logp_ref - logp` per token.
    #[test]
    fn kl_estimators_k1_k2_k3_by_hand() {
        // Response 0: d = ln(0.5) - ln(0.25) = ln 2 and d = 0; response 1: d = ln(0.5).
        let ln = |p: f32| p.ln();
        let logp = t2(vec![ln(0.25), ln(0.5), ln(0.5), 0.0], 2).require_grad();
        let reference = t2(vec![ln(0.5), ln(0.5), ln(0.25), 0.0], 2);
        let mask = t2(vec![1.0, 1.0, 1.0, 0.0], 2);
        let zero = Tensor::<B, 1>::zeros([2], &Default::default());
        let scalar = |t: Tensor<B, 1>| t.into_data().convert::<f64>().to_vec::<f64>().unwrap()[0];
        let l2 = std::f64::consts::LN_2;
        // Per response, mean over its tokens, then mean over responses; beta 0.5.
        let cases = [
            (KlEstimator::K1, 0.5 * ((-l2 + 0.0) / 2.0 + l2) / 2.0),
            (
                KlEstimator::K2,
                0.5 * ((l2 * l2 / 2.0) / 2.0 + l2 * l2 / 2.0) / 2.0,
            ),
            (
                KlEstimator::K3,
                0.5 * (((2.0 - l2 - 1.0) + 0.0) / 2.0 + (0.5 + l2 - 1.0)) / 2.0,
            ),
        ];
        for (estimator, want) in cases {
            let out = PolicyLoss {
                clip: Clip::default(),
                aggregation: Aggregation::SequenceMean,
                kl_beta: 0.5,
                max_response_tokens: 2,
                tis_cap: None,
                kl_estimator: estimator,
                importance: ImportanceLevel::Token,
            }
            .compute(SurrogateBatch {
                logp: logp.clone(),
                logp_old: logp.clone().detach(),
                advantages: zero.clone(),
                mask: mask.clone(),
                logp_ref: Some(reference.clone()),
                logp_engine: None,
            });
            let got = scalar(out.loss);
            assert!((got - want).abs() < 1e-6, "{estimator:?}: {got} vs {want}");
        }
    }

    /// The TIS weight `min(exp(logp_old - logp_engine), cap)` against a hand computation, value
    /// and gradient, next to the unweighted loss.
    #[test]
    fn truncated_importance_sampling_weights_each_token() {
        let ln = |p: f32| p.ln();
        // Response 0 (A = +1): tokens 0 and 1 (token 2 is padding). Response 1 (A = -1): one
        // token, its ratio 0.75 clipped at 0.8.
        let logp = t2(vec![ln(0.5), ln(0.25), 0.0, ln(0.3), 0.0, 0.0], 2).require_grad();
        let old = t2(vec![ln(0.4), ln(0.25), 0.0, ln(0.4), 0.0, 0.0], 2);
        let engine = t2(vec![ln(0.2), ln(0.5), 0.0, ln(0.4), 0.0, 0.0], 2);
        let mask = t2(vec![1.0, 1.0, 0.0, 1.0, 0.0, 0.0], 2);
        let adv = Tensor::<B, 1>::from_floats([1.0, -1.0], &Default::default());
        let batch = |engine: Option<Tensor<B, 2>>| SurrogateBatch {
            logp: logp.clone(),
            logp_old: old.clone(),
            advantages: adv.clone(),
            mask: mask.clone(),
            logp_ref: None,
            logp_engine: engine,
        };
        let loss = |tis_cap| PolicyLoss {
            clip: Clip::default(),
            aggregation: Aggregation::SequenceMean,
            kl_beta: 0.0,
            max_response_tokens: 3,
            tis_cap,
            kl_estimator: KlEstimator::K3,
            importance: ImportanceLevel::Token,
        };
        let scalar = |t: Tensor<B, 1>| t.into_data().convert::<f32>().to_vec::<f32>().unwrap()[0];
        // Weights: token 0 min(0.4 / 0.2, 1.5) = 1.5, token 1 min(0.25 / 0.5, 1.5) = 0.5,
        // response 1 min(1, 1.5) = 1. Response 0: -(1.5 * 1.25 + 0.5 * 1) / 2 = -1.1875;
        // response 1: +0.8; mean -0.19375.
        let out = loss(Some(1.5)).compute(batch(Some(engine.clone())));
        assert!((scalar(out.loss.clone()) + 0.19375).abs() < 1e-6);
        assert!((scalar(out.clip_low) - 1.0 / 3.0).abs() < 1e-6);
        let grads = out.loss.backward();
        let g = logp
            .grad(&grads)
            .unwrap()
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        // d/dlogp of -w * rho * A / (2 tokens) / (2 responses): -1.5 * 1.25 / 4, -0.5 / 4; the
        // clipped token and the padding get none.
        let want = [-0.46875, -0.125, 0.0, 0.0, 0.0, 0.0];
        for (a, b) in g.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{g:?}");
        }
        // Without a cap (or without the engine's log-probs) the fused loss: -(1.25 + 1) / 2 and
        // 0.8, mean -0.1625.
        let plain = loss(None).compute(batch(Some(engine)));
        assert!((scalar(plain.loss) + 0.1625).abs() < 1e-6);
        let fused = loss(Some(1.5)).compute(batch(None));
        assert!((scalar(fused.loss) + 0.1625).abs() < 1e-6);
    }
}
