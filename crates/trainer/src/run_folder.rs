//! A run folder is owned by one run at a time: [`RunLock`] holds `run.lock` (the owner's process
//! id and host) for as long as training runs, and [`claim`] refuses to start a fresh run over an
//! earlier one unless told to overwrite it.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainerError};

/// The best-checkpoint record's path in `output_dir`.
pub fn best_checkpoint_path(output_dir: &Path) -> PathBuf {
    output_dir.join("best-checkpoint.json")
}

/// The lock file's name inside the run folder.
pub const LOCK_FILE: &str = "run.lock";

/// Who holds a run folder.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Owner {
    pid: u32,
    host: String,
}

impl Owner {
    fn this_process() -> Self {
        Self {
            pid: std::process::id(),
            host: host_name(),
        }
    }

    /// Whether the owner certainly no longer runs: on this host, with no such process.
    fn is_gone(&self) -> bool {
        self.host == host_name() && !process_runs(self.pid)
    }
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown-host".into())
}

/// Whether process `pid` exists (Linux: `/proc/PID`; elsewhere every process counts as running,
/// so a lock is never taken over there).
fn process_runs(pid: u32) -> bool {
    if cfg!(target_os = "linux") {
        Path::new("/proc").join(pid.to_string()).exists()
    } else {
        true
    }
}

/// The error of a folder whose lock `owner` holds.
fn in_use(dir: &Path, owner: &Owner) -> TrainerError {
    TrainerError::RunFolder {
        dir: dir.to_path_buf(),
        message: format!(
            "in use by process {} on {} (lock file {}; remove it only if that process no longer trains here)",
            owner.pid,
            owner.host,
            dir.join(LOCK_FILE).display()
        ),
    }
}

/// The run folder's lock, released (the file removed) when dropped.
#[derive(Debug)]
pub struct RunLock {
    path: PathBuf,
}

impl RunLock {
    /// Takes `dir/run.lock` for this process. A lock held by a live process (or by another
    /// host) is an error naming the owner; one left by a process that no longer runs on this
    /// host is taken over.
    pub fn acquire(dir: &Path) -> Result<Self> {
        let path = dir.join(LOCK_FILE);
        for _ in 0..2 {
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(mut f) => {
                    let owner =
                        serde_json::to_string(&Owner::this_process()).expect("an owner serializes");
                    f.write_all(owner.as_bytes())
                        .and_then(|_| f.sync_all())
                        .map_err(|e| TrainerError::io(&path, e))?;
                    return Ok(Self { path });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let text = std::fs::read_to_string(&path).unwrap_or_default();
                    match serde_json::from_str::<Owner>(&text) {
                        Ok(owner) if owner.is_gone() => {
                            tracing::warn!(
                                "{}: taking over the lock of process {} on {}, which no longer runs",
                                path.display(),
                                owner.pid,
                                owner.host
                            );
                            std::fs::remove_file(&path).map_err(|e| TrainerError::io(&path, e))?;
                        }
                        Ok(owner) => return Err(in_use(dir, &owner)),
                        Err(_) => {
                            return Err(TrainerError::RunFolder {
                                dir: dir.to_path_buf(),
                                message: format!(
                                    "its lock file {} does not name an owner; if no run uses this folder, remove the file",
                                    path.display()
                                ),
                            })
                        }
                    }
                }
                Err(e) => return Err(TrainerError::io(&path, e)),
            }
        }
        Err(TrainerError::RunFolder {
            dir: dir.to_path_buf(),
            message: format!("another process took {} first", path.display()),
        })
    }
}

