"""The 'aio' engine: DeepSpeed DeepNVMe's ``aio_handle`` (libaio, O_DIRECT) on one slab per root.

Why these choices:
- The slab layout, striping and extent allocation are the posix engine's: one preallocated
  O_DIRECT file per root, tensors cut into ``chunk_bytes`` chunks striped round-robin. Only the
  system calls differ: each chunk is one ``aio_handle`` operation that DeepNVMe splits into
  ``aio_block_bytes`` libaio requests, ``aio_queue_depth`` of them in flight per aio thread.
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
    unseen. ``checksum: true`` catches that, at the cost of a CRC32 per chunk.
  * Buffers that DeepNVMe did not lock itself are bounced through a buffer it allocates and
    copies *in the calling thread*. Each lane therefore owns two page-locked staging buffers
    (``new_cpu_locked_tensor``; CUDA-pinned memory where CUDA exists) and does the copy itself,
    off the training thread, into one while the other's IO is in flight.
  * A failed ``mlock`` or ``io_setup`` is not reported either, only met later by an
    ``assert``: the memlock limit and ``fs.aio-max-nr`` are checked before any handle exists.
  * DeepNVMe's first write logs a warning inside a ``std::call_once`` that takes the GIL,
    while ``async_pwrite`` holds it: two threads making the first write at once deadlock. The
    engine makes one write alone, in its constructor, before any lane starts.
- Space is reserved as in the posix engine: a full disk fails ``write`` in the caller's thread,
  and a reserver thread keeps the slab preallocated ahead so that callers rarely wait on
  fallocate.
- Nothing here imports DeepSpeed at module import: :func:`aio_unavailable_reason` only looks for
  files, and the JIT build (minutes, cached under ``TORCH_EXTENSIONS_DIR``) happens when the
  first engine is constructed.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import glob
import importlib.util
import io
import logging
import os
import resource
import shlex
import shutil
import sys
import sysconfig
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Deque, Dict, List, Optional, Tuple

import torch

from ..config import OffloadConfig
from .base import BusyMeter, EngineError, EngineUnavailable, IOEngine
from .layout import (ALIGN, Extent, Identity, align_up, expand_roots, free_bytes, make_rank_dirs,
                     open_private, plan_chunks, remove_rank_dir)
from .posix import SlabKeys, _Slab, reserve_ahead_bytes

log = logging.getLogger(__name__)

CAP_IPC_LOCK = 14


def _free_text(directory: str) -> str:
    try:
        return f"{free_bytes(directory) / 2**20:.1f} MiB"
    except OSError:
        return "unknown space"


# -- capability checks (cheap: look for files, import nothing) ------------------------------


def _flag_dirs(var: str, flag: str) -> List[str]:
    return [a[len(flag):] for a in shlex.split(os.environ.get(var, "")) if a.startswith(flag)]


def _has_libaio_dev() -> bool:
    """libaio.h and the unversioned libaio.so the linker needs (both come with libaio-dev)."""
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    inc = ["/usr/include", "/usr/local/include"] + _flag_dirs("CFLAGS", "-I") \
        + [d for v in ("CPATH", "C_INCLUDE_PATH") for d in os.environ.get(v, "").split(":") if d]
    lib = [f"/usr/lib/{multiarch}", "/usr/lib64", "/usr/lib", "/usr/local/lib", "/lib64",
           f"/lib/{multiarch}"] + _flag_dirs("LDFLAGS", "-L") \
        + [d for d in os.environ.get("LIBRARY_PATH", "").split(":") if d]
    has_header = any(os.path.exists(os.path.join(d, "libaio.h")) for d in inc)
    has_lib = any(glob.glob(os.path.join(d, "libaio.so")) or glob.glob(os.path.join(d, "libaio.a"))
                  for d in lib)
    return has_header and has_lib


def _prebuilt_op(ds_dir: str) -> bool:
    """DeepSpeed installed with DS_BUILD_AIO=1 ships the op; no build tools are needed."""
    return bool(glob.glob(os.path.join(ds_dir, "ops", "aio", "async_io_op*.so")))


def aio_unavailable_reason() -> str:
    """'' when the aio engine can run (or be built) here, else what is missing and how to get it.

    Only looks for files and programs: it neither imports DeepSpeed nor starts the build.
    """
    if not sys.platform.startswith("linux"):
        return "libaio exists only on Linux; use engine='posix'"
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return ("DeepSpeed is not installed: pip install deepspeed==0.19.8 (check first with "
                "`pip install --dry-run` that it leaves torch alone, or use --no-deps and add "
                "hjson msgpack ninja psutil py-cpuinfo pydantic tqdm einops)")
    if _prebuilt_op(list(spec.submodule_search_locations)[0]):
        return ""
    missing = []
    if not _has_libaio_dev():
        missing.append("libaio headers and library (apt-get install libaio-dev, or yum install "
                       "libaio-devel; set CFLAGS=-I... LDFLAGS=-L... for a private install)")
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        missing.append(f"a C++ compiler ({cxx!r} is not on PATH; apt-get install build-essential)")
    if shutil.which("ninja") is None:
        missing.append("ninja on PATH (pip install ninja, then put the environment's bin/ on PATH)")
    if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        missing.append("the Python headers (apt-get install python3-dev)")
    if torch.version.cuda is not None and torch.cuda.is_available():
        from torch.utils.cpp_extension import CUDA_HOME

        if CUDA_HOME is None:
            missing.append("the CUDA toolkit (DeepSpeed builds the op against it; set CUDA_HOME)")
    if missing:
        return ("DeepSpeed's async_io op is not built and cannot be built here; missing: "
                + "; ".join(missing))
    return ""


def load_aio_op():
    """Import (building on first use, for minutes) DeepSpeed's async_io op; returns the module.

    The build is cached under $TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions), and a
    file lock there makes concurrent ranks wait for one build instead of racing.
    """
    why = aio_unavailable_reason()
    if why:
        raise EngineUnavailable(f"engine 'aio' cannot run here: {why}")
    log.info("loading DeepSpeed's async_io op (the first use on a machine compiles it: minutes)")
    from deepspeed.ops.op_builder import AsyncIOBuilder  # imports deepspeed: only here

    try:
        # DeepSpeed keeps the loaded op per process, and checks the compiler and libaio (by
        # compiling a test program) only before the first load.
        with _stderr_with_fd():
            return AsyncIOBuilder().load(verbose=False)
    except Exception as exc:
        raise EngineUnavailable(f"engine 'aio' cannot run here: loading DeepSpeed's async_io op "
                                f"failed: {exc}") from exc


@contextlib.contextmanager
def _stderr_with_fd():
    """DeepSpeed's compatibility check redirects ``sys.stderr.fileno()`` while it compiles its
    test program, and reports 'incompatible' when stderr has no descriptor (notebooks, pytest's
    capture). Lend it the process's real stderr for the duration."""
    try:
        sys.stderr.fileno()
        yield
        return
    except (AttributeError, OSError, io.UnsupportedOperation, ValueError):
        pass
    saved = sys.stderr
    sys.stderr = sys.__stderr__ if sys.__stderr__ is not None else saved
    try:
        yield
    finally:
        sys.stderr = saved


