//! Writing a trained policy out in its deployable format.

use std::path::Path;

use burn::tensor::DType;

use crate::error::Result;

/// Writes a policy `P` into a directory in the format its serving stack loads (a Hugging Face
/// directory for the `models/` families: weights, `config.json`, tokenizer files). `conrub train`'s
/// checkpoint hook (`conrub_trainer::RunHooks::export`) calls it with the directory each checkpoint
/// creates; the training state goes next to what it writes (`dir/training_state`). An exporter holds what the policy alone does not know: its
/// config, the tokenizer files to copy, the dtype to save in.
pub trait Export<P>: Send + Sync {
    /// Writes `policy` into `dir` (created when missing; every file written atomically).
    fn export(&self, policy: &P, dir: &Path) -> Result<()>;

    /// The dtype the export writes weight matrices in when it is narrower than the policy's
    /// (bf16 for a bf16 checkpoint); `None` (the default): as the policy holds them. A
    /// `sharding = "full"` group assembles its whole policy for the export with matrices in it,
    /// so the first device holds the exported bytes, not the f32 master weights.
    fn matrix_dtype(&self) -> Option<DType> {
        None
    }
}
