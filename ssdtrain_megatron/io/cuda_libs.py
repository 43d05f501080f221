"""The shared libraries of CUDA this process has mapped, found where the loader put them.

Why: the offloader calls a few CUDA functions torch does not expose (its own streams'
creation, cache/stream_ops.py; the IO threads' stream-capture mode, io/gpu_wait.py). They must
reach the very library torch uses (the same handle, the same runtime and per-thread state), not
another copy found on a search path, so the path is read from ``/proc/self/maps``.
"""

from __future__ import annotations

import os
from typing import Optional

MAPS = "/proc/self/maps"


def loaded_library(prefix: str, maps: str = MAPS) -> Optional[str]:
    """The path of the first mapped shared library whose file name starts with ``prefix``."""
    try:
        with open(maps, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                parts = line.split(None, 5)
                if len(parts) == 6:
                    path = parts[5].strip()
                    if os.path.basename(path).startswith(prefix):
                        return path
    except OSError:
        return None
    return None
