//! The training loop: epochs over the rubric records in a seeded order, steps of
//! `prompts_per_step` prompts, telemetry after each step, checkpoints every N steps and at the end.

use std::borrow::Cow;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::DType;
use conrub_rubric::seeded_permutation;
use conrub_rubric::RubricRecord;
use serde::{Deserialize, Serialize};

use crate::advantages::stable_seed;
use crate::checkpoint::{load_state, StateDraft, TrainingState};
use crate::error::{GrpoError, Result};
use crate::learner::{Learner, StepOutput};
use crate::parallel::DataParallel;
use crate::run_folder::{set_aside_later_checkpoints, EarlierRun};
use crate::samples::{eval_samples_path, remove_samples_after, step_samples_path, write_samples};
use crate::task::TaskPrompt;
use crate::telemetry::{progress_line, validation_progress_line, MetricsLog};
use crate::tensorboard::Dashboard;
use crate::validation::Validator;
pub use conrub_contracts::RunConfig;
use conrub_contracts::{EpochSummary, MetricsLine, Policy, StepMetrics, ValidationLine};

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

/// Where a checkpoint for `step` goes: `output_dir/checkpoint-{step}` (the HF export) with the
/// training state in its `training_state/` subdirectory. It is written as `checkpoint-{step}.tmp`
/// and renamed when complete.
pub fn checkpoint_dir(output_dir: &Path, step: u64) -> PathBuf {
    output_dir.join(format!("checkpoint-{step:06}"))
}

/// The record of the best validated checkpoint, `output_dir/best-checkpoint.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BestCheckpoint {
    /// Steps completed by the checkpoint.
    pub step: u64,
    /// Its directory.
    pub checkpoint: PathBuf,
    /// The grader's mean score of the validation round after that step.
    pub grader_score: f64,
    /// Its bootstrap standard deviation.
    pub grader_score_std: f64,
    /// The grader's id.
    pub grader: String,
    /// The training judge's score of the same responses.
    pub training_score: Option<f64>,
}

/// The best-checkpoint record's path in `output_dir`.
pub fn best_checkpoint_path(output_dir: &Path) -> PathBuf {
    output_dir.join("best-checkpoint.json")
}

impl BestCheckpoint {
    fn of(line: &ValidationLine, output_dir: &Path) -> Option<Self> {
        Some(Self {
            step: line.step,
            checkpoint: checkpoint_dir(output_dir, line.step),
            grader_score: line.grader.score?,
            grader_score_std: line.grader.score_std.unwrap_or(0.0),
            grader: line.grader.judge.clone(),
            training_score: line.training.score,
        })
    }

    /// The best of the validation rounds `evals` of steps up to `up_to`, as training decides
    /// it: the highest grader score, the earliest step among equal ones (a later round must beat
    /// it); rounds the grader left unscored do not count.
    fn best_of(evals: &[ValidationLine], up_to: u64, output_dir: &Path) -> Option<Self> {
        let mut rounds: Vec<&ValidationLine> = evals.iter().filter(|l| l.step <= up_to).collect();
        rounds.sort_by_key(|l| l.step);
        let mut best: Option<Self> = None;
        for b in rounds.into_iter().filter_map(|l| Self::of(l, output_dir)) {
            if best
                .as_ref()
                .is_none_or(|s| b.grader_score > s.grader_score)
            {
                best = Some(b);
            }
        }
        best
    }

    /// The record a run starts with, made the content of `best-checkpoint.json` (written
    /// atomically, or removed when there is none). A fresh run (`resume_step` `None`) has none.
    /// A run resumed after `resume_step` steps derives it from the validation rounds of
    /// `metrics.jsonl` it keeps (`evals`; rounds after `resume_step` are dropped here too): the
    /// file left by the earlier attempt is not trusted, since it may name a round of the steps
    /// the resumed run does again, and forget the best round before it.
    fn resume(
        output_dir: &Path,
        resume_step: Option<u64>,
        evals: &[ValidationLine],
    ) -> Result<Option<Self>> {
        let best = resume_step.and_then(|step| Self::best_of(evals, step, output_dir));
        let path = best_checkpoint_path(output_dir);
        match &best {
            Some(b) => b.write(output_dir)?,
            None if path.exists() => {
                std::fs::remove_file(&path).map_err(|e| GrpoError::io(&path, e))?
            }
            None => {}
        }
        Ok(best)
    }

    fn write(&self, output_dir: &Path) -> Result<()> {
        let path = best_checkpoint_path(output_dir);
        let text = serde_json::to_string_pretty(self).expect("record serialises");
        conrub_rubric::io::write_bytes_atomic(&path, text.as_bytes())
            .map_err(|e| GrpoError::io(&path, e))
    }
}

