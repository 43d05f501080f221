"""On a CPU training device: host memory for restored tensors, reused from step to step.

Why: on the CPU, a tensor read back from the engine needs new memory that keeping it would not
have needed. Fresh memory from the C allocator is, for activations of megabytes, fresh pages
from the kernel: each first touch is a page fault that zeroes the page. Measured on a 2-core
VM, faulting in 1.9 GB (one bench step's reads) took 2.1 s of wall time and 0.7 s of system
CPU against 0.3 s for reusing memory already touched: that, not the IO, was most of what
offload cost over keep there. A GPU does not have this cost (torch's caching allocator hands
freed blocks out again), and this pool gives the CPU the same: memory a restored tensor used
goes to the next restore of the same size, already faulted in.

Contract:
- Each block is a private anonymous mapping of its own (page-aligned, so the record can place
  the tensor at the residue it had, record.py), advised for transparent huge pages from 2 MiB
  (``_map``). Every tensor handed out gets a *new* storage over
  a block (``torch.frombuffer``), so no two tensors ever share a storage object: identity
  (identity.py) and version counters behave exactly as with ``torch.empty``. The storage holds
  the mapping alive, so memory stays valid however long the tensor lives, even after the pool
  is gone.
- A block is reused only once the storage handed out over it has died (no tensor, view or
  storage references it: ``UntypedStorage._expired`` on a weak reference). The pool polls for
  that when it is asked for memory; nothing runs in a destructor, and no lock is taken: the
  pool belongs to the training thread (where reads are started).
- At most ``capacity`` bytes are mapped (lent and free together); past that, free blocks of
  other sizes are unmapped, and if that is not enough the request gets ``torch.empty`` memory.
  The bytes read back in flight and waiting for backward are bounded by the read budget, so
  a capacity of that size serves every restore after the first step.
- Only tensors of at least ``MIN_POOLED_BYTES`` are pooled. Smaller ones come from the C
  allocator's heap, which reuses freed memory without page faults already, and pooling them
  would cost a mapping each plus a scan of every lent block of their size per request: with
  10,000 small tensors a step that scan made each restore take milliseconds
  (tests/test_soak.py). Above the threshold the capacity bounds the lent blocks to a few
  hundred, so the scan stays short.
- Contents are whatever the block held before, as ``torch.empty`` gives whatever the allocator
  had: every byte the record restores is written by the read.
"""

from __future__ import annotations

import mmap
from typing import Dict, List, Optional, Tuple

import torch

PAGE = mmap.PAGESIZE
MIN_POOLED_BYTES = 1 << 20  # glibc serves smaller requests from its heap (module docstring)
HUGE_PAGE = 2 << 20  # x86-64 and arm64 (4 KiB pages): the transparent huge page size


def _map(size: int) -> mmap.mmap:
    """A private anonymous mapping of ``size`` bytes, advised for transparent huge pages when it
    can hold one. Private: a forked process (a data-loader worker) gets copy-on-write pages, not
    the parent's memory. Huge pages: each O_DIRECT read pins the pages it reads into, one
    ``struct page`` at a time for 4 KiB pages, and the first use of a block faults it in page by
    page; with 2 MiB pages both are 512 times fewer operations. (On a 2-core VM the bench's
    step time moved by less than its noise; the gain is CPU the IO threads no longer take
    from training, which grows with the bytes read.) The advice is a hint: where THP is off
    (``never``) or unsupported the block simply has 4 KiB pages."""
    block = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if size >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            block.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel built without THP refuses the advice (EINVAL)
            pass
    return block


class RestorePool:
    """Page-aligned host blocks for restored tensors, reused by exact (page-rounded) size.

    Args:
        capacity: most bytes mapped at once (lent and free).
        min_bytes: smaller requests get ``torch.empty`` memory (default ``MIN_POOLED_BYTES``).

    ``reused`` / ``mapped`` / ``outside``: how many requests reused a block, mapped a new
    one, or got ``torch.empty`` memory because the pool was full.
    """

    def __init__(self, capacity: int, min_bytes: Optional[int] = None) -> None:
        self.capacity = capacity
        self.min_bytes = MIN_POOLED_BYTES if min_bytes is None else max(1, min_bytes)
        self.mapped_bytes = 0
        self._free: Dict[int, List[mmap.mmap]] = {}
        self._lent: Dict[int, List[Tuple[mmap.mmap, int]]] = {}  # size -> (block, storage weak ref)
        self.reused = self.mapped = self.outside = 0

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device = None) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements (uninitialised, page-aligned when pooled); the
        signature of the ``torch.empty`` calls it replaces (record.py). ``device``: the CPU."""
        nbytes = numel * dtype.itemsize
        if nbytes < self.min_bytes:
            return torch.empty(numel, dtype=dtype)
        size = -(-nbytes // PAGE) * PAGE
        block = self._take(size)
        if block is None:
            self.outside += 1
            return torch.empty(numel, dtype=dtype)
        t = torch.frombuffer(block, dtype=dtype, count=numel)
        self._lent.setdefault(size, []).append((block, t.untyped_storage()._weak_ref()))
        return t

    def _take(self, size: int):
        free = self._free.get(size)
        if not free:
            self._collect(size)
            free = self._free.get(size)
        if free:
            self.reused += 1
            return free.pop()
        if self.mapped_bytes + size > self.capacity:
            self._unmap_free(size)
            if self.mapped_bytes + size > self.capacity:
                return None
        self.mapped += 1
        self.mapped_bytes += size
        return _map(size)

    def _collect(self, size: int) -> None:
        """Blocks of ``size`` whose storage has died go back to the free list."""
        lent = self._lent.get(size)
        if not lent:
            return
        expired, free_ref = torch.UntypedStorage._expired, torch.UntypedStorage._free_weak_ref
        still = []
        for block, ref in lent:
            if expired(ref):
                free_ref(ref)
                self._free.setdefault(size, []).append(block)
            else:
                still.append((block, ref))
        self._lent[size] = still

    def _unmap_free(self, need: int) -> None:
        """Make room for ``need`` bytes: drop free blocks (of every size, after collecting the
        dead ones), until it fits. A dropped block is unmapped once nothing references it."""
        for size in list(self._lent):
            self._collect(size)
        for size, blocks in self._free.items():
            while blocks and self.mapped_bytes + need > self.capacity:
                blocks.pop()
                self.mapped_bytes -= size

    def close(self) -> None:
        """Forget every block: free ones are unmapped now, lent ones when their tensor dies."""
        free_ref = torch.UntypedStorage._free_weak_ref
        for lent in self._lent.values():
            for _block, ref in lent:
                free_ref(ref)
        self._lent.clear()
        self._free.clear()
        self.mapped_bytes = 0
