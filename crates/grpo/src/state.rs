//! Training state on disk: the policy (with its parameter ids), the optimizer moments, the step and
//! the caller's data cursor, written to a temporary directory and swapped in, so a crash leaves
//! either the previous complete state or the new one.
//!
//! A manifest (`manifest.json`) records the policy's parameters (path and shape) and the size and
//! SHA-256 of every state file; [`load_state`] checks it before reading anything, and the
//! learner settings a resume must keep ([`KEPT_ON_RESUME`]) against the running learner's, so a
//! flipped byte, a truncated copy, another model or a changed `group_size` is an error naming
//! it, never a run that trains on.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use burn::module::{ModuleVisitor, Param, ParamId};
use burn::tensor::Tensor;
use sha2::{Digest, Sha256};

use burn::module::{AutodiffModule, Module};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{AdamW, Optimizer};
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder, Recorder};
use burn::tensor::backend::AutodiffBackend;
use serde::{Deserialize, Serialize};

use conrub_rubric::io::sync_dir;

use crate::error::{GrpoError, Result};
use crate::learner::{Learner, LearnerConfig};
use conrub_contracts::Policy;
use conrub_parallel::sharding::{index_of, param_ids, Sharding};

/// The small, human-readable part of a training state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainingState {
    /// Steps completed.
    pub step: u64,
    /// Optimizer steps taken (the learning-rate schedule's position); absent in states written
    /// before schedules, which are read as `step x ppo_epochs x mini_batches`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer_steps: Option<u64>,
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
const MANIFEST: &str = "manifest.json";
/// The state format written now (1: no manifest, loaded unchecked).
const FORMAT: u32 = 2;
/// The format of a sharded group's state: format 2 with one optimizer file per rank (a build
/// that reads only 2 would look for the one `optimizer` file).
const SHARDED_FORMAT: u32 = 3;
/// The format of a `sharding = "full"` group's state: format 3 with one policy file per rank
/// too (a build that reads only 3 would look for the one `policy` file).
const PARAMETER_SHARDED_FORMAT: u32 = 4;

/// Learner settings a resume must keep (they shape the groups, the advantages, the loss or the
/// sampling of the run so far); the others (learning rate, clipping norm, micro-batch size, the
/// loss's KL estimator and entropy bonus, which hold no state, ...) may change on resume. Listed
/// in configs/README.md.
pub const KEPT_ON_RESUME: [&str; 21] = [
    "group_size",
    "max_response_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "stop",
    "clip",
    "aggregation",
    "scale_rewards",
    "estimator",
    "loss",
    "kl_beta",
    "kl_in_reward",
    "tie_mode",
    "dynamic_sampling",
    "dpo_beta",
    "ppo_epochs",
    "mini_batches",
    "seed",
];

/// Size and SHA-256 of one state file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct FileDigest {
    bytes: u64,
    sha256: String,
}

/// What a training state holds, to check before loading it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Manifest {
    /// The policy's float parameters in visiting order: module path and shape.
    parameters: Vec<(String, Vec<usize>)>,
    /// Every state file but the manifest, by name.
    files: BTreeMap<String, FileDigest>,
    /// A sharded group's optimizer state, one file per rank (absent: one `optimizer` file).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    sharding: Option<ShardFiles>,
    /// A `full` group's policy, one file per rank holding the parameters it owns (the others
    /// one-element placeholders; absent: one `policy` file).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    policy_shards: Option<Vec<ShardFile>>,
}

/// The optimizer state of a sharded group: which rank wrote which file and which parameters
/// (indices into `parameters`) it holds. A resume may use another world size or mode: every
/// file is read and each rank keeps what it owns then.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct ShardFiles {
    world: usize,
    mode: Sharding,
    shards: Vec<ShardFile>,
}

/// One rank's optimizer (or policy) file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct ShardFile {
    rank: usize,
    /// File name in the state directory (with `.mpk`, which the recorder adds).
    file: String,
    /// The parameters whose AdamW moments (or values) it holds.
    parameters: Vec<usize>,
    /// Their elements.
    elements: usize,
}

/// The AdamW state of a learner, keyed by parameter id.
type OptimRecord<B, P> = <OptimizerAdaptor<AdamW, P, B> as Optimizer<P, B>>::Record;

/// The `what` file (optimizer, policy) of `rank` of a `world`-rank sharded group.
fn shard_file(what: &str, rank: usize, world: usize) -> String {
    format!("{what}-rank-{rank:05}-of-{world:05}")
}

