"""The adaptive policy's loop: measure a step, plan per micro-batch position and layer, re-plan
when the measurements move.

The decision itself is the pure ``plan.step_plan.plan_step``; this module turns a step's
measurements (per-layer forward time and bytes, achieved bandwidth, the training thread's
offload cost, how the micro-batches interleaved) into its inputs, and answers the offloader's
"what for this layer of this micro-batch" from its output.

Without a budget (``activation_budget_bytes`` or the per-micro-batch ``memory_budget_bytes``)
everything is kept from the first step: keeping costs no device memory the user asked to save,
and no time to move. With one, the first step offloads everything (within the budget, which the
runtime guarantees) to measure the drive; the model's plan from it is then only the prior:
measured selection (plan/explore.py) tries neighbouring plans within the budget, the whole-plan
ones (all recompute, all keep, all offload) among them, keeps what measured faster and settles.
Every plan tried passes the model's budget check (plan/step_plan.py ``fits``), and the runtime's
budget (cache/budget.py) holds whatever the plan says.

With the tiered engine the places are four: keep, host, ssd and recompute, priced per tier from
each tier's measured bandwidth and within host memory as well (cache/four_places.py); the
first step offloads to the engine's default place (host memory while it has room, SSD beyond),
which measures both tiers when a step's bytes outgrow host memory. Host memory is never
exceeded at run time either: a tensor placed on 'host' that does not fit goes to SSD.
"""

from __future__ import annotations

import logging
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

from ..config import OffloadConfig
from ..plan.policy import KEEP, OFFLOAD, LayerMeasurement, should_replan
from ..plan.explore import PRIOR, Bounds, MeasuredSelection
from ..plan.step_plan import Decisions, Position, StepPlan, candidates, format_plan, plan_step
from ..telemetry.stats import StepStats
from .four_places import FourPlaces

log = logging.getLogger(__name__)

CHECKPOINT_FRACTION = 16
"""Until a layer has run recomputed (and its checkpointed inputs were measured), they are
assumed to be 1/16 of its saved bytes (a transformer layer saves ~16-34x its input)."""


class StepShape:
    """How the micro-batches of one step interleave: each one's position (forward order), how
    many other forwards ran between its forward and its backward, and how many micro-batches
    held activations when its backward began."""

    def __init__(self) -> None:
        self.position: Dict[Hashable, int] = {}
        self._between: Dict[Hashable, int] = {}
        self._live: Dict[Hashable, int] = {}

    def forward(self, key: Hashable) -> None:
        if key in self.position:
            return
        for other in self.position:
            if other not in self._live:
                self._between[other] += 1
        self.position[key] = len(self.position)
        self._between[key] = 0

    def backward(self, key: Hashable) -> None:
        if key in self.position and key not in self._live:
            self._live[key] = len(self.position) - len(self._live)

    def take(self, forward_s_per_micro_batch: float) -> List[Position]:
        """The step's positions (its forward time prices the gaps); resets for the next step."""
        out = [Position(gap_s=self._between[k] * forward_s_per_micro_batch, live=self._live.get(k, 1))
               for k in sorted(self.position, key=self.position.get)]
        self.__init__()
        return out


