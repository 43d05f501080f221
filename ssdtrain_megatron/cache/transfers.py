"""The transfer machine: every record's bytes out to the engine and back, and when they may go.

After the pack hook made a record, everything that moves it between its states
(``lifecycle.TRANSITIONS``) happens here: the hand-off to the engine (with back-pressure on
the bytes in flight), completions, cancels (a write backward wants before it started),
prefetch, reads and their retries, materializing a tensor for backward, the waits, and
release. All of it runs on the training thread; the IO threads only put ``(record id,
outcome)`` on the events queue, and a dropped handle puts ``(record, DROP)`` there
(``hooks.py``); :meth:`Transfers.drain` processes them.

Collaborators, all received at construction: the IO engine, the GPU copy layer
(``device_copy.py``, None off the GPU path), the restore pool (``restore_pool.py``), the record
table (``table.py``), the step (``step.py``), the events queue, the warn-once log, the IO
tracer. The activation budget (``budget.py``) makes room by operations only this object has
(drain, write the deferred, wait for a write), so it is built here, and the decisions
(``decisions.py``) receive it from here.
"""

from __future__ import annotations

import errno
import functools
import logging
import queue
import time
from typing import List, Optional

import torch

from ..config import OffloadConfig
from ..io.base import TIERS, EngineError, IOEngine
from ..io.memory import PoolFull
from .budget import ActivationBudget, give_back_readahead
from .lifecycle import IN_FLIGHT, READS, WRITES, State, move
from .microbatch import MicroBatch
from .record import StorageFreed, TensorRecord
from .restore_pool import RestorePool
from .step import Step, WarnOnce
from .table import RecordTable

log = logging.getLogger("ssdtrain_megatron.cache.offloader")

DROP = object()
"""Event outcome: the last reference to a handle went away (the event's first item is the record)."""


def _is_disk_full(exc: Optional[BaseException]) -> bool:
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return True
        exc = exc.__cause__
    return False


class IOTimeout(RuntimeError):
    """An IO wait exceeded ``io_timeout_s``; the message says what was pending."""


# Write refusals that mean "keep it in memory" (pool full, storage freed); others propagate.
EXPECTED_WRITE_REFUSALS = (PoolFull, StorageFreed)

READ_RETRIES = 2
"""A failed read is started again this many times before the step fails: a read that fails
has lost the only copy, and transient errors (a bus reset, a flaky link) pass on a retry."""


