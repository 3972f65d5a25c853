//! The pooling setting of a probe (a config key, so it exists in every build).

use serde::{Deserialize, Serialize};

/// How one row's hidden states over its criterion's span become one vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pooling {
    /// The state at the last prompt token, where the model would start its answer.
    Last,
    /// The mean over the criterion's span: every prompt token from the criterion's first to the
    /// end (criterion, label definitions, answer cue), fixed by the prompt alone, never by the
    /// criteria it shares a pass with.
    Mean,
}

impl Pooling {
    /// Every pooling, in sweep order.
    pub const ALL: [Pooling; 2] = [Pooling::Last, Pooling::Mean];

    /// The name used in files and flags.
    pub fn as_str(self) -> &'static str {
        match self {
            Pooling::Last => "last",
            Pooling::Mean => "mean",
        }
    }
}

impl std::str::FromStr for Pooling {
    type Err = crate::JudgeError;

    fn from_str(s: &str) -> crate::Result<Self> {
        Pooling::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| crate::JudgeError::Probe(format!("`{s}` is not a pooling (last, mean)")))
    }
}
