"""An event that fences a buffer goes back to the event pool only once nothing fences with it.

A read's ready event (recorded on the reload stream after the copy out of a staging block or
a memory-engine extent) is what the pool ``query``-s before it hands that block or extent out
again. Before the fix, ``DeviceCopy.forget`` gave it back to the event pool when the record
was released, while the block or extent still waited on it; the pool hands the newest event
out first, so the next producer event re-recorded it on the compute stream, and the block's
fence then answered done for the compute stream's point. That orders the reuse after the copy
out only when the consumer waited for the ready event on the compute stream: a consumer on a
side stream (a communication or a second compute stream) left the next copy into the block
unordered, and on a GPU it would overwrite bytes the reload copy had not read yet.

CPU machine: the streams are the recording stand-in (tests/recording_streams.py), every one
deferred, the compute and side streams too (their kernels go through the stream), with the
reload stream ``unobserved`` (the host never sees a copy out finish: a GPU far behind, the
case where only the fence orders the reuse); engines, files, pinned pools and autograd are
real. Broken variant tried: ``forget`` calling ``_recycle`` instead of ``_retire`` fails the
first two tests ("staging reuse: ... is not ordered before ..."); ``offloader.close()``
closing the engine before synchronising the streams fails the third.
"""

from __future__ import annotations

import pytest
import torch

from ssdtrain_megatron import ActivationOffloader, OffloadConfig
from ssdtrain_megatron.cache.device_copy import DeviceCopy
from ssdtrain_megatron.io import make_engine
from tests.gpu_scenes import SEEDS
from tests.recording_streams import Recorder, _range, overlaps
from tests.test_memory_tier_direct import COLS, LAYERS, NBYTES, ROWS, backward, forward
from tests.test_staging_race import Logged, check_staging_reuse

class ClosingLogged(Logged):
    """A logged engine whose ``close`` is logged once it returned (its pinned pool is gone)."""

    def close(self):
        self.inner.close()
        self.rec.host("engine_closed")


def _forward(off, rec, mb):
    """Micro-batch ``mb``'s forward: (the buffer its input's gradient lands in, its output)."""
    out = torch.zeros(ROWS, COLS)
    return out, forward(off, rec, mb, out)


def _reference(n: int = 3):
    rec = Recorder()  # eager streams: kernels run when issued
    grads = []
    for mb in range(n):
        out = torch.zeros(ROWS, COLS)
        backward(forward(None, rec, mb, out))
        rec.run_all()
        grads.append(out)
    return grads


def _side_stream_scene(tmp_path, engine: str, seed: int, **kw):
    """Three micro-batches; the first one's backward consumes on a side stream, so nothing on
    the compute stream waits for its reads; the second one's writes then want the blocks or
    extents those reads came out of, before the host saw any reload finish; its reads and the
    third's writes after.
    Returns (recorder, offloader, engine, grads)."""
    config = OffloadConfig(dirs=[str(tmp_path)], engine=engine, min_tensor_bytes=0, keep_last_layers=0,
                           prefetch_layers=LAYERS, chunk_bytes=64 * 1024, max_inflight_bytes=1 << 20,
                           **kw)
    rec = Recorder(seed=seed, poison=True, deferred_compute=True)
    eng = ClosingLogged(make_engine(config), rec)
    off = ActivationOffloader(config, device=torch.device("cpu"), engine=eng, streams=rec)
    rec.unobserved.add(off.copy.reload_stream.name)
    # Deferred like every stream here: the backward's kernels go through it (Recorder.launch),
    # so a kernel reads a restored tensor only once the side stream ran its wait for the reload.
    side = off.copy.ops.new_stream(torch.device("cpu"), "side")
    grads = []
    out, h = _forward(off, rec, 0)
    off.wait_writes()
    with rec.use(side):  # autograd runs a CPU backward on this thread: unpack sees the side stream
        backward(h)
    grads.append(out)
    del h
    off.poll()  # the first micro-batch's records are released
    out, h = _forward(off, rec, 1)
    off.wait_writes()
    # The GPU catches up (the host sees the reloads finish): the second micro-batch's reads
    # and the third's writes reuse the first one's blocks or extents, ordered by the fences'
    # first record points.
    rec.unobserved.discard(off.copy.reload_stream.name)
    backward(h)
    grads.append(out)
    out, h = _forward(off, rec, 2)
    off.wait_writes()
    backward(h)
    del h
    grads.append(out)
    off.end_step()
    return rec, off, eng, grads


