#!/usr/bin/env bash
# TensorBoard 2.21 from PyPI in .tensorboard/venv (ignored by git; a second run finds it and does
# nothing), for the test that reads conrub's event files with TensorBoard's own EventAccumulator
# (crates/trainer/src/tensorboard.rs, `tensorboard_reads_a_resumed_run_with_one_value_per_step`).
# CI runs it and sets CONRUB_REQUIRE_TENSORBOARD=1; without the venv that test says it skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.tensorboard/venv
have_tensorboard() {
  "$venv/bin/python" -c 'import tensorboard, sys; sys.exit(tensorboard.__version__ != "2.21.0")' 2>/dev/null
}
if ! have_tensorboard; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "tensorboard==2.21.0"
  have_tensorboard || { echo "setup-tensorboard: tensorboard 2.21.0 did not install" >&2; exit 1; }
fi
