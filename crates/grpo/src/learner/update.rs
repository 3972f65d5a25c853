//! The update stage: mini-batches, PPO epochs and token-budget micro-batches through the policy
//! loss (and the entropy bonus, the GRPO+DPO pairs), the gradient path of the rank (sum, reduce-
//! scatter to owners, gathered layers), clipping and the optimizer step.

use super::types::*;

impl<B, P, T> Learner<B, P, T>
where
    B: AutodiffBackend + KernelOps,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
    T: TaskPrompt,
{
    /// With `learner.entropy_coeff`: the term taken from each micro-batch's loss, from the
    /// policy's entropies `[responses, R]` and the loss mask (both masked alike): the coefficient
    /// times their aggregate under `learner.aggregation` ([`crate::aggregate_token_term`]).
    pub(super) fn entropy_bonus<Bk: burn::tensor::backend::Backend>(
        &self,
    ) -> Option<impl Fn(Tensor<Bk, 2>, Tensor<Bk, 2>) -> Tensor<Bk, 1>> {
        let (coeff, aggregation, max) = (
            self.cfg.objective.entropy_coeff,
            self.cfg.objective.aggregation,
            self.cfg.max_response_tokens,
        );
        (coeff != 0.0).then_some(move |entropy: Tensor<Bk, 2>, mask: Tensor<Bk, 2>| {
            crate::loss::aggregate_token_term(entropy * mask.clone(), mask, aggregation, max)
                * coeff
        })
    }

    /// Stage 5: PPO epochs over mini-batches; each mini-batch accumulates the gradients of its
    /// micro-batches (slices of `batch`), then clips globally and steps the optimizer.
    ///
    /// Mini-batches are cut from the whole step's rows (`rows`); a data-parallel rank takes its
    /// part of each (possibly none), weights its micro-batches by the mini-batch's global counts,
    /// and all-reduces the summed gradients before the optimizer step, so every rank applies the
    /// update one device would for the same rows.
    pub(super) fn update_stage(
        &mut self,
        batch: &TrainBatch<B>,
        dpo_pairs: &[(usize, usize)],
        rows: &GlobalRows,
    ) -> Result<UpdateStats> {
        let n = rows.lens.len();
        let size = n.div_ceil(self.cfg.mini_batches).max(1);
        let minis: Vec<Range<usize>> = (0..n).step_by(size).map(|s| s..(s + size).min(n)).collect();
        let plan = UpdatePlan {
            batch,
            dpo_pairs,
            rows,
        };
        let mut tally = UpdateTally::new();
        for epoch in 0..self.cfg.ppo_epochs {
            let last = epoch + 1 == self.cfg.ppo_epochs;
            for mini in &minis {
                self.mini_batch_step(&plan, mini.clone(), last, &mut tally)?;
            }
        }
        if !tally.norms.is_empty() {
            self.check_weights_finite()?;
        }
        self.update_stats(tally, minis.len())
    }

    /// One optimizer step: this rank's micro-batches of the mini-batch `mini` (and its GRPO+DPO
    /// pairs) through the rank's gradient path, idle passes while other ranks have more, then
    /// the reduction and the step (or a skipped one, for a non-finite norm).
    fn mini_batch_step(
        &mut self,
        plan: &UpdatePlan<'_, B>,
        mini: Range<usize>,
        last: bool,
        tally: &mut UpdateTally<B::InnerBackend>,
    ) -> Result<()> {
        let rows = plan.rows;
        let local = rows.first..rows.first + plan.batch.rows();
        let mini_tokens: usize = rows.lens[mini.clone()].iter().sum();
        // This learner's rows of the mini-batch (maybe none), as indices into `batch`.
        let lo = mini.start.clamp(local.start, local.end);
        let mine = lo - rows.first..mini.end.clamp(lo, local.end) - rows.first;
        let pairs: Vec<(usize, usize)> = plan
            .dpo_pairs
            .iter()
            .copied()
            .filter(|(w, _)| mine.contains(w))
            .collect();
        let micros = self.local_micro_batches(rows, mini.clone(), plan.batch.rows());
        // Backward passes this rank makes, and the most any rank makes (a path whose every pass
        // is a collective call has a rank with fewer join the others' with idle passes).
        let passes = micros.len() + usize::from(!pairs.is_empty());
        let rounds = self.path.rounds(passes)?;
        let mut sum = self.path.begin();
        for micro in micros {
            let mb = plan.batch.slice(micro.clone());
            let weight = self.loss.micro_batch_weight(
                micro.len(),
                mini.len(),
                mb.loss_tokens(),
                mini_tokens,
            );
            let part = self.micro_batch_pass(&mb, weight, last, &mut sum, &mut tally.comm)?;
            tally.add_micro_batch(&mb, part);
        }
        if !pairs.is_empty() {
            self.dpo_gradients(
                plan.batch,
                &pairs,
                rows.lens.len(),
                &mut sum,
                &mut tally.comm,
            )?;
        }
        for _ in passes..rounds {
            self.path
                .idle_pass(&self.policy, &self.device, &mut sum, &mut tally.comm)?;
        }
        let (norm, stepped) = self.reduce_and_step(sum, &mut tally.comm)?;
        if stepped {
            self.skipped_in_a_row = 0;
            tally.norms.push(norm);
        } else {
            self.skip_nonfinite(norm)?;
            tally.skipped += 1;
        }
        Ok(())
    }

    /// The backward pass of micro-batch `mb`, its loss weighted by `weight` (so the sum over
    /// micro-batches is the mini-batch's aggregate) and less the entropy bonus, into `sum`
    /// through the rank's gradient path.
    /// In the last PPO epoch, returns the micro-batch's numbers, kept on the device: weighted
    /// loss, clip_low x tokens, clip_high x tokens, kl x tokens, entropy sum, and whether the
    /// policy gave entropies.
    pub(super) fn micro_batch_pass(
        &self,
        mb: &TrainBatch<B>,
        weight: f64,
        last: bool,
        sum: &mut StepSum<B>,
        comm: &mut CommStats,
    ) -> Result<Option<(Tensor<B::InnerBackend, 1>, bool)>> {
        let mut part: Option<(Tensor<B::InnerBackend, 1>, bool)> = None;
        let loss = &self.loss;
        let entropy_bonus = self.entropy_bonus::<B>();
        let mut micro_loss = |out_lp: ResponseLogprobs<B>| {
            // `learner.entropy_coeff`: the policy's entropies, aggregated as the loss is, times
            // the coefficient, taken from the loss.
            let bonus = entropy_bonus
                .as_ref()
                .zip(out_lp.entropy.clone())
                .map(|(f, e)| f(e, mb.loss_mask()));
            let mut out = loss.compute(SurrogateBatch {
                logp: out_lp.logprobs,
                logp_old: mb.logp_old.clone(),
                advantages: mb.advantages.clone(),
                mask: mb.loss_mask(),
                logp_ref: mb.logp_ref.clone(),
                logp_engine: mb.logp_engine.clone(),
            });
            if let Some(b) = bonus {
                out.loss = out.loss - b;
            }
            if last {
                let w = mb.loss_tokens() as f64;
                let f32_of = |t: Tensor<B, 1>| t.detach().inner().cast(DType::F32);
                let zero = || {
                    Tensor::<B::InnerBackend, 1>::zeros([1], &out.clip_low.device())
                        .cast(DType::F32)
                };
                let has_entropy = out_lp.entropy.is_some();
                let numbers = Tensor::cat(
                    vec![
                        f32_of(out.loss.clone()) * weight,
                        f32_of(out.clip_low.clone()) * w,
                        f32_of(out.clip_high.clone()) * w,
                        out.kl.clone().map(|k| f32_of(k) * w).unwrap_or_else(zero),
                        out_lp
                            .entropy
                            .map(|e| f32_of((e * mb.loss_mask()).sum()))
                            .unwrap_or_else(zero),
                    ],
                    0,
                );
                part = Some((numbers, has_entropy));
            }
            out.loss * weight
        };
        self.path
            .backward(&self.policy, &mb.tokens, &mut micro_loss, sum, comm)?;
        Ok(part)
    }

    /// The update's metrics from its tally over `minis` mini-batches: the one read of the last
    /// epoch's micro-batch numbers, added over ranks in rank order.
    fn update_stats(
        &self,
        mut tally: UpdateTally<B::InnerBackend>,
        minis: usize,
    ) -> Result<UpdateStats> {
        let steps = tally.norms.len();
        let mut totals = tally.totals();
        if let Some(slot) = &self.rank {
            // Every rank's totals, added in rank order: the same numbers on every rank.
            totals = UpdateTotals::sum_in_rank_order(
                slot.collective.all_gather(slot.rank, totals.to_vec())?,
            );
        }
        let tokens = totals.tokens.max(1.0);
        Ok(UpdateStats {
            grad_norms: tally.norms,
            optimizer_steps: steps,
            skipped_optimizer_steps: tally.skipped,
            loss: totals.loss / minis.max(1) as f64,
            clip_low: totals.clip_low / tokens,
            clip_high: totals.clip_high / tokens,
            kl: (self.cfg.objective.kl_beta != 0.0).then(|| totals.kl / tokens),
            entropy: (totals.has_entropy > 0.0).then(|| totals.entropy / tokens),
            tokens_computed: totals.computed as u64,
            tokens_needed: totals.needed as u64,
            comm: tally.comm,
            lr: self.update.last_lr(),
        })
    }

    /// The optimizer step of a mini-batch whose gradients are `sum`: reduced over the group's
    /// ranks by the gradient path, clipped by the global norm and applied, then the updated
    /// weights shared as the path says. Returns the norm and whether the step was taken.
    pub(super) fn reduce_and_step(
        &mut self,
        sum: StepSum<B>,
        comm: &mut CommStats,
    ) -> Result<(f64, bool)> {
        let mut reduced = self.path.reduce(&self.policy, sum, comm)?;
        let grads = std::mem::take(&mut reduced.grads);
        let (policy, norm, stepped) = match reduced.norm.take() {
            None => self.update.apply_if_finite(self.policy.clone(), grads),
            Some(norm) => self
                .update
                .apply_with_norm(self.policy.clone(), grads, norm),
        };
        self.policy = self.path.share_updated(policy, &reduced, stepped, comm)?;
        Ok((norm, stepped))
    }

    /// An optimizer step whose gradient norm is `norm` (non-finite) was not taken: an error
    /// under `learner.on_nonfinite = "stop"`, and under `"skip-step"` once
    /// `learner.max_skipped_steps` were skipped in a row.
    pub(super) fn skip_nonfinite(&mut self, norm: f64) -> Result<()> {
        let at = format!("step {}", self.step);
        let what = format!("the gradient norm is {norm} (a non-finite loss or gradient)");
        match self.cfg.system.on_nonfinite {
            OnNonFinite::Stop => Err(GrpoError::NonFinite { at, what }),
            OnNonFinite::SkipStep => {
                self.skipped_in_a_row += 1;
                if self.skipped_in_a_row > self.cfg.system.max_skipped_steps {
                    return Err(GrpoError::NonFinite {
                        at,
                        what: format!(
                            "{what}, {} optimizer steps skipped in a row (learner.max_skipped_steps = {})",
                            self.skipped_in_a_row, self.cfg.system.max_skipped_steps
                        ),
                    });
                }
                Ok(())
            }
        }
    }

    /// Every weight of the policy is finite after the step's updates (one device reduction and
    /// one scalar read); a non-finite one stops the run whatever `learner.on_nonfinite` says.
    pub(super) fn check_weights_finite(&self) -> Result<()> {
        let sum = crate::update::nonfinite_probe(&self.policy);
        if sum.is_finite() {
            return Ok(());
        }
        Err(GrpoError::NonFinite {
            at: format!("step {}", self.step),
            what: "a weight is not finite after the update".into(),
        })
    }

    /// Gradients of the GRPO+DPO baseline term for accepted `(winner, loser)` rows, added into
    /// `sum` (the mini-batch's running sum). `total` is the step's row count (the term is
    /// normalised by it).
    pub(super) fn dpo_gradients(
        &self,
        batch: &TrainBatch<B>,
        pairs: &[(usize, usize)],
        total: usize,
        sum: &mut StepSum<B>,
        comm: &mut CommStats,
    ) -> Result<()> {
        let rows: Vec<usize> = pairs.iter().flat_map(|&(w, l)| [w, l]).collect();
        let index = row_index::<B>(&rows, &self.device);
        // Padding cut to the bucket of the longest of these rows, as for a micro-batch.
        let (seq_len, response_len) = batch.widths(rows.iter().copied());
        let tokens = batch
            .tokens
            .select(index.clone())
            .slice(0..rows.len(), seq_len, response_len);
        let old = batch
            .logp_old
            .clone()
            .select(0, index)
            .sum_dim(1)
            .reshape([rows.len()]);
        let p = pairs.len();
        let winners = row_index::<B>(&(0..p).map(|i| 2 * i).collect::<Vec<_>>(), &self.device);
        let losers = row_index::<B>(&(0..p).map(|i| 2 * i + 1).collect::<Vec<_>>(), &self.device);
        let beta = self.cfg.objective.dpo_beta;
        Ok(self.path.backward(
            &self.policy,
            &tokens,
            &mut |lp| {
                let seq = lp.logprobs.sum_dim(1).reshape([rows.len()]);
                dpo_pair_loss(
                    seq.clone().select(0, winners.clone()),
                    seq.select(0, losers.clone()),
                    old.clone().select(0, winners.clone()),
                    old.clone().select(0, losers.clone()),
                    beta,
                    total,
                )
            },
            sum,
            comm,
        )?)
    }
}

