"""The measurements behind ``ssdtrain io-bench``: the drive's own limit and one engine.

``raw_baseline`` is what fio would report for the device: one preallocated O_DIRECT file,
several threads each keeping one large pwrite/pread in flight, no copies (``layout_compare``,
one slab against one file per tensor, is in io_layout.py). ``bench_engine`` writes and reads
tensors through an engine's public interface, with at most ``max_inflight_bytes`` in flight as
the offloader would, and verifies every byte read back. ``io_bench`` runs them in rounds and
reports the ratios.
"""

from __future__ import annotations

import collections
import errno
import gc
import mmap
import os
import sys
import threading
import time
from typing import Callable, Deque, Dict, List, Optional, Tuple

from .cli_types import progress as progress_bar
from ..config import OffloadConfig
from ..io.layout import align_up


MiB = 1 << 20
GiB = 1 << 30
GB = 1e9
BASELINE_BLOCK = 8 * MiB
BASELINE_THREADS = 8
SOURCES = 4  # distinct source tensors, so a misplaced extent shows up in the verification


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


# -- raw baseline ----------------------------------------------------------------------------


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


def raw_baseline(directory: str, total: int, threads: int = BASELINE_THREADS,
                 block: int = BASELINE_BLOCK) -> Dict[str, object]:
    """Sequential O_DIRECT write then read of ``total`` bytes in ``block``-byte requests from
    ``threads`` threads on one preallocated file: the device's limit."""
    total = align_up(total, block)
    path = os.path.join(directory, "baseline.bin")
    fd, direct = _open_direct(path)
    bufs = _buffers(threads, block)
    try:
        os.posix_fallocate(fd, 0, total)
        out: Dict[str, object] = {"direct": direct}
        for op in ("write", "read"):
            work = _Blocks([(0, off, block) for off in range(0, total, block)])

            def worker(i: int, op: str = op, work: _Blocks = work) -> None:
                with memoryview(bufs[i]) as mv:
                    while (item := work.take()) is not None:
                        if not direct and op == "read":
                            os.posix_fadvise(fd, item[1], block, os.POSIX_FADV_DONTNEED)
                        _do(op, fd, mv, item[1], path)
                        if not direct and op == "write":
                            os.fdatasync(fd)
                            os.posix_fadvise(fd, item[1], block, os.POSIX_FADV_DONTNEED)

            out[f"{op}_gbps"] = total / _run_threads(threads, worker) / GB
        return out
    finally:
        os.close(fd)
        os.unlink(path)
        for b in bufs:
            b.close()


# -- engines -------------------------------------------------------------------------------


def contender_label(engine: str, verify: str) -> str:
    """How the report names an engine measured with ``verify``: 'posix', 'posix+crc32c'."""
    return engine if verify == "off" else f"{engine}+{verify}"


def bench_engine(name: str, directory: str, n_tensors: int, tensor_bytes: int,
                 progress: Progress, base: Optional[OffloadConfig] = None) -> Dict[str, object]:
    """Write then read ``n_tensors`` tensors through engine ``name``; verify a sample bitwise.
    ``{op}_gb_per_core_s``: GB per CPU-second of the process, IO threads included."""
    import torch

    from ..io import make_engine

    total = n_tensors * tensor_bytes
    overrides: Dict[str, object] = {"dirs": [directory], "engine": name, "job": f"iobench{os.getpid()}"}
    if name == "memory":
        overrides["host_memory_bytes"] = n_tensors * align_up(max(tensor_bytes, 1), 512) + MiB
    elif name == "tiered":
        overrides["host_memory_bytes"] = total // 2  # half in memory, half spilled to SSD
    cfg = (base or OffloadConfig()).replace(**overrides)
    label = contender_label(name, cfg.verify)
    window = max(cfg.max_inflight_bytes, 2 * tensor_bytes)
    gen = torch.Generator().manual_seed(0)
    sources = [torch.randint(0, 256, (tensor_bytes,), dtype=torch.uint8, generator=gen)
               for _ in range(min(SOURCES, n_tensors))]
    # Zero-filled, so the read pass measures the engine and not page faults on fresh buffers.
    outs = [torch.zeros(tensor_bytes, dtype=torch.uint8)
            for _ in range(min(n_tensors, max(2, window // max(tensor_bytes, 1))))]

    engine = make_engine(cfg)
    # The heap that exists before measuring is frozen, as a latency-minded training loop does,
    # so a full collection of torch's objects is not billed to the call that happened to
    # trigger it; what the engine allocates is still collected (and counted) as usual.
    gc.collect()
    gc.freeze()
    try:
        result: Dict[str, object] = {}
        for op in ("write", "read"):
            pending: Deque[Tuple[object, int]] = collections.deque()
            inflight = 0
            hand_cpu = 0.0
            cpu0, proc0, t0 = time.thread_time(), time.process_time(), time.perf_counter()
            for i in range(n_tensors):
                # At most len(outs) - 1 reads pending: outs[i % len(outs)] is free again.
                while pending and inflight + tensor_bytes > window:
                    fut, nb = pending.popleft()
                    fut.result(cfg.io_timeout_s)
                    inflight -= nb
                h0 = time.thread_time()
                if op == "write":
                    fut = engine.write(i, sources[i % len(sources)])
                else:
                    fut = engine.read(i, outs[i % len(outs)])
                hand_cpu += time.thread_time() - h0
                pending.append((fut, tensor_bytes))
                inflight += tensor_bytes
                progress.tick(f"{label} {op}", i + 1, n_tensors, tensor_bytes)
            for fut, _ in pending:
                fut.result(cfg.io_timeout_s)
            elapsed, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
            proc = time.process_time() - proc0  # every thread: the IO threads' copies and checksums
            result[f"{op}_gbps"] = total / elapsed / GB
            result[f"{op}_cpu_s_per_gb"] = cpu / (total / GB)
            result[f"{op}_gb_per_core_s"] = total / GB / max(proc, 1e-9)
            result[f"{op}_call_us"] = hand_cpu / n_tensors * 1e6
            progress.say(f"{label} {op}: {result[f'{op}_gbps']:.2f} GB/s")
        for key in sorted({0, n_tensors // 2, n_tensors - 1}):
            got = torch.empty(tensor_bytes, dtype=torch.uint8)
            engine.read(key, got).result(cfg.io_timeout_s)
            if not torch.equal(got, sources[key % len(sources)]):
                raise BenchError(f"engine {name!r} returned wrong bytes for tensor {key}")
        result["page_cache_bypassed"] = bool(getattr(engine, "page_cache_bypassed", True))
        result["on_disk"] = name not in ("memory",)
        if name == "tiered":
            result["tensors_spilled"] = engine.tensors_spilled
        for i in range(n_tensors):
            engine.release(i)
        if engine.bytes_on_disk:
            raise BenchError(f"engine {name!r} holds {engine.bytes_on_disk} bytes after every key was released")
        engine.end_step()
    finally:
        gc.unfreeze()
        engine.close()
    result["cpu_us_per_tensor"] = max(result["write_call_us"], result["read_call_us"])
    return result
