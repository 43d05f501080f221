"""The pinned staging pool: host memory between the GPU and a drive engine, allocated once.

A write's bytes are copied device -> staging block on the offload stream; the engine writes the
block to the drive; the block goes back to the pool when the write is done. A read's bytes come
from the drive into a block, then block -> device on the reload stream. The pool is host memory
(a GPU node has hundreds of GB of it per GPU): a write in flight holds a block, not GPU memory,
once its device copy has landed (cache/transfers.py), so the pool's size, not the device's
memory, bounds how far the forward pass may run ahead of a slow drive.

Contract:
- ``cudaHostAlloc``/``cudaHostRegister`` synchronise the device: the pool is allocated once, at
  construction, never in the hot path. Pinned memory that cannot be had is a
  :class:`StagingUnavailable` error there.
- A block given back with an event (a copy that may still read or write it) is reusable once
  that event completed: ``take`` reclaims such blocks with ``query()``, never
  ``synchronize()``; a block whose copy has not run is skipped.
- ``take(n, overflow=False)`` answers None when no block fits: the caller waits for a write to
  complete (back-pressure, counted) instead of blocking here. With ``overflow`` (the default),
  a request that does not fit takes page-locked memory from torch's caching host allocator
  instead, counted in ``overflows``.
- ``may_free``: whether waiting can make room at all: a block is out with a holder that will
  give it back (a write or a read in flight), or given back behind an event not yet seen
  complete. A block a failed copy left unusable (``withhold``) never comes back; when only such
  blocks fill the pool, the waiting caller overflows instead of waiting out ``io_timeout_s``.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Deque, Optional, Tuple

import torch

from ..io.extents import ExtentAllocator
from ..io.layout import ALIGN
from .stream_ops import StreamOps

# Staging blocks start on page boundaries (the pool is one pinned allocation, page-aligned):
# the posix engine then writes and reads a block with O_DIRECT in place, without copying it
# through its bounce buffer (io/posix.py).
STAGING_ALIGN = ALIGN


class StagingUnavailable(RuntimeError):
    """The pinned staging pool could not be allocated; the message says what to change."""


class Block:
    """A staging block: ``tensor`` (uint8 host memory), and where it lies in the pool
    (``offset`` is None for an overflow block from torch's caching host allocator)."""

    __slots__ = ("tensor", "offset", "size")

    def __init__(self, tensor: torch.Tensor, offset: Optional[int], size: int) -> None:
        self.tensor = tensor
        self.offset = offset
        self.size = size


class StagingPool:
    """Pinned host memory allocated once, carved into blocks; never blocks the caller (module
    docstring)."""

    def __init__(self, nbytes: int, ops: StreamOps) -> None:
        try:
            self._mem = ops.pinned_pool(nbytes)
        except (RuntimeError, MemoryError, OSError) as exc:
            raise StagingUnavailable(
                f"could not allocate pinned_staging_bytes={nbytes} ({nbytes / 2**20:.0f} MiB) of "
                f"page-locked host memory for GPU<->host copies: {exc}; lower pinned_staging_bytes "
                f"(or max_inflight_bytes, which sizes its default), or raise the locked-memory limit "
                f"(ulimit -l)") from exc
        self.capacity = nbytes
        self._ops = ops
        self._alloc = ExtentAllocator(STAGING_ALIGN)
        self._lock = threading.Lock()
        self._pending: Deque[Tuple[Block, Any]] = deque()  # (block, event it waits for)
        self._out = 0  # blocks handed out whose holder will give them back
        self.overflows = 0
        self.overflow_bytes = 0

    def take(self, nbytes: int, overflow: bool = True) -> Optional[Block]:
        """A block of ``nbytes``; when none fits, an overflow block (``overflow``) or None."""
        with self._lock:
            self._reclaim()
            offset = self._alloc.allocate(nbytes)
            size = aligned(nbytes)
            if offset + size <= self.capacity:
                self._out += 1
                return Block(self._mem[offset:offset + nbytes], offset, size)
            self._alloc.free(offset, size)
            if not overflow:
                return None
            self.overflows += 1
            self.overflow_bytes += nbytes
        # Outside the lock: the caching host allocator may call cudaHostAlloc the first time.
        return Block(self._ops.pinned_empty(nbytes), None, nbytes)

    def give(self, block: Block, after: Any = None) -> None:
        """Return ``block``; with ``after``, only once that event has completed."""
        if block.offset is None:
            return  # torch's caching host allocator tracks its own copies' events
        with self._lock:
            self._out -= 1
            if after is None:
                self._alloc.free(block.offset, block.size)
            else:
                self._pending.append((block, after))

    def withhold(self, block: Block) -> None:
        """``block`` never comes back (a copy into it may still land and no event can say when):
        its bytes stay allocated, and it no longer counts as a block waiting can get back."""
        if block.offset is None:
            return
        with self._lock:
            self._out -= 1

    @property
    def may_free(self) -> bool:
        """Whether a block may still come back: one is out with a holder that gives it back, or
        given back behind an event (module docstring)."""
        with self._lock:
            return self._out > 0 or bool(self._pending)

    @property
    def bytes_in_use(self) -> int:
        with self._lock:
            return self._alloc.allocated

    def close(self) -> None:
        """Let the pinned memory go (unregistered once the last view of it is gone). The caller
        has made sure no copy into or out of it is still queued (``DeviceCopy.close``)."""
        with self._lock:
            self._pending.clear()
            self._mem = torch.empty(0, dtype=torch.uint8)

    def _reclaim(self) -> None:
        # Every pending block, not only the oldest: the events come from two streams (offload
        # copies into blocks, reload copies out of them), which complete in any order.
        if not self._pending:
            return
        still: Deque[Tuple[Block, Any]] = deque()
        for block, event in self._pending:
            if event.query():
                self._alloc.free(block.offset, block.size)
            else:
                still.append((block, event))
        self._pending = still


def aligned(n: int) -> int:
    """``n`` bytes as the pool rounds them: whole pages (at least one)."""
    return (max(n, 1) + STAGING_ALIGN - 1) // STAGING_ALIGN * STAGING_ALIGN
