"""Offload that does not happen says why: the check behind ``StepStats.not_offloaded_why``.

The complaint users file most against activation offloaders is the silent one: offloading is
on, the job trains, and nothing is written, because every saved tensor was on another device,
below ``min_tensor_bytes``, or saved where the offloader's scopes do not reach. The pack hook
counts each tensor it leaves to autograd by reason (``StepCounters.pass_through``); at every
step's end :class:`OffloadWatch` looks at those counts and, when offloading is on and

* a step after the first offloaded nothing (no tensor written, kept or falling back), or
* a layer whose decision is ``offload`` recorded no tensor while some of its saves passed
  through, or
* layers of a class that never enters a layer scope (integrations name them, see
  ``expect_layers``) saved tensors outside any scope,

says which reason dominated and what to change, in ``StepStats.not_offloaded_why`` (the step
summary, the JSONL, ``ssdtrain report``) and in one warning per job. The first step is
exempt: a warm-up may legitimately save nothing.
"""

from __future__ import annotations

import logging
from typing import Dict, Hashable, List, Optional, Tuple

import torch

from ..telemetry.stats import StepCounters, StepStats
from .decisions import OFFLOADS

log = logging.getLogger(__name__)


def reason_text(reason: str, detail: str, device: torch.device, min_bytes: int) -> str:
    """What ``reason`` means for the user, and what to change."""
    if reason == "device":
        return (f"saved tensors are on {detail or 'another device'}, the offloader's device is "
                f"{device}: run the model on {device}, or create the offloader on the device "
                f"the model runs on")
    return {
        "small": f"every saved tensor is below min_tensor_bytes={min_bytes}: lower "
                 f"--ssd-offload-min-tensor-bytes (min_tensor_bytes)",
        "recompute": "tensors re-created by the recompute pass of checkpointing stay in memory by "
                     "design: only what the forward itself saves can be offloaded (recompute "
                     "fewer layers, or none, to offload more)",
        "parameter": "saved tensors are parameters or views of them, never offloaded: the "
                     "activations were saved outside the offloader's hooks",
        "subclass": "saved tensors are tensor subclasses (DTensor, Float8, ...), which are not "
                    "offloaded: save plain tensors (e.g. run the layers without the subclass)",
        "layout": "saved tensors are sparse or otherwise not strided, which are not offloaded",
        "held_by_schedule": "something else holds these tensors until backward (the pipeline "
                            "schedule, the caller's batch): writing them would free nothing",
        "cuda_graph_capture": "tensors saved during CUDA-graph capture stay in (graph) memory: "
                              "run the offloaded layers outside captured graphs",
        "discarded_graph": "tensors saved inside a checkpoint's no-grad forward belong to a "
                           "graph that is dropped before backward: writing them would free "
                           "nothing (checkpoint fewer layers, or none, to offload more)",
    }.get(reason, f"reason {reason!r}")


class OffloadWatch:
    """Per-job state of the check (module docstring): the one warning and the layers to expect.

    Args:
        device: the offloader's device.
        min_bytes: its min_tensor_bytes (named in the fix).
        offloading: whether it offloads at all (policy keep: nothing to check).
    """

    def __init__(self, device: torch.device, min_bytes: int, offloading: bool) -> None:
        self.device = device
        self.min_bytes = min_bytes
        self.offloading = offloading
        self.warned: Optional[str] = None
        """The warning logged (once per job), or None."""
        self.unscoped: Dict[str, str] = {}
        """Layer (str of its key) -> class name, for layers that never enter a layer scope."""

    def expect_layers(self, unscoped: Dict[Hashable, str]) -> None:
        """An integration names layers whose class it could not scope (their forward does not
        run through the patched one): their saves land outside any layer scope."""
        self.unscoped.update({str(k): v for k, v in unscoped.items()})

    def check(self, stats: StepStats, counters: StepCounters) -> str:
        """The step's ``not_offloaded_why`` ('' when it offloaded as asked); warns once."""
        why = self.explain(stats, counters) if self.offloading and stats.step > 0 else ""
        if why and self.warned is None:
            self.warned = why
            log.warning("ssdtrain: %s", why)
        return why

    def explain(self, stats: StepStats, counters: StepCounters) -> str:
        by_reason = stats.passed_through_by_reason
        if not (stats.tensors_offloaded or stats.tensors_kept or stats.fallbacks):
            if not by_reason:
                if stats.bytes_deduplicated:
                    return ""
                return (f"step {stats.step + 1} offloaded nothing: no tensor was saved inside "
                        "offloader.microbatch() (the forward ran outside the offloader's hooks; "
                        "with Megatron, `ssdtrain doctor` checks the patches)")
            reason, n = _dominant(by_reason)
            return (f"step {stats.step + 1} offloaded nothing: {n} of "
                    f"{stats.tensors_passed_through} saved tensors passed through because "
                    f"{self._text(reason, counters)}")
        unscoped = self._unscoped_layers(stats)
        if unscoped:
            return unscoped
        for row in stats.layers:
            if row.decision not in OFFLOADS or row.tensors:
                continue
            mine = {r: n for (layer, r), n in counters.passed.items() if str(layer) == row.layer}
            if mine:
                reason, n = _dominant(mine)
                return (f"layer {row.layer} (decision {row.decision}) moved no bytes in step "
                        f"{stats.step + 1}: {n} of its {sum(mine.values())} saved tensors passed "
                        f"through because {self._text(reason, counters)}")
        return ""

    def _unscoped_layers(self, stats: StepStats) -> str:
        rows = {row.layer: row for row in stats.layers}
        outside = rows.get("None")
        missing: List[Tuple[str, str]] = [(k, c) for k, c in self.unscoped.items() if k not in rows]
        if not missing or outside is None or not outside.tensors:
            return ""
        classes = sorted({c for _, c in missing})
        return (f"layers {', '.join(k for k, _ in missing)} of class {', '.join(classes)} run "
                f"outside any layer scope (their forward does not run through the patched "
                f"TransformerLayer.forward): {outside.tensors} tensors were recorded under layer "
                f"None, where no layer's plan (keep_last_layers, recompute, budget) applies; "
                f"make the class call TransformerLayer.forward, or report it to ssdtrain")

    def _text(self, reason: str, counters: StepCounters) -> str:
        return reason_text(reason, counters.pass_detail.get(reason, ""), self.device, self.min_bytes)


def _dominant(counts: Dict[str, int]) -> Tuple[str, int]:
    reason = max(sorted(counts), key=lambda r: counts[r])
    return reason, counts[reason]
