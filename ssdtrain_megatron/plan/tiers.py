"""One plan across four places: keep, host, SSD or recompute, per layer and micro-batch position.

Pure (no torch, no IO): :func:`plan_tiers` takes one micro-batch's layers (analytic figures
from the CLI, or what the adaptive runtime measured), the schedule's micro-batch positions
(``plan.step_plan.Position``: the compute between a micro-batch's forward and its backward, and
how many micro-batches hold activations at once) and what the node offers (:class:`Tiers`),
and returns a :class:`TierPlan`: a place for every (position, layer), the modeled iteration
time, the bytes and bandwidth of each place, the peaks and the resource that binds.

What each place costs, and the iteration's shared bandwidth: plan/tier_costs.py.

Choosing: from keep-all, while a position holds more than the GPU budget allows (its live
micro-batches' kept bytes beside the most one of them needs at once, in forward order), make the
move that adds the least iteration time per byte freed (keep -> host, ssd or recompute;
recompute -> host or ssd), within each position's share of host memory. Ties: host before ssd
before recompute, the first layers first: they have the whole forward to be written and the
whole backward to come back, and the layers kept are then the last ones, which backward frees
first, making room to read the moved ones ahead under the budget (a layer moved after kept ones
is read back while they still hold their bytes). Where a tier's bandwidth matters, the costs
differ and decide. Lazy greedy: a move's cost only grows as the resources fill, so a stale cost is
a lower bound and only the best candidate is re-evaluated. Then, since one move at a time
can take recompute where a tier only pays once several layers move, the plans that put the
first k layers of every position in one place are priced too, and one that fits and is
faster replaces the greedy's.
"""

from __future__ import annotations

import heapq
from typing import Dict, List, Sequence, Tuple

from .policy import KEEP, RECOMPUTE, LayerMeasurement
from .step_plan import Position
from .tier_costs import (BINDING, HOST, PLACES, SSD, PositionCost, TierPlan, Tiers, REL_EPS,
                         _readahead, kept_bytes, timeline)

__all__ = ["BINDING", "HOST", "KEEP", "PLACES", "Position", "RECOMPUTE", "SSD", "TierPlan",
           "Tiers", "kept_bytes", "plan_tiers", "price", "timeline"]

_RANK = {HOST: 0, SSD: 1, RECOMPUTE: 2}


class _Step:
    """The iteration's cost from its positions' costs (positions grouped when alike)."""

    def __init__(self, layers: Sequence[LayerMeasurement], groups: List[Tuple[Position, int]],
                 tiers: Tiers) -> None:
        self.layers, self.groups, self.tiers = layers, groups, tiers
        self.compute = sum(count * (1 + tiers.backward_factor) * sum(l.forward_s for l in layers)
                           for _, count in groups) + tiers.bubble_s

    def cost(self, g: int, row: Sequence[str]) -> PositionCost:
        """Group ``g`` under ``row``; with a budget, it may hold what the budget leaves after
        the reserve and the group's other live micro-batches' kept bytes."""
        p, t = self.groups[g][0], self.tiers
        cap = None
        if t.budget_bytes is not None:
            cap = max(0, t.budget_bytes - t.reserve_bytes - (p.live - 1) * kept_bytes(self.layers, row))
        return timeline(self.layers, row, p.gap_s, t, cap)

    def busy(self, costs: Sequence[PositionCost]) -> Tuple[float, float]:
        """(host link, drives): seconds of the iteration each must be busy. The link's busier
        direction is the one to the host (what is forwarded from memory is not read back);
        the drives do one thing at a time, so their writes and reads add up."""
        t = self.tiers
        groups = list(zip(costs, self.groups))
        link = sum((c.host_bytes + c.ssd_bytes) * n for c, (_, n) in groups)
        ssd = sum(c.ssd_bytes * n for c, (_, n) in groups)
        ssd_read = sum(c.ssd_read_bytes * n for c, (_, n) in groups)
        link_s = link / t.host_link_bps if link else 0.0
        drive_s = ssd / t.ssd_write_bps + ssd_read / t.ssd_read_bps if ssd else 0.0
        return link_s, drive_s

    def iteration(self, costs: Sequence[PositionCost]) -> Tuple[float, float]:
        """(iteration seconds, work seconds without stalls)."""
        work = self.compute + sum((c.recompute_s + c.cpu_s) * n
                                  for c, (_, n) in zip(costs, self.groups))
        stalled = work + sum(c.stall_s * n for c, (_, n) in zip(costs, self.groups))
        return max(stalled, *self.busy(costs)), work


