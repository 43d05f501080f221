"""The path of a request through a disk engine's IO threads.

Why these choices:
- A request is one tensor. Its chunks are placed (``Placement``) by the first IO thread that
  reaches it, in queue order, so tensors written one after another are contiguous in the slab
  and the training thread pays for no arithmetic.
- IO threads take a request a chunk at a time (``ChunkQueue``), so one large tensor keeps every
  thread busy; chunks queued right behind each other that continue each other in a slab (small
  tensors written one after another, or read back in reverse order, as backward does) become
  one ``Run``: one system call.
- A request's Future completes only when none of its chunks is in flight, even when one
  failed: the caller may then free its extents or reuse its tensor at once.
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Deque, Dict, List, Optional, Protocol, Tuple

import torch

from . import hostmem
from .base import BusyMeter, as_bytes
from .extents import Extent

class Placement:
    """Where one stored tensor's chunks live: one extent per root (``allocs``: root, offset,
    bytes) and the chunks in tensor order (``extents``). An IO thread fills it in when it
    reaches the write, so the training thread does not pay for the arithmetic."""

    __slots__ = ("nbytes", "allocs", "extents")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.allocs: List[Tuple[int, int, int]] = []
        self.extents: Optional[List[Extent]] = None


class RequestOwner(Protocol):
    """What a request needs of the engine that made it (``SlabEngine``), named here so that
    this module does not import the engine: where completions go (None: each request
    completes its own Future), and the placement of a write's chunks, done by the first IO
    thread that reaches it (under the queue's lock, so in queue order)."""

    completions: Optional[Any]

    def place_chunks(self, placement: Placement, req: "Request") -> None: ...


class Request:
    """One tensor's write or read: its placement, and its completion once the last chunk is
    done: a Future, or an item on the engine's ``completions`` queue. It fails with the first
    chunk error, but only once no chunk is in flight. Chunk i starts at byte
    ``i * chunk_bytes`` of the tensor."""

    __slots__ = ("future", "key", "t_submit", "depth", "writing", "tensor", "nbytes", "placement",
                 "owner", "ready_event", "meter", "next_chunk", "error", "completions", "cancelled",
                 "_left", "_lock", "_addr")

    def __init__(self, owner: RequestOwner, key: int, writing: bool, tensor: torch.Tensor,
                 placement: Placement, n_chunks: int, ready_event: Optional[object], meter: BusyMeter,
                 depth: int) -> None:
        self.completions = owner.completions
        self.future: Optional[Future] = Future() if self.completions is None else None
        self.owner = owner
        self.key = key
        self.t_submit = time.perf_counter()
        self.depth = depth  # chunks queued or in flight when this request was made (for the trace)
        self.writing = writing
        self.tensor: Optional[torch.Tensor] = tensor  # any dtype: see bytes()
        self.nbytes = placement.nbytes  # the tensor's, read once by the engine
        self.placement = placement
        self.ready_event = ready_event
        self.meter = meter
        self.next_chunk = 0  # guarded by the queue's lock
        self.cancelled = False  # guarded by the queue's lock: taken out before any chunk started
        self.error: Optional[BaseException] = None
        self._left = n_chunks
        self._addr: Optional[int] = None  # see address()
        # Only chunks of one request finishing on several threads need a lock; most requests
        # (activations up to chunk_bytes) are one chunk, and the training thread makes them.
        self._lock = threading.Lock() if n_chunks > 1 else None

    def bytes(self) -> torch.Tensor:
        """The request's memory as 1-D uint8 (call from an IO thread: the training thread
        hands over the tensor as it is, see io/base.py). Made once; two threads taking chunks
        of one request at once may both make it, which is harmless."""
        t = self.tensor = as_bytes(self.tensor)  # the tensor itself once it is the bytes
        return t

    def address(self) -> int:
        """The address of the request's first byte (host memory; the staged engines' IO
        threads move chunks by address, io/hostmem.py). Valid while ``tensor`` is held, that
        is until the last chunk is done."""
        addr = self._addr
        if addr is None:
            addr = self._addr = hostmem.address(self.tensor)
        return addr

    @property
    def extents(self) -> List[Extent]:
        """The chunks, placing them first if no IO thread has yet (call from an IO thread)."""
        if self.placement.extents is None:
            self.owner.place_chunks(self.placement, self)
        return self.placement.extents

    def chunk_done(self, exc: Optional[BaseException]) -> None:
        if self._lock is None:  # one chunk: this is the only call
            if exc is not None:
                self.error = exc
            self._left = 0
            finished = True
        else:
            with self._lock:
                if exc is not None and self.error is None:
                    self.error = exc
                self._left -= 1
                finished = self._left == 0
        if finished:
            # Drop the tensor (and the event) before anyone learns the request is done: the
            # caller may free the tensor at once, and an IO thread must not keep it alive.
            self.tensor = self.ready_event = None
            self.meter.end(self.nbytes)
            if self.completions is not None:
                self.completions.put((self.key, self.error))
            elif self.error is not None:
                self.future.set_exception(self.error)
            else:
                self.future.set_result(self.nbytes)


class ChunkQueue:
    """Requests waiting for IO threads, which take one chunk (or a run of them) at a time.

    The training thread's side is cheap: ``put`` appends without the lock and takes it only to
    wake an IO thread that is waiting (none is while IO is under way). That relies on the GIL
    ordering the append before the read of ``_idle``: a thread counts itself idle under the
    lock *before* it looks at the queues, so either ``put`` sees it counted or it sees the
    request. (A free-threaded build would need the lock in ``put``.)

    Reads go first: a read is what backward is (or soon will be) waiting for, a write only
    frees memory, so a read never waits behind queued writes. A write that has not started
    can be cancelled (its tensor was released before it was written). A request's meter
    starts when an IO thread takes its first chunk: the device's busy time, measured off the
    training thread."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._reads: Deque[Request] = collections.deque()
        self._writes: Deque[Request] = collections.deque()
        self._closed = False
        self._idle = 0  # IO threads in get_run that may wait (guarded by the lock)

    def put(self, req: Request) -> None:
        # Wake one thread; each thread that takes a chunk wakes the next while chunks are
        # left, so the futex wake-ups are not all paid by the training thread.
        (self._writes if req.writing else self._reads).append(req)
        if self._idle:
            with self._cv:
                self._cv.notify()

    def cancel(self, req: Request) -> bool:
        """Take a queued write whose first chunk no IO thread has taken out of the queue;
        False when it already started (it then completes as usual)."""
        with self._cv:
            if req.next_chunk or req.cancelled:
                return False
            req.cancelled = True  # skipped (and dropped) when it reaches the head
            return True

    def _head(self) -> Optional[Deque[Request]]:
        """The queue to take from next (reads first), cancelled writes dropped from its head."""
        while self._writes and self._writes[0].cancelled:
            self._writes.popleft()
        if self._reads:
            return self._reads
        return self._writes if self._writes else None

    def get_run(self, wait: bool, limit: int, padded: Callable[[int], int],
                max_parts: Optional[int] = None) -> Optional[List[Tuple[Request, int]]]:
        """The next chunk, plus the chunks queued right behind it that continue it in the same
        slab (after its end, or before its start: reads come back in reverse order), in the
        same direction, up to ``limit`` padded bytes and ``max_parts`` chunks (posix: one
        iovec each, and the kernel refuses more than IOV_MAX with EINVAL). The run is in file
        order. None when closed and drained, or, with ``wait=False``, when nothing is queued
        right now."""
        with self._cv:
            self._idle += wait  # before looking: see the class docstring
            try:
                items = self._head()
                while wait and items is None and not self._closed:
                    self._cv.wait()
                    items = self._head()
            finally:
                self._idle -= wait
            if items is None:
                return None
            run = collections.deque([self._pop(items)])
            req0, i0 = run[0]
            first = req0.extents[i0]
            lo, hi = first.offset, first.offset + first.room
            while items:
                req = items[0]
                if req.cancelled:
                    items.popleft()
                    continue
                ext = req.extents[req.next_chunk]
                step = ext.room
                if ext.root != first.root or hi - lo + step > limit or len(run) == max_parts:
                    break
                if ext.offset == hi:
                    run.append(self._pop(items))
                    hi += step
                elif ext.offset + step == lo:
                    run.appendleft(self._pop(items))
                    lo -= step
                else:
                    break
            if self._idle and self._head() is not None:
                self._cv.notify()
            return list(run)

    @staticmethod
    def _pop(items: Deque[Request]) -> Tuple[Request, int]:
        req = items[0]
        i = req.next_chunk
        if i == 0:
            req.meter.begin()
        req.next_chunk += 1
        if req.next_chunk == len(req.extents):
            items.popleft()
        return req, i

    def close(self) -> None:
        """IO threads finish what is queued, then exit."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()


class Run:
    """One system call's worth of IO: chunks contiguous in one slab, staged back to back in
    ``buf`` (usually one chunk; several small ones when they were queued together)."""

    __slots__ = ("parts", "buf", "root", "offset", "nbytes", "writing", "failed", "direct")

    def __init__(self, parts: List[Tuple[Request, int]], buf: torch.Tensor, padded: Callable[[int], int]) -> None:
        first = parts[0][0].extents[parts[0][1]]
        last = parts[-1][0].extents[parts[-1][1]]
        self.parts = parts
        self.buf = buf
        self.root = first.root
        self.offset = first.offset
        # the last chunk's bytes, not its whole place (bounce.py): no spare page to move
        self.nbytes = last.offset + padded(last.shift + last.length) - first.offset
        self.writing = parts[0][0].writing
        self.failed: Dict[int, BaseException] = {}  # part index -> its injected error (tests)
        # Per part, the request's own memory (a buffer over it, io/hostmem.py) when the IO
        # uses it in place (zero-copy), else None (the part goes through ``buf``); None for
        # the whole run when no part does.
        self.direct: Optional[List[Optional[memoryview]]] = None
