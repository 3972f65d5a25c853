#!/usr/bin/env python3
"""Resource use of the CUDA kernels in a CubeCL compilation log, compiled here without a GPU.

CubeCL writes every kernel it compiles (its CUDA C++ source, name and launch settings) to the file
named by CUBECL_DEBUG_LOG. This script takes such a log (from a run on a GPU machine, e.g.
`CUBECL_DEBUG_LOG=/tmp/cubecl.log conrub kernels-check --device cuda:0`), compiles each kernel
whose name matches --match with NVRTC for --arch as CubeCL does (`--gpu-architecture=sm_90a
-lineinfo`, CUDA headers on the include path), assembles the PTX with ptxas -v, and prints per
kernel: registers per thread, spill stores/loads, static shared memory, stack frame, the dynamic
shared memory the kernel declares, and the theoretical occupancy on an H200 for its block size.

NVRTC and ptxas come from NVIDIA's wheels (scripts/setup-cuda-tools.sh puts them in .cuda-tools/).
Exit status 1 when a kernel fails to compile or spills (the hot kernels must not).

    python3 scripts/kernel-resources.py LOG [--arch sm_90] [--match conrub_kernels] [--json]
"""
import argparse
import ctypes
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.environ.get("CONRUB_CUDA_TOOLS", os.path.join(ROOT, ".cuda-tools"))

# H200 (sm_90): per SM 65,536 registers, 2,048 threads, 32 blocks, 228 KiB shared memory
# (227 KiB usable by one block; 1 KiB reserved per block).
SM = dict(regs=65536, threads=2048, blocks=32, smem=233472, smem_block=232448, reserved=1024)


def kernels(log):
    """(name, cube_dim, source) of every kernel compilation in a CubeCL log."""
    text = open(log, encoding="utf-8", errors="replace").read()
    for block in text.split("[START_KERNEL_COMPILATION]")[1:]:
        block = block.split("[END_KERNEL_COMPILATION]")[0]
        name = re.search(r"name: (\S+)", block)
        dims = re.search(r"cube_dim: CubeDim \{\s*x: (\d+),\s*y: (\d+),\s*z: (\d+)", block)
        src = re.search(r"```(?:cpp|c\+\+)?\n(.*?)```", block, re.S)
        if name and src:
            threads = 1
            if dims:
                for d in dims.groups():
                    threads *= int(d)
            dtype = re.findall(r"Float\((\w+)\)", block)
            yield name.group(1).rstrip("<"), threads, sorted(set(dtype)), src.group(1)


def nvrtc():
    libs = glob.glob(os.path.join(TOOLS, "**/libnvrtc.so*"), recursive=True)
    libs = [l for l in libs if "builtins" not in l]
    if not libs:
        sys.exit(f"no libnvrtc under {TOOLS}: run scripts/setup-cuda-tools.sh")
    return ctypes.CDLL(sorted(libs)[0])


def compile_ptx(lib, source, arch):
    include = glob.glob(os.path.join(TOOLS, "**/cuda_runtime/include"), recursive=True)
    opts = [f"--gpu-architecture={arch}a" if int(arch[3:]) >= 90 else f"--gpu-architecture={arch}",
            "-lineinfo"] + [f"--include-path={i}" for i in include]
    prog = ctypes.c_void_p()
    src = source.encode()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, None, 0, None, None) == 0
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    buf = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, buf)
    if rc != 0:
        return None, buf.value.decode(errors="replace")
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(prog, ptx)
    return ptx.value.decode(), None


def ptxas(ptx, arch):
    exe = glob.glob(os.path.join(TOOLS, "**/bin/ptxas"), recursive=True)
    if not exe:
        sys.exit(f"no ptxas under {TOOLS}: run scripts/setup-cuda-tools.sh")
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.ptx")
        open(p, "w").write(ptx)
        a = arch + "a" if int(arch[3:]) >= 90 else arch
        out = subprocess.run([exe[0], f"-arch={a}", "-v", p, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True)
        return out.returncode, out.stderr


def occupancy(regs, threads, smem):
    if threads == 0:
        return 0.0
    warps = -(-threads // 32)
    by_regs = SM["regs"] // max(1, regs * 32 * warps) if regs else SM["blocks"]
    # Registers are allocated per warp in units of 256.
    per_warp = -(-regs * 32 // 256) * 256 if regs else 0
    by_regs = SM["regs"] // (per_warp * warps) if per_warp else SM["blocks"]
    by_threads = SM["threads"] // (warps * 32)
    by_smem = SM["smem"] // (smem + SM["reserved"]) if smem else SM["blocks"]
    blocks = min(by_regs, by_threads, by_smem, SM["blocks"])
    return blocks * warps * 32 / SM["threads"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("log")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--match", default="conrub_kernels")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    lib = nvrtc()
    rows, failed = [], False
    seen = set()
    for name, threads, dtypes, src in kernels(a.log):
        if a.match not in name or src in seen:
            continue
        seen.add(src)
        ptx, err = compile_ptx(lib, src, a.arch)
        short = name.split("::")[-1]
        if ptx is None:
            print(f"{short}: NVRTC failed:\n{err}", file=sys.stderr)
            failed = True
            continue
        rc, info = ptxas(ptx, a.arch)
        if rc != 0:
            print(f"{short}: ptxas failed:\n{info}", file=sys.stderr)
            failed = True
            continue
        regs = int((re.search(r"Used (\d+) registers", info) or [0, 0])[1])
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
        stores, loads = (int(spill[1]), int(spill[2])) if spill else (0, 0)
        stack = int((re.search(r"(\d+) bytes stack frame", info) or [0, 0])[1])
        smem = int((re.search(r"(\d+) bytes smem", info) or [0, 0])[1])
        row = dict(kernel=short, dtypes=dtypes, threads=threads, registers=regs,
                   spill_stores=stores, spill_loads=loads, stack_bytes=stack, static_shared=smem,
                   occupancy=round(occupancy(regs, threads, smem), 3))
        failed |= stores + loads > 0
        rows.append(row)
    if a.json:
        print(json.dumps(rows))
    else:
        print(f"{'kernel':32} {'dtypes':10} {'threads':>7} {'regs':>5} {'spill st/ld':>12} "
              f"{'stack':>6} {'smem':>6} {'occupancy':>9}")
        for r in rows:
            print(f"{r['kernel'][:32]:32} {','.join(r['dtypes'])[:10]:10} {r['threads']:>7} "
                  f"{r['registers']:>5} {r['spill_stores']:>5}/{r['spill_loads']:<6} "
                  f"{r['stack_bytes']:>6} {r['static_shared']:>6} {r['occupancy']:>9.2f}")
    sys.exit(1 if failed or not rows else 0)


if __name__ == "__main__":
    main()
