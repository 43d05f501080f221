"""How a staged engine's IO threads move a chunk between its tensor and the file (posix, aio).

:class:`ChunkStaging` is an object each staged engine (``slab_engine.py``) owns: it knows the
chunk size, the alignments and the checksum setting, and counts which way the bytes went; the
engine hands it each run (``requests.Run``) before and after the system call.

Why these choices:
- O_DIRECT wants every piece of memory handed to one system call to start on, and be a
  multiple of, the device's direct-IO granularity (``dio_align``: 512 bytes on most devices,
  probed by the posix engine; 4096 where that is refused), and the file offset to be aligned.
  A tensor from the C allocator starts 64 bytes past a page (glibc) and ends anywhere, so
  copying every chunk through a page-aligned bounce buffer cost a memcpy each way of every
  byte: on a CPU training device, where the tensor already is host memory, that was about
  half of the IO threads' CPU in the bench.
- Instead, a chunk is stored ``shift`` bytes into its extent, ``shift`` being its memory
  address modulo ``dio_align`` (``Extent.shift``; the posix engine sets it when it places a
  write). Memory address and file position are then congruent, and the chunk is moved in
  three pieces: its head (up to the first aligned address) and its tail (after the last
  aligned one) through the bounce buffer, padded with zeros there, and everything between in
  place, by the kernel. A restored tensor has the address residue its original had
  (record.py, modulo 512), so reads of it go in place too; a read whose target has another
  residue goes through the bounce buffer, as every chunk of the aio engine does (shift 0).
- Writes move in place only from page-aligned memory: the GPU path's pinned staging blocks
  and the engine's own buffers, mapped once and reused. A CPU tensor's chunk (memory autograd
  allocated moments ago, 64 bytes past a page) is copied whole into the bounce buffer, at its
  shift, so that its read still goes in place. How large a direct IO request reaching the
  drive is depends on how physically contiguous its memory is (tools/iobench/measure.py), and
  fresh activations are not: training the bench's model at micro-batch 4 on this project's
  VM, the IO threads wrote them in place at 0.26-0.43 GB/s and through the bounce buffer at
  0.51-0.64 GB/s, so in place the writes lagged the forward and stayed resident (offload's
  peak 0.68-0.74 of keep's, against 0.385).
  Reads land in the restore pool's reused memory (cache/restore_pool.py) and stay in place.
- Each chunk's place in the slab (``Extent.room``) has room for any shift: its length plus
  ``dio_align - 1``, padded to the page (a page more than before for most chunks, 0.05% of
  an 8 MiB chunk). Not the shift it got: the space a step needs must not depend on where its
  tensors happened to be in memory (the free-space check goes by it). The IO covers a
  run's places up to its last chunk's bytes (``_span``), so chunks placed back to back still
  merge into one system call, and a page-aligned chunk (GPU staging) moves no spare page.
- Nothing but the chunk's own bytes and zeros reaches the disk, and a read writes nothing of
  the target's memory outside the chunk's bytes: in place is only ever the chunk's middle.
- Copies are by address (io/hostmem.py): no torch call per chunk.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from typing import Callable, List, Optional, Sequence

from .base import EngineError
from .checksum import ALGORITHM, checksum
from .gpu_wait import wait_for
from .hostmem import buffer_at, memmove, memset
from .extents import Extent
from .layout import ALIGN, align_up, open_private
from .requests import Request, Run


class ChunkStaging:
    """Bounce-buffer staging and in-place chunks (see the module docstring).

    Args:
        chunk_bytes: the engine's ``chunk_bytes`` (chunk ``i`` of a request starts at byte
            ``i * chunk_bytes`` of its tensor).
        align: padding and file-offset alignment of every chunk (what O_DIRECT needs; aio:
            times its intra-op parallelism).
        checksum: keep a CRC32C per chunk and verify it on reads (``verify='crc32c'``).
        name: the engine's name, for error messages.

    Until :meth:`move_in_place` every chunk goes through the bounce buffer (aio, gds).
    ``zero_copy_bytes`` / ``bounced_bytes`` count, from any IO thread, the bytes moved in
    place and those copied through a bounce buffer.
    """

    def __init__(self, chunk_bytes: int, align: int = ALIGN, checksum: bool = False, name: str = "") -> None:
        self.chunk_bytes = chunk_bytes
        self.align = align
        self.dio_align = align
        """The direct-IO granularity of memory pieces (posix probes it: 512 on most drives)."""
        self._zero_copy = False
        self._checksum = checksum
        self._name = name
        self._lock = threading.Lock()  # the two counters, updated by several IO threads
        self.zero_copy_bytes = 0
        self.bounced_bytes = 0

    def move_in_place(self, dio_align: int) -> None:
        """Host chunks move in place from now on (posix), at ``dio_align`` granularity."""
        self._zero_copy = True
        self.dio_align = dio_align

    def padded(self, length: int) -> int:
        return align_up(max(length, 1), self.align)

    def shift_for(self, req: Request) -> Optional[int]:
        """Where a write's chunks start in their extents: their address modulo the direct-IO
        granularity, when they can be moved in place (host memory, posix); else None."""
        if not self._zero_copy or req.tensor is None or req.tensor.device.type != "cpu":
            return None
        return req.address() % self.dio_align

    def span(self, op: Run, j: int, ext: Extent) -> int:
        """Bytes of the run's IO in part ``j``'s place: all of it but for the last part, whose
        bytes the run ends with (padded)."""
        return ext.room if j < len(op.parts) - 1 else self.padded(ext.shift + ext.length)

    def head(self, ext: Extent) -> int:
        """Bytes of the extent before its in-place middle (the shift, up to an aligned offset)."""
        return align_up(ext.shift, self.dio_align) if ext.shift else 0

    def in_place(self, req: Request, i: int, ext: Extent) -> Optional[memoryview]:
        """The middle of chunk ``i`` in the request's own memory, when the IO can use it in
        place: host memory at the residue the extent was stored at, and at least one aligned
        block of it. None: the whole chunk goes through the bounce buffer."""
        if not self._zero_copy or req.tensor is None or req.error is not None or not ext.length:
            return None
        if req.tensor.device.type != "cpu":
            return None
        addr, g = self._chunk_address(req, i), self.dio_align
        if addr % g != ext.shift:
            return None
        head = self.head(ext)
        body = (ext.shift + ext.length) // g * g - head
        return buffer_at(addr + head - ext.shift, body) if body > 0 else None

    def _chunk_address(self, req: Request, i: int) -> int:
        """Where chunk ``i`` of the request's own (host) memory starts."""
        return req.address() + i * self.chunk_bytes

    def count_copies(self, op: Run) -> None:
        """After a successful run: how many of its bytes went in place, how many were bounced."""
        direct = sum(len(m) for m in op.direct if m is not None) if op.direct is not None else 0
        with self._lock:
            self.zero_copy_bytes += direct
            self.bounced_bytes += op.nbytes - direct

    def fill(self, op: Run) -> None:
        """Write side, before the IO: what of each chunk goes through the bounce buffer (all of
        it, or its head and tail), in place there with zeros around it."""
        direct: List[Optional[memoryview]] = []
        base = op.buf.data_ptr() - op.offset
        for j, (req, i) in enumerate(op.parts):
            ext = req.extents[i]
            n, at, s = ext.length, base + ext.offset, ext.shift
            span = self.span(op, j, ext)
            if req.error is not None:  # another chunk of this tensor failed: write zeros
                memset(at, 0, span)
                direct.append(None)
                continue
            if req.ready_event is not None:
                wait_for(req.ready_event)
            src = self._chunk_address(req, i)
            # In place only from page-aligned memory (see the module docstring): a CPU
            # tensor's chunk is copied whole, at its shift, so its read still goes in place.
            body = self.in_place(req, i, ext) if src % ALIGN == 0 else None
            direct.append(body)
            lo, hi = (self.head(ext), self.head(ext) + len(body)) if body is not None else (s + n, s + n)
            # [0, s) zeros, [s, lo) bytes, [lo, hi) in place, [hi, s + n) bytes, then zeros
            memset(at, 0, s)
            if lo > s:
                memmove(at + s, src, lo - s)
            if s + n > hi:
                memmove(at + hi, src + hi - s, s + n - hi)
            memset(at + s + n, 0, span - s - n)  # the padding reaches the disk: never stale memory
            if self._checksum:
                ext.crc = checksum(buffer_at(src, n)) if n else 0
        op.direct = direct if any(m is not None for m in direct) else None

    def drain(self, op: Run, paths: Sequence[str],
              finish: Callable[[Request, int, Optional[BaseException]], None]) -> None:
        """Read side, after the IO: per chunk, copy what went through the bounce buffer out (by
        address), verify the checksum, and complete it with ``finish`` (the engine's: a bad
        chunk fails its own tensor only). ``paths``: the slab file of each root (messages)."""
        base = op.buf.data_ptr() - op.offset
        for j, (req, i) in enumerate(op.parts):
            exc: Optional[BaseException] = op.failed.get(j)
            try:
                ext = req.extents[i]
                n, at, s = ext.length, base + ext.offset, ext.shift
                if exc is None and req.error is None and n:
                    self._copy_out(req, i, ext, at, op.direct[j] if op.direct is not None else None)
                    if self._checksum:
                        crc = checksum(buffer_at(self._chunk_address(req, i), n))
                        if crc != ext.crc:
                            raise EngineError(f"checksum mismatch reading {n} bytes from "
                                              f"{paths[ext.root]} at offset {ext.offset + s}: "
                                              f"stored {ALGORITHM} {ext.crc:#010x}, read {crc:#010x}")
            except BaseException as e:  # noqa: BLE001 - surfaced through the Future
                exc = as_engine_error(e, f"{self._name} read")
            finish(req, i, exc)

    def _copy_out(self, req: Request, i: int, ext: Extent, at: int, body: Optional[memoryview]) -> None:
        """The bytes of chunk ``i`` that came into the bounce buffer (at ``at``) go to the tensor."""
        n, s = ext.length, ext.shift
        dst = self._chunk_address(req, i)
        if body is None:
            if req.ready_event is not None:
                wait_for(req.ready_event)
            memmove(dst, at + s, n)
            return
        lo = self.head(ext)
        hi = lo + len(body)
        if lo > s:
            memmove(dst, at + s, lo - s)
        if s + n > hi:
            memmove(dst + hi - s, at + hi, s + n - hi)


