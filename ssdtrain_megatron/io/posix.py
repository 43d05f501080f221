"""The default engine: a thread pool doing positioned O_DIRECT IO on one slab per root.

Why these choices:
- O_DIRECT, so reads come from the device and not the page cache (the cache would make the
  read bandwidth a lie and would double the memory the activations occupy). Where a filesystem
  refuses O_DIRECT (tmpfs, some network filesystems) we fall back to buffered IO with
  ``POSIX_FADV_DONTNEED`` and say so once.
- One preallocated slab file per root with an extent allocator: no file creation, no
  metadata update in the hot path; space is reserved with ``posix_fallocate`` so a full disk
  shows up in the caller's thread, before any byte is in flight. fallocate costs about 1 us
  per MiB, so a reserver thread keeps the slab reserved up to ``max_inflight_bytes`` ahead
  of what is allocated; the caller only reserves itself when the reserver has fallen behind
  (or the disk is nearly full).
- Tensors are cut into chunks striped round-robin over the roots; each chunk is one
  request, so a large tensor keeps several requests in flight and every drive busy. Requests
  go to the workers through a ``SimpleQueue`` (well under a microsecond per request; a
  ``ThreadPoolExecutor.submit`` with its done-callback cost about 10).
- O_DIRECT needs aligned memory: each worker owns a page-aligned bounce buffer (an anonymous
  mmap) of ``chunk_bytes``; the copy in and out of it runs in the worker, not in the training
  thread.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import queue
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, List, Optional

import torch

from ..config import OffloadConfig
from .base import BusyMeter, EngineError, IOEngine
from .layout import (Extent, ExtentAllocator, Identity, align_up, expand_roots, free_bytes,
                     make_rank_dirs, open_private, plan_chunks, remove_rank_dir)

log = logging.getLogger(__name__)

SLAB_NAME = "slab.bin"
GROW_BYTES = 256 << 20  # preallocate the slab in steps of this size


def reserve_ahead_bytes(config: OffloadConfig, n_slabs: int) -> int:
    """How far ahead of the allocation the reserver keeps each slab reserved.

    A burst of writes hands out up to ``max_inflight_bytes`` at once: reserving that far ahead
    keeps the callers off fallocate. The excess goes at end_step, and on a nearly full disk at
    once (see ``_Slab.reserve`` and 'tight')."""
    return max(GROW_BYTES, config.max_inflight_bytes // n_slabs)


class _Slab:
    """One root's slab file: its fd, allocator and preallocated size."""

    def __init__(self, directory: str) -> None:
        self.dir = directory
        self.path = os.path.join(directory, SLAB_NAME)
        self.alloc = ExtentAllocator()
        self.lock = threading.Lock()
        self.fd: Optional[int] = None
        self.direct = True
        self.reserved = 0
        self.tight = False  # the disk was full this step: reserve exactly, not GROW_BYTES ahead
        self.ahead_pending = False  # a grow_ahead is queued on the reserver thread
        self.generation = 0  # bumped by drop(): tells grow_ahead its file is gone
        self.ahead_bytes = GROW_BYTES  # how far the reserver keeps ahead of the allocation

    def ensure_open(self) -> int:
        if self.fd is None:
            try:
                self.fd = open_private(self.path, os.O_RDWR | os.O_DIRECT)
                self.direct = True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise EngineError(f"cannot create {self.path}: {exc.strerror}") from exc
                os.unlink(self.path) if os.path.lexists(self.path) else None
                self.fd = open_private(self.path, os.O_RDWR)
                self.direct = False
                log.warning("O_DIRECT refused on %s; using buffered IO with FADV_DONTNEED "
                            "(reads may be served by the page cache)", self.dir)
        return self.fd

    def reserve(self, end: int) -> None:
        """Make sure the file has space up to ``end`` (raises OSError ENOSPC when full)."""
        if end <= self.reserved:
            return
        fd = self.ensure_open()
        new = end if self.tight else max(end, self.reserved + GROW_BYTES)
        try:
            os.posix_fallocate(fd, self.reserved, new - self.reserved)
        except OSError as exc:
            # A failed fallocate may keep the blocks it got (ext4 does: the slab would take
            # every free byte of the disk from other users): give them back, then reserve
            # exactly what is needed, and only that for the rest of the step.
            os.ftruncate(fd, self.reserved)
            if exc.errno != errno.ENOSPC or new == end:
                raise
            self.tight = True
            try:
                os.posix_fallocate(fd, self.reserved, end - self.reserved)
            except OSError:
                os.ftruncate(fd, self.reserved)
                raise
            new = end
        self.reserved = new

    def wants_ahead(self, end: int) -> bool:
        """Whether to queue a grow_ahead after allocating up to ``end`` (call with lock held)."""
        if self.ahead_pending or self.tight or self.reserved - end >= self.ahead_bytes // 2:
            return False
        self.ahead_pending = True
        return True

    def grow_ahead(self) -> None:
        """Reserver thread: extend the reservation to ``ahead_bytes`` past the allocated end
        (queued once less than half of that is left).

        fallocate runs on a duplicate of the descriptor and outside ``lock``, so writers are
        not held up and an end_step that closes the slab meanwhile cannot make it touch
        another file. A failure only gives back what it got: the next reserve() in a caller
        meets the full disk itself and reports it there.
        """
        with self.lock:
            self.ahead_pending = False
            if self.fd is None or self.tight:
                return
            start = self.reserved
            target = self.alloc.size + self.ahead_bytes
            if target <= start:
                return
            fd = os.dup(self.fd)
            generation = self.generation
        try:
            try:
                os.posix_fallocate(fd, start, target - start)
                ok = True
            except OSError:
                ok = False
            with self.lock:
                if self.generation != generation:  # dropped meanwhile: the file is gone
                    return
                if ok and not self.tight:
                    self.reserved = max(self.reserved, target)
                else:  # failed, or the disk filled meanwhile: give back what it got
                    os.ftruncate(fd, self.reserved)
        finally:
            os.close(fd)

    def drop(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            os.unlink(self.path)
        self.alloc.reset()
        self.reserved = 0
        self.tight = False
        self.generation += 1


class _Gather:
    """Completes one Future when all of a request's chunks are done (or the first fails)."""

    def __init__(self, n: int, nbytes: int, on_done: Callable[[], None]) -> None:
        self.future: Future = Future()
        self._left = n
        self._nbytes = nbytes
        self._lock = threading.Lock()
        self._on_done = on_done

    def chunk_done(self, exc: Optional[BaseException]) -> None:
        with self._lock:
            self._left -= 1
            finished = self._left == 0
            first_error = exc is not None and not self.future.done()
            if first_error:
                self.future.set_exception(exc)
        if finished:
            self._on_done()
            if not self.future.done():
                self.future.set_result(self._nbytes)


class SlabKeys:
    """Key bookkeeping shared by the engines that keep tensors in per-root slabs.

    Needs ``_lock``, ``_extents`` (key -> its Extents) and ``_slabs`` (objects with ``alloc``,
    ``lock`` and ``drop()``) on the engine."""

    def release(self, key: int) -> None:
        with self._lock:
            extents = self._extents.pop(key, None)
        for e in extents or ():
            self._slabs[e.root].alloc.free(e.offset, e.length)

    def end_step(self) -> None:
        """No key is live: remove the slab files, so nothing stays on disk between steps."""
        with self._lock:
            if self._extents:
                return
        # What this step needed per root (its slabs' high-water marks): the plan the
        # offloader checks free space against before the next step.
        self.step_peak_bytes = [s.alloc.size for s in self._slabs]
        for s in self._slabs:
            with s.lock:
                s.drop()


class PosixEngine(SlabKeys, IOEngine):
    """pwrite/pread on O_DIRECT slab files from a thread pool. See the module docstring."""

    name = "posix"

    def __init__(self, config: OffloadConfig, ident: Optional[Identity] = None) -> None:
        self.config = config
        self.ident = ident or Identity.detect(config.job_id())
        self.roots = expand_roots(config.dirs, self.ident)
        self.rank_dirs: List[str] = make_rank_dirs(self.roots, self.ident)
        self._slabs = [_Slab(d) for d in self.rank_dirs]
        for s in self._slabs:
            s.ahead_bytes = reserve_ahead_bytes(config, len(self._slabs))
        self._chunk = config.chunk_bytes
        self._checksum = config.checksum
        self._requests: "queue.SimpleQueue[Optional[tuple]]" = queue.SimpleQueue()
        self._cancelled = False  # remove_files(): queued requests fail instead of running
        self._workers = [threading.Thread(target=self._work, name=f"ssdtrain-io-{i}", daemon=True)
                         for i in range(config.io_threads)]
        self._reserver = ThreadPoolExecutor(1, thread_name_prefix="ssdtrain-reserve")
        self._reserver.submit(int)  # start its thread now, not in the first write()
        self._buffers: "queue.Queue[mmap.mmap]" = queue.Queue()
        for _ in range(config.io_threads):
            self._buffers.put(mmap.mmap(-1, self._chunk))
        self._extents: Dict[int, List[Extent]] = {}
        self._lock = threading.Lock()
        self._next_root = 0
        self._closed = False
        self.write_meter = BusyMeter()
        self.read_meter = BusyMeter()
        self.step_peak_bytes: List[int] = [0] * len(self._slabs)
        self.tracer: Optional[Callable[..., None]] = None
        """Optional IO trace sink: tracer(op, key, path, offset, nbytes, t_submit, t_done,
        queue_depth), called from the worker when each request completes."""
        self._queued = 0  # requests submitted and not completed (queue depth)
        self.fault: Optional[Callable[[str, str, int], Optional[OSError]]] = None
        """Test-only fault injection: called as fault(op, path, offset) before each request;
        a returned OSError is raised as if the system call had failed."""
        for t in self._workers:
            t.start()

    # -- properties -------------------------------------------------------------------------

    @property
    def bytes_on_disk(self) -> int:
        return sum(s.alloc.allocated for s in self._slabs)

    @property
    def page_cache_bypassed(self) -> bool:
        return all(s.direct for s in self._slabs if s.fd is not None)

    # -- requests ---------------------------------------------------------------------------

    def write(self, key: int, data: torch.Tensor, ready_event: Optional[object] = None) -> Future:
        self._check_open()
        nbytes = data.numel()
        with self._lock:
            if key in self._extents:
                raise EngineError(f"key {key} written twice")
            first = self._next_root
            self._next_root = (self._next_root + 1) % len(self._slabs)
        chunks = plan_chunks(nbytes, self._chunk, len(self._slabs), first)
        extents: List[Extent] = []
        ahead: List[_Slab] = []
        try:
            for root, _start, length in chunks:
                slab = self._slabs[root]
                with slab.lock:
                    offset = slab.alloc.allocate(length)
                    extents.append(Extent(root, offset, length))
                    end = offset + align_up(max(length, 1))
                    slab.reserve(end)  # at once, unless the reserver kept ahead
                    if slab.wants_ahead(end):
                        ahead.append(slab)
        except OSError as exc:
            for e in extents:
                self._slabs[e.root].alloc.free(e.offset, e.length)
            failed = self._slabs[chunks[len(extents) - 1][0]]
            raise EngineError(f"cannot reserve {nbytes} bytes in {failed.path}: {exc.strerror or exc} "
                              f"({_free_text(failed.dir)} free in {failed.dir})") from exc
        for slab in ahead:
            self._reserver.submit(slab.grow_ahead)
        with self._lock:
            self._extents[key] = extents
        self.write_meter.begin()
        gather = _Gather(len(chunks), nbytes, lambda: self.write_meter.end(nbytes))
        for (root, start, length), ext in zip(chunks, extents):
            self._submit("write", key, ext, gather, self._write_chunk, data, start, ext, ready_event)
        return gather.future

    def read(self, key: int, out: torch.Tensor) -> Future:
        self._check_open()
        with self._lock:
            extents = self._extents.get(key)
        if extents is None:
            raise EngineError(f"read of unknown key {key}")
        nbytes = out.numel()
        self.read_meter.begin()
        gather = _Gather(len(extents), nbytes, lambda: self.read_meter.end(nbytes))
        start = 0
        for ext in extents:
            self._submit("read", key, ext, gather, self._read_chunk, out, start, ext)
            start += ext.length
        return gather.future

    def _submit(self, op: str, key: int, ext: Extent, gather: _Gather, fn, *args) -> None:
        with self._lock:
            self._queued += 1
            depth = self._queued
        self._requests.put((op, key, ext, gather, fn, args, time.perf_counter(), depth))

    def _work(self) -> None:
        """Worker thread: run requests in order until the None that close() queues."""
        while True:
            request = self._requests.get()
            if request is None:
                return
            op, key, ext, gather, fn, args, t_submit, depth = request
            exc: Optional[BaseException] = None
            if self._cancelled:
                exc = EngineError(f"{op} of key {key} cancelled: the engine's files were removed")
            else:
                try:
                    fn(*args)
                except BaseException as e:  # noqa: BLE001 - handed to the caller's Future
                    exc = e
            with self._lock:
                self._queued -= 1
            tracer = self.tracer
            if tracer is not None and exc is None:
                tracer(op, key, self._slabs[ext.root].path, ext.offset, ext.length, t_submit,
                       time.perf_counter(), depth)
            gather.chunk_done(exc)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Let queued and running requests finish, but a request may hang on a dead drive:
        # wait for them at most io_timeout_s.
        self._stop_workers()
        deadline = time.monotonic() + self.config.io_timeout_s
        while self._queued and time.monotonic() < deadline:
            time.sleep(0.005)
        with self._lock:
            self._extents.clear()
            stuck = self._queued
        if stuck:
            # Workers still use the slab fds and their buffers: leave both to the process's
            # exit, but take the files out of the namespace now.
            log.error("ssdtrain: closing with %d IO requests still running after %gs; removing "
                      "the files, leaving their descriptors open", stuck, self.config.io_timeout_s)
        else:
            for s in self._slabs:
                s.drop()
        for d in self.rank_dirs:
            remove_rank_dir(d)
        while not stuck and not self._buffers.empty():
            self._buffers.get_nowait().close()

    def remove_files(self) -> None:
        self._closed = True
        self._cancelled = True
        self._stop_workers()
        for d in self.rank_dirs:
            remove_rank_dir(d)

    def _stop_workers(self) -> None:
        """Workers exit once they reach these markers, after the requests queued before them."""
        for _ in self._workers:
            self._requests.put(None)
        self._reserver.shutdown(wait=False, cancel_futures=True)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError("engine is closed")

    # -- workers ----------------------------------------------------------------------------

    def _inject(self, op: str, slab: _Slab, offset: int) -> None:
        if self.fault is not None:
            err = self.fault(op, slab.path, offset)
            if err is not None:
                raise err

    def _write_chunk(self, data: torch.Tensor, start: int, ext: Extent, ready_event) -> None:
        slab = self._slabs[ext.root]
        if ready_event is not None:
            ready_event.synchronize()
        buf = self._buffers.get()
        try:
            n = ext.length
            view = torch.frombuffer(buf, dtype=torch.uint8, count=n) if n else None
            if n:
                view.copy_(data[start:start + n])
            padded = align_up(max(n, 1))
            mv = memoryview(buf)[:padded]
            try:
                self._inject("write", slab, ext.offset)
                done = os.pwrite(slab.fd, mv, ext.offset)
                if not slab.direct:
                    os.posix_fadvise(slab.fd, ext.offset, padded, os.POSIX_FADV_DONTNEED)
            except OSError as exc:
                raise EngineError(f"write of {padded} bytes to {slab.path} at offset {ext.offset} failed: "
                                  f"{exc.strerror or exc}") from exc
            finally:
                mv.release()
            if done != padded:
                raise EngineError(f"short write to {slab.path} at offset {ext.offset}: {done} of {padded} bytes")
            if self._checksum:
                ext.crc = _crc(buf, n)
            del view
        finally:
            self._buffers.put(buf)

    def _read_chunk(self, out: torch.Tensor, start: int, ext: Extent) -> None:
        slab = self._slabs[ext.root]
        buf = self._buffers.get()
        try:
            n = ext.length
            padded = align_up(max(n, 1))
            mv = memoryview(buf)[:padded]
            try:
                self._inject("read", slab, ext.offset)
                if not slab.direct:
                    os.posix_fadvise(slab.fd, ext.offset, padded, os.POSIX_FADV_DONTNEED)
                done = os.preadv(slab.fd, [mv], ext.offset)
            except OSError as exc:
                raise EngineError(f"read of {padded} bytes from {slab.path} at offset {ext.offset} failed: "
                                  f"{exc.strerror or exc}") from exc
            finally:
                mv.release()
            if done != padded:
                raise EngineError(f"short read from {slab.path} at offset {ext.offset}: {done} of {padded} bytes")
            if self._checksum and n:
                crc = _crc(buf, n)
                if crc != ext.crc:
                    raise EngineError(f"checksum mismatch reading {n} bytes from {slab.path} at offset "
                                      f"{ext.offset}: stored crc32 {ext.crc:#010x}, read {crc:#010x}")
            if n:
                out[start:start + n].copy_(torch.frombuffer(buf, dtype=torch.uint8, count=n))
        finally:
            self._buffers.put(buf)


def _free_text(directory: str) -> str:
    try:
        return f"{free_bytes(directory) / 2**20:.1f} MiB"
    except OSError:
        return "unknown space"


def _crc(buf: mmap.mmap, n: int) -> int:
    with memoryview(buf) as mv, mv[:n] as part:
        return zlib.crc32(part)
