"""The record side of ActivationOffloader: IO hand-off, completions, reads, waits, release.

A part of :class:`~.offloader.ActivationOffloader` (a base class of it, so that no module is
longer than a few hundred lines): everything that moves a record between its states
(``record.TRANSITIONS``) after the pack hook made it. All of it runs on the training thread;
the IO threads only put ``(record id, outcome)`` on ``self._events``.

Uses the offloader's fields: ``config``, ``_engine``, ``_copy``, ``_restore_pool``, ``_events``,
``_records``, ``_microbatches``, ``_c`` (the step's counters), ``_inflight_bytes``, ``_tracer``,
``_step``, ``_phase``, ``_warned``.
"""

from __future__ import annotations

import errno
import functools
import logging
import queue
import time
from typing import List, Optional

import torch

from ..io.base import EngineError
from ..io.memory import PoolFull
from .budget import give_back_readahead
from .hooks import _DROP
from .microbatch import MicroBatch
from .record import IN_FLIGHT, READS, RESIDENT, WRITES, State, StorageFreed, TensorRecord

log = logging.getLogger("ssdtrain_megatron.cache.offloader")


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


class RecordIO:
    """The transitions of records after pack (see the module docstring)."""

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
            c.count(e, rec.nbytes, rec.layer, rec.decision, rec)

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
        if records and not self._events.empty():
            # Dropped handles first: a deferred tensor whose graph is gone (megatron's
            # bias-dropout-add inside a checkpoint's no-grad forward) is released, not written.
            self._drain()
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
        t_submit = time.perf_counter() if self._time_submit else 0.0  # budget/plan: its cost
        try:
            rec.check_storage()  # before any copy or IO could read memory its owner freed
            if self._copy is not None:  # GPU: the engine gets pinned bytes and a copy event
                # The memory engine's pool is pinned: copy straight into it (one copy, no staging).
                into = None if self._copy.direct else self._engine.pool_view(rec.id, rec.nbytes)
                if into is None:
                    data, event, rec.transfer = self._copy.stage_out(rec)
                else:
                    fence = functools.partial(self._engine.fence, rec.id)
                    data, event, rec.transfer = self._copy.stage_out(rec, into, fence)
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
            rec.hold()
            self._move(rec, State.KEPT)
            raise
        if self._time_submit:  # budget/plan: (end of the measured part)
            self._submit_s += time.perf_counter() - t_submit
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
        if dropped or not rec.handles:  # no user left (a forwarded one waited for its write)
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
        dropped = rec.state == State.WRITE_DROPPED or not rec.handles
        rec.hold()  # it stays in memory: hold it as kept records do (record.py)
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
            self._inflight_bytes -= rec.nbytes
            self._move(rec, State.READY)  # the record still holds the tensor (record.py)
        else:
            self._move(rec, State.WRITING_WANTED)  # forwarded when the write completes

    def _start_read(self, rec: TensorRecord) -> None:
        alive = rec.ref()
        if alive is not None:  # still referenced elsewhere: no IO needed
            # Its bytes were written for nothing; the next save of this storage passes through.
            self._held.learn(alive.untyped_storage())
            rec.tensor = alive.detach()
            self._move(rec, State.READY)
            return
        event = None
        if self._copy is not None:  # GPU: the engine reads into pinned staging (gds: in place)
            # Bytes in the memory engine's pool are copied from there (no staging, no engine copy).
            src = None if self._copy.direct else self._engine.pool_view_of(rec.id)
            restored, target, event = self._copy.stage_in(rec, src) if src is not None else self._copy.stage_in(rec)
        else:  # CPU: memory from the restore pool, already faulted in (restore_pool.py)
            restored, target = rec.allocate_restore(empty=self._restore_pool.empty)
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
        if exc is not None and self._retry_read(rec, exc):
            return
        if exc is not None:
            tries = f" ({rec.read_retries + 1} attempts)" if rec.read_retries else ""
            rec.error = f"reading back a {rec.describe()} failed{tries}, the only copy is lost: {exc}"
            rec.tensor = None
            if self._copy is not None:
                self._copy.read_failed(rec)  # its staging is free
            self._move(rec, State.BROKEN)
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
                self._move(rec, State.BROKEN)
                raise
            self._move(rec, State.READY)
        if dropped:
            self._release(rec)

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
        self._move(rec, State.ON_DISK)
        self._warn_once("read-retry", f"a read failed and is retried (at most {READ_RETRIES} "
                        f"times, counted in StepStats.read_retries): {exc}")
        self._start_read(rec)
        return True

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
        """Wait for every pending write and read (releases deferred to their completion run);
        the time it blocks is the step's ``step_end_wait_s``."""
        t0 = time.perf_counter()
        self._wait_inflight_writes()
        for rec in list(self._records.values()):
            self._wait_record(rec, count=False)
        self._c.step_end_wait_s += time.perf_counter() - t0

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
            if s == State.WRITING_WANTED:  # forwarded: READY when its write ends, then released
                return
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

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("ssdtrain: %s", message)
