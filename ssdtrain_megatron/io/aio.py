"""The 'aio' engine: DeepSpeed DeepNVMe's ``aio_handle`` (libaio, O_DIRECT) on one slab per root.

Why these choices:
- The slab, placement, striping and request path are the posix engine's (``slab_engine.py``): one
  preallocated O_DIRECT file per root, tensors cut into ``chunk_bytes`` chunks striped
  round-robin, space reserved by the IO threads. Only the system calls differ: each run of
  chunks is one ``aio_handle`` operation that DeepNVMe splits into ``aio_block_bytes`` libaio
  requests, ``aio_queue_depth`` of them in flight per aio thread.
- DeepNVMe has traps, and each is closed here before the call, because the library does not
  report them afterwards:
  * Sizes must be multiples of 512 bytes and of ``intra_op_parallelism``, or a write returns
    success having written nothing, and a later read past the end of the file trips an
    ``assert`` that aborts the whole process. Every request here is padded to a multiple of
    ``4096 * intra_op_parallelism`` (4096 also covers 4K-sector drives), every offset is
    4096-aligned, and a read is refused in Python unless it lies inside the preallocated file.
  * ``wait()`` waits for every pending operation of its handle. Each lane (one worker thread)
    owns its own handle and one operation at a time, and writes and reads use separate lanes,
    so a read never waits behind a write it does not depend on.
  * ``async_pwrite``/``async_pread`` return 0 or -1 and ``wait()`` the number of operations
    completed: both are checked, and anything else is an :class:`EngineError`. The library does
    not expose the per-request kernel result (``io_event.res``): a device error (EIO) would go
    unseen. ``verify: crc32c`` catches that, at the cost of a CRC32C per chunk.
  * Buffers that DeepNVMe did not lock itself are bounced through a buffer it allocates and
    copies *in the calling thread*. Each lane therefore owns two page-locked staging buffers
    (``new_cpu_locked_tensor``; CUDA-pinned memory where CUDA exists) and does the copy itself,
    off the training thread, into one while the other's IO is in flight.
  * A failed ``mlock`` or ``io_setup`` is not reported either, only met later by an
    ``assert``: the memlock limit and ``fs.aio-max-nr`` are checked (``aio_support.py``)
    before any handle exists.
  * DeepNVMe's first write logs a warning inside a ``std::call_once`` that takes the GIL,
    while ``async_pwrite`` holds it: two threads making the first write at once deadlock. The
    engine makes one write alone, in its constructor, before any lane starts.
- Nothing here imports DeepSpeed at module import; the JIT build (minutes, cached under
  ``TORCH_EXTENSIONS_DIR``) happens when the first engine is constructed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import List, Optional, Tuple

import torch

from ..config import OffloadConfig
from .affinity import pin_io_thread
from .base import EngineError
from .layout import ALIGN, Identity, align_up
from .aio_support import aio_unavailable_reason, can_lock, check_aio_events, load_aio_op
from .requests import ChunkQueue, Request, Run
from .slab_engine import SlabEngine, aligned_buffer, join_before_exit

__all__ = ["AioEngine", "aio_unavailable_reason", "load_aio_op"]

log = logging.getLogger(__name__)


class _Lane:
    """One worker thread with its own aio_handle and two page-locked staging buffers: while
    one buffer's IO is in flight, the other is filled (write) or emptied (read), so the copy
    never leaves the drive idle."""

    def __init__(self, handle, buffers: List[torch.Tensor], locked_by_deepnvme: bool) -> None:
        self.handle = handle
        self.buffers = buffers
        self.locked_by_deepnvme = locked_by_deepnvme
        self.thread: Optional[threading.Thread] = None


class AioEngine(SlabEngine):
    """libaio through DeepNVMe's ``aio_handle`` on O_DIRECT slab files. See the module docstring.

    Raises:
        EngineUnavailable: when DeepSpeed, libaio-dev or the build tools are missing.
        EngineError: when a root refuses O_DIRECT, or the staging buffers cannot be locked.
    """

    name = "aio"

    @classmethod
    def is_available(cls) -> Tuple[bool, str]:
        why = aio_unavailable_reason()
        return not why, why

    def __init__(self, config: OffloadConfig, ident: Optional[Identity] = None) -> None:
        self._op = load_aio_op()
        self._init_common(config, ident, align=ALIGN * config.aio_intra_op_parallelism)
        self._stage_bytes = align_up(config.chunk_bytes, self.staging.align)
        lanes = config.io_threads
        check_aio_events(2 * lanes * config.aio_intra_op_parallelism, config.aio_queue_depth)
        self._cuda = torch.cuda.is_available()
        if not self._cuda:
            ok, why = can_lock(2 * lanes * 2 * self._stage_bytes)
            if not ok:
                raise EngineError(why)
        self._write_lanes: List[_Lane] = []
        self._read_lanes: List[_Lane] = []
        self._pending_lane: Optional[_Lane] = None
        self._writes = self._write_queue = ChunkQueue()
        self._reads = ChunkQueue()
        try:
            self._open_slabs("require")
            for s in self._slabs:
                s.ensure_open()  # fail now, not at the first write, where O_DIRECT is refused
            self._write_lanes = [self._new_lane() for _ in range(lanes)]
            self._read_lanes = [self._new_lane() for _ in range(lanes)]
            self._first_write(self._write_lanes[0])
            for lanes_list, queue, writing in ((self._write_lanes, self._writes, True),
                                               (self._read_lanes, self._reads, False)):
                for i, lane in enumerate(lanes_list):
                    lane.thread = threading.Thread(target=self._run_lane, args=(lane, queue, writing),
                                                   name=f"ssdtrain-aio-{'w' if writing else 'r'}{i}", daemon=True)
                    lane.thread.start()
        except BaseException:
            self._shutdown()
            raise

    def _first_write(self, lane: _Lane) -> None:
        """One small write before any lane runs.

        DeepNVMe logs a warning on its first write inside a ``std::call_once`` that takes the
        GIL, while ``async_pwrite`` holds the GIL: two lanes making the first write at once
        deadlock. Making it here, on one thread, runs the call_once before there is a race.
        The bytes land at offset 0 of the first slab, which the allocator hands out later.
        """
        slab = self._slabs[0]
        buf = lane.buffers[0][:self.staging.align]
        buf.zero_()
        slab.ensure_reserved(self.staging.align)
        rc = lane.handle.async_pwrite(buf, slab.fd, 0)
        if rc != 0 or lane.handle.wait() != 1:
            raise EngineError(f"the first aio write to {slab.path} failed (returned {rc}); "
                              f"DeepNVMe's stderr says why")

    def _new_lane(self) -> _Lane:
        cfg = self.config
        handle = self._op.aio_handle(cfg.aio_block_bytes, cfg.aio_queue_depth, False, True,
                                     cfg.aio_intra_op_parallelism)
        buffers: List[torch.Tensor] = []
        lane = _Lane(handle, buffers, not self._cuda)
        self._pending_lane = lane  # freed by _shutdown if the next allocation fails
        for _ in range(2):
            if self._cuda:
                # CUDA-pinned memory is what DeepNVMe accepts without a bounce copy there, and
                # it makes the GPU<->staging copy a DMA.
                buffers.append(aligned_buffer(self._stage_bytes, pin=True))
            else:
                buf = handle.new_cpu_locked_tensor(self._stage_bytes, torch.empty(0, dtype=torch.uint8))
                buffers.append(buf)
                if buf.numel() != self._stage_bytes or buf.data_ptr() % ALIGN:
                    raise EngineError("DeepNVMe returned a staging buffer that is not page-aligned")
        self._pending_lane = None
        return lane

    @property
    def page_cache_bypassed(self) -> bool:
        return True  # every slab is O_DIRECT or the engine refuses to start

    # -- requests ---------------------------------------------------------------------------

    def _enqueue(self, req: Request) -> None:
        (self._writes if req.writing else self._reads).put(req)

    def close(self) -> None:
        if self._closed:
            return
        self._shutdown()

    def remove_files(self) -> None:
        """Signal/exit path: take the files out of the namespace now; let the lanes finish
        before the interpreter goes (see ``join_before_exit``)."""
        self._closed = True
        self._writes.close()
        self._reads.close()
        self._remove_files(drop_slabs=False)
        threads = [lane.thread for lane in self._write_lanes + self._read_lanes if lane.thread is not None]
        join_before_exit(threads, self.config.io_timeout_s)
        if not any(t.is_alive() for t in threads):
            # Destroy the DeepNVMe handles now, no operation pending, rather than leave them
            # to the interpreter's teardown, where it aborted the process ("terminate called
            # without an active exception") about once in 16 exits of a loaded machine.
            self._shutdown()

    def _shutdown(self) -> None:
        self._closed = True
        self._writes.close()
        self._reads.close()
        # Lanes finish what is queued; a request may hang on a dead drive: wait io_timeout_s.
        deadline = time.monotonic() + self.config.io_timeout_s
        lanes = self._write_lanes + self._read_lanes
        for lane in lanes:
            if lane.thread is not None:
                lane.thread.join(max(0.0, deadline - time.monotonic()))
        stuck = sum(1 for lane in lanes if lane.thread is not None and lane.thread.is_alive())
        if stuck:
            # Their handles have operations pending (destroying one would abort the process)
            # and their buffers are in use: leave both to the process's exit, remove the files.
            log.error("ssdtrain: closing the aio engine with %d lanes still in IO after %gs; "
                      "removing the files, leaving the lanes", stuck, self.config.io_timeout_s)
            self.remove_files()
            return
        stray = [self._pending_lane] if self._pending_lane is not None else []
        self._pending_lane = None
        for lane in lanes + stray:
            if lane.locked_by_deepnvme:
                for buf in lane.buffers:
                    lane.handle.free_cpu_locked_tensor(buf)
            lane.buffers = []
            lane.handle = None  # destroys the handle: its threads stop (no op is pending)
        self._write_lanes, self._read_lanes = [], []
        self._forget_all()
        self._remove_files(drop_slabs=True)

    # -- lanes ------------------------------------------------------------------------------

    def _run_lane(self, lane: _Lane, queue: ChunkQueue, writing: bool) -> None:
        """Keep one operation in flight and prepare the next one meanwhile.

        Write: copy B into the free buffer while A is written; wait for A; submit B.
        Read: wait for A; submit B into the free buffer; copy A out while B is read.
        """
        pin_io_thread(self.config.io_cpus)
        inflight: Optional[Run] = None
        while True:
            parts = queue.get_run(inflight is None, self._stage_bytes, self.staging.padded)
            if parts is None:
                if inflight is None:
                    return  # closed and drained
                self._settle(lane, inflight)
                inflight = None
                continue
            buf = lane.buffers[1] if inflight is not None and inflight.buf is lane.buffers[0] else lane.buffers[0]
            nxt: Optional[Run] = Run(parts, buf, self.staging.padded)
            parts = buf = None  # nothing of a finished run may stay bound while the lane waits
            if writing:
                nxt = self._guard(nxt, self.staging.fill, nxt)
                if inflight is not None:
                    self._settle(lane, inflight)
                inflight = self._guard(nxt, self._submit, lane, nxt) if nxt else None
            else:
                if inflight is not None:
                    inflight = self._guard(inflight, self._wait, lane, inflight)
                nxt = self._guard(nxt, self._submit, lane, nxt)
                if inflight is not None:
                    self._drain(inflight)
                inflight = nxt
            nxt = None

    def _settle(self, lane: _Lane, op: Run) -> None:
        """Wait for ``op``; finish it (copy out for a read); complete its chunks."""
        if self._guard(op, self._wait, lane, op) is None:
            return
        if op.writing:
            self._finished(op, None)
        else:
            self._drain(op)

    def _submit(self, lane: _Lane, op: Run) -> None:
        slab = self._slabs[op.root]
        if op.writing:
            slab.ensure_reserved(op.offset + op.nbytes)
        else:
            self._check_inside(op)  # DeepNVMe asserts (aborting the process) on a read past EOF
        rc = self._sys.aio_submit(lane.handle, op.writing, op.buf[:op.nbytes], slab.fd, slab.path, op.offset)
        if rc != 0:
            why = f": {os.strerror(-rc)}" if rc < 0 else ""  # a negative errno, when it gives one
            raise EngineError(f"{self._describe(op)} was refused by DeepNVMe (returned {rc}{why}; its stderr says why)")

    def _wait(self, lane: _Lane, op: Run) -> None:
        done = self._sys.aio_wait(lane.handle)
        if done != 1:
            raise EngineError(f"{self._describe(op)}: DeepNVMe completed {done} operations, expected 1")
