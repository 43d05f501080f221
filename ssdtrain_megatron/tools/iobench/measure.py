"""The measurements behind ``ssdtrain io-bench``: one segment of the drive's own limit, and
one step of an engine.

A segment writes a number of bytes into fresh space and reads them back, timed each way; the
schedule that sets segments of both sides side by side is ``rounds.py``.

- ``BaselineSide`` is what fio would report for the device: a new O_DIRECT file preallocated
  (before the clock starts) for each segment, several threads each keeping one large
  pwrite/pread in flight, no copies; the file is removed after, as the engine's slab is.
  ``raw_baseline`` is one such segment (``doctor --node-profile`` uses it).
- ``EngineSide`` (engine_side.py) is an engine as a training job uses it from its second
  step on: built, one untimed step, then one step per segment through its public interface,
  with at most ``max_inflight_bytes`` in flight as the offloader would: the tensors written,
  read back, a sample read again and compared bitwise, released, and ``end_step`` (the slab
  removed). So each step writes into a new slab in fresh space, as every training step does,
  and its one reservation (io/slab.py) is inside the timed write.
- ``BenchMemory`` is the memory both sides move the bytes from and into.
"""

from __future__ import annotations

import dataclasses
import errno
import mmap
import os
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

from ...io.layout import ALIGN, align_up
from ..cli_types import progress as progress_bar


MiB = 1 << 20
GiB = 1 << 30
GB = 1e9
BASELINE_BLOCK = 8 * MiB
BASELINE_THREADS = 8
SOURCES = 4  # distinct source tensors at least, so a misplaced extent shows up in the verification


class BenchError(RuntimeError):
    """The benchmark could not measure something, or read back wrong bytes."""


