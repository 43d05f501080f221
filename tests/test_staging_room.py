"""A pack waiting for room in the pinned staging pool sees room a GPU event frees, and
overflows at once when nothing in flight could free any.

Before the fix, the wait for a staging block slept on the events queue for the whole
``io_timeout_s`` unless copies to host were in flight: a block given back behind a reload's
ready event (the copy out of it on the reload stream) came free with no IO thread to say so,
and the pack raised ``IOTimeout`` with the room already there. And "nothing in flight" was
``_writes == 0``, which never held for a write: ``submit`` had counted the record being
written, so a pool filled by blocks nobody gives back was waited on for ``io_timeout_s`` too.

CPU machine: the streams are the recording stand-in (tests/recording_streams.py); the reload
stream is ``unobserved`` (its events answer not done) until a helper thread, started by the
pack's first failed attempt to take a block, marks it observed: ordered by that event, not by
time. The posix engine, its files, IO threads and the pinned pool are real. Broken variants
tried: ``next_event`` not re-polling (no ``poll``) fails the first test with ``IOTimeout``;
``room()`` back on ``not self._writes`` fails the second with ``IOTimeout``; ``room()``
overflowing whenever no other write is in flight fails the first (``staging_overflows``).
"""

from __future__ import annotations

import threading

import pytest
import torch

from ssdtrain_megatron import ActivationOffloader, OffloadConfig
from ssdtrain_megatron.cache.lifecycle import State
from ssdtrain_megatron.io import make_engine
from tests.recording_streams import Recorder
from tests.test_staging_race import Logged, Saves, check_staging_reuse

NBYTES = 64 * 1024
TIMEOUT_S = 60.0
"""io_timeout_s: in the fixed code nothing waits for it (the pack returns as soon as its room
is seen); only a broken variant reaches it, so it can be long enough for any load."""


def _offloader(tmp_path, blocks: int):
    config = OffloadConfig(dirs=[str(tmp_path)], engine="posix", min_tensor_bytes=0, keep_last_layers=0,
                           prefetch_layers=2, chunk_bytes=NBYTES, io_threads=1, max_inflight_bytes=1 << 20,
                           pinned_staging_bytes=blocks * NBYTES, io_timeout_s=TIMEOUT_S)
    rec = Recorder()
    engine = Logged(make_engine(config), rec, pooled=False)
    return rec, ActivationOffloader(config, device=torch.device("cpu"), engine=engine, streams=rec)


def _forward(off, rec, seen, mb, values):
    ys = []
    with off.microbatch(mb):
        for i, v in enumerate(values):
            with off.layer(i):
                ys.append(Saves.apply(torch.full((NBYTES // 4,), v).requires_grad_(), rec, seen))
    return ys


def test_a_pack_waiting_for_staging_sees_a_block_a_reload_event_frees(tmp_path):
    """Both blocks of the pool hold a read whose copy to the device has not been seen to run
    (the reload stream is unobserved). The next pack waits for a block; the reload stream's
    events then complete, and the pack takes a block without overflowing, long before
    ``io_timeout_s``."""
    rec, off = _offloader(tmp_path, blocks=2)
    seen = []
    try:
        ya, yb = _forward(off, rec, seen, "a", (1.0, 2.0))
        off.wait_writes()
        rec.unobserved.add(off.copy.reload_stream.name)
        off.begin_backward("a")  # read-ahead: both records come back through the two blocks
        off.transfers.wait_all()
        assert [off.table.get(i).state for i in (0, 1)] == [State.READY, State.READY]
        assert off.copy.take_staging(NBYTES) is None, "the scene needs both blocks fenced"

        waiting = threading.Event()
        real = off.copy.take_staging

        def take_staging(nbytes):
            block = real(nbytes)
            if block is None:
                waiting.set()  # the pack found no room: the GPU may now run the reloads
            return block

        off.copy.take_staging = take_staging

        def gpu_catches_up():
            assert waiting.wait(TIMEOUT_S)
            rec.unobserved.discard(off.copy.reload_stream.name)

        helper = threading.Thread(target=gpu_catches_up)
        helper.start()
        (yc,) = _forward(off, rec, seen, "c", (3.0,))  # its write waits for a block
        helper.join()
        assert waiting.is_set(), "the pack never waited for staging (the scene did not run)"
        assert off.copy.staging_overflows == 0, "the pack overflowed although room was coming"
        off.copy.take_staging = real
        off.wait_writes()
        for y in (yc, yb, ya):
            y.sum().backward()
        assert [int(s[0]) for s in seen] == [4, 3, 2]
        off.end_step()
        assert check_staging_reuse(rec, off.copy.pool._mem) > 0
    finally:
        off.close()


def test_a_pack_overflows_at_once_when_no_block_can_come_back(tmp_path):
    """The pool's one block is withheld (as after a failed copy: ``StagingPool.withhold``), no
    other write or read is in flight: the pack takes an overflow block at once instead of
    waiting ``io_timeout_s`` for room nothing can free."""
    rec, off = _offloader(tmp_path, blocks=1)
    seen = []
    try:
        pool = off.copy.pool
        pool.withhold(pool.take(NBYTES))
        assert not pool.may_free
        (y,) = _forward(off, rec, seen, "a", (1.0,))
        assert off.copy.staging_overflows == 1
        off.wait_writes()  # written (not taken back by the backward below)
        y.sum().backward()
        assert [int(s[0]) for s in seen] == [2]
        stats = off.end_step()
        assert stats.tensors_offloaded == 1
    finally:
        off.close()
