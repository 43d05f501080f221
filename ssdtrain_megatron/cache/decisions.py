"""What happens to each layer's saved tensors: where they spend the time between its forward
and its backward.

Four places: the GPU ('keep'), host memory ('host'), a drive ('ssd'), or nowhere ('recompute':
the layer runs again in backward from its input). 'offload' is the engine's default place, as
before the tiers were planned: with the tiered engine, host memory while it has room and SSD
beyond; with any other engine, its one place. 'host' and 'ssd' name the tier; an engine with
one place ignores it.

Sources decide, in this order of precedence: the policy ('keep' keeps everything), the
adaptive planner (``adaptive.py``: per micro-batch position and layer, from measurement), else
the per-layer plan the integration or the user set (``set_layer``; offload by default), whose
'offload' layers the tier placement (``four_places.TierPlacement``: policy 'offload' on the
tiered engine) sends to host memory or SSD by layer. The
activation budget (``budget.py``) then has the last word on a record that would not fit: it
makes room before the record counts as resident, writes a record the plan keeps when keeping it
would leave no room for what the micro-batch's later layers need (sized from the plan's order:
``_room_after``), and, with ``recompute_fallback``, turns a layer the
plan offloads into a recomputed one when its bytes could not be read back beside what no write
can free. At a step's end the budget's and the planner's figures go into the step's stats, and
the planner re-plans from them.

Collaborators received at construction: the budget (built by ``transfers.py``, which owns the
operations it makes room with) and the planner; nothing here moves bytes or records states.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Dict, Hashable, List, Optional, Sequence

from ..config import OffloadConfig
from ..io.base import TIERS
from ..plan.policy import LayerMeasurement
from ..plan.tier_costs import need_bytes
from ..telemetry.stats import StepStats
from .budget import ActivationBudget
from .record import TensorRecord

if TYPE_CHECKING:
    from .adaptive import AdaptivePlanner
    from .four_places import TierPlacement
    from .step import Step

KEEP, OFFLOAD, RECOMPUTE = "keep", "offload", "recompute"
HOST, SSD = TIERS

DECISIONS = (OFFLOAD, KEEP, RECOMPUTE) + TIERS
"""Every decision the offloader accepts (``set_layer_decision``, the adaptive plan)."""

OFFLOADS = (OFFLOAD,) + TIERS
"""The decisions that hand a tensor to the IO engine."""

LATE_PROBE_MAX_STEPS = 64
"""The longest run of steps with no late write before ``late_tail`` gives layers back to
offload again, after probes that found them late (``Decisions.learn``)."""


class Decisions:
    """Per-layer decisions for one offloader (training thread only).

    Args:
        config: the settings (``policy``, ``recompute_fallback``).
        budget: the activation budget, or None.
        planner: the adaptive planner (policy 'adaptive'), or None.
        placement: the tier placement (policy 'offload' on the tiered engine), or None.
    """

    def __init__(self, config: OffloadConfig, budget: Optional[ActivationBudget],
                 planner: Optional["AdaptivePlanner"], placement: Optional["TierPlacement"] = None) -> None:
        self._keep_all = config.policy == "keep"
        self._recompute_fallback = config.recompute_fallback
        self._budget = budget
        self._planner = planner
        self._placement = placement
        self._by_layer: Dict[Hashable, str] = {}
        self._order: Dict[Hashable, int] = {}  # layer -> forward position, from the last step
        self._layers: List[Hashable] = []  # the layers in forward order, from the last step
        self._after: Dict[tuple, Optional[int]] = {}  # (micro-batch, layer) -> room_after, this step
        self._outside = 0  # bytes one micro-batch saves outside layers, from the last step
        self.late_tail = 0
        """Layers at the forward's end whose writes are deferred like ``keep_last_layers``'
        (kept when the micro-batch's backward follows at once) because backward wanted their
        records before the device->host copies had landed in an earlier step: writes that cannot
        complete in time are not started. It grows to cover the first layer found late, and
        halves after a run of steps with no late write, so that layers go back to offload once
        their writes land in time again (one slow first step does not keep them in GPU memory
        for the whole run); a halving that finds them late again doubles the run it waits for
        next time, up to ``LATE_PROBE_MAX_STEPS`` (:meth:`learn`)."""
        self._late_calm = 0  # steps in a row with no late write, since late_tail last changed
        self._late_probe = 1  # ... needed before late_tail halves
        self._late_probing = False  # the last step ran with a halved late_tail
        # Without a budget, a planner or a placement a record's decision is its layer's: one
        # dict lookup.
        self._plain = budget is None and planner is None and placement is None

    @property
    def planner(self) -> Optional["AdaptivePlanner"]:
        return self._planner

    def set_layer(self, layer: Hashable, decision: str) -> None:
        if decision not in DECISIONS:
            raise ValueError(f"decision={decision!r} is invalid; allowed: {', '.join(DECISIONS)}")
        self._by_layer[layer] = decision

    def for_layer(self, micro_batch: Hashable, layer: Hashable, forward: bool) -> str:
        """The decision for ``layer`` of ``micro_batch`` (``forward``: asked during forward,
        where the budget may turn an offloaded layer into a recomputed one)."""
        if self._keep_all:
            return "keep"
        if self._planner is not None:  # plan: per micro-batch position and layer
            d = self._planner.decision(micro_batch, layer)
        else:
            d = self._by_layer.get(layer, OFFLOAD)
            if d == OFFLOAD and self._placement is not None:
                d = self._placement.place(layer)  # tiers: host or ssd for this layer
        if d in OFFLOADS and self._budget is not None and self._recompute_fallback and forward \
                and self._budget.recompute_instead(micro_batch, layer):
            return "recompute"  # budget: the layer's bytes would not fit; run it recomputed
        return d

    def for_record(self, rec: TensorRecord, step: "Step") -> str:
        """The pack hook's question for a new record: sets and returns ``rec.decision``, after
        the budget made room for the record's bytes. ``step`` (cache/step.py): its phase and
        number, read only past the two plain cases (``forward`` as in :meth:`for_layer`)."""
        if self._keep_all:
            d = rec.decision = "keep"
            return d
        if self._plain:
            d = rec.decision = self._by_layer.get(rec.layer, "offload")
            return d
        rec.decision = self.for_layer(rec.microbatch, rec.layer, step.phase == "forward")
        b = self._budget
        if b is not None:
            if not b.make_room(rec.nbytes):
                b.overrun(rec.nbytes, step.number, f"saving a {rec.describe()} in layer {rec.layer}")
            if rec.decision == "keep" and not b.may_keep(rec.nbytes, self._room_after(rec.microbatch, rec.layer)):
                rec.decision = "offload"
        return rec.decision

    def _room_after(self, micro_batch: Hashable, layer: Hashable) -> Optional[int]:
        """What the layers after ``layer`` of ``micro_batch`` will need beside what is resident
        when one of its records is kept: tier_costs.need_bytes of those layers under their
        decisions now, with what is saved outside layers kept after them (the head and loss
        stay until backward starts). None until a step measured the layers' bytes. Once per
        micro-batch and layer in a step (decisions change only between steps)."""
        key = (micro_batch, layer)
        if key in self._after:
            return self._after[key]
        b, i = self._budget, self._order.get(layer)
        room = None
        if i is not None and b.layer_bytes:
            later = self._layers[i + 1:]
            sizes = [b.layer_bytes.get(str(k), b.largest_layer_bytes) for k in later] + [self._outside]
            rows = [self.for_layer(micro_batch, k, False) for k in later] + ["keep"]
            room = need_bytes([LayerMeasurement(0.0, s) for s in sizes], rows)
        self._after[key] = room
        return room

    def forward_started(self, micro_batch: Hashable) -> None:
        """A micro-batch's first forward in the step (the planner learns the step's shape)."""
        if self._planner is not None:
            self._planner.shape.forward(micro_batch)

    def backward_started(self, micro_batch: Hashable) -> None:
        if self._planner is not None:
            self._planner.shape.backward(micro_batch)

    def end_step(self, stats: StepStats, submit_s: float, step_number: int,
                 num_micro_batches: int) -> StepStats:
        """The step's budget counters, the training thread's offload cost and the plan in force
        go into its stats; the budget learns each layer's bytes and its one-step recomputes end."""
        n = max(num_micro_batches, 1)
        self._after.clear()
        extra = {"offload_submit_s": submit_s}
        if self._planner is not None:
            extra["plan"] = self._planner.rows()
        if self._budget is not None:
            largest = max((r.bytes // n for r in stats.layers), default=0)
            for r in stats.layers:
                self._budget.learn_layer(r.layer, r.bytes // n, r.decision)
            for layer in self._budget.recomputed_layers():  # a budget recompute lasts one step
                if self._by_layer.get(layer) == "recompute":
                    del self._by_layer[layer]
            extra.update(self._budget.end_step(largest, step_number).as_fields(self._budget.limit))
        return dataclasses.replace(stats, **extra)

    def _learn_late(self, stats: StepStats, order: Sequence[Hashable]) -> None:
        """``late_tail`` from a finished step (its docstring): the layers' late writes."""
        wanted_early = {r.layer for r in stats.layers if r.late_writes}
        late = [i for k, i in self._order.items() if str(k) in wanted_early]
        if late:  # from the first layer wanted before its copy landed to the end
            if self._late_probing:  # the layers given back were late again: try later next time
                self._late_probe = min(2 * self._late_probe, LATE_PROBE_MAX_STEPS)
            self.late_tail = max(self.late_tail, len(order) - min(late))
            self._late_calm = 0
            self._late_probing = False
            return
        self._late_probing = False
        if not self.late_tail:
            return
        self._late_calm += 1
        if self._late_calm >= self._late_probe:  # in time again: give half the tail back
            self.late_tail //= 2
            self._late_calm = 0
            self._late_probing = True

    def learn(self, stats: StepStats, order: Sequence[Hashable], num_micro_batches: int) -> None:
        """The tier placement and the planner learn from a finished step's stats (``order``:
        the layers in forward order)."""
        self._layers = list(order)
        self._order = {k: i for i, k in enumerate(order)}
        self._after.clear()
        self._learn_late(stats, order)
        if self._budget is not None:  # bytes saved outside layers (end_step learned them)
            named = {str(k) for k in order}
            self._outside = sum(v for k, v in self._budget.layer_bytes.items() if k not in named)
        if self._placement is not None:
            self._placement.learn(stats, num_micro_batches)
        if self._planner is not None:
            self._planner.update(stats, order, {r.layer: r for r in stats.layers}, num_micro_batches)
