"""What every part of the offloader shares: the step in progress, and the job's one-time warnings.

The parts (``hooks.py``, ``table.py``, ``transfers.py``, ``decisions.py``) each own their
state; these two small objects are the only state they share, and each part receives them
at construction from ``ActivationOffloader``.
"""

from __future__ import annotations

import logging
from typing import Optional, Set

from ..telemetry.stats import StepCounters

log = logging.getLogger("ssdtrain_megatron.cache.offloader")

PHASES = ("forward", "backward", "step_end")


class Step:
    """The step in progress: its number, its phase and its counters.

    ``phase`` is what the IO trace tags each request with and what tells a layer's forward
    from a recompute's: the hooks set "forward" when a micro-batch's forward starts and
    "backward" when one's backward starts, the offloader "step_end" in ``end_step``.
    ``counters`` is the running step's ``StepCounters``; :meth:`next` replaces it, so a part
    reads ``step.counters`` at each use and never keeps the object across steps.
    """

    __slots__ = ("number", "phase", "counters")

    def __init__(self) -> None:
        self.number = 0
        self.phase = "forward"
        self.counters = StepCounters()

    def enter(self, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"phase={phase!r} is invalid; allowed: {', '.join(PHASES)}")
        self.phase = phase

    def count_wait(self, rec, seconds: float) -> None:
        """The training thread waited ``seconds`` on IO for record ``rec`` (its layer's too)."""
        c = self.counters
        c.io_wait_s += seconds
        c.layer(rec.layer, rec.decision).io_wait_s += seconds

    def next(self, timeline: Optional[list] = None) -> None:
        """The step ended: the next one starts with fresh counters (``timeline``: a list to
        record the resident bytes' changes in, for plots; None: none)."""
        self.number += 1
        self.counters = StepCounters(timeline=timeline)


class WarnOnce:
    """A warning per kind (``key``), once per job: a fault that repeats every step is counted
    in the step's statistics, not logged every time."""

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen: Set[str] = set()

    def __call__(self, key: str, message: str) -> None:
        if key not in self._seen:
            self._seen.add(key)
            log.warning("ssdtrain: %s", message)
