"""The targets of `make gpu-check` (gpu_check.py) and the table it prints.

Every target has a row every time: PASS, FAIL, or NOT RUN with the reason (the step it needs was
not run, timed out, failed with an error, or skipped a point for lack of disk or time). The check
exits 0 only when every row is PASS, so a step that silently did not happen cannot pass.
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional, Tuple

from .gpu_check_optimizer import judge as optimizer_row

PASS, FAIL, NOT_RUN = "PASS", "FAIL", "NOT RUN"
STALL_MAX = 0.02  # the training thread's wait for the offloader beyond the IO deficit, of step time
PEAK_MAX = 0.5  # the activations' part of peak reserved memory, offload over keep
OVERLAP_MAX = 1.05  # offload's step time over its bound (gpu_check_bounds.py)
MIN_TIMED_STEPS = 5  # a point judged on fewer timed steps is not judged
Verdict = Tuple[Optional[bool], str]  # (True/False, detail) or (None, why not run)


def _status(step: dict) -> Verdict:
    if step.get("status") == "pass":
        return True, step.get("summary", "")
    if step.get("status") == "fail":
        return False, step.get("why", "")
    return None, _not_run_why(step)


def _not_run_why(step: dict) -> str:
    status = step.get("status", "not run")
    why = step.get("why", "")
    return why if status in ("not run", "skip") else f"step {status}: {why}"


def _megatron(step: dict) -> Verdict:
    m = step.get("megatron_core")
    if not isinstance(m, dict):
        return None, _not_run_why(step)
    return (m.get("version") == "0.16.1", m.get("version") or m.get("error", ""))


def _kvikio(step: dict) -> Verdict:
    k = step.get("kvikio")
    if not isinstance(k, dict):
        return None, _not_run_why(step)
    if k.get("error"):
        return False, k["error"]
    mode = (f"; kvikio prefers {k['mode']} mode" + (" (GPUDirect Storage)" if k["mode"] == "direct" else
            f" (POSIX through the page cache; nvidia-fs {'loaded' if k.get('nvidia_fs') else 'absent'})")
            if k.get("mode") else "")
    return not k.get("gds_unavailable"), f"kvikio {k.get('version')}" + (
        f"; gds engine unavailable: {k['gds_unavailable']}" if k.get("gds_unavailable") else "; gds engine available") + mode


def _gds(mode: str, step: dict) -> Verdict:
    """A gds bitwise row: passes only when the run was bitwise and in ``mode`` (direct:
    GPUDirect Storage; compat: kvikio's POSIX path). A run in the other mode proves nothing
    of this one: NOT RUN, saying so."""
    ran = step.get("kvikio_mode")
    if step.get("status") == "pass" and ran != mode:
        return None, f"the gds engine ran in kvikio's {ran or 'unknown'} mode, not {mode}"
    return _status(step)


def _syncs(step: dict) -> Verdict:
    if step.get("status") not in ("pass", "fail") or "offload_syncs" not in step:
        return None, _not_run_why(step)
    return (step["offload_syncs"] <= step["keep_syncs"],
            f"syncs per step: offload {step['offload_syncs']}, keep {step['keep_syncs']}")


def _points(step: dict) -> Dict[str, dict]:
    return {p["name"]: p for p in step.get("points", [])}


def _point(step: dict, name: str) -> Tuple[Optional[dict], str]:
    """A measured point of the measure step, or None and why there is none."""
    p = _points(step).get(name)
    if p is not None and p.get("ok") and p.get("steps_timed", 0) < MIN_TIMED_STEPS:
        return None, f"{name}: {p.get('steps_timed', 0)} of at least {MIN_TIMED_STEPS} timed steps ran"
    if p is not None and p.get("ok"):
        return p, ""
    if p is not None:
        return None, f"{name}: {p.get('error', 'failed')}"
    if step.get("status") in (None, "not run", "skip", "error"):
        return None, _not_run_why(step)
    return None, f"{name} was not measured (measure step {step.get('status')}: {step.get('why', 'ended before it')})"


def _keep_and_offload(engine: str, step: dict):
    """The keep and offload points at the step's micro-batch, or Nones and why one is missing."""
    k = step.get("micro_batch", 1)
    keep, why = _point(step, f"keep@{k}")
    off, why2 = _point(step, f"offload-{engine}@{k}")
    return keep, off, why or why2


def _stall(engine: str, step: dict, limit: float = STALL_MAX) -> Verdict:
    """The training thread's time blocked on the offloader beyond the IO deficit
    ``max(0, IO time - keep's step)``, of the step: a drive slower than compute forces the
    deficit, the offloader only what is beyond it (telemetry/bounds.py)."""
    keep, off, why = _keep_and_offload(engine, step)
    if keep is None or off is None:
        return None, why
    if "stall_beyond_fraction" not in off:
        return None, off.get("bound_why", "no bound was measured: the IO deficit is unknown")
    deficit = max(0.0, off["bound"]["io_s"] - keep["step_s"])
    frac = off["stall_beyond_fraction"]
    return frac <= limit, (f"{frac * 100:.2f}% beyond the IO deficit ({off['stall_s'] * 1e3:.1f} ms per step blocked on "
                           f"the offloader, deficit {deficit * 1e3:.1f} ms = max(0, IO {off['bound']['io_s'] * 1e3:.1f} - "
                           f"keep {keep['step_s'] * 1e3:.1f}); step {off['step_s'] * 1e3:.0f} ms)")


def _peak(engine: str, step: dict, limit: float = PEAK_MAX) -> Verdict:
    """The activations' part of the peak: peak reserved less memory at the step's start (after
    zero_grad: weights and optimizer state, which no offloader moves; the cache emptied after
    the warm-up). Allocated beside it, and the whole peaks: memory that ``record_stream``
    holds back is memory the user cannot use."""
    keep, off, why = _keep_and_offload(engine, step)
    if keep is None or off is None:
        return None, why
    return peak_verdict(off, keep, limit)


def peak_verdict(off: dict, keep: dict, limit: float) -> Verdict:
    if keep["activation_reserved"] <= 0:
        return None, "keep's peak reserved is no higher than memory at its step's start"
    r = off["activation_reserved"] / keep["activation_reserved"]
    g = 2 ** 30
    return r <= limit, (f"{r:.2f}x activation reserved ({off['activation_reserved'] / g:.2f} vs "
                        f"{keep['activation_reserved'] / g:.2f} GiB above the step's start; allocated "
                        f"{off['activation_bytes'] / g:.2f} vs {keep['activation_bytes'] / g:.2f} GiB); whole peak "
                        f"reserved {off['peak_reserved'] / g:.1f} vs {keep['peak_reserved'] / g:.1f} GiB, allocated "
                        f"{off['peak_bytes'] / g:.1f} vs {keep['peak_bytes'] / g:.1f} GiB")


def _overlap(engine: str, step: dict, limit: float = OVERLAP_MAX) -> Verdict:
    keep, off, why = _keep_and_offload(engine, step)
    if keep is None or off is None:
        return None, why
    return bound_verdict(off, keep, limit)


def bound_verdict(off: dict, keep: dict, limit: float) -> Verdict:
    """The point's median step over its bound, the formula that binds and every term named,
    keep + IO beside it (the bound assumes the IO hides entirely behind compute), and the
    bound's note where the schedule makes a term unreachable."""
    b = off.get("bound")
    if not b:
        return None, off.get("bound_why", "no bound was measured")
    r = off["step_s"] / b["seconds"]
    terms = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in b["terms"].items())
    return r <= limit, (f"{r:.2f}x: {off['step_s'] * 1e3:.1f} ms (median of {off['steps_timed']}, spread "
                        f"{off.get('spread', 0):.0%}) vs {b['formula']} = {b['seconds'] * 1e3:.1f} ms (ms: {terms}; "
                        f"keep + IO {(keep['step_s'] + b['io_s']) * 1e3:.1f})"
                        + (f"; {b['note']}" if b.get("note") else ""))


