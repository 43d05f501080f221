"""The saved-tensor hooks: pack (what autograd saves) and unpack (what backward needs), and the
scopes that tell them where they are (which micro-batch, which layer, forward or backward).

Pack runs for every tensor autograd saves, unpack for every one backward needs, both on the
training thread, which also launches every GPU kernel: their cost is added to each step
whenever the GPU waits on the CPU. So each reads a tensor's attributes once, makes one record
and one handle, and leaves the rest (placement, staging copies, IO) to the transfer machine
and the engine's threads.

Collaborators received at construction: the record table (``table.py``: identity, dedup,
micro-batches), the transfer machine (``transfers.py``), the decisions (``decisions.py``), the
step (``step.py``), the events queue a dropped handle reports to, and the capture query.
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
import time
from typing import Callable, Hashable, Iterator, Optional

import torch

from ..config import OffloadConfig
from .decisions import Decisions
from .identity import offloadable_storage, pass_reason
from .lifecycle import State, move
from .microbatch import MicroBatch
from .record import TensorRecord
from .step import Step
from .table import RecordTable
from .transfers import DROP, Transfers

_graph_task_id = torch._C._current_graph_task_id


def capture_query(copy) -> Callable[[], bool]:
    """What pack and unpack ask: is a CUDA graph being captured on this thread's stream?
    (the device-copy layer's streams answer; without one, never.)"""
    return copy.ops.capturing if copy is not None else _never


def _never() -> bool:
    return False


_LIBRARY_DIRS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                 os.path.dirname(os.path.abspath(torch.__file__)))
"""Frames in these folders (this package, torch) are not a save site: the model's code is."""


def save_site(depth: int = 3) -> str:
    """The model's code that saved the tensor being packed: the innermost frame of each of
    the ``depth`` innermost files outside torch and this package, innermost first
    ("file.py:line function < ...")."""
    frame, out, last = sys._getframe(1), [], None
    while frame is not None and len(out) < depth:
        path = frame.f_code.co_filename
        if path != last and not path.startswith(_LIBRARY_DIRS):  # one frame per file
            out.append(f"{os.path.basename(path)}:{frame.f_lineno} {frame.f_code.co_name}")
            last = path
        frame = frame.f_back
    return " < ".join(out) or "?"


def _as_is(x):
    return x


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
        self.events.put((self.record, DROP))


