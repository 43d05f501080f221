"""The targets of `make gpu-perf` (scripts/gpu_perf.py) and the table it prints.

Every target has a row every time: PASS, FAIL, or NOT RUN with the reason, judged as gpu-check
judges (scripts/gpu_check_targets.py: a point needs 5 timed steps; bounds, stall beyond the IO
deficit and the activation peak from the step's start), at the limits of issue 50:

- IO-bound shape: each engine within 1.10x of its bound, the stall beyond the IO deficit within
  2% of the step, the activation peak within 0.4x keep's;
- compute-bound shape (the SSDTrain paper's regime): the memory engine within 1.03x keep's step
  at an activation peak within 0.35x keep's; posix within 1.05x keep's where the drive carries
  the bytes in keep's time, else within 1.10x its bound; ours (the fastest offload point whose
  peak is no higher than save_on_cpu's) at most 0.7x save_on_cpu's step;
- at both: the planner's prediction within 10% of every measured step, and every breakdown of
  an excess adding up to it within 10%.
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional, Tuple

from .gpu_check_targets import (Verdict, _keep_and_offload, _not_run_why, _overlap, _peak, _point, _stall,
                               bound_verdict, peak_verdict, render_points)
from .gpu_check_targets import render as check_render
from .gpu_check_targets import targets as check_targets
IO_BOUND_MAX, COMPUTE_MEMORY_MAX, COMPUTE_POSIX_MAX = 1.10, 1.03, 1.05
IO_PEAK_MAX, COMPUTE_PEAK_MAX = 0.4, 0.35
VS_SAVE_ON_CPU_MAX = 0.7
OURS = ("offload-memory", "offload-posix", "adaptive")
# The parent process imports nothing of the package (the box's bare python runs it): these are
# the package's own figures, and tests/test_gpu_perf.py checks that they agree.
MODEL_MAX = 0.10  # scripts/gpu_perf_model.py
ADDS_UP = 0.10  # ssdtrain_megatron/telemetry/breakdown.py: what its ``adds_up`` judged


def _compute_memory(step: dict) -> Verdict:
    keep, off, why = _keep_and_offload("memory", step)
    if keep is None or off is None:
        return None, why
    r = off["step_s"] / keep["step_s"]
    peak_ok, peak = peak_verdict(off, keep, COMPUTE_PEAK_MAX)
    if peak_ok is None:
        return None, peak
    return r <= COMPUTE_MEMORY_MAX and peak_ok, (f"{r:.3f}x keep's step ({off['step_s'] * 1e3:.1f} vs "
                                                 f"{keep['step_s'] * 1e3:.1f} ms); peak {peak}")


def _compute_posix(step: dict) -> Verdict:
    """Where the drive moves the step's bytes within keep's step (the bound's IO term within
    keep's), posix must be within 1.05x keep's; else within 1.10x its bound."""
    keep, off, why = _keep_and_offload("posix", step)
    if keep is None or off is None:
        return None, why
    if not off.get("bound"):
        return None, off.get("bound_why", "no bound was measured")
    if off["bound"]["io_s"] <= keep["step_s"]:
        r = off["step_s"] / keep["step_s"]
        return r <= COMPUTE_POSIX_MAX, (f"the drive carries the bytes ({off['bound']['io_s'] * 1e3:.1f} ms of IO in "
                                        f"keep's {keep['step_s'] * 1e3:.1f} ms): {r:.3f}x keep's step")
    ok, detail = bound_verdict(off, keep, IO_BOUND_MAX)
    return ok, "the drive cannot carry the bytes in keep's step: " + detail


def _vs_save_on_cpu(step: dict) -> Verdict:
    k = step.get("micro_batch", 1)
    soc, why = _point(step, f"save_on_cpu@{k}")
    if soc is None:
        return None, why
    ours = [p for p in (_point(step, f"{n}@{k}")[0] for n in OURS) if p is not None]
    fit = [p for p in ours if p["activation_reserved"] <= soc["activation_reserved"]]
    if not fit:
        return (False if ours else None), ("none of ours ran" if not ours else
                                           f"none of ours at a peak no higher than save_on_cpu's "
                                           f"({soc['activation_reserved'] / 2**30:.2f} GiB)")
    best = min(fit, key=lambda p: p["step_s"])
    r = best["step_s"] / soc["step_s"]
    return r <= VS_SAVE_ON_CPU_MAX, (f"{best['name']} {r:.2f}x save_on_cpu's step ({best['step_s'] * 1e3:.1f} vs "
                                     f"{soc['step_s'] * 1e3:.1f} ms) at {best['activation_reserved'] / 2**30:.2f} vs "
                                     f"{soc['activation_reserved'] / 2**30:.2f} GiB of activations")


def _model(step: dict) -> Verdict:
    model = step.get("model")
    if not isinstance(model, dict) or not model.get("points"):
        return None, (model or {}).get("why") if isinstance(model, dict) and model.get("why") else _not_run_why(step)
    rows = model["points"]
    worst = max(rows, key=lambda n: abs(rows[n]["error"]))
    detail = ", ".join(f"{n} {v['error']:+.0%}" for n, v in rows.items())
    return abs(rows[worst]["error"]) <= MODEL_MAX, f"{detail} (forward from keep's {model.get('forward_from')})"


def _adds_up(step: dict) -> Verdict:
    rows = {p["name"]: p["breakdown"] for p in step.get("points", []) if p.get("breakdown")}
    judged = {n: b for n, b in rows.items() if b["adds_up"] is not None}
    if not judged:
        return None, ("no point had an excess to split" if rows else _not_run_why(step) or "no breakdown")
    detail = ", ".join(f"{n} {b['sum_s'] * 1e3:.1f} of {b['excess_s'] * 1e3:.1f} ms" for n, b in judged.items())
    return all(b["adds_up"] for b in judged.values()), detail


IO, COMPUTE = "io-bound", "compute-bound"


def _at(shape: str, judge: Callable[[dict], Verdict]) -> Callable[[dict], Verdict]:
    """``judge`` on one shape's result of the perf step (its ``shapes``)."""
    def at(step: dict) -> Verdict:
        sub = (step.get("shapes") or {}).get(shape)
        if sub is None:
            return None, (_not_run_why(step) if step.get("status") not in ("pass", "fail") else
                          f"the {shape} shape was not measured")
        return judge(sub)
    return at


TARGETS: List[Tuple[str, str, Callable[[dict], Verdict]]] = [(name, "perf", _at(shape, judge)) for name, shape, judge in [
    (f"io-bound: memory <= {IO_BOUND_MAX:.2f}x its link bound", IO,
     functools.partial(_overlap, "memory", limit=IO_BOUND_MAX)),
    (f"io-bound: posix <= {IO_BOUND_MAX:.2f}x its drive bound", IO,
     functools.partial(_overlap, "posix", limit=IO_BOUND_MAX)),
] + [(f"io-bound: stall beyond the IO deficit <= 2%: {e}", IO, functools.partial(_stall, e)) for e in ("memory", "posix")
     ] + [(f"io-bound: activation peak <= {IO_PEAK_MAX}x keep's: {e}", IO, functools.partial(_peak, e, limit=IO_PEAK_MAX))
          for e in ("memory", "posix")] + [
    (f"compute-bound: memory <= {COMPUTE_MEMORY_MAX:.2f}x keep, peak <= {COMPUTE_PEAK_MAX:.2f}x keep", COMPUTE,
     _compute_memory),
    (f"compute-bound: posix <= {COMPUTE_POSIX_MAX:.2f}x keep (or {IO_BOUND_MAX:.2f}x bound)", COMPUTE, _compute_posix),
    (f"compute-bound: ours <= {VS_SAVE_ON_CPU_MAX}x save_on_cpu, peak no higher", COMPUTE, _vs_save_on_cpu),
] + [(f"{shape}: the model within {MODEL_MAX:.0%} of every step", shape, _model) for shape in (IO, COMPUTE)] + [
    (f"{shape}: every breakdown adds up within {ADDS_UP:.0%}", shape, _adds_up) for shape in (IO, COMPUTE)]]


def targets(steps: Dict[str, dict], missing: Optional[Dict[str, str]] = None) -> List[dict]:
    """One row per target of TARGETS (gpu_check_targets.targets)."""
    return check_targets(steps, missing, TARGETS)


def render(data: dict) -> str:
    """gpu_check_targets.render's table and step lines, the shapes between them."""
    return check_render(data, _shape_lines)


def _shape_lines(data: dict) -> List[str]:
    lines: List[str] = []
    shapes = data.get("steps", {}).get("perf", {}).get("shapes") or {}
    for name in (IO, COMPUTE):
        st = shapes.get(name, {})
        if not st.get("points"):
            continue
        shape = st.get("shape", {})
        lines += ["", f"{name}: " + ", ".join(f"{k} {v}" for k, v in shape.items())
                  + f"; {st.get('flop_per_saved_byte', 0):,.0f} FLOP per saved byte"
                  + (f"; {st['status']}: {st.get('why', '')}" if st.get("status") != "pass" else "")]
        rates = st.get("rates") or {}
        link, drive = rates.get("link") or {}, rates.get("drive") or {}
        if link:
            lines.append(f"link on registered memory: D2H {link['d2h'] / 1e9:.1f}, H2D {link['h2d'] / 1e9:.1f}, both "
                         f"ways {link['both'] / 1e9:.1f} GB/s")
        if drive:
            lines.append(f"drive in the step's pattern: write {drive['write'] / 1e9:.2f}, read {drive['read'] / 1e9:.2f} GB/s")
        lines += render_points(st["points"])
        model = (st.get("model") or {}).get("points") or {}
        if model:
            lines += ["", "the planner's prediction with this box's figures against the measured step:"]
            lines += [f"  {n:<22} predicted {v['predicted_s'] * 1e3:8.1f} ms  measured {v['measured_s'] * 1e3:8.1f} ms  "
                      f"({v['error']:+.0%})" for n, v in model.items()]
    return lines
