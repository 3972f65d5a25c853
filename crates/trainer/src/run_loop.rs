//! The training loop: epochs over the task's prompts in a seeded order, steps of
//! `run.prompts_per_step` prompts, every output through the sinks after each step, checkpoints
//! every N steps and at the end. Its state is one struct ([`RunLoop`]) with a method per stage:
//! open (resume, claim the folder, open the sinks), draw, step, validate, checkpoint, finish.

use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use conrub_contracts::{EpochSummary, MetricsLine, Policy, RunConfig, StepMetrics};
use conrub_grpo::{stable_seed, StepOutput};
use conrub_kernels::KernelOps;
use conrub_rewards::TaskPrompt;
use conrub_rubric::seeded_permutation;
use serde::Serialize;

use crate::checkpoint::{checkpoint_dir, checkpoint_failed, BestCheckpoint, Seal, Sealing};
use crate::error::{Result, TrainerError};
use crate::hooks::RunHooks;
use crate::run_folder::{set_aside_later_checkpoints, EarlierRun};
use crate::samples::{group_samples, remove_samples_after};
use crate::sinks::{default_sinks, RunEvent, RunSink};
use crate::telemetry::MetricsLog;
use crate::trainee::Trainee;
use crate::validation::Validator;

/// The order of the records in `epoch`: a permutation seeded by the run seed and the epoch.
pub fn epoch_order(n: usize, seed: u64, epoch: usize) -> Vec<usize> {
    seeded_permutation(n, stable_seed(seed, &format!("epoch/{epoch}")))
}

/// `count` records from position `from` of the run's data order, the epochs' orders one after
/// another (position `p` is record `epoch_order(n, seed, p / n)[p % n]`): dynamic sampling's
/// cursor, which crosses epochs within a step.
pub fn drawn_records<T>(records: &[T], seed: u64, from: u64, count: usize) -> Vec<&T> {
    let n = records.len() as u64;
    let mut order: (u64, Vec<usize>) = (u64::MAX, Vec::new());
    (from..from + count as u64)
        .map(|p| {
            if order.0 != p / n {
                order = (p / n, epoch_order(records.len(), seed, (p / n) as usize));
            }
            &records[order.1[(p % n) as usize]]
        })
        .collect()
}

/// What a run did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RunSummary {
    /// Steps run in this invocation.
    pub steps_run: u64,
    /// Total steps completed.
    pub total_steps: u64,
    /// Last checkpoint written.
    pub last_checkpoint: Option<PathBuf>,
    /// Epoch summaries completed in this invocation.
    pub epochs: Vec<EpochSummary>,
    /// The best checkpoint by the validation grader's score, when the run validates.
    pub best: Option<BestCheckpoint>,
}