impl Drop for RunLock {
    fn drop(&mut self) {
        // Only our own lock: a folder taken over meanwhile keeps its new owner's.
        let ours = std::fs::read_to_string(&self.path)
            .ok()
            .and_then(|t| serde_json::from_str::<Owner>(&t).ok())
            .is_some_and(|o| o == Owner::this_process());
        if ours {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// The step of a folder name conrub writes for a checkpoint: `checkpoint-NNNNNN`, or its
/// `.tmp` / `.old` forms while one is sealed. A user's copy (`checkpoint-000002-mybackup`) is no
/// checkpoint of conrub's: never taken, moved or deleted.
fn checkpoint_step(name: &str) -> Option<u64> {
    let rest = name.strip_prefix("checkpoint-")?;
    let (digits, suffix) = rest.split_once('.').unwrap_or((rest, ""));
    let ours = !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
        && matches!(suffix, "" | "tmp" | "old");
    ours.then(|| digits.parse().ok()).flatten()
}

/// What of an earlier run `dir` holds: its metrics, samples, event files and checkpoints.
fn earlier_run(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut found = Vec::new();
    let metrics = dir.join("metrics.jsonl");
    if std::fs::metadata(&metrics).is_ok_and(|m| m.len() > 0) {
        found.push(metrics);
    }
    let entries = std::fs::read_dir(dir).map_err(|e| TrainerError::io(dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| TrainerError::io(dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let best = best_checkpoint_path(dir);
        let samples = entry.path() == crate::samples::samples_dir(dir);
        let events = entry.path() == crate::tensorboard::tensorboard_dir(dir);
        if checkpoint_step(&name).is_some() || entry.path() == best || samples || events {
            found.push(entry.path());
        }
    }
    found.sort();
    Ok(found)
}

/// The newest complete checkpoint in `dir` (`--resume auto`): the `checkpoint-NNNNNN` folder of
/// the highest step whose `training_state/state.json` exists (a checkpoint folder appears whole,
/// renamed from `.tmp`, so a kill leaves either a complete one or none; `.tmp` and `.old`
/// folders are never taken). A checkpoint of a step beyond the last step line of
/// `metrics.jsonl` is not this run's and is passed over (a resume sets such leftovers aside,
/// [`set_aside_later_checkpoints`]; this guards folders written before it did). `None` when the
/// folder does not exist or holds none.
pub fn latest_checkpoint(dir: &Path) -> Result<Option<PathBuf>> {
    let logged = steps_logged(dir)?;
    let best = checkpoints(dir)?
        .into_iter()
        .filter(|(step, path)| {
            path.join("training_state").join("state.json").is_file()
                && logged.is_none_or(|done| *step <= done)
        })
        .max_by_key(|(step, _)| *step);
    Ok(best.map(|(_, path)| path))
}

/// The `checkpoint-NNNNNN` folders of `dir` (none of `.tmp` or `.old`) with their steps; none
/// when `dir` does not exist.
pub(crate) fn checkpoints(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(TrainerError::io(dir, e)),
    };
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| TrainerError::io(dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let step = checkpoint_step(&name).filter(|_| !name.contains('.'));
        if let Some(step) = step.filter(|_| entry.path().is_dir()) {
            found.push((step, entry.path()));
        }
    }
    Ok(found)
}

/// The steps done by the last step line of `dir/metrics.jsonl` (its `step` + 1); `None` without
/// the file or without a step line in it (an emptied file says nothing of which checkpoints are
/// this run's, so it sets none aside).
fn steps_logged(dir: &Path) -> Result<Option<u64>> {
    let path = dir.join("metrics.jsonl");
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(TrainerError::io(&path, e)),
    };
    let done = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["kind"] == "step")
        .filter_map(|v| v["step"].as_u64())
        .map(|s| s + 1)
        .max();
    Ok(done)
}

/// Moves `paths` (entries of `dir`) into a new `dir/attempt-SECONDS/` and returns it: what an
/// earlier attempt wrote, kept whole where a new attempt would otherwise overwrite or mix with
/// it.
fn set_aside(dir: &Path, paths: &[PathBuf]) -> Result<PathBuf> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let aside = (0..)
        .map(|i| match i {
            0 => dir.join(format!("attempt-{secs}")),
            i => dir.join(format!("attempt-{secs}-{i}")),
        })
        .find(|p| !p.exists())
        .expect("a free name");
    std::fs::create_dir(&aside).map_err(|e| TrainerError::io(&aside, e))?;
    for path in paths {
        let to = aside.join(path.file_name().expect("an entry of the folder"));
        std::fs::rename(path, &to).map_err(|e| TrainerError::io(path, e))?;
    }
    conrub_rubric::io::sync_dir(dir).map_err(|e| TrainerError::io(dir, e))?;
    Ok(aside)
}

/// For a run resumed after `steps_done` steps (holding the folder's lock): the checkpoints of
/// later steps (and their `.tmp` and `.old` folders), which an earlier, longer attempt left and
/// which this run's own would otherwise replace or be confused with, moved into
/// `dir/attempt-SECONDS/`. Returns that folder, `None` when there were none.
pub fn set_aside_later_checkpoints(dir: &Path, steps_done: u64) -> Result<Option<PathBuf>> {
    let entries = std::fs::read_dir(dir).map_err(|e| TrainerError::io(dir, e))?;
    let mut later = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| TrainerError::io(dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if checkpoint_step(&name).is_some_and(|s| s > steps_done) {
            later.push(entry.path());
        }
    }
    if later.is_empty() {
        return Ok(None);
    }
    later.sort();
    set_aside(dir, &later).map(Some)
}

/// What [`claim`] does with an earlier run's metrics, samples, events and checkpoints found by
/// a fresh run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EarlierRun {
    /// Refuse the folder (the default).
    Refuse,
    /// Delete them (`--overwrite`).
    Delete,
    /// Move them into `attempt-SECONDS/` (`--resume auto` with no checkpoint to resume).
    SetAside,
}

