"""The time plan of `make gpu-perf` (gpu_perf.py): its steps and limits, its two shapes
and their strategies, and each point's estimate at gpu_check_plan.py's conservative rates. No
torch here: the dry run prints anywhere (`GPU_CHECK_DRY=1 make gpu-perf`).

One measure step runs both shapes, one after the other, in one process: a second process
would cost a second start (20 s at the plan's rates) that 198 s cannot spare. Each shape gets
a share of the step's time in proportion to its estimate, so a slow first shape leaves the
second its share.

The two shapes, and why:

- **io-bound**: gpu-check's measure shape, 8 layers, hidden 2048, seq 1024, micro-batch 2,
  megatron-core's local spec. Its unfused attention saves the softmax and the probabilities
  (b x heads x seq^2), so a layer does about 2,200 FLOP per saved byte: at an H200's ~500
  TFLOP/s and a ~50 GB/s link, a layer's bytes take about 4.6x its compute to cross.
- **compute-bound**: the SSDTrain paper's regime, where a layer's forward and backward take
  longer than its saved bytes over the link (>= 10,000 FLOP per byte at 500 TFLOP/s and 50
  GB/s). Core attention on SDPA (gpu_check_sdpa.py: it saves what fused attention
  saves), so a layer does 72 b s h^2 (1 + s/6h) FLOP over 34 b s h bytes, about 2.1 h FLOP
  per byte whatever the sequence. Hidden 6144 (48 heads of 128): about 13,100 FLOP per byte,
  compute 1.3x the link at 500 TFLOP/s and still above it at 600. 16 layers, so that the
  activation-peak target (0.35x keep's) sits above the shape's floor with margin: the kept
  last layer and the read-ahead window (3 layers: a layer's read is a little longer than its
  backward at these rates) are 4 of 16, a floor of 0.25 (:func:`peak_floor`; 6 layers had
  0.67). Seq 256 pays for them: a layer's FLOP and bytes both scale with the sequence, so the
  ratio and the floor stay while the time does not grow. Not hidden 8192: 16 layers of it
  would not fit an H100's 80 GB. Micro-batch 1: 7.35 B parameters, 59 GB of bf16 weights,
  gradients and Adam state and 0.9 GB of activations, inside an H100's 80 GB; torch's
  save_on_cpu copies the weights too (the linear layers save them for backward), 14.7 GB each
  way a step, the largest part of the plan.

Both shapes run every strategy a user has: keep; offload with the memory and the posix
engine; torch's ``save_on_cpu(pin_memory=True)``; Megatron's full recompute; adaptive on the
memory engine in half of keep's activations (recompute where it must).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

from .gpu_check_plan import (ASSUME, ASSUMED_CARD, CARDS, MEASURE_INFLIGHT, activation_bytes, card_check, parameters,
                             point_plan, points_estimate, print_steps)

STEPS = [
    ("install", 29, (), "pip install --no-index the bundle (.whl) into <out>/prefix"),
    ("perf", 164, ("install",), "both shapes, every strategy: bounds, timelines, breakdowns, the model"),
]
TOTAL_S = 198  # the whole run, set-up included (the models' build came into the estimate, and the
# compute-bound shape moved into SSDTrain's regime, gpu_perf_regime.py, and the raw drive rate: 180 -> 198)
PARENT_S = 5

SHAPES: Dict[str, dict] = {
    "io-bound": dict(layers=8, hidden=2048, heads=16, seq=1024, vocab=8192, micro_batch=2, num_microbatches=1,
                     attention="local"),
    "compute-bound": dict(layers=6, hidden=10240, heads=80, seq=512, vocab=8192, micro_batch=1, num_microbatches=1,
                          attention="sdpa"),
}
"""The shapes in the order the step runs them."""
STRATEGIES = (("keep", None), ("offload-memory", "memory"), ("offload-posix", "posix"), ("save_on_cpu", None),
              ("recompute", None), ("adaptive", "memory"))
"""(point, engine) in the order the step runs them (gpu_perf_step.py)."""
NOMINAL = {"flops": 500e12, "link_bps": 50e9, "drive_bps": 2e9}
"""An H100's or H200's rates in practice, for the shapes' ratio and their peak floors (the
time estimates use ASSUME's, lower)."""

