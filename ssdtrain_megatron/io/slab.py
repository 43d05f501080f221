"""What the disk engines (posix, aio, gds) share: slab files and the path of a request.

Why these choices:
- One preallocated slab file per root with an extent allocator: no file creation and no
  metadata update in the hot path.
- The training thread does only bookkeeping: ``write`` registers the key and queues one
  request. Everything else runs on the IO threads: placing the chunks in the slabs (in queue
  order, so tensors written one after another are contiguous), and reserving disk space: the
  thread about to write past a slab's reserved end calls ``posix_fallocate`` (``GROW_BYTES``
  at a time). A full disk therefore fails the write's Future (ENOSPC, naming the directory and its free space)
  and the offloader keeps that tensor in memory, counted as a fallback; nothing blocks the
  caller, and a failed reservation gives back what it got, so the slab never takes the last
  free bytes of a disk from other users.
- A request is one tensor; IO threads take it a chunk at a time, so one large tensor keeps every
  thread busy, and chunks that continue each other in a slab (small tensors written one after
  the other, or read back in reverse order) are merged into one system call.
- A request's Future completes only when none of its chunks is in flight, even when one
  failed: the caller may then free its extents or reuse its tensor at once.
"""

from __future__ import annotations

import abc
import collections
import errno
import itertools
import logging
import os
import threading
import time
import zlib
from concurrent.futures import Future
from typing import Callable, Deque, Dict, List, Optional, Tuple

import torch

from ..config import OffloadConfig
from .base import BusyMeter, EngineError, IOEngine
from .layout import (ALIGN, Extent, ExtentAllocator, Identity, align_up, expand_roots, free_bytes,
                     make_rank_dirs, open_private)

log = logging.getLogger(__name__)

SLAB_NAME = "slab.bin"
GROW_BYTES = 256 << 20  # reserve the slab in steps of this size (fallocate: about 1 us per MiB)


class Slab:
    """One root's slab file: its descriptor, extent allocator and reserved size.

    ``direct`` is 'prefer' (O_DIRECT, else buffered IO, said once), 'require' (O_DIRECT or an
    error: DeepNVMe opens the file with it) or 'off' (kvikio opens its own descriptor).
    ``lock`` guards the file and its reservation, not the allocator (which has its own lock):
    an IO thread may hold it for a fallocate without holding up the training thread.
    """

    def __init__(self, directory: str, direct: str = "prefer",
                 on_open: Optional[Callable[["Slab"], None]] = None) -> None:
        self.dir = directory
        self.path = os.path.join(directory, SLAB_NAME)
        self.alloc = ExtentAllocator()
        self.lock = threading.Lock()
        self.fd: Optional[int] = None
        self.direct = direct != "off"
        self._mode = direct
        self._on_open = on_open
        self.handle: object = None  # what on_open attached (gds: a kvikio CuFile)
        self.reserved = 0
        self.tight = False  # the disk was full this step: reserve exactly, not GROW_BYTES ahead

    def ensure_open(self) -> int:
        if self.fd is None:
            flags = os.O_RDWR | (os.O_DIRECT if self._mode != "off" else 0)
            try:
                self.fd = open_private(self.path, flags)
            except OSError as exc:
                if exc.errno != errno.EINVAL or self._mode == "off":
                    raise EngineError(f"cannot create {self.path}: {exc.strerror}") from exc
                if os.path.lexists(self.path):
                    os.unlink(self.path)
                if self._mode == "require":
                    raise EngineError(f"the filesystem of {self.dir} refuses O_DIRECT, which the aio "
                                      f"engine needs; use engine='posix' there (it falls back to "
                                      f"buffered IO) or a directory on a local SSD") from exc
                self.fd = open_private(self.path, os.O_RDWR)
                self.direct = False
                log.warning("O_DIRECT refused on %s; using buffered IO with FADV_DONTNEED "
                            "(reads may be served by the page cache)", self.dir)
            if self._on_open is not None:
                self._on_open(self)
        return self.fd

    def ensure_reserved(self, end: int) -> None:
        """IO thread: make sure the file has space up to ``end`` before writing there.

        Raises EngineError (its cause an OSError, ENOSPC when the disk is full)."""
        if end <= self.reserved:
            return
        with self.lock:
            try:
                self._reserve(end)
            except OSError as exc:
                raise EngineError(f"cannot reserve {end - self.reserved} bytes in {self.path}: "
                                  f"{exc.strerror or exc} ({_free_text(self.dir)} free in {self.dir})"
                                  ) from exc

    def _reserve(self, end: int) -> None:
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

    def drop(self) -> None:
        """Remove the file (no IO may be pending on it)."""
        with self.lock:
            if self.handle is not None:
                self.handle.close()
                self.handle = None
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None
                os.unlink(self.path)
            self.alloc.reset()
            self.reserved = 0
            self.tight = False


