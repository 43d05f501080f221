"""The checks a node profile's fields go through, and the error they raise: one module that
plan/node.py and plan/gemm_table.py (the measured GEMM table, a field of the profile) both
import, so neither imports the other at its top."""

from __future__ import annotations

from typing import Any


class ProfileError(ValueError):
    """An invalid node profile: the message names the field, the value and what is allowed."""


def _fail(name: str, value: Any, allowed: str, source: str = "NodeProfile") -> None:
    raise ProfileError(f"{source}.{name}={value!r} is invalid: {allowed}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


__all__ = ["ProfileError"]
