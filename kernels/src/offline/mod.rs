//! Every CubeCL kernel of this crate compiled for an NVIDIA architecture on a machine without a
//! GPU, driver or toolkit (`conrub kernels-compile`; feature `cuda-compile`).
//!
//! 1. [`generate`] launches each kernel, at each configuration an H200 run launches it with,
//!    through the same launch function as the backend, on [`OfflineCuda`]: a CubeCL runtime with
//!    `cubecl-cuda`'s compiler and device properties whose server records the CUDA C++ instead
//!    of running it. The launcher's geometry (tile rows, units per cube) therefore comes from
//!    the device limits the kernel would see on the GPU.
//! 2. [`compile`] compiles each source with NVRTC as `cubecl-cuda` does, assembles the PTX
//!    with `ptxas -v`, and reads registers, spills, stack and static shared memory; the dynamic
//!    shared memory is what the launch asks for. [`occupancy`] turns them into blocks and warps
//!    per SM.
//! 3. [`problems`] lists what would fail or slow down on the device: a compile error (with
//!    NVRTC's log), a spill, shared memory over the per-block limit.
//!
//! NVRTC, ptxas and the CUDA headers come from NVIDIA's PyPI wheels
//! (`scripts/setup-cuda-tools.sh`), found by [`CudaTools::find`].

mod arch;
mod launches;
mod nvrtc;
mod runtime;

use std::sync::Mutex;

pub use arch::{Arch, OfflineError, SmLimits};
pub use launches::KernelConfig;
pub use nvrtc::{parse_ptxas, ptxas, CudaTools, Nvrtc, PtxasReport};
#[cfg(test)]
pub(crate) use runtime::device_properties as runtime_device_properties;
pub use runtime::{OfflineCuda, OfflineDevice, RecordedKernel};

/// Resident blocks and warps per SM of a kernel, and what limits them.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Occupancy {
    /// Blocks resident on one SM.
    pub blocks_per_sm: u32,
    /// Warps resident on one SM.
    pub warps_per_sm: u32,
    /// Resident warps over the SM's maximum.
    pub occupancy: f64,
    /// `registers`, `shared`, `threads` or `blocks`: the tightest limit.
    pub limiter: &'static str,
}

/// Theoretical occupancy of a kernel with `threads` per block, `registers` per thread and
/// `shared_bytes` of shared memory per block (the occupancy calculator's rules: registers by the
/// warp in units of `register_unit`, shared memory plus the system's reserve in 128-byte units).
pub fn occupancy(
    limits: &SmLimits,
    threads: u32,
    registers: u32,
    shared_bytes: usize,
) -> Occupancy {
    let warps_per_block = threads.div_ceil(32).max(1);
    let max_warps = limits.threads_per_sm / 32;
    let by_threads = max_warps / warps_per_block;
    let regs_per_warp =
        (registers.max(1) * 32).div_ceil(limits.register_unit) * limits.register_unit;
    let by_registers = (limits.registers_per_sm / regs_per_warp) / warps_per_block;
    let shared = (shared_bytes + limits.reserved_shared_per_block).div_ceil(128) * 128;
    let by_shared = (limits.shared_per_sm / shared) as u32;
    let candidates = [
        (limits.blocks_per_sm, "blocks"),
        (by_threads, "threads"),
        (by_registers, "registers"),
        (by_shared, "shared"),
    ];
    let (blocks, limiter) = candidates
        .into_iter()
        .min_by_key(|(n, _)| *n)
        .expect("four candidates");
    let warps = blocks * warps_per_block;
    Occupancy {
        blocks_per_sm: blocks,
        warps_per_sm: warps,
        occupancy: warps as f64 / max_warps as f64,
        limiter,
    }
}

/// One kernel at one configuration, as CubeCL generates it for the architecture.
#[derive(Debug, Clone)]
pub struct GeneratedKernel {
    /// Which kernel, at which configuration.
    pub config: KernelConfig,
    /// The recorded compile.
    pub kernel: RecordedKernel,
}

/// Generation runs one at a time: the recording server's log is process-wide.
static GENERATING: Mutex<()> = Mutex::new(());

/// The CUDA C++ of every kernel at every configuration of [`KernelConfig::all`], for `arch`.
pub fn generate(arch: Arch) -> Result<Vec<GeneratedKernel>, OfflineError> {
    generate_configs(arch, &KernelConfig::all())
}

