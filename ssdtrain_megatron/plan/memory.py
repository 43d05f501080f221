"""What a GPU holds besides activations: weights, gradients and optimizer state, and so what is
left for activations. The planner's "largest micro-batch" searches within that.

Mixed-precision training with Adam, as Megatron runs it (its distributed-optimizer docs count
the same bytes), per parameter held on the GPU:

    weights      2 B  (bf16/fp16; 4 B when the model is fp32)
    main grads   4 B  (fp32, Megatron's gradient buffer: with bf16 Megatron-LM turns on
                      --accumulate-allreduce-grads-in-fp32; 2 B with --main-grads-dtype bf16,
                      ``ModelShape.main_grad_bytes``)
    main params  4 B  (fp32 copy the optimizer updates; none when the model is fp32)
    Adam m, v    8 B  (fp32)

that is 18 B per parameter (16 B in fp32), or with ``distributed_optimizer`` 6 + 12 / d B,
the 12 B of main parameters and Adam states sharded over the d data-parallel ranks
(d = dp x cp for dense parameters, dp x cp / ep for expert parameters); 4 + 12 / d B with
bf16 gradients.

megatron-core's optimizer CPU offload (``--optimizer-cpu-offload``, ``--optimizer-offload-fraction
F``, with ``--use-precision-aware-optimizer`` and so the distributed optimizer;
megatron/core/optimizer/cpu_offloading/, ``HybridDeviceOptimizer``) takes the first F of the
optimizer's parameters (by elements, of each rank's shard) to host memory: their fp32 main
weights and Adam states leave the GPU (12 of the 12 / d B above), the weights and the gradient
buffer stay. In host memory, per offloaded parameter (:func:`optimizer_host_bytes`):

    main params  4 B  fp32, pageable (a copy of the pinned one below, made in fp32)
    Adam m, v    8 B  fp32, pageable (torch's AdamW makes them at its first step)
    grads        4 B  fp32, pinned (the copy target of each step's gradients, in the main
                      params' dtype)
    first copy   2 B  bf16, pinned: the parameter's first copy to host, freed at once but kept
                      by torch's pinned-memory cache (CachingHostAllocator), which rounds each
                      block up to a power of two (not counted)

18 B (16 B for an fp32 model, whose pinned first copy is the main parameter itself), 6 B of
them pinned. Parameters on a GPU:
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
MAIN_PARAM_BYTES = 4
"""The optimizer's fp32 main parameters."""
HOST_GRAD_BYTES = 4
"""The optimizer CPU offload's pinned gradient copy per offloaded parameter (fp32, the main
parameters' dtype)."""


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
    """GPU bytes per parameter: 18 B (16 B in fp32), or 6 + 12 / shards B with the
    distributed optimizer; the main gradients at ``shape.main_grad_bytes`` (fp32 models: 4),
    or 2 under ``--grad-reduce-in-bf16`` (Megatron then does not turn on
    ``--accumulate-allreduce-grads-in-fp32`` for bf16, so its gradient buffer is bf16); the
    optimizer's 12 B (8 in fp32) times 1 - ``optimizer_offload_fraction``."""
    weights = shape.dtype_bytes
    grads = (2 if shape.grad_reduce_in_bf16 else shape.main_grad_bytes) \
        if shape.dtype_bytes < 4 else 4
    sharded = optimizer_gpu_bytes(shape) * (1 - shape.optimizer_offload_fraction)
    if shape.distributed_optimizer:
        return weights + grads + sharded / shards
    return weights + grads + sharded


def optimizer_gpu_bytes(shape: ModelShape) -> int:
    """The optimizer's bytes per parameter it updates: fp32 main parameters (none when the
    model is fp32) and Adam's two states."""
    return (MAIN_PARAM_BYTES if shape.dtype_bytes < 4 else 0) + ADAM_STATE_BYTES


def optimizer_host_bytes(shape: ModelShape) -> Dict[str, int]:
    """Host bytes per parameter the optimizer CPU offload moves (module docstring):
    ``pinned`` and ``pageable``."""
    if shape.dtype_bytes < 4:
        return {"pinned": HOST_GRAD_BYTES + shape.dtype_bytes,
                "pageable": MAIN_PARAM_BYTES + ADAM_STATE_BYTES}
    return {"pinned": MAIN_PARAM_BYTES + HOST_GRAD_BYTES, "pageable": ADAM_STATE_BYTES}


def optimizer_parameters(shape: ModelShape) -> Dict[str, float]:
    """Parameters the optimizer on one GPU of the first stage updates (its shard under the
    distributed optimizer), and how many of them its CPU offload moves to host memory."""
    params = parameters_per_gpu(shape)
    dense_shards = shape.dp * shape.cp if shape.distributed_optimizer else 1
    expert_shards = max(1, shape.dp * shape.cp // shape.ep) if shape.distributed_optimizer else 1
    updated = params["dense"] / dense_shards + params["expert"] / expert_shards
    return {"updated": updated, "offloaded": updated * shape.optimizer_offload_fraction}


def model_state_bytes(shape: ModelShape) -> Dict[str, int]:
    """Weights, gradients and optimizer state on one GPU of the first stage, in bytes, with
    the parameter counts behind them (see the module docstring for the formula); and the host
    memory the optimizer CPU offload takes for that GPU (``host_bytes``, ``pinned_host_bytes``;
    0 without it)."""
    params = parameters_per_gpu(shape)
    dense_shards = shape.dp * shape.cp
    expert_shards = max(1, dense_shards // shape.ep)
    total = params["dense"] * bytes_per_parameter(shape, dense_shards) \
        + params["expert"] * bytes_per_parameter(shape, expert_shards)
    offloaded = optimizer_parameters(shape)["offloaded"]
    host = optimizer_host_bytes(shape)
    return {"dense_parameters": params["dense"], "expert_parameters": params["expert"],
            "bytes": int(total), "offloaded_parameters": int(offloaded),
            "host_bytes": int(offloaded * (host["pinned"] + host["pageable"])),
            "pinned_host_bytes": int(offloaded * host["pinned"])}


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
