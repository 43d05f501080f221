"""Keep / offload / recompute per layer and per micro-batch position, under a memory budget.

Pure (no torch, no IO): ``plan_step`` turns measured costs into decisions; the adaptive loop
(cache/adaptive.py) feeds it what a step measured and applies what it returns.

What a decision costs, per micro-batch (the timeline of ``plan.policy``'s module docstring,
plus the time between the micro-batch's forward and its backward):

* keep: no time; its bytes stay resident until the layer's backward.
* offload: the training thread's cost of handing the bytes to the engine (``cpu_s_per_byte``),
  plus any stall when the write and read-back cannot hide behind compute. Writes drain during
  the later layers' forward, during ``gap_s`` (other micro-batches' forwards that run before
  this one's backward: the first micro-batches of a pipeline's warm-up) and the backward; reads
  start with the backward.
* recompute: one extra forward of the layer in backward; its input stays resident.

The budget is for all micro-batches holding activations at once (``live`` per position) plus
headroom for what the runtime guarantee needs beside the kept bytes (``reserve_bytes``: a
layer being saved, a write in flight, a layer read back). With no budget everything is kept:
keeping costs no time. With one, each position keeps as much as its share allows and frees the
rest by whichever of offload and recompute adds the least time per byte freed: offload where
the drive hides it, recompute where it does not (if allowed), else offload anyway (the budget
comes first; the stall is predicted).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from .policy import KEEP, OFFLOAD, RECOMPUTE, LayerMeasurement, free_cheapest_first, timeline

_REL_EPS = 1e-9


@dataclass(frozen=True)
class Position:
    """How one micro-batch position of the step runs (measured by the offloader)."""

    gap_s: float = 0.0
    """Compute between this micro-batch's forward end and its backward start."""
    live: int = 1
    """Micro-batches holding activations at once while this one is in backward (itself included)."""


@dataclass(frozen=True)
class StepPlan:
    """Decisions per micro-batch position and layer, and what they are predicted to cost."""

    decisions: Tuple[Tuple[str, ...], ...]
    """decisions[position][layer], layers in forward order."""
    extra_s: float
    """Predicted time over keeping everything: IO stalls, recomputation and the training
    thread's offload cost, all positions together."""
    kept_bytes: Tuple[int, ...]
    """Bytes each position keeps resident (kept layers and recomputed layers' inputs)."""
    allowance_bytes: Optional[int]
    """Kept bytes each live micro-batch may hold (None: no budget)."""
    fits_budget: bool
    """False when even freeing every movable layer leaves a position above its share."""

    def rows(self, names: Sequence[str]) -> List[Tuple[str, ...]]:
        """The plan as a table: one row per layer, one column per position."""
        return [(name,) + tuple(d[i] for d in self.decisions) for i, name in enumerate(names)]


def simulate(layers: Sequence[LayerMeasurement], decisions: Sequence[str], write_bps: float,
             read_bps: float, gap_s: float = 0.0, cpu_s_per_byte: float = 0.0,
             backward_factor: float = 2.0) -> float:
    """Seconds one micro-batch takes over keeping everything, under ``decisions``."""
    return sum(timeline(layers, decisions, write_bps, read_bps, gap_s, cpu_s_per_byte,
                        backward_factor))


def _kept(layers: Sequence[LayerMeasurement], decisions: Sequence[str]) -> int:
    return sum(layer.activation_bytes if d == KEEP else layer.checkpoint_bytes if d == RECOMPUTE else 0
               for layer, d in zip(layers, decisions))


