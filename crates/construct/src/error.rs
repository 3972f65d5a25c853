//! The crate's error type.

use std::path::PathBuf;

/// Everything that can stop a build before it runs or while writing its artifacts. Failed model
/// calls are not errors: they mark their prompt as failed and the build goes on.
#[derive(Debug, thiserror::Error)]
pub enum ConstructError {
    /// A file could not be read or written.
    #[error("{}: {message}", path.display())]
    File { path: PathBuf, message: String },
    /// TOML text that does not parse.
    #[error("{message}")]
    Toml { message: String },
    /// An error inside a config file.
    #[error("{}: {source}", path.display())]
    InFile {
        path: PathBuf,
        source: Box<ConstructError>,
    },
    /// A config value is missing or out of range.
    #[error("{field}: {message}")]
    Config { field: String, message: String },
    /// The prompt input is malformed.
    #[error(transparent)]
    Rubric(#[from] conrub_rubric::RubricError),
    /// An artifact file could not be written.
    #[error(transparent)]
    Write(#[from] conrub_rubric::io::FileError),
    /// A client or cache could not be built.
    #[error(transparent)]
    Judge(#[from] conrub_judge::JudgeError),
}

impl ConstructError {
    pub(crate) fn config(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Config {
            field: field.into(),
            message: message.into(),
        }
    }

    pub(crate) fn file(path: impl Into<PathBuf>, message: impl ToString) -> Self {
        Self::File {
            path: path.into(),
            message: message.to_string(),
        }
    }
}

/// Result alias of this crate.
pub type Result<T, E = ConstructError> = std::result::Result<T, E>;
