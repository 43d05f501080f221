"""How a point of the measure step runs its steps (gpu_check_measure.py), and how the
last timed one is recorded as a timeline (ssdtrain_megatron/telemetry/timeline.py).

A strategy is either an offloader installed into megatron-core for the step (keep, offload,
adaptive, recompute: ``installed_step``), or torch's own
``torch.autograd.graph.save_on_cpu(pin_memory=True)`` around a plain step: what a user tries
first (every saved tensor copied to pinned host memory on the compute stream as autograd saves
it, and back when backward unpacks it).

The timeline: the offloader's own events (``ActivationOffloader.record_timeline``, where the
offloader has it) and what only the step's caller knows: the whole step (a host span and a span
on the compute stream, category "step") and the optimizer (category "phase", name
"optimizer", from the optimizer's step hooks). Started after a device synchronisation,
stopped after another, so GPU and host times share one origin; written as a Chrome trace
capped at 2 MB per point.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch

from ssdtrain_megatron.telemetry.timeline import Timeline
from ssdtrain_megatron.tools.minigpt import installed_step, timed

TRACE_MAX_BYTES = 2 << 20
SAVE_ON_CPU = "save_on_cpu"


class Runner:
    """One strategy's steps on ``model``: through ``off`` (installed for each step), or, with
    ``off`` None, under torch's save_on_cpu (module docstring)."""

    def __init__(self, model: Any, off: Any = None) -> None:
        self.model, self.off = model, off

    def step(self) -> float:
        """One training step; its seconds (the step ends with the loss read back: synchronised)."""
        if self.off is not None:
            return installed_step(self.model, self.off)[1]
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            return timed(self.model.step)[1]

    @property
    def stats(self) -> Optional[Any]:
        return self.off.last_step_stats if self.off is not None else None


def record_step(box: Any, runner: Runner, streams: Any, device: torch.device,
                meta: Optional[dict] = None) -> tuple:
    """One step of ``runner`` recorded (module docstring): (seconds, the stopped Timeline).
    ``streams``: the offloader's StreamOps where the box gave it one (None: CUDA's own)."""
    ops = box.timing_ops(streams)
    tl = Timeline(ops, device)
    tl.meta.update(meta or {})
    sync: Callable[[], None] = lambda: box.synchronize(device)  # noqa: E731
    wire = getattr(runner.off, "record_timeline", None)
    hooks = _optimizer_marks(runner.model.optimizer, tl, ops, device)
    if wire is not None:
        wire(tl)
    try:
        tl.start(sync)
        t0 = tl.now()
        token = tl.gpu_begin(ops.current_stream(device), "compute", "step", "step")
        seconds = runner.step()
        tl.gpu_end(ops.current_stream(device), token)
        tl.span("step", "step", t0)
        tl.stop(sync)
    finally:
        # After an error: no synchronisation, and no times asked of events that have not run
        # (Timeline.abandon), so the step's own exception is what propagates; a no-op after stop(sync).
        tl.abandon()
        if wire is not None:
            wire(None)
        for h in hooks:
            h.remove()
    tl.meta["offloader_events"] = wire is not None
    return seconds, tl


def _optimizer_marks(optimizer: torch.optim.Optimizer, tl: Timeline, ops: Any, device: torch.device) -> List[Any]:
    """The optimizer's step as a host span and a compute-stream span (category "phase")."""
    cell: dict = {}

    def pre(opt, args, kwargs) -> None:
        cell["t0"] = tl.now()
        cell["token"] = tl.gpu_begin(ops.current_stream(device), "compute", "optimizer", "phase")

    def post(opt, args, kwargs) -> None:
        tl.gpu_end(ops.current_stream(device), cell.pop("token", None))
        if "t0" in cell:
            tl.span("optimizer", "phase", cell.pop("t0"))

    return [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]

