"""What the training thread learns of the IO threads and the GPU, and how it waits for it.

Three sources, each looked at only on the training thread, which owns every record:

- the *events queue*: an IO thread puts ``(record id, None or the exception)`` when a request
  completes, a dropped handle ``(record, DROP)`` (hooks.py);
- the *copies landing* (GPU): device->host copies on the offload stream, oldest first, whose
  events are polled with ``query()`` (one stream runs them in order, so the oldest is the next
  to finish; no IO thread reports them, and the host never blocks on the GPU for them);
- the *copies out of the engine's pool* (GPU, memory engine): polled the same way, only so
  that the engine's read meter sees when each finished.

``wait(done, ...)`` blocks until ``done()`` holds, processing whatever happens meanwhile; while
copies are in flight it looks at the oldest one every ``LANDING_POLL_S``. A wait whose
``done()`` itself depends on GPU events nothing reports (``poll``: room in the staging pool,
freed when a reload's copy out of a block ran) asks ``done()`` again at that pace too, whether
or not copies to host are in flight. Every wait of the training thread on the offloader goes
through :meth:`Progress.next_event` (the GPU check's stall probe times it there).
"""

from __future__ import annotations

import queue
import time
from collections import deque
from typing import Callable, Deque, Optional, Tuple

from .lifecycle import WRITES

LANDING_POLL_S = 0.0002
"""While copies are in flight, a wait looks at the oldest one's event this often (it has no
IO thread to report it): a fraction of a layer's copy at any link's pace."""


class IOTimeout(RuntimeError):
    """An IO wait exceeded ``io_timeout_s``; the message says what was pending."""


def relay(events, key: int, fut) -> None:
    """For an engine that returns Futures instead of reporting to ``completions``: its
    completion, put on the events queue."""
    events.put((key, fut.exception()))


class Progress:
    """The events queue and the copies in flight, drained and waited for (module docstring).

    Args:
        events: the queue IO threads and dropped handles report to.
        copy: the GPU data path (``device_copy.py``), or None.
        on_event: processes one queued item (``(what, outcome)``).
        on_landed: processes a record whose device->host copy landed.
        pool_read_done: tells the engine a copy out of its pool finished (key).
        timeout_s: ``io_timeout_s``: how long any one wait may last.
    """

    def __init__(self, events: "queue.SimpleQueue", copy, on_event: Callable[..., None],
                 on_landed: Callable[..., None], pool_read_done: Callable[[int], None], timeout_s: float) -> None:
        self._events = events
        self._copy = copy
        self._on_event = on_event
        self._on_landed = on_landed
        self._pool_read_done = pool_read_done
        self.timeout_s = timeout_s
        self.landing: Deque = deque()
        """Records whose device->host copy is not known to have run, in issue order."""
        self.pool_reads: Deque[Tuple[int, object]] = deque()
        """(key, ready event) of copies out of the engine's pool, in issue order."""
        self.timeline = None  # telemetry/timeline.py, while a step is recorded (the offloader sets it)

    @property
    def pending(self) -> bool:
        """Something may have happened that only a poll finds (copies in flight) or an IO
        thread reported (the queue is not empty)."""
        return bool(self.landing or self.pool_reads) or not self._events.empty()

    def drain(self) -> None:
        """Process everything that happened so far: copies that landed, queued events."""
        if self.landing or self.pool_reads:
            self.poll_copies()
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

    def poll_copies(self) -> bool:
        """Process the device->host copies that landed, oldest first, and the copies out of the
        pool that finished; True when a copy landed."""
        landed = False
        q = self.landing
        while q:
            rec = q[0]
            xfer = rec.transfer
            if rec.state not in WRITES or xfer is None or not rec.inflight:
                q.popleft()  # done (or given up) another way
                continue
            if not self._copy.landed(xfer):
                break
            q.popleft()
            self._on_landed(rec)
            landed = True
        reads = self.pool_reads
        while reads and reads[0][1].query():
            self._pool_read_done(reads.popleft()[0])
        return landed

    def next_event(self, deadline: float, poll: bool = False) -> bool:
        """Wait until ``deadline`` for one thing to happen and process it: an IO completion or
        a dropped handle from the queue or, with copies in flight, a device->host copy that
        landed; False on timeout. ``poll``: the caller's condition depends on GPU events
        nothing reports (module docstring): True also after ``LANDING_POLL_S`` with nothing
        processed, so that the caller looks again. An error raised while processing it (a
        failed finish_read) reaches the caller as it is."""
        while True:
            if (self.landing or self.pool_reads) and self.poll_copies():
                return True
            left = deadline - time.perf_counter()
            if self.landing or poll:
                left = min(left, LANDING_POLL_S)
            try:
                item = self._events.get(timeout=left) if left > 0 else self._events.get_nowait()
            except queue.Empty:
                if time.perf_counter() >= deadline:
                    return False
                if poll:
                    return True
                if self.landing:
                    continue
                return False
            self._on_event(*item)
            return True

    def wait(self, done: Callable[[], bool], what: Callable[[], str], reason: Optional[str] = None,
             poll: bool = False, **args) -> float:
        """Block until ``done()`` holds, processing what happens meanwhile; the seconds it
        waited (0.0 when ``done()`` held at once). ``reason``: a WAIT_REASONS reason the
        timeline records the wait under, with ``args``. ``poll``: ``done()`` depends on GPU
        events nothing reports; it is asked again every ``LANDING_POLL_S`` (module docstring).

        Raises:
            IOTimeout: after ``timeout_s``, saying "waited <timeout_s>s for <what()>".
        """
        if done():
            return 0.0
        t0 = time.perf_counter()
        tl = self.timeline
        t0_ns = tl.now() if tl is not None else 0
        deadline = t0 + self.timeout_s
        while not done():
            if not self.next_event(deadline, poll):
                raise IOTimeout(f"waited {self.timeout_s:g}s for {what()}")
        if tl is not None and reason is not None:
            tl.wait(reason, t0_ns, **args)
        return time.perf_counter() - t0
