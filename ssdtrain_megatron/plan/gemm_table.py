"""A node profile's measured GEMM table (``NodeProfile.gemm_tflops_by_shape``): its rows
checked and held as (m, n, k, dtype, TFLOP/s) tuples, and written back as the YAML's mappings.
``ssdtrain doctor --node-profile`` measures it on a GPU (tools/gemm_sweep.py); the planner
reads it through plan/gpu_kind.py's ``nearest_measured``."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Sequence, Tuple

from .profile_checks import _fail, _is_int, _is_number

GEMM_ROW_KEYS = ("m", "n", "k", "dtype", "tflops")
"""The keys of one ``gemm_tflops_by_shape`` row, in its tuple's order."""

GEMM_DTYPES = ("bf16", "fp8")


def gemm_table(value: Any) -> Tuple[Tuple[int, int, int, str, float], ...]:
    """``gemm_tflops_by_shape`` as (m, n, k, dtype, tflops) tuples in the given order, or one
    line naming the field, the row and what is wrong."""
    allowed = ("expected a list of {m, n, k, dtype, tflops}: m, n, k integers >= 1, dtype "
               + " or ".join(GEMM_DTYPES) + ", tflops a number > 0")
    if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__iter__"):
        _fail("gemm_tflops_by_shape", value, allowed + ", or null")
    rows = []
    for i, row in enumerate(value):
        if isinstance(row, Mapping):
            if sorted(row) != sorted(GEMM_ROW_KEYS):
                _fail(f"gemm_tflops_by_shape[{i}]", dict(row), allowed)
            row = tuple(row[key] for key in GEMM_ROW_KEYS)
        if not isinstance(row, (tuple, list)) or len(row) != len(GEMM_ROW_KEYS):
            _fail(f"gemm_tflops_by_shape[{i}]", row, allowed)
        m, n, k, dtype, tflops = row
        if not all(_is_int(d) and d >= 1 for d in (m, n, k)) or dtype not in GEMM_DTYPES \
                or not _is_number(tflops) or not 0 < tflops < float("inf"):
            _fail(f"gemm_tflops_by_shape[{i}]", dict(zip(GEMM_ROW_KEYS, row)), allowed)
        rows.append((m, n, k, dtype, float(tflops)))
    if not rows:
        _fail("gemm_tflops_by_shape", value, allowed + " (at least one row), or null")
    return tuple(rows)


def table_rows(table: Sequence[Tuple[int, int, int, str, float]]) -> List[Dict[str, Any]]:
    """The table as the YAML holds it: one ``{m, n, k, dtype, tflops}`` mapping per row."""
    return [dict(zip(GEMM_ROW_KEYS, row)) for row in table]


__all__ = ["GEMM_DTYPES", "GEMM_ROW_KEYS", "gemm_table", "table_rows"]