def _rok(step: dict) -> Verdict:
    k = step.get("micro_batch", 1)
    keep, why = _point(step, f"keep@{k}")
    ad, why2 = _point(step, f"adaptive@{k + 1}")
    rc, why3 = _point(step, f"recompute@{k + 1}")
    if keep is None or ad is None or rc is None:
        return None, why or why2 or why3
    keep_more = _points(step).get(f"keep@{k + 1}")
    detail = (f"tokens/s adaptive@{k + 1} {ad['tokens_per_s']:.0f}, keep@{k} {keep['tokens_per_s']:.0f}, "
              f"recompute@{k + 1} {rc['tokens_per_s']:.0f}")
    if not (keep_more and keep_more.get("oom")):
        return None, detail + f"; keep fit at {k + 1} in the budget: not the ROK regime"
    if not ad.get("settled") or not ad.get("still_settled", True):
        return None, (detail + f"; adaptive did not settle in {ad.get('warmup_steps', '?')} steps (or re-explored "
                      "while timed): its time is that of the plans it tried, not compared")
    return ad["tokens_per_s"] >= keep["tokens_per_s"] and ad["tokens_per_s"] > rc["tokens_per_s"], detail


def needs_drive(judge: Callable[[dict], Verdict]) -> Callable[[dict], Verdict]:
    """``judge`` of a row that times the drive: NOT RUN where the step's scratch was not a
    drive taking O_DIRECT (tmpfs, or O_DIRECT refused: gpu_drive.py), with the reason."""
    @functools.wraps(judge)
    def on_a_drive(step: dict) -> Verdict:
        problem = (step.get("drive") or {}).get("problem")
        return (None, problem) if problem else judge(step)
    return on_a_drive


