//! The crate's one error type.

/// What stops a group of data-parallel ranks.
#[derive(Debug, thiserror::Error)]
pub enum ParallelError {
    /// A data-parallel rank failed; the other ranks stop with its error.
    #[error("rank {rank} failed: {message}")]
    RankFailed {
        /// The rank that failed first.
        rank: usize,
        /// Its error.
        message: String,
    },
    /// A data-parallel rank's thread panicked.
    #[error("rank {rank} panicked: {message}")]
    RankPanicked {
        /// The rank.
        rank: usize,
        /// The panic's message.
        message: String,
    },
    /// A rank waited longer than the collective's timeout for the others.
    #[error(
        "rank {rank} waited {secs:.1} s in a collective for {}",
        missing.iter().map(|r| format!("rank {r}")).collect::<Vec<_>>().join(", ")
    )]
    CollectiveTimeout {
        /// The rank that gave up.
        rank: usize,
        /// The timeout.
        secs: f64,
        /// The ranks that had not arrived.
        missing: Vec<usize>,
    },
    /// A collective or a layout got input of the wrong size, or a device read failed.
    #[error("stage output: {0}")]
    Stage(String),
    /// The policy's backward pass failed on a gradient path.
    #[error(transparent)]
    Policy(#[from] conrub_contracts::ContractError),
}

/// `Result` with [`ParallelError`].
pub type Result<T> = std::result::Result<T, ParallelError>;