/// What the update stage works over: the step's train batch (this rank's rows), its GRPO+DPO
/// pairs and every rank's rows.
pub(super) struct UpdatePlan<'a, B: AutodiffBackend> {
    pub(super) batch: &'a TrainBatch<B>,
    pub(super) dpo_pairs: &'a [(usize, usize)],
    pub(super) rows: &'a GlobalRows,
}

/// What the update stage gathers as it goes: the norms of the optimizer steps taken (read one
/// scalar per step, so a non-finite norm stops or skips that step before it changes the
/// weights), the steps skipped, the last epoch's micro-batch numbers (on the device until the
/// one read), token counts and collective traffic.
pub(super) struct UpdateTally<B: burn::tensor::backend::Backend> {
    pub(super) norms: Vec<f64>,
    pub(super) skipped: usize,
    micro_parts: Vec<Tensor<B, 1>>,
    loss_tokens: usize,
    has_entropy: bool,
    /// Token positions the policy's forward passes computed (padding included) and needed.
    computed: usize,
    needed: usize,
    pub(super) comm: CommStats,
}

impl<B: burn::tensor::backend::Backend> UpdateTally<B> {
    fn new() -> Self {
        Self {
            norms: Vec::new(),
            skipped: 0,
            micro_parts: Vec::new(),
            loss_tokens: 0,
            has_entropy: false,
            computed: 0,
            needed: 0,
            comm: CommStats::default(),
        }
    }

