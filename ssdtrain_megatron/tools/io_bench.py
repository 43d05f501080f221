"""``ssdtrain io-bench``: the IO engines against the drive's own limit, measured in one run.

The baseline is what fio would report for the device: one preallocated O_DIRECT file, several
threads each keeping one large (8 MiB) pwrite/pread in flight, no copies. Each engine then
writes and reads the same amount of data as tensors of ``--tensor-mib``, through its public
interface, with at most ``max_inflight_bytes`` (1 GiB) in flight as the offloader would, and
the report gives, for write and read: GB/s (10^9 bytes per second), the ratio to the baseline,
and the CPU time the calling (training) thread spent per GB; plus ``cpu_us_per_tensor``, the
calling thread's CPU time inside one ``write``/``read`` call (the larger of the two means).

A drive shared with other work, or a virtual one, changes speed within seconds. So each engine
is measured between two baselines and its ratio is taken against their mean, over
``--rounds`` rounds that start with different engines; every figure is a median over rounds.

Reads are O_DIRECT everywhere, so they come from the drive and not the page cache; where a
filesystem refuses O_DIRECT the report says so on stderr and ``page_cache_bypassed`` is false.
Progress goes to stderr; stdout gets the table, or with ``--json`` one JSON object.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import errno
import gc
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Callable, Deque, Dict, List, Optional, Tuple

from .cli_types import (EnvironmentProblem, UsageError, check_engine, deprecated_alias, positive_float,
                         positive_int, writable_dir)
from .cli_types import progress as progress_bar
from ..config import ConfigError, OffloadConfig
from ..io.layout import align_up

MiB = 1 << 20
GiB = 1 << 30
GB = 1e9
BASELINE_BLOCK = 8 * MiB
BASELINE_THREADS = 8
ENGINE_CHOICES = ("posix", "aio", "memory", "tiered", "gds", "all")
ALL_ENGINES = ("posix", "aio", "memory")
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


def layout_compare(directory: str, n_tensors: int, tensor_bytes: int, threads: int,
                   chunk: int) -> Dict[str, Dict[str, float]]:
    """Tensors in one preallocated slab vs one new file per tensor: same threads, same request
    size (``min(chunk, tensor)``), O_DIRECT, each thread writing/reading whole tensors."""
    req = min(chunk, align_up(tensor_bytes))
    padded = align_up(tensor_bytes, req)
    total = n_tensors * padded
    bufs = _buffers(threads, req)
    results: Dict[str, Dict[str, float]] = {}
    try:
        # Slab: one file, preallocated (the fallocate is timed with the writes).
        path = os.path.join(directory, "layout-slab.bin")
        fd, _ = _open_direct(path)
        try:
            res: Dict[str, float] = {}
            for op in ("write", "read"):
                work = _Blocks([(i, i * padded, 0) for i in range(n_tensors)])

                def slab_worker(t: int, op: str = op, work: _Blocks = work) -> None:
                    with memoryview(bufs[t]) as mv:
                        while (item := work.take()) is not None:
                            for off in range(item[1], item[1] + padded, req):
                                _do(op, fd, mv, off, path)

                t0 = time.perf_counter()
                if op == "write":
                    os.posix_fallocate(fd, 0, total)
                _run_threads(threads, slab_worker)
                res[f"{op}_gbps"] = n_tensors * tensor_bytes / (time.perf_counter() - t0) / GB
            results["slab"] = res
        finally:
            os.close(fd)
            os.unlink(path)

        # One file per tensor, created by the write (what per-tensor torch.save does).
        names = [os.path.join(directory, f"layout-file-{i}.bin") for i in range(n_tensors)]
        res = {}
        for op in ("write", "read"):
            work = _Blocks([(i, 0, 0) for i in range(n_tensors)])

            def file_worker(t: int, op: str = op, work: _Blocks = work) -> None:
                with memoryview(bufs[t]) as mv:
                    while (item := work.take()) is not None:
                        name = names[item[0]]
                        if op == "write":
                            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
                        else:
                            fd = os.open(name, os.O_RDONLY | os.O_DIRECT)
                        try:
                            for off in range(0, padded, req):
                                _do(op, fd, mv, off, name)
                        finally:
                            os.close(fd)

            res[f"{op}_gbps"] = n_tensors * tensor_bytes / _run_threads(threads, file_worker) / GB
        t0 = time.perf_counter()
        for name in names:
            os.unlink(name)
        res["unlink_us_per_file"] = (time.perf_counter() - t0) / n_tensors * 1e6
        results["file_per_tensor"] = res
        return results
    finally:
        for name in os.listdir(directory):
            if name.startswith("layout-"):
                os.unlink(os.path.join(directory, name))
        for b in bufs:
            b.close()


# -- engines -------------------------------------------------------------------------------


def bench_engine(name: str, directory: str, n_tensors: int, tensor_bytes: int,
                 progress: Progress, base: Optional[OffloadConfig] = None) -> Dict[str, object]:
    """Write then read ``n_tensors`` tensors through engine ``name``; verify a sample bitwise."""
    import torch

    from ..io import make_engine

    total = n_tensors * tensor_bytes
    overrides: Dict[str, object] = {"dirs": [directory], "engine": name, "job": f"iobench{os.getpid()}"}
    if name == "memory":
        overrides["host_memory_bytes"] = n_tensors * align_up(max(tensor_bytes, 1), 512) + MiB
    elif name == "tiered":
        overrides["host_memory_bytes"] = total // 2  # half in memory, half spilled to SSD
    cfg = (base or OffloadConfig()).replace(**overrides)
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
            cpu0, t0 = time.thread_time(), time.perf_counter()
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
                progress.tick(f"{name} {op}", i + 1, n_tensors, tensor_bytes)
            for fut, _ in pending:
                fut.result(cfg.io_timeout_s)
            elapsed, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
            result[f"{op}_gbps"] = total / elapsed / GB
            result[f"{op}_cpu_s_per_gb"] = cpu / (total / GB)
            result[f"{op}_call_us"] = hand_cpu / n_tensors * 1e6
            progress.say(f"{name} {op}: {result[f'{op}_gbps']:.2f} GB/s")
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


# -- report --------------------------------------------------------------------------------


def _median(samples: List[Dict[str, object]], key: str) -> float:
    return statistics.median(float(s[key]) for s in samples)


def run(directory: str, engines: List[str], tensor_mib: float, total_gib: float,
        progress: Progress, compare_layout: bool = False, rounds: int = 1,
        base_config: Optional[OffloadConfig] = None) -> Dict[str, object]:
    """Measure the baseline and each engine, ``rounds`` times interleaved (the drive's speed
    drifts; each figure is the median over rounds). Returns the report: the --json object plus
    private keys, starting with '_', for the table."""
    from ..io import engine_class
    from ..io.base import EngineUnavailable

    tensor_bytes = int(round(tensor_mib * MiB))
    n_tensors = max(1, int(round(total_gib * GiB / max(tensor_bytes, 1))))
    total = n_tensors * tensor_bytes
    os.makedirs(directory, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="ssdtrain-iobench.", dir=directory)
    report: Dict[str, object] = {"_skipped": {}, "_detail": {}, "_n_tensors": n_tensors,
                                 "_total": total, "_dir": directory, "_rounds": rounds}
    try:
        runnable = []
        for name in engines:
            ok, why = engine_class(name).is_available()
            if ok:
                runnable.append(name)
            else:
                progress.say(f"skipping {name}: {why}")
                report["_skipped"][name] = why
        if "aio" in runnable:
            progress.say("aio: loading DeepSpeed's async_io op (the first build takes minutes)")
        samples: Dict[str, List[Dict[str, object]]] = {name: [] for name in ["baseline"] + runnable}
        ratios: Dict[str, Dict[str, List[float]]] = {n: {"write": [], "read": []} for n in runnable}

        def baseline() -> Dict[str, object]:
            progress.say(f"baseline: {BASELINE_THREADS} threads x {BASELINE_BLOCK // MiB} MiB "
                         f"O_DIRECT requests, {total / GiB:.2f} GiB")
            base = raw_baseline(scratch, max(total, BASELINE_BLOCK))
            if not base["direct"]:
                progress.say(f"WARNING: {directory} refuses O_DIRECT; buffered IO with "
                             f"fadvise(DONTNEED) is used and reads MAY BE SERVED BY THE PAGE CACHE")
            progress.say(f"baseline: write {base['write_gbps']:.2f} GB/s, read {base['read_gbps']:.2f} GB/s")
            samples["baseline"].append(base)
            return base

        for r in range(rounds):
            # A shared or virtual drive drifts within seconds: every engine is measured between
            # two baselines and compared with their mean, and each round starts with another
            # engine, so that none is always the one after a pause.
            order = runnable[r % len(runnable):] + runnable[:r % len(runnable)] if runnable else []
            progress.say(f"round {r + 1}/{rounds}: " + " | ".join(["baseline"] + [f"{n} | baseline" for n in order]))
            before = baseline()
            for name in order:
                if name not in runnable:
                    continue
                progress.say(f"{name}: {n_tensors} tensors of {tensor_bytes / MiB:g} MiB")
                try:
                    got = bench_engine(name, scratch, n_tensors, tensor_bytes, progress, base_config)
                except EngineUnavailable as exc:
                    why = str(exc).replace(f"engine {name!r} cannot run here: ", "")
                    progress.say(f"skipping {name}: {why}")
                    report["_skipped"][name] = why
                    runnable.remove(name)
                    continue
                after = baseline()
                samples[name].append(got)
                for op in ("write", "read"):
                    ratios[name][op].append(got[f"{op}_gbps"] / ((before[f"{op}_gbps"] + after[f"{op}_gbps"]) / 2))
                before = after
        base_w = _median(samples["baseline"], "write_gbps")
        base_r = _median(samples["baseline"], "read_gbps")
        report["baseline"] = {"write_gbps": base_w, "read_gbps": base_r}
        bypassed = all(bool(s["direct"]) for s in samples["baseline"])
        engines_out: Dict[str, Dict[str, float]] = {}
        for name in runnable:
            got = samples[name]
            detail = {k: _median(got, k) for k in got[0] if isinstance(got[0][k], (int, float))
                      and not isinstance(got[0][k], bool)}
            for op in ("write", "read"):
                detail[f"{op}_ratio"] = statistics.median(ratios[name][op])
                detail[f"{op}_ratio_range"] = (min(ratios[name][op]), max(ratios[name][op]))
            report["_detail"][name] = detail
            engines_out[name] = {
                "write_gbps": detail["write_gbps"], "read_gbps": detail["read_gbps"],
                "write_ratio": detail["write_ratio"], "read_ratio": detail["read_ratio"],
                "cpu_us_per_tensor": detail["cpu_us_per_tensor"],
            }
            if got[0]["on_disk"] and not all(s["page_cache_bypassed"] for s in got):
                progress.say(f"WARNING: {name} read through the page cache; its read figures are inflated")
                bypassed = False
        report["engines"] = engines_out
        report["tensor_mib"] = tensor_mib
        report["page_cache_bypassed"] = bypassed
        if compare_layout:
            progress.say("layout: one slab vs one file per tensor")
            cfg = base_config or OffloadConfig()
            report["layout"] = layout_compare(scratch, n_tensors, tensor_bytes, cfg.io_threads, cfg.chunk_bytes)
        return report
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def public(report: Dict[str, object]) -> Dict[str, object]:
    """The --json object: the report without its private keys."""
    return {k: report[k] for k in ("baseline", "engines", "tensor_mib", "page_cache_bypassed", "layout")
            if k in report}


def format_table(report: Dict[str, object]) -> str:
    base = report["baseline"]
    lines = [
        f"io-bench {report['_dir']}: {report['_n_tensors']} tensors x {report['tensor_mib']:g} MiB "
        f"= {report['_total'] / GiB:.2f} GiB per engine; reads "
        + ("bypass the page cache (O_DIRECT)" if report["page_cache_bypassed"]
           else "MAY COME FROM THE PAGE CACHE (O_DIRECT refused)"),
        "",
        f"{'':<14}{'write GB/s':>11}{'ratio':>7}{'CPU s/GB':>10}{'read GB/s':>11}{'ratio':>7}"
        f"{'CPU s/GB':>10}{'write() us':>12}{'read() us':>11}   per-round ratios w / r",
        f"{'raw O_DIRECT':<14}{base['write_gbps']:>11.2f}{1.0:>7.2f}{'':>10}{base['read_gbps']:>11.2f}"
        f"{1.0:>7.2f}",
    ]
    for name, e in report["engines"].items():
        d = report["_detail"][name]
        lines.append(f"{name:<14}{e['write_gbps']:>11.2f}{e['write_ratio']:>7.2f}{d['write_cpu_s_per_gb']:>10.3f}"
                     f"{e['read_gbps']:>11.2f}{e['read_ratio']:>7.2f}{d['read_cpu_s_per_gb']:>10.3f}"
                     f"{d['write_call_us']:>12.1f}{d['read_call_us']:>11.1f}   "
                     f"{d['write_ratio_range'][0]:.2f}-{d['write_ratio_range'][1]:.2f} / "
                     f"{d['read_ratio_range'][0]:.2f}-{d['read_ratio_range'][1]:.2f}")
    for name, why in report["_skipped"].items():
        lines.append(f"{name:<14}skipped: {why}")
    lines += ["", f"Medians of {report['_rounds']} round(s). baseline: {BASELINE_THREADS} threads x "
              f"{BASELINE_BLOCK // MiB} MiB O_DIRECT requests on one preallocated file, measured before and "
              f"after each engine;",
              "ratio: the engine against the mean of those two baselines (median over rounds; range "
              "at the right).",
              "CPU s/GB, write() us, read() us: CPU time of the calling (training) thread; "
              "cpu_us_per_tensor is the larger of the two per-call figures."]
    if "memory" in report["engines"]:
        lines.append("memory: host RAM, no disk; its ratios only compare it with the drive.")
    if "layout" in report:
        lay = report["layout"]
        lines += ["", "layout (same threads and request size, no engine):",
                  f"  one slab:            write {lay['slab']['write_gbps']:.2f} GB/s, read "
                  f"{lay['slab']['read_gbps']:.2f} GB/s",
                  f"  one file per tensor: write {lay['file_per_tensor']['write_gbps']:.2f} GB/s, read "
                  f"{lay['file_per_tensor']['read_gbps']:.2f} GB/s, unlink "
                  f"{lay['file_per_tensor']['unlink_us_per_file']:.0f} us/file"]
    return "\n".join(lines)


# -- command line --------------------------------------------------------------------------


def add_io_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``io-bench`` on an ``add_subparsers()`` object; ``args.func(args)`` runs it."""
    p = subparsers.add_parser(
        "io-bench", help="measure the IO engines against the drive's raw O_DIRECT limit",
        description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="directory on the drive to measure (a scratch "
                   "directory is created in it and removed afterwards)")
    p.add_argument("--engine", default="all", choices=ENGINE_CHOICES,
                   help="engine to measure; 'all' = posix, aio (skipped with the reason when it "
                        "cannot run here) and memory (default: all)")
    p.add_argument("--tensor-mib", type=positive_float, default=64.0, metavar="MIB",
                   help="tensor size in MiB (2^20 bytes; default 64)")
    p.add_argument("--total-gib", type=positive_float, default=4.0, metavar="GIB",
                   help="GiB (2^30 bytes) written and read back per engine and by the baseline "
                        "(default 4); speeds are reported in GB/s (10^9 bytes per second)")
    deprecated_alias(p, "--tensor-mb", "--tensor-mib", "tensor_mib", positive_float)
    deprecated_alias(p, "--total-gb", "--total-gib", "total_gib", positive_float)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--compare-layout", action="store_true",
                   help="also measure one slab file against one file per tensor")
    p.add_argument("--rounds", type=positive_int, default=3,
                   help="measure everything this many times, interleaved, and report medians "
                        "(the drive's speed drifts; default 3)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="an OffloadConfig field for the engines, e.g. --set io_threads=8 "
                        "(YAML value; repeatable)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=run_io_bench)
    return p


@contextlib.contextmanager
def _stdout_to_stderr(enabled: bool):
    """While measuring, send what libraries print to stdout (DeepSpeed's logger; DeepNVMe's
    C++ messages on descriptor 1) to stderr, so that stdout holds the JSON object alone."""
    if not enabled:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _config_from_sets(sets: List[str]) -> OffloadConfig:
    import yaml

    values = {}
    for item in sets:
        field, sep, value = item.partition("=")
        if not sep or field not in OffloadConfig.field_names():
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE with FIELD one of "
                             + ", ".join(OffloadConfig.field_names()))
        values[field] = yaml.safe_load(value)
    return OffloadConfig(**values)


