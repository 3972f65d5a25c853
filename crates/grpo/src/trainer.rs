//! The training loop: epochs over the rubric records in a seeded order, steps of
//! `prompts_per_step` prompts, telemetry after each step, checkpoints every N steps and at the end.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use conrub_rubric::seeded_permutation;
use conrub_rubric::RubricRecord;
use serde::{Deserialize, Serialize};

use crate::advantages::stable_seed;
use crate::checkpoint::{load_state, save_state, TrainingState};
use crate::error::{GrpoError, Result};
use crate::learner::{Learner, StepMetrics, StepOutput};
use crate::parallel::DataParallel;
use crate::policy::Policy;
use crate::telemetry::{
    progress_line, validation_progress_line, EpochSummary, MetricsLine, MetricsLog,
};
use crate::validation::{ValidationLine, Validator};

/// Loop settings (the `[run]` table of a train config).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    /// Passes over the prompts.
    pub epochs: usize,
    /// Prompts per step (32 in the published run: 32 x 8 = 256 responses).
    pub prompts_per_step: usize,
    /// Save a checkpoint every this many steps (0: only at the end).
    pub checkpoint_every: u64,
    /// Stop after this many steps in total (for smoke runs); `None` runs every epoch.
    pub max_steps: Option<u64>,
    /// Output directory: metrics, plots, checkpoints.
    pub output_dir: PathBuf,
    /// Keep only the newest this many checkpoints (and the best one by the validation grader,
    /// see `[eval]`); `None` keeps every checkpoint.
    pub keep_checkpoints: Option<usize>,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            epochs: 3,
            prompts_per_step: 32,
            checkpoint_every: 50,
            max_steps: None,
            output_dir: PathBuf::from("runs/conrub"),
            keep_checkpoints: None,
        }
    }
}

/// The order of the records in `epoch`: a permutation seeded by the run seed and the epoch.
pub fn epoch_order(n: usize, seed: u64, epoch: usize) -> Vec<usize> {
    seeded_permutation(n, stable_seed(seed, &format!("epoch/{epoch}")))
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

    /// Reads the record of a run resumed after `resume_step` steps (a record of a later step
    /// belongs to steps the resumed run does again, and is dropped).
    fn read(output_dir: &Path, resume_step: Option<u64>) -> Result<Option<Self>> {
        let path = best_checkpoint_path(output_dir);
        let Some(step) = resume_step.filter(|_| path.exists()) else {
            if path.exists() {
                std::fs::remove_file(&path).map_err(|e| GrpoError::io(&path, e))?;
            }
            return Ok(None);
        };
        let text = std::fs::read_to_string(&path).map_err(|e| GrpoError::io(&path, e))?;
        let best: Self = serde_json::from_str(&text).map_err(|e| GrpoError::io(&path, e))?;
        Ok((best.step <= step).then_some(best))
    }

    fn write(&self, output_dir: &Path) -> Result<()> {
        let path = best_checkpoint_path(output_dir);
        let text = serde_json::to_string_pretty(self).expect("record serialises");
        conrub_rubric::io::write_bytes_atomic(&path, text.as_bytes())
            .map_err(|e| GrpoError::io(&path, e))
    }
}

