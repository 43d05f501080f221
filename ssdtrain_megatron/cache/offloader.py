"""ActivationOffloader: saved-tensor hooks that move activations to an IO engine and back."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import itertools
import logging
import queue
import time
from typing import Dict, Hashable, Iterable, Iterator, List, Optional, Set

import torch

from ..config import OffloadConfig
from ..io import IOEngine, make_engine
from ..io.memory import PoolFull
from ..io.layout import Identity, expand_file, free_bytes
from ..io import cleanup
from ..io.where import log_roots
from ..telemetry.stats import StepCounters, StepStats, append_jsonl
from ..telemetry.trace import IOTracer
from .adaptive import AdaptivePlanner
from .budget import ActivationBudget, give_back_readahead, resolve_budget
from .device_copy import DeviceCopy, StreamOps
from .identity import dedup_key, pass_reason, storage_ref
from .microbatch import MicroBatch
from .record import IN_FLIGHT, READS, RESIDENT, WRITES, State, TensorRecord

log = logging.getLogger(__name__)

DECISIONS = ("offload", "keep", "recompute")


def _is_disk_full(exc: Optional[BaseException]) -> bool:
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return True
        exc = exc.__cause__
    return False


class IOTimeout(RuntimeError):
    """An IO wait exceeded ``io_timeout_s``; the message says what was pending."""


# What engine.write may raise for a tensor it cannot take, documented as "keep it in memory
# instead": the host pool is full. Anything else raised there is a bug and propagates.
EXPECTED_WRITE_REFUSALS = (PoolFull,)

_DROP = object()
"""Event outcome: the last reference to a handle went away (the event's first item is the record)."""


class _Handle:
    """What autograd holds instead of an offloaded tensor. Dropping the last handle of a record
    (autograd frees saved tensors right after their backward node runs) releases it.

    ``__del__`` runs on whatever thread drops the last reference (autograd's device threads,
    the GC inside any allocation): it takes no lock and touches no state, it only queues the
    drop for the owner, which processes it at its next pack, unpack or step end."""

    __slots__ = ("record", "events")

    def __init__(self, record: TensorRecord, events: "queue.SimpleQueue") -> None:
        self.record = record
        self.events = events

    def __del__(self) -> None:
        self.events.put((self.record, _DROP))


def _relay(events: "queue.SimpleQueue", key: int, fut) -> None:
    """For an engine that returns Futures instead of reporting to ``completions``."""
    events.put((key, fut.exception()))


class ActivationOffloader:
    """Offload the activations autograd saves to SSD (or another engine) and bring them back.

    Forward runs inside ``microbatch(mb)`` (optionally ``layer(i)`` per layer); each saved
    tensor that is large enough, on the training device and not a parameter is handed to the
    IO engine and replaced by a small handle. Backward reads it back in reverse save order,
    a window of layers ahead; a tensor still in memory (write in flight, or still referenced)
    is forwarded without a read.

    Args:
        config: the settings (see OffloadConfig).
        device: the training device; default: the current CUDA device, else the CPU.
        engine: an IO engine to use instead of building ``config.engine`` (tests, benchmarks).
        streams: the streams/events/copies of the GPU data path (``cache/device_copy.py``);
            default: torch.cuda's on a CUDA device, none on the CPU. Tests pass a recording
            stand-in to check the ordering on a CPU device.

    Raises:
        ConfigError, EngineUnavailable, LayoutError: at construction, on bad settings or roots.
        StagingUnavailable: at construction on a GPU, when the pinned staging pool
            (``pinned_staging_bytes``) cannot be allocated.
        RuntimeError: at unpack, when a saved tensor was modified in place, or its read failed
            (the message names the file, offset and cause).
        BudgetTooSmall: in or right after the first step, when ``activation_budget_bytes``
            cannot hold one layer (cache/budget.py; the message has the numbers).
        ValueError: at construction, a budget given as a fraction of device memory off CUDA.

    Example:
        >>> with ActivationOffloader(OffloadConfig(dirs=["/mnt/nvme0/act"])) as off:
        ...     for mb, x in enumerate(batches):
        ...         with off.microbatch(mb):
        ...             loss = model(x)
        ...         loss.backward()
        ...     stats = off.end_step()
    """

    def __init__(self, config: OffloadConfig, device: Optional[torch.device] = None,
                 engine: Optional[IOEngine] = None, streams: Optional[StreamOps] = None) -> None:
        self.config = config
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
                else torch.device("cpu")
        self.device = torch.device(device)
        self._engine: Optional[IOEngine] = engine
        self._streams = streams
        self._closed = False
        if self._engine is None and config.policy != "keep":
            self._engine = make_engine(config)
        try:
            self._init_state(config)
        except BaseException:
            # A failed start leaves nothing on disk: the engine we built removes its rank
            # directories (and the job folders they leave empty). An engine handed in is the
            # caller's to close.
            self._closed = True
            if engine is None and self._engine is not None:
                self._engine.close()
            raise

    def _init_state(self, config: OffloadConfig) -> None:
        """Everything of ``__init__`` after the engine (which is already on disk)."""
        # The training thread owns every field below. IO threads report completions as
        # (record id, None or the exception) on this queue, and dropped handles arrive as
        # (record, _DROP); the owner drains it in pack, unpack, end_step and while it waits.
        self._events: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        if self._engine is not None:
            self._engine.completions = self._events
        # The GPU data path: copies on their own streams through pinned staging (or, for an
        # engine that moves device memory itself, gds, only the events that order it).
        self._copy: Optional[DeviceCopy] = None
        if self._engine is not None and (self.device.type == "cuda" or self._streams is not None):
            self._copy = DeviceCopy(self.device, config.staging_bytes(), self._streams,
                                    direct=getattr(self._engine, "device_direct", False))
        self._ids = itertools.count()
        self._records: Dict[int, TensorRecord] = {}
        self._dedup: Dict[tuple, tuple] = {}
        self._microbatches: Dict[Hashable, MicroBatch] = {}
        self._param_storages: Set[int] = set()
        self._current: Optional[MicroBatch] = None
        self._layer: Optional[Hashable] = None
        self._layer_decisions: Dict[Hashable, str] = {}
        self._inflight_bytes = 0
        # budget: room-making under activation_budget_bytes (cache/budget.py); None without one.
        limit = resolve_budget(config.activation_budget_bytes, self.device) if config.policy != "keep" else None
        self._budget = None if limit is None else ActivationBudget(
            limit, lambda: self._c.resident_bytes, self._drain, self._budget_write_deferred,
            self._budget_wait_event, lambda: self._inflight_bytes, self._budget_pinned)
        # plan: the adaptive planner decides per (micro-batch position, layer) under the budget.
        self._planner = AdaptivePlanner(config, limit) if config.policy == "adaptive" else None
        self._submit_s = 0.0  # budget/plan: training-thread seconds spent handing writes over
        self._c = StepCounters()
        self._step = 0
        self._step_started = self._step_first = time.perf_counter()
        self._warned: Set[str] = set()
        self.last_step_stats: Optional[StepStats] = None
        self.record_memory_timeline = False
        self.last_memory_timeline: List[tuple] = []
        self._phase = "forward"
        self._tracer: Optional[IOTracer] = None
        ident = getattr(self._engine, "ident", None) or Identity.detect(config.job_id())
        # Files, not directories: a restarted job (same command line) appends to them.
        self._stats_path = expand_file(config.stats_path, ident) if config.stats_path else None
        if config.trace_path and self._engine is not None:
            self._tracer = IOTracer(expand_file(config.trace_path, ident), ident.rank)
            self._engine.tracer = self._tracer.on_io
        cleanup.register(id(self), self._emergency_close)
        log_roots(self.rank_dirs, config)  # settings, where the bytes go; a warning for RAM (/tmp)

    # -- public API -------------------------------------------------------------------------

    @property
    def rank_dirs(self) -> List[str]:
        """This rank's directories (one per root) where its files live."""
        return list(getattr(self._engine, "rank_dirs", []))

    @property
    def engine(self) -> Optional[IOEngine]:
        return self._engine

    def register_parameters(self, params: Iterable[torch.Tensor]) -> None:
        """Never offload these tensors or any view of their storage."""
        for p in params:
            self._param_storages.add(p.untyped_storage()._cdata)

    def set_layer_decision(self, layer: Hashable, decision: str) -> None:
        """Plan for a layer: 'offload', 'keep' (stay in memory) or 'recompute' (labelled; the
        integration runs the layer under checkpointing)."""
        if decision not in DECISIONS:
            raise ValueError(f"decision={decision!r} is invalid; allowed: {', '.join(DECISIONS)}")
        self._layer_decisions[layer] = decision

    @contextlib.contextmanager
    def microbatch(self, key: Hashable) -> Iterator["ActivationOffloader"]:
        """Forward of micro-batch ``key``: saved tensors inside are recorded under it."""
        self._check_open()
        self._drain()
        if not self._microbatches:
            self._step_first = time.perf_counter()  # the step's first forward starts
        mb = self._microbatches.get(key)
        if mb is None:
            mb = self._microbatches[key] = MicroBatch(key)
            if self._planner is not None:  # plan: the micro-batch's position in the step
                self._planner.shape.forward(key)
        # Another micro-batch's forward runs first: the deferred last layers of every
        # micro-batch still waiting for backward will not be needed right away; write them.
        for other in self._microbatches.values():
            if other is not mb and not other.in_backward and other.deferred:
                self._submit_all(other.take_all_deferred())
        prev, prev_layer = self._current, self._layer
        self._current, self._layer = mb, None
        self._phase = "forward"
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            self._current, self._layer = prev, prev_layer

    @contextlib.contextmanager
    def layer(self, key: Hashable, decision: Optional[str] = None) -> Iterator[None]:
        """Forward of one layer (an int, or a tuple that sorts in forward order)."""
        if decision is not None:
            self.set_layer_decision(key, decision)
        forward = torch._C._current_graph_task_id() == -1  # not a recompute inside backward
        prev = self._layer
        self._layer = key
        mb = self._current
        if mb is not None and forward:
            idx = mb.enter_layer(key)
            keep = self.config.keep_last_layers
            self._submit_all(mb.take_deferred_before(idx - keep + 1) if keep else mb.take_all_deferred())
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._layer = prev
            if mb is not None and forward:
                self._c.layer(key, self.decision_for(key)).forward_s += time.perf_counter() - t0

    def decision_for(self, layer: Hashable) -> str:
        """What the plan says for a layer: 'offload', 'keep' or 'recompute'."""
        if self.config.policy == "keep":
            return "keep"
        mb = self._current.key if self._current else None
        if self._planner is not None:  # plan: per micro-batch position and layer
            d = self._planner.decision(mb, layer)
        else:
            d = self._layer_decisions.get(layer, "offload")
        if d == "offload" and self._budget is not None and self.config.recompute_fallback \
                and self._phase == "forward" and self._budget.recompute_instead(mb, layer):
            return "recompute"  # budget: the layer's bytes would not fit; run it recomputed
        return d

    def begin_backward(self, key: Hashable) -> None:
        """Hint: the backward of micro-batch ``key`` is next. Its deferred last layers stay in
        memory, and reads of its last layers start now, while other work runs."""
        self._drain()
        mb = self._microbatches.get(key)
        if mb is None:
            return
        self._enter_backward(mb)

    def enable_memory_timeline(self) -> None:
        """From the current step on, ``last_memory_timeline`` holds (seconds into the step,
        resident bytes) at every change of the last step (for plots; a list append per change)."""
        self.record_memory_timeline = True
        if self._c.timeline is None:
            self._c.timeline = []

    def poll(self) -> None:
        """Process what the IO threads and dropped handles reported so far (pack, unpack and
        end_step do this themselves): completed writes free their memory, released records
        their space on disk."""
        self._drain()

    def wait_writes(self) -> None:
        """Block until every write handed to the engine has completed (or failed)."""
        self._drain()
        self._wait_inflight_writes()

    def end_step(self) -> StepStats:
        """Finish the step: wait for IO, release what is left, emit and return StepStats."""
        self._check_open()
        self._phase = "step_end"
        self._drain()
        self._wait_all_io()
        leftovers = list(self._records.values())
        if leftovers:
            self._warn_once("leftover", f"end_step(): {len(leftovers)} saved tensors were never "
                            "released (a graph whose backward did not run?); releasing them, "
                            "and a later backward through them will fail")
            for r in leftovers:
                self._release(r, force=True)  # no IO is in flight after _wait_all_io
        if self._engine is not None:
            self._engine.end_step()
            self.check_free_space()
        write = self._engine.write_meter.take() if hasattr(self._engine, "write_meter") else (0, 0.0)
        read = self._engine.read_meter.take() if hasattr(self._engine, "read_meter") else (0, 0.0)
        now = time.perf_counter()
        # step_time_s from the step's first forward (what ran before it, e.g. another
        # model's step, is not this step's); iteration_time_s from the last end_step().
        first = max(self._step_first, self._step_started)
        stats = self._c.freeze(self._step, write, read,
                               self._engine.bytes_on_disk if self._engine else 0, now - first,
                               now - (first if self._step == 0 else self._step_started))
        stats = self._budget_step_end(stats)  # budget/plan: counters and what the planner needs
        if self._planner is not None:
            order = max((mb.layer_keys for mb in self._microbatches.values()), key=len, default=[])
            self._planner.update(stats, order, {r.layer: r for r in stats.layers}, len(self._microbatches))
        if self._c.timeline is not None:
            self.last_memory_timeline = [(t - self._step_first, b) for t, b in self._c.timeline]
        self._c = StepCounters(timeline=[] if self.record_memory_timeline else None)
        self._dedup.clear()
        self._microbatches.clear()
        self._step += 1
        self._step_started = now
        self.last_step_stats = stats
        if self._stats_path:
            append_jsonl(self._stats_path, stats, {"policy": self.config.policy})
        if self._tracer is not None:
            self._tracer.flush()
        log.debug("ssdtrain step %d: %s", stats.step, stats.summary())
        return stats

    def check_free_space(self, plan_bytes: Optional[List[int]] = None) -> List[str]:
        """Before a step: compare the free space of each root with what the step will need,
        ``plan_bytes`` (one number per root) or, by default, what the last step needed there.
        Warns once per directory, saying how much is missing; returns the warnings."""
        need = plan_bytes if plan_bytes is not None else getattr(self._engine, "step_peak_bytes", None)
        dirs = self.rank_dirs
        if not need or len(need) != len(dirs):
            return []
        short = []
        for d, n in zip(dirs, need):
            free = free_bytes(d)
            if n > free:
                msg = (f"the next step needs about {n / 2**20:.1f} MiB in {d} but only "
                       f"{free / 2**20:.1f} MiB are free: {(n - free) / 2**20:.1f} MiB missing; writes "
                       f"that do not fit will stay in memory (counted in StepStats.fallbacks)")
                short.append(msg)
                self._warn_once(f"space:{d}", msg)
        return short

    def close(self) -> None:
        """Release everything and remove every file and directory this offloader created."""
        if self._closed:
            return
        self._closed = True
        try:
            self._drain()
            self._wait_inflight_writes()
        except IOTimeout as exc:
            log.error("ssdtrain: closing with IO still pending: %s", exc)
        finally:
            for r in list(self._records.values()):
                self._release(r, force=True)
            if self._engine is not None:
                self._engine.close()
                self._engine.completions = None
            cleanup.unregister(id(self))

    def __enter__(self) -> "ActivationOffloader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- pack / unpack ----------------------------------------------------------------------

    def _pack(self, t: torch.Tensor):
        if torch._C._current_graph_task_id() != -1:
            # Saved while autograd's engine runs: the recompute pass of checkpointing. These
            # tensors are needed moments later by the same backward; keep them in memory.
            self._c.tensors_passed_through += 1
            return t
        cfg = self.config
        if t.numel() * t.element_size() < max(cfg.min_tensor_bytes, 1):  # the cheapest test first
            self._c.tensors_passed_through += 1
            return t
        storage = t.untyped_storage()
        if pass_reason(t, self.device, self._param_storages, cfg.min_tensor_bytes, storage) is not None:
            self._c.tensors_passed_through += 1
            return t
        if not self._events.empty():
            self._drain()
        key = dedup_key(t, storage)
        hit = self._dedup.get(key)
        if hit is not None:
            rec, sref = hit
            if rec.state != State.RELEASED and not sref.expired():
                rec.handles += 1
                if rec.state == State.WRITE_DROPPED:  # it has a user again
                    self._move(rec, State.WRITING)
                elif rec.state == State.READ_DROPPED:
                    self._move(rec, State.READING)
                cur = self._current
                if cur is None or cur.key != rec.microbatch:
                    rec.shared = True
                else:
                    rec.last_pos = max(rec.last_pos, cur.position)
                self._c.bytes_deduplicated += rec.nbytes
                return _Handle(rec, self._events)
        mb = self._current
        layer = self._layer
        rec = TensorRecord(next(self._ids), t, mb.key if mb else None, layer)
        rec.handles = 1
        rec.decision = self.decision_for(layer)
        if self._budget is not None:  # budget: room for this record before it counts as resident
            self._budget_admit(rec)
        self._records[rec.id] = rec
        self._dedup[key] = (rec, storage_ref(t, storage))
        self._c.add_resident(rec.nbytes)
        acc = self._c.layer(layer, rec.decision)
        acc.bytes += rec.nbytes
        acc.tensors += 1
        if mb is not None:
            rec.pos = rec.last_pos = mb.position
            mb.records.append(rec)
        if rec.decision == "keep":
            self._move(rec, State.KEPT)
        elif mb is not None and mb.annotated and cfg.keep_last_layers:
            mb.deferred.append(rec)  # written once later layers prove it is not among the last
        else:
            self._submit(rec)
        return _Handle(rec, self._events)

    def _unpack(self, handle):
        if isinstance(handle, torch.Tensor):
            return handle
        if not self._events.empty():
            self._drain()
        rec: TensorRecord = handle.record
        # A tensor shared by several micro-batches says nothing about where any one of
        # their backwards is; one saved again by later layers is needed until the latest.
        mb = None if rec.shared else self._microbatches.get(rec.microbatch)
        if mb is not None and not mb.in_backward:
            self._enter_backward(mb)
        out = self._materialize(rec)
        if mb is not None:
            mb.consumed(rec)
            idx = rec.last_pos
            if mb.backward_layer is None or idx < mb.backward_layer:
                mb.backward_layer = idx
            self._prefetch(mb)
        return out

    # -- internals (training thread) --------------------------------------------------------

    def _move(self, rec: TensorRecord, new: int) -> None:
        """The one place a record changes state, and the one place the step's counters
        follow what happened to a tensor (record.TRANSITIONS says what each transition counts)."""
        was = rec.state in RESIDENT
        effects = rec.move(new)
        now = new in RESIDENT
        c = self._c
        if was != now:
            c.add_resident(rec.nbytes if now else -rec.nbytes)
        for e in effects:
            if e == "offloaded":
                c.bytes_offloaded += rec.nbytes
                c.tensors_offloaded += 1
                c.layer(rec.layer, rec.decision).bytes_offloaded += rec.nbytes
            elif e == "forwarded":
                c.tensors_forwarded += 1
            elif e == "read":
                c.bytes_read += rec.nbytes
            elif e == "kept":
                c.tensors_kept += 1
            elif e == "fallback":
                c.fallbacks += 1

    def _drain(self) -> None:
        """Process every event queued so far (IO completions, dropped handles)."""
        events = self._events
        while not events.empty():
            self._on_event(*events.get_nowait())

    def _on_event(self, what, outcome) -> None:
        if outcome is _DROP:
            rec = what
            rec.handles -= 1
            if rec.handles == 0:
                self._release(rec)
            return
        rec = self._records.get(what)
        if rec is None:  # released by close() while its IO hung
            return
        if rec.state in WRITES:
            self._write_done(rec, outcome)
        elif rec.state in READS:
            self._read_done(rec, outcome)
        else:
            raise RuntimeError(f"ssdtrain internal error: IO completed for record {rec.id} "
                               f"in state {rec.state_name}")

    def _next_event(self, deadline: float) -> bool:
        """Wait for one event until ``deadline`` and process it; False on timeout. An error
        raised while processing it (a failed finish_read) reaches the caller as it is."""
        left = deadline - time.perf_counter()
        try:
            item = self._events.get(timeout=left) if left > 0 else self._events.get_nowait()
        except queue.Empty:
            return False
        self._on_event(*item)
        return True

    def _submit_all(self, records: List[TensorRecord]) -> None:
        for rec in records:
            if rec.state == State.SAVED:
                self._submit(rec)

    def _submit(self, rec: TensorRecord) -> None:
        """Hand a SAVED record to the engine, after back-pressure allows it."""
        cap = self.config.max_inflight_bytes
        if self._inflight_bytes and self._inflight_bytes + rec.nbytes > cap:
            self._drain()
            t0 = time.perf_counter()
            deadline = t0 + self.config.io_timeout_s
            while self._inflight_bytes and self._inflight_bytes + rec.nbytes > cap:
                if not self._next_event(deadline):
                    raise IOTimeout(f"waited {self.config.io_timeout_s:g}s for {self._inflight_bytes} "
                                    f"bytes of writes to finish before writing a {rec.describe()}")
            self._count_wait(rec, time.perf_counter() - t0)
        self._move(rec, State.WRITING)
        self._inflight_bytes += rec.nbytes
        if self._tracer is not None:
            self._tracer.tag(rec.id, self._step, rec.microbatch, rec.layer, self._phase)
        t_submit = time.perf_counter()  # budget/plan: the training thread's cost of offloading
        try:
            if self._copy is not None:  # GPU: the engine gets pinned bytes and a copy event
                data, event, rec.transfer = self._copy.stage_out(rec)
            else:
                data, event = rec.bytes_view(), None
            fut = self._engine.write(rec.id, data, event)
        except EXPECTED_WRITE_REFUSALS as exc:  # nothing started (the memory pool is full): keep it
            self._written(rec)
            self._inflight_bytes -= rec.nbytes
            self._fallback(rec, exc)
            return
        except BaseException:  # an engine bug: the caller sees it; the tensor stays usable
            self._written(rec)
            self._inflight_bytes -= rec.nbytes
            self._move(rec, State.KEPT)
            raise
        self._submit_s += time.perf_counter() - t_submit  # budget/plan: (end of the measured part)
        if fut is not None:  # an engine without ``completions``
            fut.add_done_callback(functools.partial(_relay, self._events, rec.id))

    def _write_done(self, rec: TensorRecord, exc: Optional[BaseException]) -> None:
        """A write finished (or failed)."""
        self._written(rec)
        self._inflight_bytes -= rec.nbytes
        if exc is not None:
            # Its extent stays allocated until the record is released (_release), as a
            # written one's would: the slab's high-water mark, which the next step's
            # free-space check goes by, is then the step's demand whatever the disk held.
            self._fallback(rec, exc)
            return
        dropped = rec.state == State.WRITE_DROPPED
        t = rec.tensor
        if t is not None and t._version != rec.version:
            rec.error = (f"a {rec.describe()} was modified in place while it was being "
                         f"offloaded (version {rec.version} -> {t._version})")
            self._move(rec, State.ON_DISK if dropped else State.BROKEN)
            rec.tensor = None
        elif rec.state == State.WRITING_WANTED:
            self._move(rec, State.READY)  # backward already has it: keep our reference
        else:
            self._move(rec, State.ON_DISK)
            rec.tensor = None  # our copy is on disk; the memory goes when the model drops it
        if dropped:
            self._release(rec)

    def _written(self, rec: TensorRecord) -> None:
        """The engine is done with a write's bytes (written, failed, refused or cancelled): a
        GPU record's pinned staging block goes back to the pool."""
        if rec.transfer is not None:
            self._copy.written(rec.transfer)
            rec.transfer = None

    def _fallback(self, rec: TensorRecord, exc: BaseException) -> None:
        # A full disk is warned on its own, even after an IO error was: the user acts on it.
        self._warn_once("disk-full" if _is_disk_full(exc) else "fallback",
                        f"offload write failed, keeping tensors in memory instead "
                        f"(counted in StepStats.fallbacks): {exc}")
        dropped = rec.state == State.WRITE_DROPPED
        self._move(rec, State.KEPT)
        if dropped:
            self._release(rec)

    def _enter_backward(self, mb: MicroBatch) -> None:
        mb.in_backward = True
        if self._planner is not None:  # plan: how the micro-batches interleave
            self._planner.shape.backward(mb.key)
        self._phase = "backward"
        for rec in mb.take_all_deferred():  # its last layers: backward needs them right away
            if rec.state == State.SAVED:
                self._move(rec, State.KEPT)
        self._prefetch(mb)

    def _prefetch(self, mb: MicroBatch) -> None:
        if self._engine is None:
            return
        candidates = mb.prefetch_candidates(self.config.prefetch_layers, self.config.max_inflight_bytes)
        for i, rec in enumerate(candidates):
            if rec.state == State.WRITING:
                self._move(rec, State.WRITING_WANTED)  # forwarded from memory when the write completes
            elif self._budget is not None and not self._budget.room_to_read(rec.nbytes):
                give_back_readahead(mb, candidates[i:])  # budget: read ahead less
                return
            else:
                self._start_read(rec)

    def _start_read(self, rec: TensorRecord) -> None:
        alive = rec.ref()
        if alive is not None:  # still referenced elsewhere: no IO needed
            rec.tensor = alive.detach()
            self._move(rec, State.READY)
            return
        event = None
        if self._copy is not None:  # GPU: the engine reads into pinned staging (gds: in place)
            restored, target, event = self._copy.stage_in(rec)
        else:
            restored, target = rec.allocate_restore()
        rec.tensor = restored
        self._move(rec, State.READING)
        if self._tracer is not None:
            self._tracer.tag(rec.id, self._step, rec.microbatch, rec.layer, self._phase)
        fut = self._engine.read(rec.id, target, event)
        if fut is not None:  # an engine without ``completions``
            fut.add_done_callback(functools.partial(_relay, self._events, rec.id))

    def _read_done(self, rec: TensorRecord, exc: Optional[BaseException]) -> None:
        """A read finished (or failed). ``finish_read`` runs here, on the training thread: if
        it raises (out of memory), the caller of pack/unpack/end_step gets that error."""
        dropped = rec.state == State.READ_DROPPED
        if exc is not None:
            rec.error = f"reading back a {rec.describe()} failed: {exc}"
            rec.tensor = None
            if self._copy is not None:
                self._copy.read_failed(rec)  # its staging is free
            self._move(rec, State.BROKEN)
        else:
            try:
                if self._copy is not None:
                    self._copy.finish_in(rec)  # host->device on the reload stream
                else:
                    rec.finish_read()
            except BaseException:
                rec.error = f"finishing the read of a {rec.describe()} failed"
                rec.tensor = None
                self._move(rec, State.BROKEN)
                raise
            self._move(rec, State.READY)
        if dropped:
            self._release(rec)

    def _materialize(self, rec: TensorRecord) -> torch.Tensor:
        """The record's tensor for backward, waiting for IO if needed."""
        s = rec.state
        if s == State.RELEASED:
            raise RuntimeError(f"a {rec.describe()} saved for backward was already released "
                               "(end_step() or close() ran before this backward)")
        if s == State.ON_DISK:
            if self._budget is not None and not self._budget.make_room(rec.nbytes):  # budget: wait for writes
                self._budget.overrun(rec.nbytes, self._step, f"reading back a {rec.describe()}")
            self._start_read(rec)
        elif s == State.WRITING:
            self._move(rec, State.WRITING_WANTED)  # keep our reference when the write completes
        if rec.state == State.READING:
            self._wait_record(rec)
        if rec.state == State.BROKEN:
            raise RuntimeError(rec.error)
        out = rec.tensor
        if self._copy is not None:
            self._copy.consume(rec, out)  # the current stream waits for the reload
        rec.check_version(rec.ref())
        return out

    def _wait_record(self, rec: TensorRecord, count: bool = True) -> None:
        if rec.state not in IN_FLIGHT:
            return
        t0 = time.perf_counter()
        deadline = t0 + self.config.io_timeout_s
        while rec.state in IN_FLIGHT:
            if not self._next_event(deadline):
                raise IOTimeout(f"waited {self.config.io_timeout_s:g}s for the "
                                f"{rec.state_name} of a {rec.describe()} (record {rec.id})")
        if count:
            self._count_wait(rec, time.perf_counter() - t0)

    def _wait_inflight_writes(self) -> None:
        deadline = time.perf_counter() + self.config.io_timeout_s
        while self._inflight_bytes:
            if not self._next_event(deadline):
                raise IOTimeout(f"waited {self.config.io_timeout_s:g}s for {self._inflight_bytes} "
                                "bytes of pending writes")

    def _wait_all_io(self) -> None:
        """Wait for every pending write and read (releases deferred to their completion run)."""
        self._wait_inflight_writes()
        for rec in list(self._records.values()):
            self._wait_record(rec, count=False)

    def _count_wait(self, rec: TensorRecord, seconds: float) -> None:
        self._c.io_wait_s += seconds
        self._c.layer(rec.layer, rec.decision).io_wait_s += seconds

    def _release(self, rec: TensorRecord, force: bool = False) -> None:
        s = rec.state
        if s == State.RELEASED:
            return
        if s in IN_FLIGHT and not force:
            # IO in flight on its extent and memory: free both when it completes, unless it
            # is a write no IO thread has started, which is taken back now.
            if s in WRITES:
                if s != State.WRITE_DROPPED:
                    self._move(rec, State.WRITE_DROPPED)
                if not self._engine.cancel(rec.id):
                    return
                self._written(rec)  # never started: its staging is free
                self._inflight_bytes -= rec.nbytes
            else:
                if s != State.READ_DROPPED:
                    self._move(rec, State.READ_DROPPED)
                return
        self._move(rec, State.RELEASED)
        if self._engine is not None:
            self._engine.release(rec.id)  # frees its extent at once (no-op if never written)
        if self._tracer is not None:
            self._tracer.forget(rec.id)
        rec.tensor = None
        rec.transfer = None
        self._records.pop(rec.id, None)
        mb = self._microbatches.get(rec.microbatch)
        if mb is not None:
            mb.consumed(rec)

    # -- budget (cache/budget.py) and the planner's measurements ------------------------------

    def _budget_admit(self, rec: TensorRecord) -> None:
        """Room for a new record; a record the plan keeps is written when keeping it would
        leave too little room for a layer's backward."""
        b = self._budget
        if not b.make_room(rec.nbytes):
            b.overrun(rec.nbytes, self._step, f"saving a {rec.describe()} in layer {rec.layer}")
        if rec.decision == "keep" and not b.may_keep(rec.nbytes):
            rec.decision = "offload"

    def _budget_write_deferred(self) -> int:
        """Write the deferred last-layer records of every micro-batch still in forward."""
        n = 0
        for mb in list(self._microbatches.values()):
            if not mb.in_backward and mb.deferred:
                records = mb.take_all_deferred()
                n += len(records)
                self._submit_all(records)
        return n

    def _budget_pinned(self) -> int:
        """Resident bytes no write will free: not in flight, not deferred (those can be written)."""
        deferred = sum(r.nbytes for mb in self._microbatches.values() for r in mb.deferred
                       if r.state == State.SAVED)
        return self._c.resident_bytes - self._inflight_bytes - deferred

    def _budget_wait_event(self) -> bool:
        if not self._next_event(time.perf_counter() + self.config.io_timeout_s):
            raise IOTimeout(f"waited {self.config.io_timeout_s:g}s for {self._inflight_bytes} bytes "
                            "of writes to finish to stay within activation_budget_bytes")
        return True

    def _budget_step_end(self, stats: StepStats) -> StepStats:
        """The step's budget counters and the training thread's offload cost, into its stats."""
        n = max(len(self._microbatches), 1)
        extra = {"offload_submit_s": self._submit_s}
        if self._planner is not None:
            extra["plan"] = self._planner.rows()
        self._submit_s = 0.0
        if self._budget is not None:
            largest = max((r.bytes // n for r in stats.layers), default=0)
            for r in stats.layers:
                self._budget.learn_layer(r.layer, r.bytes // n, r.decision)
            for layer in self._budget.recomputed_layers():  # a budget recompute lasts one step
                if self._layer_decisions.get(layer) == "recompute":
                    del self._layer_decisions[layer]
            extra.update(self._budget.end_step(largest, self._step).as_fields(self._budget.limit))
        return dataclasses.replace(stats, **extra)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("ssdtrain: %s", message)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("ActivationOffloader is closed")

    def _emergency_close(self) -> None:
        """Signal/exit path: remove files now; do not wait for anything."""
        self._closed = True
        if self._engine is not None:
            self._engine.remove_files()
