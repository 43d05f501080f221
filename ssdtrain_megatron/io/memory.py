"""The 'memory' engine: a host-memory pool (the paper's CPU offloader) and the spill-over tier.

Why these choices:
- One pool of ``host_memory_bytes``, allocated once, carved into extents by the same
  :class:`ExtentAllocator` the slab files use: no allocation (and, on CUDA machines, no
  ``cudaHostAlloc``, which synchronises the device) in the hot path.
- The pool is pinned only where CUDA exists: pinning is what makes GPU<->host copies
  asynchronous DMA; on a CPU-only machine it would only lock memory for nothing. It is pinned
  at exactly its size (io/pinned.py; ``pinned_bytes``), not torch's next power of two. Either way
  every page is committed at construction (pinning does it; on CPU the pool is zero-filled):
  a pool that does not fit in RAM fails at start-up, not in the middle of a step, and the
  first step does not pay a page fault per 4 KiB.
- The copies run on worker threads, never on the training thread: handing over a tensor costs
  an extent allocation and a queue push.
- A full pool is a :class:`PoolFull` error raised in the caller's thread, before anything is in
  flight; the 'tiered' engine catches it and sends the tensor to SSD instead.
- On a GPU the pool is the staging: ``pool_view`` allocates a key's extent up front and the
  offloader copies device -> extent (and back) on its own streams, one copy each way instead
  of device -> pinned staging -> pool. No worker takes part: the offloader sees the copy's
  event complete and says so (``commit``), and it copies the bytes back out itself
  (``pool_view_of``, counted with ``pool_read``); the meters and the trace count both.
  ``fence`` names the event of the last copy into or out of an extent: a released extent is
  handed out again only once that event completed (``query``, never a wait), like a staging
  block (cache/device_copy.py). An extent keeps its own fence or none: ``commit`` (the copy
  in ran) drops the copy's, which the data path then reuses for other record points.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..config import OffloadConfig
from .affinity import pin_io_thread
from .base import BusyMeter, EngineError, IOEngine, as_bytes
from .extents import ExtentAllocator
from .layout import Identity
from .gpu_wait import wait_for
from .pinned import pin

log = logging.getLogger(__name__)

POOL_ALIGN = 512  # extents start on 512-byte boundaries (DMA-friendly, little waste)
TRACE_PATH = "<host memory>"  # the 'file' of this engine's rows in the IO trace


class PoolFull(EngineError):
    """The host-memory pool has no room for a tensor; nothing was started."""


def _cuda_available() -> bool:
    return torch.cuda.is_available()


class MemoryEngine(IOEngine):
    """Keeps byte ranges in one host-memory pool of ``config.host_memory_bytes``.

    ``bytes_on_disk`` (the interface's name for "bytes held for live keys") counts the pool
    bytes held; nothing of this engine ever touches a disk.

    Raises:
        PoolFull: from ``write`` when the tensor does not fit in what is left of the pool.
    """

    name = "memory"
    tier = "host"

    def __init__(self, config: OffloadConfig, ident: Optional[Identity] = None,
                 capacity: Optional[int] = None) -> None:
        self.config = config
        self.capacity = config.host_memory_bytes if capacity is None else capacity
        self.pinned = _cuda_available()
        # A zero-capacity pool is legal for 'tiered' (everything goes to SSD).
        if self.pinned:  # exactly the size asked, not the next power of two (io/pinned.py)
            self._pool, self.pinned_bytes = pin(self.capacity)
        else:
            self._pool, self.pinned_bytes = torch.zeros(self.capacity, dtype=torch.uint8), 0
        # pinned_bytes: host memory page-locked for the pool (what a RAM check must count;
        # torch's power of two where cudaHostRegister was refused, io/pinned.py)
        self._alloc = ExtentAllocator(POOL_ALIGN)
        self._lock = threading.Lock()
        self._extents: Dict[int, Tuple[int, int]] = {}  # key -> (offset, nbytes)
        self._in_place: Dict[int, float] = {}  # keys whose extent pool_view handed out, not yet written: since when
        self._reading: Dict[int, float] = {}  # keys the offloader copies out of the pool itself: since when
        self._fences: Dict[int, Any] = {}  # key -> event of the last device copy into/out of it
        self._fenced: List[Tuple[Tuple[int, int], Any]] = []  # released extents, until the event
        # Own threads, started now and fed through a SimpleQueue: a ThreadPoolExecutor would
        # start its threads inside the first submit() calls, on the training thread.
        self._requests: "queue.SimpleQueue[Optional[tuple]]" = queue.SimpleQueue()
        self._workers = [threading.Thread(target=self._work, name=f"ssdtrain-mem-{i}", daemon=True)
                         for i in range(config.io_threads)]
        for t in self._workers:
            t.start()
        self._closed = False
        self._queued = 0
        self.write_meter = BusyMeter()
        self.read_meter = BusyMeter()
        self.tracer: Optional[Callable[..., None]] = None
        """Optional IO trace sink: tracer(op, key, path, offset, nbytes, t_submit, t_done,
        queue_depth), called from a worker when each copy completes."""

    # -- properties -------------------------------------------------------------------------

    @property
    def bytes_on_disk(self) -> int:
        return self._alloc.allocated

    @property
    def bytes_in_memory(self) -> int:
        """Pool bytes held for live keys (extents are rounded up to 512 bytes)."""
        return self._alloc.allocated

    @property
    def page_cache_bypassed(self) -> bool:
        return True  # no file, no page cache

    # -- requests ---------------------------------------------------------------------------

    def pool_view(self, key: int, nbytes: int) -> Optional[torch.Tensor]:
        """The pool memory ``key``'s bytes will live in, allocated now (see the module
        docstring); ``write(key, <this view>, event)`` follows.

        Raises:
            PoolFull: no room (nothing is allocated)."""
        self._check_open()
        with self._lock:
            if key in self._extents:
                raise EngineError(f"key {key} written twice")
            offset = self._allocate(nbytes)
            self._extents[key] = (offset, nbytes)
            self._in_place[key] = time.perf_counter()
        self.write_meter.begin()  # the copy into it starts now; commit() or the write ends it
        return self._pool[offset:offset + nbytes]

    def commit(self, key: int) -> None:
        """The offloader's copy into ``key``'s ``pool_view`` ran: the bytes are stored. Its
        event fences nothing now (the data path gives it back to its event pool, to be
        re-recorded for something else): the extent keeps no fence until a copy out of it
        names its own."""
        with self._lock:
            t_view = self._in_place.pop(key, None)
            where = self._extents.get(key)
            if t_view is not None:
                self._fences.pop(key, None)
        if t_view is None or where is None:
            raise EngineError(f"commit of key {key}, which has no pool_view waiting for its bytes")
        self._counted("write", key, where, self.write_meter, t_view)

    def pool_read(self, key: int, started: bool) -> None:
        with self._lock:
            where = self._extents.get(key)
            t0 = self._reading.pop(key, None) if not started else None
            if started:
                self._reading[key] = time.perf_counter()
        if started:
            self.read_meter.begin()
        elif t0 is not None and where is not None:
            self._counted("read", key, where, self.read_meter, t0)

    def _counted(self, op: str, key: int, where: Tuple[int, int], meter: BusyMeter, t0: float) -> None:
        """A copy the offloader made into or out of the pool, done: the meter (begun when it
        started) and the trace count it."""
        offset, nbytes = where
        meter.end(nbytes)
        tracer = self.tracer
        if tracer is not None:
            tracer(op, key, TRACE_PATH, offset, nbytes, t0, time.perf_counter(), 1)

    def pool_view_of(self, key: int) -> Optional[torch.Tensor]:
        with self._lock:
            where = self._extents.get(key)
        if where is None or key in self._in_place:
            return None  # not stored yet
        return self._pool[where[0]:where[0] + where[1]]

    def stored_bytes(self, key: int) -> int:
        """The bytes stored under ``key`` (0: none)."""
        with self._lock:
            where = self._extents.get(key)
        return where[1] if where is not None else 0

    def fence(self, key: int, event: Any) -> None:
        with self._lock:
            if key in self._extents:
                self._fences[key] = event

    def write(self, key: int, data: torch.Tensor, ready_event: Optional[object] = None) -> Optional[Future]:
        self._check_open()
        nbytes = data.nbytes
        with self._lock:
            in_place = key in self._in_place  # already copied into its extent (pool_view)
            if in_place:
                del self._in_place[key]
                offset, nbytes = self._extents[key]
            elif key in self._extents:
                raise EngineError(f"key {key} written twice")
            else:
                offset = self._allocate(nbytes)
                self._extents[key] = (offset, nbytes)
        if in_place:
            if data.data_ptr() != self._pool.data_ptr() + offset or data.nbytes != nbytes:
                raise EngineError(f"key {key}: written from other memory than its pool_view")
            return self._start("write", key, offset, nbytes, self.write_meter, _wait, ready_event, begun=True)
        return self._start("write", key, offset, nbytes, self.write_meter,
                           self._copy_in, data, offset, nbytes, ready_event)

    def _allocate(self, nbytes: int) -> int:
        """Under the lock: an extent for ``nbytes``, or PoolFull."""
        self._reclaim()
        offset = self._alloc.allocate(nbytes)
        # The allocator grows without bound; the pool does not. An extent past the end is
        # given back (its bookkeeping beyond the pool stays free, never handed out whole).
        if offset + _padded(nbytes) > self.capacity:
            self._alloc.free(offset, nbytes)
            raise PoolFull(
                f"host memory pool full: {nbytes} bytes requested, "
                f"{self.capacity - self._alloc.allocated} of host_memory_bytes={self.capacity} free "
                f"(possibly fragmented); raise host_memory_bytes, or use engine='tiered' to spill "
                f"to SSD")
        return offset

    def _reclaim(self) -> None:
        """Under the lock: free the released extents whose last device copy has run."""
        if self._fenced:
            still = []
            for where, event in self._fenced:
                if event.query():
                    self._alloc.free(*where)
                else:
                    still.append((where, event))
            self._fenced = still

    def read(self, key: int, out: torch.Tensor, ready_event: Optional[object] = None) -> Optional[Future]:
        self._check_open()
        with self._lock:
            where = self._extents.get(key)
        if where is None:
            raise EngineError(f"read of unknown key {key}")
        offset, nbytes = where
        if out.nbytes != nbytes:
            raise EngineError(f"read of key {key} into {out.nbytes} bytes; {nbytes} were written")
        if out.device.type == "cpu" and out.data_ptr() == self._pool.data_ptr() + offset:
            # Its own extent (pool_view): the bytes are there; the device copy is the caller's.
            return self._start("read", key, offset, nbytes, self.read_meter, _wait, None)
        return self._start("read", key, offset, nbytes, self.read_meter,
                           self._wait_then_copy_out, out, offset, nbytes, ready_event)

    def _start(self, op: str, key: int, offset: int, nbytes: int, meter: BusyMeter, fn, *args,
               begun: bool = False) -> Optional[Future]:
        """Queue a request for the workers; its meter starts now (``begun``: it started at
        ``pool_view``)."""
        with self._lock:
            self._queued += 1
            depth = self._queued
        if not begun:
            meter.begin()
        sink = self.completions
        fut: Optional[Future] = Future() if sink is None else None
        self._requests.put((fut, sink, op, key, offset, nbytes, meter, depth, time.perf_counter(), fn, args))
        return fut

    def _work(self) -> None:
        """Worker thread: run requests in order until the None that close() queues.

        Every reference to a request's tensor is dropped before its completion is reported,
        and nothing of it stays bound while the thread waits for the next request: a worker
        must never keep the last tensor it handled alive."""
        pin_io_thread(self.config.io_cpus)
        while True:
            request = self._requests.get()
            if request is None:
                return
            fut, sink, op, key, offset, nbytes, meter, depth, t_submit, fn, args = request
            request = None
            exc: Optional[BaseException] = None
            try:
                fn(*args)
            except Exception as e:  # noqa: BLE001 - reported to the caller below
                exc = EngineError(f"host-memory {op} of {nbytes} bytes (key {key}) failed: {e}")
                exc.__cause__ = e
            except BaseException as e:  # noqa: BLE001 - reported to the caller as it is
                exc = e
            fn = args = None
            with self._lock:
                self._queued -= 1
            meter.end(nbytes)
            tracer = self.tracer
            if tracer is not None and exc is None:
                tracer(op, key, TRACE_PATH, offset, nbytes, t_submit, time.perf_counter(), depth)
            if sink is not None:
                sink.put((key, exc))
            elif exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(nbytes)
            fut = sink = exc = None

    def release(self, key: int) -> None:
        with self._lock:
            where = self._extents.pop(key, None)
            fence = self._fences.pop(key, None)
            never_stored = self._in_place.pop(key, None) is not None
            reading = self._reading.pop(key, None) is not None
            if where is not None:
                if fence is None or fence.query():
                    self._alloc.free(*where)
                else:  # a device copy into or out of it may still run: free it after
                    self._fenced.append((where, fence))
        if never_stored:  # its pool_view's copy never reported: the meter it began ends
            self.write_meter.end(0)
        if reading:  # a copy out the offloader did not see finish: counted as done now
            self.read_meter.end(where[1] if where is not None else 0)

    def end_step(self) -> None:
        with self._lock:
            self._reclaim()
            if not self._extents and not self._fenced:
                self._alloc.reset()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for _ in self._workers:
            self._requests.put(None)
        for t in self._workers:
            t.join()
        with self._lock:
            # The pool goes below: device copies into or out of it must have run (close, not
            # the hot path, may wait).
            for event in [e for _, e in self._fenced] + list(self._fences.values()):
                wait_for(event)
            self._extents.clear()
            self._fences.clear()
            self._fenced = []
            self._alloc.reset()
        self._pool = torch.empty(0, dtype=torch.uint8)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError("engine is closed")

    # -- workers ----------------------------------------------------------------------------

    def _copy_in(self, data: torch.Tensor, offset: int, nbytes: int, ready_event) -> None:
        if ready_event is not None:
            wait_for(ready_event)
        if nbytes:
            self._pool[offset:offset + nbytes].copy_(as_bytes(data))

    def _wait_then_copy_out(self, out: torch.Tensor, offset: int, nbytes: int, ready_event) -> None:
        if ready_event is not None:  # kernels that used out's memory before must be done
            wait_for(ready_event)
        self._copy_out(out, offset, nbytes)

    def _copy_out(self, out: torch.Tensor, offset: int, nbytes: int) -> None:
        if nbytes:
            as_bytes(out).copy_(self._pool[offset:offset + nbytes])


def _wait(ready_event) -> None:
    """An in-place request: the bytes are where they belong once the event completed."""
    if ready_event is not None:
        wait_for(ready_event)


def _padded(nbytes: int) -> int:
    return (max(nbytes, 1) + POOL_ALIGN - 1) // POOL_ALIGN * POOL_ALIGN
