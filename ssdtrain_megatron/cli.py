"""The `ssdtrain` command: demo, benchmarks, planning and maintenance."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import List, Optional

from . import __version__
from .config import ConfigError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ssdtrain",
        description="SSD activation offloading for Megatron: demo, benchmarks, planning, cleanup.")
    parser.add_argument("--version", action="version", version=f"ssdtrain {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    from .bench import add_bench_parser
    from .corebench import add_core_bench_parser
    from .demo import add_demo_parser
    from .io.bench import add_io_bench_parser
    from .io.clean import add_clean_parser
    from .plan.cli import add_lifespan_parser, add_plan_parser
    from .telemetry.report import add_report_parser

    add_demo_parser(sub)
    add_plan_parser(sub)
    add_lifespan_parser(sub)
    add_bench_parser(sub)
    add_core_bench_parser(sub)
    add_report_parser(sub)
    add_io_bench_parser(sub)
    add_clean_parser(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"ssdtrain {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
