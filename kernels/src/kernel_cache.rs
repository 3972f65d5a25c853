//! conrub's kernel caches on the CubeCL backends: compiled kernels (CUDA's PTX, wgpu's SPIR-V)
//! and autotune results, kept across runs under one folder per device and conrub build, never
//! the working directory's `target/` or CubeCL's shared `~/.cache/cubecl`.
//!
//! CubeCL 0.10 keys a compiled kernel by its type name and compile-time settings only, not by
//! the GPU's architecture or the kernel's body, and its autotune results by device index, not
//! model: an entry shared across GPU types or kept across an edit of a kernel could serve the
//! wrong code. So the folder is `ROOT/<device name>-<architecture>/<build id>`, where the build
//! id ([`build_id`]) is conrub-kernels' version, a hash of its sources (`build.rs`) and the
//! CubeCL version: a changed kernel or another GPU starts an empty folder.
//!
//! CubeCL reads its run-time configuration once per process, when the first device starts, and
//! cannot be configured after that: [`install`] must run before any CubeCL device is created
//! (the `conrub` binary calls it in its device selection). CubeCL's environment variables
//! (`CUBECL_DEBUG_LOG`, `CUBECL_AUTOTUNE_LEVEL`, ...) still apply.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cubecl::config::cache::CacheConfig;
use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};

/// The CubeCL version whose cache formats the folders hold (burn 0.21's).
pub const CUBECL_VERSION: &str = "0.10.0";
/// Overrides [`build_id`] (for tests that prove another build's entries are not used).
pub const BUILD_ID_ENV: &str = "CONRUB_KERNEL_BUILD_ID";

/// Errors of the kernel cache.
#[derive(Debug, thiserror::Error)]
pub enum KernelCacheError {
    /// The folder could not be created or read.
    #[error("kernel cache {path}: {source}")]
    Io {
        /// The folder.
        path: PathBuf,
        /// What failed.
        source: std::io::Error,
    },
    /// CubeCL was configured with another folder earlier in this process.
    #[error(
        "kernel cache {wanted}: this process already uses {current} (CubeCL is configured once per process)"
    )]
    AlreadySet {
        /// The folder asked for now.
        wanted: PathBuf,
        /// The folder in use.
        current: PathBuf,
    },
    /// CubeCL had read its configuration before the cache was chosen (a device was already
    /// started in this process).
    #[error("kernel cache {wanted}: CubeCL already started in this process without it")]
    TooLate {
        /// The folder asked for.
        wanted: PathBuf,
    },
    /// The device could not be asked for its name.
    #[error("kernel cache: cannot identify device {device}: {message}")]
    Device {
        /// The device.
        device: String,
        /// The driver's answer.
        message: String,
    },
}

/// This build of the kernels: `conrub-kernels-<version>-src<hash>-cubecl-<version>`, or
/// [`BUILD_ID_ENV`] when set.
pub fn build_id() -> String {
    if let Ok(id) = std::env::var(BUILD_ID_ENV) {
        if !id.is_empty() {
            return slug(&id);
        }
    }
    format!(
        "conrub-kernels-{}-src{}-cubecl-{CUBECL_VERSION}",
        env!("CARGO_PKG_VERSION"),
        env!("CONRUB_KERNELS_SOURCE_HASH")
    )
}

/// What a cache folder is kept for: the device's model and architecture.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceIdentity {
    /// The device's name, as its driver reports it (`NVIDIA H100 80GB HBM3`, `llvmpipe (LLVM
    /// 15.0.6, 256 bits)`).
    pub name: String,
    /// Its architecture: `sm_90` on CUDA, the graphics API and driver on wgpu.
    pub arch: String,
}

impl DeviceIdentity {
    /// The folder name: `<name>-<arch>` with every character but letters, digits, `.`, `_` and
    /// `-` replaced by `_`.
    pub fn folder(&self) -> String {
        slug(&format!("{}-{}", self.name, self.arch))
    }
}

fn slug(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The default root: `$XDG_CACHE_HOME/conrub/kernels`, else `$HOME/.cache/conrub/kernels`, else
/// `.conrub-kernels` in the working directory (no home at all).
pub fn default_root() -> PathBuf {
    let xdg = std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty());
    match (xdg, std::env::var_os("HOME").filter(|v| !v.is_empty())) {
        (Some(x), _) => PathBuf::from(x).join("conrub/kernels"),
        (None, Some(home)) => PathBuf::from(home).join(".cache/conrub/kernels"),
        (None, None) => PathBuf::from(".conrub-kernels"),
    }
}

