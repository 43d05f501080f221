"""One plan across four places: keep, host, SSD or recompute, per layer and micro-batch position.

Pure (no torch, no IO): :func:`plan_tiers` takes one micro-batch's layers (analytic figures
from the CLI, or what the adaptive runtime measured), the schedule's micro-batch positions
(``plan.step_plan.Position``: the compute between a micro-batch's forward and its backward, and
how many micro-batches hold activations at once) and what the node offers (:class:`Tiers`),
and returns a :class:`TierPlan`: a place for every (position, layer), the modeled iteration
time, the bytes and bandwidth of each place, the peaks and the resource that binds.

What each place costs, per micro-batch (the timeline of ``plan.policy``, with two tiers):

* keep: no time; the bytes stay in GPU memory until the layer's backward.
* host: the bytes cross the host link (GPU -> host) in forward, queued behind earlier writes,
  and back (host -> GPU) in backward; they occupy host memory in between.
* ssd: the same crossing of the host link (the offloader bounces drive IO through pinned host
  memory), and in series the drive's write, later its read. A drive does one thing at a time:
  its writes and reads share its time.
* recompute: one extra forward of the layer in backward; its input stays in GPU memory.
* host and ssd also cost the training thread ``cpu_s_per_byte`` per byte handed over.

Reads start with the micro-batch's backward, in reverse layer order, each no earlier than its
write completed; a read that completes after its layer's backward is due stalls for the
difference (the runtime bounds its read-ahead by the budget's reserve; here it is unbounded).

Micro-batches overlap in a pipeline, so each position's own timeline sees the whole bandwidth;
what they share is checked for the whole iteration: every resource (each direction of the host
link, the drives) must carry its bytes within the iteration. The iteration time is the larger
of the compute with each position's stalls and the busiest resource's time, so a plan that
needs more bandwidth than a tier has never reports 0 stall.

Choosing: from keep-all, while a position keeps more than its share of the GPU budget, make the
move that adds the least iteration time per byte freed (keep -> host, ssd or recompute;
recompute -> host or ssd), within each position's share of host memory. Ties: host before ssd
before recompute; host takes the last layers first (they come back first and want the nearest
place), ssd the first layers (they have the whole forward to be written and the whole backward
to come back). Lazy greedy: a move's cost only grows as the resources fill, so a stale cost is
a lower bound and only the best candidate is re-evaluated.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .policy import KEEP, OFFLOAD, RECOMPUTE, LayerMeasurement
from .step_plan import Position

HOST = "host"
SSD = "ssd"
PLACES = (KEEP, HOST, SSD, RECOMPUTE)
"""The four places, nearest first."""

BINDING = ("GPU memory", "host memory", "the host link", "the drives")
"""What ``TierPlan.binding`` may name (or "nothing": the plan costs no time over keep)."""

_REL_EPS = 1e-9
_FULL = 0.999  # a resource this full (of capacity or of the iteration) binds
_RANK = {HOST: 0, SSD: 1, RECOMPUTE: 2}


def _check_rate(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) \
            or value < 0:
        raise ValueError(f"Tiers.{name}={value!r} is invalid: expected bytes/s >= 0 "
                         "(0: no such tier; math.inf: unlimited)")


@dataclass(frozen=True)
class Tiers:
    """What one GPU has for activations, and which places the plan may use."""

    budget_bytes: Optional[int]
    """GPU activation bytes allowed at once, all live micro-batches together; None: no limit
    (everything is kept: keeping costs no time)."""
    host_capacity_bytes: int = 0
    """Host memory for this GPU's activations."""
    host_link_bps: float = 0.0
    """Bytes/s between GPU and host memory in each direction; the SSD tier crosses it too."""
    ssd_write_bps: float = 0.0
    """Drive write bytes/s this GPU gets."""
    ssd_read_bps: float = 0.0
    """Drive read bytes/s this GPU gets."""
    reserve_bytes: int = 0
    """Part of the budget left for what is not kept (a layer being saved or read back)."""
    places: Tuple[str, ...] = PLACES
    """Places the plan may use (keep always): the engine's tiers, recompute if allowed."""
    bubble_s: float = 0.0
    """Pipeline bubble per iteration: idle compute, during which IO still runs."""
    cpu_s_per_byte: float = 0.0
    """Training-thread seconds per byte handed to the host or SSD tier."""
    backward_factor: float = 2.0
    """Backward time of a layer as a multiple of its forward time."""
    keep_last_layers: int = 1
    """Where backward follows the forward at once (gap 0), the last N layers stay kept."""

    def __post_init__(self) -> None:
        for name in ("budget_bytes", "host_capacity_bytes", "reserve_bytes", "keep_last_layers"):
            value = getattr(self, name)
            if value is None and name == "budget_bytes":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Tiers.{name}={value!r} is invalid: expected an integer >= 0")
        for name in ("host_link_bps", "ssd_write_bps", "ssd_read_bps"):
            _check_rate(name, getattr(self, name))
        for name in ("bubble_s", "cpu_s_per_byte"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"Tiers.{name}={getattr(self, name)!r} is invalid: expected >= 0")
        if not self.backward_factor > 0:
            raise ValueError(f"Tiers.backward_factor={self.backward_factor!r} is invalid: "
                             "expected > 0")
        unknown = [p for p in self.places if p not in PLACES]
        if unknown:
            raise ValueError(f"Tiers.places={self.places!r} is invalid: allowed: "
                             + ", ".join(PLACES))

    def usable(self) -> Tuple[str, ...]:
        """The places a layer may leave keep for: allowed, and with a nonzero rate."""
        ok = []
        if HOST in self.places and self.host_link_bps > 0 and self.host_capacity_bytes > 0:
            ok.append(HOST)
        if SSD in self.places and self.host_link_bps > 0 and self.ssd_write_bps > 0 \
                and self.ssd_read_bps > 0:
            ok.append(SSD)
        if RECOMPUTE in self.places:
            ok.append(RECOMPUTE)
        return tuple(ok)


