"""A bandwidth cap around any engine: emulates a slower drive (tests, what-if runs).

Every request is given a slot on one emulated device timeline (reads and writes share it, as
they share a real drive): it completes no earlier than ``max(submit, device free) + bytes /
cap``. The real IO still happens underneath; only completion is held back, and the meters
measure the emulated device. Completions go back as the caller asked (IOEngine.completions):
a Future per request, or ``(key, None or the exception)`` on its queue once the slot ended;
the engine underneath always answers this one with Futures.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional, Sequence

import torch

from .affinity import pin_io_thread
from .base import BusyMeter, IOEngine


class ThrottledEngine(IOEngine):
    def __init__(self, inner: IOEngine, gbps: float, cpus: Sequence[int] = ()) -> None:
        self.inner = inner
        self.name = f"{inner.name}@{gbps:g}GB/s"
        self._bps = gbps * 1e9
        self._lock = threading.Lock()
        self._free_at = 0.0
        # One thread completes requests in submission order; finish times are monotonic.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ssdtrain-throttle",
                                        initializer=pin_io_thread, initargs=(tuple(cpus),))
        self.write_meter = BusyMeter()
        self.read_meter = BusyMeter()

    def __getattr__(self, name):  # page_cache_bypassed, ... (what IOEngine does not declare)
        return getattr(self.inner, name)

    def _slot(self, key: int, inner: Future, nbytes: int, meter: BusyMeter) -> Optional[Future]:
        sink = self.completions
        out: Optional[Future] = Future() if sink is None else None
        with self._lock:
            start = max(time.perf_counter(), self._free_at)
            finish = self._free_at = start + nbytes / self._bps
        meter.begin()

        def complete() -> None:
            try:
                result = inner.result()
            except BaseException as exc:  # the real IO failed: report it, at once
                meter.end(0)
                if sink is not None:
                    sink.put((key, exc))
                else:
                    out.set_exception(exc)
                return
            delay = finish - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            meter.end(nbytes)
            if sink is not None:
                sink.put((key, None))
            else:
                out.set_result(result)

        self._pool.submit(complete)
        return out

    def write(self, key: int, data: torch.Tensor, ready_event: Optional[object] = None) -> Optional[Future]:
        return self._slot(key, self.inner.write(key, data, ready_event), data.nbytes, self.write_meter)

    def read(self, key: int, out: torch.Tensor, ready_event: Optional[object] = None) -> Optional[Future]:
        return self._slot(key, self.inner.read(key, out, ready_event), out.nbytes, self.read_meter)

    # IOEngine declares these with defaults, so __getattr__ never sees them: forward each.

    @property
    def device_direct(self) -> bool:
        return self.inner.device_direct

    @property
    def tier(self) -> str:
        return self.inner.tier

    def place(self, key: int, tier: str) -> None:
        self.inner.place(key, tier)

    @property
    def ident(self):
        return self.inner.ident

    @property
    def rank_dirs(self):
        return self.inner.rank_dirs

    @property
    def step_peak_bytes(self):
        return self.inner.step_peak_bytes

    @property
    def tracer(self):
        return self.inner.tracer

    @tracer.setter
    def tracer(self, sink) -> None:
        self.inner.tracer = sink

    def release(self, key: int) -> None:
        self.inner.release(key)

    def end_step(self) -> None:
        self.inner.end_step()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.inner.close()

    def remove_files(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.inner.remove_files()

    @property
    def bytes_on_disk(self) -> int:
        return self.inner.bytes_on_disk
