"""The fastest layout of a job with megatron-core's optimizer CPU offload, for a job that does
not fit its GPUs without it: which offload fraction, which layout, with our activation offload or
without (plan/optimizer_step.py prices the step; plan/memory.py counts the bytes).

Per layout (plan/search.py's), the least fraction (in steps of :data:`FRACTION_STEP`) that
leaves room for the least activations any plan runs in, and every 0.1 above it, while the
optimizer's host memory fits the node's host memory per GPU; each planned on the host memory it
leaves for our pool. More offload gives activations room and costs CPU time: the plan with the
most tokens/s wins. Pure: the analytic model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

from .fit import DEFAULT_RESERVE_BYTES, least_activation_bytes
from .memory import model_state_bytes, optimizer_gpu_bytes, optimizer_parameters
from .node import NodeProfile
from .optimizer_step import OptimizerStep, optimizer_step
from .search import WITH_OFFLOAD, WITHOUT_OFFLOAD, Layout, layouts, plan_layout
from .shape import ModelShape, SaveProfile
from .stage import stage

FRACTION_STEP = 0.05
"""Offload fractions are planned in steps of this (Megatron takes any fraction)."""


def host_left(shape: ModelShape, host_bytes: int) -> int:
    """Host memory per GPU left for our pool and staging once the optimizer offload took its
    share (negative: it does not fit)."""
    return host_bytes - model_state_bytes(shape)["host_bytes"]


def least_fraction(shape: ModelShape, node: NodeProfile, reserve: int, num_micro_batches: int,
                   profile: SaveProfile = SaveProfile.paper()) -> Optional[float]:
    """The least offload fraction (a multiple of :data:`FRACTION_STEP`) with which ``shape``
    (the distributed optimizer on) leaves room for the least activations any plan runs in;
    None where even 1 does not."""
    shape = shape.replace(distributed_optimizer=True, optimizer_offload_fraction=0.0)
    need = model_state_bytes(shape)["bytes"] + reserve \
        + least_activation_bytes(shape, node, num_micro_batches, profile) - node.gpu_memory_bytes
    if need <= 0:
        return 0.0
    movable = optimizer_parameters(shape)["updated"] * optimizer_gpu_bytes(shape)
    steps = math.ceil(need / movable / FRACTION_STEP - 1e-9)
    fraction = round(steps * FRACTION_STEP, 2)
    return fraction if fraction <= 1 else None


@dataclass(frozen=True)
class WithOptimizerOffload:
    """A layout planned with the optimizer CPU offload: the plan, its step and tokens/s."""

    layout: Layout
    step: OptimizerStep
    tokens_per_s_per_gpu: float

    @property
    def offloads_activations(self) -> bool:
        return self.layout.offloads

    def describe(self) -> str:
        """'TP8 PP1 DP1, b=1, full recompute, optimizer offload 0.90 (overlapped)'."""
        from .baseline import describe

        return (f"{describe(self.layout)}, optimizer offload {self.step.fraction:.2f}"
                + (" (overlapped)" if self.step.overlapped else ""))

    def to_dict(self) -> Dict[str, Any]:
        s = self.layout.shape
        return {"layout": self.describe(), "tp": s.tp, "pp": s.pp, "cp": s.cp, "dp": s.dp,
                "micro_batch": s.micro_batch, "recompute": s.recompute,
                "offloads_activations": self.offloads_activations,
                "iteration_s": self.layout.plan.iteration_s,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
                "optimizer_offload": self.step.to_dict()}


def _fractions(least: float) -> Iterator[float]:
    """``least``, then every 0.1 above it, and 1."""
    f = least
    while f < 1:
        yield round(f, 2)
        f += 0.1
    yield 1.0


def plans(base: ModelShape, gpus: int, global_batch: int, node: NodeProfile,
          places: Tuple[str, ...], reserve: int = DEFAULT_RESERVE_BYTES,
          profile: SaveProfile = SaveProfile.paper(), keep_last_layers: int = 1,
          overlap: bool = True) -> List[WithOptimizerOffload]:
    """Every layout of ``base`` on ``gpus`` (plan/search.py's) with the optimizer offload at
    the fractions that fit GPU and host memory, planned with ``places`` on the host memory the
    optimizer leaves; fastest first. Layouts are tried fastest bound first (baseline.py's rule,
    the step's own time added) and the search stops where a bound is slower than the best."""
    bounds = []
    tokens = global_batch * base.seq_len
    for shape, m in layouts(base.replace(distributed_optimizer=True), gpus, global_batch, node):
        least = least_fraction(shape, node, reserve, m, profile)
        if least is None or least == 0:
            continue  # nothing fits even with all of it, or it fits without
        for f in _fractions(least):
            trial = shape.replace(optimizer_offload_fraction=f, overlap_optimizer_d2h_h2d=overlap)
            if host_left(trial, node.host_memory_bytes) < 0:
                break  # more offload only takes more host memory
            keep_s = stage(trial, profile, node, m).keep_iteration_s  # the step's time in it
            bounds.append((tokens / keep_s / gpus, trial, m, optimizer_step(trial, node)))
    bounds.sort(key=lambda b: -b[0])
    found: List[WithOptimizerOffload] = []
    for bound, shape, m, step in bounds:
        if found and bound < found[0].tokens_per_s_per_gpu:
            break
        host = node.replace(host_memory_bytes=host_left(shape, node.host_memory_bytes))
        layout = plan_layout(shape, m, host, places, profile, global_batch, gpus,
                             keep_last_layers, reserve)
        if layout is None:
            continue
        found.append(WithOptimizerOffload(layout, step, layout.tokens_per_s_per_gpu))
        found.sort(key=lambda x: (-x.tokens_per_s_per_gpu, x.layout.key()))
    return found


def offer(base: ModelShape, gpus: int, global_batch: int, node: NodeProfile,
          reserve: int = DEFAULT_RESERVE_BYTES, profile: SaveProfile = SaveProfile.paper(),
          keep_last_layers: int = 1) -> Dict[str, Optional[WithOptimizerOffload]]:
    """The fastest plan with the optimizer offload alone (``alone``: keep and recompute, as
    Megatron runs without us) and with ours too (``with_ours``: host memory and the drives as
    well), or None where none fits."""
    out: Dict[str, Optional[WithOptimizerOffload]] = {}
    for key, places in (("alone", WITHOUT_OFFLOAD), ("with_ours", WITH_OFFLOAD)):
        best = plans(base, gpus, global_batch, node, places, reserve, profile, keep_last_layers)
        out[key] = best[0] if best else None
    return out


__all__ = ["FRACTION_STEP", "WithOptimizerOffload", "host_left", "least_fraction", "offer",
           "plans"]