# -- resource checks, done before DeepNVMe would abort on them --------------------------------


def _can_lock(nbytes: int) -> Tuple[bool, str]:
    """Whether ``nbytes`` more can be page-locked (DeepNVMe asserts when mlock fails)."""
    try:
        with open("/proc/self/status") as fh:
            status = dict(line.split(":", 1) for line in fh if ":" in line)
        if int(status["CapEff"].strip(), 16) >> CAP_IPC_LOCK & 1:
            return True, ""
        locked = int(status.get("VmLck", "0 kB").split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        locked = 0
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or locked + nbytes <= soft:
        return True, ""
    return False, (f"the aio engine needs {nbytes} bytes of page-locked staging buffers, but "
                   f"RLIMIT_MEMLOCK allows {soft} ({locked} already locked); raise it (`ulimit -l "
                   f"unlimited`, or memlock in /etc/security/limits.conf / docker --ulimit "
                   f"memlock=-1), or lower io_threads or chunk_bytes")


def _check_aio_events(contexts: int, queue_depth: int) -> None:
    """Each handle thread calls io_setup(queue_depth); DeepNVMe ignores its failure and later
    asserts in io_submit, so check the system-wide budget first."""
    try:
        with open("/proc/sys/fs/aio-max-nr") as fh:
            limit = int(fh.read())
        with open("/proc/sys/fs/aio-nr") as fh:
            used = int(fh.read())
    except (OSError, ValueError):
        return
    # The kernel reserves max(depth, 4 * cpus) * 2 events per context.
    need = contexts * max(queue_depth, 4 * (os.cpu_count() or 1)) * 2
    if used + need > limit:
        raise EngineError(f"the aio engine needs about {need} libaio events but fs.aio-max-nr={limit} "
                          f"and {used} are in use; raise it (sysctl -w fs.aio-max-nr={used + need * 2}) "
                          f"or lower io_threads / aio_queue_depth / aio_intra_op_parallelism")


# -- slab, requests, lanes -------------------------------------------------------------------


class _DirectSlab(_Slab):
    """The posix engine's slab (extent allocator, reservation ahead of need, 'tight' mode on a
    nearly full disk), but O_DIRECT is a must: DeepNVMe opens the file with it for reads."""

    def ensure_open(self) -> int:
        if self.fd is None:
            try:
                self.fd = open_private(self.path, os.O_RDWR | os.O_DIRECT)
            except OSError as exc:
                if exc.errno == errno.EINVAL:
                    if os.path.lexists(self.path):
                        os.unlink(self.path)
                    raise EngineError(f"the filesystem of {self.dir} refuses O_DIRECT, which the aio "
                                      f"engine needs; use engine='posix' there (it falls back to "
                                      f"buffered IO) or a directory on a local SSD") from exc
                raise EngineError(f"cannot create {self.path}: {exc.strerror}") from exc
        return self.fd


class _Request:
    """One tensor's write or read: its chunks, and a Future completed when the last chunk is
    done. The Future fails with the first chunk error, but only once no chunk is in flight, so
    the caller may reuse the tensor as soon as the Future completes."""

    def __init__(self, key: int, writing: bool, tensor: torch.Tensor, extents: List[Extent],
                 starts: List[int], ready_event: Optional[object], meter: BusyMeter, depth: int) -> None:
        self.future: Future = Future()
        self.key = key
        self.t_submit = time.perf_counter()
        self.depth = depth  # chunks queued or in flight when this request was made (for the trace)
        self.writing = writing
        self.tensor = tensor
        self.extents = extents
        self.starts = starts
        self.ready_event = ready_event
        self.meter = meter
        self.next_chunk = 0  # guarded by the queue's lock
        self.error: Optional[BaseException] = None
        self._left = len(extents)
        self._lock = threading.Lock()

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


class _ChunkQueue:
    """Requests waiting for lanes; a lane takes one chunk at a time, so one large tensor keeps
    every lane busy. One lock and one notify per tensor: cheap for the training thread."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._items: Deque[_Request] = collections.deque()
        self._closed = False

    def put(self, req: _Request) -> None:
        with self._cv:
            self._items.append(req)
            self._cv.notify(len(req.extents))

    def get_run(self, wait: bool, limit: int, padded: Callable[[int], int]
                ) -> Optional[List[Tuple[_Request, int]]]:
        """The next chunk, plus the chunks queued right behind it that continue it in the same
        slab, up to ``limit`` padded bytes: small tensors written (or read) one after another
        become one large request. None when closed and drained, or, with ``wait=False``, when
        nothing is queued right now."""
        with self._cv:
            while wait and not self._items and not self._closed:
                self._cv.wait()
            if not self._items:
                return None
            run = [self._pop()]
            first = run[0][0].extents[run[0][1]]
            end = first.offset + padded(first.length)
            size = end - first.offset
            while self._items:
                req = self._items[0]
                ext = req.extents[req.next_chunk]
                step = padded(ext.length)
                if ext.root != first.root or ext.offset != end or size + step > limit:
                    break
                run.append(self._pop())
                end += step
                size += step
            return run

    def _pop(self) -> Tuple[_Request, int]:
        req = self._items[0]
        i = req.next_chunk
        req.next_chunk += 1
        if req.next_chunk == len(req.extents):
            self._items.popleft()
        return req, i

    def close(self) -> None:
        """Lanes finish what is queued, then exit."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()


class _Lane:
    """One worker thread with its own aio_handle and two page-locked staging buffers: while
    one buffer's IO is in flight, the other is filled (write) or emptied (read), so the copy
    never leaves the drive idle."""

    def __init__(self, handle, buffers: List[torch.Tensor], locked_by_deepnvme: bool) -> None:
        self.handle = handle
        self.buffers = buffers
        self.locked_by_deepnvme = locked_by_deepnvme
        self.thread: Optional[threading.Thread] = None


class _InFlight:
    """One DeepNVMe operation: chunks contiguous in one slab, staged back to back in ``buf``
    (usually one chunk; several small ones when they were queued together)."""

    __slots__ = ("parts", "buf", "root", "offset", "nbytes", "writing")

    def __init__(self, parts: List[Tuple[_Request, int]], buf: torch.Tensor, padded: Callable[[int], int]) -> None:
        first = parts[0][0].extents[parts[0][1]]
        last = parts[-1][0].extents[parts[-1][1]]
        self.parts = parts
        self.buf = buf
        self.root = first.root
        self.offset = first.offset
        self.nbytes = last.offset + padded(last.length) - first.offset
        self.writing = parts[0][0].writing


class AioEngine(SlabKeys, IOEngine):  # its own release(): merged requests
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
        self.config = config
        self._op = load_aio_op()
        self.ident = ident or Identity.detect(config.job_id())
        self._align = ALIGN * config.aio_intra_op_parallelism
        self._stage_bytes = align_up(config.chunk_bytes, self._align)
        self._chunk = config.chunk_bytes
        self._checksum = config.checksum
        lanes = config.io_threads
        _check_aio_events(2 * lanes * config.aio_intra_op_parallelism, config.aio_queue_depth)
        self._cuda = torch.cuda.is_available()
        if not self._cuda:
            ok, why = _can_lock(2 * lanes * 2 * self._stage_bytes)
            if not ok:
                raise EngineError(why)

        roots = expand_roots(config.dirs, self.ident)
        self.roots = roots
        self.rank_dirs: List[str] = []
        self._write_lanes: List[_Lane] = []
        self._read_lanes: List[_Lane] = []
        self._writes = _ChunkQueue()
        self._reads = _ChunkQueue()
        self._slabs: List[_DirectSlab] = []
        self._closed = False
        self._extents: Dict[int, List[Extent]] = {}  # key -> its chunks, in tensor order
        self._allocs: Dict[int, List[Tuple[int, int, int]]] = {}  # key -> (root, offset, bytes)
        self._lock = threading.Lock()
        self._next_root = 0
        self.write_meter = BusyMeter()
        self.read_meter = BusyMeter()
        self.fault: Optional[Callable[[str, str, int], Optional[OSError]]] = None
        """Test-only fault injection: called as fault(op, path, offset) before each request;
        a returned OSError is raised as if the system call had failed."""
        self.tracer: Optional[Callable[..., None]] = None
        """Optional IO trace sink: tracer(op, key, path, offset, nbytes, t_submit, t_done,
        queue_depth), called from a lane when each chunk completes."""
        self.step_peak_bytes: List[int] = [0] * len(roots)
        """Per root, the slab size the last step reached (the offloader checks free space
        against it before the next step)."""
        self._queued = 0  # chunks queued or in flight
        self._reserver = ThreadPoolExecutor(1, thread_name_prefix="ssdtrain-aio-reserve")
        self._reserver.submit(int)  # start its thread now, not in the first write()
        try:
            self.rank_dirs = make_rank_dirs(roots, self.ident)
            self._slabs = [_DirectSlab(d) for d in self.rank_dirs]
            for s in self._slabs:
                s.ahead_bytes = reserve_ahead_bytes(config, len(self._slabs))
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
        buf = lane.buffers[0][:self._align]
        buf.zero_()
        with slab.lock:
            slab.reserve(self._align)
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
                # it makes the GPU<->staging copy a DMA. Over-allocate to start on a page.
                raw = torch.empty(self._stage_bytes + ALIGN, dtype=torch.uint8, pin_memory=True)
                skip = (-raw.data_ptr()) % ALIGN
                buffers.append(raw[skip:skip + self._stage_bytes])
            else:
                buf = handle.new_cpu_locked_tensor(self._stage_bytes, torch.empty(0, dtype=torch.uint8))
                buffers.append(buf)
                if buf.numel() != self._stage_bytes or buf.data_ptr() % ALIGN:
                    raise EngineError("DeepNVMe returned a staging buffer that is not page-aligned")
        self._pending_lane = None
        return lane

    # -- properties -------------------------------------------------------------------------

    @property
    def bytes_on_disk(self) -> int:
        return sum(s.alloc.allocated for s in self._slabs)

    @property
    def page_cache_bypassed(self) -> bool:
        return True  # every slab is O_DIRECT or the engine refuses to start

    # -- requests ---------------------------------------------------------------------------

    def _padded(self, length: int) -> int:
        return align_up(max(length, 1), self._align)

    def write(self, key: int, data: torch.Tensor, ready_event: Optional[object] = None) -> Future:
        self._check_open()
        nbytes = data.numel()
        with self._lock:
            if key in self._extents:
                raise EngineError(f"key {key} written twice")
            first = self._next_root
            self._next_root = (first + 1) % len(self._slabs)
        chunks = plan_chunks(nbytes, self._chunk, len(self._slabs), first)
        # One extent per root holds all of the tensor's chunks on that root, back to back: one
        # allocation and one reservation check per root, not per chunk.
        per_root: Dict[int, int] = {}
        for root, _start, length in chunks:
            per_root[root] = per_root.get(root, 0) + self._padded(length)
        allocs: List[Tuple[int, int, int]] = []  # (root, offset, bytes)
        ahead: List[_DirectSlab] = []
        try:
            for root, size in per_root.items():
                slab = self._slabs[root]
                with slab.lock:
                    offset = slab.alloc.allocate(size)
                    allocs.append((root, offset, size))
                    slab.reserve(offset + size)  # at once, unless the reserver kept ahead
                    if slab.wants_ahead(offset + size):
                        ahead.append(slab)
        except OSError as exc:
            for root, offset, size in allocs:
                self._slabs[root].alloc.free(offset, size)
            failed = self._slabs[allocs[-1][0]]
            raise EngineError(f"cannot reserve {nbytes} bytes in {failed.path}: {exc.strerror or exc} "
                              f"({_free_text(failed.dir)} free in {failed.dir})") from exc
        for slab in ahead:
            self._reserver.submit(slab.grow_ahead)
        cursor = {root: offset for root, offset, _size in allocs}
        extents: List[Extent] = []
        for root, _start, length in chunks:
            extents.append(Extent(root, cursor[root], length))
            cursor[root] += self._padded(length)
        with self._lock:
            self._allocs[key] = allocs
            self._extents[key] = extents
            self._queued += len(extents)
            depth = self._queued
        self.write_meter.begin()
        req = _Request(key, True, data, extents, [c[1] for c in chunks], ready_event, self.write_meter, depth)
        self._writes.put(req)
        return req.future

    def read(self, key: int, out: torch.Tensor) -> Future:
        self._check_open()
        with self._lock:
            extents = self._extents.get(key)
        if extents is None:
            raise EngineError(f"read of unknown key {key}")
        stored = sum(e.length for e in extents)
        if out.numel() != stored:
            raise EngineError(f"read of key {key} into {out.numel()} bytes; {stored} were written")
        starts, pos = [], 0
        for e in extents:
            starts.append(pos)
            pos += e.length
        with self._lock:
            self._queued += len(extents)
            depth = self._queued
        self.read_meter.begin()
        req = _Request(key, False, out, extents, starts, None, self.read_meter, depth)
        self._reads.put(req)
        return req.future

    def release(self, key: int) -> None:
        with self._lock:
            self._extents.pop(key, None)
            allocs = self._allocs.pop(key, ())
        for root, offset, size in allocs:
            self._slabs[root].alloc.free(offset, size)

    def close(self) -> None:
        if self._closed:
            return
        self._shutdown()

    def remove_files(self) -> None:
        """Signal/exit path: take the files out of the namespace now, wait for nothing."""
        self._closed = True
        self._writes.close()
        self._reads.close()
        self._reserver.shutdown(wait=False, cancel_futures=True)
        for d in self.rank_dirs:
            remove_rank_dir(d)
        self.rank_dirs = []

    def _shutdown(self) -> None:
        self._closed = True
        self._writes.close()
        self._reads.close()
        self._reserver.shutdown(wait=True)
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
        stray = [self._pending_lane] if getattr(self, "_pending_lane", None) else []
        self._pending_lane = None
        for lane in lanes + stray:
            if lane.locked_by_deepnvme:
                for buf in lane.buffers:
                    lane.handle.free_cpu_locked_tensor(buf)
            lane.buffers = []
            lane.handle = None  # destroys the handle: its threads stop (no op is pending)
        self._write_lanes, self._read_lanes = [], []
        with self._lock:
            self._extents.clear()
            self._allocs.clear()
        for s in self._slabs:
            s.drop()
        for d in self.rank_dirs:
            remove_rank_dir(d)
        self.rank_dirs = []

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError("engine is closed")

    # -- lanes ------------------------------------------------------------------------------

    def _run_lane(self, lane: _Lane, queue: _ChunkQueue, writing: bool) -> None:
        """Keep one operation in flight and prepare the next one meanwhile.

        Write: copy B into the free buffer while A is written; wait for A; submit B.
        Read: wait for A; submit B into the free buffer; copy A out while B is read.
        """
        inflight: Optional[_InFlight] = None
        while True:
            run = queue.get_run(inflight is None, self._stage_bytes, self._padded)
            if run is None:
                if inflight is None:
                    return  # closed and drained
                self._settle(lane, inflight)
                inflight = None
                continue
            buf = lane.buffers[1] if inflight is not None and inflight.buf is lane.buffers[0] else lane.buffers[0]
            nxt: Optional[_InFlight] = _InFlight(run, buf, self._padded)
            if writing:
                nxt = self._guard(nxt, self._fill, nxt)
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

    def _settle(self, lane: _Lane, op: _InFlight) -> None:
        """Wait for ``op``; finish it (copy out for a read); complete its chunks."""
        if self._guard(op, self._wait, lane, op) is None:
            return
        if op.writing:
            self._finished(op, None)
        else:
            self._drain(op)

    def _finished(self, op: _InFlight, exc: Optional[BaseException]) -> None:
        for req, i in op.parts:
            self._finish_chunk(req, i, exc)

    def _finish_chunk(self, req: _Request, i: int, exc: Optional[BaseException]) -> None:
        """A chunk is done (or failed): trace it, then count it towards its tensor's Future."""
        with self._lock:
            self._queued -= 1
        tracer = self.tracer
        if tracer is not None and exc is None and req.error is None:
            ext = req.extents[i]
            tracer("write" if req.writing else "read", req.key, self._slabs[ext.root].path,
                   ext.offset, ext.length, req.t_submit, time.perf_counter(), req.depth)
        req.chunk_done(exc)

    def _guard(self, op: _InFlight, step, *args) -> Optional[_InFlight]:
        """Run one step of ``op``; on failure complete its chunks with the error and return
        None (the error reaches the caller through the tensors' Futures, never a log)."""
        try:
            step(*args)
            return op
        except BaseException as exc:  # noqa: BLE001 - surfaced through the Future
            self._finished(op, _as_engine_error(exc, f"aio {step.__name__.strip('_')}"))
            return None

    def _inject(self, op: str, slab: _DirectSlab, offset: int) -> None:
        if self.fault is not None:
            err = self.fault(op, slab.path, offset)
            if err is not None:
                raise err

    def _describe(self, op: _InFlight) -> str:
        slab = self._slabs[op.root]
        return (f"aio {'write' if op.writing else 'read'} of {op.nbytes} bytes "
                f"{'to' if op.writing else 'from'} {slab.path} at offset {op.offset}")

    def _fill(self, op: _InFlight) -> None:
        """Write side, before submitting: each chunk's bytes (and zeroed padding) into place."""
        for req, i in op.parts:
            ext = req.extents[i]
            n, start = ext.length, req.starts[i]
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

    def _submit(self, lane: _Lane, op: _InFlight) -> None:
        slab = self._slabs[op.root]
        what = self._describe(op)
        if slab.fd is None or op.offset + op.nbytes > slab.reserved:
            # DeepNVMe asserts (aborting the process) on a read past the end of the file.
            raise EngineError(f"{what}: past the reserved end of the slab ({slab.reserved} bytes)")
        try:
            for req, i in op.parts:
                self._inject("write" if op.writing else "read", slab, req.extents[i].offset)
        except OSError as exc:
            raise EngineError(f"{what} failed: {exc.strerror or exc}") from exc
        stage = op.buf[:op.nbytes]
        if op.writing:
            rc = lane.handle.async_pwrite(stage, slab.fd, op.offset)
        else:
            rc = lane.handle.async_pread(stage, slab.path, op.offset)
        if rc != 0:
            raise EngineError(f"{what} was refused by DeepNVMe (returned {rc}; its stderr says why)")

    def _wait(self, lane: _Lane, op: _InFlight) -> None:
        done = lane.handle.wait()
        if done != 1:
            raise EngineError(f"{self._describe(op)}: DeepNVMe completed {done} operations, expected 1")

    def _drain(self, op: _InFlight) -> None:
        """Read side, after the IO: per chunk, verify the checksum, copy the bytes out, and
        complete it (a bad chunk fails its own tensor only)."""
        for req, i in op.parts:
            exc: Optional[BaseException] = None
            try:
                ext = req.extents[i]
                n, start = ext.length, req.starts[i]
                stage = op.buf[ext.offset - op.offset:ext.offset - op.offset + n]
                if req.error is None and self._checksum and n:
                    crc = zlib.crc32(stage.numpy())
                    if crc != ext.crc:
                        raise EngineError(f"checksum mismatch reading {n} bytes from "
                                          f"{self._slabs[ext.root].path} at offset {ext.offset}: "
                                          f"stored crc32 {ext.crc:#010x}, read {crc:#010x}")
                if req.error is None and n:
                    req.tensor[start:start + n].copy_(stage)
            except BaseException as e:  # noqa: BLE001 - surfaced through the Future
                exc = _as_engine_error(e, "aio read")
            self._finish_chunk(req, i, exc)


def _as_engine_error(exc: BaseException, what: str) -> BaseException:
    if isinstance(exc, EngineError):
        return exc
    wrapped = EngineError(f"{what} failed: {exc!r}")
    wrapped.__cause__ = exc
    return wrapped