/// The steps of the checkpoints in `existing` that pruning to `keep` removes right after the
/// checkpoint of step `just_written` was written, in ascending order. That one stays, and so does
/// the one of `best`; of the earlier ones the newest `keep - 1` stay (the best counts among them
/// when it is one of them); every later one goes: it was left by an earlier attempt at the steps
/// a resumed run does again, and is no part of this run's history.
fn checkpoints_to_prune(
    existing: &[u64],
    just_written: u64,
    best: Option<u64>,
    keep: usize,
) -> Vec<u64> {
    let mut earlier: Vec<u64> = existing
        .iter()
        .copied()
        .filter(|&s| s < just_written)
        .collect();
    earlier.sort_unstable();
    earlier.dedup();
    let old = earlier.len().saturating_sub(keep.saturating_sub(1));
    let mut prune = earlier[..old].to_vec();
    prune.extend(existing.iter().copied().filter(|&s| s > just_written));
    prune.retain(|&s| Some(s) != best);
    prune.sort_unstable();
    prune.dedup();
    prune
}

/// Prunes the checkpoints of `output_dir` to `keep` right after the one of step `just_written`
/// was written, never removing that one nor the one of `best_step` (see
/// [`checkpoints_to_prune`]).
fn prune_checkpoints(
    output_dir: &Path,
    keep: usize,
    just_written: u64,
    best_step: Option<u64>,
) -> Result<()> {
    let found = crate::run_folder::checkpoints(output_dir)?;
    let steps: Vec<u64> = found.iter().map(|(step, _)| *step).collect();
    let prune = checkpoints_to_prune(&steps, just_written, best_step, keep);
    for (step, dir) in &found {
        if prune.binary_search(step).is_ok() {
            std::fs::remove_dir_all(dir).map_err(|e| GrpoError::io(dir, e))?;
        }
    }
    Ok(())
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

/// What the training loop asks of its caller.
pub trait RunHooks<P> {
    /// Writes `policy` in its deployable format into `dir` (a Hugging Face directory for the `conrub_models` families);
    /// the training state goes into `dir/training_state` next to it.
    fn export(&mut self, policy: &P, dir: &Path) -> Result<()>;
    /// The dtype [`RunHooks::export`] writes weight matrices in, when narrower than the
    /// policy's (see `conrub_contracts::Export::matrix_dtype`); `None` by default.
    fn export_dtype(&self) -> Option<DType> {
        None
    }
    /// Called with the progress line after every step.
    fn progress(&mut self, _line: &str) {}
    /// Lines written to `metrics.jsonl` once it is opened, before the first step (the binary's
    /// kernel warm-up line).
    fn opening_lines(&mut self) -> Vec<MetricsLine> {
        Vec::new()
    }
    /// Called after every checkpoint (the periodic ones and the last) with the run directory,
    /// whose `metrics.jsonl` is complete up to that step: where `conrub train` draws its curves.
    /// With `run.checkpoint_in_background` it comes once the checkpoint is in place: at the
    /// first step boundary after its seal is done (or at the next save, or the run's end).
    fn checkpointed(&mut self, _run_dir: &Path, _checkpoint: &Path) -> Result<()> {
        Ok(())
    }
}

/// What [`train`] drives: one [`Learner`], or a [`DataParallel`] group of them.
pub trait Trainee<B, P, T = RubricRecord>
where
    B: AutodiffBackend,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
    T: TaskPrompt,
{
    /// The learner whose step, settings and state the run reads (rank 0 of a group; every rank
    /// holds the same but in a sharded group: its policy then comes from
    /// [`Trainee::whole_policy`]).
    fn lead(&self) -> &Learner<B, P, T>;

    /// One training step on `records`, drawing from `reserve` under dynamic sampling
    /// ([`Learner::step_with_reserve`]).
    fn train_step<'a>(
        &'a mut self,
        records: &'a [&'a T],
        reserve: &'a [&'a T],
    ) -> impl Future<Output = Result<StepOutput>> + 'a;

    /// Loads a saved training state (into every learner of a group).
    fn load(&mut self, dir: &Path) -> Result<TrainingState>;

    /// Sets the run's length in training steps, which the learning-rate schedule counts from
    /// (every learner of a group; [`Learner::set_training_steps`]).
    fn set_training_steps(&mut self, steps: u64) -> Result<()>;

    /// Checks made before every checkpoint (a group: the replicas still agree).
    fn verify(&self) -> Result<()> {
        Ok(())
    }

    /// The whole policy, for exports and validation: a learner's own, or a
    /// `sharding = "full"` group's assembled from its ranks, weight matrices in `matrices`
    /// when set (see [`DataParallel::whole_policy`]).
    fn whole_policy(&self, matrices: Option<DType>) -> Result<Cow<'_, P>>;

    /// Writes the training state's files for `dir` ([`crate::write_state`]; a sharded group
    /// writes every rank's part of the optimizer state, and a `full` group every rank's
    /// parameters); the caller seals the draft ([`StateDraft::seal`]).
    fn save(&self, data_cursor: serde_json::Value, dir: &Path) -> Result<StateDraft> {
        crate::checkpoint::write_state(self.lead(), data_cursor, dir)
    }
}

