"""Bitwise comparison of tensors, as the numerics contract means it.

``torch.equal`` compares values: +0.0 equals -0.0 and NaN equals nothing, so two runs that
differ in the sign of a zero pass and two identical runs with a NaN fail. These compare the
bits, through integer views of floating-point tensors.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as integers with the same bytes (floating-point and complex), else ``t``."""
    t = t.detach()
    if t.dtype.is_floating_point or t.dtype.is_complex:
        if t.dtype.is_complex:
            t = torch.view_as_real(t)
        return t.contiguous().view(_INT_OF_SIZE[t.element_size()])
    return t


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, same shape, same bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def float_bits(values) -> list:
    """Python floats (or 0-d tensors) as ``float.hex`` strings: lists of them compare equal
    only when every value has the same bits (``==`` on floats says 0.0 == -0.0, nan != nan)."""
    return [float(v).hex() for v in values]


def tensor_leaves(prefix: str, value, out: Optional[Dict[str, torch.Tensor]] = None,
                  skip: Tuple[str, ...] = ()) -> Dict[str, torch.Tensor]:
    """Every tensor inside ``value`` (nested dicts, lists, tuples: a checkpoint), by its path
    from ``prefix``; keys containing one of ``skip`` are left out."""
    out = {} if out is None else out
    if isinstance(value, torch.Tensor):
        out[prefix] = value
    elif isinstance(value, dict):
        for key, item in value.items():
            if not any(s in str(key) for s in skip):
                tensor_leaves(f"{prefix}.{key}", item, out, skip)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            tensor_leaves(f"{prefix}[{i}]", item, out, skip)
    return out
