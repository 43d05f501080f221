"""What the disk engines (posix, aio, gds) share: keys, placement, staging and completion.

Why these choices:
- The training thread does only bookkeeping: ``write`` registers the key and queues one
  request (``requests.py``). Everything else runs on the IO threads: placing the chunks, and
  reserving disk space (``slab.py``) just before writing past a slab's reserved end. A full
  disk therefore fails the write's Future (ENOSPC, naming the directory and its free space)
  and the offloader keeps that tensor in memory, counted as a fallback.
- Chunks are ``chunk_bytes`` long and striped round-robin over the roots (one per drive), a
  tensor's first chunk on the next root in turn; each root holds its chunks of a tensor back
  to back in one extent.
- Staged engines (posix, aio) copy through page-aligned bounce buffers on the IO threads,
  zero the padding that reaches the disk, and keep a CRC32C per chunk when ``verify`` is
  'crc32c' (io/checksum.py).
"""

from __future__ import annotations

import abc
import itertools
import logging
import mmap
import threading
import time
from concurrent.futures import Future
from typing import Callable, Dict, List, Optional

import torch

from ..config import OffloadConfig
from . import cleanup
from .base import BusyMeter, EngineError, IOEngine
from .bounce import ChunkStaging, as_engine_error
from .clean import sweep_before_start
from .name_clash import check_own_names
from .extents import Extent
from .layout import ALIGN, Identity, RankDir, expand_roots, make_rank_dirs, remove_rank_dir
from .roots import check_roots
from .requests import ChunkQueue, Placement, Request, Run
from .slab import Slab
from .syscalls import OS, SysCalls
from .pinned import pin as pin_host


