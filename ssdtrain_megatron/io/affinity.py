"""Which CPUs the IO threads run on (``OffloadConfig.io_cpus``).

On a GPU node the training thread launches every kernel, and a core it loses to an IO thread's
copy or checksum is a stall the GPU sees; on a CPU host the IO threads take cores from the
model's compute itself. ``io_cpus`` gives the IO threads cores of their own (on a GPU node: the
drives' NUMA node, away from the cores the training process is bound to). Each IO thread
confines itself when it starts (Linux affinity is per thread: a thread created later by the
training thread would otherwise inherit the training thread's CPUs), and the check that the
CPUs exist for this process runs where the engine is built, before any thread starts.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import List, Sequence, Set

from .base import EngineUnavailable

log = logging.getLogger(__name__)


def check_cpus(cpus: Sequence[int]) -> None:
    """Refuse CPUs this process may not run on, naming the ones it may.

    Raises:
        EngineUnavailable: a CPU outside the process's affinity, or no affinity on this OS.
    """
    if not cpus:
        return
    if not hasattr(os, "sched_setaffinity"):
        raise EngineUnavailable("io_cpus needs os.sched_setaffinity (Linux); leave io_cpus empty here")
    allowed = allowed_cpus()
    missing = sorted(set(cpus) - allowed)
    if missing:
        raise EngineUnavailable(f"io_cpus {list(cpus)}: CPU(s) {missing} are not among the CPUs this "
                                f"process may use ({_ranges(sorted(allowed))})")


def allowed_cpus() -> Set[int]:
    """The CPUs a thread of this process may run on (its cpuset), which a thread confined
    to fewer (the training thread, ``bench --node-emulation``) does not show in its own
    affinity: a probe thread asks for every CPU and reads back what it got."""
    got: List[Set[int]] = []

    def probe() -> None:
        try:
            os.sched_setaffinity(0, range(os.cpu_count() or 1))
        except OSError:
            pass
        got.append(os.sched_getaffinity(0))

    t = threading.Thread(target=probe, name="ssdtrain-cpu-probe", daemon=True)
    t.start()
    t.join()
    return got[0] if got else os.sched_getaffinity(0)


def pin_io_thread(cpus: Sequence[int]) -> None:
    """First thing on each IO thread: run only on ``cpus`` (empty: where the process runs).
    A refusal (the CPUs went away since the check) is logged, never raised: a worker that died
    here would leave its requests unanswered."""
    if not cpus:
        return
    try:
        os.sched_setaffinity(0, cpus)  # 0: the calling thread
    except (OSError, AttributeError) as exc:
        log.warning("ssdtrain: cannot confine an IO thread to CPUs %s: %s", list(cpus), exc)


def _ranges(cpus: Sequence[int]) -> str:
    out, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            out.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(out)
