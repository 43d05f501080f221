"""``ssdtrain plan``'s engine, policy and recompute fallback: what the job would run on the node.

As at a job's start (megatron/follow_node.py): what the preset's offload: section or a flag
(--engine, --policy, --recompute-fallback) sets is planned as it is; an engine neither names
follows the node (plan/engine_choice.py), here the profile's host memory per GPU: tiered where
it holds at least one layer, else posix. Where the engine is named and the node's choice would
plan a faster iteration, :func:`slower_than_the_node` says so.
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, Mapping, Optional, Tuple

from ...plan.engine_choice import (EngineChoice, choose_engine, forced, host_need, size,
                                   tiered_settings)
from ...plan.node import NodeProfile
from ...plan.shape import ModelShape

FLAGS = {"engine": "--engine", "policy": "--policy", "recompute_fallback": "--recompute-fallback"}
"""The OffloadConfig fields ``ssdtrain plan`` has a flag for, and the flag."""


def given_fields(args: argparse.Namespace, preset_keys) -> Dict[str, str]:
    """{OffloadConfig field: who set it}: the preset's offload: keys, then the plan's flags."""
    given = {str(k): "the preset" for k in preset_keys}
    for name, flag in FLAGS.items():
        if getattr(args, name, None) is not None:
            given[name] = flag
    return given


def plan_settings(offload: Any, given: Mapping[str, str], args: argparse.Namespace,
                  shape: ModelShape, node: NodeProfile, num_micro_batches: int
                  ) -> Tuple[Any, EngineChoice]:
    """The OffloadConfig the plan is made for (the preset's, the flags over it, and the engine
    the node calls for where none is named), and how its engine was chosen."""
    changes = {name: getattr(args, name) for name in FLAGS if getattr(args, name, None) is not None}
    offload = offload.replace(**changes) if changes else offload
    if "engine" in given:
        return offload, forced(offload.engine, f"{given['engine']} ({offload.engine})")
    per_gpu = node.host_memory_bytes
    runs = tiered_settings(given, offload)
    need = host_need(shape, offload, node, num_micro_batches, per_gpu, runs["policy"],
                     runs["recompute_fallback"])
    choice = choose_engine(given, offload, per_gpu,
                           f"{size(per_gpu)} host memory per GPU ({node.name})", need)
    return offload.replace(**choice.changes), choice


def without_the_engine(given: Mapping[str, str], args: argparse.Namespace
                       ) -> Tuple[Dict[str, str], argparse.Namespace]:
    """``given`` and ``args`` with the engine left to the node (the rest as they are)."""
    return ({k: v for k, v in given.items() if k != "engine"},
            argparse.Namespace(**{**vars(args), "engine": None}))


def slower_than_the_node(result: Dict[str, Any], default: Optional[Dict[str, Any]],
                         choice: EngineChoice) -> Optional[Dict[str, Any]]:
    """Where the named engine plans a slower iteration than the node's choice would: what the
    node would choose (engine, its line, iteration and ratio to keep); else None."""
    if choice.followed or default is None or default["engine"] == result["engine"] \
            or default["iteration_s"] >= result["iteration_s"] * (1 - 1e-9):
        return None
    return {"engine": default["engine"], "reason": default["engine_choice"]["reason"],
            "policy": default["policy"], "places": default["places"],
            "iteration_s": default["iteration_s"], "vs_keep": default["vs_keep"]}


__all__ = ["FLAGS", "given_fields", "plan_settings", "slower_than_the_node", "without_the_engine"]
