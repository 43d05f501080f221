"""The 'gds' engine: kvikio ``CuFile`` (GPUDirect Storage) on one slab per root.

Why these choices:
- With GDS, the drive DMAs straight into GPU memory: no bounce through host RAM, no CPU copy.
  Where GDS is absent (no nvidia-fs driver, unsupported filesystem) kvikio runs in compat mode
  (POSIX IO through its own pinned bounce buffers); it still works, only slower.
- kvikio needs libcuda: on a machine without CUDA it cannot even be imported usefully, so
  building the engine (``make_engine`` / the constructor) refuses there with the reason (via
  :func:`gds_unavailable_reason`, which imports neither kvikio nor CUDA state) instead of
  failing at the first write. The config does not probe: a gds preset loads anywhere.
- The slab, placement and striping are the posix engine's (``slab_engine.py``): extents start on
  4 KiB boundaries (GDS's alignment); kvikio handles unaligned tails.
- kvikio's own thread pool does the IO; our worker threads wait for ``ready_event``, reserve
  the slab space and hand the buffer over, so the training thread only places the chunks and
  queues the request. kvikio's pool has one thread unless told otherwise: it gets
  ``io_threads`` (``KVIKIO_NTHREADS``, when set, wins), so a tensor's chunks are in flight on
  several threads at once.
- Compat mode (no GDS) moves device memory through kvikio's own bounce buffers with copies on
  a stream kvikio makes per thread (blocking, so ordered with the legacy default stream that
  torch computes on by default) or on the legacy default stream itself: every such copy
  would wait for the training step's kernels and they for it. So where kvikio prefers compat
  mode the engine is not ``device_direct``: the offloader stages through pinned host memory
  on its own non-blocking streams (cache/device_copy.py), and kvikio does plain POSIX IO on
  those host blocks, no CUDA stream at all. Said once in the log.
- With GDS, a read lands in device memory that the offloader allocates at 4 KiB alignment
  (``GDS_ALIGN``, cache/record.py): cuFile DMAs an aligned buffer directly and bounces an
  unaligned one through its own buffers. cuFile reads and writes device memory outside any CUDA stream, so the
  event is what orders it: on a write, the producer's event (recorded after any compaction);
  on a read, the event recorded where the destination was allocated (kernels that used that
  memory before may still run). See cache/device_copy.py.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Tuple

import torch

from ..config import OffloadConfig
from .affinity import pin_io_thread
from .base import EngineError, EngineUnavailable
from .layout import Identity
from .requests import Request
from .slab import Slab
from .slab_engine import SlabEngine
from .gpu_wait import wait_for

log = logging.getLogger(__name__)

GDS_ALIGN = 4096
"""Device buffers cuFile reads into without bouncing start on this boundary."""


def gds_unavailable_reason() -> str:
    """'' when the gds engine can run here, else why not and what to install.

    Cheap (asks torch whether CUDA works and looks for kvikio without importing it): called
    where the engine is built, and by ``ssdtrain doctor``.
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