class AdaptivePlanner:
    def __init__(self, config: OffloadConfig, budget_bytes: Optional[int]) -> None:
        self.config = config
        self.budget_bytes = budget_bytes
        self.shape = StepShape()
        self.plan: Optional[StepPlan] = None
        self.replans = 0
        self._decisions: Dict[Tuple[int, Hashable], str] = {}
        self._bytes: Dict[str, int] = {}  # layer -> bytes of one micro-batch when not recomputed
        self._checkpoint: Dict[str, int] = {}  # layer -> bytes kept when recomputed
        self._recompute: Dict[str, float] = {}  # layer -> seconds of one recompute pass, measured
        self._bw: Optional[Tuple[float, float]] = None  # (write, read) bytes/s last measured
        self._plan_write_bps = 0.0
        self._cpu_s_per_byte = 0.0
        self._inputs: Optional[tuple] = None  # (order, layers, positions, budget, reserve, w, r)
        self._prior_replans = 0  # model re-plans while the prior is measured (at most one)
        # With both tiers (tiered): keep, host, ssd or recompute (four_places.py).
        self._four: Optional[FourPlaces] = FourPlaces(config) if config.engine == "tiered" else None
        bounds = Bounds(config.adaptive_trial_steps, config.adaptive_explore_steps,
                        config.adaptive_min_gain, config.adaptive_drift)
        self.selection: Optional[MeasuredSelection] = (
            MeasuredSelection(bounds, self._candidates) if config.adaptive_explore_steps > 0 else None)

    @property
    def has_budget(self) -> bool:
        return self.budget_bytes is not None or self.config.memory_budget_bytes is not None

    def decision(self, micro_batch: Hashable, layer: Hashable) -> str:
        """The plan's decision for ``layer`` of ``micro_batch`` (before a plan: keep without a
        budget, offload with one; positions past the plan's take its last one)."""
        if self.plan is None:
            return OFFLOAD if self.has_budget else KEEP
        pos = min(self.shape.position.get(micro_batch, 0), len(self.plan.decisions) - 1)
        return self._decisions.get((pos, layer), OFFLOAD if self.has_budget else KEEP)

    def rows(self) -> Tuple[Tuple[int, str, str], ...]:
        """The plan in force, for StepStats.plan."""
        return tuple((p, str(k), d) for (p, k), d in sorted(self._decisions.items(), key=lambda kv: kv[0][0]))

    def update(self, stats: StepStats, order: Sequence[Hashable], layer_rows: Dict[str, object],
               num_micro_batches: int) -> bool:
        """Re-plan from a finished step when needed; True when the plan changed."""
        n = max(num_micro_batches, 1)
        layers = self.measure(stats, order, layer_rows, n)
        positions = self.shape.take(sum(m.forward_s for m in layers))
        if not order or not positions:
            return False
        if not self.has_budget:
            if self.plan is None:
                self._apply(order, plan_step(layers, positions, write_bps=1.0, read_bps=1.0,
                                             budget_bytes=None), 1.0, 1.0)
            return False
        if self._bw is None or (self._four is not None and not self._four.measured):
            return False  # nothing went through the drive yet
        write_bps, read_bps = self._bw
        budget, reserve = self._budget_and_reserve(order, layers, layer_rows, n)
        self._inputs = (list(order), layers, positions, budget, reserve, write_bps, read_bps)
        if self._wants_model_plan(stats, positions, write_bps):
            if self._four is not None:
                plan = self._four.plan(layers, positions, budget, reserve, self._cpu_s_per_byte)
            else:
                plan = plan_step(layers, positions, write_bps=write_bps, read_bps=read_bps, budget_bytes=budget,
                                 reserve_bytes=reserve, cpu_s_per_byte=self._cpu_s_per_byte,
                                 recompute_fallback=self.config.recompute_fallback,
                                 keep_last_layers=self.config.keep_last_layers)
            changed = self._apply(order, plan, write_bps, read_bps)
            if self.selection is not None:
                self.selection.steps += 1  # a step, though not one measured selection judges
                if self.selection.phase != PRIOR or self.selection.current is None:
                    self._prior_replans = 0
                    log.info("ssdtrain adaptive: measuring plans: %s", self.selection.bounds.describe())
                else:
                    self._prior_replans += 1
                self.selection.start("model's plan", plan.decisions)
            return changed
        if self.selection is None:
            return False
        was_settled = self.selection.settled
        nxt = self.selection.observe(stats.step_time_s)
        if self.selection.settled and not was_settled:
            log.info("ssdtrain adaptive: settled plan:\n%s", format_plan(
                StepPlan(nxt, 0.0, (), None, True), [str(k) for k in order]))
        return self._run(order, nxt)

    def _wants_model_plan(self, stats: StepStats, positions: List[Position], write_bps: float) -> bool:
        """A (new) model plan: the first, the step's shape changed, or (while no measurements
        decide, or while the prior is measured, once) the model's own re-plan triggers fire."""
        if self.plan is None or len(positions) != len(self.plan.decisions):
            return True
        if self.selection is not None and (self.selection.phase != PRIOR or self._prior_replans >= 1):
            return False
        return bool(stats.budget_overruns) or should_replan(
            stats.io_wait_s + stats.budget_wait_s, max(stats.iteration_time_s or stats.step_time_s, 1e-9),
            self.config.replan_io_wait_fraction, self._plan_write_bps, write_bps)

    def _candidates(self, current: Decisions) -> List[Tuple[str, Decisions]]:
        """Plans to measure next to ``current``, each within the budget (MeasuredSelection asks)."""
        order, layers, positions, budget, reserve, write_bps, read_bps = self._inputs
        if self._four is not None:
            return self._four.candidates(current, layers, positions, budget, reserve, self._cpu_s_per_byte,
                                         [str(k) for k in order])
        return candidates(current, layers, positions, write_bps=write_bps, read_bps=read_bps,
                          budget_bytes=budget, reserve_bytes=reserve, cpu_s_per_byte=self._cpu_s_per_byte,
                          recompute_fallback=self.config.recompute_fallback,
                          keep_last_layers=self.config.keep_last_layers, names=[str(k) for k in order])

    def _run(self, order: Sequence[Hashable], decisions: Decisions) -> bool:
        """Run ``decisions`` from the next step on; True when they differ from the last step's."""
        new = {(p, k): d for p, row in enumerate(decisions) for k, d in zip(order, row)}
        changed = new != self._decisions
        self._decisions = new
        return changed

    def measure(self, stats: StepStats, order, layer_rows, n: int) -> List[LayerMeasurement]:
        """One micro-batch's layers in ``order`` as the planner prices them, from a finished
        step (``layer_rows``: its StepStats.layers by name; ``n`` micro-batches): bytes and
        forward time, a recomputed layer's input and recompute pass as last measured (kept
        across steps that did not recompute it); the tiers' and drive's rates are taken too."""
        if self._four is not None:
            self._four.measure(stats)
        if stats.write_gbps > 0:
            write = stats.write_gbps * 1e9
            self._bw = (write, stats.read_gbps * 1e9 if stats.read_gbps > 0 else write)
        if stats.bytes_offloaded and stats.offload_submit_s:
            self._cpu_s_per_byte = stats.offload_submit_s / stats.bytes_offloaded
        layers = []
        for key in order:
            row = layer_rows.get(str(key))
            if row is not None and row.decision == "recompute":
                self._checkpoint[str(key)] = row.bytes // n
            elif row is not None:
                self._bytes[str(key)] = row.bytes // n
            if row is not None and row.recomputes:
                self._recompute[str(key)] = row.recompute_pass_s
            nbytes = self._bytes.get(str(key), 0)
            layers.append(LayerMeasurement(
                forward_s=row.forward_s / n if row else 0.0, activation_bytes=nbytes,
                recompute_s=self._recompute.get(str(key)),
                checkpoint_bytes=min(nbytes, self._checkpoint.get(str(key), nbytes // CHECKPOINT_FRACTION))))
        return layers

    def _budget_and_reserve(self, order, layers, layer_rows, n: int) -> Tuple[Optional[int], int]:
        """Without activation_budget_bytes, memory_budget_bytes is one micro-batch's kept bytes.
        With it, the reserve is what stays resident beside the kept layers: tensors saved
        outside layers (embedding, head, loss) and, for the three-place model, one layer
        (being saved and written in forward, read back in backward; the runtime waits for
        writes beyond that). The four-place model sizes that room from the plan's own order
        (plan.tier_costs.need_bytes), as the runtime's budget does (cache/budget.py)."""
        if self.budget_bytes is None:
            return self.config.memory_budget_bytes, 0
        outside = sum(r.bytes for k, r in layer_rows.items() if k not in {str(x) for x in order}) // n
        largest = max((m.activation_bytes for m in layers), default=0)
        budget = self.budget_bytes
        if self.config.memory_budget_bytes is not None:
            budget = min(budget, self.config.memory_budget_bytes)
        return budget, outside + (0 if self._four is not None else largest)

    def _apply(self, order: Sequence[Hashable], plan: StepPlan, write_bps: float, read_bps: float) -> bool:
        new = {(p, k): d for p, row in enumerate(plan.decisions) for k, d in zip(order, row)}
        changed = new != self._decisions
        first = self.plan is None
        self.plan, self._decisions, self._plan_write_bps = plan, new, write_bps
        self.replans += 1
        if first or changed:
            budget = "no budget: keep everything" if plan.allowance_bytes is None else (
                f"kept bytes per live micro-batch <= {plan.allowance_bytes / 2**20:.1f} MiB, "
                f"write {write_bps / 1e9:.2f} GB/s, read {read_bps / 1e9:.2f} GB/s, predicted "
                f"extra {plan.extra_s * 1e3:.1f} ms per step"
                + ("" if self._four is None else f"; {self._four.describe()}")
                + ("" if plan.fits_budget else "; DOES NOT FIT the budget"))
            level = logging.INFO if first else logging.DEBUG
            log.log(level, "ssdtrain adaptive plan #%d (%s):\n%s", self.replans, budget,
                    format_plan(plan, [str(k) for k in order]))
        return changed