/// Entries a cache folder holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheEntries {
    /// Compiled kernels (PTX or SPIR-V).
    pub compiled: usize,
    /// Autotune results.
    pub autotune: usize,
}

/// One device's cache folder for this build.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelCache {
    /// `ROOT/<device folder>/<build id>`.
    pub dir: PathBuf,
    /// The device it is for.
    pub identity: DeviceIdentity,
}

impl KernelCache {
    /// The folder of `identity` and this build under `root` (created when missing).
    pub fn open(root: &Path, identity: DeviceIdentity) -> Result<Self, KernelCacheError> {
        let dir = root.join(identity.folder()).join(build_id());
        std::fs::create_dir_all(&dir).map_err(|source| KernelCacheError::Io {
            path: dir.clone(),
            source,
        })?;
        Ok(Self { dir, identity })
    }

    /// What the folder holds now: lines of CubeCL's index files (`*.json.log`; one entry per
    /// line), autotune results under `autotune/`, compiled kernels elsewhere.
    pub fn entries(&self) -> CacheEntries {
        let mut out = CacheEntries::default();
        count_entries(&self.dir, &mut out, false);
        out
    }
}

fn count_entries(dir: &Path, out: &mut CacheEntries, autotune: bool) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if p.is_dir() {
            count_entries(&p, out, autotune || name == "autotune");
        } else if name.ends_with(".json.log") {
            let lines = std::fs::read_to_string(&p)
                .map(|t| t.lines().filter(|l| !l.trim().is_empty()).count())
                .unwrap_or(0);
            if autotune {
                out.autotune += lines;
            } else {
                out.compiled += lines;
            }
        }
    }
}

static INSTALLED: OnceLock<PathBuf> = OnceLock::new();

/// Points CubeCL's compilation cache (on) and autotune cache at `cache.dir` for the rest of the
/// process. Call before any CubeCL device starts ([`KernelCacheError::TooLate`] after); a second
/// call with the same folder does nothing, with another one is [`KernelCacheError::AlreadySet`].
pub fn install(cache: &KernelCache) -> Result<(), KernelCacheError> {
    if INSTALLED.get().is_none() && CubeClRuntimeConfig::storage().lock().is_some() {
        return Err(KernelCacheError::TooLate {
            wanted: cache.dir.clone(),
        });
    }
    let mut first = false;
    let current = INSTALLED.get_or_init(|| {
        first = true;
        cache.dir.clone()
    });
    if !first {
        return if *current == cache.dir {
            Ok(())
        } else {
            Err(KernelCacheError::AlreadySet {
                wanted: cache.dir.clone(),
                current: current.clone(),
            })
        };
    }
    // What CubeCL itself would read (cubecl.toml or burn.toml upward from the working
    // directory, then its environment variables), with the two caches moved here.
    let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
    config.compilation.cache = Some(CacheConfig::File(cache.dir.clone()));
    config.autotune.cache = CacheConfig::File(cache.dir.clone());
    CubeClRuntimeConfig::set(config);
    Ok(())
}

/// The folder [`install`] gave CubeCL in this process, if any.
pub fn installed() -> Option<&'static Path> {
    INSTALLED.get().map(PathBuf::as_path)
}

/// The name, compute capability and driver version of CUDA device `index`, asked of the
/// driver before CubeCL starts (through the same primary context CubeCL then uses): PTX is kept
/// per architecture and driver, since an older driver rejects a newer PTX version.
#[cfg(feature = "cuda")]
pub fn cuda_identity(index: usize) -> Result<DeviceIdentity, KernelCacheError> {
    let err = |e: cudarc::driver::DriverError| KernelCacheError::Device {
        device: format!("cuda:{index}"),
        message: e.to_string(),
    };
    let ctx = cudarc::driver::CudaContext::new(index).map_err(err)?;
    let (major, minor) = ctx.compute_capability().map_err(err)?;
    let mut driver: std::ffi::c_int = 0;
    // SAFETY: the driver is loaded and initialised (the context above); it writes one int.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver) }
        .result()
        .map_err(err)?;
    Ok(DeviceIdentity {
        name: ctx.name().map_err(err)?,
        arch: format!("sm_{major}{minor}-driver{driver}"),
    })
}

/// Total memory of CUDA device `index` in bytes, asked of the driver.
#[cfg(feature = "cuda")]
pub fn cuda_total_memory(index: usize) -> Result<u64, KernelCacheError> {
    let err = |e: cudarc::driver::DriverError| KernelCacheError::Device {
        device: format!("cuda:{index}"),
        message: e.to_string(),
    };
    let ctx = cudarc::driver::CudaContext::new(index).map_err(err)?;
    Ok(ctx.total_mem().map_err(err)? as u64)
}

