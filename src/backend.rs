//! Backend selection: cargo features decide which backends exist, `--device` picks one at run time.

use std::sync::Arc;

use anyhow::{bail, Result};
use conrub_config::backend_of;
use conrub_grpo::{Collective, HostCollective};
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

/// The collective of a backend's data-parallel ranks: NCCL between CUDA devices, the host
/// collective (fixed rank order, bit-reproducible) everywhere else.
pub trait RankCollective: GrpoOps {
    /// The group of `devices`, rank `r` on `devices[r]`.
    fn rank_collective(devices: &[Self::Device]) -> Arc<dyn Collective<Self>> {
        Arc::new(HostCollective::new(devices.len()))
    }
}

#[cfg(feature = "flex")]
impl RankCollective for burn::backend::Flex {}
#[cfg(feature = "ndarray")]
impl RankCollective for burn::backend::NdArray<f32> {}
#[cfg(feature = "wgpu")]
impl RankCollective for burn::backend::Wgpu {}
#[cfg(feature = "tch")]
impl RankCollective for burn::backend::LibTorch {}
#[cfg(feature = "cuda")]
impl RankCollective for burn::backend::Cuda {
    fn rank_collective(devices: &[Self::Device]) -> Arc<dyn Collective<Self>> {
        Arc::new(conrub_grpo::NcclCollective::new::<Self>(devices))
    }
}

/// Work that runs on one or more devices of one backend: the ranks of a data-parallel run.
pub trait DevicesTask {
    /// Runs on backend `B` and `devices` (at least one, in the order given).
    fn run<B: RankCollective>(self, devices: Vec<B::Device>) -> Result<()>;
}

/// A one-device task as a [`DevicesTask`].
struct One<T>(T);

impl<T: BackendTask> DevicesTask for One<T> {
    fn run<B: RankCollective>(self, devices: Vec<B::Device>) -> Result<()> {
        let device = devices.into_iter().next().expect("one device");
        self.0.run::<B>(device)
    }
}

/// Parses `spec` and runs `task` on that device.
pub fn run_on_device<T: BackendTask>(spec: &str, task: T) -> Result<()> {
    run_on_devices(&[spec.to_string()], One(task))
}

/// Parses `specs` (all of one backend) and runs `task` on those devices.
// Each arm returns from whichever of its feature-gated statements this build keeps; with some
// feature sets that `return` is the last statement of its block.
#[allow(clippy::needless_return)]
pub fn run_on_devices<T: DevicesTask>(specs: &[String], task: T) -> Result<()> {
    let Some(first) = specs.first() else {
        bail!("no device given");
    };
    if let Some(other) = specs.iter().find(|s| backend_of(s) != backend_of(first)) {
        bail!("devices `{first}` and `{other}`: every rank runs on one backend");
    }
    match first.as_str() {
        "cpu" => {
            #[cfg(feature = "flex")]
            return run_on_devices(&vec!["flex".to_string(); specs.len()], task);
            #[cfg(all(not(feature = "flex"), feature = "ndarray"))]
            return run_on_devices(&vec!["ndarray".to_string(); specs.len()], task);
            #[cfg(not(any(feature = "flex", feature = "ndarray")))]
            return missing("ndarray", first);
        }
        "ndarray" => {
            #[cfg(feature = "ndarray")]
            return task.run::<burn::backend::NdArray<f32>>(vec![Default::default(); specs.len()]);
            #[cfg(not(feature = "ndarray"))]
            return missing("ndarray", first);
        }
        "flex" => {
            #[cfg(feature = "flex")]
            return task.run::<burn::backend::Flex>(vec![Default::default(); specs.len()]);
            #[cfg(not(feature = "flex"))]
            return missing("flex", first);
        }
        s if s.starts_with("wgpu") => {
            let indices = specs
                .iter()
                .map(|s| index(s, "wgpu"))
                .collect::<Result<Vec<_>>>()?;
            #[cfg(feature = "wgpu")]
            {
                use burn::backend::wgpu::WgpuDevice;
                let devices = specs
                    .iter()
                    .zip(indices)
                    .map(|(s, i)| {
                        if s == "wgpu" {
                            WgpuDevice::DefaultDevice
                        } else {
                            WgpuDevice::DiscreteGpu(i)
                        }
                    })
                    .collect();
                return task.run::<burn::backend::Wgpu>(devices);
            }
            #[cfg(not(feature = "wgpu"))]
            {
                let _ = indices;
                missing("wgpu", first)
            }
        }
        s if s.starts_with("cuda-bf16") => bail!(
            "device `{s}`: pure-bf16 training was removed (bf16 weights and AdamW moments cannot take steps of lr 3e-6: most \
             updates round away); use `cuda{}` with `precision = \"bf16-mixed\"` (bf16 compute, f32 master weights)",
            s.trim_start_matches("cuda-bf16")
        ),
        s if s.starts_with("cuda") => {
            let indices = specs
                .iter()
                .map(|s| index(s, "cuda"))
                .collect::<Result<Vec<_>>>()?;
            #[cfg(feature = "cuda")]
            return task.run::<burn::backend::Cuda>(
                indices
                    .into_iter()
                    .map(burn::backend::cuda::CudaDevice::new)
                    .collect(),
            );
            #[cfg(not(feature = "cuda"))]
            {
                let _ = indices;
                missing("cuda", first)
            }
        }
        s if s.starts_with("tch") => {
            #[cfg(feature = "tch")]
            {
                use burn::backend::libtorch::LibTorchDevice;
                let devices = specs
                    .iter()
                    .map(|s| {
                        Ok(match s.as_str() {
                            "tch" | "tch:cpu" => LibTorchDevice::Cpu,
                            _ => LibTorchDevice::Cuda(index(s.trim_start_matches("tch:"), "cuda")?),
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                return task.run::<burn::backend::LibTorch>(devices);
            }
            #[cfg(not(feature = "tch"))]
            return missing("tch", first);
        }
        other => bail!("unknown device `{other}`; expected one of: {DEVICE_HELP}"),
    }
}