DIO_PROBE = 512
"""The direct-IO granularity the posix engine tries first (the logical block of most drives)."""


def probe_dio_align(directory: str) -> int:
    """The granularity of O_DIRECT pieces of memory in ``directory``: ``DIO_PROBE`` when one
    write and one read of a page, made of a ``DIO_PROBE``-byte piece at a ``DIO_PROBE``-aligned
    (not page-aligned) address and the rest of the page, both pass; else ALIGN (a 4Kn drive,
    an older kernel). A filesystem that refuses O_DIRECT takes any (buffered IO): DIO_PROBE.
    The probe file is the engine's own (0600, in its rank directory) and is removed at once."""
    path = os.path.join(directory, "dio-probe.bin")
    try:
        fd = open_private(path, os.O_RDWR | os.O_DIRECT)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return DIO_PROBE
        raise
    mem = mmap.mmap(-1, 2 * ALIGN)
    view = memoryview(mem)
    try:
        pieces = [view[DIO_PROBE:2 * DIO_PROBE], view[2 * DIO_PROBE:ALIGN + DIO_PROBE]]
        ok = os.pwritev(fd, pieces, 0) == ALIGN and os.preadv(fd, pieces, 0) == ALIGN
    except OSError:
        ok = False
    finally:
        del pieces
        view.release()
        mem.close()
        os.close(fd)
        os.unlink(path)
    return DIO_PROBE if ok else ALIGN


def as_engine_error(exc: BaseException, what: str) -> BaseException:
    if isinstance(exc, EngineError):
        return exc
    wrapped = EngineError(f"{what} failed: {exc!r}")
    wrapped.__cause__ = exc
    return wrapped
