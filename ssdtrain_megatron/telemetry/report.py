"""The IO characteristics of the offload traffic, from an IO trace (``ssdtrain report TRACE``).

The figures follow the storage characterisation of LLM training (Gunnam et al., PAPERS.md
section 2): request-size histogram, read/write mix, sequentiality, queue depth over time,
bandwidth over time per training phase, bytes written per step and the drive writes per day
they imply. This module reads the trace and computes those figures; the command
(``tools/report.py``) and ``tools/report_render.py`` turn them into Markdown and PNG plots.

Definitions (they decide the numbers, so they are stated once, here):

- Times are per rank: each rank's ``t`` counts from its own tracer start. A trace may hold
  several ranks' records (files concatenated); requests are ordered by ``(rank, t)`` and line
  order breaks ties, since the tracer appends records in completion order, not submit order.
- A request is *contiguous* when its offset equals ``offset + bytes`` of the previous request
  (of either op) that the same rank submitted to the same file. The first request to a file
  has no predecessor and is not contiguous. Shares are over all requests of the op.
- The *span* of a set of requests runs from the first submit to the last completion. The
  write rate for endurance is bytes written / span; drive writes per day = rate x 86400 /
  drive bytes, drive size in decimal TB (1 TB = 1e12 B).
- The timeline starts at the first submit and is cut into equal buckets. A request's bytes
  are spread evenly over its submit-to-completion interval, so bucket bandwidth is what the
  drive moved in that bucket; queue depth in a bucket is over the requests submitted in it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

PHASES = ("forward", "backward", "step_end")
OPS = ("write", "read")
DEFAULT_DRIVE_TB = 3.84
TIMELINE_BUCKETS = 50
"""The automatic bucket width aims at about this many buckets over the span."""
SECONDS_PER_DAY = 86400


class TraceError(ValueError):
    """The trace cannot be read; the message names the file and, where it applies, the line."""


@dataclass(frozen=True, slots=True)
class IORecord:
    """One IO request of the trace (a chunk of at most ``chunk_bytes``)."""

    t: float
    """Submit time, seconds since this rank's tracer started."""
    rank: int
    step: int
    microbatch: Optional[str]
    layer: Optional[str]
    phase: str
    """'forward', 'backward' or 'step_end'."""
    op: str
    """'write' or 'read'."""
    bytes: int
    file: str
    offset: int
    latency_s: float
    """Submit to completion."""
    queue_depth: int
    """Requests of the engine in flight at submit, this one included."""

    @property
    def end_t(self) -> float:
        return self.t + self.latency_s


# -- reading the trace ------------------------------------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


# key -> (check, what the value must be)
_FIELDS: Dict[str, Tuple[Any, str]] = {
    "t": (lambda v: _is_number(v) and v >= 0, "a number >= 0"),
    "rank": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "step": (_is_int, "an integer"),
    "microbatch": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "layer": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "phase": (lambda v: v in PHASES, "one of " + ", ".join(PHASES)),
    "op": (lambda v: v in OPS, "one of " + ", ".join(OPS)),
    "bytes": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "file": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "offset": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "latency_s": (lambda v: _is_number(v) and v >= 0, "a number >= 0"),
    "queue_depth": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
}


def parse_trace(lines: Iterable[str], source: str) -> List[IORecord]:
    """Records of a JSONL trace, in line order; blank lines are skipped, unknown keys ignored.

    Raises:
        TraceError: ``"{source}:{line}: ..."`` for the first line that is not a JSON object
            with every key of the trace format holding a valid value, or ``"{source}: ..."``
            when there is no record at all.
    """
    records: List[IORecord] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})")
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        missing = [k for k in _FIELDS if k not in obj]
        if missing:
            raise TraceError(f"{where}: missing key(s) {', '.join(missing)}")
        for key, (check, expected) in _FIELDS.items():
            if not check(obj[key]):
                raise TraceError(f"{where}: {key!r} must be {expected}, got {obj[key]!r}")
        records.append(IORecord(**{k: obj[k] for k in _FIELDS}))
    if not records:
        raise TraceError(f"{source}: no IO records (is trace_path set and did any IO run?)")
    return records


