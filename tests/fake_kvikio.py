"""A stand-in for kvikio, for the gds engine's tests on machines without CUDA.

kvikio cannot do any IO without libcuda, even on host buffers, so on a CPU-only machine the gds
engine cannot run for real. This module takes kvikio's place in ``sys.modules`` with the two
calls the engine makes, ``CuFile(path, "r+")`` and its ``pwrite``/``pread(buf, size,
file_offset)`` returning a future with ``get()``, done the way kvikio's compat mode does them:
POSIX IO on host memory, on threads of its own. It checks what kvikio requires of its callers
(the file exists, the buffer holds ``size`` bytes, the file is open).

What the tests on it cover: the engine's placement, striping, space reservation, ordering,
errors and clean-up. What they cannot cover: kvikio itself, GPUDirect Storage, CUDA buffers and
streams. Those need a CUDA machine (the tests marked ``cuda``).
"""

from __future__ import annotations

import os
import types
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import numpy as np

_POOL = ThreadPoolExecutor(2, thread_name_prefix="fake-kvikio")


class IOFuture:
    def __init__(self, fut: Future) -> None:
        self._fut = fut

    def get(self) -> int:
        return self._fut.result()

    def done(self) -> bool:
        return self._fut.done()


class CuFile:
    def __init__(self, path: str, flags: str = "r") -> None:
        if flags != "r+":
            raise ValueError(f"the gds engine opens its slabs 'r+', not {flags!r}")
        self._fd: Optional[int] = os.open(path, os.O_RDWR)  # FileNotFoundError, as kvikio raises

    def _check(self, buf, size: int) -> memoryview:
        if self._fd is None:
            raise RuntimeError("CuFile is closed")
        if not isinstance(buf, np.ndarray):
            raise TypeError(f"this stand-in takes host numpy buffers only, not {type(buf).__name__}")
        view = memoryview(buf).cast("B")
        if view.nbytes < size:
            raise ValueError(f"buffer of {view.nbytes} bytes for an IO of {size}")
        return view[:size]

    def pwrite(self, buf, size: int, file_offset: int = 0) -> IOFuture:
        view, fd = self._check(buf, size), self._fd
        return IOFuture(_POOL.submit(os.pwrite, fd, view, file_offset))

    def pread(self, buf, size: int, file_offset: int = 0) -> IOFuture:
        view, fd = self._check(buf, size), self._fd
        return IOFuture(_POOL.submit(os.preadv, fd, [view], file_offset))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class Defaults:
    """kvikio.defaults as the engine uses it (the current API): the thread pool's size and
    whether kvikio prefers compat mode (POSIX IO, no GPUDirect Storage)."""

    def __init__(self, compat: bool) -> None:
        self.compat = compat
        self.settings = {"num_threads": 1}  # kvikio's default

    def set(self, key, value=None) -> None:
        if isinstance(key, dict):
            self.settings.update(key)
        else:
            self.settings[key] = value

    def get(self, key):
        return self.settings[key]

    def is_compat_mode_preferred(self) -> bool:
        return self.compat


def install(monkeypatch, compat: bool = False) -> Defaults:
    """Make ``import kvikio`` give this stand-in, and let the gds engine run, for one test.
    ``compat``: what kvikio says of compat mode (default: GDS works). Returns its defaults."""
    from ssdtrain_megatron.io import gds

    module = types.ModuleType("kvikio")
    module.CuFile = CuFile
    module.defaults = Defaults(compat)
    module.__doc__ = __doc__
    monkeypatch.setitem(__import__("sys").modules, "kvikio", module)
    monkeypatch.setattr(gds, "gds_unavailable_reason", lambda: "")
    return module.defaults
