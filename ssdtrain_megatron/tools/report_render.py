"""Markdown tables and PNG plots of the IO characteristics that ``report.analyze`` computed.

Plots draw on matplotlib ``Figure`` objects with the Agg canvas directly: no pyplot, so nothing
global (the backend, the current figure) changes in the calling process.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Dict, List, Optional, Sequence

from ..telemetry.report import OPS, PHASES

PLOTS_NEED = "matplotlib for the plots (pip install 'ssdtrain-megatron[plot]')"
REPORT_NAME = "report.md"
PLOT_NAMES = ("request_sizes.png", "queue_depth.png", "bandwidth.png")


# -- formatting -------------------------------------------------------------------------------


def binary_size(n: int) -> str:
    """A power-of-two size as the user thinks of chunk sizes: '8 MiB', '512 KiB', '3 B'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def _bytes(n: int) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n:,} ({n / scale:.3g} {unit})"
    return f"{n:,}"


def _share(x: float) -> str:
    return f"{100 * x:.1f}%"


def _num(x: Optional[float], fmt: str = ".3g") -> str:
    return "n/a" if x is None else format(x, fmt)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> List[str]:
    out = ["| " + " | ".join(header) + " |",
           "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out + [""]


def _series(figures: Dict[str, Any]) -> List[tuple]:
    """(phase, op, GB/s list) of the timeline series that moved any bytes."""
    bw = figures["timeline"]["bandwidth_gbps"]
    return [(p, op, bw[p][op]) for p in PHASES for op in OPS if any(bw[p][op])]


# -- Markdown ---------------------------------------------------------------------------------


def render_markdown(figures: Dict[str, Any], trace: str) -> str:
    """The report as Markdown: a title line and one table per figure."""
    f = figures
    tl = f["timeline"]
    lines = [f"# IO characteristics of `{trace}`", "",
             f"{f['requests']:,} requests from rank(s) {', '.join(map(str, f['ranks']))} over "
             f"{f['span_s']:.3f} s (first submit to last completion). Decimal units: "
             "1 GB = 1e9 B, 1 TB = 1e12 B.", ""]

    lines += ["## Read/write mix", ""]
    lines += _table(
        ("op", "requests", "share of requests", "bytes", "share of bytes", "mean latency (ms)",
         "max latency (ms)"),
        [(op, m["requests"], _share(m["request_share"]), _bytes(m["bytes"]),
          _share(m["byte_share"]),
          _num(None if m["latency_mean_s"] is None else m["latency_mean_s"] * 1e3),
          _num(None if m["latency_max_s"] is None else m["latency_max_s"] * 1e3))
         for op, m in f["mix"].items()])

    lines += ["## Traffic per phase", ""]
    lines += _table(("phase", "writes", "bytes written", "reads", "bytes read"),
                    [(p, c["write"]["requests"], _bytes(c["write"]["bytes"]),
                      c["read"]["requests"], _bytes(c["read"]["bytes"]))
                     for p, c in f["phases"].items()])

    lines += ["## Request sizes", "",
              "Bucket [2^k, 2^(k+1)) bytes, named by its lower bound.", ""]
    lines += _table(("size", "writes", "reads", "all"),
                    [(binary_size(b["bucket_bytes"]), b["write"], b["read"],
                      b["write"] + b["read"]) for b in f["request_sizes"]])

    lines += ["## Sequentiality", "",
              "Contiguous: the offset is the end of the previous request of the same rank to "
              "the same file.", ""]
    lines += _table(("op", "requests", "contiguous", "share"),
                    [(k, s["requests"], s["contiguous"], _share(s["share"]))
                     for k, s in f["sequentiality"].items()])

    qd = f["queue_depth"]
    lines += ["## Queue depth at submit", "",
              f"Mean {qd['mean']:.2f}, max {qd['max']} "
              + "(" + "; ".join(f"rank {r['rank']}: mean {r['mean']:.2f}, max {r['max']}"
                                for r in qd["per_rank"]) + ").", ""]
    lines += _table(("depth", "requests", "share"),
                    [(h["depth"], h["requests"], _share(h["requests"] / f["requests"]))
                     for h in qd["histogram"]])

    series = _series(f)
    lines += ["## Bandwidth and queue depth over time", "",
              f"Buckets of {tl['bucket_s']:g} s from t = {tl['start_s']:g} s; GB/s summed over "
              "ranks; queue depth over the requests submitted in the bucket.", ""]
    rows = []
    for i in range(tl["buckets"]):
        rows.append([f"{tl['start_s'] + i * tl['bucket_s']:.6g}"]
                    + [f"{s[2][i]:.4g}" for s in series]
                    + [_num(tl["queue_depth_mean"][i], ".2f"),
                       _num(tl["queue_depth_max"][i], "d")])
    lines += _table(["t (s)"] + [f"{p} {op} (GB/s)" for p, op, _ in series]
                    + ["queue depth mean", "queue depth max"], rows)

    lines += ["## Bytes per step", ""]
    lines += ["Never read back: written and then served from memory (or released unread), "
              "drive bandwidth and endurance spent for nothing.", ""]
    lines += _table(("step", "bytes written", "bytes read", "never read back", "writes", "reads"),
                    [(s["step"], _bytes(s["bytes_written"]), _bytes(s["bytes_read"]),
                      _bytes(s["bytes_unread"]), s["writes"], s["reads"]) for s in f["steps"]])

    en = f["endurance"]
    lines += [f"## Drive writes per day ({en['drive_tb']:g} TB drive)", "",
              "Bytes written / span x 86400 / drive bytes; per rank one drive each, all ranks "
              "as if they shared one drive.", ""]
    lines += _table(("rank", "bytes written", "span (s)", "write rate (GB/s)", "DWPD"),
                    [(r["rank"], _bytes(r["bytes_written"]), f"{r['span_s']:.6g}",
                      _num(r["write_gbps"], ".4g"), _num(r["dwpd"], ".4g"))
                     for r in en["per_rank"]]
                    + [("all", _bytes(en["all_ranks"]["bytes_written"]),
                        f"{en['all_ranks']['span_s']:.6g}",
                        _num(en["all_ranks"]["write_gbps"], ".4g"),
                        _num(en["all_ranks"]["dwpd"], ".4g"))])
    return "\n".join(lines)


# -- plots ------------------------------------------------------------------------------------


def _figure(rows: int = 1):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4 * rows), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _edges(tl: Dict[str, Any]) -> List[float]:
    """Bucket edges, one more than buckets: step plots repeat the last value to the last edge
    so the final bucket is drawn to its end."""
    return [tl["start_s"] + i * tl["bucket_s"] for i in range(tl["buckets"] + 1)]


