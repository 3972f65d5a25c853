//! The rollout stage: the step's prompts through the rollout engine, their responses decoded and
//! cut at stop strings, scored; and generation outside training (validation).

use super::types::*;

impl<B, P, T> Learner<B, P, T>
where
    B: AutodiffBackend + KernelOps,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
    T: TaskPrompt,
{
    /// `samples` answers of the current policy to each conversation of `prompts` (prompt-major),
    /// through this learner's rollout engine and codec, with `sampling`. Training state is
    /// untouched (validation during training uses it: `conrub_trainer::Validator`).
    pub fn generate(
        &self,
        prompts: &[Vec<conrub_rubric::Message>],
        samples: usize,
        sampling: &SamplingConfig,
    ) -> Result<Vec<crate::rollout::Answer>> {
        self.generate_with(&self.policy.valid(), prompts, samples, sampling)
    }

    /// [`Learner::generate`] from `inner` (a sharded group's whole policy) instead of this
    /// learner's own.
    pub fn generate_with(
        &self,
        inner: &P::InnerModule,
        prompts: &[Vec<conrub_rubric::Message>],
        samples: usize,
        sampling: &SamplingConfig,
    ) -> Result<Vec<crate::rollout::Answer>> {
        let ids: Vec<Vec<u32>> = prompts
            .iter()
            .map(|m| self.codec.encode_prompt(m))
            .collect::<conrub_contracts::Result<_>>()?;
        if ids.iter().any(Vec::is_empty) {
            return Err(GrpoError::Stage("a prompt renders to no tokens".into()));
        }
        self.rollout.sync_weights(inner, self.step)?;
        let request = RolloutRequest {
            prompts: &ids,
            group_size: samples,
            sampling,
            step: self.step,
            first_group: 0,
        };
        let mut batch = self.rollout.rollout(inner, &request, &self.device)?;
        batch.check_shape(prompts.len(), samples)?;
        let mut texts = self.decode_all(&batch)?;
        cut_at_stop_strings(&mut batch, &mut texts, self.codec.as_ref(), &self.cfg.stop)?;
        Ok(texts
            .into_iter()
            .zip(batch.responses.iter().zip(&batch.finish_reasons))
            .map(|(text, (r, &f))| crate::rollout::Answer::new(text, r.len(), f))
            .collect())
    }

    /// Every response of `batch` as text.
    pub(super) fn decode_all(&self, batch: &RolloutBatch) -> Result<Vec<String>> {
        Ok(batch
            .responses
            .iter()
            .map(|r| self.codec.decode(r))
            .collect::<conrub_contracts::Result<_>>()?)
    }

    /// Stages 1 and 2 on `candidates`: their groups rolled out (streams by candidate index, so
    /// the same prompt gets the same responses on any number of ranks), cut at stop strings and
    /// scored. `times` gains the seconds of each stage.
    pub(super) async fn rollout_and_score<'r>(
        &self,
        inner: &P::InnerModule,
        candidates: Vec<(usize, &'r T)>,
        times: &mut (f64, f64),
    ) -> Result<Scored<'r, T>> {
        let k = self.cfg.group_size;
        let records: Vec<&T> = candidates.iter().map(|(_, r)| *r).collect();
        let t0 = Instant::now();
        let first = candidates.first().map_or(0, |(i, _)| *i);
        let mut rollout = self.rollout_stage(inner, &records, first)?;
        rollout.check_shape(records.len(), k)?;
        let mut texts = self.decode_all(&rollout)?;
        cut_at_stop_strings(
            &mut rollout,
            &mut texts,
            self.codec.as_ref(),
            &self.cfg.stop,
        )?;
        times.0 += t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let scores = self.reward_stage(&records, &rollout, &texts).await;
        if let Some((g, s)) = scores.iter().enumerate().find(|(_, s)| s.scores.len() != k) {
            return Err(GrpoError::Stage(format!(
                "rewards of group {g} ({}): {} scores for {k} responses",
                records[g].id(),
                s.scores.len()
            )));
        }
        times.1 += t1.elapsed().as_secs_f64();
        Ok(Scored {
            prompts: candidates,
            rollout,
            texts,
            scores,
        })
    }

    /// The sequence and response lengths of the whole step's rows and where this learner's rows
    /// start among them (gathered from every rank when data-parallel).
    pub(super) fn global_rows(&self, rollout: &RolloutBatch, shard: Shard) -> Result<GlobalRows> {
        let Some(slot) = &self.rank else {
            return Ok(self.local_rows(rollout));
        };
        let GlobalRows {
            seq_lens: seq,
            lens: response,
            ..
        } = self.local_rows(rollout);
        let mine: Vec<f64> = seq.iter().chain(&response).map(|&l| l as f64).collect();
        let gathered = slot.collective.all_gather(slot.rank, mine)?;
        let first = gathered[..slot.rank].iter().map(|v| v.len() / 2).sum();
        let (mut seq_lens, mut lens) = (Vec::new(), Vec::new());
        for v in &gathered {
            let (s, r) = v.split_at(v.len() / 2);
            seq_lens.extend(s.iter().map(|&l| l as usize));
            lens.extend(r.iter().map(|&l| l as usize));
        }
        if lens.len() != shard.total * self.cfg.group_size {
            return Err(GrpoError::Stage(format!(
                "rank {}: the ranks hold {} rows for {} groups of {}",
                slot.rank,
                lens.len(),
                shard.total,
                self.cfg.group_size
            )));
        }
        Ok(GlobalRows {
            seq_lens,
            lens,
            first,
        })
    }

    /// This learner's rows alone: their sequence lengths and the tokens each adds to the loss
    /// (a masked truncated response none).
    pub(super) fn local_rows(&self, rollout: &RolloutBatch) -> GlobalRows {
        GlobalRows {
            seq_lens: (0..rollout.rows())
                .map(|r| rollout.prompt(r).len() + rollout.responses[r].len())
                .collect(),
            lens: rollout
                .responses
                .iter()
                .zip(self.loss_rows(rollout))
                .map(|(r, kept)| if kept { r.len() } else { 0 })
                .collect(),
            first: 0,
        }
    }

    /// Stage 1: `group_size` responses per record, sampled on the inner backend.
    pub(super) fn rollout_stage(
        &self,
        inner: &P::InnerModule,
        records: &[&T],
        first_group: usize,
    ) -> Result<RolloutBatch> {
        let prompts: Vec<Vec<u32>> = records
            .iter()
            .map(|r| {
                self.codec
                    .encode_prompt(r.messages())
                    .map_err(|e| GrpoError::Prompt {
                        id: r.id().to_string(),
                        message: match e {
                            conrub_contracts::ContractError::Prompt { message, .. } => message,
                            other => other.to_string(),
                        },
                    })
            })
            .collect::<Result<_>>()?;
        if let Some(i) = prompts.iter().position(Vec::is_empty) {
            return Err(GrpoError::Prompt {
                id: records[i].id().to_string(),
                message: "renders to no tokens".into(),
            });
        }
        let seed = stable_seed(self.cfg.seed, &format!("rollout/{}", self.step));
        let sampling = SamplingConfig::from_learner(&self.cfg, seed, &self.stop_ids);
        let request = RolloutRequest {
            prompts: &prompts,
            group_size: self.cfg.group_size,
            sampling: &sampling,
            step: self.step,
            first_group,
        };
        Ok(self.rollout.rollout(inner, &request, &self.device)?)
    }
}