/// Removes all but the newest `keep` checkpoints of `output_dir`, never the one of `best_step`.
fn prune_checkpoints(output_dir: &Path, keep: usize, best_step: Option<u64>) -> Result<()> {
    let entries = std::fs::read_dir(output_dir).map_err(|e| GrpoError::io(output_dir, e))?;
    let mut steps: Vec<u64> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name();
            let step = name
                .to_str()?
                .strip_prefix("checkpoint-")?
                .parse::<u64>()
                .ok()?;
            e.path().is_dir().then_some(step)
        })
        .collect();
    steps.sort_unstable();
    let old = steps.len().saturating_sub(keep);
    for &step in &steps[..old] {
        if Some(step) != best_step {
            let dir = checkpoint_dir(output_dir, step);
            std::fs::remove_dir_all(&dir).map_err(|e| GrpoError::io(&dir, e))?;
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
    /// Writes `policy` in its deployable format into `dir` (a Hugging Face directory for Qwen3);
    /// the training state goes into `dir/training_state` next to it.
    fn export(&mut self, policy: &P, dir: &Path) -> Result<()>;
    /// Called with the progress line after every step.
    fn progress(&mut self, _line: &str) {}
    /// Called after every checkpoint (the periodic ones and the last) with the run directory,
    /// whose `metrics.jsonl` is complete up to that step: where `conrub train` draws its curves.
    fn checkpointed(&mut self, _run_dir: &Path, _checkpoint: &Path) -> Result<()> {
        Ok(())
    }
}

/// What [`train`] drives: one [`Learner`], or a [`DataParallel`] group of them.
pub trait Trainee<B, P>
where
    B: AutodiffBackend,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
{
    /// The learner whose policy and state a checkpoint saves (rank 0 of a group; every rank
    /// holds the same).
    fn lead(&self) -> &Learner<B, P>;

    /// One training step on `records`.
    fn train_step<'a>(
        &'a mut self,
        records: &'a [&'a RubricRecord],
    ) -> impl Future<Output = Result<StepOutput>> + 'a;

    /// Loads a saved training state (into every learner of a group).
    fn load(&mut self, dir: &Path) -> Result<TrainingState>;

    /// Checks made before every checkpoint (a group: the replicas still agree).
    fn verify(&self) -> Result<()> {
        Ok(())
    }
}

impl<B, P> Trainee<B, P> for Learner<B, P>
where
    B: AutodiffBackend + conrub_kernels::GrpoOps,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
{
    fn lead(&self) -> &Learner<B, P> {
        self
    }

    fn train_step<'a>(
        &'a mut self,
        records: &'a [&'a RubricRecord],
    ) -> impl Future<Output = Result<StepOutput>> + 'a {
        self.step(records)
    }

    fn load(&mut self, dir: &Path) -> Result<TrainingState> {
        load_state(self, dir)
    }
}

impl<B, P> Trainee<B, P> for DataParallel<B, P>
where
    B: AutodiffBackend + conrub_kernels::GrpoOps,
    P: Policy<B> + AutodiffModule<B> + Send,
    P::InnerModule: Policy<B::InnerBackend>,
{
    fn lead(&self) -> &Learner<B, P> {
        self.learner()
    }

    fn train_step<'a>(
        &'a mut self,
        records: &'a [&'a RubricRecord],
    ) -> impl Future<Output = Result<StepOutput>> + 'a {
        self.step(records)
    }

    fn load(&mut self, dir: &Path) -> Result<TrainingState> {
        self.load_state(dir)
    }

    fn verify(&self) -> Result<()> {
        self.check_replicas()
    }
}

