//! The crate's error type.

/// What is wrong with evaluation input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EvalError {
    /// `--format` names no known multiple-choice format.
    #[error("`{0}` is not a known format (allowed: medmcqa, pubmedqa, mmlu)")]
    UnknownFormat(String),
    /// A data row is malformed.
    #[error("line {line}: {message}")]
    Row {
        /// 1-based line of the file.
        line: usize,
        /// What is wrong with it.
        message: String,
    },
}
