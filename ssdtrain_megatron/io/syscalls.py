"""The calls a disk engine makes to move bytes, in one object per engine (``engine._sys``).

Production engines use :data:`OS`, set once at construction: the os module's calls for posix,
DeepNVMe's submission and completion count for aio (its handle makes the system calls itself,
in C), kvikio's file handle for gds. A test puts a faulty one in front of it (tests/faulty.py),
so a fault runs each engine's own error path (the OSError of a pwritev, a refused DeepNVMe
submission, a failed kvikio call) and the engines carry no test hook.
"""

from __future__ import annotations

import os
from typing import Any, Sequence


def _iov_max() -> int:
    try:
        return max(16, os.sysconf("SC_IOV_MAX"))
    except (ValueError, OSError):
        return 1024  # Linux's UIO_MAXIOV


IOV_MAX = _iov_max()
"""Buffers one ``preadv``/``pwritev`` may take; more fail with EINVAL."""


class SysCalls:
    """One method per call an engine makes. The ``path`` arguments name the file for whoever
    stands in front (faults, traces); the real calls use the descriptor or handle."""

    # posix: vectored IO at an offset; returns the bytes moved or raises OSError.
    def pwritev(self, fd: int, buffers: Sequence[Any], offset: int, path: str) -> int:
        return os.pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: Sequence[Any], offset: int, path: str) -> int:
        return os.preadv(fd, buffers, offset)

    # aio: DeepNVMe's asynchronous submission (0: accepted) and its count of completed operations.
    # Its reads open a file by name: /proc/self/fd/N reopens the slab we hold, not whatever
    # now has the slab's name (layout.py: nothing of ours is reached by path after it is made).
    def aio_submit(self, handle: Any, writing: bool, stage: Any, fd: int, path: str, offset: int) -> int:
        if writing:
            return handle.async_pwrite(stage, fd, offset)
        return handle.async_pread(stage, f"/proc/self/fd/{fd}", offset)

    def aio_wait(self, handle: Any) -> int:
        return handle.wait()

    # gds: one kvikio call on the file's handle; returns its future (raises on failure).
    def gds_submit(self, handle: Any, writing: bool, buf: Any, nbytes: int, offset: int, path: str) -> Any:
        call = handle.pwrite if writing else handle.pread
        return call(buf, nbytes, offset)


OS = SysCalls()
"""What production engines use."""