def _relay(events: "queue.SimpleQueue", key: int, fut) -> None:
    """For an engine that returns Futures instead of reporting to ``completions``."""
    events.put((key, fut.exception()))


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
        self.timeline = None  # telemetry/timeline.py, while a step is recorded (the offloader sets it)
        self._budget: Optional[ActivationBudget] = None
        if budget_limit is not None:
            self._budget = ActivationBudget(budget_limit, self._resident_bytes, self.drain,
                                            self.write_deferred, self._wait_for_room,
                                            self._in_flight_bytes, self._pinned_bytes)

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
        """Bytes of writes handed to the engine and not yet completed."""
        return self._inflight_bytes

    def take_submit_s(self) -> float:
        """Training-thread seconds spent handing writes over since the last call."""
        s, self._submit_s = self._submit_s, 0.0
        return s

    # -- events -----------------------------------------------------------------------------

    def drain(self) -> None:
        """Process every event queued so far (IO completions, dropped handles)."""
        events = self._events
        tl = self.timeline
        if tl is not None and not events.empty():
            t0, n = tl.now(), 0
            while not events.empty():
                self._on_event(*events.get_nowait())
                n += 1
            tl.span("drain", "drain", t0, events=n)
            return
        while not events.empty():
            self._on_event(*events.get_nowait())

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

    # -- writes -----------------------------------------------------------------------------

    def keep(self, rec: TensorRecord) -> None:
        """A record that stays in memory for this step (the plan keeps its layer)."""
        rec.hold()
        move(rec, State.KEPT, self._step.counters)

    def submit_all(self, records: List[TensorRecord]) -> None:
        if records and not self._events.empty():
            # Dropped handles first: a deferred tensor whose graph is gone (megatron's
            # bias-dropout-add inside a checkpoint's no-grad forward) is released, not written.
            self.drain()
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
        if self._tracer is not None:
            self._tracer.tag(rec.id, self._step.number, rec.microbatch, rec.layer, self._step.phase)
        t_submit = time.perf_counter() if self._time_submit else 0.0  # budget/plan: its cost
        try:
            if not fresh:
                rec.check_storage()  # before any copy or IO could read memory its owner freed
            if rec.decision in TIERS:  # the plan's tier ('host', 'ssd'): said before pool_view
                self._engine.place(rec.id, rec.decision)
            data, event = self._stage_out(rec) if self._copy is not None else (rec.bytes_view(), None)
            fut = self._engine.write(rec.id, data, event)
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
            fut.add_done_callback(functools.partial(_relay, self._events, rec.id))

    def _wait_below(self, limit: int, rec: TensorRecord) -> None:
        """Back-pressure: wait until the bytes in flight are at most ``limit`` (counted as the
        record's IO wait)."""
        self.drain()
        t0 = time.perf_counter()
        t0_ns = self.timeline.now() if self.timeline is not None else 0
        deadline = t0 + self._config.io_timeout_s
        while self._inflight_bytes and self._inflight_bytes > limit:
            if not self._next_event(deadline):
                raise IOTimeout(f"waited {self._config.io_timeout_s:g}s for {self._inflight_bytes} "
                                f"bytes of writes to finish before writing a {rec.describe()}")
        self._count_wait(rec, time.perf_counter() - t0)
        if self.timeline is not None:
            self.timeline.wait("back-pressure", t0_ns, record=rec.id, bytes=rec.nbytes)

    def _stage_out(self, rec: TensorRecord):
        """GPU: (the bytes for the engine, the event it waits for), through pinned staging or,
        for the memory engine, straight into its pinned pool (one copy, no staging)."""
        into = None if self._copy.direct else self._engine.pool_view(rec.id, rec.nbytes)
        if into is None:
            data, event, rec.transfer = self._copy.stage_out(rec)
        else:
            fence = functools.partial(self._engine.fence, rec.id)
            data, event, rec.transfer = self._copy.stage_out(rec, into, fence)
        return data, event

    def _write_done(self, rec: TensorRecord, exc: Optional[BaseException]) -> None:
        """A write finished (or failed)."""
        self._written(rec)
        if exc is not None:
            # Its extent stays allocated until the record is released (release), as a
            # written one's would: the slab's high-water mark, which the next step's
            # free-space check goes by, is then the step's demand whatever the disk held.
            self._fallback(rec, exc)
            return
        c = self._step.counters
        dropped = rec.state == State.WRITE_DROPPED
        t = rec.tensor
        if t is not None and t._version != rec.version:
            rec.error = (f"a {rec.describe()} was modified in place while it was being "
                         f"offloaded (version {rec.version} -> {t._version})")
            move(rec, State.ON_DISK if dropped else State.BROKEN, c)
            rec.tensor = None
        elif rec.state == State.WRITING_WANTED:
            move(rec, State.READY, c)  # backward already has it: keep our reference
        else:
            move(rec, State.ON_DISK, c)
            rec.tensor = None  # our copy is on disk; the memory goes when the model drops it
        if dropped or not rec.handles:  # no user left (a forwarded one waited for its write)
            self.release(rec)

    def _written(self, rec: TensorRecord) -> None:
        """The engine is done with a write's bytes (written, failed, refused or cancelled):
        they no longer count in flight, and a GPU record's pinned staging block goes back."""
        self._inflight_bytes -= rec.nbytes
        if rec.transfer is not None:
            self._copy.written(rec.transfer)
            rec.transfer = None

    def _fallback(self, rec: TensorRecord, exc: BaseException) -> None:
        # A full disk is warned on its own, even after an IO error was: the user acts on it.
        self._warn("disk-full" if _is_disk_full(exc) else "fallback",
                   f"offload write failed, keeping tensors in memory instead "
                   f"(counted in StepStats.fallbacks): {exc}")
        dropped = rec.state == State.WRITE_DROPPED or not rec.handles
        rec.hold()  # it stays in memory: hold it as kept records do (record.py)
        move(rec, State.KEPT, self._step.counters)
        if dropped:
            self.release(rec)

    # -- reads ------------------------------------------------------------------------------

    def prefetch(self, mb: MicroBatch) -> None:
        if self._engine is None:
            return
        cfg = self._config
        candidates = mb.prefetch_candidates(cfg.prefetch_layers, cfg.max_inflight_bytes)
        for i, rec in enumerate(candidates):
            if rec.state == State.WRITING:
                self._wanted_while_writing(rec)
            elif self._budget is not None and not self._budget.room_to_read(rec.nbytes):
                give_back_readahead(mb, candidates[i:])  # budget: read ahead less
                return
            else:
                self._start_read(rec)

    def _wanted_while_writing(self, rec: TensorRecord) -> None:
        """Backward (or prefetch) wants a record whose write has not completed: it is served
        from memory. A write no IO thread has started is taken back, since its bytes would
        be written only to be forwarded (a tensor held until backward by someone we could not
        know of, or the last micro-batch's layers whose writes trail its forward); one under
        way completes, and its bytes are counted in StepStats.bytes_wasted."""
        if self._engine.cancel(rec.id):
            self._written(rec)  # nothing was written: the staging block goes back
            move(rec, State.READY, self._step.counters)  # the record still holds the tensor (record.py)
        else:
            move(rec, State.WRITING_WANTED, self._step.counters)  # forwarded when the write completes

    def _start_read(self, rec: TensorRecord) -> None:
        c = self._step.counters
        alive = rec.ref()
        if alive is not None:  # still referenced elsewhere: no IO needed
            # Its bytes were written for nothing; the next save of this storage passes through.
            self._table.learn_held(alive.untyped_storage())
            rec.tensor = alive.detach()
            move(rec, State.READY, c)
            return
        event = None
        if self._copy is not None:  # GPU: the engine reads into pinned staging (gds: in place)
            # Bytes in the memory engine's pool are copied from there (no staging, no engine copy).
            src = None if self._copy.direct else self._engine.pool_view_of(rec.id)
            restored, target, event = self._copy.stage_in(rec, src) if src is not None else self._copy.stage_in(rec)
        else:  # CPU: memory from the restore pool, already faulted in (restore_pool.py)
            restored, target = rec.allocate_restore(empty=self._restore_pool.empty)
        rec.tensor = restored
        move(rec, State.READING, c)
        if self._tracer is not None:
            self._tracer.tag(rec.id, self._step.number, rec.microbatch, rec.layer, self._step.phase)
        fut = self._engine.read(rec.id, target, event)
        if fut is not None:  # an engine without ``completions``
            fut.add_done_callback(functools.partial(_relay, self._events, rec.id))

    def _read_done(self, rec: TensorRecord, exc: Optional[BaseException]) -> None:
        """A read finished (or failed). ``finish_read`` runs here, on the training thread: if
        it raises (out of memory), the caller of pack/unpack/end_step gets that error."""
        c = self._step.counters
        dropped = rec.state == State.READ_DROPPED
        if exc is not None and self._retry_read(rec, exc):
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
                if self._copy is not None:
                    pooled = rec.transfer.pooled is not None
                    self._copy.finish_in(rec)  # host->device on the reload stream
                    if pooled:  # out of the engine's pool: not reused before the copy ran
                        self._engine.fence(rec.id, rec.transfer.ready_event)
                else:
                    rec.finish_read()
            except BaseException:
                rec.error = f"finishing the read of a {rec.describe()} failed"
                rec.tensor = None
                move(rec, State.BROKEN, c)
                raise
            move(rec, State.READY, c)
        if dropped:
            self.release(rec)

    def _retry_read(self, rec: TensorRecord, exc: BaseException) -> bool:
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
        self._start_read(rec)
        return True

    def materialize(self, rec: TensorRecord) -> torch.Tensor:
        """The record's tensor for backward, waiting for IO if needed."""
        s = rec.state
        if s == State.RELEASED:
            raise RuntimeError(f"a {rec.describe()} saved for backward was already released "
                               "(end_step() or close() ran before this backward)")
        if s == State.ON_DISK:
            if self._budget is not None and not self._budget.make_room(rec.nbytes):  # budget: wait for writes
                self._budget.overrun(rec.nbytes, self._step.number, f"reading back a {rec.describe()}")
            self._start_read(rec)
        elif s == State.WRITING:
            self._wanted_while_writing(rec)
        if rec.state == State.READING:
            self._wait_record(rec)
        if rec.state == State.BROKEN:
            raise RuntimeError(rec.error)
        out = rec.hold()  # backward gets the detached alias (record.py)
        if self._copy is not None:
            self._copy.consume(rec, out)  # the current stream waits for the reload
        rec.check_version(rec.ref())
        return out

    # -- waits ------------------------------------------------------------------------------

    def _wait_record(self, rec: TensorRecord, count: bool = True) -> None:
        if rec.state not in IN_FLIGHT:
            return
        t0 = time.perf_counter()
        t0_ns = self.timeline.now() if self.timeline is not None else 0
        deadline = t0 + self._config.io_timeout_s
        what = rec.state_name
        while rec.state in IN_FLIGHT:
            if not self._next_event(deadline):
                raise IOTimeout(f"waited {self._config.io_timeout_s:g}s for the "
                                f"{rec.state_name} of a {rec.describe()} (record {rec.id})")
        if count:
            self._count_wait(rec, time.perf_counter() - t0)
            if self.timeline is not None:
                self.timeline.wait("read", t0_ns, record=rec.id, bytes=rec.nbytes, layer=str(rec.layer),
                                   was=what)

    def wait_writes(self) -> None:
        """Block until every write handed to the engine has completed (or failed)."""
        deadline = time.perf_counter() + self._config.io_timeout_s
        while self._inflight_bytes:
            if not self._next_event(deadline):
                raise IOTimeout(f"waited {self._config.io_timeout_s:g}s for {self._inflight_bytes} "
                                "bytes of pending writes")

    def wait_all(self) -> None:
        """Wait for every pending write and read (releases deferred to their completion run);
        the time it blocks is the step's ``step_end_wait_s``."""
        t0 = time.perf_counter()
        t0_ns = self.timeline.now() if self.timeline is not None else 0
        self.wait_writes()
        for rec in self._table.records():
            self._wait_record(rec, count=False)
        self._step.counters.step_end_wait_s += time.perf_counter() - t0
        if self.timeline is not None:
            self.timeline.wait("step-end", t0_ns)

    def _count_wait(self, rec: TensorRecord, seconds: float) -> None:
        c = self._step.counters
        c.io_wait_s += seconds
        c.layer(rec.layer, rec.decision).io_wait_s += seconds

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
        t0_ns = self.timeline.now() if self.timeline is not None else 0
        if not self._next_event(time.perf_counter() + self._config.io_timeout_s):
            raise IOTimeout(f"waited {self._config.io_timeout_s:g}s for {self._inflight_bytes} bytes "
                            "of writes to finish to stay within activation_budget_bytes")
        if self.timeline is not None:
            self.timeline.wait("budget", t0_ns)
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
            if s == State.WRITING_WANTED:  # forwarded: READY when its write ends, then released
                return
            if s in WRITES:
                if s != State.WRITE_DROPPED:
                    move(rec, State.WRITE_DROPPED, c)
                if not self._engine.cancel(rec.id):
                    return
                self._written(rec)  # never started: its staging is free
            else:
                if s != State.READ_DROPPED:
                    move(rec, State.READ_DROPPED, c)
                return
        move(rec, State.RELEASED, c)
        if self._engine is not None:
            self._engine.release(rec.id)  # frees its extent at once (no-op if never written)
        if self._tracer is not None:
            self._tracer.forget(rec.id)
        rec.tensor = None
        rec.transfer = None
        self._table.remove(rec)

    def release_all(self) -> int:
        """Release every record still in the table, IO or not (no IO may be pending: after
        :meth:`wait_all`, or when closing); returns how many there were."""
        leftovers = self._table.records()
        for r in leftovers:
            self.release(r, force=True)
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