/// The CUDA C++ of the given kernel configurations, for `arch`.
pub fn generate_configs(
    arch: Arch,
    configs: &[KernelConfig],
) -> Result<Vec<GeneratedKernel>, OfflineError> {
    let _one = GENERATING.lock().unwrap_or_else(|e| e.into_inner());
    use cubecl::Runtime;
    let client = OfflineCuda::client(&OfflineDevice { sm: arch.sm });
    runtime::take_recorded();
    for config in configs {
        launches::launch(&client, config);
    }
    client.flush().map_err(|e| OfflineError::Compile {
        kernel: "(flush)".into(),
        reason: e.to_string(),
    })?;
    let recorded = runtime::take_recorded();
    assert_eq!(
        recorded.len(),
        configs.len(),
        "one recorded kernel per launch"
    );
    configs
        .iter()
        .zip(recorded)
        .map(|(config, kernel)| {
            // CubeCL names the kernel's function; the configuration says which launch it was.
            let kernel = kernel.map_err(|e| match e {
                OfflineError::Compile { kernel, reason } => OfflineError::Compile {
                    kernel: config.label(),
                    reason: format!("{kernel}: {reason}"),
                },
                other => other,
            })?;
            Ok(GeneratedKernel {
                config: config.clone(),
                kernel,
            })
        })
        .collect()
}

/// Resource use of one compiled kernel at one configuration.
#[derive(Debug, Clone, serde::Serialize)]
pub struct KernelResources {
    /// The kernel's name (its function in `kernels/src`).
    pub kernel: String,
    /// Its configuration (dtype, head dimension, launch geometry).
    pub config: String,
    /// Threads per block.
    pub threads: u32,
    /// Registers per thread.
    pub registers: u32,
    /// Bytes spilled per thread (ptxas' spill stores; its spill loads are in `spill_loads`).
    pub spills: u32,
    /// Bytes of spill loads per thread.
    pub spill_loads: u32,
    /// Bytes of stack frame per thread (local memory: spills and local arrays).
    pub stack_bytes: u32,
    /// Shared memory per block, static plus dynamic, bytes.
    pub shared_bytes: usize,
    /// Static shared memory (ptxas), bytes.
    pub static_shared_bytes: u32,
    /// Dynamic shared memory the launch asks for, bytes.
    pub dynamic_shared_bytes: usize,
    /// Blocks and warps per SM.
    #[serde(flatten)]
    pub occupancy: Occupancy,
}

/// Compiles one generated kernel with NVRTC and ptxas for `arch`.
pub fn compile(
    nvrtc: &Nvrtc,
    tools: &CudaTools,
    arch: Arch,
    generated: &GeneratedKernel,
) -> Result<KernelResources, OfflineError> {
    let label = generated.config.label();
    let ptx = nvrtc.compile(&label, &generated.kernel.source, arch)?;
    let report = ptxas(tools, &label, &ptx, arch)?;
    let shared = report.static_shared_bytes as usize + generated.kernel.dynamic_shared_bytes;
    Ok(KernelResources {
        kernel: generated.config.kernel.to_string(),
        config: generated.config.describe(),
        threads: generated.kernel.threads,
        registers: report.registers,
        spills: report.spill_stores,
        spill_loads: report.spill_loads,
        stack_bytes: report.stack_bytes,
        shared_bytes: shared,
        static_shared_bytes: report.static_shared_bytes,
        dynamic_shared_bytes: generated.kernel.dynamic_shared_bytes,
        occupancy: occupancy(
            &arch.limits(),
            generated.kernel.threads,
            report.registers,
            shared,
        ),
    })
}

/// [`compile`] of every kernel in `generated`, one worker per core (NVRTC and ptxas are
/// single-threaded), the results in `generated`'s order.
pub fn compile_all(
    nvrtc: &Nvrtc,
    tools: &CudaTools,
    arch: Arch,
    generated: &[GeneratedKernel],
) -> Vec<Result<KernelResources, OfflineError>> {
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                s.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(g) = generated.get(i) else { break };
                        done.push((i, compile(nvrtc, tools, arch, g)));
                    }
                    done
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("a compile worker panicked"))
            .collect()
    });
    results.sort_by_key(|(i, _)| *i);
    results.into_iter().map(|(_, r)| r).collect()
}