def _drive(engine: str, judge: Callable[[dict], Verdict]) -> Callable[[dict], Verdict]:
    return needs_drive(judge) if engine == "posix" else judge


# (target, the step whose result judges it, judge). Order: as the steps run.
TARGETS: List[Tuple[str, str, Callable[[dict], Verdict]]] = [
    ("install: the bundle installs offline (pip --no-index)", "install", _status),
    ("import megatron.core 0.16.1", "imports", _megatron),
    ("import kvikio; the gds engine is available", "imports", _kvikio),
] + [(f"bitwise {e}: keep == offload, compute stream delayed", f"bitwise-{e}", _status)
     for e in ("posix", "memory", "tiered")] + [
    ("bitwise gds (GPUDirect Storage): keep == offload", "bitwise-gds", functools.partial(_gds, "direct")),
    ("bitwise gds-compat (kvikio compat mode): keep == offload", "bitwise-gds-compat", functools.partial(_gds, "compat")),
    ("stress: 50 steps bitwise, side stream, compact views", "stress", _status),
    ("cuda tests: every required one passed", "cuda-tests", _status),
    ("no host sync added by offload (memory engine)", "syncs", _syncs),
    ("optimizer offload + ours: pool, pinned, bitwise, time", "optimizer-offload", optimizer_row),
] + [(f"stall beyond the IO deficit offload-{e} <= {STALL_MAX:.0%} of step", "measure",
      _drive(e, functools.partial(_stall, e))) for e in ("memory", "posix")] + [
    (f"peak activation memory offload-{e} <= {PEAK_MAX}x keep", "measure", _drive(e, functools.partial(_peak, e)))
    for e in ("memory", "posix")] + [
    (f"overlap offload-{e} <= {OVERLAP_MAX}x its bound", "measure", _drive(e, functools.partial(_overlap, e)))
    for e in ("memory", "posix")] + [
    ("ROK: adaptive at K+1 >= keep's best and > recompute", "measure", _rok),
]


def targets(steps: Dict[str, dict], missing: Optional[Dict[str, str]] = None,
            table: Optional[List[Tuple[str, str, Callable[[dict], Verdict]]]] = None) -> List[dict]:
    """One row per target of ``table`` (default: TARGETS). ``missing``: why a step that has no
    result did not run."""
    rows = []
    for name, step_name, judge in TARGETS if table is None else table:
        step = steps.get(step_name)
        if step is None:
            ok, detail = None, (missing or {}).get(step_name, f"step {step_name} did not run")
        else:
            ok, detail = judge(step)
        rows.append({"target": name, "step": step_name, "detail": detail,
                     "result": NOT_RUN if ok is None else (PASS if ok else FAIL)})
    return rows


