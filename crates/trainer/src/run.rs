//! [`Trainer::run`]: the supervised warm-up, the learners (one, or one per device) and the
//! training loop.

use burn::backend::Autodiff;
use burn::module::AutodiffModule;
use conrub_contracts::{PagedModel, Policy};
use conrub_grpo::{DataParallel, GrpoError, Learner, LearnerBuilder};
use conrub_kernels::KernelOps;
use conrub_parallel::HostCollective;
use conrub_rewards::TaskPrompt;
use std::sync::Arc;

use crate::error::{Result, TrainerError};
use crate::hooks::Hooks;
use crate::progress::PhaseProgress;
use crate::run_folder;
use crate::run_loop::{train, RunSummary};
use crate::sft::{sft_pairs, sft_train};
use crate::{Engine, Judging, Trainer};

impl<B, P, T> Trainer<B, P, T>
where
    B: KernelOps,
    P: Policy<Autodiff<B>> + AutodiffModule<Autodiff<B>> + Send + 'static,
    P::InnerModule: Policy<B> + PagedModel<B> + 'static,
    T: TaskPrompt + 'static,
{
    /// Trains: the supervised warm-up of `[warmup]` (fresh runs), then GRPO steps until the
    /// run's epochs or `run.max_steps` are done, writing `run.output_dir` as the training loop
    /// does ([`train`](crate::train)). Returns the run's summary (also printed).
    pub fn run(mut self) -> Result<RunSummary> {
        self.preflight()?;
        if self.cfg.run.output_dir.as_os_str().is_empty() {
            let why = "is empty (name the folder the run writes to)";
            return Err(GrpoError::config("run.output_dir", why).into());
        }
        let mut run = self.cfg.run.clone();
        run.output_dir = self.cfg.resolve(&run.output_dir);
        // A folder that is in use or holds an earlier run fails before the supervised warm-up.
        let replace = run.overwrite || run.set_aside;
        run_folder::check_start(&run.output_dir, self.resume.is_some(), replace)?;
        let model = self
            .model
            .take()
            .ok_or_else(|| TrainerError::Setup("no policy".into()))?;
        let engine = self.engine_for(&model)?;
        let model = self.run_sft(model)?;
        let mut hooks = Hooks {
            export: self.export.clone(),
            kernel_warmup: self.kernel_warmup.take(),
        };
        tracing::info!(
            "training on {} -> {}",
            self.describe,
            run.output_dir.display()
        );
        let resume = self.resume.as_deref();
        let validator = self.validator.as_ref();
        let summary = if self.devices.len() == 1 {
            let mut learner = self
                .learner_builder(model, &self.devices[0], &engine, self.judging())
                .build()?;
            let fut = train(
                &mut learner,
                &self.task,
                &run,
                resume,
                validator,
                &mut hooks,
            );
            self.runtime.block_on(fut)?
        } else {
            tracing::info!(
                "data parallel: {} ranks on {} (sharding = \"{}\")",
                self.devices.len(),
                self.cfg.devices.join(", "),
                self.cfg.sharding.name()
            );
            let collective = self
                .collective
                .clone()
                .unwrap_or_else(|| Arc::new(HostCollective::new(self.devices.len())));
            let bucket = self.cfg.learner.system.allreduce_bucket_bytes();
            let sharding = self.cfg.sharding;
            let mut policy_of = crate::policy_for_ranks(model, self.devices.len());
            let mut group = DataParallel::build_sharded(
                &self.devices,
                collective,
                bucket,
                sharding,
                |r, d| Ok(self.learner_builder(policy_of(r).fork(d), d, &engine, self.judging())),
            )?;
            let fut = train(&mut group, &self.task, &run, resume, validator, &mut hooks);
            self.runtime.block_on(fut)?
        };
        crate::report(&summary, &run.output_dir);
        Ok(summary)
    }

    /// Runs `[warmup]` on the policy when the config has it and the run is fresh.
    pub(crate) fn run_sft(&mut self, model: P) -> Result<P> {
        let (Some(w), None) = (&self.cfg.warmup, &self.resume) else {
            return Ok(model);
        };
        let pairs = sft_pairs(&self.task, &self.codec, &self.stop_ids)
            .map_err(|e| TrainerError::Setup(format!("[warmup]: {e}")))?;
        if pairs.is_empty() {
            return Err(TrainerError::Setup(
                "[warmup]: no prompt of the task has a reference answer".into(),
            ));
        }
        let device = self.devices[0].clone();
        let mut progress = PhaseProgress::new("warm-up", w.steps);
        let (model, losses) =
            sft_train(model, &pairs, w.steps, w.lr, &device, &mut |done, loss| {
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

    /// One rank's learner: the run's settings, engine, codec and registry, scored and its ties
    /// broken by `judging` (the run's own, or the kernel warm-up's).
    pub(crate) fn learner_builder(
        &self,
        model: P,
        device: &B::Device,
        engine: &Engine<B, P>,
        (rewards, breaker): Judging<T>,
    ) -> LearnerBuilder<Autodiff<B>, P, T> {
        let b = Learner::builder(model, self.cfg.learner_config(), device.clone())
            .rollout(engine.clone())
            .codec(self.codec.clone())
            .rewards(rewards)
            .stop_ids(self.stop_ids.clone());
        let b = match &self.registry {
            Some(r) => b.registry(r.clone()),
            None => b,
        };
        // With `tie_mode = "off"` the learner never calls a breaker it is given.
        match breaker {
            Some(t) => b.tie_breaker(t),
            None => b,
        }
    }

    /// The run's own rewards and tie breaker.
    fn judging(&self) -> Judging<T> {
        (self.rewards.clone(), self.tie_breaker.clone())
    }
}
