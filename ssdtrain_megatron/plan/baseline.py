"""What runs without offload: the fastest layout of a model on the same GPUs and global batch
with only what Megatron does alone (keep, and recompute: per layer, selective or full), the
plan a gain from offload is measured against (issue 58: a gain over a keep that does not fit
is no gain).

It is :func:`plan.search.search`'s best without offload, found with fewer plans: a layout's
iteration keeping every activation (``Stage.keep_iteration_s``, what its own recompute
granularity adds included) is a lower bound on any plan of it without offload (recompute and
waiting only add time), so layouts are planned fastest bound first, and the search stops at
the first whose bound is slower than the best found. The same bound holds with offload (host
memory and the drives only add waiting), so :func:`best_layout` finds the best with offload as
fast: the README's table of where offload pays (scripts/plan_table.py) runs both per row. Pure:
the analytic model.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from .fit import DEFAULT_RESERVE_BYTES
from .memory import model_state_bytes
from .node import NodeProfile
from .search import WITH_OFFLOAD, WITHOUT_OFFLOAD, Layout, layout_key, layouts, plan_layout
from .shape import ModelShape, SaveProfile
from .stage import stage


def best_without_offload(base: ModelShape, gpus: int, global_batch: int, node: NodeProfile,
                         profile: SaveProfile = SaveProfile.paper(), keep_last_layers: int = 1,
                         reserve: int = DEFAULT_RESERVE_BYTES) -> Optional[Layout]:
    """The fastest layout without offload that fits (ties: search's order), or None."""
    return best_layout(base, gpus, global_batch, node, WITHOUT_OFFLOAD, profile,
                       keep_last_layers, reserve)


def best_with_offload(base: ModelShape, gpus: int, global_batch: int, node: NodeProfile,
                      profile: SaveProfile = SaveProfile.paper(), keep_last_layers: int = 1,
                      reserve: int = DEFAULT_RESERVE_BYTES) -> Optional[Layout]:
    """The fastest layout with offload (keep, host, SSD, recompute) that fits and offloads
    something, or None: what search's with-offload ranking puts first."""
    return best_layout(base, gpus, global_batch, node, WITH_OFFLOAD, profile,
                       keep_last_layers, reserve)


def best_layout(base: ModelShape, gpus: int, global_batch: int, node: NodeProfile,
                places: Tuple[str, ...], profile: SaveProfile = SaveProfile.paper(),
                keep_last_layers: int = 1,
                reserve: int = DEFAULT_RESERVE_BYTES) -> Optional[Layout]:
    """The fastest layout planned with ``places`` that fits (ties: search's order), or None."""
    bounds: List[Tuple[float, Tuple[int, ...], ModelShape, int]] = []
    tokens = global_batch * base.seq_len
    for shape, m in layouts(base, gpus, global_batch, node):
        if node.gpu_memory_bytes - model_state_bytes(shape)["bytes"] - reserve <= 0:
            continue
        bound = tokens / stage(shape, profile, node, m).keep_iteration_s / gpus
        bounds.append((bound, layout_key(shape), shape, m))
    bounds.sort(key=lambda b: (-b[0], b[1]))
    best: Optional[Layout] = None
    for bound, _, shape, m in bounds:
        if best is not None and bound < best.tokens_per_s_per_gpu:
            break  # no plan of this layout, nor of any after it, can be faster
        found = plan_layout(shape, m, node, places, profile, global_batch, gpus,
                            keep_last_layers, reserve)
        if found is not None and places != WITHOUT_OFFLOAD and not found.offloads:
            found = None  # keeps everything: no gain of offload
        if found is not None and (best is None or (-found.tokens_per_s_per_gpu, found.key())
                                  < (-best.tokens_per_s_per_gpu, best.key())):
            best = found
    return best


def describe(x: Layout) -> str:
    """'TP4 PP8 DP2, b=1, keep' (CP where above 1; the recompute it runs)."""
    s = x.shape
    places = set(p for row in x.plan.decisions for p in row)
    how = {"none": "keep" + (" and recompute per layer" if "recompute" in places else ""),
           "selective": "selective recompute", "full": "full recompute"}[s.recompute]
    return (f"TP{s.tp} PP{s.pp}" + (f" VP{s.vp}" if s.vp > 1 else "")
            + (f" CP{s.cp}" if s.cp > 1 else "") + f" DP{s.dp}, b={s.micro_batch}, {how}"
            + ("" if s.distributed_optimizer else ", no distributed optimizer"))


__all__ = ["best_layout", "best_with_offload", "best_without_offload", "describe"]