class Progress:
    """Progress on stderr: lines (``say``) and, while an engine writes or reads, a tqdm bar
    with its rate and time left (``tick``; silent when stderr is not a terminal); nothing at
    all when disabled (``--quiet``)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._bar = None
        self._phase: Optional[str] = None

    def say(self, msg: str) -> None:
        if self.enabled:
            text = f"[io-bench] {msg}"
            if self._bar is not None and not self._bar.disable:
                self._bar.write(text, file=sys.stderr)
            else:
                print(text, file=sys.stderr, flush=True)

    def tick(self, phase: str, done: int, total: int, unit_bytes: int = 1) -> None:
        """``done`` of ``total`` items of ``unit_bytes`` each are through ``phase``."""
        if not self.enabled:
            return
        if phase != self._phase:
            self.close()
            self._bar = progress_bar(total * unit_bytes, desc=phase, unit="B", unit_scale=True,
                                     unit_divisor=1000)
            self._phase = phase
        self._bar.update(done * unit_bytes - self._bar.n)
        if done >= total:
            self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self._bar, self._phase = None, None


# -- O_DIRECT files and threads -----------------------------------------------------------


def _open_direct(path: str) -> Tuple[int, bool]:
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        return os.open(path, flags | os.O_DIRECT, 0o600), True
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return os.open(path, flags, 0o600), False


def _run_threads(n: int, target: Callable[[int], None]) -> float:
    """Run ``target(i)`` on ``n`` threads; re-raise the first error; return wall seconds."""
    errors: List[BaseException] = []

    def wrap(i: int) -> None:
        try:
            target(i)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return elapsed


class _Blocks:
    """A shared cursor over (item, offset, length) work, taken by several threads."""

    def __init__(self, items: List[Tuple[int, int, int]]) -> None:
        self._items = items
        self._next = 0
        self._lock = threading.Lock()

    def take(self) -> Optional[Tuple[int, int, int]]:
        with self._lock:
            if self._next == len(self._items):
                return None
            self._next += 1
            return self._items[self._next - 1]


def _buffers(n: int, size: int) -> List[mmap.mmap]:
    bufs = []
    for _ in range(n):
        b = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
        b.write(os.urandom(size))
        bufs.append(b)
    return bufs


def _do(op: str, fd: int, mv: memoryview, offset: int, path: str) -> None:
    done = os.pwrite(fd, mv, offset) if op == "write" else os.preadv(fd, [mv], offset)
    if done != len(mv):
        raise BenchError(f"short {op} on {path} at offset {offset}: {done} of {len(mv)} bytes")


# -- what a segment measured ---------------------------------------------------------------


@dataclasses.dataclass
class Segment:
    """Bytes one side wrote (and read back) in one segment, or in several added up, and the
    seconds each way. The CPU figures are the engine's (0 for the baseline): the calling
    (training) thread's CPU time, the whole process's (IO threads included), and the calling
    thread's CPU time inside the ``write``/``read`` calls of ``calls`` tensors."""

    nbytes: int = 0
    write_s: float = 0.0
    read_s: float = 0.0
    write_cpu_s: float = 0.0
    read_cpu_s: float = 0.0
    write_proc_s: float = 0.0
    read_proc_s: float = 0.0
    write_call_s: float = 0.0
    read_call_s: float = 0.0
    calls: int = 0

    def __add__(self, other: "Segment") -> "Segment":
        return Segment(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def gbps(self, op: str) -> float:
        """Bytes over seconds, summed: a slow segment weighs by the time it took."""
        return self.nbytes / max(getattr(self, f"{op}_s"), 1e-12) / GB

    def engine_figures(self) -> Dict[str, float]:
        """What the report gives per engine, besides GB/s and the ratios."""
        gb = self.nbytes / GB
        out: Dict[str, float] = {}
        for op in ("write", "read"):
            out[f"{op}_cpu_s_per_gb"] = getattr(self, f"{op}_cpu_s") / gb
            out[f"{op}_gb_per_core_s"] = gb / max(getattr(self, f"{op}_proc_s"), 1e-9)
            out[f"{op}_call_us"] = getattr(self, f"{op}_call_s") / max(self.calls, 1) * 1e6
        return out


# -- the memory both sides move bytes from and into -----------------------------------------


class BenchMemory:
    """Host memory that the engine's tensors and the baseline's requests share: ``src`` (random
    bytes, written from) and ``dst`` (zeroed, read into), each page-aligned.

    Why shared: a direct IO request takes at most ``max_segments`` runs of physically
    contiguous pages (254 on a virtio disk), so how large the requests reaching the drive are
    depends on how the kernel happened to lay out the memory, not on the program. On this
    project's VM, buffers of three allocations in one process gave 512 KiB, 2 MiB and 4 MiB
    write requests and 0.43, 0.95 and 1.4 GB/s, each the same every time it was used. So the
    baseline moves each block from and into the memory the engine uses for the same bytes of
    its segment (``window``): tensor i is written from source ``i % n_sources`` and read into
    out ``i % n_outs``, and the baseline's block at file offset ``off`` from ``src`` at
    ``off`` modulo the sources' length (likewise for reads)."""

    def __init__(self, tensor_bytes: int, n_sources: int, n_outs: int,
                 threads: int = BASELINE_THREADS, block: int = BASELINE_BLOCK) -> None:
        import torch

        from ...io.slab_engine import aligned_buffer

        self.tensor_bytes, self.threads, self.block = tensor_bytes, threads, block
        self.n_sources, self.n_outs = n_sources, n_outs
        # A block past the tensors, so that a window that starts in the last one fits.
        self.src = aligned_buffer(n_sources * tensor_bytes + block)
        self.src.random_(0, 256, generator=torch.Generator().manual_seed(0))
        self.dst = aligned_buffer(n_outs * tensor_bytes + block)
        self.dst.zero_()  # faulted in, so reads measure the IO and not first touches
        self._views = {"write": memoryview(self.src.numpy()), "read": memoryview(self.dst.numpy())}

    def sources(self) -> list:
        """The engine's source tensors: distinct random bytes, back to back in ``src``."""
        size = self.tensor_bytes
        return [self.src[i * size:(i + 1) * size] for i in range(self.n_sources)]

    def outs(self) -> list:
        size = self.tensor_bytes
        return [self.dst[i * size:(i + 1) * size] for i in range(self.n_outs)]

    def window(self, op: str, offset: int, length: int) -> memoryview:
        """The baseline's buffer for ``length`` bytes at file ``offset``: where the engine's
        segment keeps those bytes, rounded down to a page (O_DIRECT needs it)."""
        start = offset % ((self.n_sources if op == "write" else self.n_outs) * self.tensor_bytes)
        start -= start % ALIGN
        return self._views[op][start:start + length]

    def close(self) -> None:
        for mv in self._views.values():
            mv.release()


# -- raw baseline ----------------------------------------------------------------------------


class BaselineSide:
    """The drive's limit, a segment at a time: a new O_DIRECT file preallocated before the
    clock starts, written then read back sequentially in ``block``-byte requests from
    ``threads`` threads (the last request shorter when the segment is not a whole number of
    blocks), then removed. Its buffers are windows of ``memory`` (the engine's, see
    ``BenchMemory``), or its own. ``direct`` is False once a filesystem refused O_DIRECT
    (buffered IO with fdatasync and fadvise(DONTNEED) is used there)."""

    def __init__(self, memory: Optional[BenchMemory] = None, threads: int = BASELINE_THREADS,
                 block: int = BASELINE_BLOCK) -> None:
        self._memory = memory
        if memory is not None:
            threads, block = memory.threads, memory.block
        self._own = [] if memory is not None else _buffers(threads, block)
        self.threads, self.block = threads, block
        self.direct = True

    def _buffer(self, op: str, thread: int, offset: int, length: int) -> memoryview:
        if self._memory is not None:
            return self._memory.window(op, offset, length)
        return memoryview(self._own[thread])[:length]

    def segment(self, directory: str, nbytes: int) -> Segment:
        nbytes = align_up(nbytes, ALIGN)
        path = os.path.join(directory, "baseline.bin")
        fd, direct = _open_direct(path)
        self.direct = self.direct and direct
        block = self.block
        try:
            os.posix_fallocate(fd, 0, nbytes)
            seconds = {}
            for op in ("write", "read"):
                work = _Blocks([(0, off, min(block, nbytes - off)) for off in range(0, nbytes, block)])

                def worker(i: int, op: str = op, work: _Blocks = work) -> None:
                    while (item := work.take()) is not None:
                        _, off, length = item
                        if not direct and op == "read":
                            os.posix_fadvise(fd, off, length, os.POSIX_FADV_DONTNEED)
                        with self._buffer(op, i, off, length) as mv:
                            _do(op, fd, mv, off, path)
                        if not direct and op == "write":
                            os.fdatasync(fd)
                            os.posix_fadvise(fd, off, length, os.POSIX_FADV_DONTNEED)

                seconds[op] = _run_threads(self.threads, worker)
            return Segment(nbytes, seconds["write"], seconds["read"])
        finally:
            os.close(fd)
            os.unlink(path)

    def close(self) -> None:
        for b in self._own:
            b.close()


def raw_baseline(directory: str, total: int, threads: int = BASELINE_THREADS,
                 block: int = BASELINE_BLOCK) -> Dict[str, object]:
    """One baseline segment of ``total`` bytes (rounded up to ``block``): the device's limit."""
    side = BaselineSide(threads=threads, block=block)
    try:
        got = side.segment(directory, align_up(total, block))
        return {"direct": side.direct, "write_gbps": got.gbps("write"), "read_gbps": got.gbps("read")}
    finally:
        side.close()
