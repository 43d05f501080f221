"""One engine measured for ``ssdtrain io-bench``: as a training job uses it from its second
step on (``EngineSide``), over the memory it shares with the baseline (measure.py
``BenchMemory``)."""

from __future__ import annotations

import collections
import os
import time
from typing import Deque, Dict, Optional, Tuple

from ...config import OffloadConfig
from ...io.layout import align_up
from ..gc_freeze import gc_frozen
from .measure import (BASELINE_BLOCK, BASELINE_THREADS, MiB, SOURCES, BenchError, BenchMemory, Progress,
                      Segment)


def contender_label(engine: str, verify: str) -> str:
    """How the report names an engine measured with ``verify``: 'posix', 'posix+crc32c'."""
    return engine if verify == "off" else f"{engine}+{verify}"


class EngineSide:
    """Engine ``name`` as a training job uses it from its second step on (see the module
    docstring): built, warmed up by one untimed step of ``max_tensors`` tensors, then
    measured a step at a time by ``step``. Raises EngineUnavailable when it cannot run here."""

    def __init__(self, name: str, directory: str, tensor_bytes: int, max_tensors: int,
                 progress: Progress, base: Optional[OffloadConfig] = None) -> None:
        from ...io import make_engine

        overrides: Dict[str, object] = {"dirs": [directory], "engine": name, "job": f"iobench{os.getpid()}"}
        if name == "memory":
            overrides["host_memory_bytes"] = max_tensors * align_up(max(tensor_bytes, 1), 512) + MiB
        elif name == "tiered":
            overrides["host_memory_bytes"] = max_tensors * tensor_bytes // 2  # half in memory, half on SSD
        self.config = cfg = (base or OffloadConfig()).replace(**overrides)
        self.name, self.label = name, contender_label(name, cfg.verify)
        self.tensor_bytes, self.progress = tensor_bytes, progress
        self.window = max(cfg.max_inflight_bytes, 2 * tensor_bytes)
        # Shared with the baseline paired with this engine (BenchMemory says why): at least
        # SOURCES distinct tensors, and as many as the baseline's requests in flight span.
        span = -(-BASELINE_THREADS * BASELINE_BLOCK // max(tensor_bytes, 1))
        self.memory = BenchMemory(tensor_bytes, min(max_tensors, max(SOURCES, span)),
                                  min(max_tensors, max(2, self.window // max(tensor_bytes, 1))))
        self.sources, self.outs = self.memory.sources(), self.memory.outs()
        self.engine = make_engine(cfg)
        try:
            self.step(max_tensors)  # step 1: threads running, the slab's size known (io/slab.py)
        except BaseException:
            self.engine.close()
            raise

    @property
    def page_cache_bypassed(self) -> bool:
        return bool(getattr(self.engine, "page_cache_bypassed", True))

    def step(self, n: int) -> Segment:
        """One step of ``n`` tensors: written, read back, a sample read again and compared
        bitwise (BenchError when it differs), released, and ``end_step``."""
        engine = self.engine
        # The heap that exists before measuring is frozen, as a latency-minded training loop
        # does, so a full collection of torch's objects is not billed to the call that happened
        # to trigger it; what the engine allocates is still collected (and counted) as usual.
        with gc_frozen():
            got = Segment(n * self.tensor_bytes, calls=n)
            for op in ("write", "read"):
                self._timed(op, n, got)
            self._check(n)
            for i in range(n):
                engine.release(i)
            if engine.bytes_on_disk:
                raise BenchError(f"engine {self.name!r} holds {engine.bytes_on_disk} bytes after every key "
                                 f"was released")
            engine.end_step()
            return got

    def _timed(self, op: str, n: int, got: Segment) -> None:
        """``n`` writes or reads with at most ``window`` bytes in flight; the times into ``got``."""
        engine, size, outs = self.engine, self.tensor_bytes, self.outs
        pending: Deque[Tuple[object, int]] = collections.deque()
        inflight, hand_cpu = 0, 0.0
        cpu0, proc0, t0 = time.thread_time(), time.process_time(), time.perf_counter()
        for i in range(n):
            # At most len(outs) - 1 reads pending: outs[i % len(outs)] is free again.
            while pending and inflight + size > self.window:
                fut, nb = pending.popleft()
                fut.result(self.config.io_timeout_s)
                inflight -= nb
            h0 = time.thread_time()
            if op == "write":
                fut = engine.write(i, self.sources[i % len(self.sources)])
            else:
                fut = engine.read(i, outs[i % len(outs)])
            hand_cpu += time.thread_time() - h0
            pending.append((fut, size))
            inflight += size
        for fut, _ in pending:
            fut.result(self.config.io_timeout_s)
        setattr(got, f"{op}_s", time.perf_counter() - t0)
        setattr(got, f"{op}_cpu_s", time.thread_time() - cpu0)
        setattr(got, f"{op}_proc_s", time.process_time() - proc0)  # IO threads' copies and checksums
        setattr(got, f"{op}_call_s", hand_cpu)

    def _check(self, n: int) -> None:
        import torch

        for key in sorted({0, n // 2, n - 1}):
            back = torch.empty(self.tensor_bytes, dtype=torch.uint8)
            self.engine.read(key, back).result(self.config.io_timeout_s)
            if not torch.equal(back, self.sources[key % len(self.sources)]):
                raise BenchError(f"engine {self.name!r} returned wrong bytes for tensor {key}")

    def close(self) -> None:
        self.engine.close()
        self.memory.close()
