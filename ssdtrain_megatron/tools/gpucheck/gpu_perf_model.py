"""The four-place planner's prediction beside each measured step of `make gpu-perf`, with the
box's own figures from the same run: what ``ssdtrain bench --node-emulation`` predicts on a
CPU node (ssdtrain_megatron/tools/bench/predict.py, reused as it is), here against an H200.

The node the planner sees: the host link (the slower direction measured on the memory engine's
registered memory at the records' sizes), the drive (written and read in the step's pattern),
the host tier (the memory engine's pool). Compute comes from keep's step: each layer's forward
from keep's timeline on the compute stream where it has one per layer (the host's clock
measures launches, not kernels, on a GPU), else from its StepStats; backward from what keep's
step leaves. Each strategy as it runs: offload with memory is the planner's "host" (the pool
first-come, the last layer kept), with posix its "offload" (every layer but the last to the
drive), recompute its "recompute", adaptive the plan it ran in its last step. torch's
save_on_cpu is none of the planner's places (its copies run on the compute stream), so it has
no prediction. The error is predicted over measured, less one, on step time relative to keep's
(as the bench reports it).

Beside it, each engine's activation-peak floor at the box's own figures (:func:`floors`:
gpu_perf_plan.peak_floor with a layer's saved bytes and forward from keep, its backward
BACKWARD_PER_FORWARD of that, and the engine's measured read rate).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Sequence

from .gpu_perf_plan import READAHEAD_CAP, peak_floor
from ssdtrain_megatron.plan.readahead import BACKWARD_PER_FORWARD
from ssdtrain_megatron.tools.bench.predict import adaptive_rows, as_run, measurements, predict

STRATEGY = {"offload-memory": "host", "offload-posix": "offload", "recompute": "recompute",
            "adaptive": "adaptive"}
"""A point of the measure step -> the strategy bench's predict() prices."""


@dataclasses.dataclass(frozen=True)
class BoxNode:
    """The box as predict() reads a node (tools/bench/node.py's NodeEmulation has the same)."""

    link_gbps: float
    write_gbps: float
    read_gbps: float
    host_bytes: int

    def drive_gbps(self):
        return self.write_gbps, self.read_gbps


def with_gpu_forward(stats, events: Optional[Sequence[dict]]):
    """``stats`` with each layer's forward time from the compute stream's "forward layer <k>"
    spans of its timeline (summed over micro-batches), where every layer has one; else as is."""
    if not events:
        return stats
    spans: Dict[str, float] = {}
    for e in events:
        if e["pid"] == "gpu" and e["cat"] == "layer" and e.get("ph") == "X" and e["name"].startswith("forward layer "):
            key = e["name"][len("forward layer "):]
            spans[key] = spans.get(key, 0.0) + e["dur"] / 1e6
    rows = [r for r in stats.layers if r.layer != "None"]
    if not rows or any(r.layer not in spans for r in rows):
        return stats
    layers = tuple(dataclasses.replace(r, forward_s=spans[r.layer]) if r.layer in spans else r for r in stats.layers)
    return dataclasses.replace(stats, layers=layers)


def floors(stats, events: Optional[Sequence[dict]], rates: Dict[str, Optional[dict]]) -> Dict[str, dict]:
    """Each engine's activation-peak floor (gpu_perf_plan.peak_floor) from keep's ``stats`` and
    timeline ``events``: a layer's saved bytes (LayerStats.bytes, the layers' mean), its
    backward BACKWARD_PER_FORWARD times its forward on the compute stream (the host's where the
    timeline has no layer spans), and the engine's measured read rate (memory: the link's H2D;
    posix: the drive's reads). Empty without keep's layers; an engine without its rate is left
    out."""
    if stats is None:
        return {}
    rows = [r for r in with_gpu_forward(stats, events).layers if r.layer != "None"]
    if not rows:
        return {}
    layer_bytes = sum(r.bytes for r in rows) / len(rows)
    backward_s = BACKWARD_PER_FORWARD * sum(r.forward_s for r in rows) / len(rows)
    read = {"memory": (rates.get("link") or {}).get("h2d"), "posix": (rates.get("drive") or {}).get("read")}
    return {engine: peak_floor(len(rows), layer_bytes, bps, backward_s, READAHEAD_CAP[engine])
            for engine, bps in read.items() if bps}


def predictions(measure, k: int, host_bytes: int, adaptive_budget: Optional[int]) -> dict:
    """Per point at micro-batch ``k``: predicted and measured seconds and the error (module
    docstring); ``node`` the figures used; ``why`` where nothing could be predicted;
    ``floors`` each engine's activation-peak floor (:func:`floors`)."""
    points = {p["name"]: p for p in measure.result["points"] if p.get("ok")}
    keep, keep_stats = points.get(f"keep@{k}"), measure.stats.get(f"keep@{k}")
    link, drive = measure.rates.get("link"), measure.rates.get("drive")
    tl = measure.timelines.get(f"keep@{k}")
    floor = floors(keep_stats, tl.events if tl is not None else None, measure.rates)
    if keep is None or keep_stats is None or not link or not drive:
        return {"why": "keep, its stats, or the link's or the drive's rates were not measured", "floors": floor}
    node = BoxNode(min(link["d2h"], link["h2d"]) / 1e9, drive["write"] / 1e9, drive["read"] / 1e9, host_bytes)
    stats = with_gpu_forward(keep_stats, tl.events if tl is not None else None)
    plans = {}
    adaptive = measure.stats.get(f"adaptive@{k}")
    if adaptive is not None:
        _, _, names = measurements(stats, 1)
        rows = adaptive_rows(adaptive, names, 1)
        if rows is not None:
            plans["adaptive"] = as_run(rows, adaptive, names)
    ratios = predict(node, stats, keep["step_s"], 1, plans, adaptive_budget, measure.stats.get(f"recompute@{k}"))
    out: Dict[str, object] = {"node": dataclasses.asdict(node), "forward_from": "timeline" if stats is not keep_stats
                              else "stats", "points": {}, "floors": floor}
    for name, p in points.items():
        strategy = STRATEGY.get(name.split("@")[0])
        if p["micro_batch"] != k or strategy not in ratios:  # keep: its ratio is 1 by construction
            continue
        predicted = ratios[strategy] * keep["step_s"]
        out["points"][name] = {"predicted_s": predicted, "measured_s": p["step_s"],
                               "error": predicted / p["step_s"] - 1}
    return out
