"""How an IO thread waits for a CUDA event before it touches the memory the event guards.

Why:

- The first CUDA runtime call a thread makes binds it to its *current* device, which for a
  new thread is device 0, and creates device 0's context in this process if it has none: on a
  node with 8 GPUs every rank's IO threads would each put a context (hundreds of MiB) on GPU 0.
  So the event's own device is made current first (``torch.cuda.set_device`` is a no-op when
  it already is). The events the offloader hands over are created with blocking sync
  (cache/stream_ops.py), so the wait sleeps instead of spinning a core.
- While any thread captures a CUDA graph in ``capture_error_mode="global"`` (torch's
  default), CUDA refuses "potentially unsafe" calls, event queries and synchronisations among
  them, from *every* thread still in the default (global) interaction mode, and the refusal
  also invalidates that capture: an IO thread waiting for a copy event would fail its write
  and break the user's graph. The offloader never records an event inside a capture (the
  hooks and scope entry check for one, cache/hooks.py and cache/offloader.py), so the events
  an IO thread waits for were all recorded outside it, and the wait is safe; the thread says
  so by switching itself to the thread-local interaction mode around the wait
  (``cuThreadExchangeStreamCaptureMode``, push and pop), which lets a capture on another
  thread go on. Nothing else changes: a capture on the IO thread itself (there is none) would
  still be checked.

Events without a CUDA ``device`` (the tests' stand-ins) are just waited for, with the same
mode switch through :func:`capture_driver` (the tests replace it with a recording one).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from typing import Any, Iterator, Optional

import torch

from .cuda_libs import loaded_library

CAPTURE_MODE_THREAD_LOCAL = 1  # CU_STREAM_CAPTURE_MODE_THREAD_LOCAL


def wait_for(event: Any) -> None:
    """Block the calling (IO) thread until ``event`` completed, on the event's device, in the
    thread-local capture mode (module docstring)."""
    device = getattr(event, "device", None)
    if device is not None and getattr(device, "type", None) == "cuda":
        torch.cuda.set_device(device)
    with thread_local_capture_mode(capture_driver()):
        event.synchronize()


@contextlib.contextmanager
def thread_local_capture_mode(driver: Optional[Any]) -> Iterator[None]:
    """Inside the block the calling thread ignores captures made by other threads (CUDA's
    thread-local stream-capture interaction mode); the previous mode is restored after.
    ``driver``: the CUDA driver library (ctypes), or None (no CUDA: nothing to switch)."""
    if driver is None:
        yield
        return
    mode = ctypes.c_int(CAPTURE_MODE_THREAD_LOCAL)
    if driver.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode)) != 0:
        yield  # an old driver without the call: wait as before
        return
    try:
        yield
    finally:
        driver.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode))  # the previous mode back


@functools.lru_cache(maxsize=1)
def capture_driver() -> Optional[Any]:
    """The CUDA driver library this process loaded (ctypes), or None where it has none (a CPU
    machine, or CUDA not initialised yet: then no event of ours exists either). Looked up
    once: the driver, once loaded, stays."""
    path = loaded_library("libcuda.so")
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)  # already loaded: the same handle, the same per-thread state
        lib.cuThreadExchangeStreamCaptureMode.restype = ctypes.c_int
        lib.cuThreadExchangeStreamCaptureMode.argtypes = [ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    return lib