/// The resource table `conrub kernels-compile` prints: a header, then a line per kernel
/// configuration (threads, registers, spill stores/loads, stack, shared bytes, blocks per SM,
/// occupancy and what limits it).
pub fn table(resources: &[KernelResources]) -> Vec<String> {
    let mut lines = vec![format!(
        "{:<26} {:<16} {:>7} {:>4} {:>11} {:>6} {:>7} {:>6} {:>5}  {}",
        "kernel",
        "config",
        "threads",
        "regs",
        "spill st/ld",
        "stack",
        "shared",
        "blocks",
        "occ",
        "limit"
    )];
    for r in resources {
        lines.push(format!(
            "{:<26} {:<16} {:>7} {:>4} {:>11} {:>6} {:>7} {:>6} {:>5.3}  {}",
            r.kernel,
            r.config,
            r.threads,
            r.registers,
            format!("{}/{}", r.spills, r.spill_loads),
            r.stack_bytes,
            r.shared_bytes,
            r.occupancy.blocks_per_sm,
            r.occupancy.occupancy,
            r.occupancy.limiter
        ));
    }
    lines
}

/// A spill the project knows of and accepts for now (`kernels/known-spills.json`): the check
/// fails when it grows past `spills` bytes. CubeCL orders a kernel's shared arrays by a hash
/// map, so the same kernel compiles to slightly different register allocations from one process
/// to the next: a listed kernel may spill a little more or not at all; the bound holds the
/// largest spill seen over repeated runs with room to spare.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KnownSpill {
    /// The kernel's name.
    pub kernel: String,
    /// Its configuration, as [`KernelConfig::describe`] writes it.
    pub config: String,
    /// Spill stores per thread, bytes, at most.
    pub spills: u32,
}

/// What fails the check: a spill that `known` does not list (or one bigger than listed; every
/// kernel of ours runs in every step, so none may spill unnoticed), shared memory over the
/// per-block limit.
pub fn problems(arch: Arch, resources: &[KernelResources], known: &[KnownSpill]) -> Vec<String> {
    let limit = arch.limits().max_shared_per_block;
    let mut out = Vec::new();
    for r in resources {
        let listed = known
            .iter()
            .find(|k| k.kernel == r.kernel && k.config == r.config);
        let spills = r.spills > 0 || r.spill_loads > 0;
        match listed {
            None if spills => out.push(format!(
                "{} [{}]: spills {} bytes (stores) / {} bytes (loads) per thread at {} registers",
                r.kernel, r.config, r.spills, r.spill_loads, r.registers
            )),
            Some(k) if r.spills > k.spills => out.push(format!(
                "{} [{}]: spills {} bytes per thread, more than the {} known",
                r.kernel, r.config, r.spills, k.spills
            )),
            _ => {}
        }
        if r.shared_bytes > limit {
            out.push(format!(
                "{} [{}]: {} bytes of shared memory, over the {} per block of {}",
                r.kernel,
                r.config,
                r.shared_bytes,
                limit,
                arch.real_name()
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn architectures_parse() {
        for name in ["sm_90", "sm_90a", "compute_90", "90"] {
            assert_eq!(Arch::parse(name).unwrap(), Arch::SM90);
        }
        assert_eq!(Arch::parse("sm_80").unwrap().real_name(), "sm_80");
        assert_eq!(Arch::SM90.real_name(), "sm_90a");
        assert!(Arch::parse("sm_75").is_err());
        assert!(Arch::parse("h200").is_err());
    }

    /// Values of NVIDIA's occupancy calculator for compute capability 9.0.
    #[test]
    fn occupancy_follows_the_calculator() {
        let h200 = Arch::SM90.limits();
        // 64 threads at 255 registers: 8,192 registers a warp, 8 warps, 4 blocks: 8/64.
        let o = occupancy(&h200, 64, 255, 48 * 1024);
        assert_eq!(
            (o.blocks_per_sm, o.warps_per_sm, o.limiter),
            (4, 8, "registers")
        );
        assert_eq!(o.occupancy, 0.125);
        // 168 registers: 5,376 a warp, 12 warps, 6 blocks of 2 warps.
        assert_eq!(occupancy(&h200, 64, 168, 0).warps_per_sm, 12);
        // 256 threads at 32 registers: 8 blocks by threads; 64 warps, full occupancy.
        let o = occupancy(&h200, 256, 32, 2048);
        assert_eq!(
            (o.blocks_per_sm, o.occupancy, o.limiter),
            (8, 1.0, "threads")
        );
        // 100 KiB of shared memory (+1 KiB reserve): two blocks fit in 228 KiB.
        let o = occupancy(&h200, 64, 32, 100 * 1024);
        assert_eq!((o.blocks_per_sm, o.limiter), (2, "shared"));
        // Tiny blocks: 32 blocks per SM at most.
        assert_eq!(occupancy(&h200, 32, 16, 0).limiter, "blocks");
    }
}
