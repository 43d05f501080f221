"""Streams, events and copies as the device-copy layer uses them, and the real CUDA ones.

Why these choices:

- **Streams outside torch's pool.** ``torch.cuda.Stream()`` does not create a stream: it hands
  out, round-robin, one of a small per-device pool (32 low-priority and 32 high-priority
  streams), the pool NCCL's process groups take their communication streams from too.
  Megatron makes many process groups (data, tensor, pipeline, context, expert, embedding
  ...); once the counter wraps, our offload stream can be the very stream a collective or a
  pipeline send runs on, and copies that should overlap communication queue behind it
  instead. So each stream is created for us alone, with ``cudaStreamCreateWithPriority``
  (non-blocking: no implicit ordering with the legacy default stream, which is torch's
  default compute stream) from the CUDA runtime this process already loaded (the same
  library torch calls, found in ``/proc/self/maps``), and wrapped in
  ``torch.cuda.ExternalStream``. Where that runtime cannot be found (torch linked it
  statically) or the call fails, the fallback is ``torch.cuda.Stream(priority=<highest>)``:
  the high-priority pool, which NCCL uses only for process groups created with
  ``is_high_priority_stream``; a warning says so. The two streams live as long as the
  process (they are never destroyed: an ExternalStream does not own its handle).
- **Blocking-sync events.** IO threads wait for copy events with ``synchronize()``. A
  default event spins a CPU core at 100% while it waits; on a node where every core also
  feeds a GPU (data loading, kernel launches) that costs step time. Events are created with
  ``blocking=True`` (``cudaEventBlockingSync``): the waiting thread sleeps.
- **The capture query** for CUDA graphs (``torch.cuda.is_current_stream_capturing()``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from typing import Any, ContextManager, Optional

import torch

from ..io.cuda_libs import MAPS, loaded_library
from ..io.pinned import pin


log = logging.getLogger(__name__)

CUDA_STREAM_NON_BLOCKING = 1  # cudaStreamNonBlocking


class StreamOps:
    """Streams, events and copies as the device-copy layer uses them (torch.cuda's API shape:
    a stream has ``wait_event(event)``; an event has ``record(stream)``, ``synchronize()`` and
    ``query()``). Subclasses: :class:`CudaStreams`, and the tests' recording stand-in."""

    def current_stream(self, device: torch.device) -> Any:
        raise NotImplementedError

    def new_stream(self, device: torch.device) -> Any:
        raise NotImplementedError

    def new_event(self) -> Any:
        raise NotImplementedError

    def timing_event(self) -> Any:
        """An event whose ``elapsed_time(other)`` gives milliseconds between two record points
        (telemetry/timeline.py; never used to order copies)."""
        raise NotImplementedError

    def use(self, stream: Any) -> ContextManager:
        """Make ``stream`` current for the calling thread inside the block."""
        raise NotImplementedError

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src, non_blocking=True)`` on the current stream."""
        dst.copy_(src, non_blocking=True)

    def compact(self, t: torch.Tensor) -> torch.Tensor:
        """``t.contiguous()`` on the current stream."""
        return t.contiguous()

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``torch.empty`` on the current stream (CUDA's caching allocator gives each stream's
        memory back to that stream: 512-byte aligned)."""
        return torch.empty(numel, dtype=dtype, device=device)

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        t.record_stream(stream)

    def let_go(self, t: Optional[torch.Tensor]) -> None:
        """The data path drops its reference to device bytes a copy read (the allocator may
        reuse them once every other reference is gone too): nothing to do on CUDA; the tests'
        recording stand-in logs it, to check it comes after the copy ran."""

    def capturing(self) -> bool:
        """True while the calling thread's current stream is capturing a CUDA graph."""
        return False

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """Page-locked host memory (uint8) from torch's caching host allocator (staging
        overflow: reused without registering again)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def pinned_pool(self, nbytes: int) -> torch.Tensor:
        """Page-locked host memory (uint8) allocated once for the job: the staging pool."""
        return self.pinned_empty(nbytes)


class CudaStreams(StreamOps):
    """torch.cuda streams (our own, see the module docstring) and blocking-sync events."""

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device) -> Any:
        return dedicated_stream(device)

    def new_event(self) -> Any:
        return torch.cuda.Event(blocking=True)

    def timing_event(self) -> Any:
        return torch.cuda.Event(enable_timing=True)

    def use(self, stream: Any) -> ContextManager:
        return torch.cuda.stream(stream)

    def capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def pinned_pool(self, nbytes: int) -> torch.Tensor:
        # Exactly the size asked (io/pinned.py), not the next power of two; where pinning in
        # place is refused, torch's pinned allocator (warned once).
        return pin(nbytes, fallback=self.pinned_empty)[0]


def dedicated_stream(device: torch.device, runtime: Any = None) -> Any:
    """A stream of our own on ``device``, outside torch's stream pool (module docstring).

    ``runtime``: the CUDA runtime library (a ctypes CDLL); default: the one this process
    loaded. Tests pass a stand-in."""
    lib = runtime if runtime is not None else cuda_runtime()
    if lib is not None:
        handle = ctypes.c_void_p()
        with torch.cuda.device(device):
            err = lib.cudaStreamCreateWithPriority(ctypes.byref(handle), CUDA_STREAM_NON_BLOCKING, 0)
        if err == 0 and handle.value:
            return torch.cuda.ExternalStream(handle.value, device=device)
        why = f"cudaStreamCreateWithPriority returned error {err}"
    else:
        why = "the CUDA runtime library is not among this process's shared libraries"
    _least, greatest = torch.cuda.Stream.priority_range()
    log.warning("ssdtrain: could not create a dedicated CUDA stream (%s); using a high-priority "
                "stream from torch's pool, which communication may share only if a process group "
                "was created with is_high_priority_stream", why)
    return torch.cuda.Stream(device, priority=greatest)


def cuda_runtime(maps: str = MAPS) -> Optional[Any]:
    """The CUDA runtime library torch uses (ctypes), when it is a shared library this process
    has mapped; else None."""
    path = loaded_library("libcudart.so", maps)
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)  # already loaded: the same handle, the same runtime state
        lib.cudaStreamCreateWithPriority.restype = ctypes.c_int
        lib.cudaStreamCreateWithPriority.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_int]
    except (OSError, AttributeError) as exc:
        log.debug("ssdtrain: %s: %s", path, exc)
        return None
    return lib


class NullStreams(StreamOps):
    """Streams, events and copies that do nothing but count their calls: what
    ``ssdtrain core-bench --gpu-path`` runs the GPU data path with on a CPU, so that what it
    times is this package's Python on that path (staging, events, bookkeeping), not CUDA, and
    ``calls`` says how many stream, event and copy calls each record costs. Events complete
    at once; copies move nothing (the bytes that come back are not the ones that went)."""

    def __init__(self) -> None:
        self.calls = 0
        self._stream = _NullStream(self)
        self._arena = torch.empty(0, dtype=torch.uint8)

    def current_stream(self, device: torch.device) -> Any:
        self.calls += 1
        return self._stream

    def new_stream(self, device: torch.device) -> Any:
        return _NullStream(self)

    def new_event(self) -> Any:
        self.calls += 1
        return _NullEvent(self)

    def timing_event(self) -> Any:
        return _NullEvent(self)

    def use(self, stream: Any) -> ContextManager:
        self.calls += 1
        return _NULL_CONTEXT

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.calls += 1

    def compact(self, t: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return t.contiguous()

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        self.calls += 1

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Device memory as a caching allocator hands it out, without the CPU allocator's cost
        (a 256 KiB ``torch.empty`` on a CPU is a fresh mapping, page faults and all): every
        tensor is a view of one arena, whose bytes nobody reads here."""
        nbytes = numel * dtype.itemsize
        if self._arena.numel() < nbytes:
            self._arena = torch.empty(max(nbytes, 2 * self._arena.numel()), dtype=torch.uint8)
        return self._arena[:nbytes].view(dtype)

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        from ..io.slab_engine import aligned_buffer  # page-aligned, as cudaHostAlloc's memory is

        return aligned_buffer(nbytes)


class _NullStream:
    __slots__ = ("ops",)

    def __init__(self, ops: NullStreams) -> None:
        self.ops = ops

    def wait_event(self, event: Any) -> None:
        self.ops.calls += 1


class _NullEvent:
    __slots__ = ("ops",)

    def __init__(self, ops: NullStreams) -> None:
        self.ops = ops

    def record(self, stream: Any = None) -> None:
        self.ops.calls += 1

    def synchronize(self) -> None:
        self.ops.calls += 1

    def query(self) -> bool:
        self.ops.calls += 1
        return True

    def elapsed_time(self, end: Any) -> float:
        return 0.0


_NULL_CONTEXT = contextlib.nullcontext()  # reusable: enters and exits as often as asked