PEAK_MAX = {"io-bound": 0.7, "compute-bound": 0.8}
"""The activation-peak targets, offload over keep (ssdtrain_megatron/tools/gpucheck/gpu_perf_targets.py judges them):
each above its shape's floor (:func:`peak_floor`) with margin. IO-bound: reads are far slower
than backward, so the read-ahead window is the byte cap's (1 GiB, about 3.5 of its 8 layers of
310 MB): a floor of about 0.56 (the first GPU run measured 0.59-0.63), and 0.7 leaves the
offloader 0.14 above it. Compute-bound: 16 layers so that the kept one and three read ahead
are a quarter of them, 0.1 under 0.35."""
KEEP_LAST_LAYERS, PREFETCH_LAYERS = 1, 2
"""OffloadConfig's keep_last_layers and prefetch_layers defaults (config.py), which every
point runs with; this module imports nothing of the package (the parent's bare python runs
it): tests/test_gpu_perf.py checks that they agree."""
READAHEAD_CAP = {"memory": 1 << 30, "posix": MEASURE_INFLIGHT}
"""The read-ahead byte cap (max_inflight_bytes) of each engine's points: the memory engine's
default, posix's the measure step's."""
BACKWARD_SHARE = 2 / 3
"""A layer's backward of its forward and backward: plan/readahead.py's BACKWARD_PER_FORWARD = 2."""


def flop_per_saved_byte(shape: dict) -> float:
    """A layer's forward and backward FLOP (72 b s h^2 (1 + s / 6h)) over the bytes it saves."""
    b, s, h = shape["micro_batch"], shape["seq"], shape["hidden"]
    return 72 * b * s * h * h * (1 + s / (6 * h)) * shape["layers"] / activation_bytes(shape)


def layer_flop(shape: dict) -> float:
    """One layer's forward and backward FLOP for one micro-batch: 72 b s h^2 (1 + s / 6h)."""
    b, s, h = shape["micro_batch"], shape["seq"], shape["hidden"]
    return 72 * b * s * h * h * (1 + s / (6 * h))


def readahead_window(layer_bytes: float, read_bps: float, backward_s: float, layers: int,
                     start: int = PREFETCH_LAYERS) -> int:
    """plan/readahead.py's ``readahead_layers`` (the test checks they agree): layers read ahead
    of backward, enough that each read arrives before backward reaches it, at least
    ``start``, at most the layers."""
    if layer_bytes <= 0 or read_bps <= 0 or backward_s <= 0:
        return start
    need = math.ceil(layer_bytes / read_bps / backward_s) + 1
    return max(1, min(max(start, need), max(layers, start)))


def peak_floor(layers: int, layer_bytes: float, read_bps: float, backward_s: float, cap_bytes: float) -> dict:
    """The least activation peak offload can have against keep's, whatever its overheads: when
    backward starts the kept last layer is in memory and the read-ahead window is being read
    (the window by time at these rates, within the byte cap), ``(kept + ahead) / layers``;
    keep's peak and offload's share the transients above that, which only raise the ratio.
    ``floor``, ``kept``, ``ahead`` (layers, fractional where the byte cap cuts), ``window``
    (by time), ``by`` ("time" or "byte cap")."""
    window = readahead_window(layer_bytes, read_bps, backward_s, layers)
    capped = max(1.0, cap_bytes / layer_bytes) if layer_bytes > 0 else float(window)
    by_time = float(min(window, max(layers - KEEP_LAST_LAYERS, 0)))
    ahead = min(by_time, capped)
    return {"floor": min(1.0, (KEEP_LAST_LAYERS + ahead) / layers), "kept": KEEP_LAST_LAYERS, "ahead": ahead,
            "window": window, "layers": layers, "by": "time" if ahead >= by_time else "byte cap",
            "read_gbps": read_bps / 1e9, "backward_ms": backward_s * 1e3}


def nominal_floors(shape: dict, layer_bytes: Optional[float] = None) -> Dict[str, dict]:
    """Each engine's :func:`peak_floor` at the NOMINAL rates (memory: the link; posix: the
    drive), a layer's backward BACKWARD_SHARE of its compute at NOMINAL["flops"]."""
    layers = shape["layers"]
    size = layer_bytes if layer_bytes is not None else activation_bytes(shape) / layers
    backward_s = BACKWARD_SHARE * layer_flop(shape) / NOMINAL["flops"]
    return {engine: peak_floor(layers, size, NOMINAL[rate], backward_s, READAHEAD_CAP[engine])
            for engine, rate in (("memory", "link_bps"), ("posix", "drive_bps"))}


def floor_text(f: dict) -> str:
    ahead = f"{f['ahead']:.0f} read ahead" if f["by"] == "time" else f"{f['ahead']:.1f} read ahead (the byte cap)"
    return (f"{f['floor']:.2f} ({f['kept']} kept + {ahead} of {f['layers']} layers; reads at "
            f"{f['read_gbps']:.1f} GB/s, a layer's backward {f['backward_ms']:.2f} ms)")


