"""Slab files: one preallocated file per root, carved into extents.

Why these choices:
- One slab per root with an extent allocator (``extents.ExtentAllocator``): no file creation and
  no metadata update in the hot path; extents are reused as soon as a tensor is released, and
  the file is removed at the end of every step.
- Space is reserved with ``posix_fallocate`` by the IO thread about to write past the reserved
  end (never the training thread). ``lock`` guards the file and its reservation, not the
  allocator, so a fallocate holds up no one but writers that need it.
- A step's first reservation takes what the last step reached (``expected``) at once, and only
  past that ``GROW_BYTES`` at a time. Why: ext4's fallocate waits for every direct write in
  flight on the file to finish (``inode_dio_wait``) and new ones wait for it, so each growth in
  the middle of a step drains the drive's queue (measured: 30-60 ms inside each 256 MiB
  fallocate while four 8 MiB writes were in flight, 0.3 ms on an idle file). At the step's
  first write nothing is in flight yet, so from the second step on a step of the same size
  drains nothing.
- A failed reservation gives back what it got (ext4 keeps the blocks of a failed fallocate),
  then reserves exactly what is needed for the rest of the step: a slab never takes the last
  free bytes of a drive from the other users of the node.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from typing import Callable, Optional

from .base import EngineError
from .extents import ExtentAllocator
from .dirfd import vanished_text
from .layout import RankDir, free_bytes

log = logging.getLogger(__name__)

SLAB_NAME = "slab.bin"
GROW_BYTES = 256 << 20  # reserve the slab in steps of this size (fallocate: about 1 us per MiB)


class Slab:
    """One root's slab file: its descriptor, extent allocator and reserved size.

    ``direct`` is 'prefer' (O_DIRECT, else buffered IO, said once), 'require' (O_DIRECT or an
    error: DeepNVMe opens the file with it) or 'off' (kvikio opens its own descriptor).
    ``lock`` guards the file and its reservation, not the allocator (which has its own lock):
    an IO thread may hold it for a fallocate without holding up the training thread.
    The file is created and removed (every step) relative to the rank directory's held
    descriptor (``layout.RankDir``), never by path: ``path`` only names it.
    """

    def __init__(self, directory: RankDir, direct: str = "prefer",
                 on_open: Optional[Callable[["Slab"], None]] = None) -> None:
        self._rank_dir = directory
        self.dir = directory.path
        self.path = os.path.join(self.dir, SLAB_NAME)
        self.alloc = ExtentAllocator()
        self.lock = threading.Lock()
        self.fd: Optional[int] = None
        self.direct = direct != "off"
        self._mode = direct
        self._on_open = on_open
        self.handle: object = None  # what on_open attached (gds: a kvikio CuFile)
        self.reserved = 0
        self.tight = False  # the disk was full this step: reserve exactly, not GROW_BYTES ahead
        self.expected = 0
        """Bytes the last step reached in this slab: the step's first reservation takes them."""

    def ensure_open(self) -> int:
        if self.fd is None:
            flags = os.O_RDWR | (os.O_DIRECT if self._mode != "off" else 0)
            try:
                self.fd = self._rank_dir.open_file(SLAB_NAME, flags)
            except OSError as exc:
                if exc.errno != errno.EINVAL or self._mode == "off":
                    raise EngineError(f"cannot create {self.path}: {exc.strerror}"
                                      f"{_why(self.dir, exc)}") from exc
                self._rank_dir.unlink(SLAB_NAME)
                if self._mode == "require":
                    raise EngineError(f"the filesystem of {self.dir} refuses O_DIRECT, which the aio "
                                      f"engine needs; use engine='posix' there (it falls back to "
                                      f"buffered IO) or a directory on a local SSD") from exc
                self.fd = self._rank_dir.open_file(SLAB_NAME, os.O_RDWR)
                self.direct = False
                log.warning("O_DIRECT refused on %s; using buffered IO with FADV_DONTNEED "
                            "(reads may be served by the page cache)", self.dir)
            if self._on_open is not None:
                self._on_open(self)
        return self.fd

    @property
    def proc_path(self) -> str:
        """A path to the open file itself, for libraries that open by name (DeepNVMe's reads,
        kvikio): /proc/self/fd/N reaches this file even if its name was taken over."""
        return f"/proc/self/fd/{self.ensure_open()}"

    def ensure_reserved(self, end: int) -> None:
        """IO thread: make sure the file has space up to ``end`` before writing there.

        Raises EngineError (its cause an OSError, ENOSPC when the disk is full)."""
        if end <= self.reserved:
            return
        with self.lock:
            try:
                self._reserve(end)
            except OSError as exc:
                raise EngineError(f"cannot reserve {end - self.reserved} bytes in {self.path}: "
                                  f"{exc.strerror or exc} ({_free_text(self.dir)} free in {self.dir})"
                                  ) from exc

    def _reserve(self, end: int) -> None:
        if end <= self.reserved:
            return
        fd = self.ensure_open()
        new = end if self.tight else max(end, self.reserved + GROW_BYTES, self.expected)
        try:
            os.posix_fallocate(fd, self.reserved, new - self.reserved)
        except OSError as exc:
            # A failed fallocate may keep the blocks it got (ext4 does: the slab would take
            # every free byte of the disk from other users): give them back, then reserve
            # exactly what is needed, and only that for the rest of the step.
            os.ftruncate(fd, self.reserved)
            if exc.errno != errno.ENOSPC or new == end:
                raise
            self.tight = True
            try:
                os.posix_fallocate(fd, self.reserved, end - self.reserved)
            except OSError:
                os.ftruncate(fd, self.reserved)
                raise
            new = end
        self.reserved = new

    def end_step(self) -> int:
        """Remove the file (no IO may be pending on it); the next step's first reservation
        takes what this one reached, which is returned."""
        peak = self.alloc.size
        self.drop()
        self.expected = peak
        return peak

    def drop(self) -> None:
        """Remove the file (no IO may be pending on it)."""
        with self.lock:
            if self.handle is not None:
                self.handle.close()
                self.handle = None
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None
                try:
                    self._rank_dir.unlink(SLAB_NAME)
                except OSError as exc:  # read-only now: the next create says so; close goes on
                    log.warning("ssdtrain: cannot remove %s: %s", self.path, vanished_text(self.dir, exc))
            self.alloc.reset()
            self.reserved = 0
            self.tight = False


def _why(directory: str, exc: OSError) -> str:
    """The likely cause of a failed create, for a directory gone or read-only."""
    if exc.errno in (errno.ENOENT, errno.EROFS, errno.ESTALE):
        return f" ({vanished_text(directory, exc)})"
    return ""


def _free_text(directory: str) -> str:
    try:
        return f"{free_bytes(directory) / 2**20:.1f} MiB"
    except OSError:
        return "unknown space"
