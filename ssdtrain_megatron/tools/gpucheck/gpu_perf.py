#!/usr/bin/env python3
"""`make gpu-perf`: the measure step alone, at two shapes, with a timeline of every point, in at
most 198 s on a bare single-GPU box (set-up included), so a change can be tried three times in
one sitting. `make gpu-check` stays the acceptance check; this says where the time goes.

The box and the bundle are gpu-check's (docs/gpu-check.md: ``make gpu-bundle`` where there is
network, ``.whl/`` carried along). Two steps, each in its own process under its own limit
(gpu_perf_plan.py has the plan and why the shapes are what they are):

  install  pip install --no-index --find-links .whl --prefix <out>/prefix: what the box lacks
  perf     the measure step at two shapes, one after the other, each in its share of the time:
           io-bound (gpu-check's: 8 layers, hidden 2048, seq 1024, micro-batch 2, megatron-core's
           local spec), then compute-bound, the SSDTrain paper's regime (16 layers, hidden 6144,
           seq 256, micro-batch 1, core attention on torch's SDPA: gpu_check_sdpa.py)

At each shape: keep; offload with the memory and the posix engine; torch's save_on_cpu; full
recompute; adaptive on the memory engine in half of keep's activations: --steps timed steps
each (5), median and spread; the bounds' rates measured in the same run (the link on registered
memory at the records' sizes, one way and both at once; the drive in the step's pattern); per
point its bound, the stall beyond the IO deficit, the activation peak against the step's
start, the excess over the bound split by cause (ssdtrain_megatron/telemetry/breakdown.py), and
the four-place planner's prediction with the box's own figures beside the measured step
(gpu_perf_model.py). The last timed step of every point is a Chrome trace (open it in
https://ui.perfetto.dev or chrome://tracing) in <out>/traces/<shape>/, at most 2 MB each.

It prints one row per target (gpu_perf_targets.py): PASS, FAIL or NOT RUN with the
reason, and exits 0 only when every target passed. ``gpu-perf.json`` (everything) and
``table.txt`` are rewritten in --out after every step. ``GPU_CHECK_DRY=1`` (or --dry-run)
prints the time plan (each step's and each point's estimate) and exits 1 if it does not fit.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from .gpu_check import Suite, finish_args, run, suite_parser
from .gpu_check_plan import plan
from .gpu_perf_plan import SHAPES, STEPS, TOTAL_S, cards_header, estimates
from .gpu_perf_plan import print_plan as print_shapes_plan
from .gpu_perf_regime import REGIME_MARGIN, card_regimes, regime_lines
from .gpu_perf_targets import render, targets


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    return finish_args(suite_parser("gpu_perf", __doc__, "gpu-perf-results", TOTAL_S), PERF, argv)


def header(args: argparse.Namespace) -> dict:
    return {"estimates": estimates(args), "shapes": SHAPES, "steps_per_point": args.steps,
            "compute_bound_regime": card_regimes(SHAPES["compute-bound"]), **cards_header()}


def print_plan(args: argparse.Namespace, steps: List[dict], say) -> bool:
    """The plan (gpu_perf_plan.print_plan), the compute-bound shape's regime, bound and floor per
    card under it; it does not fit when the shape is out of the regime on a card."""
    regimes = card_regimes(SHAPES["compute-bound"])
    lines = ["in SSDTrain's regime on each card (gpu_perf_regime.py):"] + [f"  {line}" for line in
                                                                             regime_lines(SHAPES["compute-bound"])]
    out = [card for card, r in regimes.items() if r["margin"] < REGIME_MARGIN]
    fits = print_shapes_plan(args, steps, say, {"compute-bound": lines})
    if out:
        say(f"the compute-bound shape is NOT in the regime on {', '.join(out)}: grow its hidden size")
    return fits and not out


PERF = Suite("gpu-perf", f"{__package__}.gpu_perf", STEPS, lambda args: plan(args, STEPS), header, print_plan,
             targets, render, ("steps",), f"{__package__}.gpu_perf_step:run_step")


def main(argv: Optional[List[str]] = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
