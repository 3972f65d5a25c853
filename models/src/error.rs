//! The crate's error type.

use std::path::{Path, PathBuf};

/// Everything that can go wrong while loading, running or saving a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A JSON file did not parse.
    #[error("{path}: invalid JSON: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The cause, with line and column.
        source: serde_json::Error,
    },
    /// A config field has a value this implementation cannot use.
    #[error("{}field `{field}`: {message}", path.as_ref().map(|p| format!("{}: ", p.display())).unwrap_or_default())]
    Config {
        /// The config file, when known.
        path: Option<PathBuf>,
        /// The offending field.
        field: String,
        /// What is wrong.
        message: String,
    },
    /// A weight file is unreadable or does not match the model.
    #[error("{file}: tensor `{tensor}`: {message}")]
    Weights {
        /// The safetensors file (or index).
        file: PathBuf,
        /// The tensor name.
        tensor: String,
        /// What is wrong.
        message: String,
    },
    /// A model directory lacks a required file.
    #[error("{dir}: {message}")]
    ModelDir {
        /// The directory.
        dir: PathBuf,
        /// What is missing.
        message: String,
    },
    /// The model could not be fetched from the hub.
    #[error("model `{model}`: {message}")]
    Hub {
        /// The model id.
        model: String,
        /// What went wrong and what to do.
        message: String,
    },
    /// Tokenizer or chat template failure.
    #[error("{context}: {message}")]
    Tokenizer {
        /// The file or step.
        context: String,
        /// What went wrong.
        message: String,
    },
    /// The rollout engine refused a call or failed.
    #[error(transparent)]
    Rollout(#[from] conrub_contracts::ContractError),
}

impl ModelError {
    /// A `config.json` error naming `field` (the caller that knows the file adds its path).
    pub(crate) fn config(field: &str, message: impl Into<String>) -> Self {
        ModelError::Config {
            path: None,
            field: field.to_string(),
            message: message.into(),
        }
    }

    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        ModelError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, ModelError>;