/// The SHA-256 of the task's prompt ids in order (hex), kept in the data cursor: a resume over
/// other prompts is told that its data order does not continue the earlier run's.
fn prompt_ids_digest<T: TaskPrompt>(records: &[T]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for r in records {
        h.update(r.id().as_bytes());
        h.update([0u8]);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Where the run is in its data: the step plan and, under dynamic sampling, the prompts drawn.
struct DataCursor {
    steps_per_epoch: u64,
    total_steps: u64,
    /// Prompts drawn so far (dynamic sampling's flat cursor over the epochs' orders).
    drawn: u64,
    dynamic: bool,
    records: usize,
    ids_digest: String,
}

impl DataCursor {
    /// What a checkpoint keeps of it after `step` steps.
    fn saved(&self, step: u64) -> serde_json::Value {
        let mut cursor = serde_json::json!({
            "step": step,
            "steps_per_epoch": self.steps_per_epoch,
            "records": self.records,
            "prompt_ids": self.ids_digest,
        });
        if self.dynamic {
            cursor["prompts_drawn"] = self.drawn.into();
        }
        cursor
    }
}

/// A saved state the run continues from: its steps and its dynamic-sampling cursor.
struct Resumed {
    step: u64,
    drawn: Option<u64>,
}

/// Loads the state of `resume` (a checkpoint or its `training_state`) into `trainee`, warning
/// when it was written over other prompts than `records` (the data order does not continue).
fn resume_state<B, P, T, Tr>(trainee: &mut Tr, records: &[T], resume: &Path) -> Result<Resumed>
where
    B: AutodiffBackend + KernelOps,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
    T: TaskPrompt,
    Tr: Trainee<B, P, T>,
{
    let state_dir = if resume.join("training_state").is_dir() {
        resume.join("training_state")
    } else {
        resume.to_path_buf()
    };
    let state = trainee.load(&state_dir)?;
    // The data order is the seed's over these records: other records, another order.
    let saved = state.data_cursor["records"].as_u64();
    let ids = state.data_cursor["prompt_ids"].as_str();
    if saved.is_some_and(|n| n != records.len() as u64) {
        tracing::warn!(
            "{}: the state was written with {} prompts and this run has {}: the data order does not continue the earlier run's (did data.rubrics, [[data.train]] or data.max_prompt_tokens change?)",
            state_dir.display(),
            saved.unwrap_or_default(),
            records.len()
        );
    } else if ids.is_some_and(|d| d != prompt_ids_digest(records)) {
        tracing::warn!(
            "{}: the state was written with other prompts (or another order of them) than this run's: the data order does not continue the earlier run's (did a file of data.rubrics or [[data.train]] change?)",
            state_dir.display()
        );
    }
    Ok(Resumed {
        step: state.step,
        // Prompts drawn so far (a state without a count drew `prompts_per_step` a step).
        drawn: state.data_cursor["prompts_drawn"].as_u64(),
    })
}

/// Claims `run.output_dir` for the run (`run.lock`, held until the returned lock drops): a
/// fresh run never starts over an earlier one unless told to overwrite it or set it aside; a
/// resumed one moves checkpoints past its step (an earlier, longer attempt's) aside.
fn claim_folder(run: &RunConfig, resumed: Option<&Resumed>) -> Result<crate::run_folder::RunLock> {
    let earlier = match (run.overwrite, run.set_aside) {
        (true, _) => EarlierRun::Delete,
        (false, true) => EarlierRun::SetAside,
        (false, false) => EarlierRun::Refuse,
    };
    let lock = crate::run_folder::claim(&run.output_dir, resumed.is_some(), earlier)?;
    if let Some(r) = resumed {
        if let Some(aside) = set_aside_later_checkpoints(&run.output_dir, r.step)? {
            tracing::warn!(
                "checkpoints after step {}, left by an earlier attempt, moved to {}",
                r.step,
                aside.display()
            );
        }
        remove_samples_after(&run.output_dir, r.step)?;
    }
    Ok(lock)
}

/// Runs training (the run folder `run.output_dir` locked for the whole run, see
/// [`crate::run_folder::claim`]): epochs over `records` in a seeded order, `run.prompts_per_step`
/// prompts a step, metrics after every step, checkpoints every `run.checkpoint_every` steps and
/// at the end. `resume` is a checkpoint directory (or its `training_state`).
///
/// With a `validator`, the policy is validated whenever [`Validator::due`] says so (a
/// `kind = "eval"` line in `metrics.jsonl`); a round whose grader score beats every earlier one
/// gets a checkpoint (when its step has none already) and becomes `best-checkpoint.json`, which
/// `run.keep_checkpoints` never prunes. A resumed run derives that record from the validation
/// rounds `metrics.jsonl` keeps (those up to the resumed step).
pub async fn train<B, P, T, Tr>(
    trainee: &mut Tr,
    records: &[T],
    run: &RunConfig,
    resume: Option<&Path>,
    validator: Option<&Validator>,
    hooks: &mut dyn RunHooks<P>,
) -> Result<RunSummary>
where
    B: AutodiffBackend + KernelOps,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
    T: TaskPrompt,
    Tr: Trainee<B, P, T>,
{
    if records.is_empty() {
        return Err(TrainerError::NoRecords);
    }
    run.validate().map_err(conrub_grpo::GrpoError::from)?;
    if run.prompts_per_step > records.len() {
        tracing::warn!(
            "run.prompts_per_step = {} but there are {} records: each step takes all of them",
            run.prompts_per_step,
            records.len()
        );
    }
    let resumed = match resume {
        Some(dir) => Some(resume_state(trainee, records, dir)?),
        None => None,
    };
    let _lock = claim_folder(run, resumed.as_ref())?;
    let mut run_loop = RunLoop::open(trainee, records, run, resumed, validator, hooks)?;
    while run_loop.steps_done() < run_loop.cursor.total_steps {
        run_loop.step().await?;
    }
    run_loop.finish()
}

/// A run in progress: what it trains, where it is, and where its outputs go.
struct RunLoop<'r, B, P, T, Tr> {
    trainee: &'r mut Tr,
    records: &'r [T],
    run: &'r RunConfig,
    validator: Option<&'r Validator>,
    hooks: &'r mut dyn RunHooks<P>,
    sinks: Vec<Box<dyn RunSink>>,
    cursor: DataCursor,
    summary: RunSummary,
    /// Every step's metrics in `metrics.jsonl` (the epoch summaries are made from them).
    history: Vec<StepMetrics>,
    /// The checkpoint being sealed (hashed, flushed, renamed) behind the steps that follow it.
    sealing: Sealing,
    /// A new best waits for its step's checkpoint: it becomes the record once that checkpoint
    /// is in place.
    pending_best: Option<BestCheckpoint>,
    _backend: PhantomData<B>,
}

impl<'r, B, P, T, Tr> RunLoop<'r, B, P, T, Tr>
where
    B: AutodiffBackend + KernelOps,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
    T: TaskPrompt,
    Tr: Trainee<B, P, T>,
{
    /// Plans the run's steps, opens `metrics.jsonl` (dropping what a resumed run writes again)
    /// and the sinks, writes the hooks' opening lines, and derives the best checkpoint so far.
    fn open(
        trainee: &'r mut Tr,
        records: &'r [T],
        run: &'r RunConfig,
        resumed: Option<Resumed>,
        validator: Option<&'r Validator>,
        hooks: &'r mut dyn RunHooks<P>,
    ) -> Result<Self> {
        let resume_step = resumed.as_ref().map(|r| r.step);
        let steps_per_epoch = records.len().div_ceil(run.prompts_per_step) as u64;
        let mut total_steps = steps_per_epoch * run.epochs as u64;
        if let Some(m) = run.max_steps {
            total_steps = total_steps.min(m);
        }
        trainee.set_training_steps(total_steps)?;
        let path = run.output_dir.join("metrics.jsonl");
        let log = MetricsLog::open(&path, resume_step, steps_per_epoch, total_steps)?;
        let mut sinks = default_sinks(run, log.clone(), resume_step, total_steps)?;
        sinks.extend(hooks.sinks());
        for line in hooks.opening_lines() {
            for sink in &mut sinks {
                sink.event(&RunEvent::Opening(&line))?;
            }
        }
        // The record of the best checkpoint so far, and the steps so far (the opening lines
        // included), from the file as it now is.
        let best = BestCheckpoint::resume(&run.output_dir, resume_step, &log.evals()?)?;
        let history = log.steps()?;
        let cursor = DataCursor {
            steps_per_epoch,
            total_steps,
            drawn: resumed.map_or(0, |r| {
                r.drawn.unwrap_or(r.step * run.prompts_per_step as u64)
            }),
            dynamic: trainee.lead().config().dynamic_sampling,
            records: records.len(),
            ids_digest: prompt_ids_digest(records),
        };
        Ok(Self {
            trainee,
            records,
            run,
            validator,
            hooks,
            sinks,
            cursor,
            summary: RunSummary {
                best,
                ..Default::default()
            },
            history,
            sealing: Sealing::default(),
            pending_best: None,
            _backend: PhantomData,
        })
    }

    /// Steps completed.
    fn steps_done(&self) -> u64 {
        self.trainee.lead().steps_done()
    }

    /// Hands `event` to every sink, in order.
    fn emit(&mut self, event: RunEvent<'_>) -> Result<()> {
        for sink in &mut self.sinks {
            sink.event(&event)?;
        }
        Ok(())
    }

    /// The prompts of the next step, and under dynamic sampling the reserve it may draw from
    /// (the next prompts of a flat cursor over the epochs' orders: a step may draw into the
    /// next epoch).
    fn draw(&self) -> (Vec<&'r T>, Vec<&'r T>) {
        let (records, pps) = (self.records, self.run.prompts_per_step);
        let step = self.steps_done();
        let seed = self.trainee.lead().config().seed;
        if self.cursor.dynamic {
            let rounds = self.trainee.lead().config().dynamic_sampling_rounds;
            let at = drawn_records(records, seed, self.cursor.drawn, pps * (1 + rounds));
            return (at[..pps].to_vec(), at[pps..].to_vec());
        }
        let epoch = (step / self.cursor.steps_per_epoch) as usize;
        let index = (step % self.cursor.steps_per_epoch) as usize;
        let order = epoch_order(records.len(), seed, epoch);
        let batch = order
            .iter()
            .skip(index * pps)
            .take(pps)
            .map(|&i| &records[i])
            .collect();
        (batch, Vec::new())
    }

    /// One training step and everything after it: its outputs, the epoch's summary when the
    /// epoch ends, a validation round when due, and a checkpoint when one is due.
    async fn step(&mut self) -> Result<()> {
        self.sealing.poll(
            &mut *self.hooks,
            &self.run.output_dir,
            &mut self.summary.last_checkpoint,
        )?;
        let epoch = (self.steps_done() / self.cursor.steps_per_epoch) as usize;
        let (batch, reserve) = self.draw();
        let before = conrub_kernels::events::snapshot();
        let out = self.trainee.train_step(&batch, &reserve).await?;
        if self.cursor.dynamic {
            let extra = out.metrics.dynamic_prompts_drawn.unwrap_or(0);
            self.cursor.drawn += (batch.len() + extra) as u64;
        }
        // The prompts trained on (dynamic sampling may have replaced some), in group order.
        let trained: Vec<&T> = out
            .prompts
            .iter()
            .map(|&i| {
                batch
                    .get(i)
                    .copied()
                    .unwrap_or_else(|| reserve[i - batch.len()])
            })
            .collect();
        self.record_step(epoch, out, &trained, before)?;
        let step = self.steps_done();
        if let Some(v) = self.validator.filter(|v| v.due(step)) {
            self.validate(v).await?;
        }
        let periodic =
            self.run.checkpoint_every > 0 && step.is_multiple_of(self.run.checkpoint_every);
        if step < self.cursor.total_steps && (periodic || self.pending_best.is_some()) {
            self.checkpoint()?;
        }
        Ok(())
    }

    /// Hands a step's output to the sinks (its samples, then its metrics line with the kernels
    /// it compiled since `before`), and the epoch's summary when the step ends an epoch.
    fn record_step(
        &mut self,
        epoch: usize,
        out: StepOutput,
        trained: &[&T],
        before: Option<conrub_kernels::events::KernelEvents>,
    ) -> Result<()> {
        let samples = group_samples(&out, trained, self.run.sample_groups);
        self.emit(RunEvent::Step {
            output: &out,
            samples: &samples,
        })?;
        let mut m = out.metrics;
        m.kernels = before
            .zip(conrub_kernels::events::snapshot())
            .map(|(a, b)| b.since(&a));
        let step = self.steps_done();
        let line = MetricsLine::Step {
            epoch,
            metrics: Box::new(m.clone()),
        };
        self.emit(RunEvent::Line {
            line: &line,
            steps_done: step,
        })?;
        self.history.push(m);
        self.summary.steps_run += 1;
        let per_epoch = self.cursor.steps_per_epoch;
        let first = epoch as u64 * per_epoch;
        if step == first + per_epoch || step == self.cursor.total_steps {
            let steps: Vec<StepMetrics> = self
                .history
                .iter()
                .filter(|s| s.step >= first && s.step < first + per_epoch)
                .cloned()
                .collect();
            let e = EpochSummary::from_steps(epoch, &steps);
            let line = MetricsLine::Epoch(e.clone());
            self.emit(RunEvent::Line {
                line: &line,
                steps_done: step,
            })?;
            self.summary.epochs.push(e);
        }
        Ok(())
    }

    /// A validation round with `v` on the whole policy: its answers and line to the sinks, and
    /// a new best by the grader pending until its step's checkpoint.
    async fn validate(&mut self, v: &Validator) -> Result<()> {
        let step = self.steps_done();
        let before = conrub_kernels::events::snapshot();
        let lead = self.trainee.lead();
        let policy = self.trainee.whole_policy(lead.policy().matrix_dtype())?;
        let (mut line, answers) = v.validate_round(lead, &policy.valid()).await?;
        drop(policy);
        self.emit(RunEvent::Validation {
            steps_done: step,
            answers: &answers,
        })?;
        line.kernels = before
            .zip(conrub_kernels::events::snapshot())
            .map(|(a, b)| b.since(&a));
        let best = self.summary.best.as_ref().map(|b| b.grader_score);
        self.pending_best = BestCheckpoint::of(&line, &self.run.output_dir)
            .filter(|b| best.is_none_or(|s| b.grader_score > s));
        self.emit(RunEvent::Line {
            line: &MetricsLine::Eval(line),
            steps_done: step,
        })
    }

    /// Writes a checkpoint of the current step (the policy's export and the learner's state,
    /// whole under `.tmp`) and starts its seal, after the previous checkpoint is in place: one
    /// checkpoint in flight. A pending best becomes the run's best with it.
    fn checkpoint(&mut self) -> Result<()> {
        let output_dir = &self.run.output_dir;
        self.sealing.finish(
            &mut *self.hooks,
            output_dir,
            &mut self.summary.last_checkpoint,
        )?;
        self.summary.best = self.pending_best.take().or(self.summary.best.take());
        self.trainee.verify()?;
        let step = self.steps_done();
        let dir = checkpoint_dir(output_dir, step);
        // Written whole under `.tmp`, then renamed: a kill leaves no partial checkpoint.
        let tmp = dir.with_extension("tmp");
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(|e| TrainerError::io(&tmp, e))?;
        }
        let t0 = Instant::now();
        let draft = match self.write_checkpoint(&tmp) {
            Ok(draft) => draft,
            Err(e) => return Err(checkpoint_failed(&tmp, &dir, e)),
        };
        let seal = Seal {
            draft,
            tmp,
            dir,
            output_dir: output_dir.clone(),
            keep: self.run.keep_checkpoints,
            step,
            best: self.summary.best.clone(),
            written_secs: t0.elapsed().as_secs_f64(),
        };
        let background = self.run.checkpoint_in_background;
        self.sealing.start(seal, background);
        if !background {
            self.sealing.finish(
                &mut *self.hooks,
                output_dir,
                &mut self.summary.last_checkpoint,
            )?;
        }
        Ok(())
    }

    /// The checkpoint's files in `tmp`: the export of the whole policy (let go before the state
    /// is written), then the learner's state, whose draft the seal finishes.
    fn write_checkpoint(&mut self, tmp: &Path) -> Result<conrub_grpo::StateDraft> {
        let policy = self.trainee.whole_policy(self.hooks.export_dtype())?;
        self.hooks.export(&policy, tmp)?;
        drop(policy);
        let cursor = self.cursor.saved(self.steps_done());
        Ok(self.trainee.save(cursor, &tmp.join("training_state"))?)
    }

    /// The last checkpoint (unless this invocation ran no step and one is in place), then waits
    /// for its seal.
    fn finish(mut self) -> Result<RunSummary> {
        if self.summary.steps_run > 0 || self.summary.last_checkpoint.is_none() {
            self.checkpoint()?;
        }
        self.sealing.finish(
            &mut *self.hooks,
            &self.run.output_dir,
            &mut self.summary.last_checkpoint,
        )?;
        self.summary.total_steps = self.steps_done();
        Ok(std::mem::take(&mut self.summary))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Dynamic sampling's cursor reads the epochs' orders one after another: a draw across an
    /// epoch's end takes the rest of that epoch's order, then the next one's from its start.
    #[test]
    fn drawn_records_cross_epochs_in_their_orders() {
        let records: Vec<usize> = (0..5).collect();
        let (first, second) = (epoch_order(5, 7, 0), epoch_order(5, 7, 1));
        assert_ne!(first, second);
        let drawn: Vec<usize> = drawn_records(&records, 7, 3, 4)
            .into_iter()
            .copied()
            .collect();
        assert_eq!(drawn, vec![first[3], first[4], second[0], second[1]]);
        let third: Vec<usize> = drawn_records(&records, 7, 10, 5)
            .into_iter()
            .copied()
            .collect();
        assert_eq!(third, epoch_order(5, 7, 2));
    }
}
