"""The adaptive planner's model when the engine has both tiers (tiered): four places.

With one tier (posix, aio, gds, memory) the adaptive planner chooses keep, offload or recompute
(plan/step_plan.py). With the tiered engine an offloaded layer can go to host memory or to the
drives, and the two differ in everything the plan weighs: host memory is near (its link is
fast) and small, the drives far and large. This model prices the four places with the pure
four-place planner (plan/tiers.py), from what the steps measured:

* the host link: the host tier's measured bandwidth (StepStats.tier_gbps['host'], the slower
  direction); the SSD tier's bytes cross it too (the offloader bounces drive IO through pinned
  host memory);
* the drives: the SSD tier's measured write and read bandwidth (under ``bandwidth_cap_gbps``,
  the emulated drive's);
* host memory: ``host_memory_bytes``, shared by the micro-batches holding activations at once;
* per layer its forward time and bytes, the training thread's cost per byte handed over, and
  the GPU budget and the reserve for what is saved outside the layers (cache/adaptive.py);
  the room the layers need beside what they keep comes from the plan's order.

A tier not measured yet (no byte went there) is not planned with. The model's plan is the
prior of measured selection (plan/explore.py); ``candidates`` offers the plans measured next to
it: the whole-plan ones (all recompute, all keep, all SSD, all host: a model can be wrong about
a machine as a whole), then every single change of one (position, layer) to another place, the
model's cheapest first, each within the GPU budget and the host memory.

With policy 'offload' on the tiered engine there is no budget to plan for: every eligible layer
is offloaded, and :class:`TierPlacement` only chooses the tier, by layer (the last ones on
host memory as far as it holds them, the others on SSD), from the last step's bytes.
"""

from __future__ import annotations

import math
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

from ..config import OffloadConfig
from ..plan.policy import OFFLOAD, LayerMeasurement
from ..plan.step_plan import Decisions, Position, StepPlan
from ..plan.tier_costs import need_bytes
from ..plan.tiers import (HOST, KEEP, PLACES, RECOMPUTE, SSD, TierPlan, Tiers, kept_bytes, plan_tiers,
                          price)
from ..telemetry.stats import StepStats


def _host(layers: Sequence[LayerMeasurement], row: Sequence[str]) -> int:
    return sum(m.activation_bytes for m, d in zip(layers, row) if d == HOST)


