"""The activation budget: resident activation bytes never exceed ``activation_budget_bytes``.

"Resident" is the offloader's own account (``StepStats.peak_resident_bytes``): records kept,
saved but not yet written, being written, being read, read back or read ahead. Before a new
record adds its bytes, the offloader asks this object for room; what it can do about a lack of
room, cheapest first:

* write the deferred records (the last layers, otherwise kept for an immediate backward),
* wait for writes in flight to complete (back-pressure): a written record stops counting,
* in backward, read ahead less (prefetch stops where the budget would be crossed; the record
  is read when backward asks for it),
* in forward, with ``recompute_fallback`` (Megatron integration), run a layer under
  recomputation when its bytes (as measured in the last step) would not fit beside what is
  resident and not being written; decided once per micro-batch and layer in a step,
* offload a record the plan wanted kept when keeping it would leave too little room for what the
  micro-batch's later layers need (sized from the plan's order once the layers' bytes are known).

Each of these is counted and lands in StepStats (``budget_*`` fields). When none of them makes
room (the budget is smaller than what one layer's backward needs at once), the first step
raises ``BudgetTooSmall`` with the numbers; a later step counts an overrun and warns once.

This module holds the decisions and the counters; the offloader supplies the operations
(drain, write deferred, wait for one event) as callables, so it knows nothing of records.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional

log = logging.getLogger(__name__)


class BudgetTooSmall(RuntimeError):
    """``activation_budget_bytes`` cannot hold what one layer needs at once; the message has the numbers."""


def resolve_budget(value: Optional[float], device) -> Optional[int]:
    """Bytes of a configured budget: an integer as is, a fraction of the CUDA device's memory.

    Raises:
        ValueError: a fraction on a device that is not CUDA (no device memory to take it of).
    """
    if value is None:
        return None
    if isinstance(value, float) and value <= 1:
        if getattr(device, "type", str(device)) != "cuda":
            raise ValueError(f"OffloadConfig.activation_budget_bytes={value!r} is a fraction of "
                             f"device memory, but the training device is {device}: give a size "
                             "such as 12GiB instead")
        import torch

        total = torch.cuda.get_device_properties(device).total_memory
        return max(1, int(value * total))
    return int(value)


@dataclass
class BudgetCounters:
    """What the budget did in one step (StepStats ``budget_*``)."""

    waits: int = 0
    """Times pack or a demand read waited for writes to make room (back-pressure)."""
    wait_s: float = 0.0
    deferred_written: int = 0
    """Deferred last-layer records written early to make room."""
    readahead_cuts: int = 0
    """Times prefetch stopped short because the budget had no room for the next read."""
    forced_offloads: int = 0
    """Records the plan kept but the budget had no room to keep: written instead."""
    recomputes: int = 0
    """Layers run under recomputation because their bytes would not fit (recompute_fallback)."""
    overruns: int = 0
    """Times nothing could make room and resident bytes crossed the budget (after step 0)."""

    def as_fields(self, budget: int) -> Dict[str, object]:
        return {"budget_bytes": budget, "budget_waits": self.waits, "budget_wait_s": self.wait_s,
                "budget_deferred_written": self.deferred_written,
                "budget_readahead_cuts": self.readahead_cuts,
                "budget_forced_offloads": self.forced_offloads,
                "budget_recomputes": self.recomputes, "budget_overruns": self.overruns}


class ActivationBudget:
    """Room-making for one offloader (training thread only).

    Args:
        limit: the budget in bytes.
        resident: returns the resident bytes now.
        drain: processes every queued IO completion and dropped handle.
        write_deferred: submits every deferred record; returns how many.
        wait_event: waits (until its deadline) for one IO event and processes it; False when
            nothing is in flight or the wait timed out.
        in_flight: returns the bytes of writes in flight.
        pinned: returns the resident bytes that no write will free (kept, read back, being
            read); default: resident minus in flight.
    """

    def __init__(self, limit: int, resident: Callable[[], int], drain: Callable[[], None],
                 write_deferred: Callable[[], int], wait_event: Callable[[], bool],
                 in_flight: Callable[[], int], pinned: Optional[Callable[[], int]] = None) -> None:
        self.limit = limit
        self._resident = resident
        self._drain = drain
        self._write_deferred = write_deferred
        self._wait_event = wait_event
        self._in_flight = in_flight
        self._pinned = pinned or (lambda: resident() - in_flight())
        self.c = BudgetCounters()
        self.largest_layer_bytes = 0
        """Largest bytes one layer of one micro-batch saved in an earlier step (0: not known)."""
        self.layer_bytes: Dict[str, int] = {}
        """Bytes each layer of one micro-batch saved in the last step it was not recomputed."""
        self._recompute: Dict[tuple, bool] = {}  # (micro-batch, layer) -> decided this step
        self._warned = False

    def fits(self, nbytes: int) -> bool:
        return self._resident() + nbytes <= self.limit

    def make_room(self, nbytes: int) -> bool:
        """Try to get ``resident + nbytes <= limit``: drain, write deferred records, then wait
        for writes in flight one completion at a time. True when it fits."""
        if self.fits(nbytes):
            return True
        self._drain()
        if self.fits(nbytes):
            return True
        self.c.deferred_written += self._write_deferred()
        if self.fits(nbytes):
            return True
        t0 = time.perf_counter()
        waited = False
        while not self.fits(nbytes) and self._in_flight():
            waited = True
            if not self._wait_event():
                break
        if waited:
            self.c.waits += 1
            self.c.wait_s += time.perf_counter() - t0
        return self.fits(nbytes)

    def may_keep(self, nbytes: int, room_after: Optional[int] = None) -> bool:
        """Whether a record the plan keeps can stay, else it is written instead (counted).

        ``room_after``: what the micro-batch's later layers will need beside it, from the plan's
        order (``plan.tier_costs.need_bytes`` of the layers after this one and what is saved
        outside layers): with it, the record stays when it fits beside that and what no write
        will free (a write in flight frees its bytes; the budget waits for it when the room is
        wanted). Kept layers late in the forward then leave no room unused, and a layer moved
        after kept ones still finds its own bytes' room. None (its layer or the bytes of later
        ones not known yet): it must leave room for one layer's backward (the largest seen)
        beside everything resident."""
        if room_after is None:
            fits = self._resident() + nbytes + self.largest_layer_bytes <= self.limit
        else:
            fits = self._pinned() + nbytes + room_after <= self.limit
        if fits:
            return True
        self.c.forced_offloads += 1
        return False

    def room_to_read(self, nbytes: int) -> bool:
        """Prefetch: read ahead only within the budget (counted when it stops short)."""
        if self.fits(nbytes):
            return True
        self.c.readahead_cuts += 1
        return False

    def recompute_instead(self, micro_batch, layer) -> bool:
        """Forward, recompute_fallback on: whether a layer the plan offloads must run under
        recomputation because its bytes (to be read back for its backward) would not fit beside
        what no write can free (decided at its first question in the step, counted once)."""
        key = (micro_batch, layer)
        decided = self._recompute.get(key)
        if decided is None:
            need = self.layer_bytes.get(str(layer), 0)
            decided = bool(need) and self._pinned() + need > self.limit
            self._recompute[key] = decided
            self.c.recomputes += decided
        return decided

    def recomputed_layers(self) -> set:
        """Layers this step ran recomputed for the budget (the integration labels them
        'recompute' for the step; the label is the step's only)."""
        return {layer for (_, layer), d in self._recompute.items() if d}

    def overrun(self, nbytes: int, step: int, what: str) -> None:
        """Nothing made room for ``nbytes``. The first step refuses the budget with the numbers;
        a later one counts it and warns once."""
        resident = self._resident()
        msg = (f"activation budget of {_mib(self.limit)} is too small: {what} needs "
               f"{_mib(nbytes)} more while {_mib(resident)} are resident and cannot be freed "
               f"(kept, read back, or needed by the backward now running)"
               + (f"; the largest layer of a micro-batch saves {_mib(self.largest_layer_bytes)}"
                  if self.largest_layer_bytes else "")
               + f". Raise activation_budget_bytes to at least {_mib(resident + nbytes)}.")
        if step == 0:
            raise BudgetTooSmall(msg)
        self.c.overruns += 1
        if not self._warned:
            self._warned = True
            log.warning("ssdtrain: %s (counted in StepStats.budget_overruns)", msg)

    def learn_layer(self, layer: str, nbytes: int, decision: str) -> None:
        """A finished step's bytes of one layer of one micro-batch (recomputed layers' bytes are
        their inputs only: not what the layer needs)."""
        if decision != "recompute":
            self.layer_bytes[layer] = nbytes

    def end_step(self, layer_bytes_per_micro_batch: int, step: int) -> BudgetCounters:
        """The step's counters (reset for the next step); learns the largest layer.

        Raises:
            BudgetTooSmall: after the first step, when the budget is smaller than the largest
                layer of a micro-batch (what a recomputed or kept layer holds at once).
        """
        self.largest_layer_bytes = max(self.largest_layer_bytes, layer_bytes_per_micro_batch)
        self._recompute.clear()
        if step == 0 and self.limit < self.largest_layer_bytes:
            raise BudgetTooSmall(
                f"activation budget of {_mib(self.limit)} is too small: the largest layer of a "
                f"micro-batch saves {_mib(self.largest_layer_bytes)}, and at least one layer must "
                f"fit. Raise activation_budget_bytes to at least {_mib(self.largest_layer_bytes)}.")
        c, self.c = self.c, BudgetCounters()
        return c


def give_back_readahead(mb, records) -> None:
    """Prefetch stopped before ``records`` (candidates it had taken, in reverse save order):
    they are no longer read ahead, and the micro-batch's prefetch cursor goes back to the
    first of them, so a later prefetch (with room again) takes them."""
    if not records:
        return
    for r in records:
        if r.readahead:
            r.readahead = False
            mb.readahead_bytes -= r.nbytes
    mb.cursor = min(mb.cursor, len(mb.records) - 1 - mb.records.index(records[0]))


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
