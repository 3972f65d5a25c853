#!/usr/bin/env bash
# Kernel parity and timings on an NVIDIA GPU, for a machine without Rust.
#
# Build here (offline; CUDA kernels compile with NVRTC at run time; match the driver's CUDA version):
#   CUDARC_CUDA_VERSION=13000 cargo build --release --features cuda
# Carry target/release/conrub and this script to the GPU machine, then:
#   scripts/gpu-check.sh [path/to/conrub] [cuda device index]
# It prints one table: parity of the fused ops on CUDA against the CPU fallback (values and
# gradients at the full 151,936 vocabulary), then fused vs naive timings of token_logprobs
# (4,096 x 151,936 x 1,024), of the clipped surrogate (64 x 8,192) and of a Qwen3-0.6B-shaped
# forward/backward step (4 x 1,024 tokens). It exits non-zero when parity fails.
set -euo pipefail
BIN="${1:-./target/release/conrub}"
DEV="${2:-0}"
if [[ ! -x "$BIN" ]]; then
  echo "gpu-check: no executable at $BIN (build it with --features cuda and pass its path)" >&2
  exit 2
fi
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
fi
echo "== f32 kernels on cuda:$DEV"
"$BIN" kernels-check --device "cuda:$DEV" --iters "${ITERS:-5}"