    /// Counts micro-batch `mb`'s positions and, in the last epoch, keeps its numbers (`part`).
    fn add_micro_batch<A: AutodiffBackend<InnerBackend = B>>(
        &mut self,
        mb: &TrainBatch<A>,
        part: Option<(Tensor<B, 1>, bool)>,
    ) {
        self.computed += mb.tokens.tokens.dims().iter().product::<usize>();
        self.needed += mb.seq_lens.iter().sum::<usize>();
        if let Some((numbers, has_entropy)) = part {
            self.micro_parts.push(numbers);
            self.has_entropy |= has_entropy;
            self.loss_tokens += mb.loss_tokens();
        }
    }

    /// This rank's totals: the one read of the micro-batch numbers, summed in order in f64.
    fn totals(&mut self) -> UpdateTotals {
        let per_micro: Vec<f64> = if self.micro_parts.is_empty() {
            Vec::new()
        } else {
            Tensor::cat(std::mem::take(&mut self.micro_parts), 0)
                .into_data()
                .convert::<f64>()
                .into_vec()
                .expect("f64 metrics")
        };
        let mut s = [0f64; 9];
        for part in per_micro.chunks(5) {
            for (acc, x) in s.iter_mut().zip(part) {
                *acc += x;
            }
        }
        s[5..].copy_from_slice(&[
            self.loss_tokens as f64,
            self.has_entropy as u8 as f64,
            self.computed as f64,
            self.needed as f64,
        ]);
        UpdateTotals::from_slice(&s)
    }
}

