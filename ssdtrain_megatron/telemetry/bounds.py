"""The fastest a step with offload can run, from what the box measured: the bound a step is
judged against, with the term that binds named.

Why these formulas (docs/gpu-check.md, "Judge fairly"):

- memory engine: the link is full-duplex, so writes (device -> host) and reads (host -> device)
  may overlap; the step can be no faster than keep's, than its writes over the D2H rate, its
  reads over the H2D rate, and all its bytes over the rate both directions reach together:
  ``max(keep, W / D2H, R / H2D, (W + R) / both-ways)``. The serial sum ``W/bw + R/bw`` of
  the first GPU run was lenient. But the schedule limits the overlap: with one micro-batch a
  record is read back only after its write, the writes land in save order and backward reads
  the last saved first, so the first read starts after every byte that will be read was
  written: ``R / D2H + R / H2D`` is a floor too, and where it exceeds ``(W + R) / both-ways``
  the schedule, not the link, makes both-ways unreachable (the bound's ``note`` says so).
- a drive does one thing at a time: ``max(keep, W / drive write + R / drive read)``.

The rates are the box's own, measured in the same run in the step's own pattern (the pool's
registered memory at the records' sizes; the engine writing and reading its slab):
ssdtrain_megatron/tools/gpucheck/gpu_check_bounds.py. Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict

__all__ = ["Bound", "BOTH_WAYS", "SCHEDULE", "link_bound", "drive_bound", "stall_beyond_deficit"]


@dataclass(frozen=True)
class Bound:
    """A step's bound: ``seconds``, the ``formula`` whose term binds, the ``resource`` it names
    ('compute' for keep's step, 'd2h', 'h2d', 'link' for both directions at once, 'drive'),
    every term's seconds (``terms``), and ``io_s``, the largest IO term (the time the IO needs
    at the measured rates, whatever binds), and ``note``: why a term cannot be reached where
    the schedule, not the resource, forbids it ("" otherwise)."""

    seconds: float
    formula: str
    resource: str
    terms: Dict[str, float] = field(default_factory=dict)
    io_s: float = 0.0
    note: str = ""

    def as_dict(self) -> dict:
        return {"seconds": self.seconds, "formula": self.formula, "resource": self.resource,
                "terms": dict(self.terms), "io_s": self.io_s, "note": self.note}


def _rate(name: str, bps: float) -> float:
    if not bps > 0:
        raise ValueError(f"{name}={bps!r} is invalid: expected a measured rate in bytes/s > 0")
    return float(bps)


def _pick(keep_s: float, io_terms: Dict[str, tuple]) -> Bound:
    """The largest of keep's step and the IO terms (formula -> (seconds, resource))."""
    if not keep_s >= 0:
        raise ValueError(f"keep_s={keep_s!r} is invalid: expected keep's step time in seconds >= 0")
    terms = {"keep": keep_s, **{f: s for f, (s, _) in io_terms.items()}}
    io_s = max((s for s, _ in io_terms.values()), default=0.0)
    formula = max(terms, key=lambda f: terms[f])  # the first of equal terms: keep, then the IO's order
    resource = "compute" if formula == "keep" else io_terms[formula][1]
    return Bound(terms[formula], formula, resource, terms, io_s)


BOTH_WAYS = "(W + R) / both-ways"
SCHEDULE = "R / D2H + R / H2D (reads after their writes)"


def link_bound(keep_s: float, written: float, read: float, d2h_bps: float, h2d_bps: float,
               both_bps: float, reads_after_writes: bool = False) -> Bound:
    """The memory engine's bound: ``max(keep, W / D2H, R / H2D, (W + R) / both-ways)``, where
    ``both_bps`` is the bytes per second of D2H and H2D together, running at once; with
    ``reads_after_writes`` (one micro-batch a step: module docstring) also ``R / D2H + R /
    H2D``, and the ``note`` says when that makes both-ways unreachable.

    Raises:
        ValueError: a rate that is not > 0, or a negative keep time.
    """
    d2h, h2d, both = _rate("d2h_bps", d2h_bps), _rate("h2d_bps", h2d_bps), _rate("both_bps", both_bps)
    terms = {"W / D2H": (written / d2h, "d2h"), "R / H2D": (read / h2d, "h2d"),
             BOTH_WAYS: ((written + read) / both, "link")}
    if reads_after_writes:
        terms[SCHEDULE] = (read / d2h + read / h2d, "link")
    bound = _pick(keep_s, terms)
    if reads_after_writes and terms[SCHEDULE][0] > terms[BOTH_WAYS][0]:
        note = (f"both-ways unreachable: one micro-batch reads a record only after its write and the last "
                f"written first, so the first read waits for every byte read to be written; the schedule, "
                f"not the link, gives {terms[SCHEDULE][0] * 1e3:.1f} ms over both-ways' "
                f"{terms[BOTH_WAYS][0] * 1e3:.1f}")
        bound = Bound(bound.seconds, bound.formula, bound.resource, bound.terms, bound.io_s, note)
    return bound


def drive_bound(keep_s: float, written: float, read: float, write_bps: float, read_bps: float) -> Bound:
    """A drive engine's bound: ``max(keep, W / drive write + R / drive read)`` (a drive does one
    thing at a time).

    Raises:
        ValueError: a rate that is not > 0, or a negative keep time.
    """
    w, r = _rate("write_bps", write_bps), _rate("read_bps", read_bps)
    return _pick(keep_s, {"W / drive write + R / drive read": (written / w + read / r, "drive")})


def stall_beyond_deficit(blocked_s: float, io_s: float, keep_s: float) -> float:
    """Seconds the training thread was blocked beyond the IO deficit ``max(0, IO - keep)``:
    the wait a drive slower than compute forces is not the offloader's to remove."""
    return max(0.0, blocked_s - max(0.0, io_s - keep_s))