def points(name: str, timed: int) -> List[dict]:
    shape = SHAPES[name]
    k = shape["micro_batch"]
    return point_plan(shape, [(point, k, engine) for point, engine in STRATEGIES], timed)


def shares(timed: int) -> Dict[str, float]:
    """Each shape's estimated seconds, its start left out: how the step splits its time."""
    return {name: points_estimate(SHAPES[name], points(name, timed))["seconds"] - ASSUME["start_s"]
            for name in SHAPES}


def estimates(args) -> Dict[str, Dict[str, float]]:
    """step -> {start, register, work, total} in seconds."""
    out: Dict[str, Dict[str, float]] = {"install": {"work": ASSUME["pip_s"]}}
    per = [points_estimate(SHAPES[name], points(name, args.steps)) for name in SHAPES]
    register = sum(e["register_s"] for e in per)
    work = sum(e["seconds"] - ASSUME["start_s"] for e in per) - register
    out["perf"] = {"start": ASSUME["start_s"], "register": round(register, 1), "work": round(work, 1)}
    for e in out.values():
        e["total"] = round(sum(e.values()), 1)
    return out


def shape_notes(name: str, timed: int) -> List[str]:
    """The dry run's lines for one shape: what it is, why, and each point's estimate."""
    shape = SHAPES[name]
    ratio = flop_per_saved_byte(shape)
    link_vs = ratio * NOMINAL["link_bps"] / NOMINAL["flops"]
    n = parameters(shape)
    lines = [f"{name}: {shape['layers']} layers, hidden {shape['hidden']}, {shape['heads']} heads, seq {shape['seq']}, "
             f"micro-batch {shape['micro_batch']}, {shape['attention']} attention: "
             f"{activation_bytes(shape) / 1e9:.2f} GB of activations a step, {ratio:,.0f} FLOP per saved byte (a "
             f"layer's compute {link_vs:.2f}x its bytes' time over the link at {NOMINAL['flops'] / 1e12:g} TFLOP/s "
             f"and {NOMINAL['link_bps'] / 1e9:g} GB/s); {n / 1e9:.2f} B parameters, {8 * n / 1e9:.1f} GB of bf16 "
             f"weights, gradients and Adam state"]
    floors = nominal_floors(shape)
    lines.append(f"  activation-peak target {PEAK_MAX[name]}x keep's; floor at {NOMINAL['flops'] / 1e12:g} TFLOP/s, "
                 f"link {NOMINAL['link_bps'] / 1e9:g} GB/s, drive {NOMINAL['drive_bps'] / 1e9:g} GB/s: "
                 + "; ".join(f"{engine} {floor_text(f)}" for engine, f in floors.items()))
    e = points_estimate(shape, points(name, timed))
    for point, est in e["points"].items():
        if "steps" in est:
            lines.append(f"  {point:<22} {est['steps']:>2} steps x ({est['compute_s']:.2f}s compute + {est['io_s']:.2f}s "
                         f"moving bytes) + {est['register_s']:.1f}s registering = {est['seconds']:.1f}s")
        else:
            lines.append(f"  {point:<22} {est['seconds']:.1f}s")
    return lines


def print_plan(args, steps: List[dict], say, shape_extra: Optional[Dict[str, List[str]]] = None) -> bool:
    """``shape_extra``: lines printed under a shape's own (the compute-bound regime's)."""
    notes = []
    if any(s["step"] == "perf" for s in steps):
        for name in SHAPES:
            notes += shape_notes(name, args.steps) + [f"  {line}" for line in (shape_extra or {}).get(name, [])]
    notes.append(f"at drive {ASSUME['drive_bps'] / 1e9:g} GB/s, link {ASSUME['link_bps'] / 1e9:g} GB/s, "
                 f"{ASSUME['flops'] / 1e12:g} TFLOP/s, registration {ASSUME['register_bps'] / 1e9:g} GB/s, "
                 f"{ASSUME['start_s']:g}s to start a step; {args.steps} timed steps a point")
    cards = None
    if any(s["step"] == "perf" for s in steps):
        cards = card_check({name: (shape, shape["micro_batch"], max(p["pinned"] for p in points(name, args.steps)))
                            for name, shape in SHAPES.items()})
    return print_steps(args, steps, say, estimates(args), PARENT_S, notes, cards)


def cards_header() -> dict:
    """What the results' header says of the cards: which the plan assumed, and each card's memory."""
    return {"card_assumed": ASSUMED_CARD, "cards": CARDS}
