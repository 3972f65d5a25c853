"""conrub against PyTorch on the same GPU, in one run: each case runs conrub's side
(`conrub bench ...`) and PyTorch's (`torch_side.py`) on the same shapes and tokens; every JSON
line is appended to `--out` as soon as it exists (a run cut off keeps what it measured), and the
table with the ratios is printed at the end (and rebuilt from `--out` with `--table-only`).

Cases (`--only` picks some, by name):
- `train-0.6b-8x2048`, `train-0.6b-1x8192`: one training step of the 0.6B shape, bf16-mixed;
- `train-4b-8x2048`, `train-4b-1x8192`: the 4B shape with activation checkpointing on both sides;
- `rollout-0.6b`: 64 rows x exactly 1,024 new tokens from 256-token prompts;
- `first-step`: conrub's first training step (0.6B, 1 x 2,048) in a process with a cold kernel
  cache, then in one with the cache that run left (warm).

Every conrub case shares one kernel cache folder (`--kernel-cache`, a fresh one by default), so
kernels compile once per run of this script, in whichever case needs them first (`first-step`
runs first when selected). A side of a case that takes longer than `--timeout` seconds is recorded
as skipped with that reason, and no case starts once `--budget` seconds (300 by default: the
issue's five minutes of GPU time) have passed.

Usage: python3 benches/gpu/compare.py --bin target/release/conrub [--device 0] [--only ...]
       python3 benches/gpu/compare.py --device cpu --check  (every case shrunk: a check without a
       GPU of both sides' command lines and of the table)
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

CASES = {
    "first-step": dict(what="first-step", shape="0.6b", rows=1, seq=2048),
    "train-0.6b-8x2048": dict(what="train", shape="0.6b", rows=8, seq=2048, ckpt=False),
    "train-0.6b-1x8192": dict(what="train", shape="0.6b", rows=1, seq=8192, ckpt=False),
    "train-4b-8x2048": dict(what="train", shape="4b", rows=8, seq=2048, ckpt=True),
    "train-4b-1x8192": dict(what="train", shape="4b", rows=1, seq=8192, ckpt=True),
    "rollout-0.6b": dict(what="rollout", shape="0.6b", rows=64, prompt=256, new=1024),
}


def bandwidth_gbs(name):
    """HBM bandwidth of the GPUs we run on (decimal GB/s); 0 when unknown."""
    n = name.upper()
    if "H200" in n:
        return 4800.0
    if "H100" in n:
        return 3350.0
    return 0.0


def gpu_name(device):
    if device == "cpu":
        return "cpu"
    try:
        out = subprocess.run(["nvidia-smi", "-i", device, "--query-gpu=name",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        return out.stdout.strip() or "unknown GPU"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown GPU"


def run_json(cmd, timeout, env=None):
    """The last JSON line `cmd` prints, or a skip record naming why there is none."""
    started = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"skipped": f"did not finish in {timeout} s"}
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        return {"skipped": f"exit {p.returncode} after {time.time() - started:.0f} s: {tail[:200]}"}
    return json.loads(lines[-1])


def emit(out, case, record):
    record = dict(record, case=case)
    print(json.dumps(record), flush=True)
    with open(out, "a") as f:
        f.write(json.dumps(record) + "\n")


def conrub_cmd(args, spec, shape):
    dev = "cpu" if args.device == "cpu" else f"cuda:{args.device}"
    base = [args.bin, "--kernel-cache", args.kernel_cache, "bench"]
    if spec["what"] == "rollout":
        return base + ["rollout", "--shape", shape, "--rows", str(spec["rows"]), "--prompt",
                       str(spec["prompt"]), "--new", str(spec["new"]), "--device", dev,
                       "--bandwidth-gbs", str(args.bandwidth)]
    cmd = base + ["train", "--shape", shape, "--rows", str(spec["rows"]), "--seq",
                  str(spec["seq"]), "--device", dev, "--iters", str(args.iters)]
    return cmd + (["--checkpointing"] if spec.get("ckpt") else [])


def torch_cmd(args, spec, shape):
    dev = "cpu" if args.device == "cpu" else f"cuda:{args.device}"
    cmd = [sys.executable, os.path.join(HERE, "torch_side.py"), spec["what"], "--shape", shape,
           "--rows", str(spec["rows"]), "--device", dev, "--iters", str(args.iters)]
    if spec["what"] == "rollout":
        return cmd + ["--prompt", str(spec["prompt"]), "--new", str(spec["new"])]
    return cmd + ["--seq", str(spec["seq"])] + (["--checkpointing"] if spec.get("ckpt") else [])


# `--check`: every case at the tiny shape and a few tokens.
CHECK = dict(shape="tiny", rows=2, seq=64, prompt=16, new=8)


def run_case(args, name, spec):
    if args.check:
        spec = dict(spec, **{k: v for k, v in CHECK.items() if k in spec})
    shape = spec["shape"]
    if spec["what"] == "first-step":
        # A cold kernel cache of its own, then the same cache again (warm).
        cache = tempfile.mkdtemp(prefix="conrub-first-step-")
        local = argparse.Namespace(**vars(args))
        local.kernel_cache = cache
        train = dict(spec, what="train", ckpt=False)
        for label in ("cold", "warm"):
            local.iters = 0
            r = run_json(conrub_cmd(local, train, shape), args.timeout)
            emit(args.out, name, dict(r, side="conrub", cache=label, shape=shape))
        return
    emit(args.out, name, run_json(conrub_cmd(args, spec, shape), args.timeout))
    emit(args.out, name, run_json(torch_cmd(args, spec, shape), args.timeout))


def ratio(a, b):
    return f"{a / b:.2f}x" if a and b else "-"


def table(path):
    rows = [json.loads(l) for l in open(path) if l.strip()]
    by = {}
    for r in rows:
        by.setdefault(r["case"], []).append(r)
    print()
    print("| case | conrub | PyTorch | conrub / PyTorch | notes |")
    print("|---|---|---|---|---|")
    for case, rs in by.items():
        both = next((r for r in rs if r.get("side") == "both"), None)
        if both:
            print(f"| {case} | skipped | skipped | - | {both['skipped']} |")
            continue
        c = next((r for r in rs if r.get("side") == "conrub" and "cache" not in r), None)
        t = next((r for r in rs if r.get("side") == "pytorch"), None)
        if case == "first-step":
            firsts = {r.get("cache"): r for r in rs}
            cold, warm = firsts.get("cold", {}), firsts.get("warm", {})
            fmt = lambda r: (f"{r['first_step_secs']:.1f} s, {r['first_step_kernel_compiles']} "
                             f"compiles" if "first_step_secs" in r else r.get("skipped", "-"))
            print(f"| first step, cold cache / warm cache | {fmt(cold)} | {fmt(warm)} | "
                  f"{ratio(cold.get('first_step_secs'), warm.get('first_step_secs'))} | "
                  f"conrub only (second column: warm) |")
            continue
        def cell(r):
            if r is None:
                return "-"
            if "skipped" in r:
                return "skipped: " + r["skipped"]
            s = f"{r['tokens_per_s']:.0f} tok/s"
            if "mfu" in r:
                s += f", MFU {100 * r['mfu']:.1f}%"
            return s
        notes = []
        if c and "timed_kernel_compiles" in c:
            notes.append(f"conrub compiles per timed step {c['timed_kernel_compiles']}")
        if c and c.get("bandwidth_bound_tokens_per_s", 1) > 1:
            notes.append(f"bandwidth bound {c['bandwidth_bound_tokens_per_s']:.0f} tok/s")
        if t and t.get("what") == "train" and "skipped" not in t:
            notes.append("PyTorch: sdpa, bf16 autocast, fused AdamW, loss in 1,024-token chunks")
        tc = c.get("tokens_per_s") if c else None
        tt = t.get("tokens_per_s") if t else None
        print(f"| {case} | {cell(c)} | {cell(t)} | {ratio(tc, tt)} | {'; '.join(notes)} |")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin", default="target/release/conrub")
    p.add_argument("--device", default="0", help="CUDA index, or cpu")
    p.add_argument("--only", default=",".join(CASES), help="comma-separated case names")
    p.add_argument("--out", default="gpu-bench.jsonl")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per side of a case")
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--budget", type=float, default=300.0,
                   help="seconds for the whole run: cases not started by then are skipped")
    p.add_argument("--kernel-cache", default=None, help="conrub's kernel cache (default: fresh)")
    p.add_argument("--check", action="store_true",
                   help="every case at the tiny shape and a few tokens (no GPU needed)")
    p.add_argument("--table-only", action="store_true")
    args = p.parse_args()
    if not args.table_only:
        args.kernel_cache = args.kernel_cache or tempfile.mkdtemp(prefix="conrub-kernels-")
        args.bandwidth = bandwidth_gbs(gpu_name(args.device))
        unknown = [c for c in args.only.split(",") if c and c not in CASES]
        if unknown:
            sys.exit(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
        started = time.time()
        for name in [c for c in CASES if c in args.only.split(",")]:
            spent = time.time() - started
            if spent > args.budget:
                emit(args.out, name, {"side": "both", "skipped":
                                      f"the run's budget of {args.budget:.0f} s was spent ({spent:.0f} s)"})
                continue
            run_case(args, name, CASES[name])
    table(args.out)


if __name__ == "__main__":
    main()