def _free_text(directory: str) -> str:
    try:
        return f"{free_bytes(directory) / 2**20:.1f} MiB"
    except OSError:
        return "unknown space"


class Placement:
    """Where one stored tensor's chunks live: one extent per root (``allocs``: root, offset,
    bytes) and the chunks in tensor order (``extents``). An IO thread fills it in when it
    reaches the write, so the training thread does not pay for the arithmetic."""

    __slots__ = ("nbytes", "allocs", "extents")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.allocs: List[Tuple[int, int, int]] = []
        self.extents: Optional[List[Extent]] = None


class Request:
    """One tensor's write or read: its placement, and a Future completed when the last chunk is
    done. The Future fails with the first chunk error, but only once no chunk is in flight.
    Chunk i starts at byte ``i * chunk_bytes`` of the tensor."""

    __slots__ = ("future", "key", "t_submit", "depth", "writing", "tensor", "placement", "owner",
                 "ready_event", "meter", "next_chunk", "error", "_left", "_lock")

    def __init__(self, owner: "SlabEngine", key: int, writing: bool, tensor: torch.Tensor,
                 placement: Placement, n_chunks: int, ready_event: Optional[object], meter: BusyMeter,
                 depth: int) -> None:
        self.future: Future = Future()
        self.owner = owner
        self.key = key
        self.t_submit = time.perf_counter()
        self.depth = depth  # chunks queued or in flight when this request was made (for the trace)
        self.writing = writing
        self.tensor = tensor
        self.placement = placement
        self.ready_event = ready_event
        self.meter = meter
        self.next_chunk = 0  # guarded by the queue's lock
        self.error: Optional[BaseException] = None
        self._left = n_chunks
        self._lock = threading.Lock()

    @property
    def extents(self) -> List[Extent]:
        """The chunks, placing them first if no IO thread has yet (call from an IO thread)."""
        if self.placement.extents is None:
            self.owner._place(self.placement)
        return self.placement.extents

    def chunk_done(self, exc: Optional[BaseException]) -> None:
        with self._lock:
            if exc is not None and self.error is None:
                self.error = exc
            self._left -= 1
            finished = self._left == 0
        if finished:
            nbytes = self.tensor.numel()
            self.meter.end(nbytes)
            if self.error is not None:
                self.future.set_exception(self.error)
            else:
                self.future.set_result(nbytes)


class ChunkQueue:
    """Requests waiting for IO threads, which take one chunk (or a run of them) at a time.
    One lock and one notify per tensor: cheap for the training thread."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._items: Deque[Request] = collections.deque()
        self._closed = False

    def put(self, req: Request) -> None:
        # Wake one thread; each thread that takes a chunk wakes the next while chunks are
        # left, so the futex wake-ups are not all paid by the training thread.
        with self._cv:
            self._items.append(req)
            self._cv.notify()

    def get_run(self, wait: bool, limit: int, padded: Callable[[int], int]
                ) -> Optional[List[Tuple[Request, int]]]:
        """The next chunk, plus the chunks queued right behind it that continue it in the same
        slab (after its end, or before its start: reads come back in reverse order), in the
        same direction, up to ``limit`` padded bytes. The run is in file order. None when
        closed and drained, or, with ``wait=False``, when nothing is queued right now."""
        with self._cv:
            while wait and not self._items and not self._closed:
                self._cv.wait()
            if not self._items:
                return None
            run = collections.deque([self._pop()])
            req0, i0 = run[0]
            first = req0.extents[i0]
            lo, hi = first.offset, first.offset + padded(first.length)
            while self._items:
                req = self._items[0]
                ext = req.extents[req.next_chunk]
                step = padded(ext.length)
                if req.writing != req0.writing or ext.root != first.root or hi - lo + step > limit:
                    break
                if ext.offset == hi:
                    run.append(self._pop())
                    hi += step
                elif ext.offset + step == lo:
                    run.appendleft(self._pop())
                    lo -= step
                else:
                    break
            if self._items:
                self._cv.notify()
            return list(run)

    def _pop(self) -> Tuple[Request, int]:
        req = self._items[0]
        i = req.next_chunk
        req.next_chunk += 1
        if req.next_chunk == len(req.extents):
            self._items.popleft()
        return req, i

    def close(self) -> None:
        """IO threads finish what is queued, then exit."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()


