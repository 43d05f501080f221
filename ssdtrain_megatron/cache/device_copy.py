"""The GPU data path: device<->host copies on their own streams, ordered by events.

Contract (what the offloader, the IO engines and CUDA may each assume):

- Per device, one *offload* stream and one *reload* stream, created once. The training
  (compute) stream never carries one of our copies, and no IO thread issues a copy on it.
- Offload (``stage_out``, training thread), in *batches* (``writes()``: the records one
  layer's deferral or one pack hands over): one *producer* event recorded on the compute
  stream covers the kernels that wrote every record of the batch; the offload stream waits on
  it once and, inside one stream context, compacts what needs compacting (a view that touches
  a third of its storage: on the offload stream, after the producer) and copies each record
  device -> host ``non_blocking`` into its pinned target (a staging block, or the memory
  engine's own pool extent: one copy, no staging), with a *copy* event after each. The engine
  gets the host bytes and the copy event: its IO thread waits for that event only.
- The device bytes a copy reads stay referenced by the offloader until the copy is known to
  have run (``landed``: the copy event's ``query()`` answered True on the training thread,
  never a wait); only then does the offloader let them go, so the allocator cannot hand the
  memory out again under the copy. Nothing marks them used by the offload stream
  (``record_stream``, which would hold every freed block until the stream's tail), so an
  owner that frees the storage in place (``resize_(0)``) before the copy landed is found
  when it lands, and the record kept (cache/transfers.py ``_landed``; docs/design.md,
  "Storages freed in place"). Bytes of a
  write that is abandoned before it landed (taken back, refused, released: nobody reads them)
  are marked used by the offload stream instead, then dropped.
- A staging block goes back to the pool when the engine is done with it, with the event of the
  last copy into or out of it unless that copy is known to have landed: the next ``take``
  must not hand out a block a copy will still land on (staging.py).
- Reload (``finish_in``, after the engine's read into a staging block completed, or at once
  from the memory engine's pool; the training thread): the restored tensor is allocated *on
  the compute stream named at install* (the stream current when the offloader was built,
  whatever stream or thread is current at the restore: a read that completes inside a write
  batch's back-pressure is restored under the offload stream's context) just before its
  copy (no read-ahead holds device memory while the drive reads). CUDA's caching allocator hands a freed block only to allocations on the
  stream that freed it, and the activations forward let go and backward frees go back to the
  compute stream's pool: allocated there, restores reuse that memory instead of growing a
  pool of their own beside it (tests/test_restore_memory.py measures reserved against
  allocated bytes). An *allocation* event recorded on the compute stream orders the reload
  stream after whatever used the block before (its cost: a reload copy never starts before
  the compute stream has reached the point where the host allocated, so read-ahead is
  ahead of the compute stream by what the host issued since). The bytes are copied host ->
  device on the reload stream (and a compact record's packed elements scattered into their
  strided places, still there; the packed memory is marked used by the reload stream, since
  it goes back to the compute stream's pool as soon as the scatter is queued), and a *ready*
  event follows. The staging block is reused only once that event has completed (``query``).
- Unpack (``consume``, the consumer's thread and stream): the current stream waits on the
  ready event (the host does not block). A consumer on a stream other than the one the
  tensor was allocated on marks it used by its stream (``record_stream``); on that stream
  itself no mark is needed (its later work, and the block's reuse, follow the consumer). A
  restored tensor released before anyone consumed it (``unused``) makes its stream wait for
  the ready event first, so that its block, back in the pool at once, is not written before
  the copy into it has landed.
- Restored tensors have the size of the original: a tensor that started on a 512-byte boundary
  (the caching allocator's alignment: every dense activation) is allocated at exactly its
  bytes, on the stream it was freed on, so it falls in the size class of the block it came
  from and can reuse it.
- ``direct`` engines (gds: cuFile DMAs device memory outside any stream) get device memory,
  no staging: on writes the engine's IO thread waits for the producer event before cuFile
  reads the bytes; on reads the restored tensor is allocated on the compute stream at
  prefetch with an *allocation event* the engine waits for before cuFile writes into it, and
  the read's completion is observed by the host before the consumer is launched (a compact
  record's scatter runs on the reload stream, ordered before the consumer by the ready event).
- Events come from a pool (``_event``; the newest freed is handed out first). An event that
  only orders streams or threads (a producer event, a write's copy event once it landed) goes
  back when nothing will wait on its last record point again: CUDA orders a wait by the record
  point at the time of the wait. An event that *fences a buffer* (a read's ready event: a
  staging block, a memory-engine extent, the engine's read meter hold it and ``query`` it
  later) goes back only once the host saw it complete (``_retire``): until then it may be the
  only thing that orders the buffer's reuse after the copy out of it, and re-recorded on
  another stream (the next producer event, on the compute stream) it would answer done for
  that stream's point instead, which orders nothing on the reload stream unless every
  consumer happened to run on the compute stream. Once its point has passed, a re-record
  only makes the holders' later ``query`` more conservative. The retired events come back
  together when the one recorded last answers done: the reload stream completes its events
  in order, so one ``query`` answers for all of them.

``ops`` (a :class:`StreamOps`) is how this module reaches streams, events and copies:
:class:`CudaStreams` on a GPU; tests pass a recording stand-in that logs every record, wait,
synchronisation and copy with its stream, and check the happens-before chain of each tensor.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch

from ..io.base import as_bytes
from ..io.gds import GDS_ALIGN
from .staging import Block, StagingPool, StagingUnavailable
from .stream_ops import CudaStreams, StreamOps

__all__ = ["DeviceCopy", "StagingPool", "StagingUnavailable", "StreamOps", "Transfer"]

log = logging.getLogger(__name__)


class Transfer:
    """One record's copy in flight: what must stay alive, and the events that order it."""

    __slots__ = ("block", "pooled", "copy_event", "landed", "source", "produced", "packed",
                 "alloc_event", "ready_event", "owner", "consumed", "ready_seq", "storage", "freed")

    def __init__(self) -> None:
        self.block: Optional[Block] = None  # staging, until the engine (write) or the copy (read) is done
        self.pooled: Optional[torch.Tensor] = None  # instead of staging: the engine's pool_view memory
        self.copy_event: Any = None  # write: recorded on the offload stream after the copy
        self.landed = False  # write: the copy event answered query() True (the copy ran)
        self.source: Optional[torch.Tensor] = None  # write: device bytes the copy (or cuFile) reads
        self.produced: Any = None  # direct write: the producer event cuFile's thread waits for
        self.packed: Optional[torch.Tensor] = None  # direct read of a compact record: packed elements
        self.alloc_event: Any = None  # direct read: recorded after the allocation
        self.ready_event: Any = None  # read: recorded on the reload stream after the copy
        self.owner: Any = None  # staged read: the stream the restored tensor was allocated on
        self.consumed = False  # staged read: a consumer's stream waited for the copy
        self.ready_seq = 0  # read: the ready event's place among the reload stream's ready events
        self.storage: Optional[Tuple[int, int]] = None  # write: (address, bytes) of the saved storage
        self.freed: Optional[BaseException] = None  # write: its owner freed that storage under the copy