def run_io_bench(args: argparse.Namespace) -> int:
    try:
        base_config = _config_from_sets(args.set)
    except (ValueError, ConfigError) as exc:
        raise UsageError(str(exc)) from None
    directory = writable_dir("--dir", args.dir)
    engines = list(ALL_ENGINES) if args.engine == "all" else [args.engine]
    if args.engine != "all":  # before measuring anything: say at once what cannot run
        check_engine("--engine", args.engine)
    progress = Progress(enabled=not args.quiet)
    progress.say(f"{directory}: {args.rounds} round(s), {args.tensor_mib:g} MiB tensors, "
                 f"{args.total_gib:g} GiB per engine and baseline; engines {', '.join(engines)}; "
                 f"io_threads {base_config.io_threads}, chunk_bytes {base_config.chunk_bytes >> 20} MiB")
    try:
        with _stdout_to_stderr(args.json):
            report = run(directory, engines, args.tensor_mib, args.total_gib, progress,
                         args.compare_layout, args.rounds, base_config)
    except BenchError as exc:
        raise EnvironmentProblem(str(exc)) from exc
    finally:
        progress.close()
    if args.engine != "all" and args.engine in report["_skipped"]:
        raise EnvironmentProblem(f"--engine {args.engine}: cannot run here: "
                                 f"{report['_skipped'][args.engine]}")
    if args.json:
        print(json.dumps(public(report)))
    else:
        print(format_table(report))
    return 0
