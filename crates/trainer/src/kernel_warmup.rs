//! Kernel warm-up (not the `[warmup]` supervised steps): before a run's first step on a CubeCL
//! backend, the run's first supervised steps (when it has `[warmup]`: two, so AdamW's step with
//! moments runs too) and one GRPO step, exactly as the run will take them (same learner
//! settings, learning rates and tie mode), on the run's first prompts; then a walk through the
//! shapes later steps can meet that this one did not (`Learner::walk_shapes`: every class of
//! micro-batch, whole-step response width, prefill, decode step and sampling the run's prompts,
//! limits and budgets allow, on made-up tokens, gradients dropped; only on a backend that
//! compiles kernels); then the weights are put
//! back from a host copy taken before (f32, exact). What the walk leaves (GRPO+DPO pair passes,
//! repetition-penalty lists, KV swaps, validation) is said in its line's `left`. A data-parallel run's GRPO step runs on its
//! own group (every rank, its collective and its sharding), since a replica of a sharded run's
//! training state may not fit one device. Every kernel and autotune key of those steps
//! is compiled, tuned and kept in the kernel cache while a counter shows progress, instead of
//! during a silent first step. For a rubric task its rewards and tie verdicts come from a
//! lexical judge with no keyword file (no server is called); other tasks score with their own
//! reward source and tie breaker (which may call a server). Nothing is written but the kernel
//! cache.
//!
//! `conrub train` runs it when the device's kernel cache held no compiled kernel (the binary's
//! `backend.rs` knows); `conrub kernels-warmup --config FILE` runs it alone (train's set-up, then
//! the warm-up, then exit). Its cost: about one step, plus a host copy of the weights (4 bytes per
//! parameter of host memory, and a transfer each way).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use burn::backend::Autodiff;
use burn::module::AutodiffModule;
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use conrub_contracts::{KernelWarmupLine, PagedModel, Policy};
use conrub_grpo::DataParallel;
use conrub_kernels::KernelOps;
use conrub_parallel::HostCollective;
use conrub_rewards::TaskPrompt;

use crate::error::{Result, TrainerError};
use crate::run_loop::epoch_order;
use crate::sft::{sft_pairs, sft_train};
use crate::{Engine, Trainer};

