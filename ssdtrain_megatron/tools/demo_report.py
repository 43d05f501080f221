"""What the demo says about where the time went, chosen from what it measured.

The demo runs offload and keep side by side and measures, per step: the step time, the time
the training thread blocked on IO (``StepStats.io_wait_s`` and ``step_end_wait_s``), the
training thread's CPU time and the whole process's CPU time. Offload's extra step time then
has three measurable causes:

- the drive: the training thread waited for reads, for writes under back-pressure, or at the
  step's end for writes still in flight;
- the hand-over: the training thread itself worked more (pack/unpack hooks, bookkeeping);
- CPU contention: the IO threads' copies took cores the model's compute needed (on a machine
  without a GPU, and few cores, this is what usually shows).

:func:`diagnose` names the drive when the training thread blocked on IO for a good part of
offload's step (whatever keep's time, which is noisier on a loaded machine); else the largest
cause when it explains a good part of the extra time; and says so when none does (machine
noise) or when there is no extra time to explain.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

NOISE_FRACTION = 0.05
"""Extra step time below this fraction of keep's step time is not worth explaining."""
EXPLAINED_FRACTION = 0.3
"""A cause is named only when it accounts for at least this fraction of the extra time."""
DRIVE_FRACTION = 0.2
"""Blocking on IO for this fraction of offload's step time names the drive whatever keep's
step time was: that time was not spent computing (keep's own time is noisier, on a loaded
machine, than a wait the offloader measures)."""


@dataclass(frozen=True)
class StepCosts:
    """Medians per step (seconds) of one side-by-side run, offload minus keep where a difference."""

    keep_s: float
    """keep's step time."""
    offload_s: float
    """offload's step time."""
    io_wait_s: float
    """offload's training thread blocked on IO (``io_wait_s`` plus ``step_end_wait_s``)."""
    handover_s: float
    """offload's training-thread CPU time minus keep's."""
    other_cpu_s: float
    """offload's CPU time on every other thread (the IO threads) minus keep's."""

    @property
    def extra_s(self) -> float:
        return self.offload_s - self.keep_s


def diagnose(c: StepCosts, bandwidth_cap_gbps: Optional[float] = None, cpu_only: bool = True) -> str:
    """One sentence naming what cost offload its time, from the measured ``c``."""
    ms = 1e3
    if c.io_wait_s >= DRIVE_FRACTION * c.offload_s:
        drive = (f"the drive, capped at {bandwidth_cap_gbps:g} GB/s by bandwidth_cap_gbps"
                 if bandwidth_cap_gbps else "the drive")
        return (f"{drive}: the training thread waited on IO {c.io_wait_s * ms:.0f} ms of each "
                f"{c.offload_s * ms:.0f} ms step; a faster drive, one root per drive, or fewer bytes "
                "to move (keep_last_layers, policy adaptive) would help")
    if c.extra_s <= NOISE_FRACTION * c.keep_s:
        return ("offload added no measurable time: the IO hid behind compute"
                + (f" ({c.io_wait_s * ms:.0f} ms of IO wait per step)" if c.io_wait_s > 0 else ""))
    causes = {"drive": c.io_wait_s, "handover": c.handover_s, "cpu": c.other_cpu_s}
    cause = max(causes, key=causes.get)
    if causes[cause] < EXPLAINED_FRACTION * c.extra_s:
        return (f"no single cause explains the extra {c.extra_s * ms:.0f} ms per step (IO wait "
                f"{c.io_wait_s * ms:.0f} ms, training-thread CPU {c.handover_s * ms:+.0f} ms, IO threads' "
                f"CPU {c.other_cpu_s * ms:+.0f} ms): most likely other load on this machine; run "
                "more --steps")
    share = f"{causes[cause] * ms:.0f} ms of the extra {c.extra_s * ms:.0f} ms per step"
    if cause == "drive":
        return (f"the drive: waiting on IO accounts for {share}; a faster drive, one root per "
                "drive, or fewer bytes to move (keep_last_layers, policy adaptive) would help")
    if cause == "handover":
        return (f"the hand-over: the training thread's extra CPU (offload hooks) accounts for {share}; "
                "a larger min_tensor_bytes sends fewer, larger tensors")
    where = ("the IO threads' system calls (the kernel pins every page an O_DIRECT call moves) share "
             "the cores with the model's compute (no GPU here)") if cpu_only \
        else "the IO threads compete with the training thread for cores"
    return f"CPU contention: {where}; their extra CPU accounts for {share}; fewer io_threads or more cores"


def destination(engine: str) -> str:
    """Where an engine puts the activations, in the user's words."""
    return {"memory": "host memory", "tiered": "host memory and SSD"}.get(engine, "SSD")