impl<B, P, T> Trainee<B, P, T> for Learner<B, P, T>
where
    B: AutodiffBackend + conrub_kernels::GrpoOps,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
    T: TaskPrompt,
{
    fn lead(&self) -> &Learner<B, P, T> {
        self
    }

    fn train_step<'a>(
        &'a mut self,
        records: &'a [&'a T],
        reserve: &'a [&'a T],
    ) -> impl Future<Output = Result<StepOutput>> + 'a {
        self.step_with_reserve(records, reserve)
    }

    fn load(&mut self, dir: &Path) -> Result<TrainingState> {
        load_state(self, dir)
    }

    fn set_training_steps(&mut self, steps: u64) -> Result<()> {
        Learner::set_training_steps(self, steps)
    }

    fn whole_policy(&self, _matrices: Option<DType>) -> Result<Cow<'_, P>> {
        Ok(Cow::Borrowed(&self.policy))
    }
}

impl<B, P, T> Trainee<B, P, T> for DataParallel<B, P, T>
where
    B: AutodiffBackend + conrub_kernels::GrpoOps,
    P: Policy<B> + AutodiffModule<B> + Send,
    P::InnerModule: Policy<B::InnerBackend>,
    T: TaskPrompt,
{
    fn lead(&self) -> &Learner<B, P, T> {
        self.learner()
    }

    fn train_step<'a>(
        &'a mut self,
        records: &'a [&'a T],
        reserve: &'a [&'a T],
    ) -> impl Future<Output = Result<StepOutput>> + 'a {
        self.step_with_reserve(records, reserve)
    }

    fn load(&mut self, dir: &Path) -> Result<TrainingState> {
        self.load_state(dir)
    }

    fn set_training_steps(&mut self, steps: u64) -> Result<()> {
        DataParallel::set_training_steps(self, steps)
    }

    fn verify(&self) -> Result<()> {
        self.check_replicas()
    }

    fn whole_policy(&self, matrices: Option<DType>) -> Result<Cow<'_, P>> {
        DataParallel::whole_policy(self, matrices)
    }

    fn save(&self, data_cursor: serde_json::Value, dir: &Path) -> Result<StateDraft> {
        crate::checkpoint::write_group_state(self.learners(), data_cursor, dir)
    }
}

/// A checkpoint written but not yet in place: what its sealing needs, owned (it runs on a
/// thread of its own).
struct Seal {
    draft: StateDraft,
    tmp: PathBuf,
    dir: PathBuf,
    output_dir: PathBuf,
    keep: Option<usize>,
    step: u64,
    best: Option<BestCheckpoint>,
    written_secs: f64,
}

