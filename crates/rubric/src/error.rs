//! The crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong reading, importing or scoring rubrics.
#[derive(Debug, thiserror::Error)]
pub enum RubricError {
    /// A file could not be read or written.
    #[error("{path}: {err}")]
    Io {
        path: PathBuf,
        #[source]
        err: std::io::Error,
    },
    /// A JSONL line is not valid JSON or does not have the expected shape.
    #[error("{path}:{line}: {field}: {message}")]
    Parse {
        path: PathBuf,
        line: usize,
        field: String,
        message: String,
    },
    /// A value is well-formed JSON but not acceptable (e.g. a duplicate id).
    #[error("{path}:{line}: {message}")]
    Invalid {
        path: PathBuf,
        line: usize,
        message: String,
    },
    /// Labels do not fit the rubric or the scoring mode.
    #[error("{0}")]
    Labels(String),
    /// A record has no `ground_truth` where a check compares to one.
    #[error("the record has no `ground_truth`, which this function compares to")]
    MissingGroundTruth,
    /// A numeric check's `ground_truth` is not one number.
    #[error("`ground_truth` {truth:?} is not one number")]
    GroundTruthNotANumber {
        /// The record's ground truth.
        truth: String,
    },
    /// A configuration value is out of range.
    #[error("{field}: {message}")]
    Config { field: String, message: String },
}

/// Result alias of this crate.
pub type Result<T, E = RubricError> = std::result::Result<T, E>;

impl From<conrub_base::FileError> for RubricError {
    fn from(e: conrub_base::FileError) -> Self {
        Self::Io {
            path: e.path,
            err: e.source,
        }
    }
}
