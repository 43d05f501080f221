"""Where a step's time above its bound went, by cause, from its timeline (telemetry/timeline.py).

Why a partition: causes overlap in time (the training thread blocks on a read inside an unpack
hook while the compute stream waits on a reload), and summing them would count one
millisecond three times. So the step's window is split, instant by instant, in a fixed order
of priority (telemetry/intervals.py), and the parts add up to the window by construction:
that they add up proves nothing. Two judgements can fail instead:

- **explained**: the parts that name no cause ("idle while the host was busy", "compute
  beyond keep's": the rest of the partition) add up to at most UNEXPLAINED_MAX of the
  measured excess (the median step less the bound). A breakdown that found its causes passes;
  one that puts the excess in the rest fails.
- **typical**: the parts (the trace's step less the bound) come within TYPICAL of the measured
  excess: the timeline is one step, so a row that misses says that step was not the median's.

Two views, after the resource the bound names (telemetry/bounds.py):

- **an IO resource binds** (the link one way or both ways, or the drive): the bound assumes it
  busy the whole step at the assumed rate. Its busy time (the union of its copies or drive
  chunks) less the bound is the resource running slower than assumed; for the link both ways
  that is split (:func:`link_parts`) into each direction alone against its measured rate,
  both at once against the both-ways rate, and the directions not overlapped (what moving
  the bytes one way at a time cost over the bound: the schedule's shape, not the link's
  speed). Every instant it was idle goes, in this order, to: the head (before its first
  byte), the tail (after its last), a collector pause, the training thread blocked on the offloader (by reason), the training
  thread in the offloader's own code (pack, unpack, drain), the compute stream waiting on a
  reload, and else "idle while the host was busy" (the pipeline did not feed it).
- **compute binds** (keep's step): both steps' windows (this one's and keep's) are split the
  same way on the compute stream: the tail (after its last event), waits on reloads (GPU
  spans), the GPU idle waiting for the host while the training thread did not issue work (a
  collector pause, a wait on the offloader, the offloader's code: the stream's last event
  issued before such a span says when it ran dry, estimated by that event's GPU time), and the
  rest (kernels and launch gaps). Each part is this step's less keep's.

Events are :class:`~ssdtrain_megatron.telemetry.timeline.Timeline` events (``tl.events``
after ``stop``): times in µs from the timeline's start; the training side is every host
thread that is not one of the IO engines' ("ssdtrain-*"). Pure: no torch.
"""

from __future__ import annotations

import bisect
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from .bounds import SCHEDULE, Bound
from .intervals import Interval, clip, intersect, length, partition, union
from .timeline import WAIT_REASONS

__all__ = ["breakdown", "partition_io", "partition_compute", "io_figures", "link_parts", "step_window", "TYPICAL",
           "UNEXPLAINED_MAX"]

TYPICAL = 0.10
"""The traced step is typical when its parts come within this fraction of the measured excess."""
UNEXPLAINED_MAX = 0.20
"""At most this fraction of the measured excess may sit in parts that name no cause."""
MIN_EXCESS = 0.02
"""Below this fraction of the bound there is no excess to split: the row says so."""

HOST_CPU = "offloader host CPU"
RELOAD = "compute waiting on reloads"
GC = "gc pauses"
HEAD = "head: before the first byte moved"
TAIL = "tail"
COMPUTE = "compute stream beyond keep's (slower kernels, launch gaps)"
IDLE_BUSY = "idle while the host was busy"
"""The IO view's rest: the resource idle and no cause found on the host."""
NOT_OVERLAPPED = "directions not overlapped"
BOTH_SLOWER = "both ways at once slower than measured"
GPU_IDLE = "GPU idle waiting for the host: "
"""The compute view's prefix of the stream's idle time by what the host was doing."""
HOST_REASONS = tuple(r for r in WAIT_REASONS if r != "reload")


def blocked(reason: str) -> str:
    return f"host blocked: {reason}"


def _training(e: dict) -> bool:
    return e["pid"] == "host" and not str(e.get("tid", "")).startswith("ssdtrain")


def _span(e: dict) -> Interval:
    return e["ts"], e["ts"] + e.get("dur", 0.0)


def _spans(events: Iterable[dict]) -> List[Interval]:
    return [_span(e) for e in events if e.get("ph") == "X"]


