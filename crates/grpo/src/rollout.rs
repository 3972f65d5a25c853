//! The two rollout engines of the crate: [`InProcessEngine`] (conrub-rollout's paged engine on the
//! policy's own weights) and [`GroupSampler`] (any [`Policy`], through [`Policy::sample`]). Both
//! implement `conrub_contracts`' [`RolloutEngine`].

use burn::tensor::backend::Backend;
use conrub_contracts::{
    EngineShapes, Generation, PagedModel, Policy, Result, RolloutBatch, RolloutEngine,
    RolloutRequest, RolloutStats, SamplingConfig, ShapeWalk,
};
use conrub_kernels::KernelOps;
use conrub_rollout::EngineConfig;

/// The rows of one call: every prompt of `chunk` repeated `k` times.
fn group_rows(chunk: &[Vec<u32>], k: usize) -> Vec<Vec<u32>> {
    chunk
        .iter()
        .flat_map(|p| std::iter::repeat_n(p.clone(), k))
        .collect()
}

/// Runs `call` on `prompts_per_call` prompts x k rows at a time. The step's groups are chunked
/// globally: group `g` belongs to call `c = g / prompts_per_call`, which uses seed
/// `sampling.seed + c`, and its response `j` draws from stream `(g - c * prompts_per_call) * k + j`
/// of that call. A response thus depends neither on the other rows of its call nor on which
/// slice of the step's groups (`request.first_group..`) this engine was given.
pub(crate) fn in_calls(
    request: &RolloutRequest<'_>,
    prompts_per_call: usize,
    mut call: impl FnMut(&[Vec<u32>], &SamplingConfig) -> Result<(Vec<Generation>, RolloutStats)>,
) -> Result<RolloutBatch> {
    let (k, per_call) = (request.group_size, prompts_per_call.max(1));
    let mut batch = RolloutBatch::new(k, request.prompts.to_vec());
    let (first, end) = (
        request.first_group,
        request.first_group + request.prompts.len(),
    );
    let mut g = first;
    while g < end {
        let c = g / per_call;
        let stop = ((c + 1) * per_call).min(end);
        let chunk = &request.prompts[g - first..stop - first];
        let cfg = SamplingConfig {
            seed: request.sampling.seed.wrapping_add(c as u64),
            first_stream: ((g - c * per_call) * k) as u64,
            ..request.sampling.clone()
        };
        g = stop;
        let (generations, stats) = call(&group_rows(chunk, k), &cfg)?;
        batch.telemetry.merge(&stats);
        for g in generations {
            batch.push(g);
        }
    }
    Ok(batch)
}

/// conrub-rollout's engine ([`conrub_rollout::rollout`]: paged KV pool, continuous batching,
/// shared prompt prefixes, sampling on the device) on the policy's own weights, `prompts_per_call`
/// prompts x k rows per engine call. Weight sync is a no-op: the engine reads the policy the
/// learner hands it.
#[derive(Debug, Clone, PartialEq)]
pub struct InProcessEngine {
    /// Prompts per engine call.
    pub prompts_per_call: usize,
    /// KV pool, block size and rows decoded at once.
    pub engine: EngineConfig,
}

impl<B, P> RolloutEngine<B, P> for InProcessEngine
where
    B: KernelOps,
    P: Policy<B> + PagedModel<B>,
{
    fn rollout(
        &self,
        policy: &P,
        request: &RolloutRequest<'_>,
        device: &B::Device,
    ) -> Result<RolloutBatch> {
        in_calls(request, self.prompts_per_call, |rows, cfg| {
            let out = conrub_rollout::rollout(policy, rows, cfg, &self.engine, device)?;
            Ok((out.generations, out.stats))
        })
    }

    fn walk_shapes(&self, policy: &P, walk: &ShapeWalk<'_>, device: &B::Device) -> Result<usize> {
        let calls = self
            .prompts_per_call
            .max(1)
            .min(walk.prompts_per_step.max(1));
        let shapes = EngineShapes::reachable(
            walk.prompt_lens,
            walk.sampling.max_new_tokens,
            calls * walk.group_size,
            self.engine.max_rows,
            self.engine.block_size,
        );
        conrub_rollout::walk_shapes(policy, &shapes, walk.sampling, &self.engine, device)
    }
}

/// Any [`Policy`] through [`Policy::sample`], `prompts_per_call` prompts x k rows per call; no
/// engine telemetry.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupSampler {
    /// Prompts per sampling call.
    pub prompts_per_call: usize,
}

impl<B: Backend, P: Policy<B>> RolloutEngine<B, P> for GroupSampler {
    fn rollout(
        &self,
        policy: &P,
        request: &RolloutRequest<'_>,
        device: &B::Device,
    ) -> Result<RolloutBatch> {
        in_calls(request, self.prompts_per_call, |rows, cfg| {
            Ok((policy.sample(rows, cfg, device)?, RolloutStats::default()))
        })
    }
}

/// One generated answer of [`Learner::generate`](crate::Learner::generate) (validation reads them).
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    /// The decoded text.
    pub text: String,
    /// Tokens generated.
    pub tokens: usize,
    /// Cut at the length limit.
    pub truncated: bool,
}

impl Answer {
    pub(crate) fn new(text: String, tokens: usize, finish: conrub_contracts::FinishReason) -> Self {
        Self {
            text,
            tokens,
            truncated: finish == conrub_contracts::FinishReason::Length,
        }
    }
}
