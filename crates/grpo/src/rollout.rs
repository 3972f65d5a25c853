//! The rollout stage: `k` sampled responses per prompt, as a [`RolloutBatch`], from a
//! [`RolloutEngine`]. Two engines come with the crate: [`InProcessEngine`] (conrub-rollout's paged
//! engine on the policy's own weights) and [`GroupSampler`] (any [`Policy`], through
//! [`Policy::sample`]). An engine in another process (an inference server) implements the same
//! trait: it receives token ids and returns token ids, and [`RolloutEngine::sync_weights`] is
//! where it gets the policy's new weights.

use burn::tensor::backend::Backend;
use conrub_kernels::GrpoOps;
use conrub_rollout::{EngineConfig, Generation, PagedModel, RolloutStats, SamplingConfig};

use crate::batch::RolloutBatch;
use crate::error::{GrpoError, Result};
use crate::policy::Policy;

/// What the learner asks of the rollout engine in one step.
#[derive(Debug, Clone, Copy)]
pub struct RolloutRequest<'a> {
    /// Prompt token ids, one per group (chat-templated, non-empty).
    pub prompts: &'a [Vec<u32>],
    /// Responses per prompt (k).
    pub group_size: usize,
    /// Decoding, length limit, stop ids and the step's seed.
    pub sampling: &'a SamplingConfig,
    /// Learner steps completed before this one.
    pub step: u64,
    /// The step's index of `prompts[0]`: 0 on one device; with data-parallel ranks, the first of
    /// this rank's groups. Calls follow the step's global chunking and streams (see [`in_calls`]),
    /// so every response is the same whatever the number of ranks.
    pub first_group: usize,
}

/// What handing the policy's weights to an engine cost (zero for an in-process engine).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct WeightSync {
    /// Wall seconds (writing the weights, the servers' reloads).
    pub secs: f64,
    /// Bytes of weights written.
    pub bytes: u64,
}

impl WeightSync {
    /// Both costs of `self` and `other`.
    pub fn plus(self, other: WeightSync) -> WeightSync {
        WeightSync {
            secs: self.secs + other.secs,
            bytes: self.bytes + other.bytes,
        }
    }
}

/// Produces the responses of one step. Per learner step the learner calls, in order:
/// [`RolloutEngine::sync_weights`] with the policy and the step count (an engine whose weights
/// are already that version does nothing), [`RolloutEngine::rollout`] with the policy on the
/// inner backend (no autodiff tape) and a seed derived from the run seed and the step,
/// [`RolloutEngine::release`] once every rank's rollouts are done and before the update stage,
/// and [`RolloutEngine::sync_weights`] again with the step count plus one once the step's
/// optimizer steps are done (the next rollout is the first reader of the new weights).
///
/// Data-parallel ranks may share one engine (it is `Sync`): each rank calls every method, so an
/// engine that syncs or releases must do it once per version or step.
pub trait RolloutEngine<B: Backend, P: Policy<B>>: Send + Sync {
    /// `request.group_size` responses to each prompt, prompt-major (row `r` answers prompt
    /// `r / group_size`), each with its per-token log-probabilities and finish reason.
    fn rollout(
        &self,
        policy: &P,
        request: &RolloutRequest<'_>,
        device: &B::Device,
    ) -> Result<RolloutBatch>;

    /// Makes the engine sample from `policy`, the weights after `version` learner steps. The
    /// default does nothing: an in-process engine samples from the policy it is given.
    fn sync_weights(&self, policy: &P, version: u64) -> Result<WeightSync> {
        let _ = (policy, version);
        Ok(WeightSync::default())
    }

    /// The step's rollouts are over on every rank: an engine that shares the learner's devices
    /// gives its memory back until the next [`RolloutEngine::sync_weights`]. Default: nothing.
    fn release(&self) -> Result<()> {
        Ok(())
    }
}

/// One engine shared by several learners (the ranks of a data-parallel group).
impl<B, P, E> RolloutEngine<B, P> for std::sync::Arc<E>
where
    B: Backend,
    P: Policy<B>,
    E: RolloutEngine<B, P> + ?Sized,
{
    fn rollout(
        &self,
        policy: &P,
        request: &RolloutRequest<'_>,
        device: &B::Device,
    ) -> Result<RolloutBatch> {
        (**self).rollout(policy, request, device)
    }

    fn sync_weights(&self, policy: &P, version: u64) -> Result<WeightSync> {
        (**self).sync_weights(policy, version)
    }

    fn release(&self) -> Result<()> {
        (**self).release()
    }
}

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
    B: GrpoOps,
    P: Policy<B> + PagedModel<B>,
{
    fn rollout(
        &self,
        policy: &P,
        request: &RolloutRequest<'_>,
        device: &B::Device,
    ) -> Result<RolloutBatch> {
        in_calls(request, self.prompts_per_call, |rows, cfg| {
            let out = conrub_rollout::rollout(policy, rows, cfg, &self.engine, device)
                .map_err(GrpoError::Sampling)?;
            Ok((out.generations, out.stats))
        })
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