class SavedTensorHooks:
    """``pack`` and ``unpack`` (see the module docstring), and the scopes they read.

    Args:
        config: the settings (``min_tensor_bytes``, ``keep_last_layers``).
        device: the training device (tensors elsewhere pass through).
        table, transfers, decisions, step: the offloader's other parts.
        events: the queue a dropped handle reports to (the transfer machine drains it).
        capturing: whether a CUDA graph is being captured now (:func:`capture_query`).
    """

    def __init__(self, config: OffloadConfig, device: torch.device, table: RecordTable,
                 transfers: Transfers, decisions: Decisions, step: Step,
                 events: "queue.SimpleQueue", capturing: Callable[[], bool]) -> None:
        self._device = device
        self._min_bytes = max(config.min_bytes_for(device), 1)  # read by every pack
        self._keep_last_layers = config.keep_last_layers
        self._note_sites = config.debug_save_sites
        self._table = table
        self._param_storages = table.param_storages  # both sets change in place: read once
        self._held = table.held_addresses
        self._transfers = transfers
        self._decisions = decisions
        self._step = step
        self._events = events
        self._landing = transfers.landing  # GPU: copies to poll (a deque; tested per pack and unpack)
        self._capturing = capturing
        self._current: Optional[MicroBatch] = None
        self._layer: Optional[Hashable] = None
        self.timeline = None  # telemetry/timeline.py, while a step is recorded (the offloader sets it)

    @property
    def current_microbatch(self) -> Optional[Hashable]:
        """The key of the micro-batch whose forward runs now (None outside one)."""
        return self._current.key if self._current is not None else None

    # -- scopes -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def microbatch_scope(self, mb: MicroBatch) -> Iterator[None]:
        """Forward of ``mb``: the hooks are installed and record under it."""
        prev, prev_layer = self._current, self._layer
        self._current, self._layer = mb, None
        self._step.enter("forward")
        tl = self.timeline
        if tl is not None:
            tl.phase(f"forward mb {mb.key}")
        try:
            pack = self.pack_noting_site if self._note_sites else self.pack
            unpack = self.unpack
            if tl is not None:  # a recorded step: each hook call timed (never otherwise)
                pack, unpack = self._timed(pack, "pack"), self._timed(self.unpack, "unpack")
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                yield
        finally:
            self._current, self._layer = prev, prev_layer

    @contextlib.contextmanager
    def layer_scope(self, key: Hashable) -> Iterator[None]:
        """Forward of one layer. In a micro-batch's forward (not a recompute inside backward),
        entering a layer writes the deferred records of layers now older than the last
        ``keep_last_layers``, and the layer's forward time is counted; inside backward (a
        checkpoint running the layer again) the time is counted as its recompute pass."""
        forward = _graph_task_id() == -1  # not a recompute inside backward
        prev = self._layer
        self._layer = key
        mb = self._current
        if mb is not None and forward:
            idx = mb.enter_layer(key)
            keep = max(self._keep_last_layers, self._decisions.late_tail)
            if not self._capturing():  # a capture: no copy or IO enters it (the offloader's microbatch())
                self._transfers.submit_all(mb.take_deferred_before(idx - keep + 1) if keep else mb.take_all_deferred())
        tl = self.timeline
        span = tl.compute_begin(f"{'forward' if forward else 'recompute'} layer {key}", "layer",
                                mb=str(mb.key) if mb is not None else None) if tl is not None else None
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if span is not None:
                tl.compute_end(span)
            self._layer = prev
            if mb is not None and forward:
                decision = self._decisions.for_layer(mb.key, key, self._step.phase == "forward")
                self._step.counters.layer(key, decision).forward_s += time.perf_counter() - t0
            elif not forward:
                self._step.counters.layer(key, "recompute").recomputed(time.perf_counter() - t0)

    def enter_backward(self, mb: MicroBatch) -> None:
        """``mb``'s backward starts: its deferred last layers stay in memory, and reads of its
        last layers start now."""
        mb.in_backward = True
        self._decisions.backward_started(mb.key)
        self._step.enter("backward")
        if self.timeline is not None:
            self.timeline.phase(f"backward mb {mb.key}")
        self._transfers.keep_deferred(mb)
        self._transfers.prefetch(mb)

    def discarded_graph(self) -> torch.autograd.graph.saved_tensors_hooks:
        """A context whose saved tensors belong to a graph that is dropped before any backward:
        they stay with autograd (counted in ``passed_through_by_reason`` as "discarded_graph")
        instead of being written for nothing. The case: the no-grad forward of a checkpoint
        (the caller runs the function again in backward) inside which the function turns grad
        on for a moment, as megatron-core's bias-dropout-add does; that graph ends where the
        checkpoint's outputs get their own ``grad_fn``, and its saved tensors are freed then."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack_discarded, _as_is)

    def _pack_discarded(self, t: torch.Tensor) -> torch.Tensor:
        self._step.counters.pass_through("discarded_graph", self._layer)
        return t

    # -- pack / unpack ----------------------------------------------------------------------

    def pack(self, t: torch.Tensor):
        c = self._step.counters
        if _graph_task_id() != -1:
            # Saved while autograd's engine runs: the recompute pass of checkpointing. These
            # tensors are needed moments later by the same backward; keep them in memory.
            c.pass_through("recompute", self._layer)
            return t
        if self._capturing():
            # A CUDA graph is being captured: no event, stream switch or IO may enter it (a
            # replay would repeat none of the host side). The tensor stays with autograd.
            c.pass_through("cuda_graph_capture", self._layer)  # StepStats.captured_kept
            return t
        if t.nbytes < self._min_bytes:  # the cheapest test first
            c.pass_through("small", self._layer)
            return t
        storage = offloadable_storage(t, self._device, self._param_storages)
        if storage is None:
            self._pass_other(t)
            return t
        if storage._cdata in self._held:  # held until backward anyway: writing frees nothing
            c.pass_through("held_by_schedule", self._layer)  # StepStats.tensors_held_by_schedule
            return t
        if self._landing or not self._events.empty():
            self._transfers.drain()
        # The identity of identity.py, from attributes read once (the record keeps them).
        shape, stride, dtype, version = t.shape, t.stride(), t.dtype, t._version
        key = (storage._cdata, t.storage_offset(), shape, stride, dtype, version)
        table = self._table
        rec = table.find(key)
        if rec is not None:
            return self._saved_again(rec)
        mb = self._current
        layer = self._layer
        rec = table.add(t, key, storage, mb, layer, (shape, stride, dtype, version, self._device))
        decision = self._decisions.for_record(rec, self._step)
        c.saved(layer, decision, rec.nbytes)
        if decision == "keep":
            self._transfers.keep(rec)
        elif mb is not None and mb.layer_keys and (self._keep_last_layers or self._decisions.late_tail
                                                   or layer is None):
            # Written once later layers prove it is not among the last, or another micro-batch's
            # forward comes first; kept if its backward does. Also with keep_last_layers 0 for
            # what is saved outside a layer after one (the head and the loss after the last
            # layer): on a pipeline's last stage backward follows at once and needs it first.
            rec.hold()
            mb.deferred.append(rec)
        else:
            try:
                self._transfers.submit(rec, True)  # it holds the tensor itself until written (record.py)
            except BaseException:
                # The error reaches the caller instead of a handle: autograd will never drop
                # one for this record, so it leaves now (not at the step's end, as a record
                # whose backward never ran would).
                rec.handles -= 1
                self._transfers.release(rec)
                raise
        return _Handle(rec, self._events)

    def pack_noting_site(self, t: torch.Tensor):
        """The pack hook with ``debug_save_sites``: :meth:`pack`, then the code that saved a
        newly recorded tensor goes on its record (``TensorRecord.origin`` names it). Normal runs
        use :meth:`pack` itself: no stack walk, no extra test per tensor."""
        handle = self.pack(t)
        if isinstance(handle, _Handle) and getattr(handle.record, "site", None) is None:
            handle.record.site = save_site()
        return handle

    def _timed(self, hook: Callable, name: str) -> Callable:
        """``hook`` (pack or unpack) with each call that involves a record put on the timeline
        as a span: its record, bytes, and the decision (pack) or state it left (unpack)."""
        tl = self.timeline

        def timed(x):
            t0 = tl.now()
            out = hook(x)
            rec = out.record if isinstance(out, _Handle) else getattr(x, "record", None)
            if rec is not None:
                tl.span(name, "hook", t0, record=rec.id, bytes=rec.nbytes, layer=str(rec.layer),
                        decision=rec.decision, state=rec.state_name)
            return out

        return timed

    def _pass_other(self, t: torch.Tensor) -> None:
        """Count a tensor offloadable_storage refused, by its reason (pass_reason's words)."""
        reason = pass_reason(t, self._device, self._param_storages, 0) or "parameter"
        self._step.counters.pass_through(reason, self._layer, str(t.device) if reason == "device" else "")

    def _saved_again(self, rec: TensorRecord) -> _Handle:
        """A deduplication hit: the same tensor (identity.py) saved again while its record lives."""
        rec.handles += 1
        c = self._step.counters
        if rec.state == State.WRITE_DROPPED:  # it has a user again
            move(rec, State.WRITING, c)
        elif rec.state == State.STAGED_DROPPED:
            move(rec, State.STAGED, c)
        elif rec.state == State.READ_DROPPED:
            move(rec, State.READING, c)
        cur = self._current
        if cur is None or cur.key != rec.microbatch:
            rec.shared = True
        else:
            rec.last_pos = max(rec.last_pos, cur.position)
        c.bytes_deduplicated += rec.nbytes
        return _Handle(rec, self._events)

    def unpack(self, handle):
        if isinstance(handle, torch.Tensor):
            return handle
        if self._landing or not self._events.empty():
            self._transfers.drain()
        rec: TensorRecord = handle.record
        if self._capturing():
            raise RuntimeError(
                f"ssdtrain: a {rec.describe()} offloaded outside CUDA graph capture is needed "
                "inside one; capture the forward that saves it as well, or run this backward "
                "without capturing it")
        # A tensor shared by several micro-batches says nothing about where any one of
        # their backwards is; one saved again by later layers is needed until the latest.
        mb = None if rec.shared else self._table.find_microbatch(rec.microbatch)
        if mb is not None and not mb.in_backward:
            self.enter_backward(mb)
        entering = mb is not None and (mb.backward_layer is None or rec.last_pos < mb.backward_layer)
        if entering:  # backward reaches this layer: the layer before it is done (its time)
            self._step.counters.backward_entered(mb.key, rec.layer, time.perf_counter(),
                                                 (threading.get_ident(), time.thread_time()))
        out = self._transfers.materialize(rec)
        if mb is not None:
            mb.consumed(rec)
            if entering:
                mb.backward_layer = rec.last_pos
                if self.timeline is not None:
                    self.timeline.compute_mark(f"backward layer {rec.layer}", "layer", mb=str(mb.key))
            self._transfers.prefetch(mb)
        return out