def _exact(rec, grads) -> None:
    rec.run_all()  # the gradients' kernels ran
    for mb, (a, b) in enumerate(zip(grads, _reference(), strict=True)):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), \
            f"micro-batch {mb}'s gradient differs (seed {rec.seed})"


@pytest.mark.parametrize("seed", SEEDS)
def test_a_side_stream_consumer_keeps_memory_engine_extents_exact(tmp_path, seed):
    """The memory engine: one extent more than a micro-batch needs, so the second micro-batch's
    first write takes the free one (its producer event is the newest event in the pool) and
    its second write wants an extent the first micro-batch's reads came out of. Broken
    variant: the pool read not fenced (cache/reads.py, ``self._engine.fence(rec.id, ready)``
    removed): "staging reuse ... is not ordered before"; on a975649 this passed, the extent
    still fenced by the write's copy event, recycled and re-recorded since (io/memory.py
    ``commit`` now drops it)."""
    rec, off, eng, grads = _side_stream_scene(tmp_path, "memory", seed, host_memory_bytes=(LAYERS + 1) * NBYTES)
    try:
        pairs = check_staging_reuse(rec, eng.inner._pool)
        assert pairs > 0, "no extent was reused across streams (nothing was checked)"
    finally:
        off.close()
    _exact(rec, grads)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_side_stream_consumer_keeps_staging_blocks_exact(tmp_path, seed):
    """The posix engine: a staging pool of one block more than a micro-batch's reads hold, so
    the second micro-batch's writes want the blocks the reads came out of."""
    rec, off, eng, grads = _side_stream_scene(tmp_path, "posix", seed, io_threads=1,
                                              pinned_staging_bytes=(LAYERS + 1) * NBYTES)
    try:
        pairs = check_staging_reuse(rec, off.copy.pool._mem)
        assert pairs > 0, "no staging block was reused across streams (nothing was checked)"
    finally:
        off.close()
    _exact(rec, grads)


def test_close_synchronises_the_streams_before_the_engine_lets_its_pool_go(tmp_path, monkeypatch):
    """Even with a fence re-recorded before its copy ran (the events recycled as before the
    fix), every copy into or out of the memory engine's pool is ordered before the engine's
    close returned: ``close()`` waits for the streams first, not only for the fences."""
    monkeypatch.setattr(DeviceCopy, "_retire", lambda self, xfer: self._recycle(xfer.ready_event))
    config = OffloadConfig(dirs=[str(tmp_path)], engine="memory", min_tensor_bytes=0, keep_last_layers=0,
                           prefetch_layers=LAYERS, chunk_bytes=64 * 1024, max_inflight_bytes=1 << 20,
                           host_memory_bytes=4 * LAYERS * NBYTES)
    rec = Recorder(poison=True, deferred_compute=True)
    eng = ClosingLogged(make_engine(config), rec)
    off = ActivationOffloader(config, device=torch.device("cpu"), engine=eng, streams=rec)
    rec.unobserved.add(off.copy.reload_stream.name)
    pool = _range(eng.inner._pool)
    side = off.copy.ops.new_stream(torch.device("cpu"), "side")  # deferred: _side_stream_scene
    out, h = _forward(off, rec, 0)
    off.wait_writes()
    with rec.use(side):
        backward(h)
    del h
    off.poll()  # released: the ready events go back to the pool
    out, h = _forward(off, rec, 1)  # ... and are re-recorded as producer and copy events
    off.close()
    (closed,) = rec.nodes("engine_closed")
    copies = [n for n in rec.nodes("copy") if overlaps(n.tags["dst"], pool) or overlaps(n.tags["src"], pool)]
    assert len(copies) == 2 * LAYERS + LAYERS
    for c in copies:
        assert rec.happens_before(c, closed), f"the memory engine's pool went before {c} ran"
