//! NVRTC (loaded from a file, as `cubecl-cuda` loads it on a GPU machine) and `ptxas -v`: CUDA
//! C++ to PTX with the options CubeCL uses, PTX to SASS for the architecture, and the resource
//! lines ptxas prints.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::process::Command;

use super::arch::{Arch, OfflineError};

/// Where NVRTC, ptxas and the CUDA headers are: NVIDIA's PyPI wheels unpacked under one folder
/// (`scripts/setup-cuda-tools.sh` puts them in `.cuda-tools/`), or a CUDA toolkit.
#[derive(Debug, Clone)]
pub struct CudaTools {
    /// `libnvrtc.so.*`.
    pub nvrtc: PathBuf,
    /// The `ptxas` executable.
    pub ptxas: PathBuf,
    /// The folder holding `cuda_fp16.h` and `cuda_bf16.h`.
    pub include: PathBuf,
}

impl CudaTools {
    /// The tools under `root`: the wheels' layout (`nvidia/cuda_nvrtc/lib`,
    /// `nvidia/cuda_nvcc/bin`, `nvidia/cuda_runtime/include`) or a toolkit's (`lib64`, `bin`,
    /// `include`).
    pub fn under(root: &Path) -> Result<Self, OfflineError> {
        let missing = |what: &str| OfflineError::Tools {
            root: root.to_path_buf(),
            reason: format!("no {what} (run scripts/setup-cuda-tools.sh)"),
        };
        let nvrtc = ["nvidia/cuda_nvrtc/lib", "lib64", "lib"]
            .iter()
            .filter_map(|dir| std::fs::read_dir(root.join(dir)).ok())
            .flat_map(|entries| entries.flatten().map(|e| e.path()))
            .filter(|p| {
                let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
                name.starts_with("libnvrtc.so") && !name.contains("builtins")
            })
            .min()
            .ok_or_else(|| missing("libnvrtc.so"))?;
        let ptxas = ["nvidia/cuda_nvcc/bin/ptxas", "bin/ptxas"]
            .iter()
            .map(|p| root.join(p))
            .find(|p| p.is_file())
            .ok_or_else(|| missing("ptxas"))?;
        let include = ["nvidia/cuda_runtime/include", "include"]
            .iter()
            .map(|p| root.join(p))
            .find(|p| p.join("cuda_bf16.h").is_file())
            .ok_or_else(|| missing("cuda_bf16.h"))?;
        Ok(Self {
            nvrtc,
            ptxas,
            include,
        })
    }

    /// The tools under `$CONRUB_CUDA_TOOLS`, else under `.cuda-tools` in the current directory
    /// or one of its parents.
    pub fn find() -> Result<Self, OfflineError> {
        if let Some(root) = std::env::var_os("CONRUB_CUDA_TOOLS") {
            return Self::under(Path::new(&root));
        }
        let cwd = std::env::current_dir().unwrap_or_default();
        let found = cwd
            .ancestors()
            .map(|dir| dir.join(".cuda-tools"))
            .find(|dir| dir.is_dir());
        match found {
            Some(root) => Self::under(&root),
            None => Err(OfflineError::Tools {
                root: cwd.join(".cuda-tools"),
                reason: "not found, and CONRUB_CUDA_TOOLS is not set \
                         (run scripts/setup-cuda-tools.sh)"
                    .into(),
            }),
        }
    }
}

