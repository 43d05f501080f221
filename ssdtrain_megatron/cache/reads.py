"""Bringing records back for backward: the read-ahead window, starting reads, their completion
and retries, and the wait for one.

Read-ahead goes by time: far enough that the reads in flight arrive before backward gets to
them, from the last step's measured read bandwidth and compute (plan/readahead.py), bounded by
the read-ahead byte cap (``max_inflight_bytes``) and the budget. It stops at a record whose
write is still under way (on a GPU: whose copy to host memory has not landed): asking for it
would only take it from memory and waste its write; a staged one (its copy landed, the drive
write running) is copied back from its staging block.

A record on disk comes back one of three ways: forwarded (someone else still holds the tensor:
no IO), copied straight out of the memory engine's pool to the device (GPU: the reload stream
copies at once, no IO thread takes part; the read is READY when issued, the consumer's stream
waits for the copy's event), or read by the engine (into a staging block on the GPU path, then
host->device on the reload stream into memory allocated just before the copy; into the
restore pool on a CPU device). Read-ahead stops, without waiting, where the activation budget
or the staging pool has no room, or where the device has no memory for a copy out of the
memory engine's pool; a demand read waits for room, and raises the device's out-of-memory
error as it is (the record stays ON_DISK: nothing is left READING with no completion coming).

Collaborators received at construction (``Transfers`` builds this): the engine, the GPU copy
layer, the restore pool, the record table, the step, the warn-once log, the IO trace's
tagger, the progress (``progress.py``: what it waits with), the budget, and three operations of
the write side: a write backward wants (``wanted_while_writing``), a staging block
(``staging_block``) and ``release``.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from ..config import OffloadConfig
from ..io.base import EngineError
from ..plan.readahead import measured_window
from .budget import give_back_readahead
from .lifecycle import IN_FLIGHT, WRITES, State, move
from .microbatch import MicroBatch
from .progress import Progress, relay
from .record import TensorRecord

READ_RETRIES = 2
"""A failed read is started again this many times before the step fails: a read that fails
has lost the only copy, and transient errors (a bus reset, a flaky link) pass on a retry."""


class Reads:
    """The read side of the transfer machine (module docstring); training thread only."""

    def __init__(self, config: OffloadConfig, engine, copy, restore_pool, table, step, warn, tracer,
                 progress: Progress, budget, wanted_while_writing: Callable[..., bool],
                 staging_block: Callable[..., object], release: Callable[[TensorRecord], None],
                 events) -> None:
        self._config = config
        self._engine = engine
        self._copy = copy
        self._restore_pool = restore_pool
        self._table = table
        self._step = step
        self._warn = warn
        self._tracer = tracer
        self._progress = progress
        self._budget = budget
        self._wanted_while_writing = wanted_while_writing
        self._staging_block = staging_block
        self._release = release
        self._events = events
        self.window = config.prefetch_layers
        """Layers read ahead of backward: ``prefetch_layers`` until a step measured its reads,
        then by time (plan/readahead.py, :meth:`learn`)."""

    def learn(self, stats, num_micro_batches: int) -> None:
        """A finished step's reads and compute set the read-ahead window (plan/readahead.py)."""
        window = measured_window(self._config.prefetch_layers, stats, num_micro_batches)
        if window is not None:
            self.window = window

    def prefetch(self, mb: MicroBatch) -> None:
        if self._engine is None:
            return
        cfg = self._config
        candidates = mb.prefetch_candidates(self.window, cfg.max_inflight_bytes)
        for i, rec in enumerate(candidates):
            if rec.state in WRITES and not self._wanted_while_writing(rec, True):
                # Its write (on a GPU: its copy to host memory) is under way: asking for it now
                # would take it from memory and spend the write for nothing. Read-ahead stops
                # here; the next unpack asks again (and backward itself, if it comes first).
                give_back_readahead(mb, candidates[i:])
                return
            if rec.state != State.ON_DISK:
                continue  # served from memory or staging (or written meanwhile: read below)
            if self._budget is not None and not self._budget.room_to_read(rec.nbytes):
                give_back_readahead(mb, candidates[i:])  # budget: read ahead less
                return
            if not self.start(rec, demand=False):
                give_back_readahead(mb, candidates[i:])  # no staging room: read ahead less
                return

    def start(self, rec: TensorRecord, demand: bool = True) -> bool:
        """Start reading ``rec`` back; False when a read ahead (not ``demand``) found no
        staging room and did not start."""
        c = self._step.counters
        alive = rec.ref()
        if alive is not None:  # still referenced elsewhere: no IO needed
            # Its bytes were written for nothing; the next save of this storage passes through.
            self._table.learn_held(alive.untyped_storage())
            rec.tensor = alive.detach()
            move(rec, State.READY, c)
            return True
        event = None
        copy = self._copy
        if copy is not None and not copy.direct:
            src = self._engine.pool_view_of(rec.id)
            if src is not None:  # the memory engine's pool: copied to the device at once
                self._engine.pool_read(rec.id, True)
                if not self._restore_from_pool(rec, src, demand):
                    return False
                move(rec, State.READING, c)
                self._tag(rec)
                ready = rec.transfer.ready_event
                self._engine.fence(rec.id, ready)
                self._progress.pool_reads.append((rec.id, ready))
                move(rec, State.READY, c)
                return True
            block = self._staging_block(rec, wait=demand)
            if block is None:
                return False
            restored, target, event = copy.stage_in(rec, block)
        elif copy is not None:  # gds: cuFile reads into device memory, allocated now
            restored, target, event = copy.stage_in(rec)
        else:  # CPU: memory from the restore pool, already faulted in (restore_pool.py)
            restored, target = rec.allocate_restore(empty=self._restore_pool.empty)
        rec.tensor = restored
        move(rec, State.READING, c)
        self._tag(rec)
        fut = self._engine.read(rec.id, target, event)
        if fut is not None:  # an engine without ``completions``
            fut.add_done_callback(functools.partial(relay, self._events, rec.id))
        return True

    def _restore_from_pool(self, rec: TensorRecord, src, demand: bool) -> bool:
        """The copy out of the memory engine's pool onto the device; False when a read ahead
        found no device memory for it. Its memory is allocated first, before any copy is
        queued: when that fails (a CUDA out-of-memory), nothing reads the extent, and the
        record stays ON_DISK (not READING, where no completion would ever come and the step's
        end would time out instead). A demand read raises the error as it is
        (``torch.OutOfMemoryError``); a read ahead stops there, warned once, and backward's
        own read of the record tries again when memory may have been freed."""
        try:
            self._copy.restore(rec, source=src)
        except BaseException as exc:
            rec.tensor = None
            rec.transfer = None
            self._engine.pool_read(rec.id, False)  # its meter ends (the read counts, though it did not run)
            if demand or not isinstance(exc, torch.OutOfMemoryError):
                raise
            self._warn("readahead-oom", f"read-ahead stopped: no device memory to bring a record back "
                       f"early ({exc}); backward reads it when it needs it")
            return False
        return True

    def _tag(self, rec: TensorRecord) -> None:
        if self._tracer is not None:
            self._tracer.tag(rec.id, self._step.number, rec.microbatch, rec.layer, self._step.phase)

    def done(self, rec: TensorRecord, exc: Optional[BaseException]) -> None:
        """A read finished (or failed). The copy to the device (or ``finish_read``) runs here,
        on the training thread: if it raises (out of memory), the caller of
        pack/unpack/end_step gets that error."""
        c = self._step.counters
        dropped = rec.state == State.READ_DROPPED
        if exc is not None and self._retry(rec, exc):
            return
        if exc is not None:
            tries = f" ({rec.read_retries + 1} attempts)" if rec.read_retries else ""
            rec.error = f"reading back a {rec.describe()} failed{tries}, the only copy is lost: {exc}"
            rec.tensor = None
            if self._copy is not None:
                self._copy.read_failed(rec)  # its staging is free
            move(rec, State.BROKEN, c)
        else:
            try:
                if self._copy is None:
                    rec.finish_read()
                elif not dropped:
                    self._copy.finish_in(rec)  # host->device on the reload stream
                else:  # nobody will use it: no device memory, no copy
                    self._copy.read_failed(rec)
            except BaseException:
                rec.error = f"finishing the read of a {rec.describe()} failed"
                rec.tensor = None
                move(rec, State.BROKEN, c)
                raise
            move(rec, State.READY, c)
        if dropped:
            self._release(rec)

    def _retry(self, rec: TensorRecord, exc: BaseException) -> bool:
        """A read failed in the engine (EngineError: IO error, short read, checksum) starts
        again, READ_RETRIES times at most; True when it did. Other errors (bugs) do not."""
        if rec.state != State.READING or rec.read_retries >= READ_RETRIES \
                or not isinstance(exc, EngineError):
            return False
        rec.read_retries += 1
        rec.tensor = None
        if self._copy is not None:
            self._copy.read_failed(rec)  # its staging is free
        move(rec, State.ON_DISK, self._step.counters)
        self._warn("read-retry", f"a read failed and is retried (at most {READ_RETRIES} "
                   f"times, counted in StepStats.read_retries): {exc}")
        self.start(rec)
        return True

    def wait(self, rec: TensorRecord, count: bool = True) -> None:
        """Until ``rec``'s IO completed (counted as its layer's IO wait with ``count``)."""
        if rec.state not in IN_FLIGHT:
            return  # most records at the step's end (wait_all): nothing to build or wait for
        what = rec.state_name
        waited = self._progress.wait(
            lambda: rec.state not in IN_FLIGHT,
            lambda: f"the {rec.state_name} of a {rec.describe()} (record {rec.id})",
            "read" if count else None, record=rec.id, bytes=rec.nbytes, layer=str(rec.layer), was=what)
        if count and waited:
            self._step.count_wait(rec, waited)
