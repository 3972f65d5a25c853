//! The rollout stage: `k` sampled responses per prompt, as a [`RolloutBatch`].

use burn::tensor::backend::Backend;
use conrub_qwen3::{EngineConfig, FinishReason, SamplingConfig};

use crate::batch::RolloutBatch;
use crate::error::Result;
use crate::policy::Policy;

/// Produces the responses of one step. The learner calls it with the policy on the inner backend
/// (no autodiff tape) and `sampling.seed` derived from the run seed and the step.
pub trait Rollout<B: Backend, P: Policy<B>>: Send + Sync {
    /// `group_size` responses to each of `prompts`, prompt-major.
    fn rollout(
        &self,
        policy: &P,
        prompts: &[Vec<u32>],
        group_size: usize,
        sampling: &SamplingConfig,
        device: &B::Device,
    ) -> Result<RolloutBatch>;
}

/// Samples `prompts_per_call` prompts x k rows per [`Policy::sample`] call; call `c` of a step uses
/// seed `sampling.seed + c`, and row `i` of a call its own stream, so a response does not depend
/// on the other rows of its call.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupSampler {
    /// Prompts per sampling call.
    pub prompts_per_call: usize,
    /// The rollout engine's settings (KV pool, rows at once) for [`Policy::sample_rollout`].
    pub engine: EngineConfig,
}

impl<B: Backend, P: Policy<B>> Rollout<B, P> for GroupSampler {
    fn rollout(
        &self,
        policy: &P,
        prompts: &[Vec<u32>],
        k: usize,
        sampling: &SamplingConfig,
        device: &B::Device,
    ) -> Result<RolloutBatch> {
        let mut batch = RolloutBatch {
            group_size: k,
            prompts: prompts.to_vec(),
            responses: Vec::new(),
            truncated: Vec::new(),
            engine: Default::default(),
        };
        for (call, chunk) in prompts.chunks(self.prompts_per_call.max(1)).enumerate() {
            let rows: Vec<Vec<u32>> = chunk
                .iter()
                .flat_map(|p| std::iter::repeat_n(p.clone(), k))
                .collect();
            let cfg = SamplingConfig {
                seed: sampling.seed.wrapping_add(call as u64),
                ..sampling.clone()
            };
            let out = policy.sample_rollout(&rows, &cfg, &self.engine, device)?;
            batch.engine.merge(&out.stats);
            for g in out.generations {
                batch
                    .truncated
                    .push(g.finish_reason == FinishReason::Length);
                batch.responses.push(g.tokens);
            }
        }
        Ok(batch)
    }
}