type Program = *mut c_void;
type CreateProgram = unsafe extern "C" fn(
    *mut Program,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> c_int;
type CompileProgram = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> c_int;
type GetSize = unsafe extern "C" fn(Program, *mut usize) -> c_int;
type GetText = unsafe extern "C" fn(Program, *mut c_char) -> c_int;
type DestroyProgram = unsafe extern "C" fn(*mut Program) -> c_int;

/// A loaded NVRTC.
pub struct Nvrtc {
    lib: libloading::Library,
    include: PathBuf,
    /// The compiler's own headers (`crt/mma.h`, which WMMA code includes), next to `ptxas`.
    compiler_include: PathBuf,
}

impl Nvrtc {
    /// Loads `tools.nvrtc`.
    pub fn load(tools: &CudaTools) -> Result<Self, OfflineError> {
        // SAFETY: loading NVIDIA's NVRTC runs no initialisation code with preconditions.
        let lib =
            unsafe { libloading::Library::new(&tools.nvrtc) }.map_err(|e| OfflineError::Tools {
                root: tools.nvrtc.clone(),
                reason: format!("cannot load NVRTC: {e}"),
            })?;
        let compiler_include = tools
            .ptxas
            .parent()
            .and_then(Path::parent)
            .map(|root| root.join("include"))
            .unwrap_or_else(|| tools.include.clone());
        Ok(Self {
            lib,
            include: tools.include.clone(),
            compiler_include,
        })
    }

    fn symbol<T: Copy>(&self, name: &[u8]) -> Result<T, OfflineError> {
        // SAFETY: each name is looked up with the signature of NVRTC's C API for it.
        unsafe { self.lib.get::<T>(name).map(|s| *s) }.map_err(|e| OfflineError::Tools {
            root: self.include.clone(),
            reason: format!("NVRTC lacks {}: {e}", String::from_utf8_lossy(name)),
        })
    }

    /// Compiles `source` to PTX for `arch` with CubeCL's options (`--gpu-architecture=sm_XXa` on
    /// sm_90 and later, `-lineinfo`, the headers' folder); the error carries NVRTC's log.
    pub fn compile(&self, name: &str, source: &str, arch: Arch) -> Result<String, OfflineError> {
        let create: CreateProgram = self.symbol(b"nvrtcCreateProgram\0")?;
        let compile: CompileProgram = self.symbol(b"nvrtcCompileProgram\0")?;
        let log_size: GetSize = self.symbol(b"nvrtcGetProgramLogSize\0")?;
        let log: GetText = self.symbol(b"nvrtcGetProgramLog\0")?;
        let ptx_size: GetSize = self.symbol(b"nvrtcGetPTXSize\0")?;
        let ptx: GetText = self.symbol(b"nvrtcGetPTX\0")?;
        let destroy: DestroyProgram = self.symbol(b"nvrtcDestroyProgram\0")?;
        let fail = |reason: String| OfflineError::Compile {
            kernel: name.to_string(),
            reason,
        };
        let c_source = CString::new(source).map_err(|e| fail(format!("source: {e}")))?;
        let options = [
            format!("--gpu-architecture={}", arch.real_name()),
            format!("--include-path={}", self.include.display()),
            format!("--include-path={}", self.compiler_include.display()),
            "-lineinfo".to_string(),
        ];
        let options: Vec<CString> = options
            .iter()
            .map(|o| CString::new(o.as_str()).expect("options have no NUL"))
            .collect();
        let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
        let text = |getter: GetText, sizer: GetSize, program: Program| -> String {
            let mut size = 0usize;
            // SAFETY: `program` is live; the buffer has the size NVRTC reports.
            unsafe {
                if sizer(program, &mut size) != 0 || size == 0 {
                    return String::new();
                }
                let mut buf = vec![0u8; size];
                if getter(program, buf.as_mut_ptr().cast()) != 0 {
                    return String::new();
                }
                CStr::from_bytes_until_nul(&buf)
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_default()
            }
        };
        let mut program: Program = std::ptr::null_mut();
        // SAFETY: NVRTC's C API, called as documented; the program is destroyed on every path.
        unsafe {
            let rc = create(
                &mut program,
                c_source.as_ptr(),
                std::ptr::null(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            );
            if rc != 0 {
                return Err(fail(format!("nvrtcCreateProgram returned {rc}")));
            }
            let rc = compile(program, option_ptrs.len() as c_int, option_ptrs.as_ptr());
            let result = if rc != 0 {
                Err(fail(text(log, log_size, program).trim_end().to_string()))
            } else {
                Ok(text(ptx, ptx_size, program))
            };
            destroy(&mut program);
            result
        }
    }
}

/// What `ptxas -v` says of one entry function.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PtxasReport {
    /// Registers per thread.
    pub registers: u32,
    /// Bytes of spill stores per thread.
    pub spill_stores: u32,
    /// Bytes of spill loads per thread.
    pub spill_loads: u32,
    /// Bytes of stack frame (local memory: spills and local arrays) per thread.
    pub stack_bytes: u32,
    /// Static shared memory, bytes per block.
    pub static_shared_bytes: u32,
}

/// Assembles `ptx` for `arch` with `ptxas -v` and reads its report.
pub fn ptxas(
    tools: &CudaTools,
    name: &str,
    ptx: &str,
    arch: Arch,
) -> Result<PtxasReport, OfflineError> {
    let dir = tempfile::tempdir().map_err(|e| OfflineError::Io {
        path: std::env::temp_dir(),
        source: e,
    })?;
    let ptx_path = dir.path().join("kernel.ptx");
    std::fs::write(&ptx_path, ptx).map_err(|e| OfflineError::Io {
        path: ptx_path.clone(),
        source: e,
    })?;
    let out = Command::new(&tools.ptxas)
        .arg(format!("-arch={}", arch.real_name()))
        .arg("-v")
        .arg("-o")
        .arg(dir.path().join("kernel.cubin"))
        .arg(&ptx_path)
        .output()
        .map_err(|e| OfflineError::Tools {
            root: tools.ptxas.clone(),
            reason: format!("cannot run ptxas: {e}"),
        })?;
    let log =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(OfflineError::Compile {
            kernel: name.to_string(),
            reason: format!("ptxas: {}", log.trim_end()),
        });
    }
    parse_ptxas(&log).ok_or_else(|| OfflineError::Compile {
        kernel: name.to_string(),
        reason: format!("no resource line in ptxas' output: {}", log.trim_end()),
    })
}