def step_window(events: Sequence[dict]) -> Interval:
    """The step's window in µs: the host span of category "step" (the measure step marks it),
    else from the first event to the end of the last."""
    steps = [e for e in events if e["cat"] == "step" and e["pid"] == "host" and e.get("ph") == "X"]
    if steps:
        return _span(max(steps, key=lambda e: e.get("dur", 0.0)))
    ends = [_span(e) for e in events if e.get("ph") in ("X", "i")]
    return (min(a for a, _ in ends), max(b for _, b in ends)) if ends else (0.0, 0.0)


def _host_layers(events: Sequence[dict]) -> List[Tuple[str, List[Interval]]]:
    """(cause, spans) of the training side not issuing work, in priority order."""
    host = [e for e in events if _training(e)]
    out = [(GC, _spans(e for e in events if e["cat"] == "gc"))]
    out += [(blocked(r), _spans(e for e in host if e["cat"] == "wait" and e["name"] == r)) for r in HOST_REASONS]
    out.append((HOST_CPU, _spans(e for e in host if e["cat"] in ("hook", "drain"))))
    return out


def _resource_spans(events: Sequence[dict], resource: str) -> List[Interval]:
    if resource == "drive":  # the drive's own rows (the memory engine's pool copies have theirs)
        return union(_spans(e for e in events if e["pid"] == "drive" and e["tid"] in ("write", "read")))
    names = {"d2h": ("d2h",), "h2d": ("h2d",), "link": ("d2h", "h2d")}[resource]
    return union(_spans(e for e in events if e["pid"] == "gpu" and e["cat"] == "copy" and e["name"] in names))


def _reload_waits(events: Sequence[dict]) -> List[Interval]:
    return _spans(e for e in events if e["pid"] == "gpu" and e["tid"] == "compute" and e["cat"] == "wait")


def partition_io(events: Sequence[dict], resource: str, window: Optional[Interval] = None) -> Dict[str, float]:
    """The window (µs) split for an IO resource that binds (module docstring), in seconds:
    ``busy`` and each cause of its idle time."""
    w = window or step_window(events)
    busy = clip(_resource_spans(events, resource), *w)
    label = "drive" if resource == "drive" else "link"
    head = [(w[0], busy[0][0])] if busy else [w]
    tail = [(busy[-1][1], w[1])] if busy else []
    layers = [("busy", busy), (HEAD, head), (TAIL, tail)] + _host_layers(events) + [(RELOAD, _reload_waits(events))]
    return {k: v / 1e6 for k, v in partition(w, layers, f"{label} {IDLE_BUSY}").items()}


def partition_compute(events: Sequence[dict], window: Optional[Interval] = None) -> Dict[str, float]:
    """The window (µs) split on the compute stream (module docstring), in seconds: ``compute``
    (kernels and launch gaps), the tail, reload waits, and the stream idle by host cause."""
    w = window or step_window(events)
    gpu = sorted((e for e in events if e["pid"] == "gpu" and e["tid"] == "compute" and e["cat"] != "step"),
                 key=lambda e: e["args"].get("issued_us", e["ts"]))
    last_end = max((_span(e)[1] for e in gpu), default=w[0])
    layers: List[Tuple[str, List[Interval]]] = [(TAIL, [(last_end, w[1])]), (RELOAD, _reload_waits(events))]
    for cause, spans in _host_layers(events):
        layers.append((GPU_IDLE + cause, [(max(a, _ran_dry(gpu, a, w[0])), b) for a, b in spans]))
    return {k: v / 1e6 for k, v in partition(w, layers, "compute").items()}


def _ran_dry(gpu: Sequence[dict], t: float, start: float) -> float:
    """When the compute stream ran out of the work issued before host time ``t``: the GPU time
    of the last compute event issued by then (its end, where that was issued by then too); an
    estimate from below (kernels issued after that event and before ``t`` ran after it)."""
    lo = bisect.bisect_right(gpu, t, key=lambda e: e["args"].get("issued_us", e["ts"]))
    if lo == 0:
        return start
    e = gpu[lo - 1]
    end_issued = e["args"].get("end_issued_us")
    return _span(e)[1] if e.get("ph") == "X" and end_issued is not None and end_issued <= t else e["ts"]


def _copies(events: Sequence[dict], name: str) -> List[dict]:
    return [e for e in events if e["pid"] == "gpu" and e["cat"] == "copy" and e["name"] == name and e.get("ph") == "X"]


