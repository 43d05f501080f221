"""`ssdtrain bench`'s loss comparison: every strategy's losses against keep's, bit for bit, and
where they first differ.

Why: bitwise equality is the product's first promise, and a run that breaks it must say exactly
where: the strategy, the micro-batch size, the step (warm-up steps count from 0) and the
micro-batch within it, and both losses' bits (``float.hex``: ``==`` on floats says 0.0 == -0.0).
A second keep run (``keep-control``, a model and a keep offloader of its own, taking its turns
like the others) is the control: where keep differs from keep, the arithmetic of this process
is not reproducible at all (a BLAS that splits its work by load, say), and a difference of
another strategy says nothing about offloading; where the control agrees and a strategy does
not, the strategy changed the numbers.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

CONTROL = "keep-control"


def loss_bits(values: Sequence[float]) -> List[str]:
    return [float(v).hex() for v in values]


def first_difference(name: str, mb: int, got: List[List[float]], keep: List[List[float]]) -> Optional[dict]:
    """The first (step, micro-batch) where ``got``'s per-micro-batch losses differ from
    ``keep``'s in any bit; None when they agree (over the steps both ran)."""
    for step, (a, b) in enumerate(zip(got, keep)):
        for i, (x, y) in enumerate(zip(loss_bits(a), loss_bits(b))):
            if x != y:
                return {"strategy": name, "micro_batch": mb, "step": step, "microbatch_index": i,
                        "value_bits": x, "keep_bits": y, "value": float.fromhex(x), "keep": float.fromhex(y)}
        if len(a) != len(b):
            return {"strategy": name, "micro_batch": mb, "step": step, "microbatch_index": min(len(a), len(b)),
                    "value_bits": None, "keep_bits": None, "value": None, "keep": None}
    if len(got) != len(keep):
        return {"strategy": name, "micro_batch": mb, "step": min(len(got), len(keep)), "microbatch_index": None,
                "value_bits": None, "keep_bits": None, "value": None, "keep": None}
    return None


def compare_losses(series: Dict[tuple, object], same: Sequence[str]) -> dict:
    """Each strategy's per-micro-batch losses against keep's at the same micro-batch size.
    ``same``: the strategies that must be bitwise equal to keep (recompute is reported apart).
    ``series``: (strategy, micro-batch size) -> an object with ``mb_losses``."""
    diffs = []
    for (name, mb), ser in sorted(series.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        keep = series.get(("keep", mb))
        if name == "keep" or keep is None:
            continue
        d = first_difference(name, mb, ser.mb_losses, keep.mb_losses)
        if d is not None:
            diffs.append(d)
    names = {n for n, _ in series}
    differing = {d["strategy"] for d in diffs}
    return {
        "losses_bitwise_equal": not (differing & set(same)),
        "recompute_losses_bitwise_equal": ("recompute" not in differing) if "recompute" in names else None,
        "control_losses_bitwise_equal": (CONTROL not in differing) if CONTROL in names else None,
        "first_differences": diffs,
    }


def render_differences(summary: dict) -> List[str]:
    """The lines the table ends with: each strategy's first difference, and what the control says."""
    lines = []
    for d in summary.get("first_differences", []):
        if d["value_bits"] is None:
            lines.append(f"  {d['strategy']} at micro-batch {d['micro_batch']}: ran a different number of steps "
                         f"or micro-batches than keep from step {d['step']}")
            continue
        lines.append(f"  first difference: {d['strategy']} at micro-batch {d['micro_batch']}, step {d['step']}, "
                     f"micro-batch {d['microbatch_index']}: {d['value_bits']} ({d['value']!r}) vs keep "
                     f"{d['keep_bits']} ({d['keep']!r})")
    control = summary.get("control_losses_bitwise_equal")
    if control is False:
        lines.append("  the control (keep-control, a second keep run) differs from keep: this process's "
                     "arithmetic is not reproducible here, and the differences above say nothing about "
                     "offloading")
    elif control and summary.get("first_differences"):
        lines.append("  the control (keep-control) agrees with keep: the strategies above changed the numbers")
    return lines
