#!/usr/bin/env bash
# Kernel parity and timings on an NVIDIA GPU, for a machine without Rust.
#
# Build here (offline; CUDA kernels compile with NVRTC at run time; match the driver's CUDA version):
#   CUDARC_CUDA_VERSION=13000 cargo build --release --features cuda
# Carry target/release/conrub and this script to the GPU machine, then:
#   scripts/gpu-check.sh [--only SECTIONS] [path/to/conrub] [cuda device index]
# SECTIONS (comma-separated, default all, in this order): compile, parity, demo, bench, allreduce.
# `bench` first times sampling at the full vocabulary against one softmax (`conrub bench sampling`,
# 256 rows; lines to $SAMPLING_OUT, default gpu-sampling.jsonl), then the attention kernels
# (`conrub bench attention`: portable vs tensor-core TFLOP/s at 2k and 8k tokens next to torch's
# SDPA from benches/gpu/sdpa.py, and split-KV decode; lines to $ATTENTION_OUT), then runs
# the benchmark against PyTorch (benches/gpu/compare.py: conrub's train step and
# rollout against transformers' on the same GPU, cold vs warm first step; its JSON lines go to
# $BENCH_OUT, default gpu-bench.jsonl, as they are measured) and needs python3 with torch and
# transformers; `demo` runs the demo's first steps twice on one kernel cache (cold, then warm)
# and prints each step's time and kernel_compiles. Sized for the lent machine: bench at most 5
# minutes of GPU time, the whole script at most 8, starts included.
# `parity` prints one table: whether the device's f32 matmuls run in TF32 (burn 0.21's CUDA matmuls do on
# an H200: cubek-matmul stages f32 operands as TF32 on tensor cores; the first H200 run measured
# 4.5e-5 on log-probs and 1.1e-3 on their gradients against the CPU's f32), parity of the fused
# ops on CUDA against true-f32 references (the log-prob rows against the textbook graph on the
# same device when its matmuls are TF32, with the TF32 cost against the CPU printed beside; values
# and gradients at the full 151,936 vocabulary), parity of the fused causal attention against the
# textbook graph on the CPU (out, dq, dk, dv; GQA 16/8, head_dim 128, 300 queries, padded keys; f32
# and bf16; then the tensor-core kernels in bf16 and f16 at the same shape and at 8,192 keys,
# GQA 4/2; a pass there is what lets `attention_kernels = "auto"` pick them, see
# conrub_kernels::TENSOR_CORE_KERNELS_VALIDATED), the sampling kernel against the host rule in
# every checked mode at the full vocabulary (min-p included) and the repetition penalty's
# gather and scatter against the host rule (conrub_kernels::sampling_check, as the lavapipe tests
# run it), parity and timing of the paged decode attention kernel against its gather fallback
# (Qwen3-4B heads 32/8 x 128, 64 rows of up to 2,048 keys in an interleaved pool; f32 and bf16),
# then fused vs naive timings of token_logprobs (4,096 x 151,936 x 1,024), of the
# clipped surrogate (64 x 8,192) and of a Qwen3-0.6B-shaped forward/backward step (4 x 1,024
# tokens), and one Qwen3-0.6B-shaped train step of the published recipe at 8,192 tokens
# (bf16-mixed, fused attention, per-layer activation checkpointing, AdamW), and one rollout of the
# paged engine at Qwen3-0.6B shape (64 rows = 8 prompts x 8, 256-token prompts, 1,024 new tokens,
# bf16-mixed: tokens/s, prefills, KV blocks, preemptions), then the data-parallel gradient
# all-reduce (NCCL vs host) on every GPU. It exits non-zero when parity fails (after the rest).
#
# On the lent H200 (CUDA 13.0 image): libnvrtc and libnccl live in the image's Python wheels; put
# their directories on LD_LIBRARY_PATH, never the toolkit's `stubs` directory (its libcuda stub
# fails the first call with CUDA_ERROR_STUB_LIBRARY). The first H200 run (2026-12-04) also found
# that the demo's first rollout spent over a minute compiling ~300 kernels with NVRTC (114 of them
# matmul autotune candidates, for each new shape bucket) with the GPU idle (`nvidia-dmon`: 0% SM);
# the two demo steps below did not finish in 150 s. A lever to try next: CUBECL_AUTOTUNE_LEVEL=minimal
# (coarser shape buckets: anchors at powers of 2.5 instead of 2, so fewer buckets tune).
set -euo pipefail
ONLY="compile,parity,demo,bench,allreduce"
if [[ "${1:-}" == "--only" ]]; then
  ONLY="$2"
  shift 2
