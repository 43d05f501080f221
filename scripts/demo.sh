#!/usr/bin/env bash
# Run the demo on this machine (CPU is enough): a small GPT trains for a few steps with SSD
# offload into DEMO_DIR and again with policy=keep, then the two are compared.
#   bash scripts/demo.sh [more `ssdtrain demo` flags]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

DEMO_DIR="${DEMO_DIR:-./ssd-offload-demo}"   # EDIT: where offload files go (removed at exit)

make install                                 # .venv with torch==2.13.0 (CPU) and this package
exec .venv/bin/ssdtrain demo --dir "$DEMO_DIR" "$@"
