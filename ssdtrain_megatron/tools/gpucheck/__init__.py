"""The GPU check: `make gpu-check`, `make gpu-perf` and `make gpu-bundle` (docs/gpu-check.md;
README.md here: what runs on the box, what comes back, where the targets live).

``scripts/gpu_check.sh`` launches ``gpu_check`` or ``gpu_perf`` here with ``python -m``. The
parent process imports no torch (the box's bare python runs it): nothing here is imported at
the package level, and the parent's modules (gpu_check, gpu_check_plan, gpu_check_targets,
gpu_perf, gpu_perf_plan, gpu_perf_targets, gpu_bundle) import only the standard library and
each other. The steps, in their own processes, import torch and the library.

Imports go one way: this folder imports the library and the tools' own level (``minigpt``),
and ``bench/predict.py`` for the planner's prediction (gpu_perf_model); nothing outside it
imports it but the tests.
"""