def _check(layers, positions, write_bps, read_bps, budget_bytes, reserve_bytes, cpu_s_per_byte) -> None:
    if not positions:
        raise ValueError("positions is empty: expected one Position per micro-batch of the step")
    for name, v in (("write_bps", write_bps), ("read_bps", read_bps)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"{name}={v!r} is invalid: expected bytes/s > 0")
    for name, v in (("budget_bytes", budget_bytes), ("reserve_bytes", reserve_bytes)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ValueError(f"{name}={v!r} is invalid: expected an integer >= 0")
    if not cpu_s_per_byte >= 0:
        raise ValueError(f"cpu_s_per_byte={cpu_s_per_byte!r} is invalid: expected >= 0")
    for p in positions:
        if not (p.gap_s >= 0 and isinstance(p.live, int) and p.live >= 1):
            raise ValueError(f"{p!r} is invalid: expected gap_s >= 0 and live >= 1")


def plan_step(layers: Sequence[LayerMeasurement], positions: Sequence[Position], *,
              write_bps: float, read_bps: float, budget_bytes: Optional[int],
              reserve_bytes: int = 0, cpu_s_per_byte: float = 0.0,
              recompute_fallback: bool = False, keep_last_layers: int = 1,
              backward_factor: float = 2.0) -> StepPlan:
    """Decide keep / offload / recompute for every (micro-batch position, layer).

    Args:
        layers: one micro-batch's layers, in forward order (forward time, bytes; recompute
            cost defaults to one forward).
        positions: one per micro-batch of the step, in forward order.
        write_bps, read_bps: achieved bandwidth of the engine, bytes/s.
        budget_bytes: resident activation bytes allowed for the whole step at any time; None:
            keep everything.
        reserve_bytes: part of the budget left for what is not kept (a layer being saved or
            read back, writes in flight).
        cpu_s_per_byte: training-thread seconds per byte offloaded.
        recompute_fallback: recompute may be chosen.
        keep_last_layers: where backward follows the forward at once (gap 0), the runtime keeps
            the last N layers' bytes until their backward anyway: they are kept here too.

    Raises:
        ValueError: bad measurements or settings.
    """
    _check(layers, positions, write_bps, read_bps, budget_bytes, reserve_bytes, cpu_s_per_byte)
    n = len(layers)
    if budget_bytes is None:
        return StepPlan(tuple((KEEP,) * n for _ in positions), 0.0,
                        tuple(_kept(layers, (KEEP,) * n) for _ in positions), None, True)
    free = max(0, budget_bytes - reserve_bytes)
    plans, extras, fits = [], 0.0, True
    for pos in positions:
        allowance = free // pos.live
        tail = keep_last_layers if pos.gap_s == 0 else 0
        decisions, ok = _plan_position(layers, pos, allowance, range(max(0, n - tail)), write_bps,
                                       read_bps, cpu_s_per_byte, recompute_fallback, backward_factor)
        fits = fits and ok
        plans.append(tuple(decisions))
        extras += simulate(layers, decisions, write_bps, read_bps, pos.gap_s, cpu_s_per_byte,
                           backward_factor)
    return StepPlan(tuple(plans), extras, tuple(_kept(layers, d) for d in plans),
                    free // max(p.live for p in positions), fits)


def _plan_position(layers, pos: Position, allowance: int, movable, write_bps, read_bps,
                   cpu_s_per_byte, recompute_fallback, backward_factor) -> Tuple[List[str], bool]:
    """Greedy: from keep-all, free the layer whose freeing adds the least time per byte, until
    the kept bytes fit ``allowance``."""
    decisions = [KEEP] * len(layers)
    tolerance = _REL_EPS * sum(layer.forward_s for layer in layers) * (1 + backward_factor)

    def cost(d) -> float:
        return simulate(layers, d, write_bps, read_bps, pos.gap_s, cpu_s_per_byte, backward_factor)

    fits = free_cheapest_first(layers, decisions, movable, cost, tolerance, recompute_fallback,
                               lambda d: _kept(layers, d) > allowance)
    return decisions, fits


Decisions = Tuple[Tuple[str, ...], ...]
"""decisions[position][layer], as in StepPlan.decisions."""


def fits(layers: Sequence[LayerMeasurement], positions: Sequence[Position], decisions: Decisions,
         budget_bytes: Optional[int], reserve_bytes: int = 0) -> bool:
    """Whether every position's kept bytes fit its share of the budget (as plan_step shares it)."""
    if budget_bytes is None:
        return True
    free = max(0, budget_bytes - reserve_bytes)
    return all(_kept(layers, d) <= free // p.live for p, d in zip(positions, decisions))


def candidates(current: Decisions, layers: Sequence[LayerMeasurement], positions: Sequence[Position], *,
               write_bps: float, read_bps: float, budget_bytes: Optional[int], reserve_bytes: int = 0,
               cpu_s_per_byte: float = 0.0, recompute_fallback: bool = False,
               keep_last_layers: int = 1, backward_factor: float = 2.0,
               names: Optional[Sequence[str]] = None) -> List[Tuple[str, Decisions]]:
    """Plans worth measuring next to ``current``, each within the budget: the whole-plan ones
    first (all recompute, all keep, all offload: a model can be wrong about a machine as a
    whole), then every single change of one (position, layer), the model's cheapest first.
    Within the budget means: each position's kept bytes fit its share (``fits``), or, when
    ``current`` itself does not fit so (the reserve is an estimate), no position keeps more
    than under ``current``; the runtime's budget (cache/budget.py) holds either way."""
    n = len(layers)
    allowed = (KEEP, OFFLOAD, RECOMPUTE) if recompute_fallback else (KEEP, OFFLOAD)
    # Offloading the last layers where backward follows at once changes nothing at run time
    # (the runtime keeps them until their backward): they stay as plan_step leaves them.
    tails = [keep_last_layers if p.gap_s == 0 else 0 for p in positions]
    whole: List[Tuple[str, Decisions]] = []
    if recompute_fallback:
        whole.append(("all recompute", tuple((RECOMPUTE,) * n for _ in positions)))
    whole.append(("all keep", tuple((KEEP,) * n for _ in positions)))
    names = list(names) if names is not None else [str(i) for i in range(n)]
    whole.append(("all offload", tuple(tuple(OFFLOAD if i < n - t else KEEP for i in range(n))
                                       for t in tails)))

    def cost(plan: Decisions) -> float:
        return sum(simulate(layers, d, write_bps, read_bps, p.gap_s, cpu_s_per_byte, backward_factor)
                   for p, d in zip(positions, plan))

    single = []
    for p, row in enumerate(current):
        for i in range(max(0, n - tails[p])):
            for d in allowed:
                if d != row[i]:
                    plan = tuple(r if q != p else r[:i] + (d,) + r[i + 1:] for q, r in enumerate(current))
                    single.append((cost(plan), f"mb{p} layer {names[i]}: {row[i]} -> {d}", plan))
    single.sort(key=lambda c: c[0])
    out = whole + [(label, plan) for _, label, plan in single]
    now = [_kept(layers, d) for d in current]
    # Within the budget: fits it, or (where even the model's plan does not, by its reserve)
    # keeps no more at any position than the plan already running under the runtime's budget.
    return [(label, plan) for label, plan in out if plan != current and (
        fits(layers, positions, plan, budget_bytes, reserve_bytes)
        or all(_kept(layers, d) <= k for d, k in zip(plan, now)))]


def format_plan(plan: StepPlan, names: Sequence[str]) -> str:
    """A small text table: layers down, micro-batch positions across."""
    head = ("layer",) + tuple(f"mb{p}" for p in range(len(plan.decisions)))
    rows = [head] + plan.rows(names)
    widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)) for r in rows)
