//! The crate's error type.

use std::path::PathBuf;

/// Errors building or configuring a judge. Failures of individual judge calls are not errors: they
/// end as verdicts without labels (the response is then *unscored*).
#[derive(Debug, thiserror::Error)]
pub enum JudgeError {
    /// A file could not be read or written.
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
    /// A configuration value is missing or out of range.
    #[error("{field}: {message}")]
    Config { field: String, message: String },
    /// The judge cache database failed.
    #[error("judge cache {path}: {message}")]
    Cache { path: PathBuf, message: String },
    /// The HTTP client could not be built.
    #[error("http client: {0}")]
    Http(String),
    /// The in-process model failed.
    #[error("local judge: {0}")]
    Model(String),
}

impl JudgeError {
    /// A configuration error naming `field`.
    pub fn config(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Config {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// Result alias of this crate.
pub type Result<T, E = JudgeError> = std::result::Result<T, E>;
