"""Sets of time intervals, and the partition of a window among them by priority.

What the breakdown of a step's time (telemetry/breakdown.py) is made of: the union of a
stream's copies is the time the link was busy, and a window split among "the host was
blocked", "the host ran offloader code", ... in priority order is a partition: every instant
counted once, so the parts add up to the window exactly. Pure, no torch.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Sequence, Tuple

Interval = Tuple[float, float]

__all__ = ["Interval", "union", "length", "intersect", "subtract", "clip", "partition"]


def union(spans: Iterable[Interval]) -> List[Interval]:
    """The spans merged: sorted, disjoint, empty ones left out."""
    out: List[Interval] = []
    for a, b in sorted((a, b) for a, b in spans if b > a):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def length(merged: Sequence[Interval]) -> float:
    return sum(b - a for a, b in merged)


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> List[Interval]:
    """Both merged (see :func:`union`); the result is merged."""
    out: List[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Sequence[Interval], b: Sequence[Interval]) -> List[Interval]:
    """What of ``a`` lies outside ``b`` (both merged)."""
    out: List[Interval] = []
    j = 0
    for lo, hi in a:
        while j < len(b) and b[j][1] <= lo:
            j += 1
        k, cur = j, lo
        while k < len(b) and b[k][0] < hi:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = b[k][1]  # b is merged: each of its spans ends past the last
            k += 1
        if cur < hi:
            out.append((cur, hi))
    return out


def clip(merged: Sequence[Interval], lo: float, hi: float) -> List[Interval]:
    return intersect(merged, [(lo, hi)]) if hi > lo else []


def partition(window: Interval, layers: Sequence[Tuple[str, Iterable[Interval]]],
              rest: str) -> Dict[str, float]:
    """``window`` split among ``layers`` (name, spans) in priority order: each instant goes to
    the first layer whose spans cover it, else to ``rest``. Every name gets an entry; the
    values add up to the window's length (names repeated add up)."""
    left = [window] if window[1] > window[0] else []
    out: Dict[str, float] = {}
    for name, spans in layers:
        got = intersect(left, union(spans))
        out[name] = out.get(name, 0.0) + length(got)
        left = subtract(left, got)
    out[rest] = out.get(rest, 0.0) + length(left)
    return out
