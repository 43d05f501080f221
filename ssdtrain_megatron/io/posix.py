"""The default engine: threads doing positioned O_DIRECT IO on one slab per root.

Why these choices:
- O_DIRECT, so reads come from the device and not the page cache (the cache would make the
  read bandwidth a lie and would double the memory the activations occupy). Where a filesystem
  refuses O_DIRECT (tmpfs, some network filesystems) we fall back to buffered IO with
  ``POSIX_FADV_DONTNEED`` and say so once.
- The slab, placement and request path are shared with the aio engine (see ``slab_engine.py``): the
  training thread only places chunks and queues one request per tensor; reserving space and
  all IO happen on ``io_threads`` worker threads.
- Tensors are cut into ``chunk_bytes`` chunks striped round-robin over the roots; each worker
  takes one chunk (or a run of small contiguous ones) at a time, so a large tensor keeps every
  worker and drive busy and small tensors do not cost a system call each.
- O_DIRECT needs aligned memory: each worker owns a page-aligned bounce buffer of
  ``chunk_bytes``; the copy in and out of it runs in the worker, not in the training thread.
  A host chunk (a CPU tensor, the GPU path's pinned staging blocks) is stored at its address
  residue, so that all of it but a head and a tail of less than the direct-IO granularity
  (probed at start: 512 bytes, else 4096) is read into its own memory, one ``preadv`` for the
  run, without the copy; page-aligned memory (the staging blocks) is also written from in
  place, a CPU tensor's chunk through the bounce buffer, which the drive takes faster than
  fresh activations' scattered pages (io/bounce.py; ``zero_copy_bytes`` / ``bounced_bytes``
  count which way the bytes went).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import List, Optional

import torch

from ..config import OffloadConfig
from .affinity import pin_io_thread
from .base import EngineError
from .bounce import probe_dio_align
from .gpu_wait import wait_for
from .layout import ALIGN, Identity
from .requests import ChunkQueue, Request, Run
from .slab_engine import SlabEngine, aligned_buffer, join_before_exit
from .syscalls import IOV_MAX

log = logging.getLogger(__name__)


class PosixEngine(SlabEngine):
    """pwrite/pread on O_DIRECT slab files from a pool of threads. See the module docstring."""

    name = "posix"

    def __init__(self, config: OffloadConfig, ident: Optional[Identity] = None) -> None:
        self._init_common(config, ident)
        self._queue = self._write_queue = ChunkQueue()  # reads first (see ChunkQueue)
        self._cancelled = False  # remove_files(): queued requests fail instead of running
        self._workers: List[threading.Thread] = []
        self._open_slabs("prefer")
        try:
            # What O_DIRECT accepts here decides how much of a host tensor moves in place (bounce.py).
            # The probe file goes through the held descriptor (layout.RankDir), not the path.
            self.staging.move_in_place(max(probe_dio_align(d.proc_path) for d in self._held_dirs))
            # Allocated here, not in the threads: a thread still inside torch when the
            # interpreter exits aborts the process.
            self._workers = [
                # A chunk stored at a shift takes up to one page more (bounce.py).
                threading.Thread(target=self._work, args=(aligned_buffer(self._chunk + ALIGN),),
                                 name=f"ssdtrain-io-{i}", daemon=True)
                for i in range(config.io_threads)]
            for t in self._workers:
                t.start()
        except BaseException:
            self._workers = [t for t in self._workers if t.ident is not None]  # the started ones
            self.close()  # a failed start leaves nothing on disk (and no thread running)
            raise

    def _enqueue(self, req: Request) -> None:
        self._queue.put(req)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Workers finish what is queued, but a request may hang on a dead drive: wait for
        # them at most io_timeout_s.
        self._queue.close()
        deadline = time.monotonic() + self.config.io_timeout_s
        for t in self._workers:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = sum(t.is_alive() for t in self._workers)
        if stuck:
            # Those workers still use the slab fds and their buffers: leave both to the
            # process's exit, but take the files out of the namespace now.
            log.error("ssdtrain: closing with %d IO threads still running a request after %gs; removing "
                      "the files, leaving their descriptors open", stuck, self.config.io_timeout_s)
        self._forget_all()
        self._remove_files(drop_slabs=not stuck)

    def remove_files(self) -> None:
        self._closed = True
        self._cancelled = True
        self._queue.close()
        self._remove_files(drop_slabs=False)
        join_before_exit(self._workers, self.config.io_timeout_s)

    # -- workers ----------------------------------------------------------------------------

    def _work(self, buf: torch.Tensor) -> None:
        """Worker thread: take runs of chunks until the queue is closed and drained. Nothing of
        a finished run stays bound while the thread waits for the next one (a worker must not
        keep the last tensor it handled alive)."""
        pin_io_thread(self.config.io_cpus)
        view = memoryview(buf.numpy())
        while True:
            parts = self._queue.get_run(True, self._chunk, self.staging.padded, IOV_MAX // 3)  # 3 pieces a chunk
            if parts is None:
                return
            op = Run(parts, buf, self.staging.padded)
            parts = None
            if self._cancelled:
                self._finished(op, EngineError(f"{self._describe(op)} cancelled: the engine's files were removed"))
            elif op.writing:
                if self._guard(op, self.staging.fill, op) and self._guard(op, self._pwrite, op, view):
                    self.staging.count_copies(op)
                    self._finished(op, None)
            elif self._guard(op, self._pread, op, view):
                self.staging.count_copies(op)
                self._drain(op)
            op = None

    def _buffers(self, op: Run, view: memoryview) -> List[memoryview]:
        """The memory of one system call, in file order: the bounce buffer, or, when some
        chunks are used in place (``op.direct``), their middles in their own memory between
        bounce slices (bounce.py)."""
        if op.direct is None:
            return [view[:op.nbytes]]
        out = []
        staging = self.staging
        for j, ((req, i), body) in enumerate(zip(op.parts, op.direct)):
            ext = req.extents[i]
            lo = ext.offset - op.offset
            span = staging.span(op, j, ext)
            if body is None:
                out.append(view[lo:lo + span])
                continue
            head = staging.head(ext)
            if head:
                out.append(view[lo:lo + head])
            out.append(body)
            if head + len(body) < span:
                out.append(view[lo + head + len(body):lo + span])
        return out

    def _read_in_place(self, op: Run) -> None:
        """Read side, before the IO: which chunks' middles are read straight into their
        tensor (once the tensor's memory may be written: its ready event)."""
        direct = []
        for req, i in op.parts:
            body = self.staging.in_place(req, i, req.extents[i])
            if body is not None and req.ready_event is not None:
                wait_for(req.ready_event)
            direct.append(body)
        op.direct = direct if any(t is not None for t in direct) else None

    def _pwrite(self, op: Run, view: memoryview) -> None:
        slab = self._slabs[op.root]
        slab.ensure_reserved(op.offset + op.nbytes)
        try:
            done = self._sys.pwritev(slab.fd, self._buffers(op, view), op.offset, slab.path)
            if not slab.direct:
                os.posix_fadvise(slab.fd, op.offset, op.nbytes, os.POSIX_FADV_DONTNEED)
        except OSError as exc:
            raise EngineError(f"{self._describe(op)} failed: {exc.strerror or exc}") from exc
        if done != op.nbytes:
            raise EngineError(f"short write to {slab.path} at offset {op.offset}: {done} of {op.nbytes} bytes")

    def _pread(self, op: Run, view: memoryview) -> None:
        slab = self._slabs[op.root]
        self._check_inside(op)
        self._read_in_place(op)
        try:
            if not slab.direct:
                os.posix_fadvise(slab.fd, op.offset, op.nbytes, os.POSIX_FADV_DONTNEED)
            done = self._sys.preadv(slab.fd, self._buffers(op, view), op.offset, slab.path)
        except OSError as exc:
            raise EngineError(f"{self._describe(op)} failed: {exc.strerror or exc}") from exc
        if done != op.nbytes:
            raise EngineError(f"short read from {slab.path} at offset {op.offset}: {done} of {op.nbytes} bytes")
