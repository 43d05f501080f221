"""The IO engine interface every backend implements.

An engine stores and returns opaque byte ranges under integer keys. It knows nothing of
autograd: the offloader hands it a contiguous tensor (any dtype and shape: its memory is the
bytes, ``tensor.nbytes`` of them) and asks for the same bytes back later into another. The
engine takes the byte view (:func:`as_bytes`) on its own threads: a view is a torch call that
releases the GIL, and on the training thread each one is a point where the IO threads can take
the interpreter away from the pack hook. Ordering contract, kept by the caller: ``read(key)``
is issued only after the ``write(key)`` has completed, and ``release(key)`` only when no IO on
that key is pending.

Completions reach the caller one of two ways: a Future per request (the default), or, when the
caller sets ``engine.completions`` (anything with ``put``, e.g. a ``queue.SimpleQueue``), one
``(key, None or the exception)`` item per request, put by the IO thread after the engine has
dropped its last reference to the request's tensor; ``write``/``read`` then return None. The
offloader uses the queue: its training thread owns all its state, and an IO thread never runs
its code.
"""

from __future__ import annotations

import abc
import functools
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

if TYPE_CHECKING:
    from .layout import Identity


TIERS = ("host", "ssd")
"""The places an offloaded tensor can go: host memory and a drive (IOEngine.tier, ``place``)."""


class EngineError(RuntimeError):
    """An IO operation failed; the message names the file, the offset and the cause."""


class EngineUnavailable(RuntimeError):
    """The engine cannot run on this machine; the message says what is missing."""


