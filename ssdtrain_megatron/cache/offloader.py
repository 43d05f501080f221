"""ActivationOffloader: saved-tensor hooks that move activations to an IO engine and back.

The one public face of ``cache/``. It builds the engine (unless given one) and composes the
parts, each of which owns its state and receives its collaborators here:

- ``hooks.py`` (:class:`SavedTensorHooks`): pack and unpack, the micro-batch and layer scopes;
- ``table.py`` (:class:`RecordTable`): records by id and identity, micro-batches, storages
  never taken (parameters, held until backward);
- ``transfers.py`` (:class:`Transfers`): the engine, the GPU copy layer and the restore pool:
  submit, complete, cancel, prefetch, read, materialize, wait, release; the activation budget;
- ``decisions.py`` (:class:`Decisions`): keep / offload / recompute per layer, from the policy,
  the adaptive planner and the budget;
- ``step.py``: the step in progress (number, phase, counters) and the warn-once log they share.

A record's states and the transitions between them are one table (``lifecycle.py``). What is
left here: the public API, the step's end (statistics, files) and the job's (close).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import time
from typing import Hashable, Iterable, Iterator, List, Optional

import torch

from ..config import OffloadConfig
from ..io import IOEngine, cleanup, make_engine
from ..io.layout import Identity, expand_file, file_base, space_shortfalls
from ..io.roots import log_roots
from ..telemetry.append import AppendFile
from ..telemetry.stats import StepStats, append_jsonl, append_line, run_header
from ..telemetry.tiers import tier_traffic
from ..telemetry.trace import IOTracer
from .adaptive import AdaptivePlanner
from .budget import resolve_budget
from .decisions import DECISIONS, Decisions
from .device_copy import DeviceCopy, StreamOps
from .four_places import TierPlacement
from .hooks import SavedTensorHooks, capture_query
from .restore_pool import RestorePool
from .silence import OffloadWatch
from .step import Step, WarnOnce
from .table import RecordTable
from .transfers import EXPECTED_WRITE_REFUSALS, IOTimeout, Transfers

__all__ = ["ActivationOffloader", "DECISIONS", "EXPECTED_WRITE_REFUSALS", "IOTimeout"]

log = logging.getLogger(__name__)


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
        ValueError: at construction, a budget given as a fraction of device memory off CUDA.
        RuntimeError: at unpack, when a saved tensor was modified in place, or its read failed
            (the message names the file, offset and cause).
        BudgetTooSmall: in or right after the first step, when ``activation_budget_bytes``
            cannot hold one layer (cache/budget.py; the message has the numbers).

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
        self._closed = False
        self._closed_by: Optional[int] = None  # the signal whose cleaners closed it (cleanup.py)
        if self._engine is None and config.policy != "keep":
            self._engine = make_engine(config)
        try:
            self._compose(config, streams)
        except BaseException:
            # A failed start leaves nothing on disk: the engine we built removes its rank
            # directories (and the job folders they leave empty). An engine handed in is the
            # caller's to close.
            self._closed = True
            if engine is None and self._engine is not None:
                self._engine.close()
            raise

    def _compose(self, config: OffloadConfig, streams: Optional[StreamOps]) -> None:
        """The parts (module docstring), built in the order they depend on each other."""
        # IO threads report completions as (record id, None or the exception) on this queue,
        # dropped handles as (record, DROP); the training thread drains it (Transfers.drain).
        events: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        if self._engine is not None:
            self._engine.completions = events
        # The GPU data path: copies on their own streams through pinned staging (or, for an
        # engine that moves device memory itself, gds, only the events that order it).
        copy: Optional[DeviceCopy] = None
        if self._engine is not None and (self.device.type == "cuda" or streams is not None):
            copy = DeviceCopy(self.device, config.staging_bytes(), streams, direct=self._engine.device_direct)
        limit = resolve_budget(config.activation_budget_bytes, self.device) if config.policy != "keep" else None
        planner = AdaptivePlanner(config, limit) if config.policy == "adaptive" else None
        # tiers: policy offload on the tiered engine places each layer by the last step (four_places.py)
        placement = TierPlacement(config.host_memory_bytes) \
            if config.policy == "offload" and config.engine == "tiered" else None
        ident = (self._engine.ident if self._engine is not None else None) or Identity.detect(config.job_id())
        self._tracer: Optional[IOTracer] = None
        if config.trace_path and self._engine is not None:
            self._tracer = IOTracer(expand_file(config.trace_path, ident), ident.rank, file_base(config.trace_path))
            self._engine.tracer = self._tracer.on_io
        self._step = Step()
        self._warn = WarnOnce()
        self._table = RecordTable()
        # Without a GPU data path: restored tensors reuse the memory earlier ones had (restore_pool.py).
        self._transfers = Transfers(config, self._engine, copy, RestorePool(config.max_inflight_bytes),
                                    self._table, self._step, events, self._warn, limit, self._tracer,
                                    time_submit=limit is not None or planner is not None)
        self._decisions = Decisions(config, self._transfers.budget, planner, placement)
        self._capturing = capture_query(copy)  # CUDA graphs (hooks.py)
        self._hooks = SavedTensorHooks(config, self.device, self._table, self._transfers, self._decisions,
                                       self._step, events, self._capturing)
        self._copy = copy
        self._timeline = None  # record_timeline()
        self._tracer_before: Optional[tuple] = None  # the engine's own trace sink, while recording
        self._step_started = self._step_first = time.perf_counter()
        self.watch = OffloadWatch(self.device, config.min_bytes_for(self.device),
                                  self._engine is not None and config.policy != "keep")  # silence.py
        self.last_step_stats: Optional[StepStats] = None
        self.record_memory_timeline = False
        self.last_memory_timeline: List[tuple] = []
        # Files, not directories: a restarted job (same command line) appends to them.
        self._stats_file = AppendFile(expand_file(config.stats_path, ident), file_base(config.stats_path),
                                      "--ssd-offload-stats-path") if config.stats_path else None
        # The run's header line goes before its first step's (readers split appended runs there).
        self._stats_header: Optional[dict] = run_header(ident.job, ident.rank, time.time(), config.to_dict()) \
            if self._stats_file else None
        # A token object, not id(self): an id is reused once this offloader is gone.
        self._cleanup_token = object()
        cleanup.register(self._cleanup_token, self._emergency_close)
        log_roots(self.rank_dirs, config)  # settings, where the bytes go; a warning for RAM (/tmp)

    # -- the parts, for tools and tests --------------------------------------------------------

    @property
    def hooks(self) -> SavedTensorHooks:
        """Pack and unpack (``hooks.py``)."""
        return self._hooks

    @property
    def table(self) -> RecordTable:
        """The records (``table.py``)."""
        return self._table

    @property
    def transfers(self) -> Transfers:
        """The transfer machine (``transfers.py``)."""
        return self._transfers

    @property
    def step(self) -> Step:
        """The step in progress: its number, phase and running counters (``step.py``)."""
        return self._step

    @property
    def copy(self) -> Optional[DeviceCopy]:
        """The GPU data path (``device_copy.py``), or None."""
        return self._copy

    # -- public API -------------------------------------------------------------------------

    @property
    def rank_dirs(self) -> List[str]:
        """This rank's directories (one per root) where its files live."""
        return list(self._engine.rank_dirs) if self._engine is not None else []

    @property
    def engine(self) -> Optional[IOEngine]:
        return self._engine

    @property
    def planner(self) -> Optional[AdaptivePlanner]:
        """The adaptive planner (policy 'adaptive'; None otherwise): its ``selection`` says
        whether measured selection has settled, after how many steps, and what it measured."""
        return self._decisions.planner

    def register_parameters(self, params: Iterable[torch.Tensor]) -> None:
        """Never offload these tensors or any view of their storage."""
        self._table.register_parameters(params)

    def register_held(self, tensors: Iterable[Optional[torch.Tensor]]) -> None:
        """Tensors something else keeps in memory until this step's backward (a pipeline
        stage's received input): saved tensors on their storage pass through, counted in
        ``tensors_held_by_schedule`` (held.py). Forgotten at the step's end; None is skipped."""
        self._table.register_held(tensors, self.device)

    def set_layer_decision(self, layer: Hashable, decision: str) -> None:
        """Plan for a layer: 'offload' (the engine's default tier), 'host' or 'ssd' (that tier
        of the tiered engine), 'keep' (stay in memory) or 'recompute' (labelled; the
        integration runs the layer under checkpointing)."""
        self._decisions.set_layer(layer, decision)

    @contextlib.contextmanager
    def microbatch(self, key: Hashable) -> Iterator["ActivationOffloader"]:
        """Forward of micro-batch ``key``: saved tensors inside are recorded under it."""
        self._check_open()
        # Inside a CUDA graph capture, entering touches no stream, event or IO thread (a
        # replay would repeat none of it): the deferred writes wait for the next entry outside.
        capturing = self._capturing()
        if not capturing:
            self._transfers.drain()
        if not self._table.microbatch_count:
            self._step_first = time.perf_counter()  # the step's first forward starts
        mb, created = self._table.microbatch(key)
        if created:
            self._decisions.forward_started(key)  # plan: the micro-batch's position in the step
        # Another micro-batch's forward runs first: the deferred last layers of every
        # micro-batch still waiting for backward will not be needed right away; write them.
        if not capturing:
            self._transfers.write_deferred(skip=mb)
        with self._hooks.microbatch_scope(mb):
            yield self

    def layer(self, key: Hashable, decision: Optional[str] = None) -> contextlib.AbstractContextManager:
        """Forward of one layer (an int, or a tuple that sorts in forward order)."""
        if decision is not None:
            self.set_layer_decision(key, decision)
        return self._hooks.layer_scope(key)

    def discarded_graph(self) -> contextlib.AbstractContextManager:
        """A context whose saved tensors belong to a graph dropped before any backward (a
        checkpoint's no-grad forward that turns grad on for a moment): they stay with autograd
        instead of being written for nothing (``SavedTensorHooks.discarded_graph``)."""
        return self._hooks.discarded_graph()

    def decision_for(self, layer: Hashable) -> str:
        """What the plan says for a layer: one of DECISIONS."""
        return self._decisions.for_layer(self._hooks.current_microbatch, layer, self._step.phase == "forward")

    def begin_backward(self, key: Hashable) -> None:
        """Hint: the backward of micro-batch ``key`` is next. Its deferred last layers stay in
        memory, and reads of its last layers start now, while other work runs (not while a
        CUDA graph is captured: no copy or IO may enter the capture)."""
        if self._capturing():
            return
        self._transfers.drain()
        mb = self._table.find_microbatch(key)
        if mb is not None:
            self._hooks.enter_backward(mb)

    def enable_memory_timeline(self) -> None:
        """From the current step on, ``last_memory_timeline`` holds (seconds into the step,
        resident bytes) at every change of the last step (for plots; a list append per change)."""
        self.record_memory_timeline = True
        if self._step.counters.timeline is None:
            self._step.counters.timeline = []

    def record_timeline(self, timeline) -> None:
        """Record into ``timeline`` (telemetry/timeline.py, built as
        ``Timeline(off.copy.ops if off.copy else None, off.device)``) from now on, or stop
        (None): layers, copies, waits with their reasons, hook calls, drains, the engine's
        drive chunks, and the memory at each phase boundary. The caller starts and stops the
        timeline around the step(s) it wants; nothing is recorded, and the hot path costs one
        attribute test, while none is set."""
        self._timeline = timeline
        for part in (self._hooks, self._transfers, self._copy):
            if part is not None:
                part.timeline = timeline
        engine = self._engine
        if engine is not None:
            if timeline is not None:
                if self._tracer_before is None:
                    self._tracer_before = (engine.tracer,)
                before = self._tracer_before[0]
                engine.tracer = timeline.on_io if before is None else _Both(before, timeline.on_io)
            elif self._tracer_before is not None:
                engine.tracer, self._tracer_before = self._tracer_before[0], None
        if timeline is not None:
            timeline.probe = self._memory_figures

    def _memory_figures(self) -> dict:
        """The timeline's memory counter: CUDA allocated and reserved, and the offloader's
        record bytes by state."""
        out = {}
        if self.device.type == "cuda":
            out["allocated"] = torch.cuda.memory_allocated(self.device)
            out["reserved"] = torch.cuda.memory_reserved(self.device)
        for rec in self._table.records():
            key = f"records_{rec.state_name}"
            out[key] = out.get(key, 0) + rec.nbytes
        out["resident"] = self._step.counters.resident_bytes
        return out

    def poll(self) -> None:
        """Process what the IO threads and dropped handles reported so far (pack, unpack and
        end_step do this themselves): completed writes free their memory, released records
        their space on disk."""
        self._transfers.drain()

    def wait_writes(self) -> None:
        """Block until every write handed to the engine has completed (or failed)."""
        self._transfers.drain()
        self._transfers.wait_writes()

    def end_step(self) -> StepStats:
        """Finish the step: wait for IO, release what is left, emit and return StepStats."""
        self._check_open()
        self._step.enter("step_end")
        if self._timeline is not None:
            self._timeline.phase("step end")
        self._transfers.drain()
        self._transfers.wait_all()
        left = self._table.records()
        leftovers = self._transfers.release_all()  # no IO is in flight after wait_all
        if leftovers:
            where = sorted({f"micro-batch {r.microbatch} {r.origin()}" for r in left})
            self._warn("leftover", f"end_step(): {leftovers} saved tensors were still held by autograd "
                       f"(the backward of their graph did not run in this step: {'; '.join(where[:3])}"
                       f"{'; ...' if len(where) > 3 else ''}); releasing them, and a later backward "
                       "through them will fail")
        engine = self._engine
        if engine is not None:
            engine.end_step()
            self.check_free_space()
        write = engine.write_meter.take() if engine is not None else (0, 0.0)
        read = engine.read_meter.take() if engine is not None else (0, 0.0)
        now = time.perf_counter()
        # step_time_s from the step's first forward (what ran before it, e.g. another
        # model's step, is not this step's); iteration_time_s from the last end_step().
        first = max(self._step_first, self._step_started)
        step, counters = self._step.number, self._step.counters
        stats = counters.freeze(step, write, read, engine.bytes_on_disk if engine else 0, now - first,
                                now - (first if step == 0 else self._step_started),
                                tier_traffic(engine, write, read) if engine is not None else None)
        n = self._table.microbatch_count
        stats = self._decisions.end_step(stats, self._transfers.take_submit_s(), step, n)
        why = self.watch.check(stats, counters)  # offload that does not happen says why
        stats = dataclasses.replace(stats, not_offloaded_why=why) if why else stats
        order = max((mb.layer_keys for mb in self._table.microbatches()), key=len, default=[])
        self._decisions.learn(stats, order, n)
        self._transfers.learn(stats, n)
        if counters.timeline is not None:
            self.last_memory_timeline = [(t - self._step_first, b) for t, b in counters.timeline]
        self._step.next(timeline=[] if self.record_memory_timeline else None)
        self._table.end_step()
        self._step_started = now
        self.last_step_stats = stats
        self._write_stats(stats)
        log.debug("ssdtrain step %d: %s", stats.step, stats.summary())
        return stats

    def _write_stats(self, stats: StepStats) -> None:
        if self._stats_file:
            if self._stats_header is not None:
                append_line(self._stats_file, self._stats_header)
                self._stats_header = None
            append_jsonl(self._stats_file, stats, {"policy": self.config.policy})
        if self._tracer is not None:
            self._tracer.flush()

    def check_free_space(self, plan_bytes: Optional[List[int]] = None) -> List[str]:
        """Before a step: compare the free space of each root with what the step will need,
        ``plan_bytes`` (one number per root) or, by default, what the last step needed there.
        Warns once per directory, saying how much is missing; returns the warnings."""
        need = plan_bytes if plan_bytes is not None else (
            self._engine.step_peak_bytes if self._engine is not None else None)
        short = space_shortfalls(self.rank_dirs, need)
        for d, msg in short.items():
            self._warn(f"space:{d}", msg)
        return list(short.values())

    def close(self) -> None:
        """Release everything and remove every file and directory this offloader created."""
        if self._closed:
            return
        self._closed = True
        try:
            self._transfers.close()
        finally:
            self._table.close()
            if self._copy is not None:
                # Every copy into or out of the engine's pinned pool (memory engine, host tier)
                # has run before the engine lets that pool go: waited for on the streams
                # themselves, not only through the fences the engine holds.
                self._copy.synchronize()
            if self._engine is not None:
                self._engine.close()
                self._engine.completions = None
            if self._copy is not None:  # after the engine: its IO threads no longer touch staging
                self._copy.close()  # waits for every copy before the pinned pool goes
            cleanup.unregister(self._cleanup_token)

    def __enter__(self) -> "ActivationOffloader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            cleanup.raise_if_interrupted(self._closed_by)
            raise RuntimeError("ActivationOffloader is closed")

    def _emergency_close(self) -> None:
        """Signal/exit path: remove files now; do not wait for anything."""
        self._closed = True
        self._closed_by = cleanup.interrupted
        if self._engine is not None:
            self._engine.remove_files()


class _Both:
    """An engine trace sink feeding two (the IO trace and the timeline)."""

    __slots__ = ("first", "second")

    def __init__(self, first, second) -> None:
        self.first, self.second = first, second

    def __call__(self, *args) -> None:
        self.first(*args)
        self.second(*args)
