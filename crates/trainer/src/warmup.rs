//! The supervised warm-up of `[warmup]`: cross-entropy steps on the prompts' reference answers
//! before the first GRPO step (fresh runs only).

use burn::backend::Autodiff;
use burn::module::AutodiffModule;
use conrub_contracts::{PagedModel, Policy};
use conrub_kernels::KernelOps;
use conrub_rewards::TaskPrompt;

use crate::error::{Result, TrainerError};
use crate::progress::PhaseProgress;
use crate::sft::{sft_warmup, warmup_pairs};
use crate::Trainer;

impl<B, P, T> Trainer<B, P, T>
where
    B: KernelOps,
    P: Policy<Autodiff<B>> + AutodiffModule<Autodiff<B>> + Send + 'static,
    P::InnerModule: Policy<B> + PagedModel<B> + 'static,
    T: TaskPrompt + 'static,
{
    /// Runs `[warmup]` on the policy when the config has it and the run is fresh.
    pub(crate) fn supervised_warmup(&mut self, model: P) -> Result<P> {
        let (Some(w), None) = (&self.cfg.warmup, &self.resume) else {
            return Ok(model);
        };
        let pairs = warmup_pairs(&self.task, &self.codec, &self.stop_ids)
            .map_err(|e| TrainerError::Setup(format!("[warmup]: {e}")))?;
        if pairs.is_empty() {
            return Err(TrainerError::Setup(
                "[warmup]: no prompt of the task has a reference answer".into(),
            ));
        }
        let device = self.devices[0].clone();
        let mut progress = PhaseProgress::new("warm-up", w.steps);
        let (model, losses) =
            sft_warmup(model, &pairs, w.steps, w.lr, &device, &mut |done, loss| {
                progress.update(done, &format!("loss {loss:.3}"))
            })?;
        tracing::info!(
            "warm-up: {} steps on {} reference answers, loss {:.3} -> {:.3}",
            w.steps,
            pairs.len(),
            losses.first().copied().unwrap_or(f64::NAN),
            losses.last().copied().unwrap_or(f64::NAN)
        );
        Ok(model)
    }
}
