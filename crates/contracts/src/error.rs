//! The crate's one error type: what a model, a codec or a rollout engine reports through the
//! contracts.

/// What can go wrong on the far side of a contract: a setting out of range, a device readback,
/// a capability the model lacks, a prompt that does not render, ids that do not decode, an engine
/// in another process.
#[derive(Debug, thiserror::Error)]
pub enum ContractError {
    /// A setting or an input is out of range.
    #[error("invalid argument `{name}`: {message}")]
    Argument {
        /// The setting or input.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// Sampled tokens could not be read back from the device.
    #[error("reading sampled tokens from the device: {0}")]
    Readback(String),
    /// The model cannot do what a setting asks; `key` names the setting as a train config spells
    /// it (`learner.activation_checkpointing`).
    #[error("{key}: {message}")]
    Unsupported {
        /// The config key.
        key: String,
        /// Why the model cannot.
        message: String,
    },
    /// A prompt could not be rendered into token ids.
    #[error("prompt {id}: {message}")]
    Prompt {
        /// The record id (empty when the caller has none).
        id: String,
        /// The codec's message.
        message: String,
    },
    /// Token ids could not be turned back into text.
    #[error("decoding a response: {0}")]
    Decode(String),
    /// A rollout engine outside the process (an inference server) failed.
    #[error("rollout engine: {0}")]
    Engine(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// A replaceable stage (a rollout engine) returned output of the wrong size.
    #[error("stage output: {0}")]
    Stage(String),
    /// Writing a model out failed.
    #[error("export to {}: {message}", path.display())]
    Export {
        /// The target directory.
        path: std::path::PathBuf,
        /// The exporter's message.
        message: String,
    },
}

impl ContractError {
    /// A [`ContractError::Argument`] error.
    pub fn arg(name: &str, message: impl Into<String>) -> Self {
        ContractError::Argument {
            name: name.into(),
            message: message.into(),
        }
    }
}

/// `Result` with [`ContractError`].
pub type Result<T> = std::result::Result<T, ContractError>;
