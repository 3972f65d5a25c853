//! Supervised warm-up: a few cross-entropy steps on reference answers before GRPO (used by the
//! offline demo to give a tiny random policy a vocabulary worth rewarding).

use burn::module::AutodiffModule;
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ElementConversion;

use crate::policy::{Policy, RolloutTokens};

/// Runs `steps` AdamW steps (lr `lr`) of mean token cross-entropy on `(prompt, answer)` pairs, all
/// pairs per step. Returns the policy and the loss of each step.
pub fn sft_warmup<B, P>(mut policy: P, pairs: &RolloutTokens, steps: usize, lr: f64, device: &B::Device) -> (P, Vec<f64>)
where
    B: AutodiffBackend,
    P: Policy<B> + AutodiffModule<B>,
{
    let mut optim = AdamWConfig::new().with_weight_decay(0.0).init::<B, P>();
    let tf = pairs.teacher_forcing();
    let tokens: f32 = tf.mask.iter().sum::<f32>().max(1.0);
    let mut losses = Vec::with_capacity(steps);
    for _ in 0..steps {
        let loss = policy.response_logprobs(&tf, device).sum().neg() / tokens as f64;
        losses.push(loss.clone().into_scalar().elem::<f64>());
        let grads = GradientsParams::from_grads(loss.backward(), &policy);
        policy = optim.step(lr, policy, grads);
    }
    (policy, losses)
}
