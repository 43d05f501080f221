"""What a stats JSONL (``stats_path``) says about offload that did not happen, for
``ssdtrain report --stats``: pass-through by reason over all steps, and each distinct
``not_offloaded_why`` (cache/silence.py) with the steps it applied to."""

from __future__ import annotations

import json
from typing import Any, Dict, List

from .report import TraceError


def summarize_stats(path: str) -> Dict[str, Any]:
    """Read a stats JSONL file (records of several offloaders or ranks may be mixed; lines
    without a ``step``, such as a run header, are skipped).

    Raises:
        TraceError: the file cannot be read or a line is not JSON (names file and line).
    """
    by_reason: Dict[str, int] = {}
    why: Dict[str, List[int]] = {}
    steps = passed = 0
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.readlines()
    except OSError as exc:
        raise TraceError(f"{path}: {exc.strerror or exc}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            raise TraceError(f"{path}, line {n}: not a JSON record") from None
        if not isinstance(rec, dict) or "step" not in rec:
            continue
        steps += 1
        passed += int(rec.get("tensors_passed_through", 0))
        for reason, count in (rec.get("passed_through_by_reason") or {}).items():
            by_reason[reason] = by_reason.get(reason, 0) + int(count)
        text = rec.get("not_offloaded_why") or ""
        if text:
            why.setdefault(text, []).append(int(rec.get("iteration", rec["step"] + 1)))
    return {"stats": path, "steps": steps, "tensors_passed_through": passed,
            "passed_through_by_reason": dict(sorted(by_reason.items())),
            "not_offloaded": [{"why": w, "iterations": its} for w, its in why.items()]}


def render_stats_summary(summary: Dict[str, Any]) -> str:
    """Markdown: the section ``ssdtrain report --stats`` prints."""
    out = [f"## Offload that did not happen ({summary['stats']}, {summary['steps']} step records)",
           ""]
    reasons = summary["passed_through_by_reason"]
    out.append(f"Saved tensors left to autograd: {summary['tensors_passed_through']}"
               + (" (" + ", ".join(f"{r}: {n}" for r, n in reasons.items()) + ")" if reasons else ""))
    out.append("")
    if not summary["not_offloaded"]:
        out.append("Every step after the first offloaded (no NOT OFFLOADING warning).")
    for item in summary["not_offloaded"]:
        its = item["iterations"]
        span = f"iteration {its[0]}" if len(its) == 1 else f"{len(its)} iterations from {its[0]}"
        out.append(f"- NOT OFFLOADING ({span}): {item['why']}")
    return "\n".join(out) + "\n"