fi
BIN="${1:-./target/release/conrub}"
DEV="${2:-0}"
want() { [[ ",$ONLY," == *",$1,"* ]]; }
if [[ ! -x "$BIN" ]]; then
  echo "gpu-check: no executable at $BIN (build it with --features cuda and pass its path)" >&2
  exit 2
fi
if [[ -z "${CONRUB_KEEP_LD_PATH:-}" ]]; then
  LIBS=$(find /usr/local /opt -name 'libnvrtc.so*' -o -name 'libnccl.so*' 2>/dev/null \
    | grep -v stubs | xargs -r -n1 dirname | sort -u | tr '\n' ':' || true)
  export LD_LIBRARY_PATH="${LIBS}${LD_LIBRARY_PATH:-}"
fi
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
fi
status=0
# One kernel cache for the whole script (a fresh one: the first section that needs a kernel
# compiles it, the later ones load it).
export CONRUB_KERNEL_CACHE="${CONRUB_KERNEL_CACHE:-$(mktemp -d)/kernels}"
echo "kernel cache: $CONRUB_KERNEL_CACHE"
# What each kernel should use here, compiled offline for sm_90 by `conrub kernels-compile` (CI
# checks it on every change; README "Compiled for an H200 without a GPU" has the full table):
#   kernel (head_dim 128)      regs  spill B  stack B  shared B  blocks/SM  occupancy
#   row_stats / logits_grad    22-30      0        0    0-3072          8       100%
#   surrogate fwd / bwd        24-40      0        0    0-4096        6-8    75-100%
#   attention_forward f32/bf16 255/166 104/0  296/1216    48316          4      12.5%
#   attention_dq               168-176  0-16    ~1540     48316          4      12.5%
#   attention_dkdv             255   108-164    ~2200     48504          4      12.5%
#   paged_decode               32       0-8      0-8      33792          6      18.8%
#   flash fwd / dq bf16,f16    72-96      0        0  102528-107008     2      12.5%
#   flash dkdv bf16,f16        72-128     0        0      78080          2       6.2%
#   sample (all dtypes)        32         0        0       3072          8       100%
# With a toolkit on this machine (ptxas, NVRTC and the headers under one folder), the same table
# from this machine's compiler; a difference from the list above is worth reading.
CUDA_HOME_GUESS="${CUDA_HOME:-/usr/local/cuda}"
if want compile && [[ -x "$CUDA_HOME_GUESS/bin/ptxas" ]]; then
  echo "== kernels compiled for sm_90 with $CUDA_HOME_GUESS"
  "$BIN" kernels-compile --arch sm_90 --tools "$CUDA_HOME_GUESS" \
    --known-spills kernels/known-spills.json || echo "gpu-check: kernels-compile failed (above)"
fi
if want parity; then
  echo "== f32 kernels on cuda:$DEV"
  # A failed parity goes on to the other checks (device time is short); the script's status says it.
  "$BIN" kernels-check --device "cuda:$DEV" --iters "${ITERS:-5}" || status=$?
fi

# The learner pipeline on the GPU: the demo's first two steps (rollout, lexical rewards, the
# device-resident train batch, updates with global clipping), twice on one fresh kernel cache: the
# first run compiles (its kernel warm-up line says how much), the second should compile nothing.
# Run from the repository root (it reads configs/ and data/).
if want demo; then
  DEMO_CACHE="$(mktemp -d)"
  for pass in cold warm; do
    echo "== demo steps on cuda:$DEV, $pass kernel cache"
    OUT_DIR="$(mktemp -d)"
    "$BIN" --kernel-cache "$DEMO_CACHE" train --config configs/demo-cpu.toml --device "cuda:$DEV" \
      --set run.max_steps=2 --set warmup.steps=2 --set "run.output_dir=\"$OUT_DIR\"" || status=$?
    python3 - "$OUT_DIR/metrics.jsonl" <<'PY' || true
import json, sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    if d["kind"] == "kernel_warmup":
        print(f"kernel warm-up: {d['secs']:.1f} s, {d.get('kernel_compiles')} compiles, {d.get('autotune_runs')} autotune runs")
    if d["kind"] == "step":
        secs = d["rollout_secs"] + d["judge_secs"] + d["update_secs"]
        print(f"step {d['step']}: {secs:.1f} s (rollout {d['rollout_secs']:.1f}, judge {d['judge_secs']:.1f}, update {d['update_secs']:.1f}), "
              f"kernel_compiles {d.get('kernel_compiles')}, autotune_runs {d.get('autotune_runs')}")
PY
  done
fi

# conrub against PyTorch on this GPU (benches/gpu/compare.py; at most about 5 minutes).
if want bench; then
  echo "== sampling at the full vocabulary vs one softmax (256 rows) on cuda:$DEV"
  "$BIN" bench sampling --device "cuda:$DEV" --rows 256 --iters 5 | tee "${SAMPLING_OUT:-gpu-sampling.jsonl}" \
    | python3 -c 'import json, sys
