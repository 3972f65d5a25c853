//! The train batch: the teacher-forcing layout on the device, the old and reference log-probs, the
//! micro-batch plan, and the engine-vs-learner log-prob gap.

use super::reward::sequence_kl;
use super::types::*;

impl<B, P, T> Learner<B, P, T>
where
    B: AutodiffBackend + KernelOps,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
    T: TaskPrompt,
{
    /// The micro-batches of the step's rows `range` (global indices) that hold this learner's
    /// rows, as indices into its train batch: the one-device plan of the whole step, cut to this
    /// learner's rows. Micro-batches never span two groups and ranks own whole groups, so the
    /// cut only drops other ranks' micro-batches.
    pub(super) fn local_micro_batches(
        &self,
        rows: &GlobalRows,
        range: Range<usize>,
        local: usize,
    ) -> Vec<Range<usize>> {
        let end = rows.first + local;
        plan_micro_batches(
            &rows.seq_lens,
            range,
            self.cfg.system.micro_batch_tokens,
            self.cfg.group_size,
        )
        .into_iter()
        .filter_map(|m| {
            let (lo, hi) = (m.start.max(rows.first), m.end.min(end));
            (lo < hi).then(|| lo - rows.first..hi - rows.first)
        })
        .collect()
    }

    /// Stage 4: the train batch on the device: the tokens and old (and reference) log-probs of
    /// [`Self::batch_logprobs`], one upload of the advantages.
    pub(super) fn train_batch(
        &self,
        rollout: &RolloutBatch,
        outcomes: &[GroupOutcome],
        logprobs: BatchLogprobs<B>,
    ) -> TrainBatch<B> {
        let n = rollout.rows();
        let width = logprobs.tokens.positions.dims()[1];
        let advantages: Vec<f32> = outcomes
            .iter()
            .flat_map(|o| o.advantages.iter().map(|&a| a as f32))
            .collect();
        // The engine's log-probs, right-padded like `logp_old` (only the TIS correction reads them).
        let logp_engine = self.cfg.objective.tis_cap.map(|_| {
            let mut flat = vec![0f32; n * width];
            for (r, l) in rollout.logprobs.iter().enumerate() {
                let t = l.len().min(width);
                flat[r * width..r * width + t].copy_from_slice(&l[..t]);
            }
            Tensor::from_data(TensorData::new(flat, [n, width]), &self.device)
        });
        TrainBatch {
            logp_old: logprobs.logp_old,
            logp_ref: logprobs.logp_ref,
            logp_engine,
            advantages: Tensor::from_data(TensorData::new(advantages, [n]), &self.device),
            tokens: logprobs.tokens,
            seq_lens: logprobs.seq_lens,
            response_lens: logprobs.response_lens,
            micro_batch_tokens: self.cfg.system.micro_batch_tokens,
            loss_rows: self.loss_rows(rollout),
        }
    }

    /// Every rank's rows (a collective: each rank's rollouts are then done, and the engine's
    /// are released), and this rank's old (and reference) log-probs over them.
    pub(super) fn rows_and_logprobs(
        &self,
        inner: &P::InnerModule,
        rollout: &RolloutBatch,
        shard: Shard,
    ) -> Result<(GlobalRows, BatchLogprobs<B>)> {
        let rows = self.global_rows(rollout, shard)?;
        self.rollout.release()?;
        let logprobs = self.batch_logprobs(inner, rollout, &rows, None);
        Ok((rows, logprobs))
    }

    /// Per row, its response's summed per-token KL to the reference (`learner.kl_estimator`
    /// over the old log-probs), read back to the host: what `learner.kl_in_reward` weighs.
    pub(super) fn sequence_kl(&self, logprobs: &BatchLogprobs<B>) -> Vec<f64> {
        match &logprobs.logp_ref {
            Some(logp_ref) => sequence_kl(
                self.cfg.objective.kl_estimator,
                logprobs.logp_old.clone(),
                logp_ref.clone(),
            ),
            None => vec![0.0; logprobs.seq_lens.len()],
        }
    }

    /// The tokens of the step's rows on the device and their old (and reference) log-probs,
    /// computed micro-batch by micro-batch and kept there; the layout's widths are the
    /// buckets of the longest rows, or at least `widths` (the kernel warm-up's walk).
    pub(super) fn batch_logprobs(
        &self,
        inner: &P::InnerModule,
        rollout: &RolloutBatch,
        rows: &GlobalRows,
        widths: Option<(usize, usize)>,
    ) -> BatchLogprobs<B> {
        let n = rollout.rows();
        let pairs = (0..n).map(|r| (rollout.prompt(r), rollout.responses[r].as_slice()));
        let tokens = match widths {
            Some(w) => TokenBatch::<B>::padded_to(pairs, w, &self.device),
            None => TokenBatch::<B>::bucketed(pairs, &self.device),
        };
        let seq_lens: Vec<usize> = (0..n)
            .map(|r| rollout.prompt(r).len() + rollout.responses[r].len())
            .collect();
        let response_lens: Vec<usize> = rollout.responses.iter().map(Vec::len).collect();
        let width = tokens.positions.dims()[1];
        let full = (tokens.tokens.dims()[1], width);
        let budget = self.cfg.system.micro_batch_tokens;
        let inner_tokens = tokens.inner();
        let micro = self.local_micro_batches(rows, rows.first..rows.first + n, n);
        let logprobs = |model: &P::InnerModule| -> Tensor<B, 2> {
            let parts: Vec<_> = micro
                .iter()
                .map(|m| {
                    // The widths the update's slices of these rows take (`TrainBatch::widths`).
                    let (s, r) =
                        micro_batch_widths((&seq_lens, &response_lens), m.clone(), budget, full);
                    pad_columns(
                        model
                            .response_logprobs(&inner_tokens.slice(m.clone(), s, r))
                            .logprobs,
                        width,
                    )
                })
                .collect();
            if parts.is_empty() {
                // A rank without a group this step (fewer groups than ranks).
                return Tensor::zeros([0, width], &self.device);
            }
            Tensor::from_inner(Tensor::cat(parts, 0))
        };
        BatchLogprobs {
            logp_old: logprobs(inner),
            logp_ref: self.reference.as_ref().map(logprobs),
            tokens,
            seq_lens,
            response_lens,
        }
    }

    /// Per row: whether the loss counts it (`learner.mask_truncated` leaves responses cut at
    /// the length limit out).
    pub(super) fn loss_rows(&self, rollout: &RolloutBatch) -> Vec<bool> {
        rollout
            .finish_reasons
            .iter()
            .map(|f| !(self.cfg.objective.mask_truncated && *f == FinishReason::Length))
            .collect()
    }
}

/// The step's rows on the device with their old (and reference) log-probs: the train batch
/// before its advantages.
pub(crate) struct BatchLogprobs<B: burn::tensor::backend::Backend> {
    pub(super) logp_old: Tensor<B, 2>,
    pub(super) logp_ref: Option<Tensor<B, 2>>,
    pub(super) tokens: TokenBatch<B>,
    pub(super) seq_lens: Vec<usize>,
    pub(super) response_lens: Vec<usize>,
}
