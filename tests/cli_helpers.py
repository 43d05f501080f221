"""Run the `ssdtrain` entry point in-process as a user would, exit status and output together."""

from __future__ import annotations

from typing import List, Tuple

from ssdtrain_megatron.tools.cli import main


def run_cli(argv: List[str], capsys) -> Tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``ssdtrain ARGV``; argparse's exits included."""
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse: --help, usage errors
        rc = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return rc, out, err