/// The adapter `WgpuDevice::DefaultDevice` (or `DiscreteGpu(index)`) selects, named without
/// starting CubeCL: the first CPU adapter under `CUBECL_WGPU_DEFAULT_DEVICE=Cpu`, else the
/// first discrete GPU, integrated GPU, other adapter in that order. Its architecture is the
/// graphics API and driver version.
#[cfg(feature = "wgpu")]
pub fn wgpu_identity(discrete_index: Option<usize>) -> Result<DeviceIdentity, KernelCacheError> {
    use burn::backend::wgpu::graphics::{AutoGraphicsApi, GraphicsApi};
    use wgpu::DeviceType;
    // Only the API burn uses (Vulkan on Linux): asking every API would start OpenGL's loader too.
    let backends: wgpu::Backends = AutoGraphicsApi::backend().into();
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends,
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    let infos: Vec<wgpu::AdapterInfo> =
        cubecl::future::block_on(instance.enumerate_adapters(backends))
            .into_iter()
            .map(|a| a.get_info())
            .collect();
    let cpu = std::env::var("CUBECL_WGPU_DEFAULT_DEVICE").is_ok_and(|v| v == "Cpu");
    let pick = match discrete_index {
        Some(i) => infos
            .iter()
            .filter(|a| a.device_type == DeviceType::DiscreteGpu)
            .nth(i),
        None if cpu => infos.iter().find(|a| a.device_type == DeviceType::Cpu),
        None => [
            DeviceType::DiscreteGpu,
            DeviceType::IntegratedGpu,
            DeviceType::VirtualGpu,
            DeviceType::Other,
            DeviceType::Cpu,
        ]
        .iter()
        .find_map(|t| infos.iter().find(|a| a.device_type == *t)),
    };
    let a = pick.ok_or_else(|| KernelCacheError::Device {
        device: match discrete_index {
            Some(i) => format!("wgpu:{i}"),
            None => "wgpu".into(),
        },
        message: format!("no such adapter among {} found", infos.len()),
    })?;
    Ok(DeviceIdentity {
        name: a.name.clone(),
        arch: format!("{:?}-{}", a.backend, a.driver_info),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Another build id or another device is another folder; the same is the same.
    #[test]
    fn folders_differ_by_device_and_build() {
        let root = tempfile::tempdir().unwrap();
        let h100 = DeviceIdentity {
            name: "NVIDIA H100 80GB HBM3".into(),
            arch: "sm_90".into(),
        };
        let a = KernelCache::open(root.path(), h100.clone()).unwrap();
        assert_eq!(a.identity.folder(), "NVIDIA_H100_80GB_HBM3-sm_90");
        assert!(a.dir.ends_with(build_id()), "{}", a.dir.display());
        assert!(build_id().starts_with("conrub-kernels-") || std::env::var(BUILD_ID_ENV).is_ok());
        let a100 = DeviceIdentity {
            name: "NVIDIA A100-SXM4-80GB".into(),
            arch: "sm_80".into(),
        };
        assert_ne!(KernelCache::open(root.path(), a100).unwrap().dir, a.dir);
        assert_eq!(KernelCache::open(root.path(), h100).unwrap().dir, a.dir);
        assert_eq!(slug("a/b c:1"), "a_b_c_1");
    }

    /// Entries are the lines of the index files: autotune results under `autotune/`.
    #[test]
    fn entries_count_index_lines() {
        let root = tempfile::tempdir().unwrap();
        let c = KernelCache::open(
            root.path(),
            DeviceIdentity {
                name: "dev".into(),
                arch: "x".into(),
            },
        )
        .unwrap();
        let ptx = c.dir.join("cuda/0.10.0/ptx");
        std::fs::create_dir_all(&ptx).unwrap();
        std::fs::write(ptx.join("toc.json.log"), "{}\n{}\n\n{}\n").unwrap();
        std::fs::write(ptx.join("chunk0.cbor"), [0u8; 8]).unwrap();
        let at = c.dir.join("autotune/0.10.0/device-0-0-cuda");
        std::fs::create_dir_all(&at).unwrap();
        std::fs::write(at.join("matmul.json.log"), "{}\n{}\n").unwrap();
        assert_eq!(
            c.entries(),
            CacheEntries {
                compiled: 3,
                autotune: 2
            }
        );
    }
}
