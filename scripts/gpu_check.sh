#!/usr/bin/env bash
# `make gpu-check`: the prepared check of the GPU data path for a bare single-GPU box (no
# network; python3 with a CUDA build of torch; the wheels of `make gpu-bundle` in .whl/). See
# ssdtrain_megatron/tools/gpucheck/gpu_check.py, or run with --help. GPU_CHECK_DRY=1 prints the time plan only. Exit
# status 0 only when every target passed. `make gpu-perf` runs gpu_perf the same way
# (GPU_SCRIPT=gpu_perf); the Python is in ssdtrain_megatron/tools/gpucheck/.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "gpu-check: $PYTHON not found; set PYTHON=/path/to/python3" >&2
    exit 2
fi
exec "$PYTHON" -m "ssdtrain_megatron.tools.gpucheck.${GPU_SCRIPT:-gpu_check}" "$@"