/// The numbers of ptxas' `-v` lines for a file holding one entry function:
/// `N bytes stack frame, N bytes spill stores, N bytes spill loads` and
/// `Used N registers, ... N bytes smem, ...`.
pub fn parse_ptxas(log: &str) -> Option<PtxasReport> {
    let number_before = |line: &str, unit: &str| -> Option<u32> {
        let at = line.find(unit)?;
        line[..at].split_whitespace().last()?.parse().ok()
    };
    let mut report = PtxasReport::default();
    let mut seen_used = false;
    for line in log.lines() {
        if line.contains("bytes stack frame") {
            report.stack_bytes = number_before(line, "bytes stack frame")?;
            report.spill_stores = number_before(line, "bytes spill stores")?;
            report.spill_loads = number_before(line, "bytes spill loads")?;
        } else if let Some(at) = line.find("Used ") {
            let rest = &line[at..];
            report.registers = number_before(rest, "registers")?;
            report.static_shared_bytes = number_before(rest, "bytes smem").unwrap_or(0);
            seen_used = true;
        }
    }
    seen_used.then_some(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptxas_lines_are_read() {
        let log = "ptxas info    : 0 bytes gmem\n\
            ptxas info    : Compiling entry function 'k' for 'sm_90a'\n\
            ptxas info    : Function properties for k\n    \
            296 bytes stack frame, 104 bytes spill stores, 96 bytes spill loads\n\
            ptxas info    : Used 255 registers, used 1 barriers, 16 bytes smem, 400 bytes cmem[0]\n";
        let r = parse_ptxas(log).unwrap();
        assert_eq!(
            r,
            PtxasReport {
                registers: 255,
                spill_stores: 104,
                spill_loads: 96,
                stack_bytes: 296,
                static_shared_bytes: 16,
            }
        );
        let no_smem = "ptxas info    : Used 30 registers, used 0 barriers, 392 bytes cmem[0]\n";
        let r = parse_ptxas(no_smem).unwrap();
        assert_eq!(
            (r.registers, r.static_shared_bytes, r.spill_stores),
            (30, 0, 0)
        );
        assert_eq!(parse_ptxas("ptxas info    : 0 bytes gmem\n"), None);
    }
}
