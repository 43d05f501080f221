"""Parsing one ``--ssd-offload-*`` flag value into what its OffloadConfig field holds.

The parser follows the field's annotation (``int``, ``float``, ``str``, ``List[int]``,
``List[str]``, ``Optional[...]`` of these) and its ``unit`` (config_checks.knob): a field of a
new type needs a parser here, nothing else in ``args.py``. Errors are
``argparse.ArgumentTypeError`` in the flags' one-line style ("'x' is invalid: expected ...").
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import typing
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..config import OffloadConfig
from ..sizes import EXPECTED as SIZE_EXPECTED
from ..sizes import parse_size


def _fields() -> dict:
    return {f.name: f for f in dataclasses.fields(OffloadConfig)}


def parse_int(text: str, allow_units: bool) -> int:
    """An integer; with ``allow_units`` a size written as every size flag takes it
    (:mod:`ssdtrain_megatron.sizes`: 80GB, 80GiB, 4096)."""
    if allow_units:
        value = parse_size(text)
        if value is None and re.fullmatch(r"\s*-\d+\s*", text):
            value = int(text)  # the field's own check names the allowed range
        if value is None:
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected {SIZE_EXPECTED}")
        return value
    if not re.fullmatch(r"\s*-?\d+\s*", text):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected an integer")
    return int(text)


def parse_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected a finite number")
    return value


def parse_str_list(text: str) -> List[str]:
    items = [d.strip() for d in text.split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(
            f"{text!r} is invalid: expected comma-separated items, none of them empty")
    return items


def parse_int_list(text: str) -> List[int]:
    """'1,2,5-7' -> [1, 2, 5, 6, 7]."""
    values: List[int] = []
    for item in parse_str_list(text):
        match = re.fullmatch(r"(-?\d+)(?:-(\d+))?", item)
        if not match:
            raise argparse.ArgumentTypeError(
                f"{text!r} is invalid: expected comma-separated integers or ranges like 5-8")
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) else first
        values.extend(range(first, last + 1))
    return values


def parse_size_or_fraction(text: str) -> Any:
    """A size (12GiB, 4096) or a fraction of device memory (0.6; resolved on CUDA)."""
    if re.fullmatch(r"\s*(0?\.\d+|1\.0*)\s*", text):
        return float(text)
    try:
        return parse_int(text, allow_units=True)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is invalid: expected a size like 12GiB or 12GB, or a fraction of device "
            "memory like 0.6") from None


def field_type(name: str, hints: Optional[Dict[str, Any]] = None) -> Tuple[Callable[[str], Any], bool]:
    """(parser of one flag value, is_boolean) for OffloadConfig field ``name``, from its
    annotation (``List[int]``, ``Optional[float]``, ...) and its ``unit``. ``Optional[X]``
    parses as X: a flag cannot set a field back to None. ``hints``: OffloadConfig's resolved
    annotations, where the caller has them (resolving them is most of a parser's build time)."""
    hint = (hints or typing.get_type_hints(OffloadConfig))[name]
    if typing.get_origin(hint) is typing.Union:
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(inner) == 1:
            hint = inner[0]
    if hint is bool:
        return (lambda text: text), True
    if hint is int:
        units = _fields()[name].metadata.get("unit") == "bytes"
        return (lambda text: parse_int(text, allow_units=units)), False
    if hint is float and _fields()[name].metadata.get("unit") == "bytes|fraction":
        return parse_size_or_fraction, False
    if hint is float:
        return parse_float, False
    if hint is str:
        return (lambda text: text), False
    if typing.get_origin(hint) is list:
        item = (typing.get_args(hint) or (None,))[0]
        if item is int:
            return parse_int_list, False
        if item is str:
            return parse_str_list, False
    raise TypeError(f"OffloadConfig.{name}: no command-line flag for type {hint!r}; teach "
                    "ssdtrain_megatron.megatron.flag_values.field_type how to parse it")