class GdsEngine(SlabEngine):
    """kvikio ``CuFile.pwrite/pread`` on slab files, striped over the roots. CUDA only."""

    name = "gds"
    device_direct = True  # cuFile DMAs device memory: no pinned staging on the way

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
        compat = configure_kvikio(kvikio, config.io_threads)
        self.device_direct = not compat
        if compat:
            log.info("ssdtrain: kvikio runs in compat mode (no GPUDirect Storage here): engine 'gds' "
                     "stages through pinned host memory on the offloader's own streams, as 'posix' does")
        self._init_common(config, ident)
        # kvikio opens the file itself (O_DIRECT where GDS or the filesystem allows it); our
        # descriptor only reserves space.
        try:
            self._open_slabs("off", on_open=self._open_cufile)
            self._workers = ThreadPoolExecutor(config.io_threads, thread_name_prefix="ssdtrain-gds",
                                               initializer=pin_io_thread, initargs=(tuple(config.io_cpus),))
        except BaseException:
            self._remove_files(drop_slabs=True)  # a failed start leaves nothing on disk
            raise

    def _open_cufile(self, slab: Slab) -> None:
        # By the descriptor we hold, not by name: a name can be taken over (layout.py).
        slab.handle = self._kvikio.CuFile(slab.proc_path, "r+")

    @property
    def page_cache_bypassed(self) -> bool:
        # GDS is direct; compat mode opens with O_DIRECT where the filesystem allows it.
        return True

    def _enqueue(self, req: Request) -> None:
        self._workers.submit(self._io, req)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._workers.shutdown(wait=True)
        self._forget_all()
        self._remove_files(drop_slabs=True)

    def remove_files(self) -> None:
        """Signal/exit path: take the files out of the namespace now, wait for nothing."""
        self._closed = True
        self._workers.shutdown(wait=False, cancel_futures=True)
        self._remove_files(drop_slabs=False)

    def _io(self, req: Request) -> None:
        """Worker thread: every chunk of ``req`` through kvikio at once, then wait for each."""
        op = "write" if req.writing else "read"
        req.meter.begin()
        try:
            if req.ready_event is not None:
                wait_for(req.ready_event)
            # kvikio takes CUDA tensors through __cuda_array_interface__, host ones as numpy.
            data = req.bytes()
            buf = data if data.is_cuda else data.numpy()
            data = None
        except BaseException as exc:  # noqa: BLE001 - surfaced through the Future
            for i in range(len(req.extents)):
                self._finish_chunk(req, i, EngineError(f"gds {op} of key {req.key} failed: {exc!r}"))
            return
        pending = []
        for i, ext in enumerate(req.extents):
            start = i * self._chunk
            slab = self._slabs[ext.root]
            try:
                if req.writing:
                    slab.ensure_reserved(ext.offset + self.staging.padded(ext.length))
                elif slab.handle is None or ext.offset + ext.length > slab.reserved:
                    raise EngineError(f"gds read of {ext.length} bytes from {slab.path} at offset "
                                      f"{ext.offset}: past the reserved end of the slab")
                if not ext.length:
                    pending.append((i, None))
                    continue
                pending.append((i, self._sys.gds_submit(slab.handle, req.writing, buf[start:start + ext.length],
                                                        ext.length, ext.offset, slab.path)))
            except BaseException as exc:  # noqa: BLE001 - surfaced through the Future
                self._finish_chunk(req, i, _gds_error(op, ext.length, ext.offset, slab.path, exc))
        buf = None  # kvikio holds what it still reads or writes; we hold nothing past completion
        while pending:
            i, handle = pending.pop(0)
            ext = req.extents[i]
            path = self._slabs[ext.root].path
            exc: Optional[BaseException] = None
            try:
                done = handle.get() if handle is not None else 0
                if done != ext.length:
                    exc = EngineError(f"short gds {op} {'to' if req.writing else 'from'} {path} at offset "
                                      f"{ext.offset}: {done} of {ext.length} bytes")
            except BaseException as e:  # noqa: BLE001 - surfaced through the Future
                exc = _gds_error(op, ext.length, ext.offset, path, e)
            self._finish_chunk(req, i, exc)


def configure_kvikio(kvikio, threads: int) -> bool:
    """Give kvikio's thread pool ``threads`` threads (unless ``KVIKIO_NTHREADS`` is set);
    True when kvikio prefers compat mode (POSIX IO instead of cuFile). Both the current
    (``defaults.set`` / ``is_compat_mode_preferred``) and the older (``num_threads_reset`` /
    ``compat_mode``) kvikio APIs. ``kvikio.defaults`` is a submodule that ``import kvikio``
    does not always import (kvikio 26.10 does not: the first GPU run of gpu-check failed on it),
    so it is imported by name where the attribute is missing."""
    defaults = getattr(kvikio, "defaults", None)
    if defaults is None:
        defaults = importlib.import_module(f"{kvikio.__name__}.defaults")
    if "KVIKIO_NTHREADS" not in os.environ:
        if hasattr(defaults, "set"):
            defaults.set("num_threads", threads)
        elif hasattr(defaults, "num_threads_reset"):
            defaults.num_threads_reset(threads)
    if hasattr(defaults, "is_compat_mode_preferred"):
        return bool(defaults.is_compat_mode_preferred())
    if hasattr(defaults, "compat_mode"):
        mode = defaults.compat_mode()
        off = getattr(getattr(kvikio, "CompatMode", None), "OFF", False)
        return mode != off
    return False


def _gds_error(op: str, length: int, offset: int, path: str, exc: BaseException) -> BaseException:
    if isinstance(exc, EngineError):
        return exc
    text = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
    wrapped = EngineError(f"gds {op} of {length} bytes {'to' if op == 'write' else 'from'} {path} at offset "
                          f"{offset} failed: {text}")
    wrapped.__cause__ = exc
    return wrapped
