//! The crate's one error type.

use std::path::PathBuf;

/// What is wrong with a run config. Every message starts with the file and names the key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Read {
        /// The config file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The file is not valid TOML.
    #[error("{}: {message}", path.display())]
    Toml {
        /// The config file.
        path: PathBuf,
        /// The parser's message, with line and column.
        message: String,
    },
    /// A key is unknown, missing, of the wrong type or out of range.
    #[error("{}: {key}: {message}", path.display())]
    Key {
        /// The config file.
        path: PathBuf,
        /// The key, dotted from the top (`learner.lr`, `judge.keywords`).
        key: String,
        /// What is wrong with it.
        message: String,
    },
    /// A judge file named by `[judge]` or `[eval.grader]` (`config = "FILE"`) is wrong.
    #[error("{}: {source}", path.display())]
    Judge {
        /// The config file.
        path: PathBuf,
        /// The judge file's error.
        source: conrub_settings::SettingsError,
    },
    /// A `--set KEY=VALUE` override could not be applied.
    #[error("--set {spec}: {message}")]
    Override {
        /// The override as given.
        spec: String,
        /// What is wrong with it.
        message: String,
    },
}

/// `Result` with [`ConfigError`].
pub type Result<T> = std::result::Result<T, ConfigError>;
