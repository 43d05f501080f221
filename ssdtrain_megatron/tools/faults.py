"""FaultyEngine and seeded faults: IO errors injected into a real engine's calls, for
``ssdtrain soak`` and the tests (tests/faulty.py re-exports this module).

It wraps a disk engine (posix, aio, gds, or tiered: then its SSD tier) and puts a faulty
:class:`~ssdtrain_megatron.io.syscalls.SysCalls` in front of the engine's own, so each fault
runs the engine's real error path on its IO thread. ``engine.fault`` (settable at any time) is
called as ``fault(op, path, offset, nbytes)`` once per call the engine makes ("write"/"read";
the file; the call's byte range, which for a merged run of chunks spans all of them); it may
block (a gate holding an IO thread, a latency spike) and returns None, :data:`SHORT` (posix:
the call moves half its bytes and returns the short count, as a kernel may), or an OSError for
the call to fail with:

- posix: raised by pwritev/preadv, as the kernel's error would be;
- aio: DeepNVMe's handle makes its system calls in C, so the fault is what the engine sees of
  them: the submission refused with the negative errno as its return code (SHORT: EIO);
- gds: raised by the kvikio call (SHORT: EIO).

Production engines carry no test hook: only this wrapper, built by the caller, injects faults.
It lives in tools/ (never imported by the library) because ``ssdtrain soak`` needs it.
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time
import zlib
from typing import Callable, Dict, Optional, Sequence

from ..io.base import IOEngine
from ..io.syscalls import SysCalls
from .fault_kinds import KINDS, OP_OF  # noqa: F401 - KINDS: this module's public name too
from .forwarding import ForwardingEngine

Fault = Callable[[str, str, int, int], Optional[object]]

SHORT = object()
"""What a fault returns for a short transfer (posix; EIO elsewhere)."""

_EIO = OSError(errno.EIO, os.strerror(errno.EIO))


def _size(buffers) -> int:
    return sum(memoryview(b).nbytes for b in buffers)


def _half(buffers) -> list:
    """The first half of the first buffer: what a short call moves."""
    first = memoryview(buffers[0]).cast("B")
    return [first[:max(1, first.nbytes // 2)]]


class _FaultyCalls(SysCalls):
    def __init__(self, owner: "FaultyEngine", real: SysCalls) -> None:
        self.owner, self.real = owner, real

    def _check(self, op: str, path: str, offset: int, nbytes: int):
        fault = self.owner.fault
        return fault(op, path, offset, nbytes) if fault is not None else None

    def _error(self, outcome) -> Optional[OSError]:
        return _EIO if outcome is SHORT else outcome

    def pwritev(self, fd, buffers, offset, path):
        err = self._check("write", path, offset, _size(buffers))
        if err is SHORT:
            return self.real.pwritev(fd, _half(buffers), offset, path)
        if err is not None:
            raise err
        return self.real.pwritev(fd, buffers, offset, path)

    def preadv(self, fd, buffers, offset, path):
        err = self._check("read", path, offset, _size(buffers))
        if err is SHORT:
            return self.real.preadv(fd, _half(buffers), offset, path)
        if err is not None:
            raise err
        return self.real.preadv(fd, buffers, offset, path)

    def aio_submit(self, handle, writing, stage, fd, path, offset):
        err = self._error(self._check("write" if writing else "read", path, offset,
                                      stage.numel() * stage.element_size()))
        if err is not None:
            return -(err.errno or errno.EIO)
        return self.real.aio_submit(handle, writing, stage, fd, path, offset)

    def aio_wait(self, handle):
        return self.real.aio_wait(handle)

    def gds_submit(self, handle, writing, buf, nbytes, offset, path):
        err = self._error(self._check("write" if writing else "read", path, offset, nbytes))
        if err is not None:
            raise err
        return self.real.gds_submit(handle, writing, buf, nbytes, offset, path)


class FaultyEngine(ForwardingEngine):
    """``inner`` with ``fault`` injected into its calls; everything else is the inner engine's
    (forwarding.py)."""

    _own = ("fault",)

    def __init__(self, inner: IOEngine, fault: Optional[Fault] = None) -> None:
        super().__init__(inner)
        self.fault = fault
        disk = getattr(inner, "ssd", inner)  # tiered: the SSD tier does the IO
        object.__setattr__(self, "_disk", disk)
        disk._sys = _FaultyCalls(self, disk._sys)


def faulty_offloader(config, fault: Optional[Fault] = None, **kwargs):
    """An ActivationOffloader on ``config``'s engine wrapped in a FaultyEngine (``off.engine``)."""
    from ..cache.offloader import ActivationOffloader
    from ..io import make_engine

    return ActivationOffloader(config, engine=FaultyEngine(make_engine(config), fault), **kwargs)


class SeededFaults:
    """A ``fault`` function that injects ``kinds`` at random, from ``seed``.

    Each call draws from a generator seeded by (seed, step, op, file name, offset, how many
    times that range was seen this step), so a run's faults do not depend on which IO thread
    got there first. Thread-safe; ``counts`` holds the faults injected by kind.

    Args:
        seed: the seed.
        kinds: which of KINDS to inject.
        rate: probability per call of each IO-error kind that applies to the call's op.
        stall_s: how long a stall holds an IO thread (above the offloader's io_timeout_s).
        stall_rate: probability per call of a stall (they cost stall_s each: keep it rare).
    """

    def __init__(self, seed: int, kinds: Sequence[str], rate: float = 0.01,
                 stall_s: float = 2.0, stall_rate: float = 0.0005) -> None:
        self.seed, self.kinds, self.rate = seed, tuple(kinds), rate
        self.stall_s, self.stall_rate = stall_s, stall_rate
        self.step = 0
        self.counts: Dict[str, int] = {k: 0 for k in self.kinds}
        self._seen: Dict[tuple, int] = {}
        self._lock = threading.Lock()
        self.spike_s = 0.05  # 100x a 0.5 ms call (a 16 KiB posix call on a local NVMe drive)
        self.enabled = True

    def __call__(self, op: str, path: str, offset: int, nbytes: int):
        if not self.enabled:
            return None
        key = (self.step, op, os.path.basename(path), offset)
        with self._lock:
            nth = self._seen.get(key, 0)
            self._seen[key] = nth + 1
        rng = random.Random(zlib.crc32(repr((self.seed,) + key + (nth,)).encode()))
        kind = self._draw(op, rng)
        if kind is None:
            return None
        with self._lock:
            self.counts[kind] += 1
        if kind == "latency_spike":
            time.sleep(self.spike_s)
            return None
        if kind == "stall":
            time.sleep(self.stall_s)
            return None
        if kind in ("short_write", "short_read"):
            return SHORT
        code = errno.ENOSPC if kind == "write_enospc" else errno.EIO
        return OSError(code, os.strerror(code))

    def _draw(self, op: str, rng: random.Random) -> Optional[str]:
        for kind in self.kinds:
            want = OP_OF.get(kind)
            if want is not None and want != op:
                continue
            p = self.stall_rate if kind == "stall" else self.rate
            if rng.random() < p:
                return kind
        return None

    def new_step(self, step: int) -> None:
        with self._lock:
            self.step = step
            self._seen.clear()

    def total(self) -> int:
        return sum(self.counts.values())
