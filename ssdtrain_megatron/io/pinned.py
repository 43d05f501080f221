"""Page-locked host memory of the size asked: anonymous mappings registered with CUDA.

Why: torch's caching host allocator (``pin_memory=True``) rounds every allocation up to a
power of two, so a 40 GB host pool pins 64 GiB and a 1 MiB + 4 KiB bounce buffer pins 2 MiB.
Pools that are allocated once and live for the job (the memory engine's pool, the pinned
staging pool, aio's bounce buffers) are instead an anonymous ``mmap`` (page-aligned, its
size rounded up to a page only) that ``cudaHostRegister`` page-locks: exactly what
:func:`pinned_size` says, which is what a RAM check must count. torch sees registered memory
as pinned (``is_pinned()``), so ``copy_(non_blocking=True)`` to and from it is a DMA.

The registration lasts as long as the memory: when the last tensor viewing it is freed,
``cudaHostUnregister`` runs (on whatever thread freed it; no lock is taken) and only then is
the mapping unmapped. Small or short-lived pinned memory (a staging overflow) still comes
from torch's allocator, which reuses it without registering again (a registration costs
about as much as pinning fresh memory, and synchronises the device).

Where ``cudaHostRegister`` is refused (a container without the right to lock memory, a low
``ulimit -l``), :func:`pin` does not stop the run: it clears the error the failed call left
as the thread's last CUDA error (the next kernel launch's check would report it as its own),
says once why and what to change, and takes the memory from torch's pinned allocator
(``cudaHostAlloc``, which the driver page-locks itself), counting what that really locks:
the next power of two (:func:`host_alloc_size`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import weakref
from typing import Any, Callable, Optional, Tuple

import torch

from .cuda_libs import loaded_library

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
CUDA_HOST_REGISTER_DEFAULT = 0  # cudaHostRegisterDefault
LIMIT_ADVICE = ("raise the locked-memory limit: `ulimit -l unlimited` (in a container: "
                "`docker run --ulimit memlock=-1`; under Slurm, PropagateResourceLimits)")


class RegistrationRefused(RuntimeError):
    """``cudaHostRegister`` refused to page-lock memory (the message has the size and cause;
    ``cause`` is CUDA's own words)."""

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


def pinned_size(nbytes: int) -> int:
    """The bytes :func:`pin_exact` page-locks for a request of ``nbytes`` (what RAM checks
    must count): ``nbytes`` rounded up to a page."""
    return (max(nbytes, 0) + PAGE - 1) // PAGE * PAGE


def pin_exact(nbytes: int, runtime: Optional[Any] = None) -> torch.Tensor:
    """``nbytes`` of page-locked host memory (uint8, page-aligned) pinning ``pinned_size(nbytes)``.

    ``runtime``: what ``torch.cuda.cudart()`` returns (tests pass a stand-in).

    Raises:
        RegistrationRefused: ``cudaHostRegister`` refused (the message has the size and the
            cause); the thread's last CUDA error is cleared.
        OSError: the mapping itself cannot be had.
    """
    size = pinned_size(nbytes)
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    rt = runtime if runtime is not None else torch.cuda.cudart()
    mm = mmap.mmap(-1, size)
    view = memoryview(mm)
    t = torch.frombuffer(view, dtype=torch.uint8)
    addr = t.data_ptr()
    err = rt.cudaHostRegister(addr, size, CUDA_HOST_REGISTER_DEFAULT)
    if int(err) != 0:
        why = _error_text(rt, err)
        clear_last_error(rt)
        del t
        view.release()
        mm.close()
        raise RegistrationRefused(f"cudaHostRegister of {size} bytes ({size / 2**20:.0f} MiB) failed: "
                                  f"{why}; lower the pool size, or {LIMIT_ADVICE}", why)
    # The tensor's storage holds ``view``; when it goes, unregister, then let the mapping go
    # (the finalizer's own reference to ``mm`` is the last one). It may run on any thread (an
    # IO thread dropping the last view): on this device, so that it creates no context on
    # GPU 0, and restoring the thread's device after.
    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    weakref.finalize(view, _unregister, rt, addr, mm, device)
    return t[:nbytes]


def pin(nbytes: int, runtime: Optional[Any] = None,
        fallback: Optional[Callable[[int], torch.Tensor]] = None) -> Tuple[torch.Tensor, int]:
    """``nbytes`` of page-locked host memory (uint8, page-aligned), and the bytes it really
    page-locks (what a RAM check must count): :func:`pin_exact`, or where the registration is
    refused, ``fallback`` (default: torch's pinned allocator), warned once per process.

    Raises:
        RuntimeError, MemoryError: the fallback could not allocate either.
        OSError: the mapping itself cannot be had.
    """
    try:
        return pin_exact(nbytes, runtime), pinned_size(nbytes)
    except RegistrationRefused as exc:
        refused = exc
        _say_refused_once(exc.cause)  # one warning per process (per cause), not per pool
    try:
        t = (fallback or torch_pinned)(nbytes + PAGE)
    except (RuntimeError, MemoryError) as exc:
        raise RuntimeError(f"{refused}; torch's pinned allocator failed too: {exc}") from exc
    start = (-t.data_ptr()) % PAGE  # page-aligned, as the mapping would be (O_DIRECT in place)
    return t[start:start + nbytes], host_alloc_size(nbytes + PAGE)


def torch_pinned(nbytes: int) -> torch.Tensor:
    """Page-locked memory from torch's caching host allocator (``cudaHostAlloc``)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def host_alloc_size(nbytes: int) -> int:
    """What torch's pinned allocator page-locks for ``nbytes``: the next power of two."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def pinned_cost(nbytes: int, registers: bool = True) -> int:
    """The host memory :func:`pin` locks for ``nbytes``: exact (a page rounding) where
    ``cudaHostRegister`` works, else torch's power of two (with the page of alignment slack)."""
    if nbytes <= 0:
        return 0
    return pinned_size(nbytes) if registers else host_alloc_size(nbytes + PAGE)


@functools.lru_cache(maxsize=None)
def _say_refused_once(why: str) -> None:
    log.warning("ssdtrain: cudaHostRegister refused to pin host memory (%s); using torch's pinned "
                "allocator instead, which locks the next power of two of each pool's size (counted "
                "as such). To pin exactly, %s", why, LIMIT_ADVICE)


def clear_last_error(rt: Any) -> None:
    """Reset the calling thread's last CUDA runtime error after a failed call we handled, so
    that the next launch check (``cudaGetLastError`` after a kernel) does not report it as
    its own. Through ``rt`` where it has the call, else the runtime library torch loaded."""
    fn = getattr(rt, "cudaGetLastError", None)
    if fn is None:
        path = loaded_library("libcudart.so")
        if path is None:
            log.debug("ssdtrain: no shared CUDA runtime mapped; the last CUDA error is not reset")
            return
        fn = ctypes.CDLL(path).cudaGetLastError
    fn()


def _unregister(rt: Any, addr: int, mm: mmap.mmap, device: Optional[int]) -> None:
    if device is None:
        rt.cudaHostUnregister(addr)
    else:
        with torch.cuda.device(device):
            rt.cudaHostUnregister(addr)
    del mm  # unmapped once nothing else refers to it (after the unregistration)


def _error_text(rt: Any, err: Any) -> str:
    try:
        return str(rt.cudaGetErrorString(err))
    except Exception:  # noqa: BLE001 - the number is still worth reporting
        return f"CUDA error {int(err)}"