/// The policy's float parameters: module path (each field entered on the way, the parameter's
/// own last) and shape.
#[derive(Default)]
struct Shapes {
    path: Vec<String>,
    found: Vec<(String, Vec<usize>)>,
}

impl<B: burn::tensor::backend::Backend> ModuleVisitor<B> for Shapes {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let name = if self.path.is_empty() {
            format!("parameter {}", self.found.len())
        } else {
            self.path.join(".")
        };
        self.found.push((name, param.val().dims().to_vec()));
    }
}

fn shapes<B: burn::tensor::backend::Backend, M: Module<B>>(m: &M) -> Vec<(String, Vec<usize>)> {
    let mut v = Shapes::default();
    m.visit(&mut v);
    v.found
}

fn digest(path: &Path) -> Result<FileDigest> {
    let mut f = std::fs::File::open(path).map_err(|e| io(path, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut bytes = 0u64;
    loop {
        let n = f.read(&mut buf).map_err(|e| io(path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        bytes += n as u64;
    }
    let sha256 = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Ok(FileDigest { bytes, sha256 })
}

/// An error about the checkpoint `dir` in a user's words.
fn bad_checkpoint(dir: &Path, message: impl std::fmt::Display) -> GrpoError {
    GrpoError::Checkpoint {
        dir: dir.to_path_buf(),
        message: message.to_string(),
    }
}

fn io(path: &Path, e: impl std::fmt::Display) -> GrpoError {
    GrpoError::io(path, e)
}

/// Writes `dir` atomically: everything goes to `dir.tmp`, then `dir` is replaced.
pub fn save_state<B, P, T>(
    learner: &Learner<B, P, T>,
    data_cursor: serde_json::Value,
    dir: &Path,
) -> Result<()>
where
    B: AutodiffBackend,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
    T: conrub_rewards::TaskPrompt,
{
    write_state(learner, data_cursor, dir)?.seal()
}

/// The first half of [`save_state`]: the state's files written into `dir.tmp` (the device's
/// tensors read back, the files in the operating system's page cache), not yet durable nor in
/// place. [`StateDraft::seal`] finishes it, on any thread.
pub fn write_state<B, P, T>(
    learner: &Learner<B, P, T>,
    data_cursor: serde_json::Value,
    dir: &Path,
) -> Result<StateDraft>
where
    B: AutodiffBackend,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
    T: conrub_rewards::TaskPrompt,
{
    write_group_state(std::slice::from_ref(learner), data_cursor, dir)
}

/// A training state whose files are written into `dir.tmp` but not yet hashed into its
/// manifest, flushed to the disk or swapped in ([`write_state`]). Sealing needs no device and
/// no learner: the training loop seals on a background thread while the next step runs. A
/// draft dropped unsealed leaves only `dir.tmp`, which no resume reads.
#[must_use = "a draft is not a saved state until it is sealed"]
#[derive(Debug)]
pub struct StateDraft {
    pub(crate) tmp: PathBuf,
    dir: PathBuf,
    manifest: Manifest,
}

impl StateDraft {
    /// A draft of the files already in `tmp` with no parameters: its seal lists those files
    /// alone (what tests of a checkpoint's sealing write).
    #[doc(hidden)]
    pub fn of_files(tmp: PathBuf, dir: PathBuf) -> Self {
        Self {
            tmp,
            dir,
            manifest: Manifest {
                parameters: vec![],
                files: BTreeMap::new(),
                sharding: None,
                policy_shards: None,
            },
        }
    }
}

impl StateDraft {
    /// Hashes every file into the manifest, writes it, flushes every file to the disk and
    /// swaps `dir.tmp` in as `dir` ([`swap_in`]).
    pub fn seal(mut self) -> Result<()> {
        let tmp = &self.tmp;
        for f in std::fs::read_dir(tmp).map_err(|e| io(tmp, e))? {
            let f = f.map_err(|e| io(tmp, e))?.path();
            let name = f
                .file_name()
                .expect("a file")
                .to_string_lossy()
                .into_owned();
            self.manifest.files.insert(name, digest(&f)?);
        }
        let json =
            serde_json::to_vec_pretty(&self.manifest).map_err(|e| io(&tmp.join(MANIFEST), e))?;
        std::fs::write(tmp.join(MANIFEST), json).map_err(|e| io(&tmp.join(MANIFEST), e))?;
        for f in std::fs::read_dir(tmp).map_err(|e| io(tmp, e))? {
            let f = f.map_err(|e| io(tmp, e))?.path();
            std::fs::File::open(&f)
                .and_then(|h| h.sync_all())
                .map_err(|e| io(&f, e))?;
        }
        swap_in(tmp, &self.dir)
    }
}

/// [`write_state`] of a data-parallel group, rank 0 first: the policy (rank 0's, every rank
/// holding the same; a `full` group's every rank's own parameters, one file each), and the
/// optimizer state: rank 0's when it is replicated, every rank's own part (one file each,
/// listed in the manifest) when the group shards it.
pub fn write_group_state<B, P, T>(
    ranks: &[Learner<B, P, T>],
    data_cursor: serde_json::Value,
    dir: &Path,
) -> Result<StateDraft>
where
    B: AutodiffBackend,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
    T: conrub_rewards::TaskPrompt,
{
    let learner = &ranks[0];
    let tmp = PathBuf::from(format!("{}.tmp", dir.display()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
    let rec = NamedMpkFileRecorder::<FullPrecisionSettings>::new();
    let policy_shards = save_policy(ranks, &tmp, &rec)?;
    let sharding = save_optimizer(ranks, &tmp, &rec)?;
    if let Some(reference) = &learner.reference {
        reference
            .clone()
            .save_file(tmp.join(REFERENCE), &rec)
            .map_err(|e| io(&tmp.join(REFERENCE), e))?;
    }
    let state = TrainingState {
        step: learner.step,
        optimizer_steps: Some(learner.update.taken),
        data_cursor,
        learner: learner.cfg.clone(),
        format: match (&policy_shards, &sharding) {
            (Some(_), _) => PARAMETER_SHARDED_FORMAT,
            (None, Some(_)) => SHARDED_FORMAT,
            (None, None) => FORMAT,
        },
    };
    let json = serde_json::to_vec_pretty(&state).map_err(|e| io(&tmp.join(STATE), e))?;
    std::fs::write(tmp.join(STATE), json).map_err(|e| io(&tmp.join(STATE), e))?;
    Ok(StateDraft {
        tmp,
        dir: dir.to_path_buf(),
        manifest: Manifest {
            parameters: whole_shapes(learner),
            files: BTreeMap::new(),
            sharding,
            policy_shards,
        },
    })
}

/// Writes the policy of `ranks` into `tmp`: rank 0's (`policy`), or in a `full` group each
/// rank's own (released: its parameters whole, the others placeholders), one file each; returns
/// what the manifest lists of those. No rank ever holds the whole policy for it.
fn save_policy<B, P, T>(
    ranks: &[Learner<B, P, T>],
    tmp: &Path,
    rec: &NamedMpkFileRecorder<FullPrecisionSettings>,
) -> Result<Option<Vec<ShardFile>>>
where
    B: AutodiffBackend,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
    T: conrub_rewards::TaskPrompt,
{
    let layout = ranks[0].rank.as_ref().and_then(|s| s.parameters_sharded());
    let Some(layout) = layout else {
        ranks[0]
            .policy
            .clone()
            .save_file(tmp.join(POLICY), rec)
            .map_err(|e| io(&tmp.join(POLICY), e))?;
        return Ok(None);
    };
    let world = ranks.len();
    if world != layout.world() {
        return Err(GrpoError::Stage(format!(
            "a rank of a sharding = \"full\" group holds 1/{} of the policy: its state is saved \
             by the whole group (DataParallel through Trainee::save), not by {world} of its ranks",
            layout.world()
        )));
    }
    let mut files = Vec::with_capacity(world);
    for (rank, learner) in ranks.iter().enumerate() {
        let file = shard_file(POLICY, rank, world);
        learner
            .policy
            .clone()
            .save_file(tmp.join(&file), rec)
            .map_err(|e| io(&tmp.join(&file), e))?;
        let parameters: Vec<usize> = layout.owned(rank).collect();
        files.push(ShardFile {
            rank,
            file: format!("{file}.mpk"),
            elements: parameters.iter().map(|&i| layout.sizes()[i]).sum(),
            parameters,
        });
    }
    Ok(Some(files))
}

/// The policy's parameters with their whole shapes (a `full` rank's placeholders listed with
/// the shapes of the parameters they stand for).
fn whole_shapes<B, P, T>(learner: &Learner<B, P, T>) -> Vec<(String, Vec<usize>)>
where
    B: AutodiffBackend,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
    T: conrub_rewards::TaskPrompt,
{
    let mut found = shapes(&learner.policy);
    if let Some(layout) = learner.rank.as_ref().and_then(|s| s.parameters_sharded()) {
        for (i, (_, dims)) in found.iter_mut().enumerate() {
            *dims = layout.shape(i).to_vec();
        }
    }
    found
}

/// Writes the optimizer state of `ranks` into `tmp`: rank 0's (`optimizer`) when it is
/// replicated, else one file per rank holding its own parameters' moments, keyed by rank 0's
/// parameter ids (those the saved policy carries); returns what the manifest lists of them.
fn save_optimizer<B, P, T>(
    ranks: &[Learner<B, P, T>],
    tmp: &Path,
    rec: &NamedMpkFileRecorder<FullPrecisionSettings>,
) -> Result<Option<ShardFiles>>
where
    B: AutodiffBackend,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
    T: conrub_rewards::TaskPrompt,
{
    let sharded = ranks[0]
        .rank
        .as_ref()
        .and_then(|s| s.sharded().map(|l| (s.sharding, l)));
    let Some((mode, layout)) = sharded else {
        rec.record(ranks[0].update.optim.to_record(), tmp.join(OPTIMIZER))
            .map_err(|e| io(&tmp.join(OPTIMIZER), e))?;
        return Ok(None);
    };
    let lead: Vec<ParamId> = param_ids(&ranks[0].policy)
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    let world = ranks.len();
    let mut shards = Vec::with_capacity(world);
    for (rank, learner) in ranks.iter().enumerate() {
        let index = index_of(&learner.policy);
        let mut record: OptimRecord<B, P> = learner.update.optim.to_record();
        let mut parameters: Vec<usize> = record.keys().map(|id| index[id]).collect();
        parameters.sort_unstable();
        record = record
            .into_iter()
            .map(|(id, r)| (lead[index[&id]], r))
            .collect();
        let file = shard_file(OPTIMIZER, rank, world);
        rec.record(record, tmp.join(&file))
            .map_err(|e| io(&tmp.join(&file), e))?;
        shards.push(ShardFile {
            rank,
            file: format!("{file}.mpk"),
            elements: parameters.iter().map(|&i| layout.sizes()[i]).sum(),
            parameters,
        });
    }
    Ok(Some(ShardFiles {
        world,
        mode,
        shards,
    }))
}

/// Replaces `dir` with the complete directory `tmp`: the entries of `tmp`, then the swap in the
/// parent, made durable; the previous `dir` waits in `dir.old` until the new one is in place
/// (the file-level twin is `conrub_rubric::io::AtomicFile`).
pub fn swap_in(tmp: &Path, dir: &Path) -> Result<()> {
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
pub fn load_state<B, P, T>(learner: &mut Learner<B, P, T>, dir: &Path) -> Result<TrainingState>
where
    B: AutodiffBackend,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
    T: conrub_rewards::TaskPrompt,
{
    // A crash between the two renames of `save_state` leaves the previous state in `dir.old`.
    let old = PathBuf::from(format!("{}.old", dir.display()));
    let dir = if !dir.join(STATE).exists() && old.join(STATE).exists() {
        old.as_path()
    } else {
        dir
    };
    let (state, manifest) = check_state(learner, dir)?;
    let rec = NamedMpkFileRecorder::<FullPrecisionSettings>::new();
    let (sharding, policy_shards) = manifest
        .map(|m| (m.sharding, m.policy_shards))
        .unwrap_or_default();
    learner.policy = match policy_shards {
        None => learner
            .policy
            .clone()
            .load_file(dir.join(POLICY), &rec, &learner.device)
            .map_err(|e| bad_checkpoint(dir, format!("{POLICY}.mpk cannot be read: {e}")))?,
        Some(files) => load_policy_shards(learner, dir, &files, &rec)?,
    };
    let record = load_optimizer(learner, dir, sharding, &rec)?;
    learner.update.optim = learner.update.optim.clone().load_record(record);
    learner.step = state.step;
    learner.update.taken = state.optimizer_steps.unwrap_or_else(|| {
        state.step * (state.learner.ppo_epochs * state.learner.mini_batches) as u64
    });
    // The KL reference (`kl_beta`, `kl_in_reward`) is the run's initial policy, saved with the
    // state.
    if learner.reference.is_some() {
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

/// The policy `learner` takes from the per-rank files of a `full` group's state: the first
/// file's (its parameter ids, which the optimizer files are keyed by), with every parameter
/// the learner needs (all; a `full` rank: its own) taken from the file that holds it. A file
/// holding none of them is not read.
fn load_policy_shards<B, P, T>(
    learner: &Learner<B, P, T>,
    dir: &Path,
    files: &[ShardFile],
    rec: &NamedMpkFileRecorder<FullPrecisionSettings>,
) -> Result<P>
where
    B: AutodiffBackend,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
    T: conrub_rewards::TaskPrompt,
{
    let shapes: Vec<Vec<usize>> = whole_shapes(learner).into_iter().map(|(_, d)| d).collect();
    let needed: Vec<bool> = match learner
        .rank
        .as_ref()
        .and_then(|s| s.parameters_sharded().map(|l| (l, s.rank)))
    {
        Some((layout, rank)) => layout.owned_flags(rank),
        None => vec![true; shapes.len()],
    };
    let read = |f: &ShardFile| -> Result<P> {
        let name = f.file.trim_end_matches(".mpk");
        learner
            .policy
            .clone()
            .load_file(dir.join(name), rec, &learner.device)
            .map_err(|e| bad_checkpoint(dir, format!("{} cannot be read: {e}", f.file)))
    };
    let (first, rest) = files
        .split_first()
        .ok_or_else(|| bad_checkpoint(dir, "corrupted: the manifest lists no policy files"))?;
    let mut policy = read(first)?;
    for f in rest {
        let n = shapes.len();
        let mut take = vec![false; n];
        for &i in f.parameters.iter().filter(|&&i| i < n && needed[i]) {
            take[i] = true;
        }
        if !take.contains(&true) {
            continue;
        }
        let values = conrub_parallel::buckets::owned_values(&read(f)?, take);
        policy = conrub_parallel::buckets::replace_shaped(policy, values, &shapes);
    }
    Ok(policy)
}

/// The optimizer state `learner` keeps from `dir`: the one `optimizer` file, or every rank's
/// file of a sharded state merged; then, on a sharded rank, only the parameters it owns (so a
/// resume may change the world size or the mode).
fn load_optimizer<B, P, T>(
    learner: &Learner<B, P, T>,
    dir: &Path,
    shards: Option<ShardFiles>,
    rec: &NamedMpkFileRecorder<FullPrecisionSettings>,
) -> Result<OptimRecord<B, P>>
where
    B: AutodiffBackend,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
    T: conrub_rewards::TaskPrompt,
{
    // Each file with the parameters it holds (all, for the one `optimizer` file).
    let files: Vec<(String, Option<Vec<usize>>)> = match shards {
        None => vec![(OPTIMIZER.to_string(), None)],
        Some(s) => s
            .shards
            .into_iter()
            .map(|f| {
                (
                    f.file.trim_end_matches(".mpk").to_string(),
                    Some(f.parameters),
                )
            })
            .collect(),
    };
    // A sharded rank keeps what it owns, file by file, so the whole state never sits on its
    // device (a file holds only the parts of the rank that wrote it).
    let owned = learner.rank.as_ref().and_then(|slot| {
        slot.sharded()
            .map(|layout| conrub_parallel::sharding::owned_by(&learner.policy, layout, slot.rank))
    });
    let mut record: OptimRecord<B, P> = Default::default();
    for (file, parameters) in files {
        if let (Some((_, indices)), Some(ps)) = (&owned, &parameters) {
            if !ps.iter().any(|i| indices.contains(i)) {
                continue;
            }
        }
        let mut part: OptimRecord<B, P> = rec
            .load(dir.join(&file), &learner.device)
            .map_err(|e| bad_checkpoint(dir, format!("{file}.mpk cannot be read: {e}")))?;
        if let Some((ids, _)) = &owned {
            part.retain(|id, _| ids.contains(id));
        }
        record.extend(part);
    }
    Ok(record)
}

/// Reads `dir/state.json` and checks the state against its manifest (files, sizes, SHA-256, the
/// policy's parameters) and the settings a resume must keep; nothing is loaded yet.
fn check_state<B, P, T>(
    learner: &Learner<B, P, T>,
    dir: &Path,
) -> Result<(TrainingState, Option<Manifest>)>
where
    B: AutodiffBackend,
    P: Policy<B> + AutodiffModule<B>,
    P::InnerModule: Policy<B::InnerBackend>,
    T: conrub_rewards::TaskPrompt,
{
    let state = read_state(dir)?;
    if state.format == 1 {
        tracing::warn!(
            "{}: a training state without a manifest (format 1): loaded unchecked",
            dir.display()
        );
        return Ok((state, None));
    }
    let manifest = read_manifest(dir)?;
    check_manifest_files(dir, &manifest)?;
    check_parameters(dir, &manifest, &whole_shapes(learner))?;
    check_kept_settings(dir, &state.learner, &learner.cfg)?;
    Ok((state, Some(manifest)))
}

/// `dir/state.json`, parsed, in a format this build reads.
fn read_state(dir: &Path) -> Result<TrainingState> {
    let state_path = dir.join(STATE);
    if !state_path.is_file() {
        return Err(bad_checkpoint(
            dir,
            "not a checkpoint: it has no state.json (resume from output_dir/checkpoint-NNNNNN)",
        ));
    }
    let text = std::fs::read_to_string(&state_path).map_err(|e| io(&state_path, e))?;
    let state: TrainingState = serde_json::from_str(&text)
        .map_err(|e| bad_checkpoint(dir, format!("corrupted: state.json: {e}")))?;
    match state.format {
        1 | FORMAT | SHARDED_FORMAT | PARAMETER_SHARDED_FORMAT => Ok(state),
        other => Err(bad_checkpoint(
            dir,
            format!(
                "state format {other}, which this build does not read (it writes {FORMAT}, {SHARDED_FORMAT} for a sharded group and {PARAMETER_SHARDED_FORMAT} for a `full` one)"
            ),
        )),
    }
}

/// `dir`'s manifest, parsed.
fn read_manifest(dir: &Path) -> Result<Manifest> {
    let manifest_path = dir.join(MANIFEST);
    let text = std::fs::read_to_string(&manifest_path)
        .map_err(|e| bad_checkpoint(dir, format!("corrupted: {MANIFEST}: {e}")))?;
    serde_json::from_str(&text)
        .map_err(|e| bad_checkpoint(dir, format!("corrupted: {MANIFEST}: {e}")))
}

/// Every file the manifest lists is there, with its recorded size and SHA-256.
fn check_manifest_files(dir: &Path, manifest: &Manifest) -> Result<()> {
    for (name, want) in &manifest.files {
        let path = dir.join(name);
        if !path.is_file() {
            return Err(bad_checkpoint(
                dir,
                format!("incomplete: {name} is missing"),
            ));
        }
        let got = digest(&path)?;
        if got.bytes != want.bytes {
            return Err(bad_checkpoint(
                dir,
                format!(
                    "corrupted: {name} is {} bytes, the manifest says {} (a truncated or partial copy?)",
                    got.bytes, want.bytes
                ),
            ));
        }
        if got.sha256 != want.sha256 {
            return Err(bad_checkpoint(
                dir,
                format!("corrupted: {name} does not match the SHA-256 its manifest recorded"),
            ));
        }
    }
    Ok(())
}

/// The checkpoint's policy has the configured policy's parameter tensors, shape for shape.
fn check_parameters(dir: &Path, manifest: &Manifest, here: &[(String, Vec<usize>)]) -> Result<()> {
    let there = &manifest.parameters;
    if here.len() != there.len() {
        return Err(bad_checkpoint(
            dir,
            format!(
                "another model: the checkpoint's policy has {} parameter tensors, the configured one {} (a different layer count?)",
                there.len(),
                here.len()
            ),
        ));
    }
    if let Some(((name, then), (_, now))) = there.iter().zip(here).find(|((_, a), (_, b))| a != b) {
        return Err(bad_checkpoint(
            dir,
            format!("another model: {name} is {then:?} in the checkpoint, {now:?} in the configured model"),
        ));
    }
    Ok(())
}

/// The learner settings a resume must keep ([`KEPT_ON_RESUME`]) are the checkpoint's.
fn check_kept_settings<C: serde::Serialize>(dir: &Path, saved: &C, now: &C) -> Result<()> {
    let saved = serde_json::to_value(saved).expect("settings serialize");
    let now = serde_json::to_value(now).expect("settings serialize");
    for key in KEPT_ON_RESUME {
        if saved.get(key) != now.get(key) {
            let show = |v: Option<&serde_json::Value>| {
                v.map(|v| v.to_string()).unwrap_or_else(|| "unset".into())
            };
            return Err(bad_checkpoint(
                dir,
                format!(
                    "learner.{key} was {} for this run, now {}: a resume must keep it (configs/README.md lists what may change)",
                    show(saved.get(key)),
                    show(now.get(key))
                ),
            ));
        }
    }
    Ok(())
}