impl<B, P, T> Trainer<B, P, T>
where
    B: KernelOps,
    P: Policy<Autodiff<B>> + AutodiffModule<Autodiff<B>> + Send + 'static,
    P::InnerModule: Policy<B> + PagedModel<B> + 'static,
    T: TaskPrompt + 'static,
{
    /// Runs the kernel warm-up (see the module docs) and keeps its line for `metrics.jsonl`; the
    /// policy comes back unchanged.
    pub fn warm_kernels(mut self) -> Result<Self> {
        self.preflight()?;
        let model = self.model.take().ok_or_else(|| setup("no policy".into()))?;
        // Built before the counter starts, so its lines print plainly.
        let engine = self.engine_for(&model)?;
        let started = Instant::now();
        let before = conrub_kernels::events::snapshot();
        let ticker = Ticker::start();
        let device = self.devices[0].clone();
        let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
        let saved = recorder
            .record(model.clone().into_record(), ())
            .map_err(|e| setup(format!("copying the weights to the host: {e}")))?;
        let (model, ran) = self.kernel_warmup_steps(model, engine)?;
        let record = recorder
            .load(saved, &device)
            .map_err(|e| setup(format!("restoring the weights: {e}")))?;
        self.model = Some(model.load_record(record));
        drop(ticker);
        let line = KernelWarmupLine {
            resumed: self.resume.is_some(),
            ran,
            left: self.left_unwalked(),
            secs: started.elapsed().as_secs_f64(),
            kernels: before
                .zip(conrub_kernels::events::snapshot())
                .map(|(a, b)| b.since(&a)),
        };
        let e = line.kernels.unwrap_or_default();
        tracing::info!(
            "kernel warm-up: {} in {:.1} s: {} kernels compiled, {} loaded from the cache, {} autotune runs",
            line.ran, line.secs, e.kernel_compiles, e.kernel_cache_loads, e.autotune_runs
        );
        if !line.left.is_empty() {
            tracing::info!(
                "kernel warm-up: not walked (compiled when a step first meets them): {}",
                line.left.join("; ")
            );
        }
        self.kernel_warmup = Some(line);
        Ok(self)
    }

    /// The steps of the warm-up on the policy (left changed: the caller restores it); returns
    /// what ran.
    fn kernel_warmup_steps(&mut self, mut model: P, engine: Engine<B, P>) -> Result<(P, String)> {
        let cfg = &self.cfg;
        let device = self.devices[0].clone();
        let mut ran = Vec::new();
        if let (Some(w), None) = (&cfg.warmup, &self.resume) {
            let pairs = sft_pairs(&self.task, &self.codec, &self.stop_ids)
                .map_err(|e| setup(format!("[warmup]: {e}")))?;
            let n = w.steps.min(2);
            if !pairs.is_empty() && n > 0 {
                model = sft_train(model, &pairs, n, w.lr, &device, &mut |_, _| {})?.0;
                ran.push(format!("{n} supervised steps of {} answers", pairs.len()));
            }
        }
        let judging = match &self.kernel_warmup_judging {
            Some((r, b)) => (r.clone(), Some(b.clone())),
            None => (self.rewards.clone(), self.tie_breaker.clone()),
        };
        let order = epoch_order(self.task.len(), cfg.learner.seed, 0);
        let batch: Vec<&T> = order
            .iter()
            .take(cfg.run.prompts_per_step)
            .map(|&i| &self.task[i])
            .collect();
        // The most groups a step holds (a task smaller than a step gives all it has).
        let groups = batch.len();
        let model = if self.devices.len() > 1 {
            // The run's own group (its ranks, collective and sharding): a replica of the
            // training state may not fit one device when the run shards it.
            let collective = self
                .collective
                .clone()
                .unwrap_or_else(|| Arc::new(HostCollective::new(self.devices.len())));
            let mut policy_of = crate::policy_for_ranks(model, self.devices.len());
            let mut group = DataParallel::build_sharded(
                &self.devices,
                collective,
                cfg.learner.system.allreduce_bucket_bytes(),
                cfg.sharding,
                |r, d| Ok(self.learner_builder(policy_of(r).fork(d), d, &engine, judging.clone())),
            )?;
            // The one step's rate does not matter (the weights are restored), only its shapes.
            group.set_training_steps(1)?;
            self.runtime.block_on(group.step(&batch))?;
            if B::compiles_kernels() {
                let walked = group.walk_shapes(&self.prompt_lens()?, groups)?;
                ran.push(walk_words(walked));
            }
            // Rank 0's policy as the structure the caller loads the saved weights into (a
            // `full` rank's placeholders included: loading replaces every parameter).
            let lead = group.learners()[0].policy().clone();
            drop(group);
            lead.fork(&device)
        } else {
            let mut learner = self
                .learner_builder(model, &device, &engine, judging)
                .build()?;
            learner.set_training_steps(1)?;
            self.runtime.block_on(learner.step(&batch))?;
            if B::compiles_kernels() {
                let walked = learner.walk_shapes(&self.prompt_lens()?, groups)?;
                ran.push(walk_words(walked));
            }
            learner.into_policy()
        };
        let ranks = match self.devices.len() {
            1 => String::new(),
            n => format!(" on {n} ranks"),
        };
        ran.insert(
            ran.len() - usize::from(B::compiles_kernels()),
            format!(
                "1 GRPO step of {} prompts x {} responses{ranks}",
                batch.len(),
                cfg.learner.group_size
            ),
        );
        Ok((model, ran.join(", ")))
    }

    /// The token length of every prompt of the task (what the walk's shapes come from).
    fn prompt_lens(&self) -> Result<Vec<usize>> {
        let mut lens = Vec::with_capacity(self.task.len());
        for t in &self.task {
            lens.push(self.codec.encode_prompt(t.messages())?.len().max(1));
        }
        Ok(lens)
    }

    /// What the warm-up leaves for the run to compile when it meets it, in words.
    fn left_unwalked(&self) -> Vec<String> {
        let cfg = &self.cfg;
        let mut left = Vec::new();
        if !B::compiles_kernels() {
            return left;
        }
        if cfg.learner.tie_mode == conrub_grpo::TieMode::GrpoDpo {
            left.push("GRPO+DPO pair passes of other pair counts".into());
        }
        if cfg.learner.sampling.repetition_penalty != 1.0 {
            left.push("repetition-penalty id lists of other lengths".into());
        }
        if cfg.rollout.kv_cache_gb.is_some() || self.kv_pool_blocks.is_some() {
            left.push("KV swaps of preempted sequences".into());
        }
        if self.validator.is_some() {
            left.push("validation's generations".into());
        }
        left
    }
}

/// The walk's counts in words.
fn walk_words((micro, engine): (usize, usize)) -> String {
    format!("{micro} micro-batches of the learner's other shapes and {engine} engine passes")
}

/// A set-up error of the warm-up.
fn setup(message: String) -> TrainerError {
    TrainerError::Setup(format!("kernel warm-up: {message}"))
}

/// Prints what the warm-up compiled so far while it runs: a spinner line on a terminal, else a
/// plain line every 15 s (a log file shows it too).
struct Ticker {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

fn counts_line(started: Instant) -> String {
    let e = conrub_kernels::events::snapshot().unwrap_or_default();
    format!(
        "kernel warm-up: {} kernels compiled, {} loaded from the cache, {} autotune runs, {:.0} s",
        e.kernel_compiles,
        e.kernel_cache_loads,
        e.autotune_runs,
        started.elapsed().as_secs_f64()
    )
}

impl Ticker {
    fn start() -> Self {
        use std::io::IsTerminal;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let started = Instant::now();
            let bar = std::io::stderr().is_terminal().then(|| {
                let bar = indicatif::ProgressBar::new_spinner();
                bar.enable_steady_tick(std::time::Duration::from_millis(200));
                bar
            });
            let mut last_line = Instant::now();
            while !flag.load(Ordering::Relaxed) {
                std::thread::sleep(std::time::Duration::from_millis(250));
                match &bar {
                    Some(bar) => bar.set_message(counts_line(started)),
                    None if last_line.elapsed().as_secs() >= 15 => {
                        tracing::info!("{}", counts_line(started));
                        last_line = Instant::now();
                    }
                    None => {}
                }
            }
            if let Some(bar) = bar {
                bar.finish_and_clear();
            }
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
