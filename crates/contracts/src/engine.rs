//! The rollout stage's contract: `k` sampled responses per prompt, as a [`RolloutBatch`], from a
//! [`RolloutEngine`]. `conrub_grpo` ships two engines (the paged engine of `conrub_rollout` on the
//! policy's own weights, and any [`Policy`] through [`Policy::sample`]); an engine in another
//! process (an inference server, `conrub_remote`) implements the same trait: it receives token ids
//! and returns token ids, and [`RolloutEngine::sync_weights`] is where it gets the policy's new
//! weights.

use burn::tensor::backend::Backend;

use crate::error::Result;
use crate::policy::Policy;
use crate::sampling::{FinishReason, Generation, SamplingConfig};
use crate::stats::RolloutStats;

/// The responses of one rollout, `group_size` per prompt, in prompt-major order (row `r` answers
/// prompt `r / group_size`).
#[derive(Debug, Clone, PartialEq)]
pub struct RolloutBatch {
    /// Responses per prompt (k).
    pub group_size: usize,
    /// Prompt ids, one per group (chat-templated, non-empty).
    pub prompts: Vec<Vec<u32>>,
    /// Response ids per row (the stop token included when one was sampled).
    pub responses: Vec<Vec<u32>>,
    /// Per row: the log-probability of each response token under the distribution it was drawn
    /// from (the engine's; the learner recomputes its own for the loss).
    pub logprobs: Vec<Vec<f32>>,
    /// Per row: why the response ended.
    pub finish_reasons: Vec<FinishReason>,
    /// What the engine did (fields an engine does not measure stay 0).
    pub telemetry: RolloutStats,
}

impl RolloutBatch {
    /// An empty batch for `prompts`, `group_size` rows each.
    pub fn new(group_size: usize, prompts: Vec<Vec<u32>>) -> Self {
        Self {
            group_size,
            prompts,
            responses: Vec::new(),
            logprobs: Vec::new(),
            finish_reasons: Vec::new(),
            telemetry: RolloutStats::default(),
        }
    }

    /// Appends the next row.
    pub fn push(&mut self, generation: Generation) {
        self.responses.push(generation.tokens);
        self.logprobs.push(generation.logprobs);
        self.finish_reasons.push(generation.finish_reason);
    }

    /// Appends the groups of `other` (the next rank's, in a data-parallel step) and merges its
    /// telemetry.
    pub fn append(&mut self, other: RolloutBatch) {
        debug_assert_eq!(self.group_size, other.group_size);
        self.prompts.extend(other.prompts);
        self.responses.extend(other.responses);
        self.logprobs.extend(other.logprobs);
        self.finish_reasons.extend(other.finish_reasons);
        self.telemetry.merge(&other.telemetry);
    }

    /// The groups `keep` (indices, in the order given) with their rows; the telemetry stays
    /// whole (it measured every group rolled out).
    pub fn select_groups(self, keep: &[usize]) -> RolloutBatch {
        let k = self.group_size;
        let rows = |g: &usize| *g * k..(*g + 1) * k;
        RolloutBatch {
            group_size: k,
            prompts: keep.iter().map(|&g| self.prompts[g].clone()).collect(),
            responses: keep
                .iter()
                .flat_map(rows)
                .map(|r| self.responses[r].clone())
                .collect(),
            logprobs: keep
                .iter()
                .flat_map(rows)
                .map(|r| self.logprobs[r].clone())
                .collect(),
            finish_reasons: keep
                .iter()
                .flat_map(rows)
                .map(|r| self.finish_reasons[r])
                .collect(),
            telemetry: self.telemetry,
        }
    }

    /// Per row: the response hit the length limit without a stop token.
    pub fn truncated(&self) -> impl Iterator<Item = bool> + '_ {
        self.finish_reasons
            .iter()
            .map(|f| *f == FinishReason::Length)
    }

    /// Checks that the batch answers `prompts` prompts with `group_size` rows each, every row
    /// with a log-probability per token and a finish reason.
    pub fn check_shape(&self, prompts: usize, group_size: usize) -> crate::error::Result<()> {
        let rows = prompts * group_size;
        let per_token = self
            .responses
            .iter()
            .zip(&self.logprobs)
            .all(|(r, l)| r.len() == l.len());
        if self.group_size == group_size
            && self.prompts.len() == prompts
            && self.rows() == rows
            && self.logprobs.len() == rows
            && self.finish_reasons.len() == rows
            && per_token
        {
            return Ok(());
        }
        Err(crate::error::ContractError::Stage(format!(
            "rollout returned {} prompts x {} rows (group size {}, {} log-prob rows{}, {} finish reasons) for {prompts} prompts x {group_size}",
            self.prompts.len(),
            self.rows(),
            self.group_size,
            self.logprobs.len(),
            if per_token { "" } else { ", some not one per token" },
            self.finish_reasons.len(),
        )))
    }
    /// Number of responses.
    pub fn rows(&self) -> usize {
        self.responses.len()
    }

    /// The prompt of `row`.
    pub fn prompt(&self, row: usize) -> &[u32] {
        &self.prompts[row / self.group_size]
    }

    /// Response lengths in tokens.
    pub fn lengths(&self) -> Vec<u32> {
        self.responses.iter().map(|r| r.len() as u32).collect()
    }
}

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
    /// this rank's groups. Calls follow the step's global chunking and streams (see `conrub_grpo`'s engines),
    /// so every response is the same whatever the number of ranks.
    pub first_group: usize,
}

/// What the kernel warm-up asks an engine to walk ([`RolloutEngine::walk_shapes`]): the shapes
/// a run's rollouts can reach.
#[derive(Debug, Clone, Copy)]
pub struct ShapeWalk<'a> {
    /// The token length of every prompt of the task.
    pub prompt_lens: &'a [usize],
    /// The most prompts one rollout call of a step can hold (before the engine's own cap).
    pub prompts_per_step: usize,
    /// Responses per prompt (k).
    pub group_size: usize,
    /// The run's decoding and length limit.
    pub sampling: &'a SamplingConfig,
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

    /// The kernel warm-up: runs `policy` through every shape of `walk` once, so that no step
    /// compiles or tunes a kernel later; returns the passes made. Default: none (an engine
    /// outside the process compiles nothing here).
    fn walk_shapes(&self, policy: &P, walk: &ShapeWalk<'_>, device: &B::Device) -> Result<usize> {
        let _ = (policy, walk, device);
        Ok(0)
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

    fn walk_shapes(&self, policy: &P, walk: &ShapeWalk<'_>, device: &B::Device) -> Result<usize> {
        (**self).walk_shapes(policy, walk, device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `select_groups` keeps the chosen groups' prompts and rows, in the order given.
    #[test]
    fn select_groups_keeps_whole_groups_in_order() {
        let mut batch = RolloutBatch::new(2, vec![vec![1], vec![2], vec![3]]);
        for row in 0..6u32 {
            batch.responses.push(vec![row]);
            batch.logprobs.push(vec![-(row as f32)]);
            batch.finish_reasons.push(if row % 2 == 0 {
                FinishReason::Stop
            } else {
                FinishReason::Length
            });
        }
        let kept = batch.select_groups(&[2, 0]);
        assert_eq!(kept.prompts, vec![vec![3], vec![1]]);
        assert_eq!(kept.responses, vec![vec![4], vec![5], vec![0], vec![1]]);
        assert_eq!(
            kept.logprobs,
            vec![vec![-4.0], vec![-5.0], vec![-0.0], vec![-1.0]]
        );
        assert_eq!(kept.finish_reasons[1], FinishReason::Length);
        kept.check_shape(2, 2).unwrap();
    }
}
