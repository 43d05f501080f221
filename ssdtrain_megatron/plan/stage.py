"""A pipeline stage on a node, as the four-place planner sees it: the analytic model's layers,
micro-batch positions and pipeline bubble for one GPU of the first stage (the one with the most
micro-batches in flight under 1F1B), and the plan :func:`plan_stage` makes for it.

Time per layer and micro-batch (docs/models.md, "The model's terms"): with a GPU kind, by
plan/step_time.py's terms (GEMMs by shape and precision, attention, memory-bound passes, TP, CP
and expert communication as the flags overlap them), and once a step its bubble ((pp - 1) / vp
micro-batch times), pipeline sends, data-parallel communication and optimizer (``step_s``);
the last stage, with the output layer and loss, sets the pace. Without a kind (a custom
profile, ``--gpu-tflops``): the layer's FLOPs over tp x cp GPUs at the node's one rate, TP
communication over NVLink not overlapped, backward twice the compute, the output layer spread
over the stages, and the bubble.

Under 1F1B the first stage holds min(pp, m) micro-batches at once, and between a micro-batch's
forward and its backward it runs the forwards and backwards of the others: that is the time its
writes have to drain.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from .model import (attention_core_flops, forward_flops_per_layer, head_activation_terms,
                    layer_activation_bytes)
from .node import NodeProfile
from .optimizer_step import optimizer_step_s
from .policy import LayerMeasurement
from .shape import ModelShape, SaveProfile
from .step_plan import Position
from .step_time import (StepOverheads, head_time, layer_time, step_overheads, timed_by_terms,
                        tp_comm_bytes)
from .tiers import PLACES, RECOMPUTE, TierPlan, Tiers, plan_tiers, price


@dataclass(frozen=True)
class Stage:
    """One micro-batch of the first stage on one GPU, timed on a node."""

    layers: Tuple[LayerMeasurement, ...]
    """The stage's layers (identical: one per transformer layer of the stage)."""
    positions: Tuple[Position, ...]
    """One per micro-batch of the step."""
    compute_s: float
    """Forward compute of one layer and micro-batch."""
    tp_comm_s: float
    """Tensor-parallel communication of one layer's forward (its backward moves as much)."""
    layout_recompute_s: float
    """What the layout's own recompute granularity adds to one layer's backward: its whole
    forward again (full), the attention core's (selective), nothing (none)."""
    head_s: float
    """Output layer and loss per micro-batch and stage (forward and backward)."""
    bubble_s: float
    """The pipeline bubble of the step: (pp - 1) micro-batch times; and the step of
    megatron-core's optimizer CPU offload where the shape has it (plan/optimizer_step.py)."""
    layer_bytes: int
    """Activation bytes of one layer and micro-batch."""
    head_bytes: int
    """Activation bytes outside the layers (kept: the planner does not move them)."""
    backward_s: Optional[float] = None
    """One layer's backward, what the layout recomputes included, by plan/step_time.py's
    terms; None: twice the compute, the same communication and the recompute."""
    step_s: float = 0.0
    """What the step adds once beyond its micro-batches and bubble: exposed pipeline sends,
    data-parallel communication, the optimizer (plan/step_time.py)."""
    terms: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Seconds by term (plan/step_time.py) where the node has a GPU kind: what the plan's JSON
    shows."""

    @property
    def backward_factor(self) -> float:
        """Backward over forward time: twice the compute, the same communication, and what the
        layout recomputes (or plan/step_time.py's backward over its forward)."""
        forward = self.compute_s + self.tp_comm_s
        if self.backward_s is not None:
            return self.backward_s / forward if forward > 0 else 2.0
        backward = 2 * self.compute_s + self.tp_comm_s + self.layout_recompute_s
        return backward / forward if forward > 0 else 2.0

    @property
    def micro_batch_s(self) -> float:
        """Forward and backward of one micro-batch on this stage, the head's share included."""
        forward = self.compute_s + self.tp_comm_s
        return len(self.layers) * forward * (1 + self.backward_factor) + self.head_s

    @property
    def keep_iteration_s(self) -> float:
        """The step keeping every activation: every micro-batch, the bubble and what the step
        adds once (``step_s``)."""
        return len(self.positions) * self.micro_batch_s + self.bubble_s + self.step_s

    @property
    def recompute_iteration_s(self) -> float:
        """The step recomputing every layer in full: one more forward of each, per micro-batch,
        instead of what the layout recomputes already."""
        return self.keep_iteration_s + len(self.positions) * len(self.layers) * (
            self.compute_s + self.tp_comm_s - self.layout_recompute_s)


def stage(shape: ModelShape, profile: SaveProfile, node: NodeProfile,
          num_micro_batches: int) -> Stage:
    """The first stage of ``shape`` on ``node`` for a step of ``num_micro_batches``: with a
    ``gpu_kind``, timed by plan/step_time.py's terms (the slowest stage sets the pace: the last,
    with the output layer and loss); without one, at the node's one achieved rate."""
    if timed_by_terms(node):
        return _stage_by_terms(shape, profile, node, num_micro_batches)
    gpus = shape.tp * shape.cp
    # GEMM efficiency by the micro-batch's tokens where the profile measured it (flops_at)
    flops = node.flops_at(shape.micro_batch * shape.seq_len // shape.cp)
    compute = forward_flops_per_layer(shape) / gpus / flops
    comm = tp_comm_bytes(shape) / (node.nvlink_gbps * 1e9)
    head_flops = 3 * 2 * shape.seq_len * shape.micro_batch * shape.hidden * (shape.vocab or 0)
    head_s = head_flops / gpus / shape.pp / flops
    if shape.recompute == "full":
        again = compute + comm
    elif shape.recompute == "selective":  # the core attention: scores and values over s^2
        again = attention_core_flops(shape) / gpus / flops
    else:
        again = 0.0
    return _assemble(shape, profile, node, num_micro_batches, compute, comm, again, head_s)


def _assemble(shape: ModelShape, profile: SaveProfile, node: NodeProfile, num_micro_batches: int,
              compute: float,
              comm: float, again: float, head_s: float, backward_s: Optional[float] = None,
              overheads: Optional[Callable[[Stage], StepOverheads]] = None,
              terms: Optional[Dict[str, Any]] = None) -> Stage:
    layer = LayerMeasurement(
        forward_s=compute + comm,
        activation_bytes=layer_activation_bytes(shape, profile),
        checkpoint_bytes=layer_activation_bytes(shape.replace(recompute="full"), profile,
                                                include_shared=False))
    layers = (layer,) * shape.layers_per_stage
    live = min(shape.pp, num_micro_batches)
    partial = Stage(layers, (), compute, comm, again, head_s, 0.0, layer.activation_bytes,
                    sum(head_activation_terms(shape, profile).values()), backward_s)
    gap = (live - 1) * partial.micro_batch_s
    step = overheads(partial) if overheads is not None else None
    bubble = step.terms["pipeline_bubble"] if step else (shape.pp - 1) * partial.micro_batch_s / shape.vp
    extra = step.total_s - bubble if step else 0.0
    # megatron-core's optimizer CPU offload: its copies and CPU step (plan/optimizer_step.py)
    offloaded_s = optimizer_step_s(shape, node)
    extra += offloaded_s
    all_terms = dict(terms or {})
    if step:
        all_terms["step"] = dict(step.terms)
    if offloaded_s:
        all_terms.setdefault("step", {})["optimizer_cpu_offload"] = offloaded_s
    return Stage(layers, (Position(gap_s=gap, live=live),) * num_micro_batches, compute, comm,
                 again, head_s, bubble, partial.layer_bytes, partial.head_bytes, backward_s,
                 extra, all_terms)


def _stage_by_terms(shape: ModelShape, profile: SaveProfile, node: NodeProfile,
                    num_micro_batches: int) -> Stage:
    lt = layer_time(shape, node)
    comm = lt.forward["tp_comm"]
    compute = lt.forward_s - comm
    head_s = head_time(shape, node)
    n = shape.layers_per_stage

    def overheads(partial: Stage) -> StepOverheads:
        return step_overheads(shape, node, partial.micro_batch_s, num_micro_batches,
                              n * lt.forward_s, n * lt.backward_s)

    terms = {"layer_forward": dict(lt.forward), "layer_backward": dict(lt.backward),
             "layer_recompute": lt.recompute_s, "head": head_s}
    return _assemble(shape, profile, node, num_micro_batches, compute, comm, lt.recompute_s, head_s,
                     lt.backward_s, overheads, terms)


def plan_stage(st: Stage, node: NodeProfile, *, budget_bytes: Optional[int],
               places: Tuple[str, ...] = PLACES, keep_last_layers: int = 1,
               cpu_s_per_byte: float = 0.0, prefetch_layers: int = 2,
               max_inflight_bytes: Optional[int] = None) -> TierPlan:
    """The four-place plan of ``st`` on ``node`` within ``budget_bytes`` of GPU activation
    memory (head bytes included: they stay), None: keep everything.

    The room a layer needs beside what is kept (being saved, read back or re-created) comes
    from the plan's order (tier_costs.need_bytes); the head's bytes come off the budget. A
    layout that recomputes already (selective or full) gets no per-layer recompute on top:
    Megatron runs one granularity. ``prefetch_layers``: the least the runtime reads ahead of
    backward (OffloadConfig.prefetch_layers; the window is sized by time above it);
    ``max_inflight_bytes``: the runtime's read-ahead byte cap (None: none)."""
    if st.layout_recompute_s > 0:
        places = tuple(p for p in places if p != RECOMPUTE)
    budget = None if budget_bytes is None else max(0, budget_bytes - st.head_bytes)
    return plan_tiers(st.layers, st.positions,
                      _tiers(st, node, budget, places, keep_last_layers, cpu_s_per_byte, prefetch_layers,
                             max_inflight_bytes))


def price_stage(st: Stage, node: NodeProfile, decisions, *, budget_bytes: Optional[int],
                keep_last_layers: int = 1, cpu_s_per_byte: float = 0.0,
                prefetch_layers: int = 2, max_inflight_bytes: Optional[int] = None) -> TierPlan:
    """What ``decisions`` (one row of places per micro-batch position) cost on ``node``, the
    forward waiting for writes and backward reading ahead only within ``budget_bytes`` (head
    bytes included; None: no bound)."""
    budget = None if budget_bytes is None else max(0, budget_bytes - st.head_bytes)
    return price(st.layers, st.positions,
                 _tiers(st, node, budget, PLACES, keep_last_layers, cpu_s_per_byte, prefetch_layers,
                        max_inflight_bytes),
                 decisions)


def _tiers(st: Stage, node: NodeProfile, budget: Optional[int], places: Tuple[str, ...],
           keep_last_layers: int, cpu_s_per_byte: float, prefetch_layers: int,
           max_inflight_bytes: Optional[int] = None) -> Tiers:
    return Tiers(budget_bytes=budget, host_capacity_bytes=node.host_memory_bytes,
                 host_link_bps=node.host_copy_gbps * 1e9,  # the link or its share of the bus
                 ssd_write_bps=node.ssd_write_gbps * 1e9, ssd_read_bps=node.ssd_read_gbps * 1e9,
                 places=places,
                 bubble_s=st.bubble_s + len(st.positions) * st.head_s + st.step_s,
                 cpu_s_per_byte=cpu_s_per_byte, backward_factor=st.backward_factor,
                 keep_last_layers=keep_last_layers, prefetch_layers=prefetch_layers,
                 max_inflight_bytes=max_inflight_bytes)


def full_recompute_fits(st: Stage, budget_bytes: int) -> bool:
    """Whether recomputing every layer fits: each in-flight micro-batch keeps the layers'
    inputs, plus one layer re-created in backward and the head."""
    live = st.positions[0].live
    inputs = sum(layer.checkpoint_bytes for layer in st.layers)
    return live * inputs + st.layer_bytes + st.head_bytes <= budget_bytes


__all__ = ["RECOMPUTE", "Stage", "full_recompute_fits", "plan_stage", "price_stage", "stage",
           "tp_comm_bytes"]
