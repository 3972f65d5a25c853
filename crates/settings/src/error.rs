//! The crate's one error type.

use std::path::PathBuf;

/// What is wrong with a setting: the dotted key and why, or the file that holds it.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    /// A key is missing, unknown, of the wrong type or out of range.
    #[error("{key}: {message}")]
    Key {
        /// The key, dotted from the top of its table (`learner.lr`, `judge.keywords`).
        key: String,
        /// What is wrong with it.
        message: String,
    },
    /// A settings file could not be read.
    #[error("{}: {source}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// TOML text that does not parse.
    #[error("{message}")]
    Toml {
        /// The parser's message, with line and column.
        message: String,
    },
    /// An error inside a settings file (a judge file named by `config = "FILE"`).
    #[error("{}: {source}", path.display())]
    InFile {
        /// The file.
        path: PathBuf,
        /// What is wrong in it.
        source: Box<SettingsError>,
    },
}

impl SettingsError {
    /// A key's error.
    pub fn key(key: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Key {
            key: key.into(),
            message: message.into(),
        }
    }
}

/// `Result` with [`SettingsError`].
pub type Result<T> = std::result::Result<T, SettingsError>;
