"""`ssdtrain bench`: how far a ratio can be trusted.

A step-time ratio is the median of one strategy over the median of another. The strategies
take turns round by round, so each measured round gives one paired ratio (this round's step of
one over this round's step of the other): noise that hits a whole round cancels in it, noise
that hits one step does not. ``ratio_spread`` reports, per step-time ratio, the min / median /
max of those paired ratios, and ``within_noise`` when half their range is larger than the
difference the ratio reports (|ratio - 1|): then the bench cannot tell the two apart.
"""

from __future__ import annotations

import statistics
from typing import Dict, List, Optional, Sequence


def paired(a: Sequence[float], b: Sequence[float]) -> Optional[Dict[str, float]]:
    """min / median / max of a[i] / b[i] over the rounds both ran; None without any."""
    ratios = [x / y for x, y in zip(a, b) if y > 0]
    if not ratios:
        return None
    return {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios)}


def ratio_spread(series: dict, ratios: Dict[str, float], ratio_mb: Optional[int], warmup: int,
                 best_fixed: Optional[str]) -> Dict[str, dict]:
    """The spread of every ``*_step_time`` ratio in ``ratios`` (see the module docstring).

    ``series`` maps (strategy, micro-batch) to what was measured (``times``, one per round)."""
    out: Dict[str, dict] = {}
    for key, value in ratios.items():
        if not key.endswith("_step_time"):
            continue
        a, _, b = key[:-len("_step_time")].partition("_vs_")
        b = best_fixed if b == "best_fixed" else b
        sa, sb = series.get((a, ratio_mb)), series.get((b, ratio_mb))
        if sa is None or sb is None:
            continue
        spread = paired(sa.times[warmup:], sb.times[warmup:])
        if spread is None:
            continue
        spread["within_noise"] = (spread["max"] - spread["min"]) / 2 > abs(value - 1.0)
        out[key] = spread
    return out


def render_spread(summary: dict) -> List[str]:
    """Lines for the table: each ratio's paired spread, and which ones noise can explain."""
    spread = summary.get("ratio_spread") or {}
    if not spread:
        return []
    lines = ["step-time ratios, paired round by round (min / median / max):"]
    for key, s in spread.items():
        note = "  the spread is larger than the difference: within noise" if s["within_noise"] else ""
        lines.append(f"  {key:<34} {s['min']:.2f} / {s['median']:.2f} / {s['max']:.2f}{note}")
    return lines
