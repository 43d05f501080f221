"""Host memory by address, for the staged engines' IO threads (posix, aio).

Why: an IO thread moves every chunk between a tensor and a bounce buffer (or hands the
tensor's memory to the kernel in place). Done with torch, each chunk costs a slice, a byte
view and a ``copy_``: each a call that takes and releases the GIL (so the training thread,
which also launches every kernel, keeps losing the interpreter to IO threads), and ``copy_``
of a few hundred KiB is split over torch's intra-op thread pool, a pool per calling thread,
which competes with the training step for the cores. Here a chunk is an address and a length:
``memmove`` and ``memset`` are plain C calls that release the GIL for their whole duration and
run on the calling thread only, and ``buffer_at`` gives the kernel (``pwritev``/``preadv``) and
the checksum the memory in place.

Only host memory has an address the CPU can use: callers check ``tensor.device`` first.
"""

from __future__ import annotations

import ctypes

import torch

memmove = ctypes.memmove
"""``memmove(dst, src, n)``: copy ``n`` bytes between addresses, the GIL released meanwhile."""

memset = ctypes.memset
"""``memset(dst, byte, n)``."""


def address(t: torch.Tensor) -> int:
    """The address of the first byte of the contiguous host tensor ``t``."""
    if t.device.type != "cpu":
        raise ValueError(f"host memory expected, got a tensor on {t.device}")
    return t.data_ptr()


def buffer_at(addr: int, n: int) -> memoryview:
    """``n`` bytes of memory at ``addr`` as a writable buffer (no copy). Whoever holds it must
    keep the memory's owner (the tensor) alive while it is used."""
    return memoryview((ctypes.c_ubyte * n).from_address(addr)).cast("B")
