"""The collector frozen while something is measured: shared by core-bench (bench/corebench.py,
bench/gpu_path.py) and io-bench (iobench/engine_side.py)."""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def gc_frozen() -> Iterator[None]:
    """The body run with Python's collector frozen, as Megatron's --manual-gc leaves it: the
    heap collected, then frozen (its full collections no longer walk it); unfrozen after."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
