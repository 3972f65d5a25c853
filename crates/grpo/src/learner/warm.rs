//! The kernel warm-up's walk through the learner's shapes: after one real step has compiled
//! the step's kernels at its own widths, the stages after the rollout (old and reference
//! log-probs, the train batch, the log-prob gap, each micro-batch's backward pass) run again on
//! made-up rows at every micro-batch shape a run can cut ([`ShapeBounds::micro_batches`];
//! with a truncated response masked too under `mask_truncated`) and every response width and
//! row count a whole step can take. The gradients are dropped: no optimizer step, no weight
//! changes.

use conrub_contracts::{dim_class, Generation, MicroShape, ShapeBounds};

use super::types::*;
use crate::advantages::TieStatus;

impl<B, P, T> Learner<B, P, T>
where
    B: AutodiffBackend + KernelOps,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
    T: TaskPrompt,
{
    /// Walks the learner's shapes, then its engine's ([`RolloutEngine::walk_shapes`]), for a
    /// task of prompts of `prompt_lens` tokens and steps of `groups` groups on this learner (see
    /// the module docs); returns the learner's micro-batches and the engine's passes. The ranks
    /// of a data-parallel group walk together ([`crate::DataParallel::walk_shapes`]): a sharded
    /// group's passes are collectives.
    pub fn walk_shapes(&self, prompt_lens: &[usize], groups: usize) -> Result<(usize, usize)> {
        let shortest = prompt_lens.iter().copied().min().unwrap_or(1).max(1);
        let longest = prompt_lens.iter().copied().max().unwrap_or(1).max(shortest);
        let bounds = ShapeBounds {
            group_size: self.cfg.group_size,
            micro_batch_tokens: self.cfg.system.micro_batch_tokens,
            prompt_tokens: (shortest, longest),
            max_response_tokens: self.cfg.max_response_tokens,
        };
        // With `mask_truncated`, a micro-batch holding a truncated response masks it: both kinds.
        let truncated: &[bool] = if self.cfg.objective.mask_truncated {
            &[false, true]
        } else {
            &[false]
        };
        let mut micro = 0;
        for shape in bounds.micro_batches() {
            let rows = vec![rows_of(shape, shortest); shape.rows];
            let layout = (shape.step_width, shape.step_responses);
            for &cut in truncated {
                micro += self.walk_rows(&rows, Some(layout), cut)?;
            }
        }
        // A whole step's widths: one row of each response width class, the others short, for
        // each class of row count a step can hold (an epoch's last step, dynamic sampling's
        // kept groups, a data-parallel rank's share).
        let k = self.cfg.group_size.max(1);
        let mut counts = std::collections::BTreeMap::new();
        for g in 1..=groups.max(1) {
            counts.insert(dim_class(g * k), g * k);
        }
        for width in bounds.step_response_widths() {
            for &n in counts.values() {
                let mut rows = vec![(shortest, 1); n];
                rows[0] = (shortest, width.min(self.cfg.max_response_tokens).max(1));
                micro += self.walk_rows(&rows, None, false)?;
            }
        }
        let (inner, _) = self.whole_inner()?;
        let sampling = SamplingConfig::from_learner(&self.cfg, 0, &self.stop_ids);
        let walk = conrub_contracts::ShapeWalk {
            prompt_lens,
            prompts_per_step: groups,
            group_size: self.cfg.group_size,
            sampling: &sampling,
        };
        let engine = self.rollout.walk_shapes(&inner, &walk, &self.device)?;
        Ok((micro, engine))
    }

    /// The stages after the rollout on made-up rows of `(prompt, response)` lengths, in groups
    /// of `group_size` (a last group may be short), laid out at least `layout` wide; returns the
    /// micro-batches passed.
    fn walk_rows(
        &self,
        rows: &[(usize, usize)],
        layout: Option<(usize, usize)>,
        truncated: bool,
    ) -> Result<usize> {
        let k = self.cfg.group_size.max(1);
        let prompts: Vec<Vec<u32>> = rows
            .chunks(k)
            .map(|g| vec![0u32; g.iter().map(|r| r.0).max().unwrap_or(1)])
            .collect();
        let mut rollout = RolloutBatch::new(k, prompts);
        for (i, &(_, r)) in rows.iter().enumerate() {
            rollout.push(Generation {
                tokens: vec![0; r],
                logprobs: vec![0.0; r],
                finish_reason: if truncated && i == 0 {
                    FinishReason::Length
                } else {
                    FinishReason::Stop
                },
            });
        }
        let outcomes: Vec<GroupOutcome> = rows
            .chunks(k)
            .map(|g| GroupOutcome {
                advantages: vec![0.0; g.len()],
                status: TieStatus::NotTied,
                pairs: Vec::new(),
            })
            .collect();
        let n = rollout.rows();
        let global = self.local_rows(&rollout);
        // Gathered for the forward passes and dropped before the backward ones, as a step does
        // (a `full` rank would otherwise hold a whole copy of the weights through them).
        let (inner, _) = self.whole_inner()?;
        let logprobs = self.batch_logprobs(&inner, &rollout, &global, layout);
        drop(inner);
        let _ = self.sequence_kl(&logprobs);
        let batch = self.train_batch(&rollout, &outcomes, logprobs);
        let _ = LogprobGap::of(&batch, &rollout);
        let micros = self.local_micro_batches(&global, 0..n, n);
        let count = micros.len();
        // The rank's own gradient path, as a real step takes it; the sum is dropped.
        let (mut sum, mut comm) = (self.path.begin(), CommStats::default());
        for micro in micros {
            self.micro_batch_pass(&batch.slice(micro), 1.0, true, &mut sum, &mut comm)?;
        }
        Ok(count)
    }
}

/// The `(prompt, response)` lengths of a row that a micro-batch of `shape` is cut to: its
/// longest sequence is the width and its response falls in the response bucket.
fn rows_of(shape: MicroShape, shortest_prompt: usize) -> (usize, usize) {
    let response = shape
        .responses
        .min(shape.width - shortest_prompt.max(1))
        .max(1);
    (shape.width - response, response)
}