class _Batch:
    """An open batch of writes: the compute stream, and the producer event once recorded."""

    __slots__ = ("compute", "produced")

    def __init__(self, compute: Any) -> None:
        self.compute = compute
        self.produced: Any = None


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
                 direct: bool = False, compute: Any = None) -> None:
        self.device = torch.device(device)
        self.ops = ops if ops is not None else CudaStreams()
        self.direct = direct
        # The compute stream, named at install (default: the stream current now, on the thread
        # that builds the offloader): restores are allocated on it whatever stream or thread
        # is current when a read completes (module docstring).
        self.compute_stream = compute if compute is not None else self.ops.current_stream(self.device)
        self.offload_stream = self.ops.new_stream(self.device)
        self.reload_stream = self.ops.new_stream(self.device)
        self.pool = None if direct else StagingPool(staging_bytes, self.ops)
        self.timeline = None  # telemetry/timeline.py, while a step is recorded (the offloader sets it)
        self._events: List[Any] = []  # free events (module docstring)
        # Retired ready events that may still fence a buffer, and the one recorded last on the
        # reload stream among them (_event; module docstring).
        self._fencing: List[Any] = []
        self._fencing_last: Any = None
        self._fencing_seq = -1
        self._ready_seq = 0  # ready events recorded on the reload stream so far
        self._batch: Optional[_Batch] = None
        self._warned = False
        self._closed = False

    # -- events -----------------------------------------------------------------------------

    def _event(self) -> Any:
        if self._events:
            return self._events.pop()
        # The retired fences, once the host sees them complete: their record points passed, so
        # every buffer fenced with them may be reused, and a new record point cannot make a
        # holder's later ``query`` answer done too early (module docstring). All were recorded
        # on the reload stream, which completes its events in order: one ``query`` of the one
        # recorded last answers for all of them.
        if self._fencing and self._fencing_last.query():
            self._events.extend(self._fencing)
            self._fencing.clear()
            self._fencing_last, self._fencing_seq = None, -1
            return self._events.pop()
        return self.ops.new_event()

    def _recycle(self, event: Any) -> None:
        """An event that fences no buffer (module docstring) goes back to the pool now."""
        if event is not None:
            self._events.append(event)

    def _retire(self, xfer: Transfer) -> None:
        """A read's ready event (recorded on the reload stream), which may fence a buffer, goes
        back only once ``query`` answers done (``_event``): a staging block or pool extent
        given back with it may still be pending."""
        event = xfer.ready_event
        if event is None:
            return
        self._fencing.append(event)
        if xfer.ready_seq > self._fencing_seq:
            self._fencing_last, self._fencing_seq = event, xfer.ready_seq

    def _ready(self, xfer: Transfer, stream: Any) -> Any:
        """A read's ready event, recorded on the reload stream ``stream`` now (numbered: the
        order ``_event`` relies on)."""
        ready = xfer.ready_event = self._event()
        ready.record(stream)
        xfer.ready_seq = self._ready_seq
        self._ready_seq += 1
        return ready

    # -- offload ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def writes(self) -> Iterator[None]:
        """A batch of :meth:`stage_out` calls: one producer event and one stream context for
        all of them (module docstring). Nested batches join the outer one."""
        if self._batch is not None or self.direct:
            yield
            return
        ops = self.ops
        self._batch = batch = _Batch(ops.current_stream(self.device))
        try:
            with ops.use(self.offload_stream):
                yield
        finally:
            self._batch = None
            self._recycle(batch.produced)  # the offload stream's wait took its record point

    def stage_out(self, rec, into: Optional[torch.Tensor] = None,
                  fence: Optional[Callable[[Any], None]] = None,
                  block: Optional[Block] = None) -> Tuple[torch.Tensor, Any, Transfer]:
        """Training thread: (bytes for the engine, the event the engine waits for before it
        reads them, the transfer to pass to :meth:`landed` and :meth:`written`).

        ``into``: the engine's own pinned memory for these bytes (``IOEngine.pool_view``, the
        memory engine): the copy goes there, one copy instead of two, and ``fence`` gets its
        event (the engine reuses that memory only after it completed). ``block``: the staging
        block to copy into (default: one taken now, overflowing when the pool is full)."""
        if self._batch is None and not self.direct:
            with self.writes():
                return self.stage_out(rec, into, fence, block)
        ops = self.ops
        xfer = Transfer()
        if self.direct:  # cuFile reads device memory once the producer (and compaction) ran
            view = as_bytes(rec.bytes_view(ops.compact))
            produced = xfer.produced = self._event()
            produced.record(ops.current_stream(self.device))
            xfer.source = view
            return view, produced, xfer
        batch = self._batch
        stream = self.offload_stream
        if batch.produced is None:
            batch.produced = self._event()
            batch.produced.record(batch.compute)
            stream.wait_event(batch.produced)
        if into is not None:
            target = xfer.pooled = into
        else:
            xfer.block = block if block is not None else self.take_block(rec.nbytes)
            target = xfer.block.tensor
        copied = self._event()
        tl = self.timeline
        try:
            # Inside the batch's stream context: a compact record's packing runs here, on the
            # offload stream, after the producer event.
            view = xfer.source = as_bytes(rec.bytes_view(ops.compact))
            span = tl.gpu_begin(stream, "offload", "d2h", "copy", record=rec.id, bytes=rec.nbytes,
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
                copied.record(stream)
            except BaseException:  # noqa: BLE001 - the first error is the one the caller sees
                log.error("ssdtrain: %d bytes of staging are withheld from the pool after a failed "
                          "device->host copy", target.numel())
                if xfer.block is not None:
                    self.pool.withhold(xfer.block)
                xfer.block = None
            if fence is not None:
                fence(copied)
            xfer.copy_event = copied
            self.written(xfer)
            raise
        if fence is not None:
            fence(copied)
        xfer.copy_event = copied
        return target, copied, xfer

    def landed(self, xfer: Transfer) -> bool:
        """Whether the write's device->host copy has run (a ``query``, never a wait); once it
        has, the transfer lets its device bytes go (the caller drops the record's own)."""
        if xfer.landed:
            return True
        if xfer.copy_event is None or not xfer.copy_event.query():
            return False
        xfer.landed = True
        self.ops.let_go(xfer.source)
        xfer.source = None
        return True

    def let_go(self, rec) -> None:
        """The record's own reference to its device bytes goes, after its copy landed."""
        self.ops.let_go(rec.tensor)
        rec.tensor = None

    def written(self, xfer: Transfer) -> None:
        """The engine's write finished, failed, or never started (cancelled, refused): its
        staging goes back to the pool, reusable once the copy into it has run (any thread;
        takes only the pool's lock, never waits). Device bytes of a copy not known to have
        run are marked used by the offload stream before they are let go (module docstring)."""
        block, xfer.block, xfer.pooled = xfer.block, None, None
        if xfer.source is not None and not xfer.landed and not self.direct:
            self.ops.record_stream(xfer.source, self.offload_stream)
        xfer.source = None
        event, xfer.copy_event = xfer.copy_event, None
        if block is not None:  # after the copy back out of it, if one was made (from staging)
            after = xfer.ready_event if xfer.ready_event is not None else None if xfer.landed else event
            self.pool.give(block, after=after)
        if xfer.landed:
            self._recycle(event)
        self._recycle(xfer.produced)  # direct: cuFile's thread has waited for it
        xfer.produced = None

    # -- reload -----------------------------------------------------------------------------

    def stage_in(self, rec, block: Optional[Block] = None) -> Tuple[Optional[torch.Tensor], torch.Tensor, Any]:
        """The thread that starts a read from the engine: (restored tensor, or None until
        :meth:`finish_in` allocates it; where the engine reads the bytes into; the event the
        engine waits for before it writes there, or None). Sets ``rec.transfer``. Staged: a
        staging block (``block``, or one taken now), no device memory yet; direct: device
        memory allocated on the compute stream now, with its allocation event."""
        xfer = rec.transfer = Transfer()
        if not self.direct:
            xfer.block = block if block is not None else self.take_block(rec.nbytes)
            return None, xfer.block.tensor, None
        ops = self.ops
        # on the compute stream named at install; cuFile reads into 4 KiB-aligned memory
        # without bouncing
        with ops.use(self.compute_stream) if ops.current_stream(self.device) != self.compute_stream \
                else contextlib.nullcontext():
            restored, dest = rec.allocate_restore(GDS_ALIGN)
        xfer.packed = rec.staging  # a compact record's packed elements (device), else None
        rec.staging = None
        xfer.alloc_event = self._event()
        xfer.alloc_event.record(self.compute_stream)
        return restored, dest, xfer.alloc_event

    def restore(self, rec, source: Optional[torch.Tensor] = None) -> None:
        """Bring a record's bytes to the device on the reload stream: from ``source`` (the
        memory engine's pool extent, or a staging block still holding a write's bytes) or from
        the staging block its read filled (``rec.transfer.block``). Sets ``rec.tensor`` and
        the ready event the consumer waits on (``rec.transfer``, made here when the record has
        none)."""
        xfer = rec.transfer
        if xfer is None:
            xfer = rec.transfer = Transfer()
        if self.direct and source is None:
            self._finish_direct(rec, xfer)
            return
        ops = self.ops
        stream = self.reload_stream
        tl = self.timeline
        host = source if source is not None else xfer.block.tensor
        # Allocated on the compute stream named at install, from the pool backward's frees go
        # back to, whatever stream is current: a read that completes inside a write batch's
        # back-pressure runs here under the offload stream's context. The reload stream writes
        # it only once the compute stream has run to this point, where whatever used the
        # block before is done (module docstring).
        owner = xfer.owner = self.compute_stream
        if ops.current_stream(self.device) == owner:
            restored, dest = rec.allocate_restore(empty=ops.empty, pad=False)
        else:
            with ops.use(owner):
                restored, dest = rec.allocate_restore(empty=ops.empty, pad=False)
        allocated = self._event()
        allocated.record(owner)
        stream.wait_event(allocated)
        self._recycle(allocated)  # the wait took its record point
        with ops.use(stream):
            span = tl.gpu_begin(stream, "reload", "h2d", "copy", record=rec.id, bytes=rec.nbytes,
                                layer=str(rec.layer)) if tl is not None else None
            ops.copy(as_bytes(dest), host)
            if rec.staging is not None:  # a compact record: scatter into the strided places
                ops.copy(restored, rec.staging)
                # The packed elements' memory goes back to the compute stream's pool now: not
                # to be reused before the reload stream has read it.
                ops.record_stream(rec.staging, stream)
                rec.staging = None
            if span is not None:
                tl.gpu_end(stream, span)
            ready = self._ready(xfer, stream)
        rec.tensor = restored
        if xfer.block is not None and source is None:
            self.pool.give(xfer.block, after=ready)
            xfer.block = None

    def finish_in(self, rec) -> None:
        """After the engine's read completed (training thread): the bytes go to the device."""
        self.restore(rec)

    def _finish_direct(self, rec, xfer: Transfer) -> None:
        """gds: cuFile wrote the bytes in place (and the host saw it finish); a compact record's
        packed elements are scattered into their places on the reload stream."""
        if xfer.packed is None:
            return
        ops = self.ops
        stream = self.reload_stream
        stream.wait_event(xfer.alloc_event)
        with ops.use(stream):
            ops.copy(rec.tensor, xfer.packed)
            self._ready(xfer, stream)
        for t in (rec.tensor, xfer.packed):  # allocated on the compute stream, written here
            ops.record_stream(t, stream)
        xfer.packed = None

    def read_failed(self, rec) -> None:
        """The engine's read failed: nothing was copied; the staging block is free."""
        xfer, rec.transfer = rec.transfer, None
        if xfer is not None:
            xfer.pooled = None
            if xfer.block is not None:
                self.pool.give(xfer.block)
                xfer.block = None

    def consume(self, rec, out: torch.Tensor) -> None:
        """Unpack, on the consumer's thread: its stream waits for the reload; the host does
        not. The tensor is marked used by the consumer's stream (module docstring)."""
        xfer = rec.transfer
        if xfer is None:
            return  # forwarded from memory: no copy to wait for
        ops = self.ops
        current = ops.current_stream(self.device)
        ready = xfer.ready_event
        if ready is not None:
            tl = self.timeline
            span = tl.gpu_begin(current, "compute", "reload", "wait", record=rec.id, bytes=rec.nbytes,
                                layer=str(rec.layer)) if tl is not None else None
            current.wait_event(ready)
            xfer.consumed = True
            if span is not None:
                tl.gpu_end(current, span)
        if xfer.alloc_event is not None or ready is not None and current != xfer.owner:
            ops.record_stream(out, current)  # used by a stream other than the one it came from

    def unused(self, xfer: Optional[Transfer]) -> None:
        """A restored tensor goes unconsumed (its record is released before any unpack): the
        stream it was allocated on waits for its copy first, so that the allocator, which
        hands its block to that stream's next allocation at once, cannot let a kernel write
        there before the copy has landed (training thread, before the tensor is dropped)."""
        if xfer is not None and xfer.owner is not None and not xfer.consumed and xfer.ready_event is not None:
            xfer.owner.wait_event(xfer.ready_event)
            xfer.consumed = True

    def forget(self, xfer: Optional[Transfer]) -> None:
        """A record is released: no consumer will wait on its read's events again, but a
        staging block or pool extent given back with its ready event may still be fenced by
        it, so the events are retired, reused only once they answered done (``_retire``)."""
        if xfer is None:
            return
        self._retire(xfer)
        # The allocation event fences nothing: the engine waited for it before its read, which
        # has completed.
        self._recycle(xfer.alloc_event)
        xfer.ready_event = xfer.alloc_event = None

    def synchronize(self) -> None:
        """Wait until every copy queued so far on the offload and reload streams has run (close,
        not the hot path, may wait): before an engine whose pinned pool those copies use is
        closed, and before the staging pool goes (:meth:`close`)."""
        for stream in (self.offload_stream, self.reload_stream):
            done = self.ops.new_event()
            done.record(stream)
            done.synchronize()

    def close(self) -> None:
        """Wait until every copy ever queued on the offload and reload streams has run, then
        release the staging pool (close, not the hot path, may wait). A block still in flight
        (a cancelled or refused write whose copy no IO thread waited for, a record released
        with its transfer) would otherwise be unregistered and unmapped under its copy."""
        if self._closed:
            return
        self._closed = True
        self.synchronize()
        if self.pool is not None:
            self.pool.close()

    @property
    def staging_overflows(self) -> int:
        return self.pool.overflows if self.pool is not None else 0

    def take_staging(self, nbytes: int) -> Optional[Block]:
        """A staging block if one fits now (no overflow), else None: the caller's back-pressure
        waits for one (cache/transfers.py)."""
        return self.pool.take(nbytes, overflow=False)

    def take_block(self, nbytes: int) -> Block:
        """A staging block, from torch's pinned allocator when the pool has no room (warned
        once, counted in ``staging_overflows``)."""
        block = self.pool.take(nbytes)
        if block.offset is None and not self._warned:
            self._warned = True
            log.warning("ssdtrain: the pinned staging pool (pinned_staging_bytes=%d) has no room for %d "
                        "bytes; using torch's pinned host allocator for the overflow (counted in "
                        "DeviceCopy.staging_overflows). Raise pinned_staging_bytes.",
                        self.pool.capacity, nbytes)
        return block
