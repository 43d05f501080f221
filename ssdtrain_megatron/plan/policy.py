"""Adaptive keep / offload / recompute decisions per layer (pure; no torch, no IO).

Timing model of one micro-batch, from the measurements of a warm-up step:

* Forward runs the layers in order; layer i ends at F_i = f_0 + ... + f_i. Its bytes, if
  offloaded, join one write queue at F_i and drain at the write bandwidth, overlapping the
  forward of later layers and, if need be, the backward.
* Backward starts when the forward ends and runs the layers in reverse, each taking
  ``backward_factor`` x its forward time (plus its forward again when it is recomputed).
* Reads start with the backward, in reverse layer order, each no earlier than its layer's
  write has completed. A layer whose read has not completed when its backward is due stalls
  the step for the difference; that wait is the predicted IO stall.

Reads and writes are modelled as independent queues at the measured read and write bandwidths.
Micro-batches are independent: every byte written for one is read back within its backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

KEEP = "keep"
OFFLOAD = "offload"
RECOMPUTE = "recompute"
DECISIONS = (KEEP, OFFLOAD, RECOMPUTE)

# Relative slack on "no stall" so that float rounding in the timeline never rejects a layer.
_REL_EPS = 1e-9


@dataclass(frozen=True)
class LayerMeasurement:
    """What the warm-up step measured for one layer of one micro-batch."""

    forward_s: float
    """Forward compute time of the layer, seconds."""

    activation_bytes: int
    """Bytes the layer saves for backward (what offloading it writes)."""

    recompute_s: Optional[float] = None
    """Extra backward time when the layer is recomputed; None: ``forward_s``."""

    checkpoint_bytes: int = 0
    """Bytes that stay resident when the layer is recomputed (its input)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.forward_s, (int, float)) and self.forward_s >= 0):
            raise ValueError(f"LayerMeasurement.forward_s={self.forward_s!r} is invalid: expected >= 0")
        if not isinstance(self.activation_bytes, int) or self.activation_bytes < 0:
            raise ValueError(f"LayerMeasurement.activation_bytes={self.activation_bytes!r} is "
                             "invalid: expected an integer >= 0")
        if self.recompute_s is not None and not self.recompute_s >= 0:
            raise ValueError(f"LayerMeasurement.recompute_s={self.recompute_s!r} is invalid: "
                             "expected >= 0 or None")
        if not isinstance(self.checkpoint_bytes, int) or not 0 <= self.checkpoint_bytes:
            raise ValueError(f"LayerMeasurement.checkpoint_bytes={self.checkpoint_bytes!r} is "
                             "invalid: expected an integer >= 0")

    @property
    def recompute_cost_s(self) -> float:
        return self.forward_s if self.recompute_s is None else self.recompute_s


@dataclass(frozen=True)
class LayerPlan:
    """Decisions for the layers of a micro-batch and what they are predicted to cost."""

    decisions: Tuple[str, ...]
    """'keep', 'offload' or 'recompute' per layer, in forward order."""

    io_stall_s: float
    """Predicted time the step waits on reads, all micro-batches together."""

    recompute_s: float
    """Extra compute the step spends recomputing layers, all micro-batches together."""

    resident_bytes: int
    """Activation bytes of one micro-batch that stay in memory: kept layers, plus the
    checkpointed inputs of recomputed layers."""

    offloaded_bytes: int
    """Bytes written (and read back) per step, all micro-batches together."""

    fits_budget: bool
    """False when even offloading or recomputing every allowed layer exceeds the budget."""

    def layers(self, decision: str) -> List[int]:
        """Indices of the layers with the given decision."""
        return [i for i, d in enumerate(self.decisions) if d == decision]


def simulate_micro_batch(layers: Sequence[LayerMeasurement], decisions: Sequence[str],
                         write_bps: float, read_bps: float,
                         backward_factor: float = 2.0) -> Tuple[float, float]:
    """(IO stall seconds, recompute seconds) of one micro-batch under ``decisions``; see the
    module docstring for the timeline."""
    stall, recompute, _ = timeline(layers, decisions, write_bps, read_bps,
                                   backward_factor=backward_factor)
    return stall, recompute


