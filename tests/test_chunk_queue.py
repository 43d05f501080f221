"""The IO threads' queue (io/requests.py ChunkQueue): the training thread's ``put`` takes the
lock only to wake a thread that waits, and no request is ever left queued with every IO thread
asleep; a request's busy meter starts when an IO thread takes it, not when it is queued."""

from __future__ import annotations

import random
import threading
import time

import torch

from ssdtrain_megatron.io.base import BusyMeter
from ssdtrain_megatron.io.extents import Extent
from ssdtrain_megatron.io.requests import ChunkQueue, Placement, Request


class _Owner:
    """What a Request needs of its engine: no completion queue, and chunk placement (each
    request one chunk at its own offset, far apart so that no two merge into one run)."""

    completions = None

    def __init__(self) -> None:
        self._next = 0

    def place_chunks(self, placement: Placement, req: Request) -> None:
        placement.extents = [Extent(0, self._next, placement.nbytes, room=placement.nbytes)]
        self._next += 1 << 30


def _request(owner: _Owner, key: int, meter: BusyMeter, writing: bool = True) -> Request:
    return Request(owner, key, writing, torch.zeros(16, dtype=torch.uint8), Placement(16), 1, None, meter, 0)


def _take_all(q: ChunkQueue, taken: list) -> None:
    while True:
        run = q.get_run(True, 1 << 20, lambda n: n)
        if run is None:
            return
        taken.extend(req.key for req, _ in run)
        time.sleep(random.random() * 1e-4)  # the IO, then back to the queue


def test_no_put_is_lost_between_a_thread_looking_and_waiting():
    owner, meter, q = _Owner(), BusyMeter(), ChunkQueue()
    taken: list = []
    threads = [threading.Thread(target=_take_all, args=(q, taken)) for _ in range(3)]
    for t in threads:
        t.start()
    rng = random.Random(0)
    n = 3000
    for key in range(n):
        q.put(_request(owner, key, meter, writing=rng.random() < 0.7))
        if rng.random() < 0.05:
            time.sleep(rng.random() * 2e-4)  # let the threads go idle now and then
    deadline = time.monotonic() + 30
    while len(taken) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    # Every request was taken while the queue was still open: a lost wake-up leaves some
    # queued with all three threads waiting, until close() would wake them.
    assert sorted(taken) == list(range(n)), f"{n - len(taken)} requests left queued"
    q.close()
    for t in threads:
        t.join(10)
        assert not t.is_alive()


class _PausingQueue(ChunkQueue):
    """Holds an IO thread between finding the queue empty and waiting, once: the window in
    which a put must still reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.looked = threading.Event()
        self.put_done = threading.Event()
        self._pause = True

    def _head(self):
        found = super()._head()
        if found is None and self._pause and threading.current_thread() is not threading.main_thread():
            self._pause = False
            self.looked.set()
            self.put_done.wait(1.0)  # a put that needs the lock waits until this thread waits
        return found


def test_a_put_while_the_thread_looks_at_an_empty_queue_still_wakes_it():
    q, owner, meter = _PausingQueue(), _Owner(), BusyMeter()
    got = []
    t = threading.Thread(target=lambda: got.append(q.get_run(True, 1 << 20, lambda n: n)))
    t.start()
    assert q.looked.wait(5)
    q.put(_request(owner, 7, meter))  # the thread saw an empty queue and is about to wait
    q.put_done.set()
    t.join(5)
    alive = t.is_alive()
    q.close()
    t.join(5)
    assert not alive, "the thread slept through the put (a lost wake-up)"
    assert [req.key for req, _ in got[0]] == [7]


def test_put_with_no_thread_waiting_takes_no_lock():
    owner, meter, q = _Owner(), BusyMeter(), ChunkQueue()
    with q._cv:  # held by "an IO thread": put must not need it when nobody waits
        done = threading.Event()
        t = threading.Thread(target=lambda: (q.put(_request(owner, 0, meter)), done.set()))
        t.start()
        assert done.wait(5), "put blocked on the queue's lock with no IO thread waiting"
    t.join()
    assert [req.key for req, _ in q.get_run(False, 1 << 20, lambda n: n)] == [0]


def test_the_meter_starts_when_an_io_thread_takes_the_request():
    owner, meter, q = _Owner(), BusyMeter(), ChunkQueue()
    req = _request(owner, 0, meter)
    q.put(req)
    time.sleep(0.05)  # queued, not taken: the device is not busy with it
    assert meter.take() == (0, 0.0)
    (taken, i), = q.get_run(False, 1 << 20, lambda n: n)
    time.sleep(0.02)
    taken.chunk_done(None)
    nbytes, busy = meter.take()
    assert nbytes == 16 and 0.02 <= busy < 0.05, busy


def test_a_cancelled_write_never_starts_its_meter():
    owner, meter, q = _Owner(), BusyMeter(), ChunkQueue()
    req = _request(owner, 0, meter)
    q.put(req)
    assert q.cancel(req)
    assert q.get_run(False, 1 << 20, lambda n: n) is None
    assert meter.take() == (0, 0.0) and meter._inflight == 0
