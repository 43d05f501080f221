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
"""

from __future__ import annotations

import mmap
import weakref
from typing import Any, Optional

import torch

PAGE = mmap.PAGESIZE
CUDA_HOST_REGISTER_DEFAULT = 0  # cudaHostRegisterDefault


def pinned_size(nbytes: int) -> int:
    """The bytes :func:`pin_exact` page-locks for a request of ``nbytes`` (what RAM checks
    must count): ``nbytes`` rounded up to a page."""
    return (max(nbytes, 0) + PAGE - 1) // PAGE * PAGE


def pin_exact(nbytes: int, runtime: Optional[Any] = None) -> torch.Tensor:
    """``nbytes`` of page-locked host memory (uint8, page-aligned) pinning ``pinned_size(nbytes)``.

    ``runtime``: what ``torch.cuda.cudart()`` returns (tests pass a stand-in).

    Raises:
        RuntimeError: ``cudaHostRegister`` refused (the message has the size and the cause).
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
        del t
        view.release()
        mm.close()
        raise RuntimeError(f"cudaHostRegister of {size} bytes ({size / 2**20:.0f} MiB) failed: "
                           f"{_error_text(rt, err)}; lower the pool size, or raise the locked-memory "
                           f"limit (ulimit -l)")
    # The tensor's storage holds ``view``; when it goes, unregister, then let the mapping go
    # (the finalizer's own reference to ``mm`` is the last one). It may run on any thread (an
    # IO thread dropping the last view): on this device, so that it creates no context on
    # GPU 0, and restoring the thread's device after.
    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    weakref.finalize(view, _unregister, rt, addr, mm, device)
    return t[:nbytes]


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
