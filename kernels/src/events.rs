//! Counts of CubeCL's kernel compilations, persistent-cache loads and autotune runs, read from
//! the records CubeCL 0.10 writes through the `log` crate at the moment each happens (in the
//! launching thread, not through CubeCL's own buffered logger):
//!
//! | event | record (target, level: message) |
//! | --- | --- |
//! | compile, CUDA | `cubecl_cuda::compute::context`, trace: `Compiling kernel` (NVRTC follows) |
//! | compile, wgpu SPIR-V | `cubecl_wgpu::backend::vulkan`, debug: `Compiling <kernel>` |
//! | compile, wgpu WGSL | `cubecl_wgpu::backend::base`, trace: `[cubecl-wgpu] compiling WGSL module ...` |
//! | persistent cache hit | `Using PTX cache` (CUDA), `Using SPIR-V cache` (wgpu), trace |
//! | autotune run | `cubecl_runtime::tune::tuner`, info: `Tuning <key>` (a key with no stored result) |
//!
//! A kernel found in a runtime's in-memory cache writes nothing: it costs nothing either. The
//! counter is a `log` logger ([`EventLog`]); a program installs it once with [`install`] (the
//! `conrub` binary does, before any device starts) and reads [`snapshot`]s around the work it
//! measures. Records of other targets at warning level and above go to standard error, as a
//! plain logger would print them. Without [`install`], [`snapshot`] is `None`: nothing counts.

use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use log::{Level, LevelFilter, Log, Metadata, Record};

static INSTALLED: AtomicBool = AtomicBool::new(false);
static COMPILES: AtomicU64 = AtomicU64::new(0);
static CACHE_LOADS: AtomicU64 = AtomicU64::new(0);
static AUTOTUNE_RUNS: AtomicU64 = AtomicU64::new(0);

/// Totals since the process started (or differences of two, [`KernelEvents::since`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KernelEvents {
    /// Kernels compiled (misses of the runtime's in-memory and persistent caches).
    pub kernel_compiles: u64,
    /// Kernels loaded from the persistent compilation cache instead of compiled.
    pub kernel_cache_loads: u64,
    /// Autotune runs (a tuning key with no stored result: its candidates are benchmarked).
    pub autotune_runs: u64,
}

impl KernelEvents {
    /// What happened between `earlier` and `self`.
    pub fn since(&self, earlier: &KernelEvents) -> KernelEvents {
        KernelEvents {
            kernel_compiles: self.kernel_compiles - earlier.kernel_compiles,
            kernel_cache_loads: self.kernel_cache_loads - earlier.kernel_cache_loads,
            autotune_runs: self.autotune_runs - earlier.autotune_runs,
        }
    }
}

/// What happened while `work` ran (`None` when nothing is counted), and its result.
pub fn during<T>(work: impl FnOnce() -> T) -> (T, Option<KernelEvents>) {
    let before = snapshot();
    let out = work();
    (out, before.zip(snapshot()).map(|(a, b)| b.since(&a)))
}

/// The totals so far; `None` when no [`EventLog`] was installed (nothing is counted).
pub fn snapshot() -> Option<KernelEvents> {
    INSTALLED.load(Ordering::Acquire).then(|| KernelEvents {
        kernel_compiles: COMPILES.load(Ordering::Relaxed),
        kernel_cache_loads: CACHE_LOADS.load(Ordering::Relaxed),
        autotune_runs: AUTOTUNE_RUNS.load(Ordering::Relaxed),
    })
}

/// What one record counts as, if anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    Compile,
    CacheLoad,
    Autotune,
}

/// Targets whose records can be events (checked before a message is formatted).
fn may_count(target: &str) -> bool {
    target.starts_with("cubecl_cuda::compute")
        || target.starts_with("cubecl_wgpu::backend")
        || target.starts_with("cubecl_runtime::tune")
}

fn classify(target: &str, level: Level, message: &str) -> Option<Event> {
    if message.starts_with("Using PTX cache") || message.starts_with("Using SPIR-V cache") {
        return Some(Event::CacheLoad);
    }
    match (target, level) {
        (t, Level::Trace) if t.starts_with("cubecl_cuda::compute") => {
            (message == "Compiling kernel").then_some(Event::Compile)
        }
        (t, Level::Debug) if t.starts_with("cubecl_wgpu::backend::vulkan") => {
            message.starts_with("Compiling ").then_some(Event::Compile)
        }
        (t, Level::Trace) if t.starts_with("cubecl_wgpu::backend") => message
            .starts_with("[cubecl-wgpu] compiling WGSL module")
            .then_some(Event::Compile),
        (t, Level::Info) if t.starts_with("cubecl_runtime::tune") => {
            message.starts_with("Tuning ").then_some(Event::Autotune)
        }
        _ => None,
    }
}

