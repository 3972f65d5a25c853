#!/usr/bin/env bash
# The libtorch backend (`--features tch`) on a fresh machine: sets up PyTorch 2.9.0 (the version
# tch 0.22 / burn-tch 0.21 are built for) in .tch/venv (ignored by git), builds with
# LIBTORCH_USE_PYTORCH=1 and runs on libtorch's CPU device:
#   - the model's HF parity tests (models/tests/parity.rs),
#   - the kernels' parity tests (the portable fallback; kernels/tests/parity.rs),
#   - the shrunk demo training with resume (tests/e2e/train.rs, demo_trains_on_libtorch).
# Exit 0 only when all of it passed. CI does not run this (see README: torch's wheel and its CUDA
# libraries are ~5 GB and the tch build adds a full build of the workspace); CI type-checks the tch
# build without libtorch instead (`cargo check --features tch-check`).
#
# PyPI's torch 2.9.0 wheel is the CUDA build (the CPU-only index is not reachable here); it runs on
# the CPU without a GPU. Set CONRUB_TCH_WHEELS=DIR to install from a folder of downloaded wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venv="$root/.tch/venv"

have_torch() {
  "$venv/bin/python3" -c 'import sys, torch; sys.exit(torch.__version__.split("+")[0] != "2.9.0")' 2>/dev/null
}
if ! have_torch; then
  echo "test-tch: installing torch 2.9.0 into $venv"
  python3 -m venv "$venv"
  extra=()
  if [ -n "${CONRUB_TCH_WHEELS:-}" ]; then extra=(--find-links "$CONRUB_TCH_WHEELS"); fi
  "$venv/bin/pip" install --quiet --disable-pip-version-check "${extra[@]}" "torch==2.9.0"
  have_torch || { echo "test-tch: torch 2.9.0 did not install" >&2; exit 1; }
fi

# torch-sys asks `python` on PATH (inside a virtualenv) where torch's headers and libraries are.
export VIRTUAL_ENV="$venv"
export PATH="$venv/bin:$PATH"
export LIBTORCH_USE_PYTORCH=1
torch_lib=$("$venv/bin/python3" -c 'import pathlib, torch; print(pathlib.Path(torch.__file__).parent / "lib")')
export LD_LIBRARY_PATH="$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export CARGO_TERM_COLOR=never

cargo test -p conrub-models --features tch --test models parity::
cargo test -p conrub-kernels --features tch --test kernels tch
cargo test --features tch --test e2e train::demo_trains_on_libtorch
echo "test-tch: every tch test passed"
