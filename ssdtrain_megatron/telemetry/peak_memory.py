"""Peak memory of this process over a stretch of training, resettable between stretches.

On a GPU: ``torch.cuda.max_memory_allocated`` (reset with ``reset_peak_memory_stats``). On the
CPU (Linux): the resident-set high-water mark ``VmHWM`` of ``/proc/self/status``, which writing
``5`` to ``/proc/self/clear_refs`` resets to the current RSS.

Why ``malloc_trim`` before each reset: memory the C allocator has freed but not returned to the
kernel stays resident. When several runs take turns in one process (the benchmarks), the pages
one run's activations left in the heap would otherwise count in the next run's peak. The price:
the next step faults those pages in again, a cost a GPU's caching allocator does not have; an
emulated GPU node (``bench --node-emulation``) measures without it (``trim=False``), and its
RSS peak then includes what the other strategies left in the heap.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from typing import Optional

import torch

log = logging.getLogger(__name__)

_CLEAR_REFS = "/proc/self/clear_refs"
_STATUS = "/proc/self/status"
RESET_PEAK_RSS = b"5"
"""What /proc/self/clear_refs takes to reset the peak RSS (Linux >= 4.0)."""


class PeakMemory:
    """``reset()`` before a stretch, ``peak()`` (bytes, or None) after it.

    Args:
        device: the training device; CUDA devices use the CUDA allocator's statistics.
        trim: on the CPU, hand freed heap memory back to the kernel before each reset (see the
            module docstring).
    """

    def __init__(self, device: torch.device, trim: bool = True) -> None:
        self.device = torch.device(device)
        self.kind: Optional[str] = None
        """What ``peak()`` measures, in words; None when nothing can be measured here."""
        self._trim = None
        self.trim = trim
        if self.device.type == "cuda":
            self.kind = "CUDA max allocated"
            return
        try:
            with open(_CLEAR_REFS, "wb") as fh:
                fh.write(RESET_PEAK_RSS)
            self._read_hwm()
        except OSError as exc:
            log.warning("ssdtrain: peak process memory is not measurable here (resetting the RSS "
                        "high-water mark through %s failed: %s)", _CLEAR_REFS, exc)
            return
        self.kind = "RSS high-water mark"
        if not trim:
            self.kind += " (freed heap memory kept between steps: it includes what other runs left)"
        libc = ctypes.util.find_library("c")
        if libc:
            self._trim = getattr(ctypes.CDLL(libc), "malloc_trim", None)  # glibc only

    def reset(self) -> None:
        if self.kind is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        if self.trim and self._trim is not None:
            self._trim(0)
        with open(_CLEAR_REFS, "wb") as fh:
            fh.write(RESET_PEAK_RSS)

    def peak(self) -> Optional[int]:
        """Peak bytes since the last ``reset()``."""
        if self.kind is None:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device))
        return self._read_hwm()

    @staticmethod
    def _read_hwm() -> int:
        with open(_STATUS, encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    value, unit = line.split()[1:3]
                    if unit != "kB":
                        raise OSError(f"{_STATUS}: unexpected unit in {line.strip()!r}")
                    return int(value) * 1024
        raise OSError(f"{_STATUS} has no VmHWM line")