def _group(positions: Sequence[Position]) -> Tuple[List[Tuple[Position, int]], List[int]]:
    groups: List[Tuple[Position, int]] = []
    index: Dict[Position, int] = {}
    of = []
    for p in positions:
        if p not in index:
            index[p] = len(groups)
            groups.append((p, 0))
        g = index[p]
        groups[g] = (p, groups[g][1] + 1)
        of.append(g)
    return groups, of


def _check(layers: Sequence[LayerMeasurement], positions: Sequence[Position]) -> None:
    if not positions:
        raise ValueError("positions is empty: expected one Position per micro-batch of the step")
    if not layers:
        raise ValueError("layers is empty: expected one LayerMeasurement per layer")
    for p in positions:
        if not (p.gap_s >= 0 and isinstance(p.live, int) and p.live >= 1):
            raise ValueError(f"{p!r} is invalid: expected gap_s >= 0 and live >= 1")


def plan_tiers(layers: Sequence[LayerMeasurement], positions: Sequence[Position],
               tiers: Tiers) -> TierPlan:
    """Keep, host, ssd or recompute for every (micro-batch position, layer); see the module
    docstring for the model and the choice.

    Args:
        layers: one micro-batch's layers on this GPU, in forward order.
        positions: one per micro-batch of the iteration, in forward order.
        tiers: the GPU budget, host memory and link, drives, allowed places.

    Raises:
        ValueError: empty or invalid measurements or positions.
    """
    _check(layers, positions)
    groups, of = _group(positions)
    step = _Step(layers, groups, tiers)
    n = len(layers)
    rows = [[KEEP] * n for _ in groups]
    costs = [step.cost(g, rows[g]) for g in range(len(groups))]
    fits = True
    if tiers.budget_bytes is not None:
        fits = _free(step, rows, costs, tiers)
        if fits:  # (a reserve over the budget leaves every position over it: not fits)
            _prefer_prefix(step, rows, costs, tiers)
    return _result(step, rows, costs, of, fits)


