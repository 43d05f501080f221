"""`ssdtrain bench` under a memory budget: adaptive against the best fixed strategy that fits.

The budget is ``--memory-budget`` or, without it, keep's peak activations at the middle
micro-batch size. Adaptive runs with ``activation_budget_bytes`` set to it (and
``recompute_fallback`` on, so that it may recompute where the drive cannot hide a layer);
at micro-batch sizes measured before a default budget is known (up to the middle one) it runs
without one, keeping everything, which fits by the budget's definition.

``budget_comparison`` adds to --json's ``ratios``:

  adaptive_vs_best_fixed_step_time  adaptive / the faster of offload and recompute, among those
                                    whose peak activations fit the budget, at the ratios'
                                    micro-batch size (the largest every strategy ran)
  adaptive_peak_vs_budget           adaptive's peak activations / the budget, at the same size,
                                    its exploration steps included (cli.py)
  adaptive_settle_steps             steps adaptive's measured selection took to settle there
                                    (cli.py; None: not within its bound)
"""

from __future__ import annotations

from typing import Dict, List, Optional

from ...config import OffloadConfig

FIXED = ("offload", "recompute")


def adaptive_config(cfg: OffloadConfig, budget: Optional[int]) -> OffloadConfig:
    """The adaptive contender's settings under ``budget`` (None: keep everything)."""
    if budget is None:
        return cfg.replace(activation_budget_bytes=None)
    return cfg.replace(activation_budget_bytes=budget, recompute_fallback=True)


def default_budget(sizes: List[int], keep_peaks: Dict[int, int]) -> Optional[int]:
    """Keep's peak at the middle micro-batch size, once measured (else None)."""
    return keep_peaks.get(sizes[len(sizes) // 2]) if sizes else None


def budget_comparison(at: Dict[tuple, object], ratio_mb: Optional[int], budget: Optional[int]) -> dict:
    """The ratios against the best fixed strategy, and which one it was.

    ``at`` maps (strategy, micro-batch) to a Point (step_s, peak_activation_bytes)."""
    out: dict = {"ratios": {}, "best_fixed": None}
    adaptive = at.get(("adaptive", ratio_mb))
    if adaptive is None or not budget:
        return out
    out["ratios"]["adaptive_peak_vs_budget"] = adaptive.peak_activation_bytes / budget
    fixed = [at[(n, ratio_mb)] for n in FIXED if (n, ratio_mb) in at
             and at[(n, ratio_mb)].peak_activation_bytes <= budget]
    if fixed:
        best = min(fixed, key=lambda p: p.step_s)
        out["best_fixed"] = best.strategy
        out["ratios"]["adaptive_vs_best_fixed_step_time"] = adaptive.step_s / max(best.step_s, 1e-12)
    return out


def render_lines(summary: dict) -> List[str]:
    """The table's lines about the budget comparison."""
    r = summary["ratios"]
    lines = []
    if "adaptive_vs_best_fixed_step_time" in r:
        lines.append(f"  {'adaptive / best fixed step time':<34} {r['adaptive_vs_best_fixed_step_time']:6.2f}"
                     f"  (best fixed within the budget: {summary.get('best_fixed')})")
    elif summary.get("memory_budget_bytes") and "adaptive_peak_vs_budget" in r:
        lines.append("  no fixed strategy (offload, recompute) fits the budget at this size")
    if "adaptive_peak_vs_budget" in r:
        lines.append(f"  {'adaptive peak / budget':<34} {r['adaptive_peak_vs_budget']:6.2f}")
    return lines