class SlabEngine(IOEngine):
    """An engine that keeps tensors in per-root slabs: placement, keys, completion.

    Subclasses set up ``_slabs`` with :meth:`_open_slabs`, move :class:`Run` s with their own
    system calls (staged through ``staging``, a :class:`ChunkStaging`), and implement
    ``_enqueue`` (hand a request to their IO threads)."""

    def _init_common(self, config: OffloadConfig, ident: Optional[Identity], align: int = ALIGN) -> None:
        """``align``: padding and file-offset alignment of every chunk (what O_DIRECT needs)."""
        self.config = config
        self._cleanup_token: Optional[object] = None
        self.ident = ident or Identity.detect(config.job_id())
        self.roots = expand_roots(config.dirs, self.ident)
        self.rank_dirs: List[str] = []
        self._held_dirs: List[RankDir] = []  # the rank directories, open (layout.RankDir)
        self._slabs: List[Slab] = []
        self._chunk = config.chunk_bytes
        self.staging = ChunkStaging(config.chunk_bytes, align, config.verify != "off", self.name)
        """How the IO threads move chunks through bounce buffers or in place (bounce.py)."""
        self._placed: Dict[int, Placement] = {}  # key -> where its chunks are
        self._write_requests: Dict[int, Request] = {}  # key -> its write (until release)
        self._write_queue: Optional[ChunkQueue] = None  # where cancel() takes writes back from
        self._lock = threading.Lock()
        self._turn = itertools.count()  # which root a tensor's first chunk goes to
        self._closed = False
        self._closed_by: Optional[int] = None  # the signal whose cleaners closed it (cleanup.py)
        self._queued = 0  # chunks queued or in flight (the trace's queue depth)
        self.write_meter = BusyMeter()
        self.read_meter = BusyMeter()
        self.step_peak_bytes: List[int] = [0] * len(self.roots)
        """Per root, the slab size the last step reached (the offloader checks free space
        against it before the next step)."""
        self.tracer: Optional[Callable[..., None]] = None
        """Optional IO trace sink: tracer(op, key, path, offset, nbytes, t_submit, t_done,
        queue_depth), called from an IO thread when each chunk completes."""
        self._sys: SysCalls = OS
        """The calls that move the bytes (io/syscalls.py); tests put a faulty one in front."""

    def _open_slabs(self, direct: str, on_open: Optional[Callable[[Slab], None]] = None) -> None:
        # A missing root is refused before anything is swept or created (io/roots.py): it is
        # most often an unmounted drive, and creating it would put the bytes on the system disk.
        # The job folders a template names were checked (expand_roots) before the sweep looks
        # in them; make_rank_dirs checks them again on the descriptors it then uses, so one put
        # there meanwhile by someone else is refused, not used.
        check_roots(self.config.dirs, self.ident, create=self.config.create_dirs)
        sweep_before_start(self.roots, self.config.dirs, self.ident.hostname)  # dead jobs' leftovers
        check_own_names(self.roots, self.ident)  # a second pod with our job id: said as such
        self._held_dirs = make_rank_dirs(self.roots, self.ident, self.config.dirs)
        self.rank_dirs = [d.path for d in self._held_dirs]
        self._slabs = [Slab(d, direct, on_open) for d in self._held_dirs]
        # Exit and SIGINT/SIGTERM remove the files and stop the IO threads even when nothing
        # else references this engine (an offloader dropped without close()); _remove_files
        # takes the registration back.
        self._cleanup_token = object()
        cleanup.register(self._cleanup_token, self.remove_files, keep_alive=True)

    # -- properties -------------------------------------------------------------------------

    @property
    def bytes_on_disk(self) -> int:
        return sum(s.alloc.allocated for s in self._slabs)

    @property
    def zero_copy_bytes(self) -> int:
        """Bytes moved in place, without a copy through a bounce buffer."""
        return self.staging.zero_copy_bytes

    @property
    def bounced_bytes(self) -> int:
        """Bytes copied through a bounce buffer."""
        return self.staging.bounced_bytes

    @property
    def page_cache_bypassed(self) -> bool:
        return all(s.direct for s in self._slabs if s.fd is not None)

    # -- the training thread's side ---------------------------------------------------------

    @abc.abstractmethod
    def _enqueue(self, req: Request) -> None:
        """Hand ``req`` to the IO threads."""

    def _n_chunks(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self._chunk))

    def place_chunks(self, placement: Placement, req: Request) -> None:
        """IO thread (under the queue's lock, in queue order): cut the tensor into
        ``chunk_bytes`` chunks striped round-robin over the roots, the first on the next root
        in turn, and allocate one extent per root holding that root's chunks back to back,
        each ``shift`` bytes into its place (bounce.py). The requests' owner protocol
        (requests.py)."""
        n_roots, chunk, nbytes = len(self._slabs), self._chunk, placement.nbytes
        first = next(self._turn) % n_roots
        staging = self.staging
        shift = staging.shift_for(req)
        # room for any shift, not this one: a step's space must not depend on addresses
        extra = 0 if shift is None else staging.dio_align - 1
        shift = shift or 0
        if nbytes <= chunk:  # one chunk, one extent (most activations): what the loops below give
            size = staging.padded(extra + nbytes)
            offset = self._slabs[first].alloc.allocate(size)
            placement.allocs = [(first, offset, size)]
            placement.extents = [Extent(first, offset, nbytes, shift=shift, room=size)]
            return
        n = self._n_chunks(nbytes)
        last = nbytes - (n - 1) * chunk
        full, tail = staging.padded(extra + chunk), staging.padded(extra + last)
        allocs = []
        for k in range(min(n_roots, n)):  # the k-th root in turn holds chunks k, k + n_roots, ...
            count = (n - 1 - k) // n_roots + 1
            size = (count - 1) * full + (tail if (n - 1) % n_roots == k else full)
            root = (first + k) % n_roots
            allocs.append((root, self._slabs[root].alloc.allocate(size), size))
        extents = []
        for i in range(n):
            root, offset, _size = allocs[i % n_roots]
            extents.append(Extent(root, offset + i // n_roots * full, chunk if i < n - 1 else last,
                                  shift=shift, room=full if i < n - 1 else tail))
        placement.allocs = allocs
        placement.extents = extents

    def write(self, key: int, data: torch.Tensor, ready_event: Optional[object] = None) -> Optional[Future]:
        """Register ``key`` and queue the request: all the training thread does."""
        if self._closed:
            self._check_open()
        if not data.is_contiguous():
            # The IO threads move the bytes by address: a strided tensor would be stored in
            # memory order and come back as other bytes.
            raise EngineError(f"{self.name} engine: key {key}: the tensor to write is not "
                              f"contiguous (shape {tuple(data.shape)}, stride {data.stride()})")
        nbytes = data.nbytes
        placement = Placement(nbytes)
        n = 1 if nbytes <= self._chunk else -(-nbytes // self._chunk)  # _n_chunks, inline: every save
        with self._lock:
            if key in self._placed:
                raise EngineError(f"key {key} written twice")
            self._placed[key] = placement
            self._queued += n
            depth = self._queued
            req = self._write_requests[key] = Request(self, key, True, data, placement, n, ready_event,
                                                      self.write_meter, depth)
        self._enqueue(req)  # its meter starts where an IO thread takes it (ChunkQueue, gds._io)
        return req.future

    def cancel(self, key: int) -> bool:
        with self._lock:
            req = self._write_requests.get(key)
        if req is None or self._write_queue is None or not self._write_queue.cancel(req):
            return False
        with self._lock:
            self._queued -= req._left
        req.tensor = req.ready_event = None  # never taken by an IO thread: its meter never started
        return True

    def read(self, key: int, out: torch.Tensor, ready_event: Optional[object] = None) -> Optional[Future]:
        if self._closed:
            self._check_open()
        with self._lock:
            placement = self._placed.get(key)
            if placement is None or placement.extents is None:
                raise EngineError(f"read of unknown key {key}" if placement is None else
                                  f"read of key {key} before its write completed")
            if out.nbytes != placement.nbytes:
                raise EngineError(f"read of key {key} into {out.nbytes} bytes; "
                                  f"{placement.nbytes} were written")
            n = len(placement.extents)
            self._queued += n
            depth = self._queued
        req = Request(self, key, False, out, placement, n, ready_event, self.read_meter, depth)
        self._enqueue(req)
        return req.future

    def release(self, key: int) -> None:
        with self._lock:
            placement = self._placed.pop(key, None)
            self._write_requests.pop(key, None)
        for root, offset, size in placement.allocs if placement is not None else ():
            self._slabs[root].alloc.free_later(offset, size)  # freed by the next allocation (extents.py)

    def end_step(self) -> None:
        """No key is live: remove the slab files, so nothing stays on disk between steps."""
        with self._lock:
            if self._placed:
                return
        # What this step needed per root (its slabs' high-water marks): the plan the
        # offloader checks free space against before the next step, and what the next
        # step's first reservation takes at once (slab.py).
        self.step_peak_bytes = [s.end_step() for s in self._slabs]

    def _forget_all(self) -> None:
        with self._lock:
            self._placed.clear()
            self._write_requests.clear()

    def _remove_files(self, drop_slabs: bool) -> None:
        """Take this engine's files away: the slabs (only when no IO thread may still use
        their descriptors) and the rank directories."""
        self._closed_by = cleanup.interrupted  # a signal's cleaners, or None
        if self._cleanup_token is not None:
            cleanup.unregister(self._cleanup_token)
            self._cleanup_token = None
        if drop_slabs:
            for s in self._slabs:
                s.drop()
        for d in self._held_dirs:
            # A no-op for a directory already gone; the job folders it leaves empty go too.
            # Its descriptor stays open while an IO thread may still create the slab in it
            # (closed, its number could name another directory by then).
            remove_rank_dir(d, keep_open=not drop_slabs)

    def _check_open(self) -> None:
        if self._closed:
            cleanup.raise_if_interrupted(self._closed_by)
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

    def _check_inside(self, op: Run) -> None:
        """Read side, before the IO: the run lies inside the reserved (written) file."""
        slab = self._slabs[op.root]
        if slab.fd is None or op.offset + op.nbytes > slab.reserved:
            raise EngineError(f"{self._describe(op)}: past the reserved end of the slab ({slab.reserved} bytes)")

    def _drain(self, op: Run) -> None:
        """Read side, after the IO: the staging copies each chunk out and completes it."""
        self.staging.drain(op, [s.path for s in self._slabs], self._finish_chunk)

    def _describe(self, op: Run) -> str:
        slab = self._slabs[op.root]
        return (f"{self.name} {'write' if op.writing else 'read'} of {op.nbytes} bytes "
                f"{'to' if op.writing else 'from'} {slab.path} at offset {op.offset}")


EXIT_JOIN_S = 10.0
"""At most this long (and at most io_timeout_s) the exit path waits for IO threads to leave."""


def join_before_exit(threads: List[threading.Thread], io_timeout_s: float) -> None:
    """Exit/signal path, after the engine's queues were closed: wait (briefly) for its IO
    threads to leave.

    Why: a daemon thread that is still running, or still inside torch (a copy releases the
    GIL), when the interpreter finalizes is stopped with ``pthread_exit`` as it takes the GIL
    back; unwinding through torch's C++ frames that way ends in ``std::terminate``
    ("terminate called without an active exception", SIGABRT) instead of the job's own exit
    status. Threads that are done when finalization starts cannot do that. A thread stuck on a
    dead drive is left behind after the deadline (and logged)."""
    deadline = time.monotonic() + min(EXIT_JOIN_S, io_timeout_s)
    for t in threads:
        if t is not threading.current_thread():
            t.join(max(0.0, deadline - time.monotonic()))
    stuck = sum(t.is_alive() for t in threads)
    if stuck:
        logging.getLogger(__name__).error(
            "ssdtrain: exiting with %d IO threads still inside a request", stuck)


def aligned_buffer(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` starting on a page boundary (O_DIRECT needs it).

    Host buffers are anonymous mmaps (the tensor keeps the mapping alive): in side-by-side runs
    of 64 MiB reads, O_DIRECT into them was a few percent faster than into torch's allocator's
    memory. ``pin`` (CUDA): the same mapping page-locked, pinning ``nbytes`` rounded up to a page
    (io/pinned.py), not torch's next power of two."""
    if not pin:
        return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=torch.uint8)[:nbytes]
    return pin_host(nbytes)[0]
