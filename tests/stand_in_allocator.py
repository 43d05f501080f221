"""A model of CUDA's caching allocator for the recording stand-in (tests/recording_streams.py).

Only what decides *which memory a tensor gets and when it may be reused*, as
c10/cuda/CUDACachingAllocator defines it:

- a block belongs to the stream it was allocated on; freed, it goes back to that stream's pool
  and serves only allocations on that stream (later work on one stream runs after earlier
  work, so reuse needs no event);
- ``record_stream(t, s)`` with ``s`` another stream: when ``t``'s block is freed, the allocator
  notes ``s``'s tail (an event recorded there at the free) and the block is reused only once
  ``s`` has run past it (queried at the next allocation, never waited for: ``s`` is never made
  to run by the free or by the query);
- nothing is ever given back to the device (no ``empty_cache``): ``reserved`` only grows.
  Blocks are reused by their size rounded to 512 bytes (CUDA's alignment), the free block at
  the lowest address first (CUDA's ordering of its free blocks); CUDA would also
  split a larger block, which the scenes here (tensors of a few fixed sizes) never need.

Each tensor handed out is a *new* storage over its block (``torch.frombuffer``), so its death
is seen by polling a weak reference (``collect``: at every allocation and every stream
operation), as the allocator sees ``free``. The stand-in's deferred copies hold ``raw`` views
of the block (another storage over the same memory), so a queued copy does not keep a freed
block alive, just as a queued CUDA copy does not.

``poison``: when a block goes back to its pool, its bytes are overwritten (0xA5) as an
operation on the owning stream: at once (queued behind the stream's earlier work) for a block
no other stream was recorded on; for one marked by ``record_stream``, when the block is handed
out again (only once every marked stream has run past its free point, as the reuse itself):
the marked streams are not made to run at the free. Any copy or kernel that reads or writes
the block later than CUDA's rules allow then moves wrong bytes, and the exactness oracle
(bitwise gradients, restored bytes) names the tensor.
"""

from __future__ import annotations

import bisect
import mmap
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

ALIGN = 512
POISON = 0xA5


def rounded(nbytes: int) -> int:
    return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)


class _Block:
    __slots__ = ("mem", "raw", "start", "size", "stream", "ref", "uses", "free_at")

    def __init__(self, size: int, stream: str) -> None:
        self.mem = mmap.mmap(-1, size)
        self.raw = torch.frombuffer(self.mem, dtype=torch.uint8)  # the stand-in's own view
        self.start = self.raw.data_ptr()
        self.size, self.stream = size, stream
        self.ref: Any = None  # weak reference to the storage lent out, None when free
        self.uses: set = set()  # other streams recorded on it (record_stream)
        self.free_at: List[Tuple[str, int]] = []  # (stream, its position at the free)


