"""The engine a job runs when neither its preset nor a flag names one: the node decides.

Host memory is the nearest place for an activation after the GPU, and a GPU node has hundreds
of GB of it per GPU; the drives are larger but slower. So where host memory is to spare, the
``tiered`` engine (host memory first, the SSD beneath) runs; where it is not, ``posix`` (the SSD
alone) runs, as before. With tiered, where the job has an activation budget
(``activation_budget_bytes`` or ``memory_budget_bytes``), placement is adaptive: keep, host,
SSD or recompute per layer by measurement (cache/four_places.py), recompute as the fallback;
without a budget, policy ``offload``: every eligible layer leaves GPU memory, the last ones to
host memory and the first ones to SSD (the adaptive policy without a budget keeps everything:
cache/adaptive.py). Whatever the preset or a flag names wins, field by field: only ``engine``,
``policy``, ``recompute_fallback`` and ``host_memory_bytes`` left unset follow the node
(:data:`FOLLOWS_THE_NODE`).

The rule, given the host memory free per rank (measured at the job's start,
:func:`free_per_rank`; or, planning, a node profile's host memory per GPU):

* with the job's model (a preset's ``model:`` section, or what Megatron's arguments say), the
  plan of its first pipeline stage (:func:`host_need`: the policy that would run, tiered's
  places, host memory of that size) says how many bytes per rank it puts in host memory. Host memory is to spare when it holds
  at least one layer's activations; the pool (``host_memory_bytes``, allocated and pinned at
  start) is then what the plan puts there and one layer more, within what is free;
* without a model (nothing says its shape), it is to spare when the pool
  (``host_memory_bytes``, 4 GiB unless set) fits in what is free per rank.

Pure: numbers in, an :class:`EngineChoice` out; reading /proc/meminfo is the job's side
(megatron/host_memory.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Collection, Dict, Optional

from .memory import activation_budget
from .node import NodeProfile
from .placing import places_for, plan_policy
from .shape import ModelShape, SaveProfile
from .stage import stage

FOLLOWS_THE_NODE = ("engine", "policy", "recompute_fallback", "host_memory_bytes")
"""The OffloadConfig fields the node sets when neither the preset nor a flag does."""

USABLE_FRACTION = 0.75
"""Of the host memory free at the start, what the job's pools may take: the rest stays for the
data loader, checkpoint staging, the page cache and the OS."""


@dataclass(frozen=True)
class HostNeed:
    """What the plan of a job's stage asks of host memory, per rank."""

    planned_bytes: int
    """Host memory the plan fills at once (every micro-batch in flight)."""
    layer_bytes: int
    """One layer's activations of one micro-batch: the least a host tier can use."""


@dataclass(frozen=True)
class EngineChoice:
    """The engine a job runs, why, and the OffloadConfig fields that follow from it."""

    engine: str
    reason: str
    """The start-up line: ``engine tiered: 1.2 TB host memory free, 150 GB per rank planned ...``."""
    changes: Dict[str, Any] = field(default_factory=dict)
    """OffloadConfig fields to set (only ones neither the preset nor a flag set)."""
    followed: bool = True
    """False when the preset or a flag named the engine."""


