//! What the kernels' checks refuse (the kernel cache has its own, `KernelCacheError`, for the
//! files it owns).

/// A backend or device that cannot run what was asked, or a device check that disagreed with
/// its reference.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KernelError {
    /// The backend on this device has no such attention kernels.
    #[error("{reason}")]
    NoAttentionKernels {
        /// The kernels asked for, by their config name (`AttentionKernels::name`).
        kernels: &'static str,
        /// What the device or backend lacks.
        reason: String,
    },
    /// The run's `attention_kernels` choice cannot run on the device.
    #[error("attention_kernels = \"{kernels}\": {reason}")]
    AttentionChoice {
        /// The kernels the choice named, by their config name.
        kernels: &'static str,
        /// Why they cannot run.
        reason: String,
    },
    /// A device check (`conrub kernels`' parity rows) found the device's result off its host
    /// reference, or could not read it back.
    #[error("{0}")]
    Check(String),
}
