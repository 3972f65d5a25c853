//! `conrub_kernels::offline`: every kernel generated as CubeCL's CUDA C++ for sm_90 without a
//! device, then compiled with NVRTC and ptxas from NVIDIA's wheels (`scripts/setup-cuda-tools.sh`).
//! Without the tools the compile tests skip, loudly; with `CONRUB_REQUIRE_CUDA_TOOLS=1` (CI) a
//! missing tool fails them.
#![cfg(feature = "cuda-compile")]

use conrub_kernels::cube_flash::{self, FlashKernel};
use conrub_kernels::offline::{
    self, Arch, CudaTools, KernelConfig, KnownSpill, Nvrtc, OfflineError,
};

fn tools() -> Option<CudaTools> {
    match CudaTools::find() {
        Ok(t) => Some(t),
        Err(e) if std::env::var("CONRUB_REQUIRE_CUDA_TOOLS").as_deref() == Ok("1") => {
            panic!("CONRUB_REQUIRE_CUDA_TOOLS=1 but {e}")
        }
        Err(e) => {
            eprintln!("SKIPPED: {e}");
            None
        }
    }
}

fn known_spills() -> Vec<KnownSpill> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/known-spills.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn every_kernel_is_generated_for_sm_90_with_the_launchers_geometry() {
    let generated = offline::generate(Arch::SM90).unwrap();
    assert_eq!(
        generated.len(),
        90,
        "6 row kernels x 3 dtypes + 6 attention x 3 x 3 + 3 tensor-core x 2 x 3"
    );
    for g in &generated {
        let entry = &g.kernel.entry;
        assert!(
            entry.starts_with(g.config.kernel.trim_end_matches("+split")),
            "{entry} for {}",
            g.config.label()
        );
        assert!(
            g.kernel.source.contains(&format!(
                "__global__ void __launch_bounds__({})",
                g.kernel.threads
            )),
            "{}",
            g.config.label()
        );
        let f = match g.config.label().split('/').nth(1).unwrap() {
            "f32" => "float",
            "bf16" => "__nv_bfloat16",
            _ => "__half",
        };
        assert!(
            g.kernel.source.contains(f),
            "{} lacks {f}",
            g.config.label()
        );
        // The H200 geometry: 64 units per attention cube, 256 per row cube; the attention tiles
        // sized to 48 KiB: two tile x head_dim f32 tiles and two tile-long vectors.
        let d = g.config.head_dim;
        match (g.config.kernel, d) {
            (kernel, Some(d)) if kernel.starts_with("flash_") => {
                // The tensor-core kernels: a warp per 16 rows, tiles sized to the H200's
                // 227 KiB (two cubes per SM where they fit), 2-byte inputs.
                let which = match kernel {
                    "flash_forward_kernel" => FlashKernel::Forward,
                    "flash_dq_kernel" => FlashKernel::Dq,
                    _ => FlashKernel::Dkdv,
                };
                let tiles = cube_flash::tiles(which, d, 2, 227 * 1024, 1024).unwrap();
                assert_eq!(
                    g.kernel.threads as usize,
                    tiles.units(),
                    "{}",
                    g.config.label()
                );
                let want = tiles.shared_bytes(which, d, 2);
                let shared = g.kernel.dynamic_shared_bytes;
                // CubeCL may pad between buffers for their alignment.
                assert!(
                    shared >= want && shared <= want + 16 * 32,
                    "{}: {shared} bytes, {want} planned",
                    g.config.label()
                );
            }
            ("paged_combine_kernel", Some(_)) => {
                assert_eq!(g.kernel.threads, 64);
                assert_eq!(g.kernel.dynamic_shared_bytes, 0);
            }
            ("paged_decode_kernel" | "paged_decode_kernel+split", Some(d)) => {
                assert_eq!(g.kernel.threads, 64);
                let tile = ((48 * 1024 / 4 - d) / (d + 2)).min(64);
                // The tile's keys, the query, the scores and the tile's pool slots.
                assert_eq!(g.kernel.dynamic_shared_bytes, (tile * d + d + 2 * tile) * 4);
            }
            (_, Some(d)) => {
                assert_eq!(g.kernel.threads, 64);
                let tile = (48 * 1024 / (4 * (2 * d + 2))).min(64);
                // Two tiles, and one (forward, dQ: the mask) or two (dK/dV: lse, delta)
                // tile-long vectors.
                let tiles = 2 * tile * d * 4;
                let shared = g.kernel.dynamic_shared_bytes;
                assert!(
                    shared == tiles + tile * 4 || shared == tiles + 2 * tile * 4,
                    "{}: {shared}",
                    g.config.label()
                );
            }
            (_, None) => assert_eq!(g.kernel.threads, 256),
        }
    }
    let kernels: std::collections::BTreeSet<_> =
        generated.iter().map(|g| g.config.kernel).collect();
    assert_eq!(kernels.len(), 15, "{kernels:?}");
}