for l in sys.stdin:
    d = json.loads(l)
    print("  %-22s %9.3f ms  %6.2fx softmax" % (d["op"], d["secs"] * 1e3, d["vs_softmax"]))' || status=$?
  # Causal attention: the portable and tensor-core kernels (TFLOP/s, forward and forward +
  # backward, GQA 32/8 x 128, bf16, 2k and 8k tokens) next to torch's SDPA (flash) on this GPU,
  # and decode over the paged pool (64 rows x 2,048 keys, 1 row x 32,768) with and without key
  # splits against the gather fallback. Lines to $ATTENTION_OUT (default gpu-attention.jsonl).
  echo "== attention kernels vs torch SDPA on cuda:$DEV"
  ATT_OUT="${ATTENTION_OUT:-gpu-attention.jsonl}"
  : > "$ATT_OUT"
  "$BIN" bench attention --device "cuda:$DEV" --iters 5 >> "$ATT_OUT" || status=$?
  python3 benches/gpu/sdpa.py --device "cuda:$DEV" --iters 5 >> "$ATT_OUT" || status=$?
  python3 - "$ATT_OUT" <<'PY' || true
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
sdpa = {(r["op"], r["tokens"]): r for r in rows if r.get("impl") == "torch-sdpa"}
print("  %-17s %6s  %-12s %10s %8s %8s" % ("op", "tokens", "kernels", "ms", "TFLOP/s", "x SDPA"))
for r in rows:
    if r.get("op") == "decode":
        continue
    ref = sdpa.get((r["op"], r["tokens"]))
    name = r.get("kernels") or r.get("impl")
    ratio = "%8.2f" % (r["tflops"] / ref["tflops"]) if ref and r.get("tflops") else "       -"
    print("  %-17s %6d  %-12s %10.3f %8.1f %s" % (r["op"], r["tokens"], name, r["secs"] * 1e3, r["tflops"], ratio))
for r in rows:
    if r.get("op") == "decode":
        print("  decode %3d rows x %6d keys  %-8s %9.3f ms  %5.2fx gather" % (r["rows"], r["tokens"], r["kernels"], r["secs"] * 1e3, r["vs_gather"]))
PY
  echo "== benchmark against PyTorch on cuda:$DEV"
  python3 benches/gpu/compare.py --bin "$BIN" --device "$DEV" --out "${BENCH_OUT:-gpu-bench.jsonl}" \
    --timeout "${BENCH_TIMEOUT:-120}" --budget "${BENCH_BUDGET:-270}" \
    --kernel-cache "$CONRUB_KERNEL_CACHE" \
    ${BENCH_ONLY:+--only "$BENCH_ONLY"} || status=$?
fi

# Data parallelism on whatever GPUs the machine has: the NCCL all-reduce, reduce-scatter and
# all-gather of gradient buckets (world size 1 on one GPU) against the host collective on the
# same buckets, with GB/s per rank; then, with two or more GPUs, one demo step on all of them
# (one rank per GPU) in each sharding mode.
if want allreduce; then
  NGPU="$(nvidia-smi -L 2>/dev/null | wc -l || echo 1)"
  [[ "$NGPU" -ge 1 ]] || NGPU=1
  DEVS="$(seq -s, -f 'cuda:%g' 0 $((NGPU - 1)))"
  echo "== gradient all-reduce on $DEVS (NCCL vs host)"
  "$BIN" allreduce-check --devices "$DEVS" --mb 64 --buckets 4
  if [[ "$NGPU" -ge 2 ]]; then
    # One shrunk step per sharding mode; each prints its collectives' bytes and seconds per
    # step (`full` with activation checkpointing, which it gathers through).
    for MODE in none optimizer gradients full; do
      echo "== data-parallel learner step on $DEVS (demo config, sharding = $MODE)"
      DP_DIR="$(mktemp -d)"
      "$BIN" train --config configs/demo-cpu.toml --devices "$DEVS" \
        --set run.max_steps=1 --set warmup.steps=2 --set "run.output_dir=\"$DP_DIR\"" \
        --set learner.activation_checkpointing=true \
        --set "sharding=\"$MODE\"" || status=$?
      grep '"kind":"step"' "$DP_DIR/metrics.jsonl" | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    print("step %d: " % m["step"] + ", ".join("%s %d bytes in %.3f s" % (k, m[k + "_bytes"], m[k + "_secs"])
          for k in ("allreduce", "reduce_scatter", "all_gather"))
          + "; device memory per rank (GB): %s" % [round(b / 1e9, 2) for b in m.get("device_memory_reserved_bytes", [])])' || status=$?
    done
  fi
fi
exit "$status"
