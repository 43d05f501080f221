"""Sizes as users write them, the same in every flag: ``80GB`` (decimal, 10^9 bytes), ``80GiB``
(binary, 2^30 bytes), ``512MiB``, ``4096`` (bytes). A plain number is bytes where the name says
so (``--min-tensor-bytes``, ``chunk_bytes``); where it does not (``--gpu-memory``, a node
profile's memory), :func:`parse_size_with_unit` refuses it: ``--gpu-memory 80`` meant 80 GB, not
80 bytes. Flags whose unit is in their name (``--total-gib``, ``--ssd-gbps``) take plain numbers
and are not parsed here.

Imports nothing heavy: the CLI's ``--help`` and the Megatron flag group both use it.
"""

from __future__ import annotations

import re
from typing import Optional

UNITS = {"": 1, "b": 1,
         "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
         "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
"""Unit suffixes (case-insensitive): decimal kB/MB/GB/TB and binary KiB/MiB/GiB/TiB."""

EXPECTED = ("a size: bytes, or a number with a unit kB, MB, GB, TB (10^3...) or KiB, MiB, GiB, "
            "TiB (2^10...), e.g. 80GB or 512MiB")

EXPECTED_WITH_UNIT = ("a size with a unit: kB, MB, GB, TB (10^3...) or KiB, MiB, GiB, TiB "
                      "(2^10...), e.g. 80GB or 512MiB")


def parse_size(text: str) -> Optional[int]:
    """Bytes for ``text`` ('80GB' -> 80_000_000_000, '1.5GiB' -> 1610612736, '4096' -> 4096),
    or None when it is not a size. A number without a unit must be a whole number of bytes;
    a fraction with a unit is rounded down to a whole byte."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*", str(text))
    if not match:
        return None
    number, unit = match.group(1), match.group(2).lower()
    if unit not in UNITS or (not unit and "." in number):
        return None
    if "." in number:
        whole, _, frac = number.partition(".")
        # Exact decimal arithmetic: 1.5GiB is 1.5 * 2^30 without float rounding.
        value = (int(whole or "0") * 10 ** len(frac) + int(frac or "0")) * UNITS[unit] \
            // 10 ** len(frac)
    else:
        value = int(number) * UNITS[unit]
    return value


def parse_size_with_unit(text: str) -> int:
    """Bytes for ``text``, which must carry a unit ('80GB', '1.5GiB', '4096B').

    Raises:
        ValueError: a plain number ("80: give a unit, e.g. 80GB"), or not a size at all (the
            message says what a size looks like).
    """
    stripped = str(text).strip()
    if re.fullmatch(r"\d+(?:\.\d*)?|\.\d+", stripped):
        raise ValueError(f"{stripped}: give a unit, e.g. {stripped}GB")
    value = parse_size(stripped)
    if value is None:
        raise ValueError(f"{stripped!r} is not {EXPECTED_WITH_UNIT}")
    return value


def format_size(n: float) -> str:
    """'80 GB (74.5 GiB)': decimal, then binary, one decimal each."""
    return f"{n / 1e9:,.1f} GB ({n / (1 << 30):,.1f} GiB)"
