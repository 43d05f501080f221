"""The GPU check: `make gpu-check`, `make gpu-perf` and `make gpu-bundle` (docs/gpu-check.md)."""
