"""Opt-in IO trace: one JSON line per IO request, for `ssdtrain report`.

Engines call ``on_io`` from their worker threads when a request completes; the offloader tags
each key with its context (step, micro-batch, layer, phase) when it submits the request.
Records are buffered in memory and appended to the file at the end of each step, so tracing
costs no file IO on the hot path.

Times: ``t`` is seconds since the tracer started (the offloader was built), for plots of one
rank; ``wall`` is the same instant as a Unix time, to line several ranks' traces up with each
other and with Megatron's log.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Dict, Hashable, List, Optional, Tuple

from .append import AppendFile


class IOTracer:
    """``base``: where the walk to the file's folder starts (:class:`AppendFile`)."""

    def __init__(self, path: str, rank: int, base: Optional[str] = None) -> None:
        self.path = path
        self.rank = rank
        self._t0 = time.perf_counter()
        self._wall0 = time.time()  # the same instant on the wall clock
        self._lock = threading.Lock()
        self._context: Dict[int, Tuple[int, Optional[str], Optional[str], str]] = {}
        self._rows: List[str] = []
        # opened once, at the first flush, never through a link; its folders made then, 0700
        self._file = AppendFile(path, base, "--ssd-offload-trace-path")

    def tag(self, key: int, step: int, microbatch: Hashable, layer: Hashable, phase: str) -> None:
        ctx = (step, None if microbatch is None else str(microbatch), None if layer is None else str(layer), phase)
        with self._lock:
            self._context[key] = ctx

    def on_io(self, op: str, key: int, path: str, offset: int, nbytes: int, t_submit: float,
              t_done: float, queue_depth: int) -> None:
        with self._lock:
            step, mb, layer, phase = self._context.get(key, (-1, None, None, "step_end"))
            self._rows.append(json.dumps({
                "t": round(t_submit - self._t0, 9), "wall": round(self._wall0 + t_submit - self._t0, 6),
                "rank": self.rank, "step": step, "microbatch": mb,
                "layer": layer, "phase": phase, "op": op, "bytes": nbytes, "file": path, "offset": offset,
                "latency_s": round(t_done - t_submit, 9), "queue_depth": queue_depth}))

    def forget(self, key: int) -> None:
        with self._lock:
            self._context.pop(key, None)

    def flush(self) -> None:
        with self._lock:
            rows, self._rows = self._rows, []
        if rows:
            self._file.write("\n".join(rows) + "\n")
