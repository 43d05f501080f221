"""``ssdtrain plan``'s offer of megatron-core's optimizer CPU offload, for a job that does not
fit its GPUs without it (the library's plan/optimizer_offload.py prices it; this renders it).

The first line of such a job's answer then says whether it fits with it: the flags, the
layout, the offload fraction, the host memory it takes per GPU, the time its step adds, the
modeled tokens/s per GPU with the optimizer offload alone and with ours too, and against the
best plan on the nearest GPU count that fits without it.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from ...plan.baseline import best_with_offload, describe
from ...plan.node import NodeProfile
from ...plan.optimizer_offload import WithOptimizerOffload, offer
from ...plan.optimizer_step import optimizer_step
from ...plan.shape import ModelShape

FLAGS = ("--use-distributed-optimizer --use-precision-aware-optimizer --optimizer-cpu-offload "
         "--optimizer-offload-fraction {fraction:g}{overlap}")
"""The Megatron flags of an offered plan."""


def flags(best: WithOptimizerOffload) -> str:
    """The Megatron flags that run ``best``'s optimizer offload."""
    return FLAGS.format(fraction=best.step.fraction,
                        overlap=" --overlap-cpu-optimizer-d2h-h2d" if best.step.overlapped else "")


def offer_answer(shape: ModelShape, gpus: int, global_batch: Optional[int], node: NodeProfile,
                 reserve: int, more_gpus: Optional[int]) -> Optional[Dict[str, Any]]:
    """The offer for a job that does not fit ``gpus`` (JSON-ready, with its ``line``), or None
    where no global batch is known. ``more_gpus``: the nearest GPU count that fits without it
    (plan/fit.py's nearest_fits), planned to compare."""
    if not global_batch:
        return None
    found = offer(shape, gpus, global_batch, node, reserve)
    alone, ours = found["alone"], found["with_ours"]
    best = ours if ours is not None and (alone is None or ours.tokens_per_s_per_gpu
                                         > alone.tokens_per_s_per_gpu) else alone
    out: Dict[str, Any] = {"alone": alone.to_dict() if alone else None,
                           "with_ours": ours.to_dict() if ours else None}
    if best is None:
        out["line"] = (f"DOES NOT FIT {gpus} GPUs even with megatron-core's optimizer CPU offload "
                       "(--optimizer-cpu-offload): no offload fraction leaves room for "
                       "activations within the host memory per GPU "
                       f"({node.host_memory_bytes / 1e9:.0f} GB on {node.name})")
        return out
    versus = ""
    bigger = best_with_offload(shape, more_gpus, global_batch, node, reserve=reserve) \
        if more_gpus else None
    if bigger is not None:
        out["more_gpus"] = {"gpus": more_gpus, "layout": describe(bigger),
                            "tokens_per_s_per_gpu": bigger.tokens_per_s_per_gpu}
        versus = (f"; against {more_gpus} GPUs as {describe(bigger)}: "
                  f"{bigger.tokens_per_s_per_gpu:,.0f} tokens/s per GPU")
    who = "with ours" if best is ours and best.offloads_activations else "without ours"
    other = alone if best is ours else ours
    also = "" if other is None else (
        f"; optimizer offload {'alone' if best is ours else 'with ours'}: "
        f"{other.tokens_per_s_per_gpu:,.0f} ({other.describe()})")
    out["line"] = (f"FITS {gpus} GPUs WITH MEGATRON'S OPTIMIZER OFFLOAD, {who}: "
                   f"{best.tokens_per_s_per_gpu:,.0f} tokens/s per GPU (modeled) as "
                   f"{best.describe()}; {best.step.words()}; flags: {flags(best)}{also}{versus}")
    return out


def optimizer_offload_of(shape: ModelShape, node: NodeProfile) -> Optional[Dict[str, Any]]:
    """A planned job's optimizer CPU offload (its step and host memory), JSON-ready; None
    without it."""
    step = optimizer_step(shape, node)
    return None if step is None else {**step.to_dict(), "words": step.words()}


def optimizer_rows(r: Dict[str, Any]) -> list:
    """The report's row for a job's optimizer CPU offload (none without it)."""
    found = r.get("optimizer_offload")
    if not found:
        return []
    return [("optimizer CPU offload", f"{found['words']}; CPU AdamW at {found['cpu_adam']}; in "
             "the iteration time above")]


__all__ = ["FLAGS", "flags", "offer_answer", "optimizer_offload_of", "optimizer_rows"]