class Run:
    """One system call's worth of IO: chunks contiguous in one slab, staged back to back in
    ``buf`` (usually one chunk; several small ones when they were queued together)."""

    __slots__ = ("parts", "buf", "root", "offset", "nbytes", "writing", "failed")

    def __init__(self, parts: List[Tuple[Request, int]], buf: torch.Tensor, padded: Callable[[int], int]) -> None:
        first = parts[0][0].extents[parts[0][1]]
        last = parts[-1][0].extents[parts[-1][1]]
        self.parts = parts
        self.buf = buf
        self.root = first.root
        self.offset = first.offset
        self.nbytes = last.offset + padded(last.length) - first.offset
        self.writing = parts[0][0].writing
        self.failed: Dict[int, BaseException] = {}  # part index -> its injected error (tests)


class SlabEngine(IOEngine):
    """An engine that keeps tensors in per-root slabs: placement, keys, completion, staging.

    Subclasses set up ``_slabs`` with :meth:`_open_slabs`, move :class:`Run` s with their own
    system calls, and implement ``_enqueue`` (hand a request to their IO threads)."""

    _align = ALIGN  # padding and offset alignment of every chunk

    def _init_common(self, config: OffloadConfig, ident: Optional[Identity]) -> None:
        self.config = config
        self.ident = ident or Identity.detect(config.job_id())
        self.roots = expand_roots(config.dirs, self.ident)
        self.rank_dirs: List[str] = []
        self._slabs: List[Slab] = []
        self._chunk = config.chunk_bytes
        self._checksum = config.checksum
        self._placed: Dict[int, Placement] = {}  # key -> where its chunks are
        self._lock = threading.Lock()
        self._turn = itertools.count()  # which root a tensor's first chunk goes to
        self._closed = False
        self._queued = 0  # chunks queued or in flight (the trace's queue depth)
        self.write_meter = BusyMeter()
        self.read_meter = BusyMeter()
        self.step_peak_bytes: List[int] = [0] * len(self.roots)
        """Per root, the slab size the last step reached (the offloader checks free space
        against it before the next step)."""
        self.tracer: Optional[Callable[..., None]] = None
        """Optional IO trace sink: tracer(op, key, path, offset, nbytes, t_submit, t_done,
        queue_depth), called from an IO thread when each chunk completes."""
        self.fault: Optional[Callable[[str, str, int], Optional[OSError]]] = None
        """Test-only fault injection: called as fault(op, path, offset) before each request;
        a returned OSError is raised as if the system call had failed."""

    def _open_slabs(self, direct: str, on_open: Optional[Callable[[Slab], None]] = None) -> None:
        self.rank_dirs = make_rank_dirs(self.roots, self.ident)
        self._slabs = [Slab(d, direct, on_open) for d in self.rank_dirs]

    # -- properties -------------------------------------------------------------------------

    @property
    def bytes_on_disk(self) -> int:
        return sum(s.alloc.allocated for s in self._slabs)

    @property
    def page_cache_bypassed(self) -> bool:
        return all(s.direct for s in self._slabs if s.fd is not None)

    # -- the training thread's side ---------------------------------------------------------

    def _padded(self, length: int) -> int:
        return align_up(max(length, 1), self._align)

    @abc.abstractmethod
    def _enqueue(self, req: Request) -> None:
        """Hand ``req`` to the IO threads."""

    def _n_chunks(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self._chunk))

    def _place(self, placement: Placement) -> None:
        """IO thread (under the queue's lock, in queue order): cut the tensor into
        ``chunk_bytes`` chunks striped round-robin over the roots, the first on the next root
        in turn, and allocate one extent per root holding that root's chunks back to back."""
        n_roots, chunk, nbytes = len(self._slabs), self._chunk, placement.nbytes
        first = next(self._turn) % n_roots
        n = self._n_chunks(nbytes)
        last = nbytes - (n - 1) * chunk
        full, tail = self._padded(chunk), self._padded(last)
        allocs = []
        for k in range(min(n_roots, n)):  # the k-th root in turn holds chunks k, k + n_roots, ...
            count = (n - 1 - k) // n_roots + 1
            size = (count - 1) * full + (tail if (n - 1) % n_roots == k else full)
            root = (first + k) % n_roots
            allocs.append((root, self._slabs[root].alloc.allocate(size), size))
        extents = []
        for i in range(n):
            root, offset, _size = allocs[i % n_roots]
            extents.append(Extent(root, offset + i // n_roots * full, chunk if i < n - 1 else last))
        placement.allocs = allocs
        placement.extents = extents

    def write(self, key: int, data: torch.Tensor, ready_event: Optional[object] = None) -> Future:
        """Register ``key`` and queue the request: all the training thread does."""
        self._check_open()
        placement = Placement(data.numel())
        n = self._n_chunks(placement.nbytes)
        with self._lock:
            if key in self._placed:
                raise EngineError(f"key {key} written twice")
            self._placed[key] = placement
            self._queued += n
            depth = self._queued
        self.write_meter.begin()
        req = Request(self, key, True, data, placement, n, ready_event, self.write_meter, depth)
        self._enqueue(req)
        return req.future

    def read(self, key: int, out: torch.Tensor) -> Future:
        self._check_open()
        with self._lock:
            placement = self._placed.get(key)
        if placement is None or placement.extents is None:
            raise EngineError(f"read of unknown key {key}" if placement is None else
                              f"read of key {key} before its write completed")
        if out.numel() != placement.nbytes:
            raise EngineError(f"read of key {key} into {out.numel()} bytes; {placement.nbytes} were written")
        n = len(placement.extents)
        with self._lock:
            self._queued += n
            depth = self._queued
        self.read_meter.begin()
        req = Request(self, key, False, out, placement, n, None, self.read_meter, depth)
        self._enqueue(req)
        return req.future

    def release(self, key: int) -> None:
        with self._lock:
            placement = self._placed.pop(key, None)
        for root, offset, size in placement.allocs if placement is not None else ():
            self._slabs[root].alloc.free(offset, size)

    def end_step(self) -> None:
        """No key is live: remove the slab files, so nothing stays on disk between steps."""
        with self._lock:
            if self._placed:
                return
        # What this step needed per root (its slabs' high-water marks): the plan the
        # offloader checks free space against before the next step.
        self.step_peak_bytes = [s.alloc.size for s in self._slabs]
        for s in self._slabs:
            s.drop()

    def _forget_all(self) -> None:
        with self._lock:
            self._placed.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError("engine is closed")

    # -- the IO threads' side ---------------------------------------------------------------

    def _finished(self, op: Run, exc: Optional[BaseException]) -> None:
        for j, (req, i) in enumerate(op.parts):
            self._finish_chunk(req, i, exc or op.failed.get(j))

    def _finish_chunk(self, req: Request, i: int, exc: Optional[BaseException]) -> None:
        """A chunk is done (or failed): trace it, then count it towards its tensor's Future."""
        with self._lock:
            self._queued -= 1
        tracer = self.tracer
        if tracer is not None and exc is None and req.error is None:
            ext = req.extents[i]
            tracer("write" if req.writing else "read", req.key, self._slabs[ext.root].path,
                   ext.offset, ext.length, req.t_submit, time.perf_counter(), req.depth)
        req.chunk_done(exc)

    def _guard(self, op: Run, step, *args) -> Optional[Run]:
        """Run one step of ``op``; on failure complete its chunks with the error and return
        None (the error reaches the caller through the tensors' Futures, never a log)."""
        try:
            step(*args)
            return op
        except BaseException as exc:  # noqa: BLE001 - surfaced through the Future
            self._finished(op, as_engine_error(exc, f"{self.name} {step.__name__.strip('_')}"))
            return None

    def _inject(self, op: Run) -> None:
        """Test hook (see ``fault``): a chunk whose call returns an error fails as if its own
        system call had (the other chunks of a merged run go on)."""
        if self.fault is None:
            return
        slab = self._slabs[op.root]
        kind = "write" if op.writing else "read"
        for j, (req, i) in enumerate(op.parts):
            ext = req.extents[i]
            err = self.fault(kind, slab.path, ext.offset)
            if err is not None:
                failed = EngineError(f"{self.name} {kind} of {self._padded(ext.length)} bytes "
                                     f"{'to' if op.writing else 'from'} {slab.path} at offset "
                                     f"{ext.offset} failed: {err.strerror or err}")
                failed.__cause__ = err
                op.failed[j] = failed

    def _describe(self, op: Run) -> str:
        slab = self._slabs[op.root]
        return (f"{self.name} {'write' if op.writing else 'read'} of {op.nbytes} bytes "
                f"{'to' if op.writing else 'from'} {slab.path} at offset {op.offset}")

    def _fill(self, op: Run) -> None:
        """Write side, before the IO: each chunk's bytes (and zeroed padding) into place."""
        for req, i in op.parts:
            ext = req.extents[i]
            n, start = ext.length, i * self._chunk
            stage = op.buf[ext.offset - op.offset:ext.offset - op.offset + self._padded(n)]
            if req.error is not None:  # another chunk of this tensor failed: write zeros
                stage.zero_()
                continue
            if req.ready_event is not None:
                req.ready_event.synchronize()
            if n:
                stage[:n].copy_(req.tensor[start:start + n])
            if stage.numel() > n:
                stage[n:].zero_()  # the padding reaches the disk: never stale memory
            if self._checksum:
                ext.crc = zlib.crc32(stage[:n].numpy()) if n else 0

    def _check_inside(self, op: Run) -> None:
        """Read side, before the IO: the run lies inside the reserved (written) file."""
        slab = self._slabs[op.root]
        if slab.fd is None or op.offset + op.nbytes > slab.reserved:
            raise EngineError(f"{self._describe(op)}: past the reserved end of the slab ({slab.reserved} bytes)")

    def _drain(self, op: Run) -> None:
        """Read side, after the IO: per chunk, verify the checksum, copy the bytes out, and
        complete it (a bad chunk fails its own tensor only)."""
        for j, (req, i) in enumerate(op.parts):
            exc: Optional[BaseException] = op.failed.get(j)
            try:
                ext = req.extents[i]
                n, start = ext.length, i * self._chunk
                stage = op.buf[ext.offset - op.offset:ext.offset - op.offset + n]
                if exc is None and req.error is None and self._checksum and n:
                    crc = zlib.crc32(stage.numpy())
                    if crc != ext.crc:
                        raise EngineError(f"checksum mismatch reading {n} bytes from "
                                          f"{self._slabs[ext.root].path} at offset {ext.offset}: "
                                          f"stored crc32 {ext.crc:#010x}, read {crc:#010x}")
                if exc is None and req.error is None and n:
                    req.tensor[start:start + n].copy_(stage)
            except BaseException as e:  # noqa: BLE001 - surfaced through the Future
                exc = as_engine_error(e, f"{self.name} read")
            self._finish_chunk(req, i, exc)


def as_engine_error(exc: BaseException, what: str) -> BaseException:
    if isinstance(exc, EngineError):
        return exc
    wrapped = EngineError(f"{what} failed: {exc!r}")
    wrapped.__cause__ = exc
    return wrapped


def aligned_buffer(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` starting on a page boundary (O_DIRECT needs it)."""
    raw = torch.zeros(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip:skip + nbytes]
