//! The run's checkpoints: where they go, the best one by the validation grader, pruning, and the
//! seal that makes one durable and puts it in place (on a thread of its own behind the next
//! steps with `run.checkpoint_in_background`). What a checkpoint holds is the policy's export
//! and the learner's state (`conrub_grpo::write_state`); writing them is the loop's
//! [`RunLoop::checkpoint`](crate::run_loop) step.

use std::path::{Path, PathBuf};
use std::time::Instant;

use conrub_contracts::ValidationLine;
use conrub_grpo::StateDraft;
use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainerError};
use crate::hooks::RunHooks;
use crate::run_folder::best_checkpoint_path;

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

impl BestCheckpoint {
    pub(crate) fn of(line: &ValidationLine, output_dir: &Path) -> Option<Self> {
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
    pub(crate) fn resume(
        output_dir: &Path,
        resume_step: Option<u64>,
        evals: &[ValidationLine],
    ) -> Result<Option<Self>> {
        let best = resume_step.and_then(|step| Self::best_of(evals, step, output_dir));
        let path = best_checkpoint_path(output_dir);
        match &best {
            Some(b) => b.write(output_dir)?,
            None if path.exists() => {
                std::fs::remove_file(&path).map_err(|e| TrainerError::io(&path, e))?
            }
            None => {}
        }
        Ok(best)
    }

    fn write(&self, output_dir: &Path) -> Result<()> {
        let path = best_checkpoint_path(output_dir);
        let text = serde_json::to_string_pretty(self).expect("record serialises");
        conrub_rubric::io::write_bytes_atomic(&path, text.as_bytes())
            .map_err(|e| TrainerError::io(&path, e))
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
            std::fs::remove_dir_all(dir).map_err(|e| TrainerError::io(dir, e))?;
        }
    }
    Ok(())
}

/// A checkpoint written but not yet in place: what its sealing needs, owned (it runs on a
/// thread of its own).
pub(crate) struct Seal {
    pub(crate) draft: StateDraft,
    pub(crate) tmp: PathBuf,
    pub(crate) dir: PathBuf,
    pub(crate) output_dir: PathBuf,
    pub(crate) keep: Option<usize>,
    pub(crate) step: u64,
    pub(crate) best: Option<BestCheckpoint>,
    pub(crate) written_secs: f64,
}

impl Seal {
    /// Makes the checkpoint durable and puts it in place: the training state sealed (hashed,
    /// flushed, swapped in), the folder renamed from `.tmp`, older checkpoints pruned, the best
    /// checkpoint's record written. Returns the checkpoint's folder.
    fn run(self) -> Result<PathBuf> {
        let t0 = Instant::now();
        if let Err(e) = self.draft.seal() {
            return Err(checkpoint_failed(&self.tmp, &self.dir, e.into()));
        }
        // (An existing `dir` is a checkpoint of a run resumed from an earlier one: superseded.)
        conrub_grpo::swap_in(&self.tmp, &self.dir)?;
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

/// The name of the thread that seals checkpoints.
const SEAL_THREAD: &str = "conrub-checkpoint-seal";

/// The checkpoint being sealed, if any (`run.checkpoint_in_background`: on its own thread,
/// while the next steps train). Dropping it waits for the seal: a run that stops on an error
/// still leaves its last checkpoint whole.
#[derive(Default)]
pub(crate) struct Sealing {
    thread: Option<std::thread::JoinHandle<Result<PathBuf>>>,
    done: Option<Result<PathBuf>>,
}

impl Sealing {
    /// Seals `seal`: on a thread of its own when `background` (or when the thread cannot be
    /// started, here).
    pub(crate) fn start(&mut self, seal: Seal, background: bool) {
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
    pub(crate) fn finish<P>(
        &mut self,
        hooks: &mut dyn RunHooks<P>,
        output_dir: &Path,
        last_checkpoint: &mut Option<PathBuf>,
    ) -> Result<()> {
        let outcome = match (self.thread.take(), self.done.take()) {
            (Some(handle), _) => handle.join().unwrap_or_else(|_| {
                Err(
                    conrub_grpo::GrpoError::Stage("the checkpoint seal thread panicked".into())
                        .into(),
                )
            }),
            (None, Some(done)) => done,
            (None, None) => return Ok(()),
        };
        let dir = outcome?;
        hooks.checkpointed(output_dir, &dir)?;
        *last_checkpoint = Some(dir);
        Ok(())
    }
}

impl Sealing {
    /// [`finish`](Self::finish) once the seal in flight is done, without waiting for it: a
    /// failed seal stops the run at the next step, not at the next save, and the hooks hear of a
    /// checkpoint soon after it is in place.
    pub(crate) fn poll<P>(
        &mut self,
        hooks: &mut dyn RunHooks<P>,
        output_dir: &Path,
        last_checkpoint: &mut Option<PathBuf>,
    ) -> Result<()> {
        match &self.thread {
            Some(handle) if !handle.is_finished() => Ok(()),
            _ => self.finish(hooks, output_dir, last_checkpoint),
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
pub(crate) fn checkpoint_failed(tmp: &Path, dir: &Path, e: TrainerError) -> TrainerError {
    let _ = std::fs::remove_dir_all(tmp);
    TrainerError::io(
        dir,
        format!(
            "writing the checkpoint failed and its partial copy was removed (is the disk full?): {e}"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::MetricsLog;
    use conrub_contracts::{JudgeScore, MetricsLine, RunConfig};

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
            let mut last = None;
            sealing.finish(&mut hooks, out.path(), &mut last).unwrap();
            let dir = out.path().join("checkpoint-000003");
            assert_eq!(hooks.0, std::slice::from_ref(&dir));
            assert_eq!(last.as_ref(), Some(&dir));
            let manifest =
                std::fs::read_to_string(dir.join("training_state/manifest.json")).unwrap();
            assert!(manifest.contains("state.json"), "{manifest}");
            assert!(dir.join("model.safetensors").is_file());
            assert_eq!(checkpoints(out.path()), ["checkpoint-000003"]);
            // Nothing in flight: finishing again does nothing.
            sealing.finish(&mut hooks, out.path(), &mut last).unwrap();
            assert_eq!(hooks.0.len(), 1);
        }
        let out = tempfile::tempdir().unwrap();
        let seal = written(out.path());
        std::fs::remove_dir_all(seal.tmp.join("training_state.tmp")).unwrap();
        let mut sealing = Sealing::default();
        sealing.start(seal, true);
        let mut last = None;
        let e = sealing
            .finish(&mut NoHooks(vec![]), out.path(), &mut last)
            .unwrap_err();
        assert!(e.to_string().contains("partial copy was removed"), "{e}");
        assert!(checkpoints(out.path()).is_empty());
        assert!(last.is_none());
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
        assert_eq!(e, "run.prompts_per_step: must be from 1 to 1048576");
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
