"""The saved-tensor hooks of ActivationOffloader: pack (what autograd saves) and unpack.

A part of :class:`~.offloader.ActivationOffloader` (a base class of it). Pack runs for every
tensor autograd saves, unpack for every one backward needs, both on the training thread, which
also launches every GPU kernel: their cost is added to each step whenever the GPU waits on the
CPU. So each reads a tensor's attributes once, makes one record and one handle, and leaves the
rest (placement, staging copies, IO) to the engine's threads.
"""

from __future__ import annotations

import os
import queue
import sys
from typing import Callable

import torch

from .identity import offloadable_storage, pass_reason
from .record import State, TensorRecord

_graph_task_id = torch._C._current_graph_task_id

_DROP = object()
"""Event outcome: the last reference to a handle went away (the event's first item is the record)."""


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


def _as_is(x):
    return x


class SavedTensorHooks:
    """``_pack`` and ``_unpack`` (see the module docstring)."""

    def discarded_graph(self) -> torch.autograd.graph.saved_tensors_hooks:
        """A context whose saved tensors belong to a graph that is dropped before any backward:
        they stay with autograd (counted in ``passed_through_by_reason`` as "discarded_graph")
        instead of being written for nothing. The case: the no-grad forward of a checkpoint
        (the caller runs the function again in backward) inside which the function turns grad
        on for a moment, as megatron-core's bias-dropout-add does; that graph ends where the
        checkpoint's outputs get their own ``grad_fn``, and its saved tensors are freed then."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack_discarded, _as_is)

    def _pack_discarded(self, t: torch.Tensor) -> torch.Tensor:
        self._c.pass_through("discarded_graph", self._layer)
        return t

    def _pack(self, t: torch.Tensor):
        c = self._c
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
        storage = offloadable_storage(t, self.device, self._param_storages)
        if storage is None:
            self._pass_other(t)
            return t
        if storage._cdata in self._held:  # held until backward anyway: writing frees nothing
            c.pass_through("held_by_schedule", self._layer)  # StepStats.tensors_held_by_schedule
            return t
        if not self._events.empty():
            self._drain()
        # The identity of identity.py, from attributes read once (the record keeps them).
        shape, stride, dtype, version = t.shape, t.stride(), t.dtype, t._version
        key = (storage._cdata, t.storage_offset(), shape, stride, dtype, version)
        rec = self._dedup.get(key)
        if rec is not None and rec.state != State.RELEASED and rec.storage_alive():
            return self._saved_again(rec)
        mb = self._current
        layer = self._layer
        sref = storage._weak_ref()
        self._storage_refs.append(sref)  # freed at the step's end, when _dedup forgets the keys
        rec = TensorRecord(next(self._ids), t, mb.key if mb is not None else None, layer,
                           (shape, stride, dtype, version, self.device), sref)
        rec.handles = 1
        if self._keep_all:
            decision = rec.decision = "keep"
        elif self._budget is None and self._planner is None:
            decision = rec.decision = self._layer_decisions.get(layer, "offload")
        else:  # budget/plan: per (micro-batch, layer), and room for it before it counts as resident
            rec.decision = self.decision_for(layer)
            if self._budget is not None:
                self._budget_admit(rec)
            decision = rec.decision
        self._records[rec.id] = rec
        self._dedup[key] = rec
        nbytes = rec.nbytes
        c.add_resident(nbytes)
        acc = c.layer(layer, decision)
        acc.bytes += nbytes
        acc.tensors += 1
        if mb is not None:
            rec.pos = rec.last_pos = mb.position
            mb.records.append(rec)
        if decision == "keep":
            rec.hold()
            self._move(rec, State.KEPT)
        elif mb is not None and mb.layer_keys and (self.config.keep_last_layers or layer is None):
            # Written once later layers prove it is not among the last, or another micro-batch's
            # forward comes first; kept if its backward does. Also with keep_last_layers 0 for
            # what is saved outside a layer after one (the head and the loss after the last
            # layer): on a pipeline's last stage backward follows at once and needs it first.
            rec.hold()
            mb.deferred.append(rec)
        else:
            self._submit(rec)  # the record holds the tensor itself until written (record.py)
        return _Handle(rec, self._events)

    def _pack_noting_site(self, t: torch.Tensor):
        """The pack hook with ``debug_save_sites``: ``_pack``, then the code that saved a newly
        recorded tensor goes on its record (``TensorRecord.origin`` names it). Normal runs use
        ``_pack`` itself: no stack walk, no extra test per tensor."""
        handle = self._pack(t)
        if isinstance(handle, _Handle) and getattr(handle.record, "site", None) is None:
            handle.record.site = save_site()
        return handle

    def _pass_other(self, t: torch.Tensor) -> None:
        """Count a tensor offloadable_storage refused, by its reason (pass_reason's words)."""
        reason = pass_reason(t, self.device, self._param_storages, 0) or "parameter"
        self._c.pass_through(reason, self._layer, str(t.device) if reason == "device" else "")

    def _saved_again(self, rec: TensorRecord) -> _Handle:
        """A deduplication hit: the same tensor (identity.py) saved again while its record lives."""
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

    def _unpack(self, handle):
        if isinstance(handle, torch.Tensor):
            return handle
        if not self._events.empty():
            self._drain()
        rec: TensorRecord = handle.record
        if self._capturing():
            raise RuntimeError(
                f"ssdtrain: a {rec.describe()} offloaded outside CUDA graph capture is needed "
                "inside one; capture the forward that saves it as well, or run this backward "
                "without capturing it")
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
