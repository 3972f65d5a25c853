//! The crate's error type.

use std::path::PathBuf;

/// A failed exchange with a rollout server, naming the server (and the field, for a reply that
/// is not what was asked for). The server is shown without a user, password or query
/// ([`conrub_base::shown_url`]).
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// The server could not be reached, timed out or answered with an error status, after the
    /// configured retries.
    #[error("{}: {message}", conrub_base::shown_url(url))]
    Server {
        /// The server's base URL.
        url: String,
        /// What happened on the last attempt.
        message: String,
    },
    /// A reply whose content is wrong: missing, malformed or inconsistent.
    #[error("{}: {field}: {message}", conrub_base::shown_url(url))]
    Reply {
        /// The server's base URL.
        url: String,
        /// The field, as a path into the reply (`[2].meta_info.finish_reason`).
        field: String,
        /// What is wrong with it.
        message: String,
    },
    /// The server did not take the new weights: the run stops rather than train on rollouts of
    /// stale weights.
    #[error("{}: weight update to {}: {message}", conrub_base::shown_url(url), path.display())]
    WeightUpdate {
        /// The server's base URL.
        url: String,
        /// The directory it was told to load.
        path: PathBuf,
        /// The server's message.
        message: String,
    },
    /// Writing the weights for the servers failed.
    #[error("writing weights to {}: {message}", path.display())]
    Write {
        /// The directory.
        path: PathBuf,
        /// The cause.
        message: String,
    },
    /// A setting that cannot work.
    #[error("rollout.{key}: {message}")]
    Config {
        /// The key under `[rollout]`.
        key: String,
        /// Why.
        message: String,
    },
}

impl From<RemoteError> for conrub_contracts::ContractError {
    fn from(e: RemoteError) -> Self {
        conrub_contracts::ContractError::Engine(Box::new(e))
    }
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, RemoteError>;
