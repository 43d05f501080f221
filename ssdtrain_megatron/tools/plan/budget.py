"""The activation budget ``ssdtrain plan`` plans within: what the weights, gradients and
optimizer state leave of a GPU's memory, or what the user or the preset says."""

from __future__ import annotations

from typing import Any, Dict

from ...plan.memory import model_state_bytes
from ...plan.shape import ModelShape

def activation_budget(shape: ModelShape, gpu_memory: int, given: Any = None,
                      preset_budget: Any = None) -> Dict[str, Any]:
    """Activation memory per GPU for the plan, and where it comes from: ``given``
    (--activation-budget), else the preset's activation_budget_bytes, else ``gpu_memory`` less
    the model state (weights, gradients, optimizer state: the library's plan/memory.py). A
    fraction is of ``gpu_memory``."""
    state = model_state_bytes(shape)
    source = "--activation-budget"
    if given is None and preset_budget is not None:
        given, source = preset_budget, "the preset's activation_budget_bytes"
    if given is None:
        budget, source = gpu_memory - state["bytes"], "GPU memory less the model state"
    elif isinstance(given, float) and given <= 1:
        budget, source = round(given * gpu_memory), f"{source}: {given:g} x GPU memory"
    else:
        budget = int(given)
    return {"gpu_memory_bytes": gpu_memory, "model_state": state,
            "activation_budget_bytes": max(budget, 0), "activation_budget_source": source,
            "fits": state["bytes"] + max(budget, 0) <= gpu_memory}
