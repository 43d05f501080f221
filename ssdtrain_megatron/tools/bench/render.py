"""`ssdtrain bench`'s output: the table and ratios (``render``) and the ROK plot (``plot_rok``).

Split out of ``cli.py`` (the command line and the figures; it re-exports these names).
"""

from __future__ import annotations

import sys
from typing import Optional

from .budget import render_lines
from .compare import render_differences
from .measure import ALL_STRATEGIES, SAME_LOSSES
from .predict import render_node_lines
from .spread import render_spread


def _mb(n: Optional[int]) -> str:
    return "n/a" if n is None else f"{n / 1e6:,.1f} MB"


def render(summary: dict) -> str:
    """The table and the ratios, as printed without --json."""
    sh = summary["shape"]
    lines = [f"megatron-core GPT, {sh['layers']} layers, hidden {sh['hidden']}, seq {sh['seq']}, "
             f"{sh['num_microbatches']} micro-batches per step, on {summary['device']}; median of "
             f"{summary['steps']} steps after {summary['warmup']} warm-up"
             + (f"; {summary['background_load']} busy background process(es) all along"
                if summary.get("background_load") else "")]
    if summary.get("omp_wait_policy") and summary["device"] == "cpu":
        lines.append(f"OpenMP wait policy: {summary['omp_wait_policy']}")
    lines.append("")
    head = ("strategy", "micro-batch", "step (s) median [min-max]", "tokens/s", "peak activations", "peak memory",
            "CPU (s)", "io wait (ms)")
    diag = summary["diagnostics"]
    rows = [(p["strategy"], p["micro_batch"], f"{p['step_s']:.3f} [{p['step_s_min']:.3f}-{p['step_s_max']:.3f}]",
             f"{p['tokens_per_s']:,.0f}",
             _mb(p["peak_activation_bytes"]), _mb(p["peak_memory_bytes"]),
             f"{diag[p['strategy'] + '@' + str(p['micro_batch'])]['cpu_s']:.2f}",
             f"{diag[p['strategy'] + '@' + str(p['micro_batch'])]['io_wait_s'] * 1e3:.0f}")
            for p in summary["points"]]
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    lines.append("  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths))))
    for r in rows:
        lines.append("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))))
    uncounted = ", ".join(f"{_mb(b)} at micro-batch {mb}" for mb, b in summary["recompute_pass_bytes"].items())
    ran = list(dict.fromkeys(p["strategy"] for p in summary["points"]))  # in table order
    lines.append(f"peak memory: {summary['peak_memory_kind'] or 'not measurable here'}, the models of "
                 f"every strategy run ({', '.join(ran)}) resident. CPU: process CPU seconds per step "
                 "(median), all threads.")
    if "recompute" in ran:
        lines.append("recompute's peak activations: the checkpoint inputs the offloader sees; the tensors "
                     "re-created in backward, one layer at a time, are not counted"
                     + (f" (keep's largest layer: {uncounted})." if uncounted else "."))
    lines.append("")
    for o in summary["out_of_memory"]:
        lines.append(f"{o['strategy']} at micro-batch {o['micro_batch']}: out of device memory")
    r = summary["ratios"]
    lines.append(f"at micro-batch {summary['ratios_micro_batch']} (the largest all strategies ran):")
    labels = (("offload_vs_keep_step_time", "offload / keep step time"),
              ("offload_vs_keep_peak_activation", "offload / keep peak activations"),
              ("recompute_vs_keep_step_time", "recompute / keep step time"),
              ("host_vs_keep_step_time", "host / keep step time"),
              ("planned_vs_keep_step_time", "planned / keep step time"),
              ("adaptive_vs_keep_step_time", "adaptive / keep step time"),
              ("adaptive_vs_keep_peak_activation", "adaptive / keep peak activations"),
              ("offload_vs_keep_cpu_time", "offload / keep CPU time"),
              ("adaptive_vs_keep_cpu_time", "adaptive / keep CPU time"),
              ("recompute_vs_keep_cpu_time", "recompute / keep CPU time"),
              ("offload+crc32c_vs_offload_step_time", "offload+crc32c / offload step time"),
              ("offload+crc32c_vs_offload_cpu_time", "offload+crc32c / offload CPU time"))
    for key, label in labels:
        if key in r:
            lines.append(f"  {label:<34} {r[key]:6.2f}")
    lines += render_lines(summary)
    lines += render_node_lines(summary)
    lines += render_spread(summary)
    for mb, e in summary.get("adaptive_exploration", {}).items():
        lines.append(f"adaptive at micro-batch {mb}: " + (
            f"settled after {e['settle_steps']} steps" if e["settle_steps"] is not None
            else f"did not settle within {e['steps']} steps") + " of measured selection, run alone "
            "before the measured steps (its step time above is the settled plan's)"
            + (f"; {e['measured_steps_exploring_again']} measured steps explored again (drift)"
               if e["measured_steps_exploring_again"] else ""))
    budget = summary["memory_budget_bytes"]
    src = summary["memory_budget_from_keep_micro_batch"]
    top = max(p["micro_batch"] for p in summary["points"])
    fits = ", ".join(f"{n} {'none' if mb is None else mb}{'+' if mb == top else ''}"
                     for n, mb in summary["largest_micro_batch_under_budget"].items())
    lines.append(f"largest micro-batch within {_mb(budget)} of activations"
                 f"{f' (keep at micro-batch {src})' if src else ''}: {fits}"
                 f"{'  (+: the largest measured)' if '+' in fits else ''}")
    same = ", ".join(n for n in SAME_LOSSES if any(p["strategy"] == n for p in summary["points"]))
    lines.append(f"losses bitwise equal ({same}): {summary['losses_bitwise_equal']}"
                 + (f"; recompute equal to keep: {summary['recompute_losses_bitwise_equal']}"
                    if "recompute" in ran else ""))
    lines += render_differences(summary)
    lines += _fallback_lines(diag)
    lines.append(f"offload files left: {summary['offload_files_left']}")
    return "\n".join(lines)


def plot_rok(summary: dict, path: str) -> bool:
    """The ROK plot as a PNG; False (and a note on stderr) without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print("matplotlib is not installed: no ROK plot (pip install 'ssdtrain-megatron[plot]')",
              file=sys.stderr)
        return False
    fig = Figure(figsize=(7, 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for s in ALL_STRATEGIES:
        pts = [p for p in summary["points"] if p["strategy"] == s.name]
        if not pts:
            continue
        xs = [p["peak_activation_bytes"] / 1e6 for p in pts]
        ys = [p["tokens_per_s"] for p in pts]
        ax.plot(xs, ys, marker="o", label=s.name)
        for p, x, y in zip(pts, xs, ys):
            ax.annotate(f"mb {p['micro_batch']}", (x, y), textcoords="offset points", xytext=(4, 4),
                        fontsize=7)
    if summary["memory_budget_bytes"]:
        ax.axvline(summary["memory_budget_bytes"] / 1e6, color="grey", linestyle="--", linewidth=1,
                   label="memory budget")
    ax.set_xlabel("peak resident activations (MB)")
    ax.set_ylabel("throughput (tokens/s)")
    ax.set_title("ROK: recompute / offload / keep")
    ax.legend()
    fig.savefig(path)
    return True


def _fallback_lines(diag: dict) -> list:
    """Writes that stayed in memory: the host strategy's full tier (by design), and failures."""
    lines = []
    full = {k: d["fallbacks"] for k, d in diag.items() if d.get("fallbacks") and k.startswith("host@")}
    if full:  # the host strategy's tier is small on purpose (--node-emulation)
        lines.append("host tier full (its capacity is the emulated node's host memory; what did not fit "
                     "stayed in memory): " + ", ".join(f"{n} tensors at micro-batch {k.split('@')[1]}"
                                                      for k, n in full.items()))
    fell = {k: d.get("fallbacks", 0) for k, d in diag.items() if d.get("fallbacks") and k not in full}
    if fell:
        lines.append("fallbacks (writes that failed, a full disk?, and stayed in memory: those points "
                     "saved less memory than they should): "
                     + ", ".join(f"{k.replace('@', ' at micro-batch ')}: {n}" for k, n in fell.items()))
    return lines
