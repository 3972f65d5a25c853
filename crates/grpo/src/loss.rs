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
use conrub_kernels::{Clip, GrpoOps, Reduce};
use serde::{Deserialize, Serialize};

/// How per-token losses become one number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Aggregation {
    /// The method's: token mean per response, then mean over responses (TRL `loss_type="grpo"`).
    #[default]
    SequenceMean,
    /// One mean over all response tokens of the (mini-)batch (TRL `bnpo`).
    GlobalTokenMean,
    /// Dr. GRPO: token sum divided by (responses x the rollout's maximum response length, i.e.
    /// `learner.max_response_tokens`) (TRL `dr_grpo`).
    DrGrpo,
}

/// The policy-loss stage: clipped surrogate, aggregation and the optional k3 KL term.
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

impl PolicyLoss {
    /// The loss of one (micro-)batch and its diagnostics.
    ///
    /// # Shapes
    /// See [`SurrogateBatch`] (in) and [`SurrogateOutput`] (out).
    pub fn compute<B: GrpoOps>(&self, batch: SurrogateBatch<B>) -> SurrogateOutput<B> {
        let SurrogateBatch {
            logp,
            logp_old,
            advantages,
            mask,
            logp_ref,
        } = batch;
        let [n, _t] = logp.dims();
        let reduce = match self.aggregation {
            Aggregation::SequenceMean => Reduce::MeanPerResponse,
            _ => Reduce::SumPerResponse,
        };
        let fused = conrub_kernels::clipped_surrogate(
            logp.clone(),
            logp_old,
            advantages,
            mask.clone(),
            self.clip,
            reduce,
        );
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
        let kl = logp_ref.filter(|_| self.kl_beta != 0.0).map(|r| {
            let d = r - logp;
            (d.clone().exp() - d - 1.0) * mask.clone()
        });
        if let Some(k) = &kl {
            let mut per_response = k.clone().sum_dim(1);
            if reduce == Reduce::MeanPerResponse {
                per_response = per_response / mask.clone().sum_dim(1).clamp_min(1.0);
            }
            loss = loss + aggregate(per_response.reshape([n])) * self.kl_beta;
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