/// Set to `1` to print every counted event (the compiled kernel's name where the runtime says
/// it: wgpu does, CUDA does not) on standard error: which kernels a step compiled.
pub const LOG_ENV: &str = "CONRUB_KERNEL_EVENTS";

fn log_events() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var(LOG_ENV).is_ok_and(|v| v == "1"))
}

/// The counting logger (see the module docs).
pub struct EventLog;

impl Log for EventLog {
    fn enabled(&self, metadata: &Metadata) -> bool {
        metadata.level() <= Level::Warn || may_count(metadata.target())
    }

    fn log(&self, record: &Record) {
        let target = record.target();
        if may_count(target) {
            let message = match record.args().as_str() {
                Some(s) => std::borrow::Cow::Borrowed(s),
                None => std::borrow::Cow::Owned(record.args().to_string()),
            };
            let event = classify(target, record.level(), &message);
            if event.is_some() && log_events() {
                let first = message.lines().next().unwrap_or("");
                // A closed stderr (`conrub ... 2>&1 | head`) drops the line; it never panics.
                let _ = writeln!(std::io::stderr(), "[kernel event] {first}");
            }
            match event {
                Some(Event::Compile) => COMPILES.fetch_add(1, Ordering::Relaxed),
                Some(Event::CacheLoad) => CACHE_LOADS.fetch_add(1, Ordering::Relaxed),
                Some(Event::Autotune) => AUTOTUNE_RUNS.fetch_add(1, Ordering::Relaxed),
                None => 0,
            };
        }
        if record.level() <= Level::Warn {
            let (level, args) = (record.level(), record.args());
            let _ = writeln!(std::io::stderr(), "{level} {target}: {args}");
        }
    }

    fn flush(&self) {}
}

/// Installs [`EventLog`] as the process's `log` logger (once; later calls do nothing). Returns
/// false when another logger was installed first: then nothing is counted.
pub fn install() -> bool {
    static LOGGER: EventLog = EventLog;
    if INSTALLED.load(Ordering::Acquire) {
        return true;
    }
    if log::set_logger(&LOGGER).is_err() {
        return false;
    }
    // The compile records are at trace level; everything else is dropped by `enabled`.
    log::set_max_level(LevelFilter::Trace);
    INSTALLED.store(true, Ordering::Release);
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The messages CubeCL 0.10 writes (copied from its sources' format strings) count as the
    /// events they are; look-alikes of other targets or levels do not.
    #[test]
    fn records_are_classified_by_target_level_and_message() {
        let cases = [
            (
                "cubecl_cuda::compute::context",
                Level::Trace,
                "Compiling kernel",
                Some(Event::Compile),
            ),
            (
                "cubecl_cuda::compute::context",
                Level::Trace,
                "Using PTX cache",
                Some(Event::CacheLoad),
            ),
            (
                "cubecl_wgpu::backend::vulkan",
                Level::Debug,
                "Compiling burn_cubecl::kernel::X",
                Some(Event::Compile),
            ),
            (
                "cubecl_wgpu::backend::base",
                Level::Trace,
                "Using SPIR-V cache",
                Some(Event::CacheLoad),
            ),
            (
                "cubecl_wgpu::backend::base",
                Level::Trace,
                "[cubecl-wgpu] compiling WGSL module `main`\nfn main() {}",
                Some(Event::Compile),
            ),
            (
                "cubecl_runtime::tune::tuner",
                Level::Info,
                "Tuning MatmulKey { m: 64 }",
                Some(Event::Autotune),
            ),
            (
                "cubecl_runtime::tune::tuner",
                Level::Debug,
                "Tuning MatmulKey { m: 64 }",
                None,
            ),
            (
                "cubecl_wgpu::backend::vulkan",
                Level::Debug,
                "Supported CMMA sizes: []",
                None,
            ),
            ("wgpu_core::device", Level::Trace, "Compiling kernel", None),
            (
                "cubecl_cuda::compute::context",
                Level::Debug,
                "Compiling kernel",
                None,
            ),
        ];
        for (target, level, message, want) in cases {
            assert_eq!(
                may_count(target) && classify(target, level, message).is_some(),
                want.is_some(),
                "{target} {message}"
            );
            if may_count(target) {
                assert_eq!(
                    classify(target, level, message),
                    want,
                    "{target} {level} {message}"
                );
            }
        }
    }

    #[test]
    fn differences_of_snapshots() {
        let e = |kernel_compiles, kernel_cache_loads, autotune_runs| KernelEvents {
            kernel_compiles,
            kernel_cache_loads,
            autotune_runs,
        };
        assert_eq!(e(10, 1, 5).since(&e(3, 1, 2)), e(7, 0, 3));
    }
}