def _prefer_prefix(step: _Step, rows: List[List[str]], costs: List[PositionCost], tiers: Tiers) -> None:
    """In place: the greedy's plan, or the first k layers of every position in one place (host,
    ssd or recompute; the rest kept, the last ``keep_last_layers`` always where backward follows
    the forward at once) where one of those fits and is faster. The greedy moves
    one layer at a time, and under a budget a single move to host or ssd can stall the forward
    (its write is not done when the next layers need the room) while recompute does not, so it
    can end recomputing layers that host memory would take at no cost once enough of them
    move: megatron-core's Mixtral 8x7B at micro-batch 4 on a DGX H100 recomputed four layers of
    eight (1.12x keep) where five in host memory fit the budget at 1.002x keep."""
    n = len(step.layers)
    tail = tiers.keep_last_layers if any(p.gap_s == 0 for p, _ in step.groups) else 0
    best = step.iteration(costs)[0]
    for place in tiers.usable():
        for k in range(1, max(0, n - tail) + 1):
            row = [place] * k + [KEEP] * (n - k)
            trial = [step.cost(g, row) for g in range(len(step.groups))]
            if not _within_budget(step, trial, tiers) or any(
                    c.host_bytes > tiers.host_capacity_bytes // p.live for c, (p, _) in zip(trial, step.groups)):
                continue
            now = step.iteration(trial)[0]
            if now < best * (1 - REL_EPS):
                best = now
                rows[:] = [list(row) for _ in step.groups]
                costs[:] = trial


def _free(step: _Step, rows: List[List[str]], costs: List[PositionCost], tiers: Tiers) -> bool:
    """Lazy greedy, in place (see the module docstring); False when some position still keeps
    more than its share once no move is left."""
    usable = tiers.usable()
    layers, n = step.layers, len(step.layers)
    host_share = [tiers.host_capacity_bytes // p.live for p, _ in step.groups]
    version = [[0] * n for _ in step.groups]
    base = [step.iteration(costs)[0]]

    def moves(g: int, i: int):
        """(place, bytes freed) for each move of layer i at group g."""
        layer, now = layers[i], rows[g][i]
        for place in usable:
            if now == KEEP:
                freed = layer.activation_bytes - (layer.checkpoint_bytes if place == RECOMPUTE else 0)
            elif now == RECOMPUTE and place != RECOMPUTE:
                freed = layer.checkpoint_bytes
            else:
                continue
            if freed > 0:
                yield place, freed

    def score(g: int, i: int, place: str, freed: int):
        """(heap key, the group's new cost), or None when host memory cannot take it."""
        if place == HOST and costs[g].host_bytes + layers[i].activation_bytes > host_share[g]:
            return None
        was = rows[g][i]
        rows[g][i] = place
        trial = step.cost(g, rows[g])
        rows[g][i] = was
        now, _ = step.iteration(costs[:g] + [trial] + costs[g + 1:])
        extra = now - base[0]
        cost = 0.0 if extra <= REL_EPS * max(base[0], 1e-30) else extra / freed
        return (cost, _RANK[place], i, g), trial

    heap: list = []

    def offer(g: int, i: int) -> None:
        for place, freed in moves(g, i):
            scored = score(g, i, place, freed)
            if scored is not None:
                heapq.heappush(heap, (scored[0], i, place, freed, version[g][i]))

    for g, (p, _) in enumerate(step.groups):
        if _over(step, g, costs[g], tiers):
            tail = tiers.keep_last_layers if p.gap_s == 0 else 0
            for i in range(max(0, n - tail)):
                offer(g, i)
    while any(_over(step, g, c, tiers) for g, c in enumerate(costs)):
        if not heap:
            return False
        key, i, place, freed, seen = heapq.heappop(heap)
        g = key[3]
        if seen != version[g][i] or not _over(step, g, costs[g], tiers):
            continue  # the layer has moved since, or its position fits already
        fresh = score(g, i, place, freed)
        if fresh is None:
            continue
        if heap and fresh[0] > heap[0][0]:
            heapq.heappush(heap, (fresh[0], i, place, freed, seen))  # costlier now: requeue
            continue
        rows[g][i] = place
        costs[g] = fresh[1]
        version[g][i] += 1
        base[0] = step.iteration(costs)[0]
        offer(g, i)  # a recomputed layer may still move out, freeing its input
    return True


def _binding(step: _Step, costs: Sequence[PositionCost], iteration: float, stall: float,
             fits: bool) -> str:
    """What limits the plan: GPU memory when the budget cannot be met; with a stall, the busier
    of the host link and the drives; with recompute or hand-over time instead, the nearest
    usable tier that could not take one more layer (host memory, the host link, the drives),
    else the budget itself; "nothing" when the plan costs no time over keep."""
    t = step.tiers
    if not fits:
        return "GPU memory"
    link_s, drive_s = step.busy(costs)
    if iteration <= step.compute * (1 + REL_EPS):
        return "nothing"
    if stall > 0:
        return "the drives" if drive_s >= link_s else "the host link"
    usable = t.usable()
    one = min(layer.activation_bytes for layer in step.layers)
    if HOST in usable and any(c.host_bytes + one > t.host_capacity_bytes // p.live
                              for c, (p, _) in zip(costs, step.groups)):
        return "host memory"
    if (HOST in usable or SSD in usable) and link_s + one / t.host_link_bps > iteration:
        return "the host link"
    if SSD in usable and drive_s + one / t.ssd_write_bps + one / t.ssd_read_bps > iteration:
        return "the drives"
    return "GPU memory"


def _staging(step: _Step, rows: List[List[str]], costs: Sequence[PositionCost]) -> int:
    """TierPlan.staging_bytes: per position, what its live micro-batches write to the SSD tier
    less what the drives take during their forwards (they are written as the forward goes),
    at least one SSD layer's bytes; the most of any position, plus the SSD layers read back
    through staging: the read-ahead window the runtime opens (by time, tier_costs._readahead),
    within its read-ahead byte cap (``max_inflight_bytes``)."""
    t = step.tiers
    on_ssd = [layer.activation_bytes for row in rows for layer, place in zip(step.layers, row) if place == SSD]
    if not on_ssd:
        return 0
    one = max(on_ssd)
    forward_s = sum(layer.forward_s for layer in step.layers)
    backlog = max(p.live * c.ssd_bytes - t.ssd_write_bps * p.live * forward_s
                  for (p, _), c in zip(step.groups, costs))
    window = max(_readahead(step.layers, row, t) for row in rows)
    reads = window * one
    if t.max_inflight_bytes is not None:
        reads = min(reads, max(t.max_inflight_bytes, one))  # one read always goes
    return int(max(backlog, one) + reads)


def _result(step: _Step, rows: List[List[str]], costs: List[PositionCost], of: List[int],
            fits: bool) -> TierPlan:
    t, layers = step.tiers, step.layers
    iteration, work = step.iteration(costs)
    counts = [n for _, n in step.groups]
    tier_bytes = {p: 0 for p in PLACES}
    for row, n in zip(rows, counts):
        for layer, place in zip(layers, row):
            if place == RECOMPUTE:
                tier_bytes[KEEP] += n * layer.checkpoint_bytes
                tier_bytes[RECOMPUTE] += n * (layer.activation_bytes - layer.checkpoint_bytes)
            else:
                tier_bytes[place] += n * layer.activation_bytes
    ssd = sum(c.ssd_bytes * n for c, n in zip(costs, counts))
    ssd_read = sum(c.ssd_read_bytes * n for c, n in zip(costs, counts))
    link = ssd + sum(c.host_bytes * n for c, n in zip(costs, counts))
    peak = max(_holds(p, c) for (p, _), c in zip(step.groups, costs)) + t.reserve_bytes
    peak = max(peak, max(c.resident_bytes(p.live) for (p, _), c in zip(step.groups, costs)))
    host_peak = max(p.live * c.host_bytes for (p, _), c in zip(step.groups, costs))
    staging = _staging(step, rows, costs)
    stall = iteration - work
    if stall <= REL_EPS * iteration:
        stall, iteration = 0.0, work
    recompute = sum(c.recompute_s * n for c, n in zip(costs, counts))
    cpu = sum(c.cpu_s * n for c, n in zip(costs, counts))
    return TierPlan(decisions=tuple(tuple(rows[g]) for g in of), compute_s=step.compute,
                    recompute_s=recompute, cpu_s=cpu, stall_s=stall, iteration_s=iteration,
                    tier_bytes=tier_bytes, link_bytes=link, ssd_bytes=ssd, ssd_read_bytes=ssd_read,
                    peak_bytes=peak,
                    host_peak_bytes=host_peak, staging_bytes=staging,
                    binding=_binding(step, costs, iteration, stall, fits),
                    fits_budget=fits, tiers=t)


def price(layers: Sequence[LayerMeasurement], positions: Sequence[Position], tiers: Tiers,
          decisions: Sequence[Sequence[str]]) -> TierPlan:
    """What given places cost, priced as :func:`plan_tiers` prices its own plan: the adaptive
    runtime's candidates and the bench's fixed strategies (all keep, all ssd, ...).

    Args:
        decisions: decisions[position][layer], one of :data:`PLACES` each.

    Raises:
        ValueError: empty or invalid measurements or positions, or decisions of another shape.
    """
    _check(layers, positions)
    if len(decisions) != len(positions) or any(len(row) != len(layers) for row in decisions) \
            or any(d not in PLACES for row in decisions for d in row):
        raise ValueError(f"decisions={decisions!r} is invalid: expected one row of "
                         f"{len(layers)} places ({', '.join(PLACES)}) per position ({len(positions)})")
    groups = [(p, 1) for p in positions]
    step = _Step(layers, groups, tiers)
    rows = [list(row) for row in decisions]
    costs = [step.cost(g, rows[g]) for g in range(len(groups))]
    fits = tiers.budget_bytes is None or _within_budget(step, costs, tiers)
    return _result(step, rows, costs, list(range(len(groups))), fits)


def _within_budget(step: _Step, costs: Sequence[PositionCost], tiers: Tiers) -> bool:
    """No position holds more than the GPU budget less the reserve (:func:`_holds`)."""
    return not any(_over(step, g, c, tiers) for g, c in enumerate(costs))


def _holds(p: Position, c: PositionCost) -> int:
    """The most a position's live micro-batches hold at once: the others keep their kept
    bytes while one needs its most (tier_costs.need_bytes: order-aware, so kept layers
    late in the forward leave no room unused for moved layers that come back after them)."""
    return (p.live - 1) * c.kept_bytes + c.need_bytes


def _over(step: _Step, g: int, c: PositionCost, tiers: Tiers) -> bool:
    return _holds(step.groups[g][0], c) > tiers.budget_bytes - tiers.reserve_bytes
