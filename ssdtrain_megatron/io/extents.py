"""Space in a slab: the extents tensors are stored in, and the allocator that hands them out.

One allocator per slab (``slab.py``; the memory engine's pool and the pinned staging blocks use
it too). IO threads allocate when they place a write (``slab_engine.py``), in queue order, so
tensors written one after another lie back to back; the training thread frees at release.
"""

from __future__ import annotations

import bisect
import collections
import threading
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional, Tuple

from .layout import ALIGN, align_up


class ExtentAllocator:
    """First-fit allocator of aligned extents in a growable slab, with coalescing.

    Thread-safe. ``allocate`` never fails: it grows the slab when no free extent fits.
    ``free_later`` is the training thread's free: it only notes the extent (a deque append,
    no lock, no search), and the next ``allocate`` (an IO thread's, placing a write) or a look
    at ``allocated`` frees it first. Every allocation sees exactly the frees made before it,
    as with ``free``, so the layout is the same.
    """

    def __init__(self, align: int = ALIGN) -> None:
        self._align = align
        self._lock = threading.Lock()
        self._free_starts: List[int] = []  # sorted
        self._free: Dict[int, int] = {}  # start -> length
        self._later: Deque[Tuple[int, int]] = collections.deque()  # (start, nbytes) to free
        self.size = 0  # slab size (high-water mark)
        self._allocated = 0

    @property
    def allocated(self) -> int:
        """Bytes in extents not freed (``free_later`` ones freed first)."""
        if self._later:
            with self._lock:
                self._free_noted()
        return self._allocated

    def free_later(self, start: int, nbytes: int) -> None:
        self._later.append((start, nbytes))

    def _free_noted(self) -> None:
        """Under the lock: the frees ``free_later`` noted (each once: popleft is atomic)."""
        later = self._later
        while later:
            self._free_locked(*later.popleft())

    def allocate(self, nbytes: int) -> int:
        n = align_up(max(nbytes, 1), self._align)
        with self._lock:
            if self._later:
                self._free_noted()
            for i, start in enumerate(self._free_starts):
                length = self._free[start]
                if length >= n:
                    del self._free[start]
                    self._free_starts.pop(i)
                    if length > n:
                        self._insert(start + n, length - n)
                    self._allocated += n
                    return start
            # Grow: extend a free extent that ends at the slab end, or append.
            if self._free_starts and self._free_starts[-1] + self._free[self._free_starts[-1]] == self.size:
                start = self._free_starts.pop()
                del self._free[start]
            else:
                start = self.size
            self.size = start + n
            self._allocated += n
            return start

    def free(self, start: int, nbytes: int) -> None:
        with self._lock:
            self._free_locked(start, nbytes)

    def _free_locked(self, start: int, nbytes: int) -> None:
        n = align_up(max(nbytes, 1), self._align)
        self._allocated -= n
        i = bisect.bisect_left(self._free_starts, start)
        # Coalesce with the previous and next free extents.
        if i > 0:
            prev = self._free_starts[i - 1]
            if prev + self._free[prev] == start:
                start, n = prev, n + self._free[prev]
                del self._free[prev]
                self._free_starts.pop(i - 1)
                i -= 1
        if i < len(self._free_starts) and start + n == self._free_starts[i]:
            nxt = self._free_starts.pop(i)
            n += self._free.pop(nxt)
        self._insert(start, n)

    def _insert(self, start: int, length: int) -> None:
        bisect.insort(self._free_starts, start)
        self._free[start] = length

    def reset(self) -> None:
        with self._lock:
            self._free_starts.clear()
            self._free.clear()
            self._later.clear()
            self.size = 0
            self._allocated = 0


@dataclass(slots=True)
class Extent:
    """One chunk of a stored tensor: which root's slab, where, how long (unpadded), how far
    into its place the chunk's first byte is (``shift``: io/bounce.py), and how long its place
    is (``room``: the length padded, plus what any shift could need, so that the space a step
    takes does not depend on where its tensors happened to be in memory)."""

    root: int
    offset: int
    length: int
    crc: Optional[int] = None
    shift: int = 0
    room: int = 0