class FourPlaces:
    """Keep, host, ssd or recompute per (micro-batch position, layer); see the module docstring."""

    def __init__(self, config: OffloadConfig) -> None:
        self.host_capacity = config.host_memory_bytes
        self.places = PLACES if config.recompute_fallback else (KEEP, HOST, SSD)
        self.keep_last_layers = config.keep_last_layers
        self.prefetch_layers = config.prefetch_layers
        self.link_bps: Optional[float] = None
        """The host link's measured bytes/s (None: no byte went to the host tier yet)."""
        self.ssd_bps: Optional[Tuple[float, float]] = None
        """The drives' measured (write, read) bytes/s (None: none went there yet)."""
        self.last: Optional[TierPlan] = None
        """The model's last plan, with its figures (iteration time, binding, bytes per place)."""

    def measure(self, stats: StepStats) -> None:
        """Take each tier's bandwidth from a finished step, where it moved bytes."""
        host = stats.tier_gbps.get(HOST, {})
        rates = [host.get(k, 0.0) for k in ("write", "read") if host.get(k, 0.0) > 0]
        if rates:
            self.link_bps = min(rates) * 1e9
        ssd = stats.tier_gbps.get(SSD, {})
        if ssd.get("write", 0.0) > 0:
            write = ssd["write"] * 1e9
            self.ssd_bps = (write, ssd["read"] * 1e9 if ssd.get("read", 0.0) > 0 else write)

    @property
    def measured(self) -> bool:
        return self.link_bps is not None or self.ssd_bps is not None

    def tiers(self, budget: Optional[int], reserve: int, cpu_s_per_byte: float) -> Tiers:
        """What the planner may use: a tier with no measurement has no rate (not planned with);
        without a measured host tier the SSD path's bounce is taken as free."""
        link = self.link_bps if self.link_bps is not None else math.inf
        write, read = self.ssd_bps if self.ssd_bps is not None else (0.0, 0.0)
        capacity = self.host_capacity if self.link_bps is not None else 0
        return Tiers(budget_bytes=budget, host_capacity_bytes=capacity, host_link_bps=link,
                     ssd_write_bps=write, ssd_read_bps=read, reserve_bytes=reserve,
                     places=self.places, cpu_s_per_byte=cpu_s_per_byte,
                     keep_last_layers=self.keep_last_layers, prefetch_layers=self.prefetch_layers)

    def plan(self, layers: Sequence[LayerMeasurement], positions: Sequence[Position],
             budget: Optional[int], reserve: int, cpu_s_per_byte: float) -> StepPlan:
        """The model's plan, in the adaptive planner's terms (``last`` keeps the full figures)."""
        tp = self.last = plan_tiers(layers, positions, self.tiers(budget, reserve, cpu_s_per_byte))
        free = None if budget is None else max(0, budget - reserve)
        return StepPlan(tp.decisions, tp.iteration_s - tp.compute_s,
                        tuple(kept_bytes(layers, row) for row in tp.decisions),
                        None if free is None else free // max(p.live for p in positions), tp.fits_budget)

    def describe(self) -> str:
        link = "not measured" if self.link_bps is None else f"{self.link_bps / 1e9:.2f} GB/s"
        ssd = "not measured" if self.ssd_bps is None else \
            f"write {self.ssd_bps[0] / 1e9:.2f}, read {self.ssd_bps[1] / 1e9:.2f} GB/s"
        figures = "" if self.last is None else (
            f"; modeled iteration {self.last.iteration_s * 1e3:.1f} ms (keep {self.last.compute_s * 1e3:.1f}), "
            f"binding: {self.last.binding}")
        return (f"host link {link}, host memory {self.host_capacity / 2**20:.1f} MiB, drives {ssd}"
                + figures)

    def candidates(self, current: Decisions, layers: Sequence[LayerMeasurement],
                   positions: Sequence[Position], budget: Optional[int], reserve: int,
                   cpu_s_per_byte: float, names: Sequence[str]) -> List[Tuple[str, Decisions]]:
        """Plans worth measuring next to ``current`` (see the module docstring): each holds,
        at every position, no more than the GPU budget allows (:func:`holds`; or no more than
        ``current`` does: the bytes are last step's) and its share of host memory."""
        tiers = self.tiers(budget, reserve, cpu_s_per_byte)
        usable = tiers.usable()
        n = len(layers)
        tails = [self.keep_last_layers if p.gap_s == 0 else 0 for p in positions]
        whole: List[Tuple[str, Decisions]] = []
        for place in (RECOMPUTE, KEEP, SSD, HOST):
            if place == KEEP or place in usable:
                tail = place not in (KEEP, RECOMPUTE)  # the runtime keeps the tails anyway
                whole.append((f"all {place}", tuple(tuple(place if i < n - (t if tail else 0) else KEEP
                                                          for i in range(n)) for t in tails)))
        single = []
        for p, row in enumerate(current):
            for i in range(max(0, n - tails[p])):
                for place in (KEEP,) + usable:
                    if place != row[i]:
                        plan = tuple(r if q != p else r[:i] + (place,) + r[i + 1:] for q, r in enumerate(current))
                        cost = price(layers, positions, tiers, plan).iteration_s
                        single.append((cost, f"mb{p} layer {names[i]}: {row[i]} -> {place}", plan))
        single.sort(key=lambda c: c[0])
        free = None if budget is None else max(0, budget - reserve)
        now = [holds(layers, row, pos) for row, pos in zip(current, positions)]

        def allowed(plan: Decisions) -> bool:
            held = [holds(layers, row, pos) for row, pos in zip(plan, positions)]
            gpu = free is None or all(h <= free for h in held) or all(h <= k for h, k in zip(held, now))
            host = all(_host(layers, row) <= tiers.host_capacity_bytes // pos.live
                       for row, pos in zip(plan, positions))
            return gpu and host

        out = whole + [(label, plan) for _, label, plan in single]
        return [(label, plan) for label, plan in out if plan != current and allowed(plan)]


def holds(layers: Sequence[LayerMeasurement], row: Sequence[str], position: Position) -> int:
    """The most a position's live micro-batches hold at once under ``row``: the others' kept
    bytes beside its own need (plan.tier_costs.need_bytes), as plan.tiers weighs the budget."""
    return (position.live - 1) * kept_bytes(layers, row) + need_bytes(layers, row)


class TierPlacement:
    """policy 'offload' on the tiered engine: every eligible layer is offloaded, and the tier is
    chosen by layer, not by arrival. From the last step's bytes per layer (one micro-batch), the
    last layers go to host memory, as many as fit in ``host_memory_bytes``, and the layers before
    them to SSD: the last layers come back first and want the near tier, the first ones have
    the whole forward pass to be written and the whole backward pass to come back. Until a step
    was measured, and for a layer it did not see, the engine's default place ('offload': host
    memory first). With several micro-batches holding activations at once host memory may fill
    before their last layers: those go to SSD (the engine's ``host_spilled``), never over it."""

    def __init__(self, host_capacity: int) -> None:
        self.host_capacity = host_capacity
        self.places: Dict[str, str] = {}
        """Layer (as StepStats names it) -> 'host' or 'ssd'."""

    def place(self, layer: Hashable) -> str:
        return self.places.get(str(layer), OFFLOAD)

    def learn(self, stats: StepStats, num_micro_batches: int) -> None:
        """Place the offloaded layers of a finished step (kept and recomputed ones stay out)."""
        n = max(num_micro_batches, 1)
        rows = [r for r in stats.layers if r.layer != "None" and r.decision in (OFFLOAD, HOST, SSD)]
        room = self.host_capacity
        places: Dict[str, str] = {}
        for r in reversed(rows):  # the last layer first
            nbytes = r.bytes // n
            places[r.layer] = HOST if nbytes <= room else SSD
            room -= nbytes if nbytes <= room else 0
        self.places = places