def link_split(events: Sequence[dict], window: Optional[Interval] = None) -> Dict[str, float]:
    """The link's copies in ``window`` (µs) split by whether the other direction ran at the same
    time: bytes and seconds of D2H alone, H2D alone, and both at once (a copy's bytes are
    shared in proportion to its time inside the other direction's copies)."""
    w = window or step_window(events)
    d2h, h2d = _copies(events, "d2h"), _copies(events, "h2d")
    sets = {"d2h": clip(union(_spans(d2h)), *w), "h2d": clip(union(_spans(h2d)), *w)}
    both = intersect(sets["d2h"], sets["h2d"])
    out = {"both_s": length(both) / 1e6, "both_bytes": 0.0}
    for key, chosen in (("d2h", d2h), ("h2d", h2d)):
        alone = 0.0
        for e in chosen:
            span = _span(e)
            inside = clip([span], *w)
            if not inside or span[1] <= span[0]:
                continue
            nbytes = float(e["args"].get("bytes", 0)) * length(inside) / (span[1] - span[0])
            shared = length(intersect(inside, both)) / length(inside)
            alone += nbytes * (1 - shared)
            out["both_bytes"] += nbytes * shared
        out[f"{key}_alone_bytes"] = alone
        out[f"{key}_alone_s"] = (length(sets[key]) - length(both)) / 1e6
    return out


def link_parts(events: Sequence[dict], bound: Bound, rates: Dict[str, float],
               window: Optional[Interval] = None) -> Optional[Dict[str, float]]:
    """The link's busy time (both directions' union) less ``bound`` where both directions bind,
    as: each direction alone slower than its measured rate (its time alone less its bytes
    alone over ``rates["d2h"]`` / ``["h2d"]``), both at once slower than ``rates["both"]``, and
    the directions not overlapped: the time the bytes need at the measured rates as they were
    scheduled (alone one way, or together) less the bound, the cost of the schedule's shape
    ("beyond what the schedule allows" where the bound is the schedule's own term). The four
    add up to busy less the bound. None without the three rates."""
    if not all(rates.get(k) for k in ("d2h", "h2d", "both")):
        return None
    x = link_split(events, window)
    need_d, need_h = x["d2h_alone_bytes"] / rates["d2h"], x["h2d_alone_bytes"] / rates["h2d"]
    need_both = x["both_bytes"] / rates["both"]
    not_overlapped = NOT_OVERLAPPED + (" beyond what the schedule allows" if bound.formula == SCHEDULE else "")
    return {"D2H alone slower than measured": x["d2h_alone_s"] - need_d,
            "H2D alone slower than measured": x["h2d_alone_s"] - need_h,
            BOTH_SLOWER: x["both_s"] - need_both,
            not_overlapped: need_d + need_h + need_both - bound.seconds}


def io_figures(events: Sequence[dict], assumed: Optional[Dict[str, float]] = None) -> dict:
    """Bytes, busy seconds and achieved GB/s of each direction of the link and of the drive's
    writes and reads, the assumed GB/s beside them (``assumed``: bytes/s by the same keys), and
    the seconds D2H and H2D (and the drive's writes and reads) overlapped; the link's bytes,
    seconds and GB/s of D2H alone, H2D alone and both at once (``link_d2h_alone``,
    ``link_h2d_alone``, ``link_both``: :func:`link_split`), against the measured rates of each
    (``assumed`` "d2h", "h2d", "both")."""
    out: Dict[str, dict] = {}
    sets = {}
    for key, pick in (("d2h", lambda e: e["pid"] == "gpu" and e["cat"] == "copy" and e["name"] == "d2h"),
                      ("h2d", lambda e: e["pid"] == "gpu" and e["cat"] == "copy" and e["name"] == "h2d"),
                      ("drive_write", lambda e: e["pid"] == "drive" and e["tid"] == "write"),
                      ("drive_read", lambda e: e["pid"] == "drive" and e["tid"] == "read")):
        chosen = [e for e in events if pick(e) and e.get("ph") == "X"]
        sets[key] = union(_spans(chosen))
        nbytes = sum(int(e["args"].get("bytes", 0)) for e in chosen)
        busy = length(sets[key]) / 1e6
        out[key] = {"bytes": nbytes, "busy_s": busy, "gbps": nbytes / busy / 1e9 if busy > 0 else None}
        if assumed and assumed.get(key):
            out[key]["assumed_gbps"] = assumed[key] / 1e9
    out["link_overlap_s"] = length(intersect(sets["d2h"], sets["h2d"])) / 1e6
    out["drive_overlap_s"] = length(intersect(sets["drive_write"], sets["drive_read"])) / 1e6
    x = link_split(events)
    for key, prefix in (("d2h", "d2h_alone"), ("h2d", "h2d_alone"), ("both", "both")):
        n, t = x[f"{prefix}_bytes"], x[f"{prefix}_s"]
        out[f"link_{prefix}"] = {"bytes": n, "busy_s": t, "gbps": n / t / 1e9 if t > 0 else None}
        if assumed and assumed.get(key):
            out[f"link_{prefix}"]["assumed_gbps"] = assumed[key] / 1e9
    return out