/// Runs training: epochs over `records` in a seeded order, `run.prompts_per_step` prompts a step,
/// metrics after every step, checkpoints every `run.checkpoint_every` steps and at the
/// end. `resume` is a checkpoint directory (or its `training_state`).
///
/// With a `validator`, the policy is validated whenever [`Validator::due`] says so (a
/// `kind = "eval"` line in `metrics.jsonl`); a round whose grader score beats every earlier one
/// gets a checkpoint (when its step has none already) and becomes `best-checkpoint.json`, which
/// `run.keep_checkpoints` never prunes.
pub async fn train<B, P, T>(
    trainee: &mut T,
    records: &[RubricRecord],
    run: &RunConfig,
    resume: Option<&Path>,
    validator: Option<&Validator>,
    hooks: &mut dyn RunHooks<P>,
) -> Result<RunSummary>
where
    B: AutodiffBackend + conrub_kernels::GrpoOps,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
    T: Trainee<B, P>,
{
    if records.is_empty() {
        return Err(GrpoError::NoRecords);
    }
    if run.prompts_per_step == 0 {
        return Err(GrpoError::config(
            "run.prompts_per_step",
            "must be at least 1",
        ));
    }
    let resume_step = match resume {
        Some(dir) => {
            let state_dir = if dir.join("training_state").is_dir() {
                dir.join("training_state")
            } else {
                dir.to_path_buf()
            };
            Some(trainee.load(&state_dir)?.step)
        }
        None => None,
    };
    std::fs::create_dir_all(&run.output_dir).map_err(|e| GrpoError::io(&run.output_dir, e))?;
    let steps_per_epoch = records.len().div_ceil(run.prompts_per_step) as u64;
    let mut total = steps_per_epoch * run.epochs as u64;
    if let Some(m) = run.max_steps {
        total = total.min(m);
    }
    let log = MetricsLog::open(
        &run.output_dir.join("metrics.jsonl"),
        resume_step,
        steps_per_epoch,
        total,
    )?;
    let mut summary = RunSummary {
        best: BestCheckpoint::read(&run.output_dir, resume_step)?,
        ..Default::default()
    };
    let mut history: Vec<StepMetrics> = log.steps()?;
    let started = Instant::now();
    let save = |trainee: &T, hooks: &mut dyn RunHooks<P>, summary: &mut RunSummary| -> Result<()> {
        trainee.verify()?;
        let learner = trainee.lead();
        let dir = checkpoint_dir(&run.output_dir, learner.step);
        // Written whole under `.tmp`, then renamed: a kill leaves no partial checkpoint.
        let tmp = dir.with_extension("tmp");
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(|e| GrpoError::io(&tmp, e))?;
        }
        hooks.export(&learner.policy, &tmp)?;
        let cursor =
            serde_json::json!({ "step": learner.step, "steps_per_epoch": steps_per_epoch });
        save_state(learner, cursor, &tmp.join("training_state"))?;
        // (An existing `dir` is a checkpoint of a run resumed from an earlier one: superseded.)
        crate::checkpoint::swap_in(&tmp, &dir)?;
        if let Some(keep) = run.keep_checkpoints {
            prune_checkpoints(&run.output_dir, keep, summary.best.as_ref().map(|b| b.step))?;
        }
        hooks.checkpointed(&run.output_dir, &dir)?;
        summary.last_checkpoint = Some(dir);
        Ok(())
    };
    // A new best waits for its step's checkpoint before it is recorded.
    let mut pending_best: Option<BestCheckpoint> = None;
    while trainee.lead().step < total {
        let step = trainee.lead().step;
        let epoch = (step / steps_per_epoch) as usize;
        let index = (step % steps_per_epoch) as usize;
        let order = epoch_order(records.len(), trainee.lead().cfg.seed, epoch);
        let batch: Vec<&RubricRecord> = order
            .iter()
            .skip(index * run.prompts_per_step)
            .take(run.prompts_per_step)
            .map(|&i| &records[i])
            .collect();
        let m = trainee.train_step(&batch).await?.metrics;
        let step = trainee.lead().step;
        log.append(&MetricsLine::Step {
            epoch,
            metrics: Box::new(m.clone()),
        })?;
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
            log.append(&MetricsLine::Epoch(e.clone()))?;
            summary.epochs.push(e);
        }
        if let Some(v) = validator.filter(|v| v.due(step)) {
            let line = v.validate(trainee.lead()).await?;
            log.append(&MetricsLine::Eval(line.clone()))?;
            hooks.progress(&validation_progress_line(&line));
            let best = summary.best.as_ref().map(|b| b.grader_score);
            pending_best = BestCheckpoint::of(&line, &run.output_dir)
                .filter(|b| best.is_none_or(|s| b.grader_score > s));
        }
        let periodic = run.checkpoint_every > 0 && step.is_multiple_of(run.checkpoint_every);
        if step < total && (periodic || pending_best.is_some()) {
            summary.best = pending_best.take().or(summary.best.take());
            save(trainee, hooks, &mut summary)?;
            if let Some(b) = summary.best.as_ref().filter(|b| b.step == step) {
                b.write(&run.output_dir)?;
            }
        }
    }
    if summary.steps_run > 0 || summary.last_checkpoint.is_none() {
        summary.best = pending_best.take().or(summary.best.take());
        save(trainee, hooks, &mut summary)?;
        let step = trainee.lead().step;
        if let Some(b) = summary.best.as_ref().filter(|b| b.step == step) {
            b.write(&run.output_dir)?;
        }
    }
    summary.total_steps = trainee.lead().step;
    Ok(summary)
}