def timeline(layers: Sequence[LayerMeasurement], decisions: Sequence[str], write_bps: float,
             read_bps: float, gap_s: float = 0.0, cpu_s_per_byte: float = 0.0,
             backward_factor: float = 2.0) -> Tuple[float, float, float]:
    """(IO stall, recompute, training-thread offload cost) seconds of one micro-batch: its
    forward (each offloaded layer costing ``cpu_s_per_byte`` per byte to hand over, its write
    queued behind the others), ``gap_s`` of other work, then its backward, reading back in
    reverse order from when the write ended and waiting where the read is late."""
    clock = cpu = 0.0
    write_free = 0.0
    write_done = {}
    for i, layer in enumerate(layers):
        clock += layer.forward_s
        if decisions[i] == OFFLOAD:
            hand_over = layer.activation_bytes * cpu_s_per_byte
            clock += hand_over
            cpu += hand_over
            write_free = max(clock, write_free) + layer.activation_bytes / write_bps
            write_done[i] = write_free
    clock += gap_s
    read_free = clock  # prefetch begins with the backward
    stall = 0.0
    recompute = 0.0
    for i in reversed(range(len(layers))):
        layer = layers[i]
        if decisions[i] == OFFLOAD:
            read_free = max(read_free, write_done[i]) + layer.activation_bytes / read_bps
            if read_free > clock:
                stall += read_free - clock
                clock = read_free
        elif decisions[i] == RECOMPUTE:
            recompute += layer.recompute_cost_s
            clock += layer.recompute_cost_s
        clock += backward_factor * layer.forward_s
    return stall, recompute, cpu


def _resident(layers: Sequence[LayerMeasurement], decisions: Sequence[str]) -> int:
    total = 0
    for layer, decision in zip(layers, decisions):
        if decision == KEEP:
            total += layer.activation_bytes
        elif decision == RECOMPUTE:
            total += layer.checkpoint_bytes
    return total