def render_points(points: List[dict]) -> List[str]:
    """The points' table: memory, time (median, spread, over the bound), stall, bytes; then each
    point's excess split by cause (telemetry/breakdown.py) and where its trace is."""
    g = 2 ** 30
    lines = [f"{'point':<22}{'reserved GiB':>13}{'act res GiB':>12}{'step ms':>9}{'spread':>7}{'x bound':>8}"
             f"{'stall %':>8}{'beyond %':>9}{'tokens/s':>10}{'written GB':>11}{'read GB':>9}"]
    for p in points:
        if not p.get("ok"):
            lines.append(f"{p['name']:<22}  {'out of memory' if p.get('oom') else p.get('error', 'failed')}")
            continue
        beyond = p.get("stall_beyond_fraction")
        lines.append(f"{p['name']:<22}{p['peak_reserved'] / g:>13.2f}{p.get('activation_reserved', 0) / g:>12.2f}"
                     f"{p['step_s'] * 1e3:>9.1f}{p.get('spread', 0):>7.0%}"
                     f"{p['vs_bound'] if 'vs_bound' in p else float('nan'):>8.2f}{100 * p['stall_fraction']:>8.2f}"
                     f"{100 * beyond if beyond is not None else float('nan'):>9.2f}{p['tokens_per_s']:>10.0f}"
                     f"{p['bytes_written'] / 1e9:>11.2f}{p['bytes_read'] / 1e9:>9.2f}")
    for p in points:
        b = p.get("breakdown")
        if not b:
            continue
        explained = {True: "explained", False: "NOT explained", None: "no excess to split"}[b["explained"]]
        typical = {True: "typical", False: "NOT typical", None: ""}[b["typical"]]
        lines += ["", f"{p['name']}: {b['step_s'] * 1e3:.1f} ms vs {b['formula']} {b['bound_s'] * 1e3:.1f} ms: excess "
                      f"{b['excess_s'] * 1e3:.1f} ms, {b['unexplained_s'] * 1e3:.1f} ms of it naming no cause "
                      f"({explained}); parts {b['sum_s'] * 1e3:.1f} ms (traced step {b['timeline_step_s'] * 1e3:.1f} "
                      f"ms{': ' + typical if typical else ''})" + (f"; trace {p['trace']['path']}" if p.get("trace") else "")]
        if b.get("note"):
            lines.append(f"  bound: {b['note']}")
        lines += [f"  {k:<58}{v * 1e3:>9.1f} ms" for k, v in sorted(b["parts"].items(), key=lambda kv: -abs(kv[1]))]
        lines += _io_lines(b, p.get("thread_cpu_s") or {})
    return lines


def _io_lines(b: dict, cpu: Dict[str, float]) -> List[str]:
    """What each link direction and the drive achieved against the bound's assumption, their
    overlap, the training side's waits by reason (summed) and each thread's CPU seconds."""
    moved = []
    for key, label in (("d2h", "D2H"), ("h2d", "H2D"), ("drive_write", "drive write"), ("drive_read", "drive read")):
        f = b["io"].get(key) or {}
        if f.get("bytes"):
            assumed = f" (assumed {f['assumed_gbps']:.1f})" if f.get("assumed_gbps") else ""
            moved.append(f"{label} {f['bytes'] / 1e9:.2f} GB at {f['gbps']:.1f} GB/s{assumed}")
    out = []
    if moved:
        out.append("  moved: " + ", ".join(moved) + f"; D2H and H2D overlapped {b['io']['link_overlap_s'] * 1e3:.1f} ms")
    split = []
    for key, label in (("link_d2h_alone", "D2H alone"), ("link_h2d_alone", "H2D alone"), ("link_both", "both at once")):
        f = b["io"].get(key) or {}
        if f.get("bytes"):
            measured = f" (measured {f['assumed_gbps']:.1f})" if f.get("assumed_gbps") else ""
            split.append(f"{label} {f['bytes'] / 1e9:.2f} GB at {f['gbps']:.1f} GB/s{measured}")
    if split:
        out.append("  link: " + ", ".join(split))
    if b.get("host_blocked_s"):
        out.append("  blocked (summed): " + ", ".join(f"{r} {v * 1e3:.1f} ms" for r, v in b["host_blocked_s"].items()))
    if cpu:
        out.append("  CPU s: " + ", ".join(f"{t} {v:.2f}" for t, v in sorted(cpu.items(), key=lambda kv: -kv[1])))
    return out


def render(data: dict, middle: Optional[Callable[[dict], List[str]]] = None) -> str:
    """The targets' table, then ``middle(data)``'s lines (by default the measure step's
    points), then one line per step; gpu_perf_targets.render gives its shapes as ``middle``."""
    lines = [f"{'target':<56} {'result':<7}  detail"]
    for t in data.get("targets", []):
        lines.append(f"{t['target'][:56]:<56} {t['result']:<7}  {t['detail']}")
    lines += (middle or _measure_lines)(data)
    lines.append("")
    for name, st in data.get("steps", {}).items():
        lines.append(f"step {name:<15} {st.get('status', '?'):<8} {st.get('seconds', '')}")
    return "\n".join(lines)


def _measure_lines(data: dict) -> List[str]:
    me = data.get("steps", {}).get("measure", {})
    return [""] + render_points(me["points"]) if me.get("points") else []
