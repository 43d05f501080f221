"""The checksum kept per written chunk when ``verify: crc32c``: CRC32C in hardware.

Chunks are checksummed on the IO threads, right after the bytes are staged for a write and
right after a read lands, so the checksum's cost adds to every byte's trip to the drive and
back. zlib's CRC32 is a table-driven loop (about 250 µs per MiB here, per pass); CRC32C has
its own CPU instruction (SSE 4.2 on x86, the CRC extension on ARMv8), which the ``crc32c``
package uses, an order of magnitude faster. It also releases the GIL for large buffers, as
zlib does, so that the training thread runs on while an IO thread checksums.

Without the package (an install with ``--no-deps``), zlib's CRC32 is used instead, and the
first checksum logs a warning saying so once. Either way a chunk is checked on read against
the same function that computed it on write, within one process.
"""

from __future__ import annotations

import functools
import logging
import zlib
from typing import Callable, Tuple

log = logging.getLogger(__name__)


def _pick() -> Tuple[str, Callable[[object], int], bool]:
    """(name, function, hardware?) of the best checksum importable here."""
    try:
        import crc32c  # noqa: PLC0415 - optional at import time, in install_requires
    except ImportError:
        return "crc32", zlib.crc32, False
    return "crc32c", crc32c.crc32c, bool(getattr(crc32c, "hardware_based", True))


ALGORITHM, _FUNCTION, HARDWARE = _pick()
"""The checksum this process uses: 'crc32c' (the ``crc32c`` package) or 'crc32' (zlib)."""

@functools.lru_cache(maxsize=None)
def _say_once() -> None:
    if ALGORITHM == "crc32":
        log.warning("ssdtrain: checksum: the crc32c package is not installed; using zlib's "
                    "CRC32, about 10x slower per byte (pip install crc32c)")
    elif not HARDWARE:
        log.warning("ssdtrain: checksum: this CPU has no CRC32C instruction; the crc32c "
                    "package computes it in software")


def checksum(data: object) -> int:
    """The checksum of a buffer (anything with the buffer protocol: bytes, memoryview, a
    contiguous numpy array), as an unsigned 32-bit int; :data:`ALGORITHM` names it. The first
    call says once, in a warning, when the checksum runs without the CPU's instruction."""
    _say_once()
    return _FUNCTION(data)


def describe() -> str:
    """One line for reports (``ssdtrain doctor``): which checksum and how it runs."""
    if ALGORITHM == "crc32":
        return "zlib CRC32 (software; pip install crc32c for the hardware CRC32C)"
    return "CRC32C, " + ("hardware instruction" if HARDWARE else "software (no CPU instruction)")
