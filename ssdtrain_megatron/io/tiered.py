"""The 'tiered' engine: a host-memory tier of ``host_memory_bytes`` and an SSD tier.

Why: host RAM is the nearest place for an activation after the GPU, but there is rarely enough
of it for a whole step; the drives take the rest. Which tier a tensor goes to is the plan's
choice, not the order of arrival: the last layers' activations come back first and want the
near tier, the first layers' have the whole forward pass to be written and the whole backward
pass to come back, so they go to SSD. The offloader says where each key goes (``place``, from
its per-layer decision 'host' or 'ssd', from the adaptive plan or, with policy 'offload', by
layer from the last step: cache/four_places.py) before handing it over; a key it says nothing
about (decision 'offload') goes to host memory while it has room and to SSD beyond,
first-come, as before plans existed. A key placed on 'host' that no longer fits there goes to SSD (counted in
``host_spilled``): host memory is never exceeded. The tier is chosen once, at ``write``, and
remembered per key, so reads come from whichever tier holds the tensor and no tensor ever
migrates (a migration would be IO competing with the step's own).

``bandwidth_cap_gbps`` caps the SSD tier only (io/throttle.py): it emulates a slower drive, and
host memory is not a drive.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch

from ..config import OffloadConfig
from .base import BusyMeter, EngineError, IOEngine
from .layout import Identity
from .memory import MemoryEngine, PoolFull
from .posix import PosixEngine
from .throttle import ThrottledEngine

TIERS = ("host", "ssd")
"""The places ``place`` accepts (IOEngine.tier of the memory and of the SSD tier)."""


class TieredEngine(IOEngine):
    """A :class:`MemoryEngine` of ``host_memory_bytes`` beside a :class:`PosixEngine`.

    ``bytes_on_disk`` counts both tiers (bytes held for live keys); ``bytes_in_memory`` and
    ``bytes_on_ssd`` split it. ``tensors_spilled`` counts writes that went to SSD because the
    memory tier was full (placed on 'host', or not placed); ``host_spilled`` the part of them
    the plan had placed on 'host'. ``tier_meters()`` gives each tier's own traffic.
    """

    name = "tiered"

    def __init__(self, config: OffloadConfig, ident: Optional[Identity] = None) -> None:
        self.config = config
        self.memory = MemoryEngine(config, ident)
        try:
            ssd: IOEngine = PosixEngine(config, ident)
        except BaseException:
            self.memory.close()
            raise
        if config.bandwidth_cap_gbps is not None:  # a slower drive: the SSD tier only
            ssd = ThrottledEngine(ssd, config.bandwidth_cap_gbps, config.io_cpus)
        self.ssd = ssd
        self.ident = self.ssd.ident
        self.rank_dirs: List[str] = self.ssd.rank_dirs
        self._tier: Dict[int, IOEngine] = {}
        self._reserved: Set[int] = set()  # keys with a memory-tier pool_view, not yet written
        self._placed: Dict[int, str] = {}  # key -> 'host' or 'ssd', said by place(), not yet written
        self._pending: Dict[int, Tuple[BusyMeter, int]] = {}  # key -> its request's meter, bytes
        self._completions = None
        self._lock = threading.Lock()
        self.tensors_spilled = 0
        self.host_spilled = 0
        # Both tiers' traffic, as one device would show it to the offloader's telemetry.
        self.write_meter = BusyMeter()
        self.read_meter = BusyMeter()

    @property
    def bytes_on_disk(self) -> int:
        return self.memory.bytes_in_memory + self.ssd.bytes_on_disk

    @property
    def bytes_in_memory(self) -> int:
        return self.memory.bytes_in_memory

    @property
    def bytes_on_ssd(self) -> int:
        return self.ssd.bytes_on_disk

    @property
    def page_cache_bypassed(self) -> bool:
        return self.ssd.page_cache_bypassed

    @property
    def step_peak_bytes(self) -> List[int]:
        """Per root, the SSD bytes the last step reached (the memory tier needs no disk)."""
        return self.ssd.step_peak_bytes

    @property
    def tracer(self) -> Optional[Callable[..., None]]:
        return self.ssd.tracer

    @tracer.setter
    def tracer(self, sink: Optional[Callable[..., None]]) -> None:
        self.memory.tracer = sink
        self.ssd.tracer = sink

    @property
    def completions(self):
        return self._completions

    @completions.setter
    def completions(self, sink) -> None:
        """Both tiers report to :meth:`report`, which counts the request in this
        engine's meters and passes it on to ``sink`` (see IOEngine.completions)."""
        self._completions = sink
        relay = None if sink is None else _Relay(self)
        self.memory.completions = relay
        self.ssd.completions = relay

    def place(self, key: int, tier: str) -> None:
        """``key`` goes to ``tier`` ('host' or 'ssd'); said before ``pool_view``/``write``."""
        if tier not in TIERS:
            raise EngineError(f"tier {tier!r} of key {key} is invalid: expected one of {', '.join(TIERS)}")
        with self._lock:
            self._placed[key] = tier

    def tier_meters(self) -> Dict[str, Tuple[BusyMeter, BusyMeter]]:
        """Each tier's (write, read) meters: the host tier's copies and the SSD tier's IO
        (the emulated drive's, under ``bandwidth_cap_gbps``)."""
        return {"host": (self.memory.write_meter, self.memory.read_meter),
                "ssd": (self.ssd.write_meter, self.ssd.read_meter)}

    def pool_view(self, key: int, nbytes: int) -> Optional[torch.Tensor]:
        """The memory tier's extent for ``key`` (see IOEngine.pool_view), or None when it is
        full or ``key`` is placed on 'ssd': the tensor then goes to SSD through the
        offloader's staging."""
        with self._lock:
            if self._placed.get(key) == "ssd":
                return None
        try:
            view = self.memory.pool_view(key, nbytes)
        except PoolFull:
            return None
        with self._lock:
            self._reserved.add(key)
        self._begin(key, self.write_meter, nbytes)  # the copy into it starts now (as the tier's)
        return view

    def commit(self, key: int) -> None:
        """The offloader's copy into the memory tier's ``pool_view`` ran: stored there."""
        with self._lock:
            if key not in self._reserved:
                raise EngineError(f"commit of key {key}, which has no memory-tier pool_view")
            self._reserved.discard(key)
            self._placed.pop(key, None)
            self._tier[key] = self.memory
        self.memory.commit(key)
        self._end(key)

    def pool_read(self, key: int, started: bool) -> None:
        with self._lock:
            if self._tier.get(key) is not self.memory:
                return
        self.memory.pool_read(key, started)
        if started:
            self._begin(key, self.read_meter, self.memory.stored_bytes(key))
        else:
            self._end(key)

    def pool_view_of(self, key: int) -> Optional[torch.Tensor]:
        with self._lock:
            tier = self._tier.get(key)
        return self.memory.pool_view_of(key) if tier is self.memory else None

    def fence(self, key: int, event: object) -> None:
        self.memory.fence(key, event)  # only memory-tier keys have pool_view memory

    def write(self, key: int, data: torch.Tensor, ready_event: Optional[object] = None) -> Optional[Future]:
        with self._lock:
            if key in self._tier:
                raise EngineError(f"key {key} written twice")
            reserved = key in self._reserved
            self._reserved.discard(key)
            placed = self._placed.pop(key, None)
        nbytes = data.nbytes
        queued = self._completions is not None
        if queued and not reserved:  # before the request exists: it may complete before write() returns
            self._begin(key, self.write_meter, nbytes)  # (a pool_view began it already)
        # Placed on 'ssd': straight there (a pool_view reservation means the host tier already
        # holds the bytes, whatever the hint said). Else host memory, and SSD when it is full.
        tier: IOEngine = self.ssd if placed == "ssd" and not reserved else self.memory
        try:
            try:
                fut = tier.write(key, data, ready_event)
            except PoolFull:
                if reserved:
                    raise
                tier = self.ssd
                fut = self.ssd.write(key, data, ready_event)
                with self._lock:
                    self.tensors_spilled += 1
                    self.host_spilled += placed == "host"
        except BaseException:
            if queued and not reserved:
                self._end(key)
            if reserved:  # its pool_view extent is still the memory tier's: release() frees it
                with self._lock:
                    self._reserved.add(key)
            raise
        with self._lock:
            self._tier[key] = tier
        return None if queued else self._metered(fut, self.write_meter, nbytes)

    def report(self, item: Tuple[int, Optional[BaseException]]) -> None:
        """A tier's request completed (any thread): count it in this engine's meter, then
        pass it on to the caller's completions queue."""
        self._end(item[0])
        sink = self._completions
        if sink is not None:
            sink.put(item)

    def _begin(self, key: int, meter: BusyMeter, nbytes: int) -> None:
        with self._lock:
            self._pending[key] = (meter, nbytes)
        meter.begin()

    def _end(self, key: int) -> None:
        with self._lock:
            pending = self._pending.pop(key, None)
        if pending is not None:  # None: released meanwhile (close() after a hung request)
            pending[0].end(pending[1])

    @staticmethod
    def _metered(fut: Future, meter: BusyMeter, nbytes: int) -> Future:
        """A Future that completes after ``meter`` has counted ``fut``."""
        out: Future = Future()
        meter.begin()

        def done(f: Future) -> None:
            meter.end(nbytes)
            exc = f.exception()
            if exc is not None:
                out.set_exception(exc)
            else:
                out.set_result(f.result())

        fut.add_done_callback(done)
        return out

    def read(self, key: int, out: torch.Tensor, ready_event: Optional[object] = None) -> Optional[Future]:
        with self._lock:
            tier = self._tier.get(key)
        if tier is None:
            raise EngineError(f"read of unknown key {key}")
        if self._completions is None:
            return self._metered(tier.read(key, out, ready_event), self.read_meter, out.nbytes)
        self._begin(key, self.read_meter, out.nbytes)
        try:
            tier.read(key, out, ready_event)
        except BaseException:
            self._end(key)
            raise
        return None

    def cancel(self, key: int) -> bool:
        with self._lock:
            tier = self._tier.get(key)
        if tier is None or not tier.cancel(key):
            return False
        if self._completions is not None:
            self._end(key)
        return True

    def tier_of(self, key: int) -> str:
        """'memory' or 'posix': where ``key`` is stored (the SSD tier is 'posix' under a cap too)."""
        with self._lock:
            tier = self._tier.get(key)
        if tier is None:
            raise EngineError(f"unknown key {key}")
        return "memory" if tier is self.memory else "posix"

    def release(self, key: int) -> None:
        with self._lock:
            self._placed.pop(key, None)
            tier = self._tier.pop(key, None)
            if key in self._reserved:  # a pool_view that was never written
                self._reserved.discard(key)
                tier = self.memory
            pending = self._pending.pop(key, None)  # its meter's operation never reported
        if pending is not None:
            pending[0].end(0)
        if tier is not None:
            tier.release(key)

    def end_step(self) -> None:
        self.memory.end_step()
        self.ssd.end_step()

    def close(self) -> None:
        with self._lock:
            self._tier.clear()
            self._placed.clear()
        try:
            self.memory.close()
        finally:
            self.ssd.close()

    def remove_files(self) -> None:
        self.ssd.remove_files()


class _Relay:
    """What the tiers report completions to when the caller uses a completions queue."""

    __slots__ = ("owner",)

    def __init__(self, owner: TieredEngine) -> None:
        self.owner = owner

    def put(self, item: Tuple[int, Optional[BaseException]]) -> None:
        self.owner.report(item)
