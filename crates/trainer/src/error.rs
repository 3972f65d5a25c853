//! The crate's one error type.

use std::path::PathBuf;

/// What stops a run before or while it trains; each variant keeps the error of the crate that
/// raised it.
#[derive(Debug, thiserror::Error)]
pub enum TrainerError {
    /// The run config is wrong (file, key and what is wrong).
    #[error(transparent)]
    Config(#[from] conrub_config::ConfigError),
    /// The learner or the training loop failed.
    #[error(transparent)]
    Learner(#[from] conrub_grpo::GrpoError),
    /// The reward functions could not be built, or refuse a prompt.
    #[error(transparent)]
    Reward(#[from] conrub_rewards::RewardError),
    /// The policy could not be loaded or written.
    #[error(transparent)]
    Model(#[from] conrub_models::ModelError),
    /// A judge could not be built.
    #[error(transparent)]
    Judge(#[from] conrub_judge::JudgeError),
    /// The rubric records could not be read.
    #[error(transparent)]
    Rubric(#[from] conrub_rubric::RubricError),
    /// The SGLang rollout engine could not be set up.
    #[error(transparent)]
    Remote(#[from] conrub_remote::RemoteError),
    /// A contract's error (a codec, an export).
    #[error(transparent)]
    Contract(#[from] conrub_contracts::ContractError),
    /// A setting is out of range (`learner.lr`, `run.prompts_per_step`).
    #[error(transparent)]
    Settings(#[from] conrub_settings::SettingsError),
    /// A file the run needs is refused; the message names what to change.
    #[error("{}: {message}", path.display())]
    Input {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// A stage of the set-up failed (the message names the stage).
    #[error("{0}")]
    Setup(String),
    /// Reading or writing a file of the run failed.
    #[error("{}: {message}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        message: String,
    },
    /// A run folder cannot be used: it is a file, cannot be written, is in use by another
    /// run, or holds an earlier run that a fresh one would overwrite.
    #[error("run folder {}: {message}", dir.display())]
    RunFolder {
        /// The folder.
        dir: PathBuf,
        /// Why, and what to do.
        message: String,
    },
    /// A [`RunHooks`](crate::RunHooks) callback other than the export failed.
    #[error("run hook: {0}")]
    Hook(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// There is nothing to train on.
    #[error("no rubric records to train on")]
    NoRecords,
}

impl TrainerError {
    /// A [`TrainerError::Io`] error.
    pub fn io(path: impl Into<PathBuf>, cause: impl std::fmt::Display) -> Self {
        Self::Io {
            path: path.into(),
            message: cause.to_string(),
        }
    }
}

/// `Result` with [`TrainerError`].
pub type Result<T> = std::result::Result<T, TrainerError>;
