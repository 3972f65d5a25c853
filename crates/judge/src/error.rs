//! The crate's error type.

use std::path::PathBuf;

/// Errors building or configuring a judge. Failures of individual judge calls are not errors: they
/// end as verdicts without labels (the response is then *unscored*).
///
/// Each message names the file or key; where there is an underlying error it is kept as the
/// variant's source (and repeated in the message, so `to_string` alone says everything).
#[derive(Debug, thiserror::Error)]
pub enum JudgeError {
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A file's contents are not what it should hold (with the line where known).
    #[error("{}: {message}", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// What is wrong, with the parser's position.
        message: String,
    },
    /// An error inside a config file.
    #[error("{}: {source}", path.display())]
    InFile {
        /// The file.
        path: PathBuf,
        /// What is wrong in it.
        source: Box<JudgeError>,
    },
    /// TOML text that does not parse.
    #[error("{message}")]
    Toml {
        /// The parser's message, with line and column.
        message: String,
    },
    /// A judge config that does not read (a key, a file, TOML), as `conrub-settings` says.
    #[error(transparent)]
    Settings(#[from] conrub_settings::SettingsError),
    /// A configuration value is missing or out of range.
    #[error("{field}: {message}")]
    Config {
        /// The key, as a config names it (`judge.concurrency`, `local.batch_size`).
        field: String,
        /// What is wrong with it.
        message: String,
    },
    /// The judge cache database failed.
    #[error("judge cache {}: {source}", path.display())]
    Cache {
        /// The database file.
        path: PathBuf,
        /// The cause.
        source: rusqlite::Error,
    },
    /// The judge cache's directory could not be created.
    #[error("judge cache {}: {source}", path.display())]
    CacheDir {
        /// The database file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The HTTP client could not be built.
    #[error("http client: {0}")]
    Http(#[source] reqwest::Error),
    /// The in-process model could not be loaded.
    #[cfg(feature = "local")]
    #[error("local judge: {0}")]
    Model(#[source] Box<conrub_models::ModelError>),
    /// The in-process model cannot serve as a judge.
    #[error("local judge: {0}")]
    Unfit(String),
    /// A probe judge or its distillation cannot go on (bad data, a probe that does not fit).
    #[error("probe: {0}")]
    Probe(String),
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
