"""The transfer machine: every record's bytes out to the engine and back, and when they may go.

After the pack hook made a record, everything that moves it between its states
(``lifecycle.TRANSITIONS``) happens here: the hand-off to the engine (with back-pressure on
the bytes in flight), completions, cancels (a write backward wants before it started),
prefetch, reads and their retries, materializing a tensor for backward, the waits, and
release. All of it runs on the training thread; the IO threads only put ``(record id,
outcome)`` on the events queue, and a dropped handle puts ``(record, DROP)`` there
(``hooks.py``); :meth:`Transfers.drain` processes them.

On the GPU path (``device_copy.py``) a write starts with a device->host copy on the offload
stream. The training thread sees each copy land by polling its event (``query``, in FIFO
order: one stream runs them in order) whenever it processes events; from then on the device
memory is not needed: the memory engine's write is done (``commit``, no IO thread), and a drive
engine's record is STAGED, its bytes in pinned host staging until the drive has them, the
device memory let go. So two limits hold a forward back, each making pack wait (counted):
``max_inflight_bytes`` of device memory whose copy has not landed, and the staging pool's
room for bytes not yet on the drive (``pinned_staging_bytes``). A record backward wants while
its drive write runs comes back from its staging block by a host->device copy; a read from the
memory engine is a host->device copy straight out of its pool, issued at once, with no IO
thread between.

Two parts of its own: how the training thread learns what happened and waits for it
(``progress.py``: the events queue, the copies in flight) and the read side (``reads.py``:
read-ahead, reads, their completion). Collaborators, all received at construction: the IO
engine, the GPU copy layer (``device_copy.py``, None off the GPU path), the restore pool
(``restore_pool.py``), the record table (``table.py``), the step (``step.py``), the events
queue, the warn-once log, the IO tracer. The activation budget (``budget.py``) makes room by operations only this object has
(drain, write the deferred, wait for a write), so it is built here, and the decisions
(``decisions.py``) receive it from here.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import queue
import time
from typing import List, Optional

import torch

from ..config import OffloadConfig
from ..io.base import TIERS, IOEngine
from ..io.memory import PoolFull
from .budget import ActivationBudget
from .lifecycle import IN_FLIGHT, READS, STAGED_STATES, WRITES, State, move
from .microbatch import MicroBatch
from .progress import IOTimeout, Progress, relay
from .reads import READ_RETRIES, Reads
from .record import StorageFreed, TensorRecord
from .restore_pool import RestorePool
from .step import Step, WarnOnce
from .table import RecordTable

__all__ = ["DROP", "EXPECTED_WRITE_REFUSALS", "IOTimeout", "READ_RETRIES", "Transfers"]

log = logging.getLogger("ssdtrain_megatron.cache.offloader")

DROP = object()
"""Event outcome: the last reference to a handle went away (the event's first item is the record)."""


def _is_disk_full(exc: Optional[BaseException]) -> bool:
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return True
        exc = exc.__cause__
    return False


# Write refusals that mean "keep it in memory" (pool full, storage freed); others propagate.
EXPECTED_WRITE_REFUSALS = (PoolFull, StorageFreed)


class Transfers:
    """Moves records' bytes between memory and the engine (see the module docstring).

    Args:
        config: the settings (``max_inflight_bytes``, ``prefetch_layers``, ``io_timeout_s``).
        engine: the IO engine; None when nothing is ever offloaded (policy 'keep').
        copy: the GPU data path, or None (CPU device).
        restore_pool: where restored tensors' memory comes from off the GPU path.
        table, step, events, warn: the parts shared with the hooks and the offloader.
        budget_limit: ``activation_budget_bytes`` resolved to bytes, or None.
        tracer: the IO trace's tagger, or None.
        time_submit: measure the training thread's seconds handing writes over (the budget
            and the adaptive planner use the figure; without them no clock is read).
    """

    def __init__(self, config: OffloadConfig, engine: Optional[IOEngine], copy, restore_pool: RestorePool,
                 table: RecordTable, step: Step, events: "queue.SimpleQueue", warn: WarnOnce,
                 budget_limit: Optional[int] = None, tracer=None, time_submit: bool = False) -> None:
        self._config = config
        self._engine = engine
        self._copy = copy
        self._restore_pool = restore_pool
        self._table = table
        self._step = step
        self._events = events
        self._warn = warn
        self._tracer = tracer
        self._time_submit = time_submit
        self._submit_s = 0.0
        self._inflight_bytes = 0
        self._writes = 0  # records handed to the engine (or copying into its pool) whose write is not done
        self._write_bytes = 0  # ... and their bytes
        self._progress = Progress(events, copy, self._on_event, self._landed, self._pool_read_done,
                                  config.io_timeout_s)
        self.landing = self._progress.landing
        """GPU: writes whose device->host copy is not known to have run, in issue order (the
        hooks test it to know there is something to poll)."""
        self._budget: Optional[ActivationBudget] = None
        if budget_limit is not None:
            self._budget = ActivationBudget(budget_limit, self._resident_bytes, self.drain,
                                            self.write_deferred, self._wait_for_room,
                                            self._in_flight_bytes, self._pinned_bytes)
        self._reads = Reads(config, engine, copy, restore_pool, table, step, warn, tracer, self._progress,
                            self._budget, self._wanted_while_writing, self._staging_block, self.release, events)

    @property
    def budget(self) -> Optional[ActivationBudget]:
        """The activation budget (None without one): built here, consulted by the decisions."""
        return self._budget

    @property
    def restore_pool(self) -> RestorePool:
        """Where restored tensors' memory comes from off the GPU path (its counters: reuse)."""
        return self._restore_pool

    @property
    def inflight_bytes(self) -> int:
        """Bytes of writes still holding device memory: on the GPU path, those whose
        device->host copy has not landed; elsewhere, those not yet completed."""
        return self._inflight_bytes

    @property
    def timeline(self):
        return self._progress.timeline

    @timeline.setter
    def timeline(self, tl) -> None:
        """telemetry/timeline.py, while a step is recorded (the offloader sets it)."""
        self._progress.timeline = tl

    def take_submit_s(self) -> float:
        """Training-thread seconds spent handing writes over since the last call."""
        s, self._submit_s = self._submit_s, 0.0
        return s

    # -- events -----------------------------------------------------------------------------

    def drain(self) -> None:
        """Process everything that happened so far: IO completions, dropped handles, and (GPU)
        copies that landed."""
        self._progress.drain()

    def _on_event(self, what, outcome) -> None:
        if outcome is DROP:
            rec = what
            rec.handles -= 1
            if rec.handles == 0:
                self.release(rec)
            return
        rec = self._table.get(what)
        if rec is None:  # released by close() while its IO hung
            return
        if rec.state in WRITES:
            self._write_done(rec, outcome)
        elif rec.state in READS:
            self._reads.done(rec, outcome)
        else:
            raise RuntimeError(f"ssdtrain internal error: IO completed for record {rec.id} "
                               f"in state {rec.state_name}")

    def _pool_read_done(self, key: int) -> None:
        self._engine.pool_read(key, False)

    # -- writes -----------------------------------------------------------------------------

    def keep(self, rec: TensorRecord) -> None:
        """A record that stays in memory for this step (the plan keeps its layer)."""
        rec.hold()
        move(rec, State.KEPT, self._step.counters)

    def submit_all(self, records: List[TensorRecord]) -> None:
        if records and self._progress.pending:
            # Dropped handles first: a deferred tensor whose graph is gone (megatron's
            # bias-dropout-add inside a checkpoint's no-grad forward) is released, not written.
            self.drain()
        if not records:
            return
        # one producer event and stream context for the batch (GPU path)
        with self._copy.writes() if self._copy is not None else contextlib.nullcontext():
            for rec in records:
                if rec.state == State.SAVED:
                    self.submit(rec)

    def write_deferred(self, skip: Optional[MicroBatch] = None) -> int:
        """Write the deferred last-layer records of every micro-batch still in forward (but
        ``skip``); returns how many were handed over."""
        n = 0
        for mb in self._table.in_forward():
            if mb is not skip and mb.deferred:
                records = mb.take_all_deferred()
                n += len(records)
                self.submit_all(records)
        return n

    def keep_deferred(self, mb: MicroBatch) -> None:
        """``mb``'s backward starts: its deferred last layers are needed right away; keep them."""
        for rec in mb.take_all_deferred():
            if rec.state == State.SAVED:
                move(rec, State.KEPT, self._step.counters)

    def submit(self, rec: TensorRecord, fresh: bool = False) -> None:
        """Hand a SAVED record to the engine, after back-pressure allows it. ``fresh``: the
        pack hook is saving it now, so its owner cannot have freed its storage yet (a
        deferred record's owner may have: ``TensorRecord.check_storage``)."""
        cap = self._config.max_inflight_bytes
        if self._inflight_bytes and self._inflight_bytes + rec.nbytes > cap:
            self._wait_below(cap - rec.nbytes, rec)
        move(rec, State.WRITING, self._step.counters)
        self._inflight_bytes += rec.nbytes
        rec.inflight = True
        self._writes += 1
        self._write_bytes += rec.nbytes
        if self._tracer is not None:
            self._tracer.tag(rec.id, self._step.number, rec.microbatch, rec.layer, self._step.phase)
        t_submit = time.perf_counter() if self._time_submit else 0.0  # budget/plan: its cost
        try:
            if not fresh:
                rec.check_storage()  # before any copy or IO could read memory its owner freed
            if rec.decision in TIERS:  # the plan's tier ('host', 'ssd'): said before pool_view
                self._engine.place(rec.id, rec.decision)
            if self._copy is None:
                fut = self._engine.write(rec.id, rec.bytes_view(), None)
            else:
                fut = self._stage_out(rec)
        except EXPECTED_WRITE_REFUSALS as exc:  # nothing started (the memory pool is full): keep it
            self._written(rec)
            self._fallback(rec, exc)
            return
        except BaseException:  # an engine bug: the caller sees it; the tensor stays usable
            self._written(rec)
            rec.hold()
            move(rec, State.KEPT, self._step.counters)
            raise
        if self._time_submit:  # budget/plan: (end of the measured part)
            self._submit_s += time.perf_counter() - t_submit
        if fut is not None:  # an engine without ``completions``
            fut.add_done_callback(functools.partial(relay, self._events, rec.id))

    def _wait_below(self, limit: int, rec: TensorRecord) -> None:
        """Back-pressure: wait until the device bytes in flight are at most ``limit`` (counted
        as the record's IO wait)."""
        self.drain()
        waited = self._progress.wait(
            lambda: not self._inflight_bytes or self._inflight_bytes <= limit,
            lambda: f"{self._inflight_bytes} bytes of writes to finish before writing a {rec.describe()}",
            "back-pressure", record=rec.id, bytes=rec.nbytes)
        if waited:
            self._step.count_wait(rec, waited)

    def _staging_block(self, rec: TensorRecord, wait: bool = True):
        """A staging block for ``rec``'s bytes. Without room: wait (``wait``; counted as the
        record's IO wait, polling the blocks' events, which no IO thread reports) for a write
        to reach the drive or a reload's copy out of a block to run, or None; when no block
        can come back (staging.py ``may_free``), or for a record larger than the pool, an
        overflow block from torch's pinned allocator (warned once)."""
        copy = self._copy
        found = [copy.take_staging(rec.nbytes)]
        if found[0] is not None or not wait:
            return found[0]

        def room() -> bool:
            found[0] = copy.take_staging(rec.nbytes)
            if found[0] is not None:
                return True
            # Not ``self._writes``: it counts this record's own write, and pool writes hold no block.
            return rec.nbytes > copy.pool.capacity or not copy.pool.may_free

        waited = self._progress.wait(
            room, lambda: (f"room in the pinned staging pool (pinned_staging_bytes={copy.pool.capacity}) "
                           f"for a {rec.describe()}"), "back-pressure", poll=True, record=rec.id, bytes=rec.nbytes,
            on="staging")
        if waited:
            self._step.count_wait(rec, waited)
        return found[0] if found[0] is not None else copy.take_block(rec.nbytes)

    def _stage_out(self, rec: TensorRecord):
        """GPU: the device->host copy, into the memory engine's pool (its write completes when
        the copy lands: no IO thread, no ``write`` call) or into pinned staging, which the
        engine then writes (returns what ``write`` returned)."""
        copy = self._copy
        if copy.direct:
            data, event, rec.transfer = copy.stage_out(rec)
            return self._engine.write(rec.id, data, event)
        into = self._engine.pool_view(rec.id, rec.nbytes)
        if into is not None:
            fence = functools.partial(self._engine.fence, rec.id)
            _, _, rec.transfer = copy.stage_out(rec, into, fence)
            rec.transfer.storage = rec.storage_span()
            self.landing.append(rec)
            return None
        block = self._staging_block(rec)
        data, event, rec.transfer = copy.stage_out(rec, block=block)
        rec.transfer.storage = rec.storage_span()
        self.landing.append(rec)
        return self._engine.write(rec.id, data, event)

    def _landed(self, rec: TensorRecord) -> None:
        """GPU: ``rec``'s device->host copy ran. Its device bytes no longer count in flight; the
        memory engine's write is done; a drive engine's record is STAGED (lifecycle.py) and
        lets its device memory go, unless backward already took it (WRITING_WANTED); one whose
        storage its owner freed in place meanwhile falls back to memory instead."""
        self._inflight_bytes -= rec.nbytes
        rec.inflight = False
        if rec.storage_span() != rec.transfer.storage:
            # Its owner freed the storage in place (resize_(0)) while the copy ran: the bytes
            # may have been reused under it. Kept in memory, as one freed before its write
            # (StorageFreed); docs/design.md, "Storages freed in place".
            rec.transfer.freed = StorageFreed(
                f"the storage of a {rec.describe()} was freed in place by its owner while its copy to "
                "host memory ran (resize_(0) after it was saved); kept in memory")
            if rec.transfer.pooled is not None:
                self._write_done(rec, None)  # nothing committed: its extent goes at release
            return  # the drive write completes, then falls back (_write_done)
        if rec.transfer.pooled is not None:
            self._engine.commit(rec.id)
            self._write_done(rec, None)
            return
        rec.note_modified()  # the write completes as usual: noted
        if rec.state == State.WRITING:
            move(rec, State.STAGED, self._step.counters)
            self._copy.let_go(rec)
        elif rec.state == State.WRITE_DROPPED:
            move(rec, State.STAGED_DROPPED, self._step.counters)
            self._copy.let_go(rec)

    def _write_done(self, rec: TensorRecord, exc: Optional[BaseException]) -> None:
        """A write finished (or failed); one whose storage was freed under its copy fails."""
        if exc is None and rec.transfer is not None and rec.transfer.freed is not None:
            exc = rec.transfer.freed
        if exc is not None and rec.state in (State.STAGED, State.STAGED_WANTED) and rec.tensor is None:
            self._copy.restore(rec, source=rec.transfer.block.tensor)  # before its block goes back
        self._written(rec)
        if exc is not None:
            # Its extent stays allocated until the record is released (release), as a
            # written one's would: the slab's high-water mark, which the next step's
            # free-space check goes by, is then the step's demand whatever the disk held.
            self._fallback(rec, exc)
            return
        c = self._step.counters
        s = rec.state
        dropped = s == State.WRITE_DROPPED or s == State.STAGED_DROPPED
        if s in STAGED_STATES:
            if s == State.STAGED_WANTED:
                move(rec, State.READY, c)  # backward has its copy from staging
            elif rec.error is not None and not dropped:
                move(rec, State.BROKEN, c)
            else:
                move(rec, State.ON_DISK, c)
        else:
            if rec.note_modified():
                move(rec, State.ON_DISK if dropped else State.BROKEN, c)
                rec.tensor = None
            elif s == State.WRITING_WANTED:
                move(rec, State.READY, c)  # backward already has it: keep our reference
            else:
                move(rec, State.ON_DISK, c)
                # our copy is on disk; the memory goes when the model drops it
                if self._copy is not None:
                    self._copy.let_go(rec)
                else:
                    rec.tensor = None
        if dropped or not rec.handles:  # no user left (a forwarded one waited for its write)
            self.release(rec)

    def _written(self, rec: TensorRecord) -> None:
        """The engine is done with a write's bytes (written, failed, refused or cancelled):
        they no longer count in flight, and a GPU record's pinned staging block goes back
        (after a copy back from it, when one was made)."""
        self._uncount(rec)
        xfer = rec.transfer
        if xfer is not None:
            self._copy.landed(xfer)  # an IO thread that wrote it waited for the copy: a query tells
            self._copy.written(xfer)
            if xfer.ready_event is None:  # else the consumer waits on its copy back from staging
                rec.transfer = None

    def _uncount(self, rec: TensorRecord) -> None:
        """A write leaves the counts of writes (and, if its device bytes still were, of bytes)
        in flight."""
        if rec.inflight:
            self._inflight_bytes -= rec.nbytes
            rec.inflight = False
        self._writes -= 1
        self._write_bytes -= rec.nbytes

    def _fallback(self, rec: TensorRecord, exc: BaseException) -> None:
        # A full disk is warned on its own, even after an IO error was: the user acts on it.
        self._warn("disk-full" if _is_disk_full(exc) else "fallback",
                   f"offload write failed, keeping tensors in memory instead "
                   f"(counted in StepStats.fallbacks): {exc}")
        if rec.state == State.STAGED_DROPPED:  # no user left, and its device bytes are gone
            self._drop(rec)
            return
        dropped = rec.state == State.WRITE_DROPPED or not rec.handles
        rec.hold()  # it stays in memory: hold it as kept records do (record.py)
        move(rec, State.KEPT, self._step.counters)
        if dropped:
            self.release(rec)

    def _wanted_while_writing(self, rec: TensorRecord, ahead: bool = False) -> bool:
        """Backward (or, ``ahead``, read-ahead) wants a record whose write has not completed:
        it is served from memory. A write no IO thread has started is taken back, since its
        bytes would be written only to be forwarded (a tensor held until backward by someone we
        could not know of, or the last micro-batch's layers whose writes trail its forward);
        one under way completes, and its bytes are counted in StepStats.bytes_wasted. A STAGED
        record (its device memory let go) is copied back from its staging block. Read-ahead
        takes back a write no IO thread has started, but does not take from memory a record
        whose write, or on a GPU whose copy to host memory, is under way: False then, and
        nothing changed."""
        if rec.state == State.WRITING and rec.transfer is not None:
            if self._copy.landed(rec.transfer):
                self._landed(rec)  # its copy ran meanwhile: STAGED (or, memory engine, written)
                if rec.state not in WRITES:
                    return True
            elif ahead:
                return False  # its copy to host memory is under way: read-ahead leaves it be
            elif not self._copy.direct:  # backward wants it before its copy landed: the layer learns
                self._step.counters.layer(rec.layer, rec.decision).late_writes += 1
        c = self._step.counters
        if rec.state == State.STAGED:
            self._copy.restore(rec, source=rec.transfer.block.tensor)
            if self._engine.cancel(rec.id):
                self._written(rec)  # nothing was written: the block goes back after the copy from it
                move(rec, State.READY, c)
            else:
                move(rec, State.STAGED_WANTED, c)  # READY when the write ends
            return True
        if rec.state != State.WRITING:  # wanted already, or dropped
            return True
        if self._engine.cancel(rec.id):
            self._written(rec)  # nothing was written: the staging block goes back
            move(rec, State.READY, c)  # the record still holds the tensor (record.py)
            return True
        if ahead:
            return False
        move(rec, State.WRITING_WANTED, c)  # forwarded when the write completes
        return True

    # -- reads ------------------------------------------------------------------------------

    def prefetch(self, mb: MicroBatch) -> None:
        self._reads.prefetch(mb)

    @property
    def readahead_layers(self) -> int:
        """Layers read ahead of backward now (by time once a step measured its reads)."""
        return self._reads.window

    def learn(self, stats, num_micro_batches: int) -> None:
        """A finished step's figures: the read-ahead window follows its reads and compute."""
        self._reads.learn(stats, num_micro_batches)

    def materialize(self, rec: TensorRecord) -> torch.Tensor:
        """The record's tensor for backward, waiting for IO if needed."""
        s = rec.state
        if s == State.RELEASED:
            raise RuntimeError(f"a {rec.describe()} saved for backward was already released "
                               "(end_step() or close() ran before this backward)")
        if s == State.WRITING or s == State.STAGED:
            self._wanted_while_writing(rec)  # (a copy that landed meanwhile may make it ON_DISK)
        if rec.state == State.ON_DISK:
            if self._budget is not None and not self._budget.make_room(rec.nbytes):  # budget: wait for writes
                self._budget.overrun(rec.nbytes, self._step.number, f"reading back a {rec.describe()}")
            self._reads.start(rec)
        if rec.state == State.READING:
            self._reads.wait(rec)
        if rec.state == State.BROKEN:
            raise RuntimeError(rec.error)
        out = rec.hold()  # backward gets the detached alias (record.py)
        if self._copy is not None:
            self._copy.consume(rec, out)  # the current stream waits for the reload
        rec.check_version(rec.ref())
        return out

    # -- waits ------------------------------------------------------------------------------

    def wait_writes(self) -> None:
        """Block until every write handed to the engine has completed (or failed)."""
        self._progress.wait(lambda: not self._writes, lambda: f"{self._write_bytes} bytes of pending writes")

    def wait_all(self) -> None:
        """Wait for every pending write and read (releases deferred to their completion run);
        the time it blocks is the step's ``step_end_wait_s``."""
        t0 = time.perf_counter()
        tl = self.timeline
        t0_ns = tl.now() if tl is not None else 0
        self.wait_writes()
        for rec in self._table.records():
            self._reads.wait(rec, count=False)
        self._step.counters.step_end_wait_s += time.perf_counter() - t0
        if tl is not None:
            tl.wait("step-end", t0_ns)

    # -- the budget's operations --------------------------------------------------------------

    def _resident_bytes(self) -> int:
        return self._step.counters.resident_bytes

    def _in_flight_bytes(self) -> int:
        return self._inflight_bytes

    def _pinned_bytes(self) -> int:
        """Resident bytes no write will free: not in flight, not deferred (those can be written)."""
        deferred = sum(r.nbytes for mb in self._table.microbatches() for r in mb.deferred
                       if r.state == State.SAVED)
        return self._step.counters.resident_bytes - self._inflight_bytes - deferred

    def _wait_for_room(self) -> bool:
        tl = self.timeline
        t0_ns = tl.now() if tl is not None else 0
        if not self._progress.next_event(time.perf_counter() + self._config.io_timeout_s):
            raise IOTimeout(f"waited {self._config.io_timeout_s:g}s for {self._inflight_bytes} bytes "
                            "of writes to finish to stay within activation_budget_bytes")
        if tl is not None:
            tl.wait("budget", t0_ns)
        return True

    # -- release ----------------------------------------------------------------------------

    def release(self, rec: TensorRecord, force: bool = False) -> None:
        s = rec.state
        if s == State.RELEASED:
            return
        c = self._step.counters
        if s in IN_FLIGHT and not force:
            # IO in flight on its extent and memory: free both when it completes, unless it
            # is a write no IO thread has started, which is taken back now.
            if s == State.WRITING_WANTED or s == State.STAGED_WANTED:  # READY when its write ends, then released
                return
            if s in WRITES:
                if s == State.WRITING:
                    move(rec, State.WRITE_DROPPED, c)
                elif s == State.STAGED:
                    move(rec, State.STAGED_DROPPED, c)
                if not self._engine.cancel(rec.id):
                    return
                self._written(rec)  # never started: its staging is free
            else:
                if s != State.READ_DROPPED:
                    move(rec, State.READ_DROPPED, c)
                return
        elif s in WRITES:  # forced (close) with a write still in flight: it no longer counts
            self._uncount(rec)
        self._drop(rec)

    def _drop(self, rec: TensorRecord) -> None:
        """The record leaves: RELEASED, its extent freed, its memory and events let go."""
        move(rec, State.RELEASED, self._step.counters)
        if self._engine is not None:
            self._engine.release(rec.id)  # frees its extent at once (no-op if never written)
        if self._tracer is not None:
            self._tracer.forget(rec.id)
        if self._copy is not None:
            self._copy.unused(rec.transfer)  # a restored tensor nobody consumed: after its copy
        rec.tensor = None
        if self._copy is not None:
            self._copy.forget(rec.transfer)
        rec.transfer = None
        self._table.remove(rec)

    def release_all(self) -> int:
        """Release every record still in the table, IO or not (no IO may be pending: after
        :meth:`wait_all`, or when closing); returns how many there were."""
        leftovers = self._table.records()
        for r in leftovers:
            self.release(r, force=True)
        self._progress.pool_reads.clear()  # every key is released: the engine counted their reads
        return len(leftovers)

    def close(self) -> None:
        """Stop: wait for writes (a hung one is logged, not waited for forever), release every
        record, and give back the restore pool's memory. The engine is the offloader's to close."""
        try:
            self.drain()
            self.wait_writes()
        except IOTimeout as exc:
            log.error("ssdtrain: closing with IO still pending: %s", exc)
        finally:
            self.release_all()
            self._restore_pool.close()
