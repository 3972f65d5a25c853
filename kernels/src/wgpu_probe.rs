//! Whether burn's `Wgpu` backend has an adapter, asked before any device is created, so that the
//! wgpu tests (here and in the root package) can skip on a machine without a Vulkan driver.

use burn::backend::wgpu::graphics::{AutoGraphicsApi, GraphicsApi};
use burn::backend::wgpu::WgpuRuntime;
use cubecl::Runtime;

/// Set to `1` (as `.ci/run` does) to make a missing adapter fail the wgpu tests instead of
/// skipping them.
pub const REQUIRE_WGPU_ENV: &str = "CONRUB_REQUIRE_WGPU";

/// Adapters that `WgpuDevice::DefaultDevice` can select: those of the graphics API burn uses by
/// default (Vulkan on Linux), only CPU ones under `CUBECL_WGPU_DEFAULT_DEVICE=Cpu`. Enumerating
/// creates no device and does not panic when the API's loader or driver is missing (it finds none).
pub fn wgpu_adapter_count() -> usize {
    let api = AutoGraphicsApi::backend();
    if std::env::var("CUBECL_WGPU_DEFAULT_DEVICE").is_ok_and(|v| v == "Cpu") {
        // cubecl's device type 3: CPU adapters (Mesa's lavapipe).
        <WgpuRuntime as Runtime>::enumerate_devices(3, &api).len()
    } else {
        <WgpuRuntime as Runtime>::enumerate_all_devices(&api).len()
    }
}

/// For a test about to use `WgpuDevice::DefaultDevice`: true when an adapter exists. Without one it
/// writes a loud notice straight to stderr (past the test harness's output capture) and returns
/// false, and the test returns early; with `CONRUB_REQUIRE_WGPU=1` it panics instead. The probe
/// runs once per process.
pub fn wgpu_adapter_or_skip(test: &str) -> bool {
    static ADAPTERS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    if *ADAPTERS.get_or_init(wgpu_adapter_count) > 0 {
        return true;
    }
    skip_or_fail(
        test,
        "no Vulkan adapter; install mesa-vulkan-drivers libvulkan1 (Mesa's software Vulkan) or run on a GPU",
    );
    false
}

/// For a wgpu test that found the adapter lacks what it checks (a dtype, a feature): the same
/// loud notice as [`wgpu_adapter_or_skip`] naming `why`, and under `CONRUB_REQUIRE_WGPU=1` a
/// panic. The caller returns after it.
pub fn skip_or_fail(test: &str, why: &str) {
    if std::env::var(REQUIRE_WGPU_ENV).is_ok_and(|v| v == "1") {
        panic!("{test}: {why} ({REQUIRE_WGPU_ENV}=1 makes this a failure)");
    }
    use std::io::Write;
    let line = "=".repeat(100);
    let _ = writeln!(
        std::io::stderr().lock(),
        "\n{line}\nSKIPPED: {why}.\n`{test}` passes WITHOUT RUNNING; set {REQUIRE_WGPU_ENV}=1 to make it fail instead.\n{line}"
    );
}
