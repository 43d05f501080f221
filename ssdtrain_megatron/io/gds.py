"""The 'gds' engine: kvikio ``CuFile`` (GPUDirect Storage) on one slab per root.

Why these choices:
- With GDS, the drive DMAs straight into GPU memory: no bounce through host RAM, no CPU copy.
  Where GDS is absent (no nvidia-fs driver, unsupported filesystem) kvikio runs in compat mode
  (POSIX IO through its own pinned bounce buffers); it still works, only slower.
- kvikio needs libcuda: on a machine without CUDA it cannot even be imported usefully, so
  ``OffloadConfig`` refuses ``engine='gds'`` there (via :func:`gds_unavailable_reason`, which
  imports neither kvikio nor CUDA state) instead of failing at the first write.
- Extents start on 4 KiB boundaries (GDS's alignment); kvikio handles unaligned tails.
- kvikio's own thread pool does the IO; our workers only wait for ``ready_event`` (a tensor's
  producer kernel) before handing the buffer over, so the training thread never blocks.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..config import OffloadConfig
from .base import BusyMeter, EngineError, EngineUnavailable, IOEngine
from .layout import (ALIGN, Extent, ExtentAllocator, Identity, align_up, expand_roots, make_rank_dirs,
                     open_private, plan_chunks, remove_rank_dir)
from .posix import SlabKeys

log = logging.getLogger(__name__)

SLAB_NAME = "slab.bin"
GROW_BYTES = 256 << 20


def gds_unavailable_reason() -> str:
    """'' when the gds engine can run here, else why not and what to install.

    Cheap enough for config validation: asks torch whether CUDA works and looks for kvikio
    without importing it.
    """
    if torch.version.cuda is None:
        return (f"engine 'gds' moves data between GPU memory and files with kvikio (cuFile), which "
                f"needs CUDA, but this torch ({torch.__version__}) is a CPU-only build; on a CUDA "
                f"machine install a CUDA build of torch and kvikio (pip install kvikio-cu12, or "
                f"kvikio-cu13 to match your CUDA), or use engine='posix' or 'aio'")
    if not torch.cuda.is_available():
        return ("engine 'gds' moves data between GPU memory and files with kvikio (cuFile), which "
                "needs a working CUDA driver and GPU, and torch.cuda.is_available() is False here; "
                "run on a CUDA machine, or use engine='posix' or 'aio'")
    if importlib.util.find_spec("kvikio") is None:
        return (f"engine 'gds' needs kvikio, which is not installed: pip install kvikio-cu"
                f"{torch.version.cuda.split('.')[0]} (matching CUDA {torch.version.cuda}); GPUDirect "
                f"Storage itself (nvidia-fs) is optional, kvikio falls back to compat mode")
    return ""


class _Slab:
    def __init__(self, directory: str) -> None:
        self.dir = directory
        self.path = os.path.join(directory, SLAB_NAME)
        self.alloc = ExtentAllocator(ALIGN)
        self.lock = threading.Lock()
        self.fd: Optional[int] = None
        self.file = None  # kvikio.CuFile
        self.reserved = 0

    def ensure_open(self, kvikio) -> None:
        if self.file is None:
            try:
                self.fd = open_private(self.path, os.O_RDWR)
            except OSError as exc:
                raise EngineError(f"cannot create {self.path}: {exc.strerror}") from exc
            self.file = kvikio.CuFile(self.path, "r+")

    def reserve(self, kvikio, end: int) -> None:
        if end <= self.reserved:
            return
        self.ensure_open(kvikio)
        new = max(end, self.reserved + GROW_BYTES)
        os.posix_fallocate(self.fd, self.reserved, new - self.reserved)
        self.reserved = new

    def drop(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            os.unlink(self.path)
        self.alloc.reset()
        self.reserved = 0


class GdsEngine(SlabKeys, IOEngine):
    """kvikio ``CuFile.pwrite/pread`` on slab files, striped over the roots. CUDA only."""

    name = "gds"

    @classmethod
    def is_available(cls) -> Tuple[bool, str]:
        why = gds_unavailable_reason()
        return not why, why

    def __init__(self, config: OffloadConfig, ident: Optional[Identity] = None) -> None:
        why = gds_unavailable_reason()
        if why:
            raise EngineUnavailable(why)
        import kvikio

        self._kvikio = kvikio
        self.config = config
        self.ident = ident or Identity.detect(config.job_id())
        self.roots = expand_roots(config.dirs, self.ident)
        self.rank_dirs: List[str] = make_rank_dirs(self.roots, self.ident)
        self._slabs = [_Slab(d) for d in self.rank_dirs]
        self._chunk = config.chunk_bytes
        self._workers = ThreadPoolExecutor(config.io_threads, thread_name_prefix="ssdtrain-gds")
        self._extents: Dict[int, List[Extent]] = {}
        self._lock = threading.Lock()
        self._next_root = 0
        self._closed = False
        self.write_meter = BusyMeter()
        self.read_meter = BusyMeter()
        self.step_peak_bytes: List[int] = [0] * len(self._slabs)
        self.tracer: Optional[Callable[..., None]] = None
        """Optional IO trace sink: tracer(op, key, path, offset, nbytes, t_submit, t_done,
        queue_depth), called from a worker when each chunk completes."""

    @property
    def bytes_on_disk(self) -> int:
        return sum(s.alloc.allocated for s in self._slabs)

    @property
    def page_cache_bypassed(self) -> bool:
        # GDS is direct; compat mode opens with O_DIRECT where the filesystem allows it.
        return True

    def write(self, key: int, data: torch.Tensor, ready_event: Optional[object] = None) -> Future:
        self._check_open()
        nbytes = data.numel()
        with self._lock:
            if key in self._extents:
                raise EngineError(f"key {key} written twice")
            first = self._next_root
            self._next_root = (first + 1) % len(self._slabs)
        chunks = plan_chunks(nbytes, self._chunk, len(self._slabs), first)
        extents: List[Extent] = []
        try:
            for root, _start, length in chunks:
                slab = self._slabs[root]
                with slab.lock:
                    offset = slab.alloc.allocate(length)
                    extents.append(Extent(root, offset, length))
                    slab.reserve(self._kvikio, offset + align_up(max(length, 1)))
        except OSError as exc:
            for e in extents:
                self._slabs[e.root].alloc.free(e.offset, e.length)
            raise EngineError(f"cannot reserve {nbytes} bytes: {exc.strerror or exc}") from exc
        with self._lock:
            self._extents[key] = extents
        starts = [c[1] for c in chunks]
        self.write_meter.begin()
        fut = self._workers.submit(self._io, "write", key, data, extents, starts, ready_event)
        fut.add_done_callback(lambda f: self.write_meter.end(nbytes))
        return fut

    def read(self, key: int, out: torch.Tensor) -> Future:
        self._check_open()
        with self._lock:
            extents = self._extents.get(key)
        if extents is None:
            raise EngineError(f"read of unknown key {key}")
        if out.numel() != sum(e.length for e in extents):
            raise EngineError(f"read of key {key} into {out.numel()} bytes; "
                              f"{sum(e.length for e in extents)} were written")
        starts, pos = [], 0
        for e in extents:
            starts.append(pos)
            pos += e.length
        nbytes = out.numel()
        self.read_meter.begin()
        fut = self._workers.submit(self._io, "read", key, out, extents, starts, None)
        fut.add_done_callback(lambda f: self.read_meter.end(nbytes))
        return fut

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._workers.shutdown(wait=True)
        with self._lock:
            self._extents.clear()
        for s in self._slabs:
            s.drop()
        for d in self.rank_dirs:
            remove_rank_dir(d)

    def remove_files(self) -> None:
        """Signal/exit path: take the files out of the namespace now, wait for nothing."""
        self._closed = True
        self._workers.shutdown(wait=False, cancel_futures=True)
        for d in self.rank_dirs:
            remove_rank_dir(d)
        self.rank_dirs = []

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError("engine is closed")

    def _io(self, op: str, key: int, tensor: torch.Tensor, extents: List[Extent], starts: List[int],
            ready_event) -> int:
        t_submit = time.perf_counter()
        if ready_event is not None:
            ready_event.synchronize()
        # kvikio takes CUDA tensors through __cuda_array_interface__, host ones as numpy.
        buf = tensor if tensor.is_cuda else tensor.numpy()
        pending = []
        for ext, start in zip(extents, starts):
            if not ext.length:
                continue
            slab = self._slabs[ext.root]
            part = buf[start:start + ext.length]
            call = slab.file.pwrite if op == "write" else slab.file.pread
            pending.append((ext, slab, call(part, ext.length, ext.offset)))
        total = 0
        for ext, slab, fut in pending:
            try:
                done = fut.get()
            except Exception as exc:
                raise EngineError(f"gds {op} of {ext.length} bytes at offset {ext.offset} of {slab.path} "
                                  f"failed: {exc}") from exc
            if done != ext.length:
                raise EngineError(f"short gds {op} at offset {ext.offset} of {slab.path}: {done} of "
                                  f"{ext.length} bytes")
            total += done
            if self.tracer is not None:
                self.tracer(op, key, slab.path, ext.offset, ext.length, t_submit, time.perf_counter(),
                            len(pending))
        return total
