"""The GPU data path: device<->host copies on their own streams, ordered by events.

Contract (what the offloader, the IO engines and CUDA may each assume):

- Per device, one *offload* stream and one *reload* stream, created once. The training
  (compute) stream never carries one of our copies, and no IO thread issues a copy on it.
- A pinned *staging pool* of ``OffloadConfig.pinned_staging_bytes`` is allocated once, at
  construction (``cudaHostAlloc`` synchronises the device: never in the hot path). A request
  that does not fit in what is free takes page-locked memory from torch's caching host
  allocator instead, counted in ``staging_overflows`` and warned about once. Pinned memory
  that cannot be had at all is a :class:`StagingUnavailable` error at construction.
- Offload (``stage_out``, training thread): the bytes to store are taken first (a compact
  record's ``.contiguous()`` runs on the current stream), *then* a producer event is recorded
  on the current stream, so it covers the compaction as well as the kernel that wrote the
  tensor. The offload stream waits on that event and copies device->staging
  ``non_blocking``; a copy event is recorded after the copy. The engine gets the staging
  tensor and the copy event: its IO thread waits for that event only, then reads the host
  bytes. The device memory the copy reads is marked used by the offload stream
  (``record_stream``), so the allocator cannot hand it out again before the copy ran, whoever
  drops the last reference. The staging block goes back to the pool when the engine is done
  with it, *with the copy event*: a write that no IO thread ever waited for (taken back by
  ``engine.cancel``, refused with ``PoolFull``, or raised on by the engine) may still have its
  copy pending, and the next ``stage_in`` must not read disk bytes into a block that copy
  will land on later.
- Reload (``stage_in``, the thread that starts the read): the restored tensor is allocated on
  the current stream, and an *allocation event* is recorded there: memory freed on that
  stream may still be in use by kernels queued before, and the reload stream must not write
  into it before they ran. The engine reads into a staging block. ``finish_in`` (after the
  engine's read completed, on whatever thread observes that) makes the reload stream wait
  on the allocation event and copies staging->device ``non_blocking`` (and, for a compact
  record, scatters the packed bytes into their strided places, still on the reload stream);
  a *ready* event follows. The staging block is reused only once that event has completed
  (checked with ``query``, never by blocking).
- Unpack (``consume``, the consumer's thread and stream): the current stream waits on the
  ready event; the host does not block. If the consumer stream is not the one the tensor was
  allocated on, the tensor is marked used by it (``record_stream``).
- ``direct`` engines (gds: cuFile DMAs device memory outside any stream) get device memory,
  no staging: on writes the engine's IO thread waits for the producer event (recorded after
  compaction) before cuFile reads the bytes; on reads it waits for the allocation event
  before cuFile writes them, and the read's completion is observed by the host before the
  consumer is launched (a compact record's scatter runs on the reload stream, ordered
  before the consumer by the ready event).

``ops`` (a :class:`StreamOps`) is how this module reaches streams, events and copies:
:class:`CudaStreams` on a GPU; tests pass a recording stand-in that logs every record, wait,
synchronisation and copy with its stream, and check the happens-before chain of each tensor.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any, Callable, Deque, Optional, Tuple

import torch

from ..io.base import as_bytes
from ..io.gds import GDS_ALIGN
from ..io.extents import ExtentAllocator
from ..io.layout import ALIGN
from .stream_ops import CudaStreams, StreamOps

log = logging.getLogger(__name__)

# Staging blocks start on page boundaries (the pool is one pinned allocation, page-aligned):
# the posix engine then writes and reads a block with O_DIRECT in place, without copying it
# through its bounce buffer (io/posix.py).
STAGING_ALIGN = ALIGN


class StagingUnavailable(RuntimeError):
    """The pinned staging pool could not be allocated; the message says what to change."""


class _Block:
    """A staging block: ``tensor`` (uint8 host memory), and where it lies in the pool
    (``offset`` is None for an overflow block from torch's caching host allocator)."""

    __slots__ = ("tensor", "offset", "size")

    def __init__(self, tensor: torch.Tensor, offset: Optional[int], size: int) -> None:
        self.tensor = tensor
        self.offset = offset
        self.size = size


class StagingPool:
    """Pinned host memory allocated once, carved into blocks; never blocks the caller.

    A block given back with an event (a copy that may still read or write it) is reusable once
    that event has completed: ``take`` reclaims such blocks with ``query()``, never
    ``synchronize()``; a block whose copy has not run yet is skipped (the request takes another
    block, or overflow memory), so the training thread never waits on the GPU here.
    """

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
        self._pending: Deque[Tuple[_Block, Any]] = deque()  # (block, event it waits for)
        self.overflows = 0
        self.overflow_bytes = 0

    def take(self, nbytes: int) -> _Block:
        with self._lock:
            self._reclaim()
            offset = self._alloc.allocate(nbytes)
            size = _aligned(nbytes)
            if offset + size <= self.capacity:
                return _Block(self._mem[offset:offset + nbytes], offset, size)
            self._alloc.free(offset, size)
            self.overflows += 1
            self.overflow_bytes += nbytes
        # Outside the lock: the caching host allocator may call cudaHostAlloc the first time.
        return _Block(self._ops.pinned_empty(nbytes), None, nbytes)

    def give(self, block: _Block, after: Any = None) -> None:
        """Return ``block``; with ``after``, only once that event has completed."""
        if block.offset is None:
            return  # torch's caching host allocator tracks its own copies' events
        with self._lock:
            if after is None:
                self._alloc.free(block.offset, block.size)
            else:
                self._pending.append((block, after))

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
        still: Deque[Tuple[_Block, Any]] = deque()
        for block, event in self._pending:
            if event.query():
                self._alloc.free(block.offset, block.size)
            else:
                still.append((block, event))
        self._pending = still


def _aligned(n: int) -> int:
    return (max(n, 1) + STAGING_ALIGN - 1) // STAGING_ALIGN * STAGING_ALIGN


class Transfer:
    """One record's copy in flight: what must stay alive, and the events that order it."""

    __slots__ = ("block", "pooled", "copy_event", "source", "dest", "packed", "alloc_stream",
                 "alloc_event", "ready_event")

    def __init__(self) -> None:
        self.block: Optional[_Block] = None  # staging, until the engine (write) or the copy (read) is done
        self.pooled: Optional[torch.Tensor] = None  # instead of staging: the engine's pool_view memory
        self.copy_event: Any = None  # write: recorded on the offload stream after the copy into block
        self.source: Optional[torch.Tensor] = None  # direct write: the bytes cuFile reads
        self.dest: Optional[torch.Tensor] = None  # read: device bytes the engine or the copy fills
        self.packed: Optional[torch.Tensor] = None  # read of a compact record: packed elements
        self.alloc_stream: Any = None  # read: the stream the restored tensor belongs to
        self.alloc_event: Any = None  # read: recorded on alloc_stream after the allocation
        self.ready_event: Any = None  # read: recorded on the reload stream after the copy


class DeviceCopy:
    """The offloader's GPU data path (see the module docstring for the contract).

    Args:
        device: the training device.
        staging_bytes: size of the pinned staging pool (unused when ``direct``).
        ops: streams/events/copies; default :class:`CudaStreams`.
        direct: the engine reads and writes device memory itself (gds): no staging.

    Raises:
        StagingUnavailable: the staging pool's pinned memory cannot be had.
    """

    def __init__(self, device: torch.device, staging_bytes: int, ops: Optional[StreamOps] = None,
                 direct: bool = False) -> None:
        self.device = torch.device(device)
        self.ops = ops if ops is not None else CudaStreams()
        self.direct = direct
        self.offload_stream = self.ops.new_stream(self.device)
        self.reload_stream = self.ops.new_stream(self.device)
        self.pool = None if direct else StagingPool(staging_bytes, self.ops)
        self.timeline = None  # telemetry/timeline.py, while a step is recorded (the offloader sets it)
        self._warned = False
        self._closed = False

    # -- offload ----------------------------------------------------------------------------

    def stage_out(self, rec, into: Optional[torch.Tensor] = None,
                  fence: Optional[Callable[[Any], None]] = None) -> Tuple[torch.Tensor, Any, Transfer]:
        """Training thread: (bytes for the engine, the event the engine waits for before it
        reads them, the transfer to pass to :meth:`written` once the engine is done).

        ``into``: the engine's own pinned memory for these bytes (``IOEngine.pool_view``, the
        memory engine): the copy goes there, one copy instead of two, and ``fence`` gets its
        event (the engine reuses that memory only after it completed)."""
        ops = self.ops
        view = as_bytes(rec.bytes_view(ops.compact))  # compaction first: the event below must cover it
        produced = ops.new_event()
        produced.record(ops.current_stream(self.device))
        xfer = Transfer()
        if self.direct:
            xfer.source = view  # cuFile reads it once `produced` completed; alive until then
            return view, produced, xfer
        if into is not None:
            target = xfer.pooled = into
        else:
            xfer.block = self._take(view.numel())
            target = xfer.block.tensor
        stream = self.offload_stream
        copied = ops.new_event()
        tl = self.timeline
        try:
            stream.wait_event(produced)
            with ops.use(stream):
                span = tl.gpu_begin(stream, "offload", "d2h", "copy", record=rec.id, bytes=view.numel(),
                                    layer=str(rec.layer)) if tl is not None else None
                ops.copy(target, view)
                if span is not None:
                    tl.gpu_end(stream, span)
                copied.record(stream)
        except BaseException:
            # The caller keeps the tensor in memory. The copy may have been queued before the
            # error: the block goes back after an event behind it, or (when even that cannot
            # be recorded) never, rather than while a copy may still land in it.
            try:
                with ops.use(stream):
                    copied.record(stream)
            except BaseException:  # noqa: BLE001 - the first error is the one the caller sees
                log.error("ssdtrain: %d bytes of staging are withheld from the pool after a failed "
                          "device->host copy", target.numel())
                xfer.block = None
            if fence is not None:
                fence(copied)
            xfer.copy_event = copied
            self.written(xfer)
            raise
        if fence is not None:
            fence(copied)
        xfer.copy_event = copied
        # Whoever drops the last reference, the allocator waits for this copy first.
        ops.record_stream(view, stream)
        return target, copied, xfer

    def written(self, xfer: Transfer) -> None:
        """The engine's write finished, failed, or never started (cancelled, refused): its
        staging goes back to the pool, reusable once the copy into it has run (any thread;
        takes only the pool's lock, never waits). After a completed write the IO thread has
        already waited for that event; after the other outcomes nobody has."""
        block, xfer.block, xfer.source, xfer.pooled = xfer.block, None, None, None
        event, xfer.copy_event = xfer.copy_event, None
        if block is not None:
            self.pool.give(block, after=event)

    # -- reload -----------------------------------------------------------------------------

    def stage_in(self, rec, src: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, Any]:
        """The thread that starts the read: (restored tensor, where the engine reads the bytes
        into, the event the engine waits for before it writes there, or None). Sets
        ``rec.transfer``. ``src``: the engine's own memory that holds the bytes (its
        ``pool_view``): no staging; :meth:`finish_in` copies from it."""
        ops = self.ops
        alloc_stream = ops.current_stream(self.device)
        # on the current stream; cuFile (direct) reads into 4 KiB-aligned memory without bouncing
        restored, dest = rec.allocate_restore(GDS_ALIGN) if self.direct else rec.allocate_restore()
        xfer = Transfer()
        xfer.dest = as_bytes(dest)  # the staged bytes are copied in as bytes (finish_in)
        xfer.packed = rec.staging  # a compact record's packed elements (device), else None
        rec.staging = None
        xfer.alloc_stream = alloc_stream
        xfer.alloc_event = ops.new_event()
        xfer.alloc_event.record(alloc_stream)
        rec.transfer = xfer
        if self.direct:
            return restored, dest, xfer.alloc_event
        if src is not None:
            xfer.pooled = src
            return restored, src, None
        xfer.block = self._take(rec.nbytes)
        return restored, xfer.block.tensor, None

    def finish_in(self, rec) -> None:
        """After the engine's read completed (any thread): the bytes go to the device on the
        reload stream, after the allocation event; the consumer will wait on ``ready_event``."""
        xfer = rec.transfer
        if self.direct and xfer.packed is None:
            xfer.dest = None
            return  # cuFile wrote the bytes in place, and the host saw it finish
        ops = self.ops
        stream = self.reload_stream
        stream.wait_event(xfer.alloc_event)
        tl = self.timeline
        with ops.use(stream):
            span = tl.gpu_begin(stream, "reload", "h2d", "copy", record=rec.id, bytes=rec.nbytes,
                                layer=str(rec.layer)) if tl is not None else None
            source = xfer.block.tensor if xfer.block is not None else xfer.pooled
            if source is not None:
                ops.copy(xfer.dest, source)
            if xfer.packed is not None:
                ops.copy(rec.tensor, xfer.packed)  # scatter into the strided places
            if span is not None:
                tl.gpu_end(stream, span)
            xfer.ready_event = ops.new_event()
            xfer.ready_event.record(stream)
        # Allocated on the compute stream, written on this one: if the record is released
        # before a consumer ran (its backward never came), the allocator must still wait.
        for t in (rec.tensor, xfer.packed):
            if t is not None:
                ops.record_stream(t, stream)
        xfer.dest = xfer.packed = xfer.pooled = None
        if xfer.block is not None:
            self.pool.give(xfer.block, after=xfer.ready_event)
            xfer.block = None

    def read_failed(self, rec) -> None:
        """The engine's read failed: nothing was copied; the staging block is free."""
        xfer, rec.transfer = rec.transfer, None
        if xfer is not None:
            xfer.pooled = None
        if xfer is not None and xfer.block is not None:
            self.pool.give(xfer.block)
            xfer.block = None

    def consume(self, rec, out: torch.Tensor) -> None:
        """Unpack, on the consumer's thread: its stream waits for the reload; the host does
        not."""
        xfer = rec.transfer
        if xfer is None:
            return  # forwarded from memory: no copy to wait for
        ops = self.ops
        current = ops.current_stream(self.device)
        if xfer.ready_event is not None:
            tl = self.timeline
            span = tl.gpu_begin(current, "compute", "reload", "wait", record=rec.id, bytes=rec.nbytes,
                                layer=str(rec.layer)) if tl is not None else None
            current.wait_event(xfer.ready_event)
            if span is not None:
                tl.gpu_end(current, span)
        if current != xfer.alloc_stream:
            ops.record_stream(out, current)

    def close(self) -> None:
        """Wait until every copy ever queued on the offload and reload streams has run, then
        release the staging pool (close, not the hot path, may wait). A block still in flight
        (a cancelled or refused write whose copy no IO thread waited for, a record released
        with its transfer) would otherwise be unregistered and unmapped under its copy."""
        if self._closed:
            return
        self._closed = True
        for stream in (self.offload_stream, self.reload_stream):
            done = self.ops.new_event()
            done.record(stream)
            done.synchronize()
        if self.pool is not None:
            self.pool.close()

    @property
    def staging_overflows(self) -> int:
        return self.pool.overflows if self.pool is not None else 0

    def _take(self, nbytes: int) -> _Block:
        block = self.pool.take(nbytes)
        if block.offset is None and not self._warned:
            self._warned = True
            log.warning("ssdtrain: the pinned staging pool (pinned_staging_bytes=%d) has no room for %d "
                        "bytes; using torch's pinned host allocator for the overflow (counted in "
                        "DeviceCopy.staging_overflows). Raise pinned_staging_bytes.",
                        self.pool.capacity, nbytes)
        return block

