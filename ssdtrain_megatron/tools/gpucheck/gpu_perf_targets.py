"""The targets of `make gpu-perf` (ssdtrain_megatron/tools/gpucheck/gpu_perf.py) and the table it prints.

Every target has a row every time: PASS, FAIL, or NOT RUN with the reason, judged as gpu-check
judges (ssdtrain_megatron/tools/gpucheck/gpu_check_targets.py: a point needs 5 timed steps; bounds, stall beyond the IO
deficit and the activation peak from the step's start), at the limits of issue 50:

- IO-bound shape: each engine within 1.10x of its bound, the stall beyond the IO deficit within
  2% of the step, the activation peak within 0.7x keep's (its floor is about 0.56:
  gpu_perf_plan.PEAK_MAX says why);
- compute-bound shape (the SSDTrain paper's regime): the memory engine within 1.03x keep's step
  at an activation peak within 0.35x keep's (its floor 0.25); posix within 1.05x keep's where
  the drive carries the bytes in keep's time, else within 1.10x its bound; ours (the fastest
  offload point whose peak is no higher than save_on_cpu's) at most 0.7x save_on_cpu's step,
  save_on_cpu's copies of the weights (Megatron's linear layers save them) shown as their own
  term;
- every peak row gives the shape's floor beside its ratio (the kept layer and the read-ahead
  window over the layers, at the box's measured rates: gpu_perf_model.floors, else at the
  plan's nominal ones), and each shape's lines report save_on_cpu, recompute and ours against
  keep (step and activation peak);
- at both: the planner's prediction within 10% of every measured step; every breakdown of an
  excess explained (at most 20% of it in parts that name no cause: idle while the host was
  busy, compute beyond keep's), and, as its own row, every traced step typical (its parts
  within 10% of the median's excess: the trace is one step).
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional, Tuple

from .gpu_check_targets import (Verdict, _drive, _keep_and_offload, _not_run_why, _peak, _point, _stall,
                               bound_verdict, needs_drive, peak_verdict, render_points)
from .gpu_check_targets import render as check_render
from .gpu_check_targets import targets as check_targets
from .gpu_drive import text as drive_text
from .gpu_perf_plan import PEAK_MAX, floor_text, nominal_floors
from .gpu_perf_regime import (CARD_RATES, OPTIMIZER_BYTES_PER_PARAM, REGIME_MARGIN, ZERO_GRAD_BYTES_PER_PARAM,
                              regime)

IO_BOUND_MAX, COMPUTE_MEMORY_MAX, COMPUTE_POSIX_MAX = 1.10, 1.03, 1.05
COMPUTE_EXCESS_MAX = COMPUTE_MEMORY_MAX - 1
"""The memory engine's step over keep's at the compute-bound shape, as a share of keep's forward
and backward (keep's step less the optimizer and zero_grad, which offload cannot touch)."""
IO_PEAK_MAX, COMPUTE_PEAK_MAX = PEAK_MAX["io-bound"], PEAK_MAX["compute-bound"]
HIDDEN_MIN = 0.7
"""Of the time save_on_cpu's activation copies take on the compute stream, ours hides at least this."""
OURS = ("offload-memory", "offload-posix", "adaptive")
# The parent process imports nothing of the package (the box's bare python runs it): these are
# the package's own figures, and tests/test_gpu_perf.py checks that they agree.
MODEL_MAX = 0.10  # ssdtrain_megatron/tools/gpucheck/gpu_perf_model.py
TYPICAL = 0.10  # ssdtrain_megatron/telemetry/breakdown.py: what its ``typical`` judged
UNEXPLAINED_MAX = 0.20  # ssdtrain_megatron/telemetry/breakdown.py: what its ``explained`` judged


def floor_of(step: dict, engine: str) -> Optional[Tuple[dict, str]]:
    """The shape's activation-peak floor for ``engine`` and at what rates: the box's measured
    (gpu_perf_model.floors, under ``model``), else the plan's nominal ones for the shape."""
    measured = ((step.get("model") or {}).get("floors") or {}).get(engine)
    if measured:
        return measured, "measured"
    shape = step.get("shape")
    return (nominal_floors(shape)[engine], "nominal") if shape else None


def _floor_note(step: dict, engine: str, limit: float) -> str:
    got = floor_of(step, engine)
    if got is None:
        return ""
    f, rates = got
    below = f"; the target {limit} is below it: the shape cannot reach it" if f["floor"] > limit else ""
    return f"; floor at the {rates} rates {floor_text(f)}{below}"


def _peak_with_floor(engine: str, step: dict, limit: float) -> Verdict:
    ok, detail = _peak(engine, step, limit=limit)
    return ok, detail + (_floor_note(step, engine, limit) if ok is not None else "")


def card_of(step: dict) -> str:
    """The lent card the step ran on, by the GPU memory it saw (gpu_check_plan.CARDS)."""
    return "H200 141 GB" if step.get("gpu_memory_bytes", 0) > 100 * (1 << 30) else "H100 80 GB"


def keep_shares(step: dict, keep: dict) -> Tuple[float, float, str]:
    """Keep's step split into what offload cannot touch (the optimizer and zero_grad, at the
    card's memory bandwidth: gpu_perf_regime.py) and the rest, its forward and backward:
    (optimizer + zero_grad seconds, forward + backward seconds, a line saying so)."""
    card = card_of(step)
    hbm = CARD_RATES[card]["hbm_bps"]
    n = step.get("parameters") or 0
    opt, zero = OPTIMIZER_BYTES_PER_PARAM * n / hbm, ZERO_GRAD_BYTES_PER_PARAM * n / hbm
    fb = keep["step_s"] - opt - zero
    return opt + zero, fb, (f"keep's {keep['step_s'] * 1e3:.1f} ms = optimizer {opt * 1e3:.1f} + zero_grad "
                            f"{zero * 1e3:.1f} ({(opt + zero) / keep['step_s']:.0%}, {n / 1e9:.2f} B parameters at "
                            f"the {card}'s {hbm / 1e12:.1f} TB/s) + forward and backward {fb * 1e3:.1f} ms")


def _regime_floor_note(step: dict, limit: float) -> str:
    shape = step.get("shape")
    if not shape:
        return ""
    card = card_of(step)
    f = regime(shape, CARD_RATES[card])["floor"]
    below = f"; the target {limit} is below it: the shape cannot reach it" if f > limit else ""
    return f"; floor {f:.2f} on the {card} (the forward side, the read window and the weight-gradient temporary){below}"


def _compute_memory(step: dict) -> Verdict:
    """The memory engine's step over keep's within COMPUTE_EXCESS_MAX of keep's forward and
    backward (not of its optimizer, which differs per card), and its peak within the target."""
    keep, off, why = _keep_and_offload("memory", step)
    if keep is None or off is None:
        return None, why
    _, fb, shares = keep_shares(step, keep)
    excess = off["step_s"] - keep["step_s"]
    peak_ok, peak = peak_verdict(off, keep, COMPUTE_PEAK_MAX)
    if peak_ok is None or fb <= 0:
        return None, peak if peak_ok is None else f"keep's step is all optimizer by the model: {shares}"
    return excess <= COMPUTE_EXCESS_MAX * fb and peak_ok, (
        f"{excess * 1e3:+.1f} ms over keep's step, {excess / fb:+.1%} of its forward and backward ({shares}); "
        f"peak {peak}" + _regime_floor_note(step, COMPUTE_PEAK_MAX))


def _in_regime(step: dict) -> Verdict:
    """The shape is in SSDTrain's regime on this box: keep's forward and backward at least
    REGIME_MARGIN above the memory engine's bytes over the measured link, serialized (W / D2H
    + R / H2D: with one micro-batch the first read waits for the last write). It judges the
    shape, not the offloader: a FAIL says the compute-bound rows cannot be read as the paper's."""
    keep, off, why = _keep_and_offload("memory", step)
    link = (step.get("rates") or {}).get("link") or {}
    if keep is None or off is None or not link.get("d2h") or not link.get("h2d"):
        return None, why or "the link's rates were not measured"
    _, fb, shares = keep_shares(step, keep)
    serial = off["bytes_written"] / link["d2h"] + off["bytes_read"] / link["h2d"]
    if serial <= 0:
        return None, "the memory engine moved no bytes"
    margin = fb / serial - 1
    return margin >= REGIME_MARGIN, (f"forward and backward {fb * 1e3:.1f} ms vs the serialized link "
                                     f"{serial * 1e3:.1f} ms ({off['bytes_written'] / 1e9:.2f} GB at D2H "
                                     f"{link['d2h'] / 1e9:.1f}, {off['bytes_read'] / 1e9:.2f} GB at H2D "
                                     f"{link['h2d'] / 1e9:.1f} GB/s): margin {margin:+.0%} (needs "
                                     f"{REGIME_MARGIN:+.0%}); {shares}")


def _io_memory(step: dict) -> Verdict:
    """The memory engine within IO_BOUND_MAX of its link bound plus the work no copy can overlap
    (where the link binds): the optimizer and zero_grad (gpu_perf_regime.py's model at the
    card's memory bandwidth), the first layer's forward (nothing to copy yet) and the last
    layer's backward (nothing left to read), one layer's forward and backward of keep's."""
    keep, off, why = _keep_and_offload("memory", step)
    if keep is None or off is None:
        return None, why
    b = off.get("bound")
    if not b:
        return None, off.get("bound_why", "no bound was measured")
    opt_zero, fb, shares = keep_shares(step, keep)
    layers = (step.get("shape") or {}).get("layers") or 1
    serial = b.get("resource") != "compute"
    extra = (opt_zero + max(fb, 0.0) / layers) if serial else 0.0
    bound = b["seconds"] + extra
    r = off["step_s"] / bound
    _, detail = bound_verdict(off, keep, IO_BOUND_MAX)
    return r <= IO_BOUND_MAX, (f"{r:.2f}x the bound with what cannot overlap, {bound * 1e3:.1f} ms = "
                               f"{b['seconds'] * 1e3:.1f} + {extra * 1e3:.1f} (optimizer and zero_grad "
                               f"{opt_zero * 1e3:.1f}, a layer's forward and backward {max(fb, 0.0) / layers * 1e3:.1f}; "
                               f"{shares}); against the bound alone {detail}")


def _posix_raw(step: dict) -> Verdict:
    """posix within IO_BOUND_MAX of the drive bound at the drive's raw O_DIRECT rates, measured
    apart from the engine (gpu_drive.raw_rates, as io-bench does): a slow engine path cannot
    hide in its own rates."""
    keep, off, why = _keep_and_offload("posix", step)
    if keep is None or off is None:
        return None, why
    raw = (step.get("rates") or {}).get("drive_raw") or {}
    if not raw.get("write") or not raw.get("read"):
        return None, step.get("drive_raw_rate_error") or "the drive's raw O_DIRECT rate was not measured"
    w, r_ = off.get("bytes_written") or 0.0, off.get("bytes_read") or 0.0
    io = w / raw["write"] + r_ / raw["read"]
    bound = max(keep["step_s"], io)
    r = off["step_s"] / bound
    engine = off.get("bound") or {}
    return r <= IO_BOUND_MAX, (f"{r:.2f}x: {off['step_s'] * 1e3:.1f} ms vs max(keep {keep['step_s'] * 1e3:.1f}, "
                               f"W / raw write + R / raw read {io * 1e3:.1f}) ms at the raw O_DIRECT "
                               f"{raw['write'] / 1e9:.2f} / {raw['read'] / 1e9:.2f} GB/s"
                               + (f"; the engine's own pattern gave {engine['seconds'] * 1e3:.1f} ms" if engine else ""))


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


def save_on_cpu_terms(step: dict, soc: dict, keep: dict) -> Optional[Dict[str, float]]:
    """save_on_cpu's step as keep's plus its copies, which run on the compute stream (so add
    to it): the weights' (Megatron's linear layers save them for backward: their bf16 bytes,
    2 x ``parameters``, each way) and the activations' (what keep's step records, each way),
    at the link's measured D2H and H2D rates, and the rest. None without the link's rates or
    the shape's figures."""
    link = (step.get("rates") or {}).get("link") or {}
    acts = (step.get("record_sizes") or {}).get("bytes")
    if not link.get("d2h") or not link.get("h2d") or not step.get("parameters") or acts is None:
        return None
    each_way = 1 / link["d2h"] + 1 / link["h2d"]
    weights, activations = 2 * step["parameters"] * each_way, acts * each_way
    return {"keep": keep["step_s"], "weights' copies": weights, "activations' copies": activations,
            "rest": soc["step_s"] - keep["step_s"] - weights - activations}


def _ours(step: dict, k: int) -> List[dict]:
    return [p for p in (_point(step, f"{n}@{k}")[0] for n in OURS) if p is not None]


def _vs_save_on_cpu(step: dict) -> Verdict:
    """The fastest of ours at a peak no higher than save_on_cpu's against what save_on_cpu pays
    for the activations: its copies on the compute stream (the records' bytes each way at the
    measured link) are the time to hide, and ours passes when its step over keep's is at most
    1 - HIDDEN_MIN of it. save_on_cpu's weights' copies (Megatron's linear layers save them:
    seconds at the compute-bound shape) are shown apart and judge nothing: against them any
    offloader would pass. The detail splits save_on_cpu's step into keep's, the weights' copies,
    the activations' copies and the rest."""
    k = step.get("micro_batch", 1)
    soc, why = _point(step, f"save_on_cpu@{k}")
    keep, why_keep = _point(step, f"keep@{k}")
    if soc is None or keep is None:
        return None, why or why_keep
    ours = _ours(step, k)
    fit = [p for p in ours if p["activation_reserved"] <= soc["activation_reserved"]]
    if not fit:
        return (False if ours else None), ("none of ours ran" if not ours else
                                           f"none of ours at a peak no higher than save_on_cpu's "
                                           f"({soc['activation_reserved'] / 2**30:.2f} GiB)")
    best = min(fit, key=lambda p: p["step_s"])
    r = best["step_s"] / soc["step_s"]
    terms = save_on_cpu_terms(step, soc, keep)
    if not terms or terms["activations' copies"] <= 0:
        return None, "the link's rates, keep's records or the parameters were not measured"
    hidden = 1 - (best["step_s"] - keep["step_s"]) / terms["activations' copies"]
    detail = (f"{best['name']} {r:.2f}x save_on_cpu's step ({best['step_s'] * 1e3:.1f} vs {soc['step_s'] * 1e3:.1f} "
              f"ms) at {best['activation_reserved'] / 2**30:.2f} vs {soc['activation_reserved'] / 2**30:.2f} GiB of "
              f"activations; keep {keep['step_s'] * 1e3:.1f} ms: ours {best['step_s'] / keep['step_s']:.2f}x, "
              f"save_on_cpu {soc['step_s'] / keep['step_s']:.2f}x")
    without = soc["step_s"] - terms["weights' copies"]
    detail += ("; save_on_cpu = " + " + ".join(f"{n} {v * 1e3:.1f}" for n, v in terms.items()) + " ms; ours "
               + (f"{best['step_s'] / without:.2f}x save_on_cpu less its weights' copies" if without > 0 else
                  "faster than its weights' copies alone"))
    copies = terms["activations' copies"]
    return hidden >= HIDDEN_MIN, (f"ours hides {hidden:.0%} of the {copies * 1e3:.1f} ms save_on_cpu's activation "
                                  f"copies take ({(best['step_s'] - keep['step_s']) * 1e3:+.1f} ms over keep); " + detail)


def vs_keep_lines(step: dict) -> List[str]:
    """save_on_cpu, recompute and ours (each of OURS measured) against keep: step time and
    activation peak, as ratios of keep's."""
    k = step.get("micro_batch", 1)
    keep, _ = _point(step, f"keep@{k}")
    if keep is None:
        return []
    rows = []
    for name in ("save_on_cpu", "recompute") + OURS:
        p, _ = _point(step, f"{name}@{k}")
        if p is None:
            continue
        peak = (f"{p['activation_reserved'] / keep['activation_reserved']:.2f}x"
                if keep["activation_reserved"] > 0 else "n/a")
        rows.append(f"  {p['name']:<22} step {p['step_s'] / keep['step_s']:.2f}x  activation peak {peak}")
    return ["against keep (step time, activation peak reserved):"] + rows if rows else []


def _model(step: dict) -> Verdict:
    model = step.get("model")
    if not isinstance(model, dict) or not model.get("points"):
        return None, (model or {}).get("why") if isinstance(model, dict) and model.get("why") else _not_run_why(step)
    rows = model["points"]
    worst = max(rows, key=lambda n: abs(rows[n]["error"]))
    detail = ", ".join(f"{n} {v['error']:+.0%}" for n, v in rows.items())
    return abs(rows[worst]["error"]) <= MODEL_MAX, f"{detail} (forward from keep's {model.get('forward_from')})"


def _ours_point(p: dict) -> bool:
    return p["name"].split("@")[0] in OURS


def _breakdowns(step: dict, key: str) -> Tuple[Dict[str, dict], str]:
    """Our points' breakdowns that judged ``key`` (not None), or why there are none. The peers'
    (save_on_cpu, recompute) are shown in the table, not judged: their excess over keep's step
    has causes of their own (synchronous copies on the compute stream; a recomputed forward)
    that a breakdown against keep counts as "compute stream beyond keep's"."""
    rows = {p["name"]: p["breakdown"] for p in step.get("points", []) if p.get("breakdown") and _ours_point(p)}
    judged = {n: b for n, b in rows.items() if b.get(key) is not None}
    return judged, ("" if judged else "no point of ours had an excess to split" if rows else
                    _not_run_why(step) or "no breakdown of ours")


def _explained(step: dict) -> Verdict:
    """Every breakdown names the causes of at least 80% of its excess (telemetry/breakdown.py)."""
    judged, why = _breakdowns(step, "explained")
    if not judged:
        return None, why
    detail = ", ".join(f"{n} {b['unexplained_s'] * 1e3:.1f} of {b['excess_s'] * 1e3:.1f} ms unexplained"
                       + (f" ({', '.join(b.get('unexplained_parts') or [])})" if not b["explained"] else "")
                       for n, b in judged.items())
    return all(b["explained"] for b in judged.values()), detail


def _typical(step: dict) -> Verdict:
    """Every traced step's parts within 10% of the median's excess."""
    judged, why = _breakdowns(step, "typical")
    if not judged:
        return None, why
    points = {p["name"]: p for p in step.get("points", [])}
    allowed = {n: typical_allowance(b, points.get(n, {})) for n, b in judged.items()}
    detail = ", ".join(f"{n} {b['sum_s'] * 1e3:.1f} of {b['excess_s'] * 1e3:.1f} ms (within "
                       f"{allowed[n] * 1e3:.1f})" for n, b in judged.items())
    return all(abs(b["sum_s"] - b["excess_s"]) <= allowed[n] for n, b in judged.items()), detail


def typical_allowance(breakdown: dict, point: dict) -> float:
    """How far the traced step's parts may sit from the median's excess: TYPICAL of the excess,
    or the timed steps' own spread (spread x the median step) where that is wider: a traced
    step within the steps' spread is typical of them, however small the excess (a millisecond
    on an IO-bound step of a hundred)."""
    return max(TYPICAL * breakdown["excess_s"], (point.get("spread") or 0.0) * (point.get("step_s") or 0.0))


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
    (f"io-bound: memory <= {IO_BOUND_MAX:.2f}x link bound + unoverlappable", IO, _io_memory),
    (f"io-bound: posix <= {IO_BOUND_MAX:.2f}x its raw drive bound", IO, needs_drive(_posix_raw)),
] + [(f"io-bound: stall beyond the IO deficit <= 2%: {e}", IO, _drive(e, functools.partial(_stall, e)))
     for e in ("memory", "posix")] + [(f"io-bound: activation peak <= {IO_PEAK_MAX}x keep's: {e}", IO,
                                       _drive(e, functools.partial(_peak_with_floor, e, limit=IO_PEAK_MAX)))
                                      for e in ("memory", "posix")] + [
    (f"compute-bound: in regime, fwd+bwd >= {1 + REGIME_MARGIN:.2f}x serial link", COMPUTE, _in_regime),
    (f"compute-bound: memory <= keep + {COMPUTE_EXCESS_MAX:.0%} fwd+bwd, peak <= {COMPUTE_PEAK_MAX:.2f}x", COMPUTE,
     _compute_memory),
    (f"compute-bound: posix <= {COMPUTE_POSIX_MAX:.2f}x keep (or {IO_BOUND_MAX:.2f}x bound)", COMPUTE,
     needs_drive(_compute_posix)),
    (f"compute-bound: ours hides >= {HIDDEN_MIN:.0%} of save_on_cpu copies", COMPUTE, _vs_save_on_cpu),
] + [(f"{shape}: the model within {MODEL_MAX:.0%} of every step", shape, _model) for shape in (IO, COMPUTE)] + [
    (f"{shape}: every excess explained, <= {UNEXPLAINED_MAX:.0%} unexplained", shape, _explained)
    for shape in (IO, COMPUTE)] + [
    (f"{shape}: every traced step typical, within {TYPICAL:.0%}", shape, _typical) for shape in (IO, COMPUTE)]]


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
        if st.get("drive"):
            lines.append(drive_text(st["drive"]))
        if drive:
            lines.append(f"drive in the step's pattern: write {drive['write'] / 1e9:.2f}, read {drive['read'] / 1e9:.2f} GB/s")
        floors = {e: g for e, g in ((e, floor_of(st, e)) for e in ("memory", "posix")) if g}
        if floors:
            lines.append(f"activation-peak target {PEAK_MAX.get(name, '?')}x keep's; floor: " + "; ".join(
                f"{e} {floor_text(f)} at the {rates} rates" for e, (f, rates) in floors.items()))
        lines += render_points(st["points"])
        against = vs_keep_lines(st)
        lines += [""] + against if against else []
        model = (st.get("model") or {}).get("points") or {}
        if model:
            lines += ["", "the planner's prediction with this box's figures against the measured step:"]
            lines += [f"  {n:<22} predicted {v['predicted_s'] * 1e3:8.1f} ms  measured {v['measured_s'] * 1e3:8.1f} ms  "
                      f"({v['error']:+.0%})" for n, v in model.items()]
    return lines