class IOEngine(abc.ABC):
    """Stores byte ranges keyed by int, asynchronously.

    ``write``/``read`` return futures whose result is the number of bytes moved, or which
    raise :class:`EngineError`. Implementations must never report success for a short or
    failed IO.
    """

    name: str = "base"

    completions: Optional[Any] = None
    """Where to report completions instead of Futures (see the module docstring)."""

    tier: str = "ssd"
    """Where this engine keeps the bytes: 'ssd' (a drive) or 'host' (host memory); the
    offloader's per-tier statistics name its traffic so (see ``tier_meters``)."""

    device_direct: bool = False
    """True when the engine moves GPU memory itself (gds): the offloader then hands it device
    tensors and events instead of pinned host copies (see cache/device_copy.py)."""

    # What the offloader reads or sets besides the methods below. Every engine has them; the
    # defaults suit an engine that keeps no files (memory): the disk engines set their own.

    ident: Optional["Identity"] = None
    """Rank, host and job this engine's directories are named after; None: it has none (the
    offloader then takes them from the environment, for stats and trace file names)."""

    rank_dirs: Sequence[str] = ()
    """This rank's directories, one per root, where the engine's files live."""

    step_peak_bytes: Optional[List[int]] = None
    """Per root, the bytes the last step's files reached (the offloader checks free space
    against it before the next step); None: the engine needs no disk space."""

    tracer: Optional[Callable[..., None]] = None
    """IO trace sink, set by the offloader: ``tracer(op, key, path, offset, nbytes, t_submit,
    t_done, queue_depth)``, called from an IO thread when each chunk completes."""

    @functools.cached_property
    def write_meter(self) -> "BusyMeter":
        """Bytes written and the time writes were in flight, for the step's bandwidth (an
        engine that measures nothing reports zeros)."""
        return BusyMeter()

    @functools.cached_property
    def read_meter(self) -> "BusyMeter":
        """As ``write_meter``, for reads."""
        return BusyMeter()

    @classmethod
    def is_available(cls) -> Tuple[bool, str]:
        """(True, '') when the engine can run here, else (False, what is missing)."""
        return True, ""

    @abc.abstractmethod
    def write(self, key: int, data: torch.Tensor, ready_event: Optional[object] = None) -> Optional[Future]:
        """Start writing the bytes of ``data`` (a contiguous tensor). ``ready_event`` (a CUDA
        event or None) must complete before the bytes are read from ``data``. Returns a Future,
        or None when ``completions`` is set."""

    @abc.abstractmethod
    def read(self, key: int, out: torch.Tensor, ready_event: Optional[object] = None) -> Optional[Future]:
        """Start reading the bytes stored under ``key`` into ``out`` (a contiguous tensor of the
        written ``nbytes``). ``ready_event`` (a CUDA event or None) must complete before bytes
        are written into ``out`` (kernels that used its memory before may still run). Returns
        a Future, or None when ``completions`` is set."""

    @abc.abstractmethod
    def release(self, key: int) -> None:
        """Forget ``key`` and free its space at once."""

    def place(self, key: int, tier: str) -> None:
        """Where the plan wants the bytes of ``key``: 'host' or 'ssd', said before its
        ``pool_view`` and ``write``. An engine with one place ignores it (the default); the
        tiered engine stores the key there (io/tiered.py)."""

    def tier_meters(self) -> Dict[str, Tuple["BusyMeter", "BusyMeter"]]:
        """Each tier's (write, read) meters, by ``tier`` name; one engine, one tier (the
        default): its own meters. The offloader takes them at the end of every step."""
        return {self.tier: (self.write_meter, self.read_meter)}

    def cancel(self, key: int) -> bool:
        """Take back the write of ``key`` if no IO thread has started it: True when it was
        (no completion will be reported; ``release(key)`` still follows), False when it runs
        to completion as usual. Default: never."""
        return False

    def pool_view(self, key: int, nbytes: int) -> Optional[torch.Tensor]:
        """Host memory of the engine's own (page-locked) where the bytes of ``key`` are to be
        stored, allocated now, or None (the default: the engine has none). With a view, the
        offloader copies the device tensor straight into it and then, once that copy has run,
        calls ``commit(key)`` (or ``write(key, view, copy_event)``, whose IO thread waits for
        the copy); later it copies the bytes back out of ``pool_view_of(key)`` itself
        (``pool_read``), or ``read(key, view)`` finds them in place. Raises what ``write``
        raises for a tensor it cannot take (PoolFull)."""
        return None

    def commit(self, key: int) -> None:
        """The device copy into ``key``'s ``pool_view`` memory has run (the offloader saw its
        event complete): the bytes are stored, with no request and no IO thread (the write
        completes here). Only for keys with a ``pool_view``; the default engine has none."""
        raise EngineError(f"{self.name} engine: commit of key {key}, but it hands out no pool memory")

    def pool_read(self, key: int, started: bool) -> None:
        """The offloader copies ``key``'s bytes out of its ``pool_view_of`` memory itself
        (``started``) or that copy has run (not ``started``): the engine counts the read in
        its meters and trace. Default: nothing (no engine memory is handed out)."""

    def pool_view_of(self, key: int) -> Optional[torch.Tensor]:
        """The engine's own (page-locked) memory that holds the stored bytes of ``key``, for
        the offloader to copy to the device from; None (the default) when they are not in
        such memory: ``read`` then brings them."""
        return None

    def fence(self, key: int, event: object) -> None:
        """A device copy into or out of ``key``'s ``pool_view`` memory completes with
        ``event``: after ``release(key)`` the memory is reused only once the event completed.
        Default: nothing (no engine memory is handed out)."""

    def end_step(self) -> None:
        """Called when no key is live: engines drop per-step files and state here."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything and remove every file this engine created."""

    def remove_files(self) -> None:
        """Signal/exit path: remove this engine's files now, without waiting for pending IO
        (the process is going away). Default: ``close()``."""
        self.close()

    @property
    @abc.abstractmethod
    def bytes_on_disk(self) -> int:
        """Bytes currently held for live keys (0 once every key is released)."""


_U8 = torch.uint8


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The memory of the contiguous tensor ``t`` as a 1-D uint8 view (no copy); ``t`` itself
    when it already is one. Engines call it on their IO threads (see the module docstring)."""
    if t.dtype is _U8 and t.dim() == 1:
        return t
    if t.requires_grad:  # the offloader may hand over the saved tensor itself
        t = t.detach()
    return t.view(-1).view(_U8)


class BusyMeter:
    """Wall time during which at least one operation of a kind was in flight.

    Bandwidth = bytes / busy time: what the device achieved while it was being used, not
    diluted by the compute between bursts.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inflight = 0
        self._since = 0.0
        self._busy = 0.0
        self._bytes = 0

    def begin(self) -> None:
        with self._lock:
            if self._inflight == 0:
                self._since = time.perf_counter()
            self._inflight += 1

    def end(self, nbytes: int) -> None:
        with self._lock:
            self._inflight -= 1
            self._bytes += nbytes
            if self._inflight == 0:
                self._busy += time.perf_counter() - self._since

    def take(self) -> Tuple[int, float]:
        """(bytes, busy seconds) since the last take; resets the counters."""
        with self._lock:
            busy = self._busy
            if self._inflight:
                now = time.perf_counter()
                busy += now - self._since
                self._since = now
            out = (self._bytes, busy)
            self._bytes, self._busy = 0, 0.0
            return out
