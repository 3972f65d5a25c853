//! The architectures the offline compile knows, with their limits, and its error.

use std::path::PathBuf;

/// What went wrong in an offline compile.
#[derive(Debug, thiserror::Error)]
pub enum OfflineError {
    /// An architecture this module has no limits for, or a malformed name.
    #[error("architecture `{0}`: expected sm_80 or sm_90")]
    Arch(String),
    /// NVRTC, ptxas or the headers are missing or unusable.
    #[error("CUDA tools at {root}: {reason}")]
    Tools {
        /// Where they were looked for.
        root: PathBuf,
        /// What is missing.
        reason: String,
    },
    /// CubeCL, NVRTC or ptxas rejected a kernel.
    #[error("kernel {kernel} does not compile: {reason}")]
    Compile {
        /// The kernel and configuration.
        kernel: String,
        /// The compiler's message.
        reason: String,
    },
    /// A file could not be written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

/// An NVIDIA architecture (compute capability), with the per-SM limits of its data-center part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arch {
    /// Compute capability times ten: 90 for sm_90.
    pub sm: u16,
}

/// Per-SM and per-block limits of an architecture (CUDA programming guide, compute capability
/// table), and the part's SM count and memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SmLimits {
    /// Streaming multiprocessors (H200 SXM: 132; A100: 108).
    pub sms: u32,
    /// Device memory, bytes.
    pub device_memory: u64,
    /// 32-bit registers per SM.
    pub registers_per_sm: u32,
    /// Registers are given to a warp in units of this many.
    pub register_unit: u32,
    /// Resident threads per SM.
    pub threads_per_sm: u32,
    /// Resident blocks per SM.
    pub blocks_per_sm: u32,
    /// Shared memory per SM, bytes.
    pub shared_per_sm: usize,
    /// Shared memory one block may opt in to, bytes.
    pub max_shared_per_block: usize,
    /// Shared memory the system reserves per block, bytes.
    pub reserved_shared_per_block: usize,
}

impl Arch {
    /// Hopper (H100, H200).
    pub const SM90: Arch = Arch { sm: 90 };

    /// Parses `sm_90`, `sm_90a`, `compute_90` or `90`.
    pub fn parse(name: &str) -> Result<Self, OfflineError> {
        let digits = name
            .trim()
            .trim_start_matches("sm_")
            .trim_start_matches("compute_")
            .trim_end_matches('a');
        match digits.parse::<u16>() {
            Ok(sm @ (80 | 90)) => Ok(Self { sm }),
            _ => Err(OfflineError::Arch(name.to_string())),
        }
    }

    /// The name NVRTC (`--gpu-architecture`, as CubeCL passes it) and ptxas (`-arch`) take:
    /// `sm_90a` from Hopper on (its architecture-specific features), `sm_80` before.
    pub fn real_name(self) -> String {
        if self.sm >= 90 {
            format!("sm_{}a", self.sm)
        } else {
            format!("sm_{}", self.sm)
        }
    }

    /// The limits of the architecture's data-center part.
    pub fn limits(self) -> SmLimits {
        match self.sm {
            80 => SmLimits {
                sms: 108,
                device_memory: 80 << 30,
                registers_per_sm: 65_536,
                register_unit: 256,
                threads_per_sm: 2048,
                blocks_per_sm: 32,
                shared_per_sm: 164 * 1024,
                max_shared_per_block: 163 * 1024,
                reserved_shared_per_block: 1024,
            },
            _ => SmLimits {
                sms: 132,
                device_memory: 143_771 << 20,
                registers_per_sm: 65_536,
                register_unit: 256,
                threads_per_sm: 2048,
                blocks_per_sm: 32,
                shared_per_sm: 228 * 1024,
                max_shared_per_block: 227 * 1024,
                reserved_shared_per_block: 1024,
            },
        }
    }
}
