//! Training state on disk: the policy (with its parameter ids), the optimizer moments, the step and
//! the caller's data cursor, written to a temporary directory and swapped in, so a crash leaves
//! either the previous complete state or the new one.

use std::path::{Path, PathBuf};

use burn::module::{AutodiffModule, Module};
use burn::optim::Optimizer;
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder, Recorder};
use burn::tensor::backend::AutodiffBackend;
use serde::{Deserialize, Serialize};

use conrub_rubric::io::sync_dir;

use crate::error::{GrpoError, Result};
use crate::learner::{Learner, LearnerConfig};
use crate::policy::Policy;

/// The small, human-readable part of a training state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainingState {
    /// Steps completed.
    pub step: u64,
    /// Where the data loader continues (opaque to the learner).
    pub data_cursor: serde_json::Value,
    /// The learner settings the state was produced with.
    pub learner: LearnerConfig,
    /// Format version of this directory.
    pub format: u32,
}

/// File names inside a state directory.
const POLICY: &str = "policy";
const OPTIMIZER: &str = "optimizer";
const STATE: &str = "state.json";
const REFERENCE: &str = "reference";

fn io(path: &Path, e: impl std::fmt::Display) -> GrpoError {
    GrpoError::io(path, e)
}

/// Writes `dir` atomically: everything goes to `dir.tmp`, then `dir` is replaced.
pub fn save_state<B, P>(
    learner: &Learner<B, P>,
    data_cursor: serde_json::Value,
    dir: &Path,
) -> Result<()>
where
    B: AutodiffBackend,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
{
    let tmp = PathBuf::from(format!("{}.tmp", dir.display()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
    let rec = NamedMpkFileRecorder::<FullPrecisionSettings>::new();
    learner
        .policy
        .clone()
        .save_file(tmp.join(POLICY), &rec)
        .map_err(|e| io(&tmp.join(POLICY), e))?;
    rec.record(learner.update.optim.to_record(), tmp.join(OPTIMIZER))
        .map_err(|e| io(&tmp.join(OPTIMIZER), e))?;
    if let Some(reference) = &learner.reference {
        reference
            .clone()
            .save_file(tmp.join(REFERENCE), &rec)
            .map_err(|e| io(&tmp.join(REFERENCE), e))?;
    }
    let state = TrainingState {
        step: learner.step,
        data_cursor,
        learner: learner.cfg.clone(),
        format: 1,
    };
    let json = serde_json::to_vec_pretty(&state).map_err(|e| io(&tmp.join(STATE), e))?;
    std::fs::write(tmp.join(STATE), json).map_err(|e| io(&tmp.join(STATE), e))?;
    for f in std::fs::read_dir(&tmp).map_err(|e| io(&tmp, e))? {
        let f = f.map_err(|e| io(&tmp, e))?.path();
        std::fs::File::open(&f)
            .and_then(|h| h.sync_all())
            .map_err(|e| io(&f, e))?;
    }
    swap_in(&tmp, dir)
}

/// Replaces `dir` with the complete directory `tmp`: the entries of `tmp`, then the swap in the
/// parent, made durable; the previous `dir` waits in `dir.old` until the new one is in place
/// (the file-level twin is `conrub_rubric::io::AtomicFile`).
pub(crate) fn swap_in(tmp: &Path, dir: &Path) -> Result<()> {
    let old = PathBuf::from(format!("{}.old", dir.display()));
    sync_dir(tmp).map_err(|e| io(tmp, e))?;
    let _ = std::fs::remove_dir_all(&old);
    if dir.exists() {
        std::fs::rename(dir, &old).map_err(|e| io(dir, e))?;
    }
    std::fs::rename(tmp, dir).map_err(|e| io(dir, e))?;
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        sync_dir(parent).map_err(|e| io(parent, e))?;
    }
    let _ = std::fs::remove_dir_all(&old);
    Ok(())
}

/// Restores policy, optimizer and step into `learner` from `dir`; returns the saved state
/// (its data cursor tells the caller where to continue).
pub fn load_state<B, P>(learner: &mut Learner<B, P>, dir: &Path) -> Result<TrainingState>
where
    B: AutodiffBackend,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
{
    // A crash between the two renames of `save_state` leaves the previous state in `dir.old`.
    let old = PathBuf::from(format!("{}.old", dir.display()));
    let dir = if !dir.join(STATE).exists() && old.join(STATE).exists() {
        old.as_path()
    } else {
        dir
    };
    let state_path = dir.join(STATE);
    let text = std::fs::read_to_string(&state_path).map_err(|e| io(&state_path, e))?;
    let state: TrainingState = serde_json::from_str(&text).map_err(|e| io(&state_path, e))?;
    if state.format != 1 {
        return Err(io(
            &state_path,
            format!("unsupported state format {}", state.format),
        ));
    }
    let rec = NamedMpkFileRecorder::<FullPrecisionSettings>::new();
    learner.policy = learner
        .policy
        .clone()
        .load_file(dir.join(POLICY), &rec, &learner.device)
        .map_err(|e| io(&dir.join(POLICY), e))?;
    let record = rec
        .load(dir.join(OPTIMIZER), &learner.device)
        .map_err(|e| io(&dir.join(OPTIMIZER), e))?;
    learner.update.optim = learner.update.optim.clone().load_record(record);
    learner.step = state.step;
    // The KL reference is the run's initial policy, saved with the state.
    if learner.cfg.kl_beta != 0.0 {
        let path = dir.join(REFERENCE);
        let base = learner
            .reference
            .clone()
            .unwrap_or_else(|| learner.policy.valid());
        learner.reference = Some(
            base.load_file(path.clone(), &rec, &learner.device)
                .map_err(|e| io(&path, e))?,
        );
    }
    Ok(state)
}
