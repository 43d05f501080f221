"""The time plan of `make gpu-perf` (scripts/gpu_perf.py): its steps and limits, its two shapes
and their strategies, and each point's estimate at gpu_check_plan.py's conservative rates. No
torch here: the dry run prints anywhere (`GPU_CHECK_DRY=1 make gpu-perf`).

The two shapes, and why:

- **IO-bound** (``perf-io``): gpu-check's measure shape, 8 layers, hidden 2048, seq 1024,
  micro-batch 2, megatron-core's local spec. Its unfused attention saves the softmax and the
  probabilities (b x heads x seq^2), so a layer does about 2,200 FLOP per saved byte: at an
  H200's ~500 TFLOP/s and a ~50 GB/s link, a layer's bytes take about 4x its compute to cross.
- **compute-bound** (``perf-compute``): the SSDTrain paper's regime, where a layer's forward
  and backward take longer than its saved bytes over the link (>= 10,000 FLOP per byte at
  500 TFLOP/s and 50 GB/s). Hidden 8192 with SDPA core attention (scripts/gpu_check_sdpa.py:
  it saves what fused attention saves), 64 heads, seq 1024, micro-batch 1: 72 b s h^2 (1 +
  s/6h) FLOP over 34 b s h bytes per layer, about 17,700 FLOP per byte whatever the sequence.
  4 layers: 3.4 B parameters, 27 GB of bf16 weights, gradients and Adam state and about 1.2 GB
  of activations, far inside an H200's 141 GB; few layers, micro-batch 1 and seq 1024 because
  time, not memory, binds: posix writes and reads the offloaded ~0.9 GB per step over the
  box's ~2 GB/s drive, 6 steps a point, inside the step's slot.

Both shapes run every strategy a user has: keep; offload with the memory and the posix
engine; torch's ``save_on_cpu(pin_memory=True)``; Megatron's full recompute; adaptive on the
memory engine in half of keep's activations (recompute where it must).
"""

from __future__ import annotations

from typing import Dict, List

from gpu_check_plan import (ASSUME, activation_bytes, point_plan, points_estimate, print_steps)

STEPS = [
    ("install", 35, (), "pip install --no-index the bundle (.whl) into <out>/prefix"),
    ("perf-io", 80, ("install",), "the IO-bound shape: every strategy, bounds, timelines, breakdowns, the model"),
    ("perf-compute", 60, ("install",), "the compute-bound shape (SDPA, hidden 8192): the same"),
]
TOTAL_S = 180  # the whole run, set-up included
PARENT_S = 5

SHAPES: Dict[str, dict] = {
    "perf-io": dict(layers=8, hidden=2048, heads=16, seq=1024, vocab=8192, micro_batch=2, num_microbatches=1,
                    attention="local"),
    "perf-compute": dict(layers=4, hidden=8192, heads=64, seq=1024, vocab=8192, micro_batch=1, num_microbatches=1,
                         attention="sdpa"),
}
STRATEGIES = (("keep", None), ("offload-memory", "memory"), ("offload-posix", "posix"), ("save_on_cpu", None),
              ("recompute", None), ("adaptive", "memory"))
"""(point, engine) in the order the step runs them (gpu_perf_step.py)."""
NOMINAL = {"flops": 500e12, "link_bps": 50e9}
"""An H200's rates in practice, for the shapes' ratio (the estimates use ASSUME's, lower)."""


def flop_per_saved_byte(shape: dict) -> float:
    """A layer's forward and backward FLOP (72 b s h^2 (1 + s / 6h)) over the bytes it saves."""
    b, s, h = shape["micro_batch"], shape["seq"], shape["hidden"]
    return 72 * b * s * h * h * (1 + s / (6 * h)) * shape["layers"] / activation_bytes(shape)


def parameters(shape: dict) -> int:
    """12 h^2 + 13 h per layer, and the untied embedding and output layer."""
    h = shape["hidden"]
    return shape["layers"] * (12 * h * h + 13 * h) + 2 * shape["vocab"] * h


def points(name: str, timed: int) -> List[dict]:
    shape = SHAPES[name]
    k = shape["micro_batch"]
    return point_plan(shape, [(point, k, engine) for point, engine in STRATEGIES], timed)


def estimates(args) -> Dict[str, Dict[str, float]]:
    """step -> {start, register, work, total} in seconds."""
    out: Dict[str, Dict[str, float]] = {"install": {"work": ASSUME["pip_s"]}}
    for name in SHAPES:
        e = points_estimate(SHAPES[name], points(name, args.steps))
        out[name] = {"start": ASSUME["start_s"], "register": e["register_s"],
                     "work": e["seconds"] - ASSUME["start_s"] - e["register_s"]}
    for e in out.values():
        e["total"] = round(sum(e.values()), 1)
    return out


def shape_notes(name: str, timed: int) -> List[str]:
    """The dry run's lines for one shape: what it is, why, and each point's estimate."""
    shape = SHAPES[name]
    ratio = flop_per_saved_byte(shape)
    gb = activation_bytes(shape) / 1e9
    link_vs = ratio * NOMINAL["link_bps"] / NOMINAL["flops"]
    lines = [f"{name}: {shape['layers']} layers, hidden {shape['hidden']}, {shape['heads']} heads, seq {shape['seq']}, "
             f"micro-batch {shape['micro_batch']}, {shape['attention']} attention: {gb:.2f} GB of activations a step, "
             f"{ratio:,.0f} FLOP per saved byte (a layer's compute {link_vs:.2f}x its bytes' time over the link at "
             f"{NOMINAL['flops'] / 1e12:g} TFLOP/s and {NOMINAL['link_bps'] / 1e9:g} GB/s: "
             f"{'compute' if link_vs >= 1 else 'IO'}-bound); {parameters(shape) / 1e9:.2f} B parameters, "
             f"{8 * parameters(shape) / 1e9:.1f} GB of bf16 weights, gradients and Adam state"]
    e = points_estimate(shape, points(name, timed))
    for point, est in e["points"].items():
        if "steps" in est:
            lines.append(f"  {point:<22} {est['steps']:>2} steps x ({est['compute_s']:.2f}s compute + {est['io_s']:.2f}s "
                         f"moving bytes) + {est['register_s']:.1f}s registering = {est['seconds']:.1f}s")
        else:
            lines.append(f"  {point:<22} {est['seconds']:.1f}s")
    return lines


def print_plan(args, steps: List[dict], say) -> bool:
    notes = []
    for name in SHAPES:
        if any(s["step"] == name for s in steps):
            notes += shape_notes(name, args.steps)
    notes.append(f"at drive {ASSUME['drive_bps'] / 1e9:g} GB/s, link {ASSUME['link_bps'] / 1e9:g} GB/s, "
                 f"{ASSUME['flops'] / 1e12:g} TFLOP/s, registration {ASSUME['register_bps'] / 1e9:g} GB/s, "
                 f"{ASSUME['start_s']:g}s to start a step; {args.steps} timed steps a point")
    return print_steps(args, steps, say, estimates(args), PARENT_S, notes)