@dataclass(frozen=True)
class _Cost:
    """One position's timeline under one row of decisions."""

    stall_s: float
    recompute_s: float
    cpu_s: float
    host_bytes: int
    ssd_bytes: int
    kept_bytes: int


@dataclass(frozen=True)
class TierPlan:
    """Places per (position, layer) and what the model predicts for one iteration."""

    decisions: Tuple[Tuple[str, ...], ...]
    """decisions[position][layer]: 'keep', 'host', 'ssd' or 'recompute', forward order."""
    compute_s: float
    """Forward and backward of every micro-batch, plus the bubble: the iteration keeping all."""
    recompute_s: float
    """Extra forward time of recomputed layers, all positions."""
    cpu_s: float
    """Training-thread time handing bytes to the tiers, all positions."""
    stall_s: float
    """Time the iteration waits on the host link or the drives (0 only when every resource
    carries its bytes in time)."""
    iteration_s: float
    """compute + recompute + cpu + stall: the modeled time of one iteration."""
    tier_bytes: Dict[str, int]
    """Bytes per iteration in each place (keep: resident, recomputed layers' inputs included;
    recompute: what recomputation re-creates)."""
    link_bytes: int
    """Bytes per iteration over the host link in each direction (host and SSD tiers)."""
    ssd_bytes: int
    """Bytes per iteration written to the drives (and read back)."""
    peak_bytes: int
    """GPU activation bytes at the worst moment: the most any position's live micro-batches
    keep, plus the reserve."""
    host_peak_bytes: int
    """Host memory at the worst moment, likewise."""
    binding: str
    """What limits the plan: one of :data:`BINDING`, or "nothing"."""
    fits_budget: bool
    """False when even moving every movable layer leaves a position above its GPU share."""
    tiers: Tiers = field(repr=False)
    """What the plan was made for (rates, capacities, allowed places)."""

    def layers(self, place: str, position: int = 0) -> List[int]:
        return [i for i, d in enumerate(self.decisions[position]) if d == place]

    def bytes_per_micro_batch(self) -> Dict[str, int]:
        """tier_bytes averaged over the positions (exact when they are all alike)."""
        n = len(self.decisions)
        return {k: v // n for k, v in self.tier_bytes.items()}

    @property
    def work_s(self) -> float:
        """The iteration without stalls."""
        return self.compute_s + self.recompute_s + self.cpu_s

    def bandwidth_bps(self) -> Dict[str, Dict[str, float]]:
        """Per tier: ``used`` (bytes/s flowing over the iteration), ``needed`` (to carry the
        bytes without stalling) and ``available``. The host link counts each direction; the
        drives carry each byte once each way, so their ``available`` is the rate of each way
        when writes and reads share their time: 1 / (1/write + 1/read)."""
        t = self.tiers
        drive = 1 / (1 / t.ssd_write_bps + 1 / t.ssd_read_bps) if t.ssd_write_bps > 0 \
            and t.ssd_read_bps > 0 else 0.0
        out = {}
        for name, moved, available in ((HOST, self.link_bytes, t.host_link_bps),
                                       (SSD, self.ssd_bytes, drive)):
            out[name] = {"used": moved / self.iteration_s if self.iteration_s else 0.0,
                         "needed": moved / self.work_s if self.work_s else 0.0,
                         "available": available}
        out[SSD].update(write_available=t.ssd_write_bps, read_available=t.ssd_read_bps)
        return out

    def as_offload_decisions(self) -> Tuple[Tuple[str, ...], ...]:
        """The plan in the runtime's older words: host and ssd become 'offload' (the engine's
        default tier)."""
        return tuple(tuple(OFFLOAD if d in (HOST, SSD) else d for d in row) for row in self.decisions)


def timeline(layers: Sequence[LayerMeasurement], row: Sequence[str], gap_s: float,
             tiers: Tiers) -> _Cost:
    """One micro-batch under ``row``: its forward (writes queued on the host link, SSD writes
    also on the drive), ``gap_s`` of other work, its backward (reads in reverse order)."""
    link, w, r = tiers.host_link_bps, tiers.ssd_write_bps, tiers.ssd_read_bps
    clock = cpu = 0.0
    d2h_free = drive_free = 0.0
    done: Dict[int, float] = {}
    host = ssd = kept = 0
    for i, layer in enumerate(layers):
        clock += layer.forward_s
        place, size = row[i], layer.activation_bytes
        if place in (HOST, SSD):
            hand = size * tiers.cpu_s_per_byte
            clock += hand
            cpu += hand
            start = max(clock, d2h_free)
            d2h_free = start + size / link
            if place == HOST:
                done[i] = d2h_free
                host += size
            else:
                drive_start = max(start, drive_free)
                drive_free = max(drive_start + size / w, d2h_free)
                done[i] = drive_free
                ssd += size
        elif place == KEEP:
            kept += size
        else:
            kept += layer.checkpoint_bytes
    clock += gap_s
    backward = h2d_free = clock
    stall = recompute = 0.0
    for i in reversed(range(len(layers))):
        layer, place, size = layers[i], row[i], layers[i].activation_bytes
        if place == HOST:
            h2d_free = max(backward, h2d_free, done[i]) + size / link
            arrival = h2d_free
        elif place == SSD:
            drive_start = max(backward, drive_free, done[i])
            drive_free = drive_start + size / r
            h2d_free = max(max(drive_start, h2d_free) + size / link, drive_free)
            arrival = h2d_free
        else:
            arrival = 0.0
        if arrival > clock:
            stall += arrival - clock
            clock = arrival
        if place == RECOMPUTE:
            recompute += layer.recompute_cost_s
            clock += layer.recompute_cost_s
        clock += tiers.backward_factor * layer.forward_s
    return _Cost(stall, recompute, cpu, host, ssd, kept)


class _Step:
    """The iteration's cost from its positions' costs (positions grouped when alike)."""

    def __init__(self, layers: Sequence[LayerMeasurement], groups: List[Tuple[Position, int]],
                 tiers: Tiers) -> None:
        self.layers, self.groups, self.tiers = layers, groups, tiers
        self.compute = sum(count * (1 + tiers.backward_factor) * sum(l.forward_s for l in layers)
                           for _, count in groups) + tiers.bubble_s

    def cost(self, g: int, row: Sequence[str]) -> _Cost:
        return timeline(self.layers, row, self.groups[g][0].gap_s, self.tiers)

    def busy(self, costs: Sequence[_Cost]) -> Tuple[float, float]:
        """(host link, drives): seconds of the iteration each must be busy. The link's two
        directions carry the same bytes (all that is written is read back); the drives do
        one thing at a time, so their writes and reads add up."""
        t = self.tiers
        link = sum((c.host_bytes + c.ssd_bytes) * n for c, (_, n) in zip(costs, self.groups))
        ssd = sum(c.ssd_bytes * n for c, (_, n) in zip(costs, self.groups))
        link_s = link / t.host_link_bps if link else 0.0
        drive_s = ssd / t.ssd_write_bps + ssd / t.ssd_read_bps if ssd else 0.0
        return link_s, drive_s

    def iteration(self, costs: Sequence[_Cost]) -> Tuple[float, float]:
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
    return _result(step, rows, costs, of, fits)


def _free(step: _Step, rows: List[List[str]], costs: List[_Cost], tiers: Tiers) -> bool:
    """Lazy greedy, in place (see the module docstring); False when some position still keeps
    more than its share once no move is left."""
    free = max(0, tiers.budget_bytes - tiers.reserve_bytes)
    usable = tiers.usable()
    layers, n = step.layers, len(step.layers)
    share = [free // p.live for p, _ in step.groups]
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
        cost = 0.0 if extra <= _REL_EPS * max(base[0], 1e-30) else extra / freed
        return (cost, _RANK[place], -i if place == HOST else i, g), trial

    heap: list = []

    def offer(g: int, i: int) -> None:
        for place, freed in moves(g, i):
            scored = score(g, i, place, freed)
            if scored is not None:
                heapq.heappush(heap, (scored[0], i, place, freed, version[g][i]))

    for g, (p, _) in enumerate(step.groups):
        if costs[g].kept_bytes > share[g]:
            tail = tiers.keep_last_layers if p.gap_s == 0 else 0
            for i in range(max(0, n - tail)):
                offer(g, i)
    while any(c.kept_bytes > s for c, s in zip(costs, share)):
        if not heap:
            return False
        key, i, place, freed, seen = heapq.heappop(heap)
        g = key[3]
        if seen != version[g][i] or costs[g].kept_bytes <= share[g]:
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


def _binding(step: _Step, costs: Sequence[_Cost], iteration: float, stall: float, fits: bool,
             host_peak: int) -> str:
    """What limits the plan: GPU memory when the budget cannot be met; with a stall, the busier
    of the host link and the drives; else a full host memory, link or drive; else the budget
    (what made layers leave keep); "nothing" when the plan costs no time over keep."""
    t = step.tiers
    if not fits:
        return "GPU memory"
    link_s, drive_s = step.busy(costs)
    if iteration <= step.compute * (1 + _REL_EPS):
        return "nothing"
    if stall > 0:
        return "the drives" if drive_s >= link_s else "the host link"
    if t.host_capacity_bytes and host_peak >= _FULL * t.host_capacity_bytes:
        return "host memory"
    return "GPU memory"


def _result(step: _Step, rows: List[List[str]], costs: List[_Cost], of: List[int],
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
    link = ssd + sum(c.host_bytes * n for c, n in zip(costs, counts))
    peak = max(p.live * c.kept_bytes for (p, _), c in zip(step.groups, costs)) + t.reserve_bytes
    host_peak = max(p.live * c.host_bytes for (p, _), c in zip(step.groups, costs))
    stall = iteration - work
    if stall <= _REL_EPS * iteration:
        stall, iteration = 0.0, work
    recompute = sum(c.recompute_s * n for c, n in zip(costs, counts))
    cpu = sum(c.cpu_s * n for c, n in zip(costs, counts))
    return TierPlan(decisions=tuple(tuple(rows[g]) for g in of), compute_s=step.compute,
                    recompute_s=recompute, cpu_s=cpu, stall_s=stall, iteration_s=iteration,
                    tier_bytes=tier_bytes, link_bytes=link, ssd_bytes=ssd, peak_bytes=peak,
                    host_peak_bytes=host_peak,
                    binding=_binding(step, costs, iteration, stall, fits, host_peak),
                    fits_budget=fits, tiers=t)
