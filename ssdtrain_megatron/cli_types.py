"""Argument types and progress output shared by the `ssdtrain` subcommands."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def progress_bar(done: int, total: int, width: int = 24) -> str:
    n = width * done // total
    return "[" + "#" * n + "-" * (width - n) + f"] {done}/{total}"
