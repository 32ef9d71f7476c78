#!/usr/bin/env bash
# Everything GPU-only, checked in one run on a machine with CUDA (about 10 minutes on one H100); results in
# bench/results/gpu_check.json and a non-zero exit status when a check fails. `--cpu` runs the same
# code on the CPU with a small model (make test runs it: tests/test_gpu_check.py).
#   bash tests/gpu_check.sh [--cpu] [--out FILE] [--steps N]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}"
export NO_ALBUMENTATIONS_UPDATE=1 RAY_USAGE_STATS_ENABLED=0
exec "$PYTHON" -m tests.gpu_check "$@"
