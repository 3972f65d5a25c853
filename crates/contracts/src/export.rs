//! Writing a trained policy out in its deployable format.

use std::path::Path;

use crate::error::Result;

/// Writes a policy `P` into a directory in the format its serving stack loads (a Hugging Face
/// directory for the `models/` families: weights, `config.json`, tokenizer files). `conrub train`'s
/// checkpoint hook (`conrub_grpo::RunHooks::export`) calls it with the directory each checkpoint
/// creates; the training state goes next to what it writes (`dir/training_state`). An exporter holds what the policy alone does not know: its
/// config, the tokenizer files to copy, the dtype to save in.
pub trait Export<P>: Send + Sync {
    /// Writes `policy` into `dir` (created when missing; every file written atomically).
    fn export(&self, policy: &P, dir: &Path) -> Result<()>;
}
