#!/usr/bin/env bash
# NVRTC, ptxas and the CUDA headers from NVIDIA's wheels on PyPI, unpacked into .cuda-tools/
# (ignored by git; a second run finds them and does nothing). No GPU, driver or toolkit needed:
# `conrub kernels-compile` (and kernels/tests/offline_compile.rs) compile CubeCL's generated CUDA
# C++ with them for sm_90. About 150 MB of wheels from PyPI (320 MB unpacked), fetched once.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.cuda-tools
if [[ -x "$DEST/nvidia/cuda_nvcc/bin/ptxas" && -e "$DEST/nvidia/cuda_nvrtc/lib/libnvrtc.so.12" ]]; then
  exit 0
fi
mkdir -p "$DEST/wheels"
python3 -m pip download --no-deps -q -d "$DEST/wheels" \
  nvidia-cuda-nvrtc-cu12==12.9.86 nvidia-cuda-nvcc-cu12==12.9.86 nvidia-cuda-runtime-cu12==12.9.79
for w in "$DEST"/wheels/*.whl; do
  python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$w" "$DEST"
done
chmod +x "$DEST/nvidia/cuda_nvcc/bin/ptxas"
rm -rf "$DEST/wheels"
