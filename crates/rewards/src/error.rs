//! The crate's one error type.

/// What can go wrong building a reward source or checking a prompt against it.
#[derive(Debug, thiserror::Error)]
pub enum RewardError {
    /// A setting is out of range; `key` names it as it appears in a train config
    /// (`reward.functions[1].weight`).
    #[error("{key}: {message}")]
    Config {
        /// The config key.
        key: String,
        /// What is wrong with it.
        message: String,
    },
    /// A prompt the reward source cannot score (a verifiable check's missing or malformed
    /// `ground_truth`); the message says what is missing.
    #[error("{0}")]
    Unscorable(String),
    /// A function's options could not be read (the message names the key).
    #[error(transparent)]
    Rubric(#[from] conrub_rubric::RubricError),
}

/// `Result` with [`RewardError`].
pub type Result<T> = std::result::Result<T, RewardError>;