def plot_request_sizes(figures: Dict[str, Any], path: str) -> None:
    sizes = figures["request_sizes"]
    fig = _figure()
    ax = fig.add_subplot()
    x = range(len(sizes))
    width = 0.4
    for j, op in enumerate(OPS):
        ax.bar([i + (j - 0.5) * width for i in x], [b[op] for b in sizes], width, label=op)
    ax.set_xticks(list(x), [binary_size(b["bucket_bytes"]) for b in sizes])
    ax.set_xlabel("request size (bucket [2^k, 2^(k+1)), lower bound)")
    ax.set_ylabel("requests")
    ax.set_title("Request sizes")
    ax.legend()
    fig.savefig(path)


def plot_queue_depth(figures: Dict[str, Any], path: str) -> None:
    tl = figures["timeline"]
    fig = _figure(rows=2)
    ax_t, ax_h = fig.subplots(2, 1)
    times = _edges(tl)
    for key, label, style in (("queue_depth_max", "max", "-"), ("queue_depth_mean", "mean", "--")):
        values = [float("nan") if v is None else v for v in tl[key]]
        ax_t.step(times, values + values[-1:], style, where="post", label=label)
    ax_t.set_xlabel("time (s)")
    ax_t.set_ylabel("queue depth at submit")
    ax_t.set_title(f"Queue depth over time ({tl['bucket_s']:g} s buckets)")
    ax_t.legend()
    hist = figures["queue_depth"]["histogram"]
    ax_h.bar([h["depth"] for h in hist], [h["requests"] for h in hist])
    ax_h.set_xlabel("queue depth at submit")
    ax_h.set_ylabel("requests")
    ax_h.set_title("Queue depth distribution")
    fig.savefig(path)


def plot_bandwidth(figures: Dict[str, Any], path: str) -> None:
    tl = figures["timeline"]
    fig = _figure()
    ax = fig.add_subplot()
    times = _edges(tl)
    for phase, op, values in _series(figures):
        ax.step(times, values + values[-1:], where="post", label=f"{phase} {op}")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("GB/s")
    ax.set_title(f"Bandwidth per phase ({tl['bucket_s']:g} s buckets, all ranks)")
    ax.legend()
    fig.savefig(path)


def write_outputs(figures: Dict[str, Any], markdown: str, out_dir: str) -> List[str]:
    """Write report.md and the three plots into ``out_dir`` (created); their paths.

    Raises:
        ImportError: matplotlib is missing (checked before anything is written).
        OSError: ``out_dir`` cannot be created or written.
    """
    importlib.import_module("matplotlib")  # fail before writing a partial report

    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, REPORT_NAME)]
    with open(paths[0], "w", encoding="utf-8") as fh:
        fh.write(markdown)
    for name, plot in zip(PLOT_NAMES, (plot_request_sizes, plot_queue_depth, plot_bandwidth)):
        paths.append(os.path.join(out_dir, name))
        plot(figures, paths[-1])
    return paths
