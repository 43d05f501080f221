"""The time plan of `make gpu-perf` (gpu_perf.py): its steps and limits, its two shapes
and their strategies, and each point's estimate at gpu_check_plan.py's conservative rates. No
torch here: the dry run prints anywhere (`GPU_CHECK_DRY=1 make gpu-perf`).

One measure step runs both shapes, one after the other, in one process: a second process
would cost a second start (20 s at the plan's rates) that 180 s cannot spare. Each shape gets
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
  per byte whatever the sequence. Hidden 6144 (48 heads of 128): about 13,400 FLOP per byte,
  compute 1.3x the link at 500 TFLOP/s and still above it at 600. Hidden 8192 (about 17,700)
  would leave fewer layers in the time: torch's save_on_cpu copies the weights too (the linear
  layers save them for backward), 6.7 GB each way a step at 4 layers of 8192, and the
  activation peak target (0.35x keep's) needs enough layers that the last one, kept, and the
  reads ahead of backward are a small part of them. 6 layers (the plan's margin left no room
  for a seventh), seq 1024, micro-batch 1: 2.8 B parameters, 23 GB of bf16 weights, gradients
  and Adam state and 1.3 GB of activations, far inside an H200's 141 GB.

Both shapes run every strategy a user has: keep; offload with the memory and the posix
engine; torch's ``save_on_cpu(pin_memory=True)``; Megatron's full recompute; adaptive on the
memory engine in half of keep's activations (recompute where it must).
"""

from __future__ import annotations

from typing import Dict, List

from .gpu_check_plan import (ASSUME, ASSUMED_CARD, CARDS, activation_bytes, card_check, parameters, point_plan,
                            points_estimate, print_steps)

STEPS = [
    ("install", 35, (), "pip install --no-index the bundle (.whl) into <out>/prefix"),
    ("perf", 140, ("install",), "both shapes, every strategy: bounds, timelines, breakdowns, the model"),
]
TOTAL_S = 180  # the whole run, set-up included
PARENT_S = 5

SHAPES: Dict[str, dict] = {
    "io-bound": dict(layers=8, hidden=2048, heads=16, seq=1024, vocab=8192, micro_batch=2, num_microbatches=1,
                     attention="local"),
    "compute-bound": dict(layers=6, hidden=6144, heads=48, seq=1024, vocab=8192, micro_batch=1, num_microbatches=1,
                          attention="sdpa"),
}
"""The shapes in the order the step runs them."""
STRATEGIES = (("keep", None), ("offload-memory", "memory"), ("offload-posix", "posix"), ("save_on_cpu", None),
              ("recompute", None), ("adaptive", "memory"))
"""(point, engine) in the order the step runs them (gpu_perf_step.py)."""
NOMINAL = {"flops": 500e12, "link_bps": 50e9}
"""An H200's rates in practice, for the shapes' ratio (the estimates use ASSUME's, lower)."""


def flop_per_saved_byte(shape: dict) -> float:
    """A layer's forward and backward FLOP (72 b s h^2 (1 + s / 6h)) over the bytes it saves."""
    b, s, h = shape["micro_batch"], shape["seq"], shape["hidden"]
    return 72 * b * s * h * h * (1 + s / (6 * h)) * shape["layers"] / activation_bytes(shape)


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
    if any(s["step"] == "perf" for s in steps):
        for name in SHAPES:
            notes += shape_notes(name, args.steps)
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
