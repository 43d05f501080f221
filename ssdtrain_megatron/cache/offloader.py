"""ActivationOffloader: saved-tensor hooks that move activations to an IO engine and back."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import queue
import time
from typing import Dict, Hashable, Iterable, Iterator, List, Optional, Set

import torch

from ..config import OffloadConfig
from ..io import IOEngine, cleanup, make_engine
from ..io.layout import Identity, expand_file, space_shortfalls
from ..io.roots import log_roots
from ..telemetry.stats import StepCounters, StepStats, append_jsonl, append_line, run_header
from ..telemetry.trace import IOTracer
from .adaptive import AdaptivePlanner
from .budget import ActivationBudget, resolve_budget
from .budget_steps import BudgetSteps
from .device_copy import DeviceCopy, StreamOps
from .held import HeldStorages
from .hooks import SavedTensorHooks, capture_query
from .microbatch import MicroBatch
from .record import TensorRecord
from .restore_pool import RestorePool
from .silence import OffloadWatch
from .transfers import EXPECTED_WRITE_REFUSALS, IOTimeout, RecordIO

__all__ = ["ActivationOffloader", "DECISIONS", "EXPECTED_WRITE_REFUSALS", "IOTimeout"]

log = logging.getLogger(__name__)

DECISIONS = ("offload", "keep", "recompute")


class ActivationOffloader(SavedTensorHooks, RecordIO, BudgetSteps):
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
        self._closed_by: Optional[int] = None  # the signal whose cleaners closed it (cleanup.py)
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
                                    direct=self._engine.device_direct)
        # Without a GPU data path: restored tensors reuse the memory earlier ones had (restore_pool.py).
        self._restore_pool = RestorePool(config.max_inflight_bytes)
        self._capturing = capture_query(self._copy)  # CUDA graphs (hooks.py)
        self._ids = itertools.count()
        self._records: Dict[int, TensorRecord] = {}
        self._dedup: Dict[tuple, TensorRecord] = {}  # identity (identity.py) -> its record
        # Weak references to the storages of this step's records (plain ints): while one is
        # held, that storage's address cannot be reused, so a key in _dedup names one storage.
        self._storage_refs: List[int] = []
        self._min_bytes = max(config.min_tensor_bytes, 1)  # read by every pack
        self._keep_all = config.policy == "keep"
        self._microbatches: Dict[Hashable, MicroBatch] = {}
        self._param_storages: Set[int] = set()
        self._held = HeldStorages()  # held until backward by something else (held.py)
        self._current: Optional[MicroBatch] = None
        self._layer: Optional[Hashable] = None
        self._layer_decisions: Dict[Hashable, str] = {}
        self._inflight_bytes = 0
        self._c = StepCounters()
        # budget: room-making under activation_budget_bytes (cache/budget.py); None without one.
        limit = (resolve_budget(config.activation_budget_bytes, self.device)
                 if config.policy != "keep" else None)
        self._budget = None if limit is None else ActivationBudget(
            limit, lambda: self._c.resident_bytes, self._drain, self._budget_write_deferred,
            self._budget_wait_event, lambda: self._inflight_bytes, self._budget_pinned)
        # plan: the adaptive planner decides per (micro-batch position, layer) under the budget.
        self._planner = AdaptivePlanner(config, limit) if config.policy == "adaptive" else None
        # budget/plan: training-thread seconds spent handing writes over (no clock read without)
        self._submit_s, self._time_submit = 0.0, self._budget is not None or self._planner is not None
        self._step = 0
        self._step_started = self._step_first = time.perf_counter()
        self._warned: Set[str] = set()
        self.watch = OffloadWatch(self.device, config.min_tensor_bytes,
                                  self._engine is not None and not self._keep_all)  # silence.py
        self.last_step_stats: Optional[StepStats] = None
        self.record_memory_timeline = False
        self.last_memory_timeline: List[tuple] = []
        self._phase = "forward"
        self._tracer: Optional[IOTracer] = None
        ident = self._engine.ident if self._engine is not None else None
        ident = ident or Identity.detect(config.job_id())
        # Files, not directories: a restarted job (same command line) appends to them.
        self._stats_path = expand_file(config.stats_path, ident) if config.stats_path else None
        # The run's header line goes before its first step's (readers split appended runs there).
        self._stats_header: Optional[dict] = run_header(ident.job, ident.rank, time.time(), config.to_dict()) \
            if self._stats_path else None
        if config.trace_path and self._engine is not None:
            self._tracer = IOTracer(expand_file(config.trace_path, ident), ident.rank)
            self._engine.tracer = self._tracer.on_io
        # A token object, not id(self): an id is reused once this offloader is gone.
        self._cleanup_token = object()
        cleanup.register(self._cleanup_token, self._emergency_close)
        log_roots(self.rank_dirs, config)  # settings, where the bytes go; a warning for RAM (/tmp)

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
        return self._planner

    def register_parameters(self, params: Iterable[torch.Tensor]) -> None:
        """Never offload these tensors or any view of their storage."""
        for p in params:
            self._param_storages.add(p.untyped_storage()._cdata)

    def register_held(self, tensors: Iterable[Optional[torch.Tensor]]) -> None:
        """Tensors something else keeps in memory until this step's backward (a pipeline
        stage's received input): saved tensors on their storage pass through, counted in
        ``tensors_held_by_schedule`` (held.py). Forgotten at the step's end; None is skipped."""
        self._held.register(tensors, self.device)

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
            pack = self._pack_noting_site if self.config.debug_save_sites else self._pack
            with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
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
        write = self._engine.write_meter.take() if self._engine is not None else (0, 0.0)
        read = self._engine.read_meter.take() if self._engine is not None else (0, 0.0)
        now = time.perf_counter()
        # step_time_s from the step's first forward (what ran before it, e.g. another
        # model's step, is not this step's); iteration_time_s from the last end_step().
        first = max(self._step_first, self._step_started)
        stats = self._c.freeze(self._step, write, read,
                               self._engine.bytes_on_disk if self._engine else 0, now - first,
                               now - (first if self._step == 0 else self._step_started))
        stats = self._budget_step_end(stats)  # budget/plan: counters and what the planner needs
        why = self.watch.check(stats, self._c)  # offload that does not happen says why
        stats = dataclasses.replace(stats, not_offloaded_why=why) if why else stats
        if self._planner is not None:
            order = max((mb.layer_keys for mb in self._microbatches.values()), key=len, default=[])
            self._planner.update(stats, order, {r.layer: r for r in stats.layers},
                                 len(self._microbatches))
        if self._c.timeline is not None:
            self.last_memory_timeline = [(t - self._step_first, b) for t, b in self._c.timeline]
        self._c = StepCounters(timeline=[] if self.record_memory_timeline else None)
        self._forget_storages()
        self._held.end_step()
        self._microbatches.clear()
        self._step += 1
        self._step_started = now
        self.last_step_stats = stats
        if self._stats_path:
            if self._stats_header is not None:
                append_line(self._stats_path, self._stats_header)
                self._stats_header = None
            append_jsonl(self._stats_path, stats, {"policy": self.config.policy})
        if self._tracer is not None:
            self._tracer.flush()
        log.debug("ssdtrain step %d: %s", stats.step, stats.summary())
        return stats

    def check_free_space(self, plan_bytes: Optional[List[int]] = None) -> List[str]:
        """Before a step: compare the free space of each root with what the step will need,
        ``plan_bytes`` (one number per root) or, by default, what the last step needed there.
        Warns once per directory, saying how much is missing; returns the warnings."""
        need = plan_bytes if plan_bytes is not None else (
            self._engine.step_peak_bytes if self._engine is not None else None)
        short = space_shortfalls(self.rank_dirs, need)
        for d, msg in short.items():
            self._warn_once(f"space:{d}", msg)
        return list(short.values())

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
            self._forget_storages()
            self._held.close()
            self._restore_pool.close()
            if self._engine is not None:
                self._engine.close()
                self._engine.completions = None
            cleanup.unregister(self._cleanup_token)

    def _forget_storages(self) -> None:
        """No record of this step is looked up by identity any more: drop the storage refs."""
        self._dedup.clear()
        free = torch.UntypedStorage._free_weak_ref
        for ref in self._storage_refs:
            free(ref)
        self._storage_refs = []

    def __enter__(self) -> "ActivationOffloader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- pack / unpack ----------------------------------------------------------------------

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
