"""The plan each policy and engine make for a pipeline stage: where an engine can put what
leaves GPU memory (:data:`ENGINE_TIERS`), the places a run may use (:func:`places_for`), and
the plan of the ``keep``, ``offload`` and ``adaptive`` policies (:func:`plan_policy`).

Used by ``ssdtrain plan`` (tools/plan/build.py) and, at the start of a job, by the choice of
the engine that follows the node (plan/engine_choice.py): both plan what the job would run.
Pure: the analytic model of plan/stage.py and plan/tiers.py.
"""

from __future__ import annotations

from typing import Any, Collection, Tuple

from .node import NodeProfile
from .stage import Stage, plan_stage, price_stage
from .tiers import HOST, KEEP, RECOMPUTE, SSD, TierPlan

ENGINE_TIERS = {"posix": (SSD,), "aio": (SSD,), "gds": (SSD,), "memory": (HOST,),
                "tiered": (HOST, SSD)}
"""Where each IO engine puts what leaves GPU memory."""


def places_for(engine: str, recompute: bool) -> Tuple[str, ...]:
    """Keep, the engine's tiers, and recompute when ``recompute`` (the recompute fallback)."""
    return (KEEP,) + ENGINE_TIERS[engine] + ((RECOMPUTE,) if recompute else ())


def plan_policy(st: Stage, node: NodeProfile, policy: str, places: Tuple[str, ...],
                budget: int, offload: Any) -> TierPlan:
    """The plan of :func:`policy_plan`, with the layers ``offload.recompute_layers`` names
    (OffloadConfig.recompute_layers, 1-based as Megatron numbers them; those of this stage, the
    first) recomputed in every micro-batch position, as the runtime runs them, and priced so
    (within the policy's budget). Without the recompute fallback in ``places`` they are not
    forced: plan/job.py refuses that combination before planning."""
    plan = policy_plan(st, node, policy, places, budget, offload)
    named = getattr(offload, "recompute_layers", None) or ()
    return with_recomputed(st, node, plan, named, budget, offload) \
        if named and RECOMPUTE in places else plan


def with_recomputed(st: Stage, node: NodeProfile, plan: TierPlan, layers: Collection[int],
                    budget: int, offload: Any) -> TierPlan:
    """``plan`` with ``layers`` (1-based) of the stage recomputed, priced again."""
    wanted = {n - 1 for n in layers if 1 <= n <= len(st.layers)}
    if not wanted:
        return plan
    rows = tuple(tuple(RECOMPUTE if i in wanted else d for i, d in enumerate(row))
                 for row in plan.decisions)
    if rows == plan.decisions:
        return plan
    return price_stage(st, node, rows, budget_bytes=budget if offload.policy != "keep" else None,
                       keep_last_layers=offload.keep_last_layers,
                       prefetch_layers=offload.prefetch_layers,
                       max_inflight_bytes=getattr(offload, "max_inflight_bytes", None))


def policy_plan(st: Stage, node: NodeProfile, policy: str, places: Tuple[str, ...],
                budget: int, offload: Any) -> TierPlan:
    """The plan ``policy`` makes: keep (nothing moves), offload (every layer but the last
    ``keep_last_layers`` leaves GPU memory, for the engine's tiers: chosen as under a budget
    that holds only those, and priced with one layer's room beside them for writes in flight
    and reads ahead: one layer in transit), adaptive (within ``budget``); reads start
    ``prefetch_layers`` ahead of backward, as the preset's runtime (``offload``: anything with
    ``keep_last_layers`` and ``prefetch_layers``, such as an OffloadConfig) starts them."""
    keep_last, ahead = offload.keep_last_layers, offload.prefetch_layers
    cap = getattr(offload, "max_inflight_bytes", None)  # the runtime's read-ahead byte cap
    if policy == "keep":
        return plan_stage(st, node, budget_bytes=None, places=places)
    if policy == "offload":
        tail = keep_last if st.positions[0].gap_s == 0 else 0
        kept = st.positions[0].live * min(tail, len(st.layers)) * st.layer_bytes
        # what holding only the tail needs: the tail kept by every live micro-batch, and, where
        # nothing is kept, one layer's room to be saved and read back (tier_costs.need_bytes)
        only_tail = max(kept, st.layer_bytes) + st.head_bytes
        chosen = plan_stage(st, node, budget_bytes=only_tail,
                            places=tuple(p for p in places if p != RECOMPUTE),
                            keep_last_layers=keep_last, prefetch_layers=ahead,
                            max_inflight_bytes=cap)
        return price_stage(st, node, chosen.decisions,
                           budget_bytes=only_tail + st.layer_bytes,
                           keep_last_layers=keep_last, prefetch_layers=ahead,
                           max_inflight_bytes=cap)
    return plan_stage(st, node, budget_bytes=budget, places=places,
                      keep_last_layers=keep_last, prefetch_layers=ahead, max_inflight_bytes=cap)


__all__ = ["ENGINE_TIERS", "places_for", "plan_policy", "policy_plan", "with_recomputed"]
