//! Backend selection: cargo features decide which backends exist, `--device` picks one at run time.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use anyhow::{bail, Result};
use conrub_config::backend_of;
use conrub_kernels::KernelOps;
use conrub_parallel::{Collective, HostCollective};

/// Work that runs on whichever backend `--device` selects.
pub trait BackendTask {
    /// Runs on backend `B` and device `device`.
    fn run<B: KernelOps>(self, device: B::Device) -> Result<()>;
}

/// `--precision` of the commands that load a model: `f32` or `bf16-mixed`.
pub fn parse_precision(s: &str) -> std::result::Result<conrub_models::Precision, String> {
    conrub_models::Precision::parse(s).ok_or_else(|| {
        format!(
            "`{s}` is not a precision (allowed: {})",
            conrub_models::Precision::NAMES
        )
    })
}

/// `--attention-kernels` of the commands that load a model: `auto`, `tensor-core`, `portable`.
pub fn parse_attention_kernels(
    s: &str,
) -> std::result::Result<conrub_models::AttentionKernelChoice, String> {
    conrub_models::AttentionKernelChoice::parse(s).ok_or_else(|| {
        format!(
            "`{s}` is not an attention kernel choice (allowed: {})",
            conrub_models::AttentionKernelChoice::NAMES
        )
    })
}

/// The model's execution settings for `--precision` and `--attention-kernels` on `device`
/// (fused attention, no checkpointing: these commands do not train). An error when the device
/// cannot run the kernels asked for.
pub fn inference_execution<B: KernelOps>(
    precision: conrub_models::Precision,
    attention_kernels: conrub_models::AttentionKernelChoice,
    device: &B::Device,
) -> Result<conrub_models::Execution> {
    let attention_kernels =
        conrub_kernels::resolve_attention_kernels::<B>(attention_kernels, device)
            .map_err(|why| anyhow::anyhow!("--attention-kernels: {why}"))?;
    Ok(conrub_models::Execution {
        precision,
        attention_kernels,
        ..Default::default()
    })
}

/// Where compiled kernels and autotune results are kept: `--kernel-cache`, else a run config's
/// `kernel_cache`, else `~/.cache/conrub/kernels`.
#[derive(Debug, Default)]
struct KernelCacheRoots {
    flag: Option<PathBuf>,
    config: Option<PathBuf>,
}

static KERNEL_CACHE_ROOTS: Mutex<KernelCacheRoots> = Mutex::new(KernelCacheRoots {
    flag: None,
    config: None,
});

/// `--kernel-cache DIR` (wins over a config's `kernel_cache`).
pub fn set_kernel_cache_flag(dir: Option<PathBuf>) {
    KERNEL_CACHE_ROOTS.lock().expect("not poisoned").flag = dir;
}

/// A run config's `kernel_cache`.
pub fn set_kernel_cache_config(dir: Option<PathBuf>) {
    KERNEL_CACHE_ROOTS.lock().expect("not poisoned").config = dir;
}

/// The kernel cache's root for this process.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn kernel_cache_root() -> PathBuf {
    let roots = KERNEL_CACHE_ROOTS.lock().expect("not poisoned");
    roots
        .flag
        .clone()
        .or(roots.config.clone())
        .unwrap_or_else(conrub_kernels::kernel_cache::default_root)
}