/// What a run can check of its folder before it loads anything (the binary calls it first, so
/// a bad folder fails in seconds, not after the model loads and the kernel warm-up): the name is
/// not empty, it is a folder or can be created as one, it can be written, and a fresh run
/// (`resuming` false) does not start over an earlier run's metrics or checkpoints unless
/// `overwrite`. Returns what an overwrite would delete.
pub fn check_start(dir: &Path, resuming: bool, overwrite: bool) -> Result<Vec<PathBuf>> {
    if dir.as_os_str().is_empty() {
        let why = "is empty (name the folder the run writes to)";
        return Err(conrub_grpo::GrpoError::config("run.output_dir", why).into());
    }
    if dir.exists() && !dir.is_dir() {
        return Err(TrainerError::RunFolder {
            dir: dir.to_path_buf(),
            message: "is a file, not a folder".into(),
        });
    }
    std::fs::create_dir_all(dir).map_err(|e| TrainerError::io(dir, e))?;
    let probe = dir.join(".conrub-write-probe");
    std::fs::write(&probe, b"")
        .and_then(|_| std::fs::remove_file(&probe))
        .map_err(|e| TrainerError::RunFolder {
            dir: dir.to_path_buf(),
            message: format!("cannot be written: {e}"),
        })?;
    // A live owner other than this process (a lock of a process gone is taken over later).
    let owner = std::fs::read_to_string(dir.join(LOCK_FILE))
        .ok()
        .and_then(|t| serde_json::from_str::<Owner>(&t).ok());
    if let Some(owner) = owner.filter(|o| !o.is_gone() && *o != Owner::this_process()) {
        return Err(in_use(dir, &owner));
    }
    if resuming {
        return Ok(Vec::new());
    }
    let earlier = earlier_run(dir)?;
    if !earlier.is_empty() && !overwrite && has_history(dir, &earlier)? {
        return Err(refusal(dir, &earlier)?);
    }
    Ok(earlier)
}

/// Whether what [`earlier_run`] found is a run's history: a checkpoint, a step, epoch or
/// validation line, or a sample file. A run that failed or was killed before its first step
/// leaves none of it (an empty `metrics.jsonl`, event files with no step), and its rerun
/// replaces those leftovers instead of being refused.
fn has_history(dir: &Path, found: &[PathBuf]) -> Result<bool> {
    let named = |p: &PathBuf| p.file_name().map(|n| n.to_string_lossy().into_owned());
    if found
        .iter()
        .filter_map(named)
        .any(|n| checkpoint_step(&n).is_some())
    {
        return Ok(true);
    }
    let samples = crate::samples::samples_dir(dir);
    let sampled = std::fs::read_dir(&samples).is_ok_and(|mut d| d.next().is_some());
    let metrics = dir.join("metrics.jsonl");
    let text = match std::fs::read_to_string(&metrics) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(TrainerError::io(&metrics, e)),
    };
    let logged = text.lines().filter(|l| !l.trim().is_empty()).any(|l| {
        let kind = serde_json::from_str::<serde_json::Value>(l).ok();
        let kind = kind.as_ref().and_then(|v| v["kind"].as_str());
        // A line that does not read is kept as history: it may be anything.
        kind.is_none_or(|k| k != "kernel_warmup")
    });
    Ok(sampled || logged)
}

/// The refusal of a fresh run over an earlier one, naming what is there and what to do: resume
/// only when there is a complete checkpoint to resume.
fn refusal(dir: &Path, earlier: &[PathBuf]) -> Result<TrainerError> {
    let names: Vec<String> = earlier
        .iter()
        .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect();
    let resume = match latest_checkpoint(dir)? {
        Some(newest) => format!(
            "continue it with --resume auto (its newest complete checkpoint) or --resume {}, or ",
            newest.display()
        ),
        None => "it has no complete checkpoint to resume; ".into(),
    };
    Ok(TrainerError::RunFolder {
        dir: dir.to_path_buf(),
        message: format!(
            "holds an earlier run ({}); {resume}start over with --overwrite (which deletes them)",
            names.join(", ")
        ),
    })
}

