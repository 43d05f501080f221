"""``ssdtrain report TRACE``: print (and with ``--out``, write) the IO characteristics of a trace.

The figures are computed by the library (``telemetry/report.py``), rendered by
``report_render``; this module is the command around them.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, List

from ..telemetry.report import DEFAULT_DRIVE_TB, TIMELINE_BUCKETS, TraceError, analyze, load_trace
from ..telemetry.stats_summary import render_stats_summary, summarize_stats
from .cli_types import positive_float
from .report_render import PLOTS_NEED, render_markdown, write_outputs


def add_report_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``ssdtrain report``."""
    parser = subparsers.add_parser(
        "report", help="IO characteristics of an IO trace (trace_path): tables and plots",
        description="IO characteristics of the offload traffic from an IO trace (JSONL, one "
                    "record per request): request sizes, read/write mix, sequentiality, queue "
                    "depth, bandwidth per phase over time, bytes written per step and drive "
                    "writes per day. Prints Markdown; with --out also writes report.md and PNG "
                    "plots there. Decimal units: 1 GB = 1e9 B, 1 TB = 1e12 B.")
    parser.add_argument("trace", metavar="TRACE", nargs="?", default=None,
                        help="IO trace file (several ranks' traces may be concatenated)")
    parser.add_argument("--stats", metavar="STATS", default=None,
                        help="also (or only) summarize a stats JSONL (stats_path): tensors "
                             "passed through by reason, and every step that offloaded nothing "
                             "with the reason and its fix")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="write report.md and the plots (request_sizes.png, "
                             "queue_depth.png, bandwidth.png) to DIR, created if missing")
    parser.add_argument("--drive-tb", type=positive_float, default=DEFAULT_DRIVE_TB,
                        metavar="TB", help="drive size for drive writes per day, decimal TB "
                                           f"(default {DEFAULT_DRIVE_TB:g})")
    parser.add_argument("--bucket-s", type=positive_float, default=None, metavar="S",
                        help="timeline bucket width in seconds (default: a 1-2-5 width giving "
                             f"at most {TIMELINE_BUCKETS} buckets)")
    parser.add_argument("--json", action="store_true",
                        help="print the figures as one JSON object instead of Markdown")
    parser.set_defaults(func=run_report)
    return parser


def run_report(args: argparse.Namespace) -> int:
    if args.trace is None and args.stats is None:
        print("ssdtrain report: error: give a TRACE, --stats STATS, or both", file=sys.stderr)
        return 2
    silence = None
    if args.stats is not None:
        try:
            silence = summarize_stats(args.stats)
        except TraceError as exc:
            print(f"ssdtrain report: error: {exc}", file=sys.stderr)
            return 2
    if args.trace is None:
        print(json.dumps(silence) if args.json else render_stats_summary(silence), end="\n" if args.json else "")
        return 0
    try:
        records = load_trace(args.trace)
    except TraceError as exc:
        print(f"ssdtrain report: error: {exc}", file=sys.stderr)
        return 2
    figures = analyze(records, drive_tb=args.drive_tb, bucket_s=args.bucket_s)
    markdown = render_markdown(figures, args.trace)
    files: List[str] = []
    if args.out is not None:
        try:
            files = write_outputs(figures, markdown, args.out)
        except ImportError:
            print(f"ssdtrain report: error: --out needs {PLOTS_NEED}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"ssdtrain report: error: --out {args.out}: {exc.strerror or exc}",
                  file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps({"trace": args.trace, **figures, "files": files,
                          **({"not_offloaded": silence} if silence else {})}))
    else:
        print(markdown + ("\n" + render_stats_summary(silence) if silence else ""), end="")
    return 0