def size(n: float) -> str:
    """Decimal bytes, one decimal: '1.2 TB', '150.0 GB', '8.4 MB'."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{int(n)} B"


def free_per_rank(free_bytes: int, local_ranks: int, pinned_per_rank: int) -> int:
    """Host memory one rank's pool may take: :data:`USABLE_FRACTION` of what is free on the
    node, shared by its ``local_ranks``, less what each rank pins besides (its staging)."""
    return max(0, int(free_bytes * USABLE_FRACTION) // max(local_ranks, 1) - pinned_per_rank)


def host_need(shape: ModelShape, offload: Any, node: NodeProfile, num_micro_batches: int,
              host_bytes: int, policy: str, recompute: bool,
              profile: SaveProfile = SaveProfile.paper()) -> HostNeed:
    """The host memory the plan of ``shape``'s first stage fills with the tiered engine, when
    each GPU has ``host_bytes`` of it (``offload``: keep_last_layers, prefetch_layers and
    activation_budget_bytes, as an OffloadConfig has them)."""
    node = node.replace(host_memory_bytes=max(host_bytes, 0))
    st = stage(shape, profile, node, num_micro_batches)
    budget = activation_budget(shape, node.gpu_memory_bytes, None,
                               offload.activation_budget_bytes)["activation_budget_bytes"]
    plan = plan_policy(st, node, policy, places_for("tiered", recompute), budget, offload)
    return HostNeed(plan.host_peak_bytes, st.layer_bytes)


def tiered_settings(given: Collection[str], config: Any, recompute: bool = True) -> Dict[str, Any]:
    """The policy and recompute fallback that run with a tiered engine the node chose: the
    given ones, else adaptive placement with recompute as the fallback where there is a budget
    to place within, and policy offload where there is none (see the module docstring).
    ``recompute``: whether the integration can recompute (Megatron-DeepSpeed cannot)."""
    budget = config.activation_budget_bytes is not None or config.memory_budget_bytes is not None
    policy = config.policy if "policy" in given else ("adaptive" if budget else "offload")
    fallback = config.recompute_fallback if "recompute_fallback" in given \
        else (recompute and policy == "adaptive")
    return {"policy": policy, "recompute_fallback": fallback}


def forced(engine: str, by: str) -> EngineChoice:
    """The choice when the preset or a flag (``by``) names the engine."""
    return EngineChoice(engine, f"engine {engine}: named by {by}", followed=False)


def choose_engine(given: Collection[str], config: Any, per_rank: int, free_text: str,
                  need: Optional[HostNeed] = None, recompute: bool = True) -> EngineChoice:
    """tiered or posix by the rule of the module docstring.

    Args:
        given: the OffloadConfig fields the preset or a flag set (they are left as they are).
        config: the OffloadConfig as given (its ``host_memory_bytes``, ``policy``,
            ``recompute_fallback`` where given).
        per_rank: host memory free per rank (:func:`free_per_rank`, or a profile's per GPU).
        free_text: where that figure comes from, for the line ("1.2 TB host memory free").
        need: the plan's :func:`host_need` (made with ``per_rank``); None without a model.
        recompute: whether the integration can recompute (:func:`tiered_settings`).
    """
    pool_given = "host_memory_bytes" in given
    if need is not None:
        enough = per_rank >= need.layer_bytes
        pool = config.host_memory_bytes if pool_given else min(per_rank, need.planned_bytes + need.layer_bytes)
        planned = f"{size(need.planned_bytes)} per rank planned"
        short = f"less than one layer's activations ({size(need.layer_bytes)})"
    else:
        enough, pool = per_rank >= config.host_memory_bytes, config.host_memory_bytes
        planned = "no preset model to plan with"
        short = f"less than the {size(pool)} host pool (host_memory_bytes)"
    if pool_given and pool > per_rank:
        enough, short = False, f"less than the {size(pool)} host pool (host_memory_bytes)"
    if not enough:
        return EngineChoice("posix", f"engine posix: {free_text}, {size(per_rank)} per rank for "
                                     f"offload, {short}")
    runs = tiered_settings(given, config, recompute)
    changes = {"engine": "tiered", **{k: v for k, v in runs.items() if k not in given}}
    if not pool_given:
        changes["host_memory_bytes"] = pool
    return EngineChoice("tiered", f"engine tiered: {free_text}, {planned}: a host pool of "
                                  f"{size(pool)} of {size(per_rank)} per rank; policy "
                                  f"{runs['policy']}, recompute fallback "
                                  f"{'on' if runs['recompute_fallback'] else 'off'}", changes)


__all__ = ["EngineChoice", "FOLLOWS_THE_NODE", "HostNeed", "USABLE_FRACTION", "choose_engine",
           "forced", "free_per_rank", "host_need", "size", "tiered_settings"]