/// Claims the run folder `dir` for a run: [`check_start`], then its lock ([`RunLock`]), then, for
/// a fresh run, the earlier run's metrics, samples, events and checkpoints are deleted or set
/// aside as `earlier` says (the fresh run starts from an empty history, and pruning never meets
/// another run's checkpoints), all under the lock.
pub fn claim(dir: &Path, resuming: bool, earlier: EarlierRun) -> Result<RunLock> {
    let replace = earlier != EarlierRun::Refuse;
    check_start(dir, resuming, replace)?;
    let lock = RunLock::acquire(dir)?;
    // Checked again under the lock: another run may have written meanwhile.
    let found = check_start(dir, resuming, replace)?;
    if earlier == EarlierRun::SetAside && !found.is_empty() {
        let aside = set_aside(dir, &found)?;
        tracing::warn!(
            "{}: an earlier attempt's files (no checkpoint to resume) moved to {}",
            dir.display(),
            aside.display()
        );
        return Ok(lock);
    }
    for path in found {
        let removed = if path.is_dir() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        removed.map_err(|e| TrainerError::io(&path, e))?;
    }
    Ok(lock)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_claim_names_the_owner_and_a_dead_owner_is_taken_over() {
        let dir = tempfile::tempdir().unwrap();
        let lock = claim(dir.path(), false, EarlierRun::Refuse).unwrap();
        let err = claim(dir.path(), true, EarlierRun::Refuse)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("in use by process {}", std::process::id())),
            "{err}"
        );
        drop(lock);
        assert!(!dir.path().join(LOCK_FILE).exists(), "released on drop");
        // A lock left by a process that no longer runs (pid beyond Linux's maximum).
        let stale = Owner {
            pid: 4_194_305,
            host: host_name(),
        };
        std::fs::write(
            dir.path().join(LOCK_FILE),
            serde_json::to_string(&stale).unwrap(),
        )
        .unwrap();
        let _lock = claim(dir.path(), false, EarlierRun::Refuse).unwrap();
    }

    #[test]
    fn a_fresh_run_over_an_earlier_one_is_refused_unless_overwriting() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("metrics.jsonl"), "{}\n").unwrap();
        complete_checkpoint(dir.path(), 4);
        let err = claim(dir.path(), false, EarlierRun::Refuse)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("holds an earlier run (checkpoint-000004, metrics.jsonl)")
                && err.contains("--resume")
                && err.contains("--overwrite"),
            "{err}"
        );
        assert!(
            dir.path().join("checkpoint-000004").exists(),
            "nothing lost"
        );
        assert!(
            !dir.path().join(LOCK_FILE).exists(),
            "the refused run let go"
        );
        drop(claim(dir.path(), true, EarlierRun::Refuse).unwrap());
        drop(claim(dir.path(), false, EarlierRun::Delete).unwrap());
        assert!(!dir.path().join("checkpoint-000004").exists());
        assert!(!dir.path().join("metrics.jsonl").exists());
    }

    fn complete_checkpoint(dir: &Path, step: u64) -> PathBuf {
        let c = dir.join(format!("checkpoint-{step:06}"));
        std::fs::create_dir_all(c.join("training_state")).unwrap();
        std::fs::write(c.join("training_state/state.json"), "{}").unwrap();
        c
    }

    /// Issue 53, items 13, 15 and 7: leftovers of a run that died before its first step do not
    /// block its rerun; a user's copy of a checkpoint is never named, taken or deleted; an
    /// emptied `metrics.jsonl` does not disown complete checkpoints.
    #[test]
    fn leftovers_copies_and_an_emptied_history() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let events = crate::tensorboard::tensorboard_dir(d);
        std::fs::write(d.join("metrics.jsonl"), "\n").unwrap();
        std::fs::create_dir_all(&events).unwrap();
        std::fs::write(events.join("events.out.tfevents.1"), b"version only").unwrap();
        drop(claim(d, false, EarlierRun::Refuse).unwrap());
        assert!(!events.exists(), "the leftovers are replaced");

        let ours = complete_checkpoint(d, 2);
        let copy = d.join("checkpoint-000002-mybackup");
        std::fs::create_dir_all(copy.join("training_state")).unwrap();
        std::fs::write(copy.join("training_state/state.json"), "{}").unwrap();
        std::fs::write(d.join("metrics.jsonl"), "{\"kind\":\"step\",\"step\":1}\n").unwrap();
        let err = claim(d, false, EarlierRun::Refuse).unwrap_err().to_string();
        assert!(!err.contains("mybackup"), "{err}");
        assert!(
            err.contains(&format!("--resume {}", ours.display())),
            "{err}"
        );
        assert_eq!(latest_checkpoint(d).unwrap(), Some(ours.clone()));
        assert_eq!(
            set_aside_later_checkpoints(d, 0)
                .unwrap()
                .map(|a| a.join("checkpoint-000002").is_dir()),
            Some(true)
        );
        assert!(
            copy.is_dir(),
            "a resume sets aside conrub's checkpoints only"
        );
        complete_checkpoint(d, 2);
        drop(claim(d, false, EarlierRun::Delete).unwrap());
        assert!(
            copy.is_dir() && !ours.exists(),
            "--overwrite deletes what conrub wrote only"
        );

        let (two, four) = (complete_checkpoint(d, 2), complete_checkpoint(d, 4));
        std::fs::write(d.join("metrics.jsonl"), "").unwrap();
        assert_eq!(latest_checkpoint(d).unwrap(), Some(four));
        assert!(two.is_dir());
        let err = claim(d, false, EarlierRun::Refuse).unwrap_err().to_string();
        assert!(err.contains("--resume auto"), "{err}");
    }

    /// `--resume auto` takes the highest complete step: not a `.tmp` or `.old` folder, not one
    /// without its training state, not a file.
    #[test]
    fn the_latest_checkpoint_is_the_newest_complete_one() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(latest_checkpoint(&dir.path().join("absent")).unwrap(), None);
        assert_eq!(latest_checkpoint(dir.path()).unwrap(), None);
        let state = |name: &str| {
            let d = dir.path().join(name).join("training_state");
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("state.json"), "{}").unwrap();
        };
        state("checkpoint-000002");
        state("checkpoint-000010");
        state("checkpoint-000012.tmp");
        state("checkpoint-000014.old");
        std::fs::create_dir_all(dir.path().join("checkpoint-000016/training_state")).unwrap();
        std::fs::write(dir.path().join("checkpoint-000018"), "").unwrap();
        assert_eq!(
            latest_checkpoint(dir.path()).unwrap(),
            Some(dir.path().join("checkpoint-000010"))
        );
        // Metrics that end at 2 steps done: checkpoint 10 is not this run's.
        let line = |s: u64| format!("{{\"kind\":\"step\",\"step\":{s}}}\n");
        std::fs::write(dir.path().join("metrics.jsonl"), line(0) + &line(1)).unwrap();
        assert_eq!(
            latest_checkpoint(dir.path()).unwrap(),
            Some(dir.path().join("checkpoint-000002"))
        );
        // A resume after 2 steps sets every later checkpoint folder aside, whole.
        let aside = set_aside_later_checkpoints(dir.path(), 2).unwrap().unwrap();
        let mut moved: Vec<String> = std::fs::read_dir(&aside)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        moved.sort();
        assert_eq!(
            moved,
            [
                "checkpoint-000010",
                "checkpoint-000012.tmp",
                "checkpoint-000014.old",
                "checkpoint-000016",
                "checkpoint-000018"
            ]
        );
        assert!(dir.path().join("checkpoint-000002").is_dir());
        assert_eq!(set_aside_later_checkpoints(dir.path(), 2).unwrap(), None);
        // With no checkpoint to resume, a fresh claim sets the earlier attempt aside whole.
        let fresh = tempfile::tempdir().unwrap();
        std::fs::write(fresh.path().join("metrics.jsonl"), line(0)).unwrap();
        std::fs::create_dir_all(fresh.path().join("samples")).unwrap();
        assert_eq!(latest_checkpoint(fresh.path()).unwrap(), None);
        drop(claim(fresh.path(), false, EarlierRun::SetAside).unwrap());
        let attempts: Vec<PathBuf> = std::fs::read_dir(fresh.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| {
                p.file_name()
                    .unwrap()
                    .to_string_lossy()
                    .starts_with("attempt-")
            })
            .collect();
        assert_eq!(attempts.len(), 1);
        assert!(
            attempts[0].join("metrics.jsonl").is_file() && attempts[0].join("samples").is_dir()
        );
        check_start(fresh.path(), false, false).unwrap();
    }

    #[test]
    fn a_file_or_an_empty_name_is_no_run_folder() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        std::fs::write(&file, "").unwrap();
        let err = claim(&file, false, EarlierRun::Refuse)
            .unwrap_err()
            .to_string();
        assert!(err.ends_with("is a file, not a folder"), "{err}");
        let err = claim(Path::new(""), false, EarlierRun::Refuse)
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("run.output_dir: is empty"), "{err}");
    }
}
