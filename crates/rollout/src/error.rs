//! The crate's error type.

/// What can go wrong in a rollout call.
#[derive(Debug, thiserror::Error)]
pub enum RolloutError {
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
}

impl RolloutError {
    pub(crate) fn arg(name: &str, message: impl Into<String>) -> Self {
        RolloutError::Argument {
            name: name.into(),
            message: message.into(),
        }
    }
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, RolloutError>;
