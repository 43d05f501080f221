"""The planner beside the bench: the planned strategy's plan, and each strategy's predicted
step time against keep, next to what the bench measured (``--node-emulation``).

Both use the four-place model (plan/tiers.py) with the emulated node's figures
(node.py: the host tier's capacity and link, the capped drives) and per-layer figures a
step of keep measured: forward time and bytes of one micro-batch per layer (StepStats.layers).
Backward is what keep's forward-and-backward time (StepStats.step_time_s) leaves after the
layers' forward, as a multiple of it (``Tiers.backward_factor``; the embedding, output layer and
loss are counted in it); what the whole step adds to that (the optimizer) is the model's
``bubble``, the same for every strategy. A recomputed layer's input is taken as 1/16 of its
bytes (cache/adaptive.py ``CHECKPOINT_FRACTION``), and recomputing it costs the recompute pass
the runtime measured for it in the recompute strategy's last step (StepStats.layers
``recompute_s``, as adaptive measures it), or its forward where none ran. The bench's
schedule has no pipeline: every micro-batch's backward follows its forward, one at a time.

Each fixed strategy is priced by what it does at run time: offload sends every layer but the
last to the SSD tier; host fills the host tier first-come in forward order and keeps what does
not fit; recompute recomputes every layer; planned and adaptive run their plans, with the layers
the runtime's budget ran recomputed instead (``recompute_fallback``) as recompute, and under
the bench's budget (their forward waits for writes past it; what is saved outside the layers is
not counted against it here).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from ...plan.policy import LayerMeasurement
from ...plan.step_plan import Position
from ...plan.tiers import HOST, KEEP, RECOMPUTE, SSD, TierPlan, Tiers, plan_tiers, price

Rows = Tuple[Tuple[str, ...], ...]


def measurements(stats, num_micro_batches: int, recomputed=None,
                 moved=None) -> Tuple[List[LayerMeasurement], int, List[str]]:
    """(one micro-batch's layers in forward order, bytes saved outside layers per micro-batch,
    the layers' names) from a step's StepStats; ``recomputed``: a step's StepStats in which
    layers ran recomputed, whose measured recompute passes price recomputing them (without
    it, or for a layer it did not recompute, the model's default: the layer's forward);
    ``moved``: a step's StepStats in which layers were offloaded, whose bytes are what moving
    each of them hands a tier (keep can count a tensor in a layer that, offloaded, the layer
    does not hand over: something else holds it; the bench's first layer, by 256 KiB)."""
    from ...cache.adaptive import CHECKPOINT_FRACTION  # here: --help imports no torch

    n = max(num_micro_batches, 1)
    rows = [r for r in stats.layers if r.layer != "None"]
    outside = sum(r.bytes for r in stats.layers if r.layer == "None") // n
    passes = {r.layer: r.recompute_pass_s for r in (recomputed.layers if recomputed is not None else ())}
    handed = {r.layer: r.bytes for r in (moved.layers if moved is not None else ()) if r.bytes_offloaded}
    layers = [LayerMeasurement(forward_s=r.forward_s / n, activation_bytes=handed.get(r.layer, r.bytes) // n,
                               recompute_s=passes.get(r.layer),
                               checkpoint_bytes=r.bytes // n // CHECKPOINT_FRACTION) for r in rows]
    return layers, outside, [r.layer for r in rows]


def backward_factor(stats, layers: Sequence[LayerMeasurement], num_micro_batches: int) -> float:
    """Backward over forward time, from a step of keep (see the module docstring); 2 when the
    step measured too little to tell."""
    forward = num_micro_batches * sum(m.forward_s for m in layers)
    if forward <= 0 or stats.step_time_s <= forward:
        return 2.0
    return (stats.step_time_s - forward) / forward


def tiers(node, budget: Optional[int], reserve: int = 0, bubble_s: float = 0.0,
          factor: float = 2.0) -> Tiers:
    """The emulated node as the planner sees it."""
    write, read = node.drive_gbps()
    return Tiers(budget_bytes=budget, host_capacity_bytes=node.host_bytes or 0,
                 host_link_bps=node.link_gbps * 1e9, ssd_write_bps=write * 1e9, ssd_read_bps=read * 1e9,
                 reserve_bytes=reserve, bubble_s=bubble_s, backward_factor=factor, keep_last_layers=1)


def plan_for(node, stats, num_micro_batches: int, budget: int, recomputed=None,
             moved=None) -> TierPlan:
    """The planned strategy's plan: within ``budget`` (all resident activation bytes), less
    what is saved outside layers, as the adaptive planner reserves it (the room the layers need
    beside what they keep comes from the plan's order, as the runtime's budget sizes it);
    recomputing priced as :func:`predict` prices it, and each layer's bytes what offloading it
    moved, as the adaptive planner measures them (``recomputed``, ``moved``: see
    :func:`measurements`)."""
    layers, outside, _ = measurements(stats, num_micro_batches, recomputed, moved)
    positions = [Position()] * num_micro_batches
    factor = backward_factor(stats, layers, num_micro_batches)
    return plan_tiers(layers, positions, tiers(node, budget, outside, factor=factor))


def fixed_rows(name: str, layers: Sequence[LayerMeasurement], host_bytes: int,
               num_micro_batches: int) -> Optional[Rows]:
    """What fixed strategy ``name`` does per layer (None: not a fixed strategy)."""
    n = len(layers)
    if name == "keep":
        row = (KEEP,) * n
    elif name == "recompute":
        row = (RECOMPUTE,) * n
    elif name in ("offload", "offload+crc32c"):
        row = (SSD,) * (n - 1) + (KEEP,)
    elif name == "host":
        out, used = [], 0
        for i, m in enumerate(layers):
            padded = -(-m.activation_bytes // 512) * 512  # the pool's extents (io/memory.py)
            fits = i < n - 1 and used + padded <= host_bytes
            used += padded if fits else 0
            out.append(HOST if fits else KEEP)
        row = tuple(out)
    else:
        return None
    return (row,) * num_micro_batches


def adaptive_rows(stats, names: Sequence[str], num_micro_batches: int) -> Optional[Rows]:
    """The plan adaptive ran in its last step (StepStats.plan), per position (positions past
    the plan's take its last one, as the planner does); None before it planned."""
    by = {(p, layer): d for p, layer, d in stats.plan}
    if not by:
        return None
    last = max(p for p, _ in by)
    rows = tuple(tuple(by.get((min(p, last), k), KEEP) for k in names) for p in range(num_micro_batches))
    return rows if all(d in (KEEP, HOST, SSD, RECOMPUTE) for row in rows for d in row) else None


def as_run(rows: Rows, stats, names: Sequence[str]) -> Rows:
    """``rows`` as the last step ran them: a layer the runtime's budget ran recomputed
    (``recompute_fallback``: its bytes would not fit; StepStats.layers says 'recompute') is
    recompute at every position, whatever the plan said."""
    if stats is None:
        return rows
    ran = {r.layer for r in stats.layers if r.decision == RECOMPUTE}
    return tuple(tuple(RECOMPUTE if k in ran else d for k, d in zip(names, row)) for row in rows)


def predict(node, keep_stats, keep_step_s: float, num_micro_batches: int,
            plans: Dict[str, Rows], budget: Optional[int] = None,
            recomputed=None) -> Dict[str, float]:
    """Each strategy's predicted step time over keep's, from keep's own step (see the module
    docstring) and, where given, the recompute passes ``recomputed`` (a step's StepStats)
    measured; ``plans``: the rows of planned and adaptive, where they ran, priced under
    ``budget`` as they ran (their forward waits for writes past it); the fixed strategies run
    without one."""
    layers, outside, _ = measurements(keep_stats, num_micro_batches, recomputed)
    if not layers:
        return {}
    positions = [Position()] * num_micro_batches
    factor = backward_factor(keep_stats, layers, num_micro_batches)
    bubble = max(0.0, keep_step_s - keep_stats.step_time_s)
    t = tiers(node, None, 0, bubble, factor)
    budgeted = t if budget is None else tiers(node, budget, outside, bubble, factor)
    keep = price(layers, positions, t, fixed_rows("keep", layers, 0, num_micro_batches)).iteration_s
    out = {}
    for name in ("keep", "offload", "offload+crc32c", "host", "recompute"):
        out[name] = price(layers, positions, t, fixed_rows(name, layers, node.host_bytes or 0,
                                                           num_micro_batches)).iteration_s / keep
    for name, rows in plans.items():
        out[name] = price(layers, positions, budgeted, rows).iteration_s / keep
    return out


def best_within(at: Dict[tuple, object], names: Sequence[str], budget: Optional[int],
                ratio_mb: int) -> Optional[object]:
    """The fastest Point among ``names`` at ``ratio_mb`` whose peak activations fit ``budget``
    (keep among them only where the budget holds all it keeps)."""
    pool = [p for (n, mb), p in at.items() if n in names and mb == ratio_mb
            and (budget is None or p.peak_activation_bytes <= budget)]
    return min(pool, key=lambda p: p.step_s, default=None)


SINGLE = ("keep", "recompute", "offload", "host")
"""The single strategies the planned one is compared with (keep within the budget)."""
FIXED = SINGLE + ("planned",)
"""Under node emulation, the fixed strategies adaptive is compared with."""


def node_ratios(at: Dict[tuple, object], ratio_mb: Optional[int], budget: Optional[int]) -> Tuple[dict, dict]:
    """(ratios, which strategy was best): at ``ratio_mb``, ``planned_vs_best_single_step_time``
    (planned's step time over the fastest single strategy's whose peak fits the budget),
    ``planned_peak_vs_budget``, and ``adaptive_vs_best_fixed_step_time`` against the single
    strategies and planned (replacing budget.py's, which knows offload and recompute)."""
    ratios: dict = {}
    best: dict = {}
    for who, names, key in (("planned", SINGLE, "planned_vs_best_single_step_time"),
                            ("adaptive", FIXED, "adaptive_vs_best_fixed_step_time")):
        mine = at.get((who, ratio_mb))
        if mine is None or not budget:
            continue
        ratios[f"{who}_peak_vs_budget"] = mine.peak_activation_bytes / budget
        other = best_within(at, names, budget, ratio_mb)
        if other is not None:
            ratios[key] = mine.step_s / max(other.step_s, 1e-12)
            best[who] = other.strategy
    return ratios, best


def node_summary(run, at: Dict[tuple, object], ratio_mb: Optional[int], budget: Optional[int],
                 ratios: dict, versus: dict) -> Optional[dict]:
    """--json's ``node_emulation`` (None without it): the node, the places planned and adaptive
    ran, and per strategy the planner's predicted step time over keep's next to the measured
    one, at ``ratio_mb``. Adds ``node_ratios`` to ``ratios``, and the best single and fixed
    strategies to ``versus``."""
    if run.node is None:
        return None
    more, best = node_ratios(at, ratio_mb, budget)
    ratios.update(more)
    versus["best_fixed"] = best.get("adaptive", versus["best_fixed"])
    versus["best_single"] = best.get("planned")
    node, n = run.node, run.spec.num_microbatches
    out = {"node": node.as_dict(), "planned_places": None, "vs_keep_step_time": {}}
    keep = run.series.get(("keep", ratio_mb))
    if keep is None or keep.last_stats is None:
        return out
    _, _, names = measurements(keep.last_stats, n)
    planned = run.series.get(("planned", ratio_mb))
    plans: Dict[str, Rows] = {}
    if planned is not None and planned.plan_rows is not None:
        plans["planned"] = as_run(planned.plan_rows, planned.last_stats, names)
        out["planned_places"] = [list(row) for row in plans["planned"]]
    adaptive = run.series.get(("adaptive", ratio_mb))
    if adaptive is not None and adaptive.last_stats is not None:
        rows = adaptive_rows(adaptive.last_stats, names, n)
        if rows is not None:
            plans["adaptive"] = as_run(rows, adaptive.last_stats, names)
            out["adaptive_places"] = [list(row) for row in plans["adaptive"]]
    recompute = run.series.get(("recompute", ratio_mb))
    predicted = predict(node, keep.last_stats, at[("keep", ratio_mb)].step_s, n, plans, budget,
                        recompute.last_stats if recompute is not None else None)
    for name, value in predicted.items():
        point = at.get((name, ratio_mb))
        if point is None:
            continue
        measured = point.step_s / max(at[("keep", ratio_mb)].step_s, 1e-12)
        out["vs_keep_step_time"][name] = {"predicted": value, "measured": measured,
                                          "error": value / measured - 1 if measured else None}
    return out


def render_node_lines(summary: dict) -> List[str]:
    """The table's lines about the emulated node and the planner's predictions."""
    node = summary.get("node_emulation")
    if not node:
        return []
    r = summary["ratios"]
    lines = []
    for key, label in (("planned_vs_best_single_step_time", "planned / best single step time"),
                       ("planned_peak_vs_budget", "planned peak / budget")):
        if key in r:
            extra = f"  (best single within the budget: {summary['best_single']})" \
                if key.startswith("planned_vs") and summary.get("best_single") else ""
            lines.append(f"  {label:<34} {r[key]:6.2f}{extra}")
    if node["planned_places"]:
        lines.append("planned places (per layer, first to last): " + " ".join(node["planned_places"][0]))
    if node.get("adaptive_places"):
        lines.append("adaptive settled on (micro-batch 0): " + " ".join(node["adaptive_places"][0]))
    rows = node["vs_keep_step_time"]
    if rows:
        lines.append("step time / keep, the planner's prediction (node figures above) against the measurement:")
        for name, v in rows.items():
            lines.append(f"  {name:<16} predicted {v['predicted']:5.2f}  measured {v['measured']:5.2f}"
                         + (f"  ({v['error']:+.0%})" if v["error"] is not None else ""))
    return lines
