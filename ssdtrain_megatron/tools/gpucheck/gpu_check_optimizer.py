"""The optimizer-offload row of `make gpu-check`: megatron-core's optimizer CPU offload and ours
in one job (issue 67; docs/gpu-check.md, "Optimizer offload with ours"). No torch here: the
parent plans the step and judges its result; the step itself is gpu_check_optimizer_step.py.

The step runs the launcher's command line below twice on one GPU, megatron-core's
DistributedOptimizer with its HybridDeviceOptimizer stepping half of the parameters on the
CPU: once with ``--optimizer-cpu-offload`` alone, once with ``--ssd-offload`` too (installed
through the launcher's install path, which reads the optimizer flags through the one
sequence). It records what the four lines of the row judge, each a pure function of the
recorded result (tests/test_gpu_optimizer_row.py feeds them recorded inputs):

- the host pool install took equals the pre-flight's for that rank;
- the pinned host memory after the first optimizer step (ours registered, the optimizer's in
  torch's pinned allocator) at most the pool, the staging and the plan's ``pinned_host_bytes``
  of the optimizer plus :data:`PINNED_SLACK`;
- the losses and gradients of every step equal those of optimizer offload alone, bitwise;
- the optimizer step's measured time within :data:`TIME_SLACK` of the plan's ``optimizer CPU
  offload`` row, at the CPU AdamW rate and pinned link measured on the box.

megatron-core 0.16.1 steps the GPU part with Transformer Engine's FusedAdam under
``--use-precision-aware-optimizer`` (megatron/core/optimizer/__init__.py falls back to torch's
AdamW without it, which is not the path users run): where TE is absent the step is NOT RUN,
saying so.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

PINNED_SLACK = 0.10  # measured pinned host memory over the plan's, at most
TIME_SLACK = 0.25  # the optimizer step's measured time against the plan's row, either way
FRACTION = 0.5  # --optimizer-offload-fraction
STEPS = 3  # training steps per job; the first makes the CPU optimizer's state, the rest are timed
SHAPE = dict(layers=2, hidden=1024, heads=16, seq=512, vocab=4096, micro_batch=2, num_microbatches=1)
"""The job's model (GPTSpec fields): small, so both jobs and their optimizer steps fit the step."""
INFLIGHT = 64 * (1 << 20)  # --ssd-offload-max-inflight-bytes: staging twice that
HOST_POOL = 256 * (1 << 20)
"""The estimate's bound on the tiered engine's pool, which the one sequence sizes (no
--ssd-offload-host-memory-bytes: the plan's host peak and a layer, 71.3 MB at SHAPE where host
memory is plentiful, less where rule 0's optimizer share and the staging leave less)."""
PINNED_BYTES_PER_PARAM = 6  # the plan's pinned share of an offloaded bf16 parameter (plan/memory.py)
ENGINE = "tiered"
TE_MISSING = ("Transformer Engine is not installed on this box: megatron-core 0.16.1 steps the GPU part of "
              "--optimizer-cpu-offload with --use-precision-aware-optimizer with TE's FusedAdam (without TE it "
              "falls back to torch's AdamW, not the path users run); install transformer-engine to run this row")
Verdict = Tuple[Optional[bool], str]


def launcher_argv(scratch: str) -> List[str]:
    """The job as the launcher gets it: Megatron's flags for :data:`SHAPE` with the optimizer
    offload, and ours (the second job; the first drops everything from ``--ssd-offload``)."""
    s = SHAPE
    return ["--num-layers", str(s["layers"]), "--hidden-size", str(s["hidden"]),
            "--num-attention-heads", str(s["heads"]), "--seq-length", str(s["seq"]),
            "--max-position-embeddings", str(s["seq"]), "--micro-batch-size", str(s["micro_batch"]),
            "--global-batch-size", str(s["micro_batch"] * s["num_microbatches"]), "--vocab-size", str(s["vocab"]),
            "--make-vocab-size-divisible-by", "128", "--bf16", "--use-distributed-optimizer",
            "--use-precision-aware-optimizer", "--optimizer-cpu-offload", "--optimizer-offload-fraction",
            str(FRACTION), "--overlap-cpu-optimizer-d2h-h2d",
            "--ssd-offload", "--ssd-offload-engine", ENGINE, "--ssd-offload-dir", scratch,
            "--ssd-offload-allow-system-disk", "--ssd-offload-max-inflight-bytes", str(INFLIGHT)]


def parameters() -> int:
    """12 h^2 + 13 h per layer and the untied embedding and output layer (gpu_check_plan)."""
    h = SHAPE["hidden"]
    return SHAPE["layers"] * (12 * h * h + 13 * h) + 2 * SHAPE["vocab"] * h


def estimate(assume: Dict[str, float]) -> Dict[str, float]:
    """Seconds the step needs at gpu_check_plan's ASSUME rates: its start (megatron-core and
    Transformer Engine), registering our pools and the optimizer's pinned blocks, and the work:
    the CPU AdamW rate's measurement (about a second), then per job its model built and
    :data:`STEPS` steps, each its compute and the offloaded part's AdamW on the CPU (at 1e8
    parameters a second, below any box's) and its copies over the link."""
    n = parameters()
    offloaded = FRACTION * n
    pinned = HOST_POOL + 2 * INFLIGHT + PINNED_BYTES_PER_PARAM * offloaded
    s = SHAPE
    flops = 72 * s["micro_batch"] * s["seq"] * s["layers"] * s["hidden"] ** 2 * (1 + s["seq"] / (6 * s["hidden"]))
    per_step = flops / assume["flops"] + offloaded / 1e8 + 2 * 4 * offloaded / assume["link_bps"]
    work = 1.0 + 2 * (8 * n / assume["build_bps"] + STEPS * per_step)
    return {"start": assume["start_s"] + assume["te_import_s"], "register": pinned / assume["register_bps"],
            "work": round(work, 1)}