/// The update's sums over the last PPO epoch's micro-batches (loss weighted, the rest by
/// tokens), as one rank has them or added over ranks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct UpdateTotals {
    loss: f64,
    clip_low: f64,
    clip_high: f64,
    kl: f64,
    entropy: f64,
    tokens: f64,
    /// 1 when the policy gave entropies (on any rank, once added).
    has_entropy: f64,
    computed: f64,
    needed: f64,
}

impl UpdateTotals {
    /// The fields in the order ranks exchange them.
    fn to_vec(self) -> Vec<f64> {
        vec![
            self.loss,
            self.clip_low,
            self.clip_high,
            self.kl,
            self.entropy,
            self.tokens,
            self.has_entropy,
            self.computed,
            self.needed,
        ]
    }

    /// Every rank's totals (as [`to_vec`](Self::to_vec) lists them) added in rank order.
    fn sum_in_rank_order(all: Vec<Vec<f64>>) -> Self {
        let s: Vec<f64> = (0..all[0].len())
            .map(|i| all.iter().map(|v| v[i]).sum())
            .collect();
        Self::from_slice(&s)
    }

    /// The totals from the fields in [`to_vec`](Self::to_vec)'s order.
    fn from_slice(s: &[f64]) -> Self {
        Self {
            loss: s[0],
            clip_low: s[1],
            clip_high: s[2],
            kl: s[3],
            entropy: s[4],
            tokens: s[5],
            has_entropy: s[6],
            computed: s[7],
            needed: s[8],
        }
    }
}
