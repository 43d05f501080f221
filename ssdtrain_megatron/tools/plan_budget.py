"""What ``ssdtrain plan`` adds to the analytic model: bandwidth per GPU, node and drive, and
the activation budget left beside the model state (weights, gradients, optimizer state)."""

from __future__ import annotations

import argparse
from typing import Any, Dict

from ..plan.memory import model_state_bytes
from ..plan.model import ModelShape, required_write_gbps

DEFAULT_GPU_MEMORY = 80 * 10 ** 9
"""--gpu-memory's default: an 80 GB GPU (H100, A100 80GB)."""


def bandwidth(offloaded_bytes: int, step_s: float, gpus_per_node: int,
              drives_per_node: int) -> Dict[str, Any]:
    """Write and read GB/s that hide ``offloaded_bytes`` per step, per GPU, node and drive.
    Writes must fit in half the step (the paper's rule); the same bytes are read back in the
    other half, so the read rate equals the write rate."""
    gpu = required_write_gbps(offloaded_bytes, step_s)
    node = gpu * gpus_per_node
    return {"offloaded_bytes_per_step": offloaded_bytes,
            "write_gbps_per_gpu": gpu, "read_gbps_per_gpu": gpu,
            "write_gbps_per_node": node, "read_gbps_per_node": node,
            "write_gbps_per_drive": node / drives_per_node,
            "read_gbps_per_drive": node / drives_per_node}


def activation_budget(shape: ModelShape, args: argparse.Namespace,
                      preset_budget: Any = None) -> Dict[str, Any]:
    """Activation memory per GPU for the largest-micro-batch search, and where it comes from:
    --activation-budget, else the preset's activation_budget_bytes, else --gpu-memory less the
    model state (weights, gradients, optimizer state: plan/memory.py)."""
    gpu_memory = getattr(args, "gpu_memory", DEFAULT_GPU_MEMORY)
    state = model_state_bytes(shape)
    given = getattr(args, "activation_budget", None)
    source = "--activation-budget"
    if given is None and preset_budget is not None:
        given, source = preset_budget, "the preset's activation_budget_bytes"
    if given is None:
        budget, source = gpu_memory - state["bytes"], "--gpu-memory less the model state"
    elif isinstance(given, float) and given <= 1:
        budget, source = round(given * gpu_memory), f"{source}: {given:g} x --gpu-memory"
    else:
        budget = int(given)
    return {"gpu_memory_bytes": gpu_memory, "model_state": state,
            "activation_budget_bytes": max(budget, 0), "activation_budget_source": source,
            "fits": state["bytes"] + max(budget, 0) <= gpu_memory}
