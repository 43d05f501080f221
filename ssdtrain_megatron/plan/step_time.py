"""How long a Megatron layer, micro-batch and step take on a node: the planner's time terms.

One GPU, one micro-batch, one transformer layer (docs/models.md, "The model's terms"):

* GEMMs (:func:`layer_gemms`): each of the layer's GEMMs at its own (M, N, K) on this rank,
  in the job's precision (FP8 with ``--fp8-format``), at the GPU kind's rate and the wave
  quantization of its shape (plan/gpu_kind.py); the experts' GEMMs at their rows per expert
  (grouped in one kernel with ``--moe-grouped-gemm``, else one after another). Backward runs
  the data and weight gradients: twice the forward's GEMMs.
* attention: causal flash attention at its own forward and backward rates, by the keys each
  kernel call sees (plan/gpu_kind.py's attention_rate).
* memory-bound passes (:func:`elementwise_bytes`): norms, rotary, SwiGLU, residual adds,
  dropout, FP8 casts (Transformer Engine's current scaling reads each input twice, for its
  amax and its cast, and writes it in both layouts Hopper's FP8 GEMMs need), MoE permutes.
* tensor parallelism: its all-gathers and reduce-scatters over NVLink; exposed, or, with
  ``--tp-comm-overlap``, one of its tp pipelined steps and whatever the GEMMs do not cover.
* context parallelism: the ring's key/value exchange (their gradients too in backward), over
  NVLink when tp x cp GPUs share a node, else the NICs; overlapped with the attention it feeds.
* expert parallelism: the dispatch and combine all-to-all (forward and backward), exposed.

A step (:func:`step_overheads`): the pipeline bubble, (pp - 1) / vp micro-batch times under
Megatron's (interleaved) 1F1B; pipeline sends, exposed without the interleaved schedule (it
overlaps them: Megatron's overlap_p2p_comm); data-parallel gradient reduce-scatter (all-reduce
without the distributed optimizer) and parameter all-gather over dp x cp ranks, over NVLink
within a node else the node's NICs, hidden behind the last micro-batch's backward with
``--overlap-grad-reduce`` and behind the first one's forward with ``--overlap-param-gather``;
the optimizer's memory-bound update of its shard.

A node whose profile holds a measured GEMM table (``gemm_tflops_by_shape``, from ``ssdtrain
doctor --node-profile`` on a GPU) runs each GEMM at the rate measured at the nearest shape of
its dtype (plan/gpu_kind.py ``nearest_measured``): the experts of a grouped GEMM as one GEMM
of their stacked rows, else each at its own rows; a dtype the table lacks at the kind's
efficiency and waves. :func:`gemm_source` says which, for the plan's assumptions line.

A node with no ``gpu_kind`` (a custom profile, ``--gpu-tflops``) runs every FLOP at its one
achieved rate (``gpu_tflops``, or its ``gpu_tflops_by_tokens``) with no memory-bound passes:
the terms above that need a kind are then left out, said so in the plan's assumptions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from .gpu_kind import (TILE_M, TILE_N, GpuKind, attention_rate, gemm_seconds, gpu_kind, memory_seconds,
                       wave_efficiency)
from .gpu_kind import measured_gemm_seconds
from .memory import layer_parameters
from .model import attention_core_flops, local_sequence_shape
from .node import NodeProfile
from .shape import ModelShape

#: Achieved bus bandwidth of NCCL's ring collectives over one link, of its rated GB/s
#: (nccl-tests all-gather / reduce-scatter busbw on DGX H100 NVLink4: about 360 of 450 GB/s;
#: on 400 Gb/s InfiniBand about 40-45 of 50 GB/s).
LINK_EFFICIENCY = 0.8

#: Bytes per parameter the optimizer step reads and writes on its shard: the fp32 gradient
#: (4), the fp32 main parameter and Adam's two moments read and written (24), the bf16 copy
#: written (2).
OPTIMIZER_BYTES_PER_PARAM = 30

_BF16 = 2


@dataclass(frozen=True)
class Gemm:
    """One GEMM of a layer's forward on one rank: (m x k) @ (k x n), ``count`` times (the
    experts of a rank, one after another), or ``grouped`` in one kernel."""

    name: str
    m: int
    n: int
    k: int
    precision: str = "bf16"
    count: int = 1
    grouped: bool = False

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k * self.count


@dataclass(frozen=True)
class LayerTime:
    """One transformer layer, one micro-batch, one GPU: seconds by term."""

    forward: Dict[str, float] = field(default_factory=dict)
    backward: Dict[str, float] = field(default_factory=dict)
    recompute_s: float = 0.0
    """What the layout's own recompute granularity adds to the backward."""

    @property
    def forward_s(self) -> float:
        return sum(self.forward.values())

    @property
    def backward_s(self) -> float:
        return sum(self.backward.values()) + self.recompute_s