class CachingAllocator:
    """One pool per stream (module docstring). ``position(stream)`` and ``done(stream)`` come
    from the recorder: how many operations the stream was given, and how many it has run;
    ``enqueue(stream, fn, after)`` queues ``fn`` on it behind the points in ``after``."""

    def __init__(self, position: Callable[[str], int], done: Callable[[str], int],
                 enqueue: Callable[[str, Callable[[], None], List[Tuple[str, int]]], None],
                 poison: bool = False) -> None:
        self._position, self._done, self._enqueue = position, done, enqueue
        self.poison = poison
        self._blocks: List[_Block] = []  # sorted by start
        self._starts: List[int] = []
        self._free: Dict[Tuple[str, int], List[_Block]] = {}  # (stream, size) -> free blocks
        self.reserved: Dict[str, int] = {}
        self.allocated: Dict[str, int] = {}
        self.peak: Optional[Dict[str, Dict[str, int]]] = None  # both, per stream, at the peak
        self.reused = self.created = 0

    # -- what the recorder calls --------------------------------------------------------------

    def empty(self, nbytes: int, stream: str) -> torch.Tensor:
        """uint8 memory of ``nbytes`` on ``stream``'s pool (a new storage over the block)."""
        self.collect()
        size = rounded(nbytes)
        block = self._reusable(stream, size)
        if block is None:
            block = _Block(size, stream)
            i = bisect.bisect(self._starts, block.start)
            self._starts.insert(i, block.start)
            self._blocks.insert(i, block)
            self.reserved[stream] = self.reserved.get(stream, 0) + size
            self.created += 1
        else:
            self.reused += 1
        t = torch.frombuffer(block.mem, dtype=torch.uint8, count=nbytes)
        block.ref = t.untyped_storage()._weak_ref()
        block.uses, block.free_at = set(), []
        self.allocated[stream] = self.allocated.get(stream, 0) + size
        self._note_peak()
        return t

    def record_stream(self, ptr: int, stream: str) -> None:
        block = self.block_of(ptr)
        if block is not None and block.ref is not None and stream != block.stream:
            block.uses.add(stream)

    def raw(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` itself, or, when it lies in a block, the same view over the block's own
        storage (a queued copy must not keep the lent storage alive: module docstring)."""
        block = self.block_of(t.data_ptr())
        if block is None or t.numel() == 0:
            return t
        offset = t.data_ptr() - block.start
        if offset % t.element_size():
            return t
        return block.raw.view(t.dtype).as_strided(t.shape, t.stride(), offset // t.element_size())

    def block_of(self, ptr: int) -> Optional[_Block]:
        i = bisect.bisect(self._starts, ptr) - 1
        if i >= 0 and ptr < self._blocks[i].start + self._blocks[i].size:
            return self._blocks[i]
        return None

    def collect(self) -> None:
        """Blocks whose storage died go back to their stream's pool (with their free points)."""
        expired, free_ref = torch.UntypedStorage._expired, torch.UntypedStorage._free_weak_ref
        for block in self._blocks:
            if block.ref is None or not expired(block.ref):
                continue
            free_ref(block.ref)
            block.ref = None
            block.free_at = [(s, self._position(s)) for s in sorted(block.uses)]
            self.allocated[block.stream] -= block.size
            self._free.setdefault((block.stream, block.size), []).append(block)
            if self.poison and not block.free_at:
                self._poison(block)

    def report(self) -> Dict[str, Any]:
        """Reserved and allocated bytes per stream, now and at the peak of allocated bytes."""
        self.collect()
        return {"reserved": dict(self.reserved), "allocated": dict(self.allocated),
                "peak": self.peak, "reused": self.reused, "created": self.created}

    def reset_peak(self) -> None:
        """Start measuring a new peak (a step's), from what is allocated now."""
        self.collect()
        self.peak = None
        self._note_peak()

    def peak_ratio(self) -> float:
        """Reserved over allocated bytes, all streams together, when allocated was highest."""
        if not self.peak:
            return 0.0
        return sum(self.peak["reserved"].values()) / max(1, sum(self.peak["allocated"].values()))

    # -- inside ------------------------------------------------------------------------------

    def _reusable(self, stream: str, size: int) -> Optional[_Block]:
        free = self._free.get((stream, size))
        if not free:
            return None
        # CUDA's order among free blocks of one stream and size: the lowest address first.
        for i, block in sorted(enumerate(free), key=lambda ib: ib[1].start):
            if all(self._done(s) >= pos for s, pos in block.free_at):
                if self.poison and block.free_at:  # marked: poisoned once reusable (module docstring)
                    self._poison(block)
                return free.pop(i)
        return None

    def _poison(self, block: _Block) -> None:
        raw = block.raw
        self._enqueue(block.stream, lambda: raw.fill_(POISON), [])

    def _note_peak(self) -> None:
        total = sum(self.allocated.values())
        if self.peak is None or total > sum(self.peak["allocated"].values()):
            self.peak = {"reserved": dict(self.reserved), "allocated": dict(self.allocated)}