def breakdown(events: Sequence[dict], step_s: float, bound: Bound, window: Optional[Interval] = None,
              keep_events: Optional[Sequence[dict]] = None, keep_window: Optional[Interval] = None,
              assumed: Optional[Dict[str, float]] = None) -> dict:
    """The excess ``step_s - bound.seconds`` split by cause (module docstring).

    Args:
        events: the step's timeline events; ``window`` its step (default: :func:`step_window`).
        step_s: the measured step time (the median of the timed steps).
        bound: what the step is judged against (telemetry/bounds.py).
        keep_events, keep_window: keep's timeline, where compute binds (without it keep's whole
            step counts as compute).
        assumed: the rates the bound assumed, bytes/s (keys of :func:`io_figures`, and "both"
            for both directions at once: :func:`link_parts` needs d2h, h2d and both).

    Returns: ``parts`` (cause -> seconds), their ``sum_s``, ``excess_s``, ``unexplained_s``
    (the parts that name no cause, positive ones summed; ``unexplained_parts`` their names),
    ``explained`` (at most UNEXPLAINED_MAX of the excess unexplained), ``gap_s`` (the excess
    less the parts) and ``typical`` (the gap within TYPICAL of the excess), both None when
    there is no excess to split; ``note`` (the bound's), ``timeline_step_s``, ``io``
    (:func:`io_figures`), ``host_blocked_s`` (the training side's waits by reason, summed).
    """
    w = window or step_window(events)
    if bound.resource == "compute":
        mine = partition_compute(events, w)
        if keep_events is not None:
            keep = partition_compute(keep_events, keep_window or step_window(keep_events))
        else:
            keep = {"compute": bound.seconds}
        parts = {k: mine.get(k, 0.0) - keep.get(k, 0.0) for k in dict.fromkeys(list(mine) + list(keep))}
        parts[COMPUTE] = parts.pop("compute", 0.0)
    else:
        parts = partition_io(events, bound.resource, w)
        busy = parts.pop("busy")
        split = link_parts(events, bound, assumed or {}, w) if bound.resource == "link" else None
        label = {"drive": "drive", "d2h": "D2H", "h2d": "H2D"}.get(bound.resource, "link")
        parts = {**(split or {f"{label} slower than assumed": busy - bound.seconds}), **parts}
    parts = {k: v for k, v in parts.items() if abs(v) >= 1e-9}
    excess = step_s - bound.seconds
    total = sum(parts.values())
    has_excess = excess > MIN_EXCESS * bound.seconds
    unnamed = {k: v for k, v in parts.items() if (k == COMPUTE or k.endswith(IDLE_BUSY)) and v > 0}
    unexplained = sum(unnamed.values())
    host = [e for e in events if _training(e) and e["cat"] == "wait" and e.get("ph") == "X"]
    return {"bound_s": bound.seconds, "formula": bound.formula, "resource": bound.resource, "step_s": step_s,
            "note": bound.note, "timeline_step_s": (w[1] - w[0]) / 1e6, "excess_s": excess, "parts": parts,
            "sum_s": total, "gap_s": excess - total,
            "typical": abs(excess - total) <= TYPICAL * excess if has_excess else None,
            "unexplained_s": unexplained, "unexplained_parts": sorted(unnamed),
            "explained": unexplained <= UNEXPLAINED_MAX * excess if has_excess else None,
            "io": io_figures(events, assumed),
            "host_blocked_s": {r: sum(e["dur"] for e in host if e["name"] == r) / 1e6
                               for r in HOST_REASONS if any(e["name"] == r for e in host)}}