# -- the row: each line a pure function of the step's recorded result -------------------------

def pool_line(pools: Optional[dict]) -> Verdict:
    """``pools``: {"install", "preflight"}: the host pool each took for this rank, bytes."""
    if not pools or pools.get("install") is None or pools.get("preflight") is None:
        return None, "host pools not recorded"
    a, b = pools["install"], pools["preflight"]
    return a == b, f"host pool: install {a:,} B {'==' if a == b else '!='} pre-flight {b:,} B"


def pinned_line(pinned: Optional[dict]) -> Verdict:
    """``pinned``: {"measured", "pool", "staging", "optimizer_planned"} bytes; passes when the
    measured is at most (1 + PINNED_SLACK) x the sum of the others."""
    keys = ("measured", "pool", "staging", "optimizer_planned")
    if not pinned or any(pinned.get(k) is None for k in keys):
        return None, "pinned host memory not recorded"
    planned = pinned["pool"] + pinned["staging"] + pinned["optimizer_planned"]
    limit = (1 + PINNED_SLACK) * planned
    g = 2 ** 30
    return pinned["measured"] <= limit, (
        f"pinned {pinned['measured'] / g:.3f} GiB vs at most {limit / g:.3f} (pool {pinned['pool'] / g:.3f} + "
        f"staging {pinned['staging'] / g:.3f} + the optimizer's planned {pinned['optimizer_planned'] / g:.3f}, "
        f"+{PINNED_SLACK:.0%})")


def bitwise_line(bitwise: Optional[dict]) -> Verdict:
    """``bitwise``: {"alone": [...], "ours": [...]}, one entry per step: the losses' bits and
    the gradients' digest as the step recorded them ({"loss_bits": [int], "grads": str});
    passes when every step of both ran and each is equal."""
    if not bitwise or "alone" not in bitwise or "ours" not in bitwise:
        return None, "losses and gradients not recorded"
    alone, ours = bitwise["alone"], bitwise["ours"]
    want = bitwise.get("steps", STEPS)
    for i, (a, b) in enumerate(zip(alone, ours)):
        if a.get("loss_bits") != b.get("loss_bits"):
            return False, f"step {i + 1}: losses differ ({a.get('loss_bits')} vs {b.get('loss_bits')}, as int bits)"
        if a.get("grads") != b.get("grads"):
            return False, f"step {i + 1}: gradients differ (digest {a.get('grads')} vs {b.get('grads')})"
    ran = min(len(alone), len(ours))
    if ran < want:
        return None, f"out of time: {ran} of {want} steps ran in both jobs, all bitwise equal"
    return True, f"{ran} steps: losses and gradients bitwise equal to optimizer offload alone"


def time_line(timing: Optional[dict]) -> Verdict:
    """``timing``: {"measured_s", "planned_s"} (the optimizer step's median and the plan's
    row); passes when they differ by at most TIME_SLACK of the plan's."""
    if not timing or not timing.get("measured_s") or not timing.get("planned_s"):
        return None, "the optimizer step's time or the plan's not recorded"
    m, p = timing["measured_s"], timing["planned_s"]
    off = m / p - 1
    rate = f"; CPU AdamW {timing['cpu_adam_params_per_s']:.3g} params/s" if timing.get("cpu_adam_params_per_s") else ""
    return abs(off) <= TIME_SLACK, (f"optimizer step {m * 1e3:.1f} ms vs the plan's {p * 1e3:.1f} ms "
                                    f"({off:+.0%}, within {TIME_SLACK:.0%}){rate}")


LINES = (("pools", pool_line), ("pinned", pinned_line), ("bitwise", bitwise_line), ("timing", time_line))


def judge(step: dict) -> Verdict:
    """The row: NOT RUN where the step did not run (Transformer Engine absent, no CUDA, an
    error, out of time) or a line has nothing recorded; else FAIL where a line fails; PASS
    when all four pass. The detail gives every line."""
    if step.get("status") not in ("pass", "fail"):
        status, why = step.get("status", "not run"), step.get("why", "")
        return None, why if status in ("not run", "skip") else f"step {status}: {why}"
    verdicts = [(name, fn(step.get(name))) for name, fn in LINES]
    detail = "; ".join(v[1] for _, v in verdicts)
    if any(v[0] is False for _, v in verdicts):
        return False, detail
    if any(v[0] is None for _, v in verdicts):
        return None, detail
    return True, detail


def status_of(result: dict) -> str:
    """The step's own status from its lines (the row judges the same): pass, fail, or not run."""
    ok, _ = judge(dict(result, status="pass"))
    return {True: "pass", False: "fail", None: "not run"}[ok]


__all__ = ["FRACTION", "LINES", "PINNED_SLACK", "SHAPE", "STEPS", "TE_MISSING", "TIME_SLACK", "bitwise_line",
           "estimate", "judge", "launcher_argv", "parameters", "pinned_line", "pool_line", "status_of", "time_line"]