def _check_bandwidth(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or math.isnan(value):
        raise ValueError(f"{name}={value!r} is invalid: expected bytes/s > 0 (math.inf allowed)")


def plan_layers(layers: Sequence[LayerMeasurement], *, write_bps: float, read_bps: float,
                num_micro_batches: int = 1, keep_last_layers: int = 1,
                recompute_fallback: bool = False, memory_budget_bytes: Optional[int] = None,
                backward_factor: float = 2.0) -> LayerPlan:
    """Decide keep / offload / recompute for each layer of a micro-batch.

    Args:
        layers: measurements of the micro-batch's layers, in forward order.
        write_bps, read_bps: achieved SSD bandwidth, bytes/s.
        num_micro_batches: micro-batches per step (scales the per-step totals).
        keep_last_layers: the last N layers always stay in memory: their backward starts as
            soon as their forward ends, leaving no time for a round trip to the SSD.
        recompute_fallback: a layer that cannot be offloaded without stalling may be
            recomputed instead.
        memory_budget_bytes: resident bytes allowed for one micro-batch's layers. None: as
            little as possible without stalling: offload every layer whose round trip hides
            behind compute, recompute (if allowed) or keep the others. With a budget, keep
            as much as it allows (keeping costs no time) and free the rest by whichever of
            offload or recompute costs the least time per byte freed.
        backward_factor: backward time of a layer as a multiple of its forward time.

    Raises:
        ValueError: a non-positive bandwidth, a negative count or budget.
    """
    _check_plan_args(write_bps, read_bps, num_micro_batches, keep_last_layers,
                     memory_budget_bytes)
    n = len(layers)
    movable = range(max(0, n - keep_last_layers))
    tolerance = _REL_EPS * sum(layer.forward_s for layer in layers) * (1 + backward_factor)

    def cost(decisions: Sequence[str]) -> Tuple[float, float]:
        return simulate_micro_batch(layers, decisions, write_bps, read_bps, backward_factor)

    decisions: List[str] = [KEEP] * n
    fits = True
    if memory_budget_bytes is None:
        _offload_what_hides(decisions, movable, cost, tolerance, recompute_fallback)
    else:
        fits = _free_to_budget(layers, decisions, movable, cost, tolerance, recompute_fallback,
                               memory_budget_bytes)
    stall, recompute = cost(decisions)
    if stall <= tolerance:
        stall = 0.0
    offloaded = sum(layer.activation_bytes for layer, d in zip(layers, decisions) if d == OFFLOAD)
    return LayerPlan(decisions=tuple(decisions), io_stall_s=stall * num_micro_batches,
                     recompute_s=recompute * num_micro_batches,
                     resident_bytes=_resident(layers, decisions),
                     offloaded_bytes=offloaded * num_micro_batches, fits_budget=fits)


def _check_plan_args(write_bps: float, read_bps: float, num_micro_batches: int,
                     keep_last_layers: int, memory_budget_bytes: Optional[int]) -> None:
    _check_bandwidth("write_bps", write_bps)
    _check_bandwidth("read_bps", read_bps)
    for name, value, minimum in (("num_micro_batches", num_micro_batches, 1),
                                 ("keep_last_layers", keep_last_layers, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name}={value!r} is invalid: expected an integer >= {minimum}")
    if memory_budget_bytes is not None and (isinstance(memory_budget_bytes, bool)
                                            or not isinstance(memory_budget_bytes, int)
                                            or memory_budget_bytes < 0):
        raise ValueError(f"memory_budget_bytes={memory_budget_bytes!r} is invalid: "
                         "expected an integer >= 0 or None")


def _offload_what_hides(decisions: List[str], movable: range, cost: Callable, tolerance: float,
                        recompute_fallback: bool) -> None:
    """No budget: offload every movable layer whose round trip hides behind compute."""
    # Earliest layers first: their writes start first and their reads are needed last,
    # so they have the most compute to hide behind.
    for i in movable:
        decisions[i] = OFFLOAD
        if cost(decisions)[0] > tolerance:
            decisions[i] = RECOMPUTE if recompute_fallback else KEEP


def _free_to_budget(layers: Sequence[LayerMeasurement], decisions: List[str], movable: range,
                    cost: Callable, tolerance: float, recompute_fallback: bool,
                    memory_budget_bytes: int) -> bool:
    """A budget: free bytes, cheapest time per byte first, until the resident bytes fit;
    False when no movable layer is left to free and they still do not."""
    return free_cheapest_first(layers, decisions, movable, lambda d: sum(cost(d)), tolerance,
                               recompute_fallback,
                               lambda d: _resident(layers, d) > memory_budget_bytes)


def free_cheapest_first(layers: Sequence[LayerMeasurement], decisions: List[str], movable,
                        cost: Callable[[Sequence[str]], float], tolerance: float,
                        recompute_fallback: bool, too_big: Callable[[Sequence[str]], bool]) -> bool:
    """Greedy, in place: while ``too_big(decisions)``, make the move that adds the least
    ``cost`` per byte freed (an increase within ``tolerance`` counts as none; ties: offload
    first, then the earlier layer): a kept layer offloaded (or, with ``recompute_fallback``,
    recomputed), or a recomputed layer offloaded, which frees the input its recompute keeps.
    Recompute is often the cheaper first move on a slow drive; when no kept layer is left and
    it is still too big, offloading recomputed layers is what makes it fit, so those moves are
    made only where offloading every movable layer would fit (else they would slow the step
    for nothing). False when no move is left and it is still too big."""
    floor = [OFFLOAD if i in set(movable) else d for i, d in enumerate(decisions)]
    reachable = not too_big(floor)
    while too_big(decisions):
        base = cost(decisions)
        best = None
        for i in movable:
            layer = layers[i]
            if decisions[i] == KEEP:
                options = [(OFFLOAD, layer.activation_bytes)]
                if recompute_fallback:
                    options.append((RECOMPUTE, layer.activation_bytes - layer.checkpoint_bytes))
            elif decisions[i] == RECOMPUTE and reachable:
                options = [(OFFLOAD, layer.checkpoint_bytes)]
            else:
                continue
            was = decisions[i]
            for rank, (decision, freed) in enumerate(options):
                if freed <= 0:
                    continue
                decisions[i] = decision
                extra = max(0.0, cost(decisions) - base)
                decisions[i] = was
                key = (0.0 if extra <= tolerance else extra / freed, rank, i)
                if best is None or key < best[0]:
                    best = (key, i, decision)
        if best is None:
            return False
        decisions[best[1]] = best[2]
    return True


def should_replan(measured_io_wait_s: float, step_time_s: float, threshold: float,
                  old_bw: float, new_bw: float, *, bandwidth_change: float = 0.25) -> bool:
    """Whether the adaptive policy should re-plan after a step.

    True when the step waited on IO for more than ``threshold`` of its time, or when the
    measured bandwidth moved by more than ``bandwidth_change`` (relative, either way) from the
    bandwidth the current plan assumed: slower risks stalls, faster leaves memory unsaved.
    """
    if not step_time_s > 0:
        raise ValueError(f"step_time_s={step_time_s!r} is invalid: expected > 0")
    if not old_bw > 0:
        raise ValueError(f"old_bw={old_bw!r} is invalid: expected bytes/s > 0")
    if measured_io_wait_s > threshold * step_time_s:
        return True
    return abs(new_bw - old_bw) > bandwidth_change * old_bw