impl Seal {
    /// Makes the checkpoint durable and puts it in place: the training state sealed (hashed,
    /// flushed, swapped in), the folder renamed from `.tmp`, older checkpoints pruned, the best
    /// checkpoint's record written. Returns the checkpoint's folder.
    fn run(self) -> Result<PathBuf> {
        let t0 = Instant::now();
        if let Err(e) = self.draft.seal() {
            return Err(checkpoint_failed(&self.tmp, &self.dir, e));
        }
        // (An existing `dir` is a checkpoint of a run resumed from an earlier one: superseded.)
        crate::checkpoint::swap_in(&self.tmp, &self.dir)?;
        if let Some(keep) = self.keep {
            let best = self.best.as_ref().map(|b| b.step);
            prune_checkpoints(&self.output_dir, keep, self.step, best)?;
        }
        if let Some(b) = self.best.as_ref().filter(|b| b.step == self.step) {
            b.write(&self.output_dir)?;
        }
        tracing::info!(
            "{}: written in {:.1} s, made durable in {:.1} s{}",
            self.dir.display(),
            self.written_secs,
            t0.elapsed().as_secs_f64(),
            if std::thread::current().name() == Some(SEAL_THREAD) {
                " on a background thread"
            } else {
                ""
            }
        );
        Ok(self.dir)
    }
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

/// The name of the thread that seals checkpoints.
const SEAL_THREAD: &str = "conrub-checkpoint-seal";

/// The checkpoint being sealed, if any (`run.checkpoint_in_background`: on its own thread,
/// while the next steps train). Dropping it waits for the seal: a run that stops on an error
/// still leaves its last checkpoint whole.
#[derive(Default)]
struct Sealing {
    thread: Option<std::thread::JoinHandle<Result<PathBuf>>>,
    done: Option<Result<PathBuf>>,
}

impl Sealing {
    /// Seals `seal`: on a thread of its own when `background` (or when the thread cannot be
    /// started, here).
    fn start(&mut self, seal: Seal, background: bool) {
        debug_assert!(self.thread.is_none() && self.done.is_none());
        if !background {
            self.done = Some(seal.run());
            return;
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name(SEAL_THREAD.into())
            .spawn(move || {
                let seal: Seal = rx.recv().expect("the seal is sent");
                seal.run()
            });
        match spawned {
            Ok(handle) => {
                tx.send(seal).expect("the thread waits for the seal");
                self.thread = Some(handle);
            }
            Err(_) => self.done = Some(seal.run()),
        }
    }

    /// Waits for the seal in flight, if any; once it is in place, tells the hooks and records
    /// it as the run's last checkpoint.
    fn finish<P>(
        &mut self,
        hooks: &mut dyn RunHooks<P>,
        output_dir: &Path,
        summary: &mut RunSummary,
    ) -> Result<()> {
        let outcome = match (self.thread.take(), self.done.take()) {
            (Some(handle), _) => handle.join().unwrap_or_else(|_| {
                Err(GrpoError::Stage(
                    "the checkpoint seal thread panicked".into(),
                ))
            }),
            (None, Some(done)) => done,
            (None, None) => return Ok(()),
        };
        let dir = outcome?;
        hooks.checkpointed(output_dir, &dir)?;
        summary.last_checkpoint = Some(dir);
        Ok(())
    }
}

impl Sealing {
    /// [`finish`](Self::finish) once the seal in flight is done, without waiting for it: a
    /// failed seal stops the run at the next step, not at the next save, and the hooks hear of a
    /// checkpoint soon after it is in place.
    fn poll<P>(
        &mut self,
        hooks: &mut dyn RunHooks<P>,
        output_dir: &Path,
        summary: &mut RunSummary,
    ) -> Result<()> {
        match &self.thread {
            Some(handle) if !handle.is_finished() => Ok(()),
            _ => self.finish(hooks, output_dir, summary),
        }
    }
}

impl Drop for Sealing {
    /// A run that stops on an error still leaves its last checkpoint whole (or says why not).
    fn drop(&mut self) {
        if let Some(handle) = self.thread.take() {
            match handle.join() {
                Ok(Err(e)) => tracing::error!("{e}"),
                Err(_) => tracing::error!("the checkpoint seal thread panicked"),
                Ok(Ok(_)) => {}
            }
        }
    }
}

/// A checkpoint that could not be written or sealed: its partial copy (a full disk, say) is
/// removed, not left filling the disk.
fn checkpoint_failed(tmp: &Path, dir: &Path, e: GrpoError) -> GrpoError {
    let _ = std::fs::remove_dir_all(tmp);
    GrpoError::io(
        dir,
        format!(
            "writing the checkpoint failed and its partial copy was removed (is the disk full?): {e}"
        ),
    )
}

/// Runs training (the run folder `run.output_dir` locked for the whole run, see
/// [`crate::run_folder::claim`]): epochs over `records` in a seeded order, `run.prompts_per_step` prompts a step,
/// metrics after every step, checkpoints every `run.checkpoint_every` steps and at the
/// end. `resume` is a checkpoint directory (or its `training_state`).
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
    B: AutodiffBackend + conrub_kernels::GrpoOps,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
    T: TaskPrompt,
    Tr: Trainee<B, P, T>,
{
    if records.is_empty() {
        return Err(GrpoError::NoRecords);
    }
    run.validate()?;
    if run.prompts_per_step > records.len() {
        tracing::warn!(
            "run.prompts_per_step = {} but there are {} records: each step takes all of them",
            run.prompts_per_step,
            records.len()
        );
    }
    let resume_step = match resume {
        Some(dir) => {
            let state_dir = if dir.join("training_state").is_dir() {
                dir.join("training_state")
            } else {
                dir.to_path_buf()
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
            // Dynamic sampling's cursor: prompts drawn so far (a state without one drew
            // `prompts_per_step` a step).
            let drawn = state.data_cursor["prompts_drawn"].as_u64();
            Some((state.step, drawn))
        }
        None => None,
    };
    let drawn = std::cell::Cell::new(match resume_step {
        Some((step, drawn)) => drawn.unwrap_or(step * run.prompts_per_step as u64),
        None => 0,
    });
    let resume_step = resume_step.map(|(step, _)| step);
    let dynamic = trainee.lead().cfg.dynamic_sampling;
    // The folder is this run's until it returns (`run.lock`); a fresh run never starts over an
    // earlier one unless told to overwrite it.
    let earlier = match (run.overwrite, run.set_aside) {
        (true, _) => EarlierRun::Delete,
        (false, true) => EarlierRun::SetAside,
        (false, false) => EarlierRun::Refuse,
    };
    let _lock = crate::run_folder::claim(&run.output_dir, resume.is_some(), earlier)?;
    if let Some(step) = resume_step {
        // Checkpoints past the resumed step are an earlier, longer attempt's.
        if let Some(aside) = set_aside_later_checkpoints(&run.output_dir, step)? {
            tracing::warn!(
                "checkpoints after step {step}, left by an earlier attempt, moved to {}",
                aside.display()
            );
        }
    }
    let steps_per_epoch = records.len().div_ceil(run.prompts_per_step) as u64;
    let mut total = steps_per_epoch * run.epochs as u64;
    if let Some(m) = run.max_steps {
        total = total.min(m);
    }
    trainee.set_training_steps(total)?;
    if let Some(step) = resume_step {
        remove_samples_after(&run.output_dir, step)?;
    }
    let log = MetricsLog::open(
        &run.output_dir.join("metrics.jsonl"),
        resume_step,
        steps_per_epoch,
        total,
    )?;
    let mut board = run
        .tensorboard
        .then(|| Dashboard::open(&run.output_dir, resume_step))
        .transpose()?;
    for line in hooks.opening_lines() {
        log.append(&line)?;
    }
    let mut summary = RunSummary {
        best: BestCheckpoint::resume(&run.output_dir, resume_step, &log.evals()?)?,
        ..Default::default()
    };
    let mut history: Vec<StepMetrics> = log.steps()?;
    let started = Instant::now();
    let ids_digest = prompt_ids_digest(records);
    // The checkpoint being sealed (hashed, flushed, renamed) behind the steps that follow it.
    let mut sealing = Sealing::default();
    // A new best (`pending`) waits for its step's checkpoint: it becomes the record once that
    // checkpoint is in place.
    let save = |trainee: &Tr,
                hooks: &mut dyn RunHooks<P>,
                summary: &mut RunSummary,
                pending: &mut Option<BestCheckpoint>,
                sealing: &mut Sealing|
     -> Result<()> {
        // One checkpoint in flight: the previous one is in place before this one is written.
        sealing.finish(hooks, &run.output_dir, summary)?;
        summary.best = pending.take().or(summary.best.take());
        trainee.verify()?;
        let learner = trainee.lead();
        let dir = checkpoint_dir(&run.output_dir, learner.step);
        // Written whole under `.tmp`, then renamed: a kill leaves no partial checkpoint.
        let tmp = dir.with_extension("tmp");
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(|e| GrpoError::io(&tmp, e))?;
        }
        let mut cursor = serde_json::json!({
            "step": learner.step,
            "steps_per_epoch": steps_per_epoch,
            "records": records.len(),
            "prompt_ids": ids_digest,
        });
        if dynamic {
            cursor["prompts_drawn"] = drawn.get().into();
        }
        let t0 = Instant::now();
        // The export's whole policy is let go before the state is written.
        let written = trainee
            .whole_policy(hooks.export_dtype())
            .and_then(|policy| hooks.export(&policy, &tmp))
            .and_then(|_| trainee.save(cursor, &tmp.join("training_state")));
        let draft = match written {
            Ok(draft) => draft,
            Err(e) => return Err(checkpoint_failed(&tmp, &dir, e)),
        };
        let seal = Seal {
            draft,
            tmp,
            dir,
            output_dir: run.output_dir.clone(),
            keep: run.keep_checkpoints,
            step: learner.step,
            best: summary.best.clone(),
            written_secs: t0.elapsed().as_secs_f64(),
        };
        sealing.start(seal, run.checkpoint_in_background);
        if !run.checkpoint_in_background {
            sealing.finish(hooks, &run.output_dir, summary)?;
        }
        Ok(())
    };
    let mut pending_best: Option<BestCheckpoint> = None;
    while trainee.lead().step < total {
        sealing.poll(hooks, &run.output_dir, &mut summary)?;
        let step = trainee.lead().step;
        let epoch = (step / steps_per_epoch) as usize;
        let index = (step % steps_per_epoch) as usize;
        let seed = trainee.lead().cfg.seed;
        let pps = run.prompts_per_step;
        let (batch, reserve): (Vec<&T>, Vec<&T>) = if dynamic {
            // A flat cursor over the epochs' orders: a step may draw into the next epoch.
            let rounds = trainee.lead().cfg.dynamic_sampling_rounds;
            let at = drawn_records(records, seed, drawn.get(), pps * (1 + rounds));
            (at[..pps].to_vec(), at[pps..].to_vec())
        } else {
            let order = epoch_order(records.len(), seed, epoch);
            let batch = order
                .iter()
                .skip(index * pps)
                .take(pps)
                .map(|&i| &records[i])
                .collect();
            (batch, Vec::new())
        };
        let before = conrub_kernels::events::snapshot();
        let out = trainee.train_step(&batch, &reserve).await?;
        if dynamic {
            let extra = out.metrics.dynamic_prompts_drawn.unwrap_or(0);
            drawn.set(drawn.get() + (batch.len() + extra) as u64);
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
        // The step's samples are in place before its metrics line.
        let samples = out.samples(&trained, run.sample_groups);
        if run.sample_groups > 0 {
            let path = step_samples_path(&run.output_dir, out.metrics.step);
            write_samples(&path, &samples)?;
        }
        if let Some(board) = &mut board {
            board.step_details(&out, samples.first())?;
        }
        let mut m = out.metrics;
        m.kernels = before
            .zip(conrub_kernels::events::snapshot())
            .map(|(a, b)| b.since(&a));
        let step = trainee.lead().step;
        let line = MetricsLine::Step {
            epoch,
            metrics: Box::new(m.clone()),
        };
        log.append(&line)?;
        if let Some(board) = &mut board {
            board.line(&line, step)?;
        }
        history.push(m.clone());
        summary.steps_run += 1;
        let per_step = started.elapsed().as_secs_f64() / summary.steps_run as f64;
        hooks.progress(&progress_line(&m, total, per_step));
        if index as u64 + 1 == steps_per_epoch || step == total {
            let first = epoch as u64 * steps_per_epoch;
            let steps: Vec<StepMetrics> = history
                .iter()
                .filter(|s| s.step >= first && s.step < first + steps_per_epoch)
                .cloned()
                .collect();
            let e = EpochSummary::from_steps(epoch, &steps);
            let line = MetricsLine::Epoch(e.clone());
            log.append(&line)?;
            if let Some(board) = &mut board {
                board.line(&line, step)?;
            }
            summary.epochs.push(e);
        }
        if let Some(v) = validator.filter(|v| v.due(step)) {
            let before = conrub_kernels::events::snapshot();
            let lead = trainee.lead();
            let policy = trainee.whole_policy(lead.policy().matrix_dtype())?;
            let (mut line, answers) = v.validate_round(lead, &policy.valid()).await?;
            drop(policy);
            write_samples(&eval_samples_path(&run.output_dir, step), &answers)?;
            line.kernels = before
                .zip(conrub_kernels::events::snapshot())
                .map(|(a, b)| b.since(&a));
            let eval = MetricsLine::Eval(line.clone());
            log.append(&eval)?;
            if let Some(board) = &mut board {
                board.line(&eval, step)?;
            }
            hooks.progress(&validation_progress_line(&line));
            let best = summary.best.as_ref().map(|b| b.grader_score);
            pending_best = BestCheckpoint::of(&line, &run.output_dir)
                .filter(|b| best.is_none_or(|s| b.grader_score > s));
        }
        let periodic = run.checkpoint_every > 0 && step.is_multiple_of(run.checkpoint_every);
        if step < total && (periodic || pending_best.is_some()) {
            save(
                trainee,
                hooks,
                &mut summary,
                &mut pending_best,
                &mut sealing,
            )?;
        }
    }
    if summary.steps_run > 0 || summary.last_checkpoint.is_none() {
        save(
            trainee,
            hooks,
            &mut summary,
            &mut pending_best,
            &mut sealing,
        )?;
    }
    sealing.finish(hooks, &run.output_dir, &mut summary)?;
    summary.total_steps = trainee.lead().step;
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;
    use conrub_contracts::JudgeScore;

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

    /// A validation round after `step` whose grader scored `score`.
    fn round(step: u64, score: Option<f64>) -> ValidationLine {
        ValidationLine {
            step,
            grader: JudgeScore {
                judge: "grader".into(),
                score,
                score_std: score.map(|_| 0.125),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    struct NoHooks(Vec<PathBuf>);

    impl RunHooks<()> for NoHooks {
        fn export(&mut self, _: &(), _: &Path) -> Result<()> {
            Ok(())
        }
        fn checkpointed(&mut self, _: &Path, checkpoint: &Path) -> Result<()> {
            self.0.push(checkpoint.to_path_buf());
            Ok(())
        }
    }

    /// A checkpoint of step 3 written into `out` (its state's files in `.tmp` folders), and the
    /// seal that finishes it.
    fn written(out: &Path) -> Seal {
        let tmp = out.join("checkpoint-000003.tmp");
        let state = tmp.join("training_state.tmp");
        std::fs::create_dir_all(&state).unwrap();
        std::fs::write(state.join("state.json"), b"{}").unwrap();
        std::fs::write(tmp.join("model.safetensors"), b"weights").unwrap();
        Seal {
            draft: StateDraft::of_files(state, tmp.join("training_state")),
            tmp,
            dir: out.join("checkpoint-000003"),
            output_dir: out.to_path_buf(),
            keep: None,
            step: 3,
            best: None,
            written_secs: 0.0,
        }
    }

    /// In the background the save returns with the seal on its own thread; finishing it puts
    /// the checkpoint in place (manifest with the state's digests, no `.tmp` left), tells the
    /// hooks and records it; in the foreground it is in place at once. A seal that fails
    /// removes its partial copy and is the run's error.
    #[test]
    fn checkpoints_are_sealed_behind_the_next_steps() {
        for background in [true, false] {
            let out = tempfile::tempdir().unwrap();
            let mut sealing = Sealing::default();
            sealing.start(written(out.path()), background);
            assert_eq!(sealing.thread.is_some(), background);
            let mut hooks = NoHooks(vec![]);
            let mut summary = RunSummary::default();
            sealing
                .finish(&mut hooks, out.path(), &mut summary)
                .unwrap();
            let dir = out.path().join("checkpoint-000003");
            assert_eq!(hooks.0, std::slice::from_ref(&dir));
            assert_eq!(summary.last_checkpoint.as_ref(), Some(&dir));
            let manifest =
                std::fs::read_to_string(dir.join("training_state/manifest.json")).unwrap();
            assert!(manifest.contains("state.json"), "{manifest}");
            assert!(dir.join("model.safetensors").is_file());
            assert_eq!(checkpoints(out.path()), ["checkpoint-000003"]);
            // Nothing in flight: finishing again does nothing.
            sealing
                .finish(&mut hooks, out.path(), &mut summary)
                .unwrap();
            assert_eq!(hooks.0.len(), 1);
        }
        let out = tempfile::tempdir().unwrap();
        let seal = written(out.path());
        std::fs::remove_dir_all(&seal.draft.tmp).unwrap();
        let mut sealing = Sealing::default();
        sealing.start(seal, true);
        let mut summary = RunSummary::default();
        let e = sealing
            .finish(&mut NoHooks(vec![]), out.path(), &mut summary)
            .unwrap_err();
        assert!(e.to_string().contains("partial copy was removed"), "{e}");
        assert!(checkpoints(out.path()).is_empty());
        assert!(summary.last_checkpoint.is_none());
    }

    fn checkpoints(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.starts_with("checkpoint-"))
            .collect();
        names.sort();
        names
    }

    /// A run resumed from step 10 in a directory that still holds the checkpoints of steps 12
    /// and 14 of a longer attempt: the checkpoint it writes next (step 11, or step 12 again) is
    /// never pruned, and the later leftovers go (but the best one).
    #[test]
    fn pruning_keeps_the_checkpoint_just_written_below_leftovers() {
        assert_eq!(
            checkpoints_to_prune(&[10, 11, 12, 14], 11, None, 1),
            [10, 12, 14]
        );
        assert_eq!(
            checkpoints_to_prune(&[10, 11, 12, 14], 11, None, 2),
            [12, 14]
        );
        assert_eq!(checkpoints_to_prune(&[10, 12, 14], 12, None, 1), [10, 14]);
        assert_eq!(checkpoints_to_prune(&[10, 12, 14], 12, Some(10), 1), [14]);
        assert!(checkpoints_to_prune(&[10, 12, 14], 12, Some(14), 3).is_empty());
        // Without leftovers: the newest `keep` counting the one just written, plus the best.
        assert_eq!(checkpoints_to_prune(&[2, 4, 6, 8], 8, Some(2), 2), [4]);
        assert_eq!(checkpoints_to_prune(&[2, 4, 6, 8], 8, Some(6), 2), [2, 4]);
        assert!(checkpoints_to_prune(&[2, 4, 6, 8], 8, None, 4).is_empty());

        let dir = tempfile::tempdir().unwrap();
        for step in [10, 11, 12, 14] {
            std::fs::create_dir_all(checkpoint_dir(dir.path(), step)).unwrap();
        }
        // A temporary directory and other files are no checkpoints.
        std::fs::create_dir_all(checkpoint_dir(dir.path(), 13).with_extension("tmp")).unwrap();
        std::fs::write(dir.path().join("metrics.jsonl"), "").unwrap();
        prune_checkpoints(dir.path(), 1, 11, None).unwrap();
        assert_eq!(
            checkpoints(dir.path()),
            ["checkpoint-000011", "checkpoint-000013.tmp"]
        );
        assert!(dir.path().join("metrics.jsonl").exists());
    }

    #[test]
    fn keep_checkpoints_zero_is_an_error_naming_the_field() {
        let run = |keep_checkpoints: Option<usize>| RunConfig {
            keep_checkpoints,
            ..Default::default()
        };
        let e = run(Some(0)).validate().unwrap_err().to_string();
        assert!(
            e.starts_with("run.keep_checkpoints: must be at least 1"),
            "{e}"
        );
        run(Some(1)).validate().unwrap();
        run(None).validate().unwrap();
        let e = RunConfig {
            prompts_per_step: 0,
            ..Default::default()
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert_eq!(e, "run.prompts_per_step: must be at least 1");
    }

    /// The best round is the highest grader score, the earliest of equal ones; unscored rounds
    /// and rounds after the resumed step do not count.
    #[test]
    fn the_best_round_is_the_first_of_the_highest_scores() {
        let dir = Path::new("out");
        let evals = [
            round(6, Some(0.75)),
            round(2, Some(0.25)),
            round(4, Some(0.75)),
            round(8, None),
            round(10, Some(1.0)),
        ];
        let best = BestCheckpoint::best_of(&evals, 9, dir).unwrap();
        assert_eq!((best.step, best.grader_score), (4, 0.75));
        assert_eq!(best.checkpoint, checkpoint_dir(dir, 4));
        assert_eq!(
            (best.grader_score_std, best.grader.as_str()),
            (0.125, "grader")
        );
        assert_eq!(BestCheckpoint::best_of(&evals, 10, dir).unwrap().step, 10);
        assert_eq!(BestCheckpoint::best_of(&evals, 3, dir).unwrap().step, 2);
        assert!(BestCheckpoint::best_of(&evals, 1, dir).is_none());
        assert!(BestCheckpoint::best_of(&[round(2, None)], 9, dir).is_none());
    }

    /// Rounds after steps 2, 4 and 6 scored 0.25, 0.5 and 1 recorded step 6 as the best; a resume
    /// from step 5 re-derives the best from the rounds the metrics file keeps (step 4) and
    /// rewrites the record; a resume before any scored round removes it, and so does a fresh
    /// run.
    #[test]
    fn a_resume_below_the_recorded_best_rederives_it_from_the_kept_rounds() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path();
        let metrics = out.join("metrics.jsonl");
        let log = MetricsLog::open(&metrics, None, 1, 10).unwrap();
        for (step, score) in [(1, None), (2, Some(0.25)), (4, Some(0.5)), (6, Some(1.0))] {
            log.append(&MetricsLine::Eval(round(step, score))).unwrap();
        }
        let record = |out: &Path| -> Option<BestCheckpoint> {
            let text = std::fs::read_to_string(best_checkpoint_path(out)).ok()?;
            Some(serde_json::from_str(&text).unwrap())
        };
        let stale = BestCheckpoint::of(&round(6, Some(1.0)), out).unwrap();
        stale.write(out).unwrap();
        assert_eq!(record(out), Some(stale.clone()));

        // Resumed at step 6 itself: the record stands.
        let evals = MetricsLog::open(&metrics, Some(6), 1, 10)
            .unwrap()
            .evals()
            .unwrap();
        let best = BestCheckpoint::resume(out, Some(6), &evals).unwrap();
        assert_eq!(best, Some(stale));

        // Resumed at step 5: the round of step 6 is dropped, the best is step 4's.
        let evals = MetricsLog::open(&metrics, Some(5), 1, 10)
            .unwrap()
            .evals()
            .unwrap();
        assert_eq!(evals.iter().map(|e| e.step).collect::<Vec<_>>(), [1, 2, 4]);
        let best = BestCheckpoint::resume(out, Some(5), &evals)
            .unwrap()
            .unwrap();
        assert_eq!((best.step, best.grader_score), (4, 0.5));
        assert_eq!(best.checkpoint, checkpoint_dir(out, 4));
        assert_eq!(record(out), Some(best));

        // Resumed at step 1: the only kept round is unscored, so there is no best.
        let evals = MetricsLog::open(&metrics, Some(1), 1, 10)
            .unwrap()
            .evals()
            .unwrap();
        assert_eq!(evals.len(), 1);
        assert_eq!(BestCheckpoint::resume(out, Some(1), &evals).unwrap(), None);
        assert_eq!(record(out), None);
        assert!(!best_checkpoint_path(out).exists());

        // A fresh run starts without a record.
        let stale = BestCheckpoint::of(&round(2, Some(0.25)), out).unwrap();
        stale.write(out).unwrap();
        let evals = [round(2, Some(0.25))];
        assert_eq!(BestCheckpoint::resume(out, None, &evals).unwrap(), None);
        assert!(!best_checkpoint_path(out).exists());
    }
}
