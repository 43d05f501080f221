"""The budget side of ActivationOffloader: admission, deferred writes and the step's numbers.

A part of :class:`~.offloader.ActivationOffloader` (a base class of it, beside
:class:`~.hooks.SavedTensorHooks` and :class:`~.transfers.RecordIO`, so that no module is longer
than a few hundred lines): what the pack hook and the waits ask of the activation budget
(``cache/budget.py``), and the budget's and the adaptive planner's measurements folded into a
step's stats. All of it runs on the training thread.

Uses the offloader's fields: ``config``, ``_budget``, ``_planner``, ``_microbatches``, ``_c``
(the step's counters), ``_inflight_bytes``, ``_layer_decisions``, ``_submit_s``, ``_step``;
and ``_submit_all`` / ``_next_event`` from :class:`~.transfers.RecordIO`.
"""

from __future__ import annotations

import dataclasses
import time

from ..telemetry.stats import StepStats
from .record import State, TensorRecord
from .transfers import IOTimeout


class BudgetSteps:
    """Mixin: the activation budget's hooks into the offloader (see the module docstring)."""

    def _budget_admit(self, rec: TensorRecord) -> None:
        """Room for a new record; a record the plan keeps is written when keeping it would
        leave too little room for a layer's backward."""
        b = self._budget
        if not b.make_room(rec.nbytes):
            b.overrun(rec.nbytes, self._step, f"saving a {rec.describe()} in layer {rec.layer}")
        if rec.decision == "keep" and not b.may_keep(rec.nbytes):
            rec.decision = "offload"

    def _budget_write_deferred(self) -> int:
        """Write the deferred last-layer records of every micro-batch still in forward."""
        n = 0
        for mb in list(self._microbatches.values()):
            if not mb.in_backward and mb.deferred:
                records = mb.take_all_deferred()
                n += len(records)
                self._submit_all(records)
        return n

    def _budget_pinned(self) -> int:
        """Resident bytes no write will free: not in flight, not deferred (those can be written)."""
        deferred = sum(r.nbytes for mb in self._microbatches.values() for r in mb.deferred
                       if r.state == State.SAVED)
        return self._c.resident_bytes - self._inflight_bytes - deferred

    def _budget_wait_event(self) -> bool:
        if not self._next_event(time.perf_counter() + self.config.io_timeout_s):
            raise IOTimeout(f"waited {self.config.io_timeout_s:g}s for {self._inflight_bytes} bytes "
                            "of writes to finish to stay within activation_budget_bytes")
        return True

    def _budget_step_end(self, stats: StepStats) -> StepStats:
        """The step's budget counters and the training thread's offload cost, into its stats."""
        n = max(len(self._microbatches), 1)
        extra = {"offload_submit_s": self._submit_s}
        if self._planner is not None:
            extra["plan"] = self._planner.rows()
        self._submit_s = 0.0
        if self._budget is not None:
            largest = max((r.bytes // n for r in stats.layers), default=0)
            for r in stats.layers:
                self._budget.learn_layer(r.layer, r.bytes // n, r.decision)
            for layer in self._budget.recomputed_layers():  # a budget recompute lasts one step
                if self._layer_decisions.get(layer) == "recompute":
                    del self._layer_decisions[layer]
            extra.update(self._budget.end_step(largest, self._step).as_fields(self._budget.limit))
        return dataclasses.replace(stats, **extra)
