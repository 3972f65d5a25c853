//! The crate's one error type.

use std::path::PathBuf;

/// What can go wrong in the learner and its collaborators.
#[derive(Debug, thiserror::Error)]
pub enum GrpoError {
    /// A setting is out of range; `key` names it as it appears in a train config (`learner.lr`).
    #[error("{key}: {message}")]
    Config {
        /// The config key.
        key: String,
        /// What is wrong with it.
        message: String,
    },
    /// A prompt could not be rendered into token ids.
    #[error("prompt {id}: {message}")]
    Prompt {
        /// The record id.
        id: String,
        /// The codec's message.
        message: String,
    },
    /// Token ids could not be turned back into text.
    #[error("decoding a response: {0}")]
    Decode(String),
    /// The policy or its engine failed to sample.
    #[error("sampling: {0}")]
    Sampling(conrub_contracts::ContractError),
    /// Reading or writing a file of the run failed.
    #[error("{}: {message}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        message: String,
    },
    /// A rollout engine outside the process (an inference server) failed.
    #[error("rollout engine: {0}")]
    Engine(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// Exporting the policy (e.g. as a Hugging Face directory) failed.
    #[error("export to {}: {message}", path.display())]
    Export {
        /// The target directory.
        path: PathBuf,
        /// The exporter's message.
        message: String,
    },
    /// A replaceable stage returned output of the wrong size.
    #[error("stage output: {0}")]
    Stage(String),
    /// Training produced a non-finite number (a loss, a gradient norm, a weight): the run stops
    /// before that update and before any checkpoint of it.
    #[error("{at}: {what}; the run stopped before writing it (lower the learning rate, or see learner.on_nonfinite)")]
    NonFinite {
        /// Where: `step 12`, `warm-up step 3`.
        at: String,
        /// The quantity and its value.
        what: String,
    },
    /// The judge left too many responses unscored for too many steps in a row.
    #[error("step {step}: {steps} steps in a row scored less than reward.min_scored_share = {min} of their responses (this one {:.1}%), and none updated the policy; the judge's last error: {last}", share * 100.0)]
    Unscored {
        /// The step.
        step: u64,
        /// Steps in a row below the share.
        steps: usize,
        /// This step's scored share.
        share: f64,
        /// `reward.min_scored_share`.
        min: f64,
        /// The judge's last message.
        last: String,
    },
    /// A checkpoint cannot be resumed: not a checkpoint, corrupted, of another model, or of a
    /// run with other settings that a resume must keep.
    #[error("checkpoint {}: {message}", dir.display())]
    Checkpoint {
        /// The state directory.
        dir: PathBuf,
        /// What is wrong, in a user's words.
        message: String,
    },
    /// A JSONL file of the run (samples) could not be read or written; names the file and line.
    #[error(transparent)]
    Jsonl(#[from] conrub_rubric::RubricError),
    /// There is nothing to train on.
    #[error("no rubric records to train on")]
    NoRecords,
    /// The data-parallel group failed (a rank's error, a collective's timeout).
    #[error(transparent)]
    Parallel(conrub_parallel::ParallelError),
}

/// A group's error; a policy's error on a gradient path keeps its kind.
impl From<conrub_parallel::ParallelError> for GrpoError {
    fn from(e: conrub_parallel::ParallelError) -> Self {
        match e {
            conrub_parallel::ParallelError::Policy(c) => c.into(),
            other => GrpoError::Parallel(other),
        }
    }
}

impl GrpoError {
    /// A [`GrpoError::Config`] error.
    pub fn config(key: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Config {
            key: key.into(),
            message: message.into(),
        }
    }

    /// A [`GrpoError::Io`] error.
    pub fn io(path: impl Into<PathBuf>, cause: impl std::fmt::Display) -> Self {
        Self::Io {
            path: path.into(),
            message: cause.to_string(),
        }
    }
}

/// A contract's error in the learner's words: a setting the model cannot honour is a config
/// error naming its key, a prompt, decode or engine failure keeps its kind, the rest is sampling.
impl From<conrub_contracts::ContractError> for GrpoError {
    fn from(e: conrub_contracts::ContractError) -> Self {
        use conrub_contracts::ContractError as C;
        match e {
            C::Unsupported { key, message } => GrpoError::Config { key, message },
            C::Prompt { id, message } => GrpoError::Prompt { id, message },
            C::Decode(m) => GrpoError::Decode(m),
            C::Engine(e) => GrpoError::Engine(e),
            C::Export { path, message } => GrpoError::Export { path, message },
            C::Stage(m) => GrpoError::Stage(m),
            other => GrpoError::Sampling(other),
        }
    }
}

/// `Result` with [`GrpoError`].
pub type Result<T> = std::result::Result<T, GrpoError>;

impl From<conrub_settings::SettingsError> for GrpoError {
    fn from(e: conrub_settings::SettingsError) -> Self {
        match e {
            conrub_settings::SettingsError::Key { key, message } => {
                GrpoError::Config { key, message }
            }
            other => GrpoError::Config {
                key: "learner".into(),
                message: other.to_string(),
            },
        }
    }
}