def timed_by_terms(node: NodeProfile) -> bool:
    """Whether ``node`` is timed by these terms: it names a GPU kind and has no measured
    ``gpu_tflops_by_tokens`` (a measurement replaces the model)."""
    return bool(getattr(node, "gpu_kind", None)) and not node.gpu_tflops_by_tokens


def _kind(node: NodeProfile) -> Optional[GpuKind]:
    return gpu_kind(node.gpu_kind) if timed_by_terms(node) else None


def local_tokens(shape: ModelShape) -> int:
    """Rows of this rank's GEMMs for one micro-batch: b x s / cp (sequence parallelism
    all-gathers the tp ranks' parts before each column-parallel GEMM)."""
    return shape.micro_batch * shape.seq_len // shape.cp


def layer_gemms(shape: ModelShape) -> List[Gemm]:
    """The forward GEMMs of one layer on one rank (see the module docstring)."""
    t, h, tokens = shape.tp, shape.hidden, local_tokens(shape)
    q, kv = shape.query_width, shape.groups * shape.head_dim
    p = "fp8" if shape.fp8 else "bf16"
    gemms = [Gemm("qkv", tokens, (q + 2 * kv) // t, h, p), Gemm("proj", tokens, h, q // t, p)]
    width = 2 if shape.swiglu else 1
    if shape.num_experts is None:
        f = shape.ffn_hidden
        return gemms + [Gemm("fc1", tokens, width * f // t, h, p), Gemm("fc2", tokens, h, f // t, p)]
    # Balanced routing: each rank receives as many rows as it sends, tokens x top-k, split
    # over its num_experts / ep experts.
    local = shape.num_experts // shape.ep
    rows = tokens * shape.moe_topk // local
    f_e = shape.moe_ffn_hidden or shape.ffn_hidden
    grouped = shape.moe_grouped_gemm
    return gemms + [Gemm("router", tokens, shape.num_experts, h),
                    Gemm("expert_fc1", rows, width * f_e // t, h, p, local, grouped),
                    Gemm("expert_fc2", rows, h, f_e // t, p, local, grouped)]


def gemm_time(g: Gemm, kind: Optional[GpuKind], node: NodeProfile, tokens: int) -> float:
    """Seconds of ``g`` (all its count) on the node's GPU kind, or at the node's one rate."""
    if kind is None:
        return g.flops / node.flops_at(tokens)
    table = getattr(node, "gemm_tflops_by_shape", None)
    if table:
        stacked = g.grouped and g.count > 1
        one = measured_gemm_seconds(table, g.count * g.m if stacked else g.m, g.n, g.k, g.precision)
        if one is not None:
            return one if stacked else g.count * one
    eff = getattr(node, "gemm_efficiency", None)
    if g.grouped and g.count > 1:
        # one kernel: the experts' tiles share the waves, instead of each running its own
        one = gemm_seconds(kind, g.m, g.n, g.k, g.precision, eff)
        tiles = g.count * -(-g.m // TILE_M) * -(-g.n // TILE_N)
        waves = -(-tiles // kind.sms)
        shared = g.count * g.m * g.n / (waves * kind.sms * TILE_M * TILE_N)
        return g.count * one * wave_efficiency(g.m, g.n, kind.sms) / shared
    return g.count * gemm_seconds(kind, g.m, g.n, g.k, g.precision, eff)


def gemm_source(node: Mapping[str, Any]) -> str:
    """Where a node's GEMM rates come from, in words for the plan's assumptions line (from its
    profile's dict): the measured table (and the dtypes it lacks), else the kind's
    efficiency and waves."""
    table = node.get("gemm_tflops_by_shape")
    if not table:
        return "GEMMs at the kind's efficiency and waves (plan/gpu_kind.py; a profile's gemm_efficiency replaces it)"
    rows = [r["dtype"] if isinstance(r, Mapping) else r[3] for r in table]
    measured = ", ".join(f"{rows.count(d)} {d}" for d in ("bf16", "fp8") if d in rows)
    lacking = [d for d in ("bf16", "fp8") if d not in rows]
    return (f"GEMMs at the rate of the nearest of the profile's measured shapes "
            f"(gemm_tflops_by_shape: {measured} rows; nearest by log FLOPs and narrowest dimension)"
            + (f"; {', '.join(lacking).upper()} at the kind's efficiency and waves (not measured)"
               if lacking else ""))


def elementwise_bytes(shape: ModelShape) -> Tuple[int, int]:
    """(forward, backward) bytes one layer's memory-bound passes move on one rank for one
    micro-batch (module docstring): h-wide passes on the rank's sequence-parallel share of
    the tokens, the others on its heads' or FFN's share; backward moves about twice the
    forward's (it reads the saved input and the gradient, writes the gradient)."""
    t, h = shape.tp, shape.hidden
    tokens = local_tokens(shape)
    sp = tokens // t if shape.sequence_parallel else tokens
    q, kv = shape.query_width, shape.groups * shape.head_dim
    d = _BF16
    f = shape.ffn_hidden
    rows, f_mlp = tokens, f
    if shape.num_experts is not None:
        rows = tokens * shape.moe_topk
        f_mlp = shape.moe_ffn_hidden or f
    # two norms (read h, write h), two residual adds (read 2h, write h), rotary on q and k
    elems = sp * (2 * 2 * h + 2 * 3 * h) + tokens * 2 * (q + kv) // t
    # SwiGLU reads 2f and writes f; GeLU reads f and writes f
    elems += rows * (3 if shape.swiglu else 2) * f_mlp // t
    if shape.hidden_dropout > 0:  # two dropouts: read h, write h and a 1-byte mask
        elems += sp * 2 * 2 * h + sp * h  # (the mask counted as half an element of 2 bytes)
    if shape.num_experts is not None:  # permute and unpermute: read and write top-k rows of h
        elems += 2 * 2 * rows * h
    forward = d * elems
    backward = 2 * forward
    if shape.fp8:
        # Current scaling: read bf16 twice (amax, cast), write fp8 in both layouts: 6 bytes per
        # element of each GEMM's input (forward) and output gradient (backward).
        fwd_in = sp * h + tokens * q // t + sp * h + rows * f_mlp // t
        bwd_in = tokens * (q + 2 * kv) // t + sp * h + rows * 2 * f_mlp // t + sp * h
        forward += 6 * fwd_in
        backward += 6 * bwd_in
    return forward, backward


def link_gbps(node: NodeProfile, group_gpus: int) -> float:
    """GB/s one GPU's ring collectives get over a group of ``group_gpus`` consecutive ranks:
    NVLink within a node, else the GPU's share of the node's NICs; achieved (LINK_EFFICIENCY).
    A node with no NICs given: NVLink (inter-node traffic not modelled)."""
    if group_gpus <= node.gpus_per_node or not getattr(node, "nics", 0):
        return node.nvlink_gbps * LINK_EFFICIENCY
    per_gpu = node.nics * node.nic_gbps / 8 / node.gpus_per_node
    return min(node.nvlink_gbps, per_gpu) * LINK_EFFICIENCY


def layer_time(shape: ModelShape, node: NodeProfile) -> LayerTime:
    """Seconds of one layer's forward and backward, by term (module docstring)."""
    kind = _kind(node)
    tokens = local_tokens(shape)
    gemms = layer_gemms(shape)
    gemm = sum(gemm_time(g, kind, node, tokens) for g in gemms)
    attn_flops = attention_core_flops(shape) / shape.cp / shape.tp
    if kind is None:
        attn_f = attn_flops / node.flops_at(tokens)
        attn_b = 2 * attn_f
        mem_f = mem_b = 0.0
    else:
        keys = shape.seq_len // (2 * shape.cp) if shape.cp > 1 else shape.seq_len
        attn_f = attn_flops / attention_rate(kind, keys)
        attn_b = 2.5 * attn_flops / attention_rate(kind, keys, backward=True)
        fwd_bytes, bwd_bytes = elementwise_bytes(shape)
        mem_f, mem_b = memory_seconds(kind, fwd_bytes), memory_seconds(kind, bwd_bytes)
    tp = _tp_comm_s(shape, node)
    # Overlapped, the collectives run in tp steps pipelined with the GEMM's chunks: one step's
    # worth stays exposed, and whatever the GEMMs cannot cover.
    tp_f = max(tp / shape.tp, tp - gemm) if shape.tp_comm_overlap else tp
    tp_b = max(tp / shape.tp, tp - 2 * gemm) if shape.tp_comm_overlap else tp
    cp_f, cp_b = _cp_comm_s(shape, node)
    a2a = _all_to_all_s(shape, node)
    forward = {"gemm": gemm, "attention": attn_f, "memory_bound": mem_f, "tp_comm": tp_f,
               "cp_comm": max(0.0, cp_f - attn_f), "ep_all_to_all": a2a}
    backward = {"gemm": 2 * gemm, "attention": attn_b, "memory_bound": mem_b, "tp_comm": tp_b,
                "cp_comm": max(0.0, cp_b - attn_b), "ep_all_to_all": a2a}
    if shape.recompute == "full":
        again = sum(forward.values())
    elif shape.recompute == "selective":
        again = attn_f
    else:
        again = 0.0
    return LayerTime(forward, backward, again)


def tp_comm_bytes(shape: ModelShape) -> int:
    """Bytes one GPU sends for one layer's forward under tensor parallelism: four collectives
    (all-gather and reduce-scatter around attention and MLP; or two all-reduces, which move as
    much) of (tp - 1) / tp of the s x b x h activations."""
    if shape.tp == 1:
        return 0
    local = local_sequence_shape(shape) if shape.cp > 1 else shape
    activations = local.seq_len * local.micro_batch * local.hidden * local.dtype_bytes
    return 4 * activations * (shape.tp - 1) // shape.tp


def _tp_comm_s(shape: ModelShape, node: NodeProfile) -> float:
    """One layer's forward all-gathers and reduce-scatters (or all-reduces) under tp."""
    return tp_comm_bytes(shape) / (link_gbps(node, shape.tp) * 1e9)


def _cp_comm_s(shape: ModelShape, node: NodeProfile) -> Tuple[float, float]:
    """(forward, backward) seconds of the ring exchange: cp - 1 steps, each passing this rank's
    keys and values (and, in backward, their gradients too)."""
    if shape.cp == 1:
        return 0.0, 0.0
    kv = shape.groups * shape.head_dim // shape.tp
    chunk = 2 * local_tokens(shape) * kv * _BF16
    rate = link_gbps(node, shape.tp * shape.cp) * 1e9
    forward = (shape.cp - 1) * chunk / rate
    return forward, 2 * forward


def _all_to_all_s(shape: ModelShape, node: NodeProfile) -> float:
    """Seconds of one layer's dispatch and combine all-to-all (each direction of a pass)."""
    if shape.num_experts is None or shape.ep == 1:
        return 0.0
    rows = local_tokens(shape) // (shape.tp if shape.sequence_parallel else 1) * shape.moe_topk
    moved = 2 * rows * shape.hidden * _BF16 * (shape.ep - 1) / shape.ep
    return moved / (link_gbps(node, shape.tp * shape.ep) * 1e9)


def head_time(shape: ModelShape, node: NodeProfile) -> float:
    """The output layer and loss for one micro-batch, forward and backward, on the last
    stage: a (tokens x h) @ (h x V / tp) GEMM and its two gradients, and the vocab-parallel
    cross entropy's fp32 logits read and written three times."""
    if not shape.vocab:
        return 0.0
    kind = _kind(node)
    tokens = local_tokens(shape)
    vocab = -(-shape.vocab // shape.tp)
    g = Gemm("output", tokens, vocab, shape.hidden)
    gemm = 3 * gemm_time(g, kind, node, tokens)
    if kind is None:
        return gemm
    return gemm + memory_seconds(kind, 3 * 2 * 4 * tokens * vocab)


@dataclass(frozen=True)
class StepOverheads:
    """What a step adds once, beyond its micro-batches: seconds by term."""

    terms: Dict[str, float]

    @property
    def total_s(self) -> float:
        return sum(self.terms.values())


def step_overheads(shape: ModelShape, node: NodeProfile, micro_batch_s: float,
                   num_micro_batches: int, stage_forward_s: float,
                   stage_backward_s: float) -> StepOverheads:
    """The bubble, exposed pipeline sends, data-parallel communication and the optimizer
    step (module docstring). ``micro_batch_s``: the slowest stage's forward and backward of
    one micro-batch; ``stage_forward_s`` / ``stage_backward_s``: its forward / backward."""
    vp = shape.vp
    terms: Dict[str, float] = {"pipeline_bubble": (shape.pp - 1) * micro_batch_s / vp}
    if shape.pp > 1 and vp == 1:
        sp_t = shape.tp if shape.sequence_parallel else 1
        sent = local_tokens(shape) // sp_t * shape.hidden * _BF16
        stride = shape.tp * shape.cp * shape.dp  # Megatron's order: pp is the outermost
        rate = link_gbps(node, 2 * stride if stride >= node.gpus_per_node else 1) * 1e9
        terms["pipeline_sends"] = 2 * num_micro_batches * sent / rate
    else:
        terms["pipeline_sends"] = 0.0
    terms.update(_data_parallel(shape, node, stage_forward_s, stage_backward_s))
    return StepOverheads(terms)


def stage_parameters(shape: ModelShape) -> Tuple[int, int]:
    """(dense, expert) parameters on one GPU of a stage (the embedding on the first)."""
    layer = layer_parameters(shape)
    n = shape.layers_per_stage
    dense = (n * layer["dense"] + (shape.vocab or 0) * shape.hidden) // shape.tp
    expert = n * layer["expert"] // (shape.ep * shape.tp)
    return dense, expert


def _data_parallel(shape: ModelShape, node: NodeProfile, forward_s: float,
                   backward_s: float) -> Dict[str, float]:
    dense, expert = stage_parameters(shape)
    grad_bytes = 2 if shape.grad_reduce_in_bf16 else 4
    reduce_s = gather_s = optimizer_s = 0.0
    for params, ranks in ((dense, shape.dp * shape.cp),
                          (expert, max(1, shape.dp * shape.cp // shape.ep))):
        if not params:
            continue
        if ranks > 1:
            share = (ranks - 1) / ranks
            rate = link_gbps(node, shape.tp * ranks) * 1e9
            if shape.distributed_optimizer:
                reduce_s += params * grad_bytes * share / rate
                gather_s += params * (1 if shape.fp8_param_gather else _BF16) * share / rate
            else:
                reduce_s += 2 * params * grad_bytes * share / rate
        shards = ranks if shape.distributed_optimizer else 1
        kind = _kind(node)
        if kind is not None:
            # the part megatron-core's optimizer CPU offload moves steps on the CPU instead
            # (plan/optimizer_step.py, priced in the stage)
            optimizer_s += memory_seconds(kind, params * OPTIMIZER_BYTES_PER_PARAM / shards) \
                * (1 - shape.optimizer_offload_fraction)
    exposed_reduce = max(0.0, reduce_s - backward_s) if shape.overlap_grad_reduce else reduce_s
    exposed_gather = max(0.0, gather_s - forward_s) if shape.overlap_param_gather else gather_s
    return {"dp_grad_reduce": exposed_reduce, "dp_param_gather": exposed_gather,
            "optimizer": optimizer_s}


__all__ = ["timed_by_terms", "tp_comm_bytes", "Gemm", "LINK_EFFICIENCY", "LayerTime", "StepOverheads", "elementwise_bytes",
           "gemm_source", "gemm_time", "head_time", "layer_gemms", "layer_time", "link_gbps", "local_tokens",
           "stage_parameters", "step_overheads"]