/// Points CubeCL at the kernel cache of the devices `identities` name (before they start) and
/// says where it is and what it holds, the first time in this process. The cache is skipped,
/// with a warning, when the devices are of different kinds (one folder cannot serve them) or
/// the folder or a device's name cannot be had: the run goes on, compiling as CubeCL would.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn prepare_kernel_cache(
    identities: Vec<
        std::result::Result<
            conrub_kernels::kernel_cache::DeviceIdentity,
            conrub_kernels::kernel_cache::KernelCacheError,
        >,
    >,
) {
    use conrub_kernels::kernel_cache::{install, installed, KernelCache};
    let first = installed().is_none();
    let opened = (|| -> Result<KernelCache> {
        let ids = identities
            .into_iter()
            .collect::<std::result::Result<Vec<_>, _>>()?;
        if let Some(other) = ids.iter().find(|i| **i != ids[0]) {
            bail!(
                "devices of different kinds ({} and {}) cannot share one",
                ids[0].folder(),
                other.folder()
            );
        }
        let cache = KernelCache::open(&kernel_cache_root(), ids[0].clone())?;
        install(&cache)?;
        Ok(cache)
    })();
    let cache = match opened {
        Ok(cache) => cache,
        Err(e) => {
            tracing::warn!("no kernel cache: {e:#}; kernels compile as CubeCL's defaults say");
            return;
        }
    };
    if first {
        let e = cache.entries();
        // Autotune results are kept on every backend, compiled kernels only where CubeCL can
        // (CUDA, SPIR-V): a cache with either is not cold.
        let _ = KERNEL_CACHE_COLD.set(e.compiled == 0 && e.autotune == 0);
        tracing::info!(
            "kernel cache: {} ({} compiled kernels, {} autotune results; {})",
            cache.dir.display(),
            e.compiled,
            e.autotune,
            cache.identity.name
        );
    }
}

/// Whether this process's kernel cache held no compiled kernel when the device started.
static KERNEL_CACHE_COLD: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// True when a CubeCL device started on an empty kernel cache in this process (what makes
/// `conrub train` run its kernel warm-up); false on the CPU backends and libtorch.
pub fn kernel_cache_was_cold() -> bool {
    KERNEL_CACHE_COLD.get().copied().unwrap_or(false)
}

/// The closing line of a command that ran kernels: how many were compiled (cache misses), loaded
/// from the kernel cache (hits) and autotuned; nothing when nothing was counted or happened.
pub fn report_kernel_events() {
    if let Some(e) = conrub_kernels::events::snapshot() {
        if e != Default::default() {
            tracing::info!(
                "kernels: {} compiled (cache misses), {} loaded from the kernel cache (hits), {} autotune runs",
                e.kernel_compiles, e.kernel_cache_loads, e.autotune_runs
            );
        }
    }
}

/// The memory of the device `spec` names, asked of its driver: CUDA devices (the memory plan is
/// checked against it); `None` for the others (no fixed device memory to check against).
pub fn device_memory_bytes(spec: &str) -> Result<Option<u64>> {
    if backend_of(spec) != "cuda" {
        return Ok(None);
    }
    #[cfg(feature = "cuda")]
    {
        let index = index(spec, "cuda")?;
        Ok(Some(conrub_kernels::kernel_cache::cuda_total_memory(
            index,
        )?))
    }
    #[cfg(not(feature = "cuda"))]
    Ok(None)
}

/// Host memory available to each rank when every device of `devices` runs on the CPU (`cpu`,
/// `flex`, `ndarray`, `tch:cpu`): `MemAvailable` of `/proc/meminfo` over the rank count. `None`
/// for GPU devices or where the kernel does not say.
pub fn host_memory_for(devices: &[String]) -> Option<u64> {
    let on_cpu = |d: &String| matches!(d.as_str(), "cpu" | "flex" | "ndarray" | "tch:cpu" | "tch");
    if devices.is_empty() || !devices.iter().all(on_cpu) {
        return None;
    }
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: u64 = info
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024 / devices.len() as u64)
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
pub trait RankCollective: KernelOps {
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
        Arc::new(conrub_parallel::NcclCollective::new::<Self>(devices))
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
                prepare_kernel_cache(
                    specs
                        .iter()
                        .zip(&indices)
                        .map(|(s, &i)| {
                            conrub_kernels::kernel_cache::wgpu_identity((s != "wgpu").then_some(i))
                        })
                        .collect(),
                );
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
            prepare_kernel_cache(
                indices
                    .iter()
                    .map(|&i| conrub_kernels::kernel_cache::cuda_identity(i))
                    .collect(),
            );
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
