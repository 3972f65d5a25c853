//! Backend selection: cargo features decide which backends exist, `--device` picks one at run time.

use anyhow::{bail, Result};
use conrub_kernels::GrpoOps;

/// Work that runs on whichever backend `--device` selects.
pub trait BackendTask {
    /// Runs on backend `B` and device `device`.
    fn run<B: GrpoOps>(self, device: B::Device) -> Result<()>;
}

/// `--precision` of the commands that load a model: `f32` or `bf16-mixed`.
pub fn parse_precision(s: &str) -> std::result::Result<conrub_qwen3::Precision, String> {
    conrub_qwen3::Precision::parse(s).ok_or_else(|| {
        format!(
            "`{s}` is not a precision (allowed: {})",
            conrub_qwen3::Precision::NAMES
        )
    })
}

/// The model's execution settings for `--precision` (fused attention, no checkpointing: these
/// commands do not train).
pub fn inference_execution(precision: conrub_qwen3::Precision) -> conrub_qwen3::Execution {
    conrub_qwen3::Execution {
        precision,
        ..Default::default()
    }
}

/// Devices accepted by `--device`.
pub const DEVICE_HELP: &str = "cpu (default), ndarray, flex, wgpu[:N], cuda[:N], tch[:cpu|:cuda:N]";

fn missing(feature: &str, device: &str) -> Result<()> {
    bail!(
        "device `{device}` needs the `{feature}` backend, which this build does not have; \
         rebuild with `cargo build --release --features {feature}`"
    )
}

fn index(spec: &str, prefix: &str) -> Result<usize> {
    match spec.strip_prefix(prefix) {
        None | Some("") => Ok(0),
        Some(rest) => match rest.strip_prefix(':').map(str::parse::<usize>) {
            Some(Ok(i)) => Ok(i),
            _ => bail!("invalid device `{spec}`: expected {prefix} or {prefix}:N"),
        },
    }
}

/// Parses `spec` and runs `task` on that device.
// Each arm returns from whichever of its feature-gated statements this build keeps; with some
// feature sets that `return` is the last statement of its block.
#[allow(clippy::needless_return)]
pub fn run_on_device<T: BackendTask>(spec: &str, task: T) -> Result<()> {
    match spec {
        "cpu" => {
            #[cfg(feature = "flex")]
            return run_on_device("flex", task);
            #[cfg(all(not(feature = "flex"), feature = "ndarray"))]
            return run_on_device("ndarray", task);
            #[cfg(not(any(feature = "flex", feature = "ndarray")))]
            return missing("ndarray", spec);
        }
        "ndarray" => {
            #[cfg(feature = "ndarray")]
            return task.run::<burn::backend::NdArray<f32>>(Default::default());
            #[cfg(not(feature = "ndarray"))]
            return missing("ndarray", spec);
        }
        "flex" => {
            #[cfg(feature = "flex")]
            return task.run::<burn::backend::Flex>(Default::default());
            #[cfg(not(feature = "flex"))]
            return missing("flex", spec);
        }
        s if s.starts_with("wgpu") => {
            let i = index(s, "wgpu")?;
            #[cfg(feature = "wgpu")]
            {
                use burn::backend::wgpu::WgpuDevice;
                let device = if s == "wgpu" { WgpuDevice::DefaultDevice } else { WgpuDevice::DiscreteGpu(i) };
                return task.run::<burn::backend::Wgpu>(device);
            }
            #[cfg(not(feature = "wgpu"))]
            {
                let _ = i;
                missing("wgpu", spec)
            }
        }
        s if s.starts_with("cuda-bf16") => bail!(
            "device `{s}`: pure-bf16 training was removed (bf16 weights and AdamW moments cannot take steps of lr 3e-6: most \
             updates round away); use `cuda{}` with `precision = \"bf16-mixed\"` (bf16 compute, f32 master weights)",
            s.trim_start_matches("cuda-bf16")
        ),
        s if s.starts_with("cuda") => {
            let i = index(s, "cuda")?;
            #[cfg(feature = "cuda")]
            return task.run::<burn::backend::Cuda>(burn::backend::cuda::CudaDevice::new(i));
            #[cfg(not(feature = "cuda"))]
            {
                let _ = i;
                missing("cuda", spec)
            }
        }
        s if s.starts_with("tch") => {
            #[cfg(feature = "tch")]
            {
                use burn::backend::libtorch::LibTorchDevice;
                let device = match s {
                    "tch" | "tch:cpu" => LibTorchDevice::Cpu,
                    _ => LibTorchDevice::Cuda(index(s.trim_start_matches("tch:"), "cuda")?),
                };
                return task.run::<burn::backend::LibTorch>(device);
            }
            #[cfg(not(feature = "tch"))]
            return missing("tch", spec);
        }
        other => bail!("unknown device `{other}`; expected one of: {DEVICE_HELP}"),
    }
}
