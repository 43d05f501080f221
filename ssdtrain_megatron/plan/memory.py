"""What a GPU holds besides activations: weights, gradients and optimizer state, and so what is
left for activations. The planner's "largest micro-batch" searches within that.

Mixed-precision training with Adam, as Megatron runs it (its distributed-optimizer docs count
the same bytes), per parameter held on the GPU:

    weights      2 B  (bf16/fp16; 4 B when the model is fp32)
    main grads   4 B  (fp32, Megatron's gradient buffer)
    main params  4 B  (fp32 copy the optimizer updates; none when the model is fp32)
    Adam m, v    8 B  (fp32)

that is 18 B per parameter (16 B in fp32), or with ``distributed_optimizer`` 6 + 12 / d B,
the 12 B of main parameters and Adam states sharded over the d data-parallel ranks
(d = dp x cp for dense parameters, dp x cp / ep for expert parameters). Parameters on a GPU:
its pipeline stage's layers (the first stage, which also holds the word embeddings, the
stage with the most micro-batches in flight under 1F1B), the dense ones split over tp, the
experts over ep and tp. Not counted: the CUDA context, NCCL and allocator buffers,
fragmentation: plan/fit.py reserves GPU memory for them (its DEFAULT_RESERVE_BYTES, or
``ssdtrain plan --memory-reserve``), and the default activation budget is what the model state
and that reserve leave.
"""

from __future__ import annotations

from typing import Any, Dict

from .shape import ModelShape

ADAM_STATE_BYTES = 8
"""Adam's first and second moments, fp32."""
MAIN_GRAD_BYTES = 4
"""Megatron's fp32 gradient buffer (``accumulate_allreduce_grads_in_fp32``, its default with
bf16)."""


def layer_parameters(shape: ModelShape) -> Dict[str, int]:
    """Parameters of one transformer layer, whole (not split): ``dense`` and ``expert``."""
    h = shape.hidden
    kv_width = shape.groups * shape.head_dim
    q = shape.query_width
    attention = h * (q + 2 * kv_width) + q * h
    norms = 2 * h
    width = 3 if shape.swiglu else 2  # SwiGLU: gate, up and down projections
    if shape.num_experts is None:
        return {"dense": attention + norms + width * h * shape.ffn_hidden, "expert": 0}
    f_e = shape.moe_ffn_hidden or shape.ffn_hidden
    router = h * shape.num_experts
    return {"dense": attention + norms + router,
            "expert": shape.num_experts * width * h * f_e}


def parameters_per_gpu(shape: ModelShape) -> Dict[str, int]:
    """Parameters held on one GPU of the first pipeline stage: ``dense`` (split over tp;
    word embeddings included when ``vocab`` is set) and ``expert`` (over ep and tp)."""
    layer = layer_parameters(shape)
    n = shape.layers_per_stage
    embedding = (shape.vocab or 0) * shape.hidden
    dense = (n * layer["dense"] + embedding) // shape.tp
    expert = n * layer["expert"] // (shape.ep * shape.tp)
    return {"dense": dense, "expert": expert}


def bytes_per_parameter(shape: ModelShape, shards: int) -> float:
    """18 B (16 B in fp32), or 6 + 12 / shards B with the distributed optimizer."""
    weights = shape.dtype_bytes
    main_params = 4 if shape.dtype_bytes < 4 else 0
    sharded = main_params + ADAM_STATE_BYTES
    if shape.distributed_optimizer:
        return weights + MAIN_GRAD_BYTES + sharded / shards
    return weights + MAIN_GRAD_BYTES + sharded


def model_state_bytes(shape: ModelShape) -> Dict[str, int]:
    """Weights, gradients and optimizer state on one GPU of the first stage, in bytes, with
    the parameter counts behind them (see the module docstring for the formula)."""
    params = parameters_per_gpu(shape)
    dense_shards = shape.dp * shape.cp
    expert_shards = max(1, dense_shards // shape.ep)
    total = params["dense"] * bytes_per_parameter(shape, dense_shards) \
        + params["expert"] * bytes_per_parameter(shape, expert_shards)
    return {"dense_parameters": params["dense"], "expert_parameters": params["expert"],
            "bytes": int(total)}


def activation_budget(shape: ModelShape, gpu_memory: int, given: Any = None,
                      preset_budget: Any = None, reserve: int = 0) -> Dict[str, Any]:
    """Activation memory per GPU for a plan, and where it comes from: ``given``
    (``ssdtrain plan --activation-budget``), else the preset's activation_budget_bytes, else
    ``gpu_memory`` less the model state (weights, gradients, optimizer state:
    :func:`model_state_bytes`) and ``reserve`` (plan/fit.py). A fraction is of ``gpu_memory``;
    ``fits``: the model state, the reserve and the budget within ``gpu_memory``."""
    state = model_state_bytes(shape)
    source = "--activation-budget"
    if given is None and preset_budget is not None:
        given, source = preset_budget, "the preset's activation_budget_bytes"
    if given is None:
        budget = gpu_memory - state["bytes"] - reserve
        source = "GPU memory less the model state" + (" and the reserve" if reserve else "")
    elif isinstance(given, float) and given <= 1:
        budget, source = round(given * gpu_memory), f"{source}: {given:g} x GPU memory"
    else:
        budget = int(given)
    return {"gpu_memory_bytes": gpu_memory, "model_state": state,
            "activation_budget_bytes": max(budget, 0), "activation_budget_source": source,
            "reserve_bytes": reserve,
            "fits": state["bytes"] + reserve + max(budget, 0) <= gpu_memory}