def load_trace(path: str) -> List[IORecord]:
    """``parse_trace`` of a file.

    Raises:
        TraceError: unreadable file, or what ``parse_trace`` raises.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            return parse_trace(fh, path)
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror or exc}")
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not UTF-8 text ({exc.reason})")


# -- the figures --------------------------------------------------------------------------------


def size_bucket(nbytes: int) -> int:
    """Power-of-two bucket of a request size: the largest power of two <= nbytes (0 for 0)."""
    return 1 << (nbytes.bit_length() - 1) if nbytes > 0 else 0


def nice_bucket_s(span_s: float, buckets: int = TIMELINE_BUCKETS) -> float:
    """The smallest 1-2-5 x 10^k width that cuts ``span_s`` into at most ``buckets`` buckets."""
    raw = span_s / buckets
    if raw <= 0:
        return 1.0
    scale = 10.0 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if m * scale >= raw:
            return m * scale
    return 10 * scale  # not reached; keeps type checkers happy


def _span(records: Sequence[IORecord]) -> Tuple[float, float]:
    return min(r.t for r in records), max(r.end_t for r in records)


def _submit_order(records: Sequence[IORecord]) -> List[IORecord]:
    # sorted() is stable, so requests submitted at the same instant keep their line order.
    return sorted(records, key=lambda r: (r.rank, r.t))


def op_mix(records: Sequence[IORecord]) -> Dict[str, Dict[str, Any]]:
    """Per op: requests and bytes, their shares of all requests and bytes, latency mean/max."""
    total_n = len(records)
    total_b = sum(r.bytes for r in records)
    out: Dict[str, Dict[str, Any]] = {}
    for op in OPS:
        rows = [r for r in records if r.op == op]
        nbytes = sum(r.bytes for r in rows)
        out[op] = {
            "requests": len(rows),
            "bytes": nbytes,
            "request_share": len(rows) / total_n if total_n else 0.0,
            "byte_share": nbytes / total_b if total_b else 0.0,
            "latency_mean_s": sum(r.latency_s for r in rows) / len(rows) if rows else None,
            "latency_max_s": max((r.latency_s for r in rows), default=None),
        }
    return out


def phase_mix(records: Sequence[IORecord]) -> Dict[str, Dict[str, Dict[str, int]]]:
    """``{phase: {op: {"requests", "bytes"}}}`` for every phase and op (zeros included)."""
    out = {p: {op: {"requests": 0, "bytes": 0} for op in OPS} for p in PHASES}
    for r in records:
        cell = out[r.phase][r.op]
        cell["requests"] += 1
        cell["bytes"] += r.bytes
    return out


def request_sizes(records: Sequence[IORecord]) -> List[Dict[str, int]]:
    """Power-of-two histogram, smallest bucket first: ``{"bucket_bytes", "write", "read"}``;
    a request of n bytes falls in the bucket of the largest power of two <= n."""
    counts: Dict[int, Dict[str, int]] = {}
    for r in records:
        row = counts.setdefault(size_bucket(r.bytes), {op: 0 for op in OPS})
        row[r.op] += 1
    return [{"bucket_bytes": b, **counts[b]} for b in sorted(counts)]


def sequentiality(records: Sequence[IORecord]) -> Dict[str, Dict[str, Any]]:
    """Per op and for all requests: ``{"requests", "contiguous", "share"}`` (see module doc)."""
    next_offset: Dict[Tuple[int, str], int] = {}
    counts = {k: [0, 0] for k in (*OPS, "all")}
    for r in _submit_order(records):
        key = (r.rank, r.file)
        hit = next_offset.get(key) == r.offset
        next_offset[key] = r.offset + r.bytes
        for k in (r.op, "all"):
            counts[k][0] += 1
            counts[k][1] += hit
    return {k: {"requests": n, "contiguous": c, "share": c / n if n else 0.0}
            for k, (n, c) in counts.items()}


def queue_depths(records: Sequence[IORecord]) -> Dict[str, Any]:
    """Distribution of the queue depth at submit: ``{"histogram": [{"depth", "requests"}],
    "mean", "max"}`` over all requests, and the same mean/max per rank."""
    hist: Dict[int, int] = {}
    for r in records:
        hist[r.queue_depth] = hist.get(r.queue_depth, 0) + 1
    per_rank = []
    for rank in sorted({r.rank for r in records}):
        qd = [r.queue_depth for r in records if r.rank == rank]
        per_rank.append({"rank": rank, "mean": sum(qd) / len(qd), "max": max(qd)})
    return {
        "histogram": [{"depth": d, "requests": hist[d]} for d in sorted(hist)],
        "mean": sum(r.queue_depth for r in records) / len(records),
        "max": max(r.queue_depth for r in records),
        "per_rank": per_rank,
    }


def timeline(records: Sequence[IORecord], bucket_s: Optional[float] = None) -> Dict[str, Any]:
    """Bandwidth per phase and op, and queue depth, in equal time buckets (see module doc).

    Returns ``{"start_s", "bucket_s", "buckets", "bandwidth_gbps": {phase: {op: [GB/s per
    bucket]}}, "queue_depth_mean": [...], "queue_depth_max": [...]}``; queue-depth entries of
    buckets in which nothing was submitted are None. Bandwidth is summed over ranks.
    """
    start, end = _span(records)
    if bucket_s is None:
        bucket_s = nice_bucket_s(end - start)
    n = max(1, math.ceil((end - start) / bucket_s))
    moved = {p: {op: [0.0] * n for op in OPS} for p in PHASES}
    qd_sum = [0] * n
    qd_n = [0] * n
    qd_max: List[Optional[int]] = [None] * n
    for r in records:
        s = r.t - start
        e = s + r.latency_s
        first = min(int(s // bucket_s), n - 1)
        # The last bucket with a positive overlap: an IO ending on a boundary stays left of it.
        last = min(max(first, math.ceil(e / bucket_s) - 1), n - 1)
        row = moved[r.phase][r.op]
        if first == last:
            row[first] += r.bytes
        else:
            for i in range(first, last + 1):
                overlap = min(e, (i + 1) * bucket_s) - max(s, i * bucket_s)
                row[i] += r.bytes * max(0.0, overlap) / r.latency_s
        qd_sum[first] += r.queue_depth
        qd_n[first] += 1
        qd_max[first] = max(qd_max[first] or 0, r.queue_depth)
    return {
        "start_s": start,
        "bucket_s": bucket_s,
        "buckets": n,
        "bandwidth_gbps": {p: {op: [b / bucket_s / 1e9 for b in moved[p][op]] for op in OPS}
                           for p in PHASES},
        "queue_depth_mean": [qd_sum[i] / qd_n[i] if qd_n[i] else None for i in range(n)],
        "queue_depth_max": qd_max,
    }


def bytes_per_step(records: Sequence[IORecord]) -> List[Dict[str, int]]:
    """Per step (all ranks together): ``{"step", "bytes_written", "bytes_read", "writes",
    "reads", "bytes_unread"}``, in step order. ``bytes_unread``: written and never read back,
    drive bandwidth spent for nothing (StepStats.bytes_wasted, as the trace sees it)."""
    steps: Dict[int, Dict[str, int]] = {}
    for r in records:
        row = steps.setdefault(r.step, {"step": r.step, "bytes_written": 0, "bytes_read": 0,
                                        "writes": 0, "reads": 0})
        if r.op == "write":
            row["bytes_written"] += r.bytes
            row["writes"] += 1
        else:
            row["bytes_read"] += r.bytes
            row["reads"] += 1
    for row in steps.values():
        row["bytes_unread"] = max(0, row["bytes_written"] - row["bytes_read"])
    return [steps[s] for s in sorted(steps)]


def drive_writes_per_day(bytes_written: int, span_s: float, drive_tb: float) -> Optional[float]:
    """Full-drive writes per day at the observed rate; None when the span is zero."""
    if span_s <= 0:
        return None
    return bytes_written / span_s * SECONDS_PER_DAY / (drive_tb * 1e12)


def endurance(records: Sequence[IORecord], drive_tb: float) -> Dict[str, Any]:
    """Write rate and drive writes per day, per rank (one drive of ``drive_tb`` each) and for
    all ranks together (as if they shared one drive; spans of different ranks' clocks)."""

    def row(rows: Sequence[IORecord]) -> Dict[str, Any]:
        start, end = _span(rows)
        written = sum(r.bytes for r in rows if r.op == "write")
        span = end - start
        return {"bytes_written": written, "span_s": span,
                "write_gbps": written / span / 1e9 if span > 0 else None,
                "dwpd": drive_writes_per_day(written, span, drive_tb)}

    per_rank = [{"rank": rank, **row([r for r in records if r.rank == rank])}
                for rank in sorted({r.rank for r in records})]
    return {"drive_tb": drive_tb, "per_rank": per_rank, "all_ranks": row(records)}


def analyze(records: Sequence[IORecord], drive_tb: float = DEFAULT_DRIVE_TB,
            bucket_s: Optional[float] = None) -> Dict[str, Any]:
    """Every figure of the report, as one JSON-ready dict (the ``--json`` output, less
    ``trace`` and ``files``)."""
    if not records:
        raise ValueError("analyze: no records")
    start, end = _span(records)
    return {
        "requests": len(records),
        "ranks": sorted({r.rank for r in records}),
        "span_s": end - start,
        "mix": op_mix(records),
        "phases": phase_mix(records),
        "request_sizes": request_sizes(records),
        "sequentiality": sequentiality(records),
        "queue_depth": queue_depths(records),
        "timeline": timeline(records, bucket_s),
        "steps": bytes_per_step(records),
        "endurance": endurance(records, drive_tb),
    }
