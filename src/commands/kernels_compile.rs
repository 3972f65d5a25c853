//! `conrub kernels-compile`: every CubeCL kernel of `conrub-kernels` generated as the CUDA C++ an
//! NVIDIA device would compile, compiled with NVRTC and assembled with ptxas for `--arch`, on a
//! machine without a GPU; prints each kernel's registers, spills, shared memory and occupancy
//! and fails on a compile error, a spill or shared memory over the per-block limit (see
//! `conrub_kernels::offline`).

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

/// Arguments of `conrub kernels-compile`.
#[derive(Args)]
pub struct KernelsCompileArgs {
    /// Target architecture: sm_90 (H100, H200) or sm_80 (A100).
    #[arg(long, default_value = "sm_90")]
    pub arch: String,
    /// Write each kernel's CUDA C++ (`KERNEL.DTYPE[.dHEAD_DIM].cu`) and `resources.json` here.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Print one JSON list of `{kernel, config, registers, spills, shared_bytes, occupancy, ...}`
    /// instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Folder holding NVRTC, ptxas and the CUDA headers (NVIDIA's wheels, as
    /// scripts/setup-cuda-tools.sh unpacks them, or a toolkit); default: $CONRUB_CUDA_TOOLS, else
    /// `.cuda-tools` here or in a parent folder.
    #[arg(long)]
    pub tools: Option<PathBuf>,
    /// JSON list of `{kernel, config, spills}`: spills accepted for now (CI passes
    /// `kernels/known-spills.json`). A listed spill may not grow, and must be taken off the list
    /// once gone; any other spill fails.
    #[arg(long)]
    pub known_spills: Option<PathBuf>,
}

#[cfg(not(feature = "cuda-compile"))]
pub fn run(_args: KernelsCompileArgs) -> Result<()> {
    anyhow::bail!(
        "kernels-compile is not in this build: rebuild with `--features cuda` or \
         `--features cuda-compile`"
    )
}

#[cfg(feature = "cuda-compile")]
pub fn run(args: KernelsCompileArgs) -> Result<()> {
    use anyhow::{bail, Context};
    use conrub_kernels::offline::{self, Arch, CudaTools, Nvrtc};

    let arch = Arch::parse(&args.arch)?;
    let known: Vec<offline::KnownSpill> = match &args.known_spills {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read {}", path.display()))?;
            serde_json::from_str(&text).with_context(|| {
                format!(
                    "{}: expected a JSON list of {{kernel, config, spills}}",
                    path.display()
                )
            })?
        }
        None => Vec::new(),
    };
    let tools = match &args.tools {
        Some(root) => CudaTools::under(root)?,
        None => CudaTools::find()?,
    };
    let nvrtc = Nvrtc::load(&tools)?;
    let generated = offline::generate(arch)?;
    if let Some(out) = &args.out {
        std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
        for g in &generated {
            let path = out.join(format!("{}.cu", g.config.label().replace('/', ".")));
            conrub_rubric::io::write_bytes_atomic(&path, g.kernel.source.as_bytes())
                .with_context(|| format!("cannot write {}", path.display()))?;
        }
    }
    let mut resources = Vec::new();
    let mut failures = Vec::new();
    for r in offline::compile_all(&nvrtc, &tools, arch, &generated) {
        match r {
            Ok(r) => resources.push(r),
            Err(e) => failures.push(e.to_string()),
        }
    }
    if let Some(out) = &args.out {
        let path = out.join("resources.json");
        let text = serde_json::to_string_pretty(&resources)?;
        conrub_rubric::io::write_bytes_atomic(&path, text.as_bytes())
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    if args.json {
        outln!("{}", serde_json::to_string(&resources)?);
    } else {
        super::print_lines(offline::table(&resources))?;
    }
    failures.extend(offline::problems(arch, &resources, &known));
    if !failures.is_empty() {
        for f in &failures {
            errln!("error: {f}");
        }
        bail!(
            "{} of {} kernel configurations fail for {}",
            failures.len(),
            generated.len(),
            arch.real_name()
        );
    }
    errln!(
        "{} kernel configurations compile for {}, within {} bytes of shared memory; {} spill \
         (all known)",
        resources.len(),
        arch.real_name(),
        arch.limits().max_shared_per_block,
        resources
            .iter()
            .filter(|r| r.spills > 0 || r.spill_loads > 0)
            .count()
    );
    Ok(())
}