#[test]
fn every_kernel_compiles_for_sm_90_within_its_limits() {
    let Some(tools) = tools() else { return };
    let nvrtc = Nvrtc::load(&tools).unwrap();
    let arch = Arch::SM90;
    let generated = offline::generate(arch).unwrap();
    let resources: Vec<_> = offline::compile_all(&nvrtc, &tools, arch, &generated)
        .into_iter()
        .map(|r| r.unwrap_or_else(|e| panic!("{e}")))
        .collect();
    // The table `conrub kernels-compile` prints, where CI's log shows it (.ci/run prints this
    // file instead of compiling every kernel a second time).
    let table = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("kernels-sm90.txt");
    let spilling = resources
        .iter()
        .filter(|r| r.spills > 0 || r.spill_loads > 0)
        .count();
    let mut lines = offline::table(&resources);
    lines.push(format!(
        "{} kernel configurations compile for {}; {spilling} spill (each listed in \
         kernels/known-spills.json, checked below)",
        resources.len(),
        arch.real_name()
    ));
    std::fs::write(&table, lines.join("\n") + "\n").unwrap();
    for r in &resources {
        if r.kernel.starts_with("flash_") {
            println!(
                "{}: {} registers, {} B shared, occupancy {:.1}% ({} blocks/SM, limited by {})",
                r.kernel,
                r.registers,
                r.shared_bytes,
                100.0 * r.occupancy.occupancy,
                r.occupancy.blocks_per_sm,
                r.occupancy.limiter
            );
        }
        assert!(r.registers > 0 && r.registers <= 255, "{r:?}");
        assert!(
            r.occupancy.occupancy > 0.0 && r.occupancy.occupancy <= 1.0,
            "{r:?}"
        );
        assert!(
            r.shared_bytes <= arch.limits().max_shared_per_block,
            "{r:?}"
        );
    }
    let problems = offline::problems(arch, &resources, &known_spills());
    assert!(problems.is_empty(), "{problems:#?}");
    // The row kernels hold a few scalars per thread: they must never spill. (The restricted
    // sampler keeps 15 running sums per thread and spills 0 or 8 B from one process to the next,
    // listed in known-spills.json and bounded by the check above.)
    for r in resources.iter().filter(|r| {
        !r.kernel.starts_with("attention")
            && !r.kernel.starts_with("paged")
            && r.kernel != "sample_restricted_kernel"
    }) {
        assert_eq!((r.spills, r.spill_loads, r.stack_bytes), (0, 0, 0), "{r:?}");
    }
    // With no known spills, the spilling attention kernels fail the check.
    assert!(!offline::problems(arch, &resources, &[]).is_empty() || known_spills().is_empty());
}

/// The tensor-core kernels at head_dim 128 (and 64, 256), bf16 and f16: their sources multiply
/// with WMMA and none is excused by known-spills.json (that they compile without spilling is
/// checked with every kernel above).
#[test]
fn tensor_core_kernels_use_wmma_and_never_spill() {
    let generated = offline::generate(Arch::SM90).unwrap();
    let flash: Vec<_> = generated
        .iter()
        .filter(|g| g.config.kernel.starts_with("flash_"))
        .collect();
    assert_eq!(
        flash.len(),
        18,
        "3 kernels x bf16, f16 x head_dim 64, 128, 256"
    );
    for g in &flash {
        let src = &g.kernel.source;
        for needle in [
            "wmma::load_matrix_sync",
            "wmma::mma_sync",
            "wmma::store_matrix_sync",
        ] {
            assert!(src.contains(needle), "{} lacks {needle}", g.config.label());
        }
    }
    for k in known_spills() {
        assert!(
            !k.kernel.starts_with("flash_"),
            "{k:?}: tensor-core kernels may not spill"
        );
    }
    // Their compile (no spill, no stack) is checked with every other kernel's by
    // `every_kernel_compiles_for_sm_90_within_its_limits`, which prints their occupancy.
}

#[test]
fn a_broken_kernel_fails_with_the_nvrtc_message() {
    let Some(tools) = tools() else { return };
    let nvrtc = Nvrtc::load(&tools).unwrap();
    let config = KernelConfig::all().into_iter().next().unwrap();
    let mut g = offline::generate_configs(Arch::SM90, &[config])
        .unwrap()
        .remove(0);
    // An undeclared name in the kernel's body, after its first statement.
    let body = g.kernel.source.find(") {\n").expect("the kernel's body") + 4;
    g.kernel
        .source
        .insert_str(body, "conrub_not_declared = 1;\n");
    match offline::compile(&nvrtc, &tools, Arch::SM90, &g) {
        Err(OfflineError::Compile { kernel, reason }) => {
            assert!(kernel.starts_with("row_stats_kernel/f32"), "{kernel}");
            assert!(
                reason.contains("identifier \"conrub_not_declared\" is undefined"),
                "{reason}"
            );
        }
        other => panic!("expected NVRTC's error, got {other:?}"),
    }
}

#[test]
fn missing_tools_are_named() {
    let dir = std::env::temp_dir().join("conrub-no-cuda-tools");
    std::fs::create_dir_all(&dir).unwrap();
    let err = CudaTools::under(&dir).unwrap_err().to_string();
    assert!(
        err.contains("conrub-no-cuda-tools") && err.contains("libnvrtc"),
        "{err}"
    );
    assert!(err.contains("setup-cuda-tools.sh"), "{err}");
}
