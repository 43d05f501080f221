"""The `ssdtrain` command: demo, benchmarks, planning, maintenance and a capability report.

Every subcommand reports a mistake in one line on stderr and exits non-zero: 2 for usage (a
flag's value), 1 for the environment (a read-only disk, a missing library), 130 after Ctrl-C,
with a line saying how many offload files were removed. ``--debug`` (or ``SSDTRAIN_DEBUG=1``)
shows the traceback instead.

Building the parser imports no torch: each subcommand imports what it needs when it runs, so
``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import List, Optional

from .. import __version__
from .cli_types import CommandError, describe_os_error, plural
from .quiet import WarningTally

DEBUG_ENV = "SSDTRAIN_DEBUG"


class Parser(argparse.ArgumentParser):
    """argparse with its usage errors in one line (the flag, what is wrong, where to look)."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="ssdtrain",
        description="SSD activation offloading for Megatron: demo, benchmarks, planning, cleanup, "
                    "and a report of what this machine can do (doctor).",
        epilog=f"Errors are one line; --debug or {DEBUG_ENV}=1 shows the traceback.")
    parser.add_argument("--version", action="version", version=f"ssdtrain {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    parser.add_argument("--debug", action="store_true",
                        help=f"show the traceback of an error (also {DEBUG_ENV}=1)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # Every module here imports torch only inside the command that runs (tests/test_cli.py).
    from .bench.cli import add_bench_parser
    from .bench.corebench import add_core_bench_parser
    from .demo import add_demo_parser
    from .doctor import add_doctor_parser
    from .iobench.cli import add_io_bench_parser
    from .clean import add_clean_parser
    from .plan.cli import add_lifespan_parser, add_plan_parser
    from .report import add_report_parser
    from .soak import add_soak_parser

    add_demo_parser(sub)
    add_doctor_parser(sub)
    add_plan_parser(sub)
    add_lifespan_parser(sub)
    add_bench_parser(sub)
    add_core_bench_parser(sub)
    add_report_parser(sub)
    add_io_bench_parser(sub)
    add_clean_parser(sub)
    add_soak_parser(sub)
    for command in sub.choices.values():  # --debug after the command too
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help=argparse.SUPPRESS)
    parser.set_defaults(commands=sub.choices)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the subcommand's parser, whose --help lists what it takes
        args.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    debug = args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    before = set(logging.getLogger().handlers)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    args.offload_files = OffloadFiles()
    prefix = f"ssdtrain {args.command}"
    # Each kind of warning once, its repeats counted (quiet.py); only in the log handler set up
    # here, not in one the caller had (a test's, an embedding program's).
    args.warnings = WarningTally([h for h in logging.getLogger().handlers if h not in before], prefix)
    try:
        with args.warnings:
            return args.func(args)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{prefix}: interrupted; {args.offload_files.describe_removal()}", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - one line per error is this function's job
        if debug:
            raise
        code, line = describe_error(exc)
        print(f"{prefix}: {line}", file=sys.stderr)
        return code
    finally:
        args.offload_files.stop()


def describe_error(exc: BaseException) -> tuple:
    """(exit code, one line) for an exception that reached the command line."""
    from ..config import ConfigError

    if isinstance(exc, CommandError):
        return exc.exit_code, str(exc)
    if isinstance(exc, ConfigError):
        return 2, str(exc)
    name = type(exc).__name__
    if name == "EngineUnavailable":  # io.base, not imported here (torch)
        return 1, f"{exc}; choose another engine (ssdtrain doctor lists what runs here)"
    if isinstance(exc, OSError):
        return 1, describe_os_error(exc)
    if isinstance(exc, MemoryError) or name == "OutOfMemoryError":
        return 1, f"out of memory: {str(exc).splitlines()[0] if str(exc) else name}; try a smaller model"
    text = " ".join(str(exc).split()) or "(no message)"
    return 1, f"{name}: {text} (--debug or {DEBUG_ENV}=1 shows the traceback)"


class OffloadFiles:
    """The offload roots a command writes under, and its files there: what Ctrl-C removed.

    ``watch(root)`` before the first offloader is built: a cleaner registered with
    :mod:`io.cleanup` then, ahead of the offloaders' own, counts this process's files when a
    signal arrives, before those cleaners remove them."""

    def __init__(self) -> None:
        self.roots: List[str] = []
        self.seen: Optional[int] = None
        self._registered = False
        self._token = object()  # cleanup's key: unlike id(self), never another object's later

    def watch(self, root: str) -> None:
        from ..io import cleanup

        if root not in self.roots:
            self.roots.append(root)
        if not self._registered:
            cleanup.register(self._token, self._count_now)
            self._registered = True

    def _count_now(self) -> None:
        self.seen = self.count()

    def count(self) -> int:
        """Files in this process's rank directories under the roots."""
        from ..io.layout import DIR_PREFIX

        mine = f".pid{os.getpid()}"
        n = 0
        for root in self.roots:
            try:
                names = os.listdir(root)
            except OSError:
                continue
            for name in names:
                path = os.path.join(root, name)
                if name.startswith(DIR_PREFIX) and name.endswith(mine) and os.path.isdir(path):
                    try:
                        n += sum(1 for f in os.listdir(path) if os.path.isfile(os.path.join(path, f)))
                    except OSError:
                        continue
        return n

    def describe_removal(self) -> str:
        if not self.roots:
            return "no offload files were written"
        left = self.count()
        removed = max((self.seen or 0) - left, 0)
        where = ", ".join(self.roots)
        line = f"removed {plural(removed, 'offload file')} under {where}"
        return line + (f"; {plural(left, 'file')} could not be removed" if left else "")

    def stop(self) -> None:
        if self._registered:
            from ..io import cleanup

            cleanup.unregister(self._token)
            self._registered = False


if __name__ == "__main__":
    sys.exit(main())
