"""Ordering scenes on a stand-in as strict as CUDA for the compute streams too (issue 63).

Every stream is deferred (``Recorder(deferred_compute=True)``), the model's kernels run when
their stream runs them (tests/gpu_scenes.py), activations and restored tensors come from the
caching-allocator model with poison on, and ``record_stream`` delays a block's reuse without
making the marked stream run. Each scene runs over several seeds (tests/gpu_scenes.py
``SEEDS``, printed by the recorder; ``SSDTRAIN_STANDIN_SEED=N`` runs one). Engines, files,
pinned pools and autograd are real; only CUDA is stood in for.

Breaks each scene was checked against (one at a time; the test named fails):

- ``DeviceCopy.consume`` without ``record_stream`` for a consumer on another stream than the
  allocating one: ``test_a_consumer_on_another_stream...`` (a restored block poisoned or
  reused on the compute stream before the side stream's kernel read it: gradients differ);
- ``DeviceCopy.stage_out`` letting the record's device bytes go before its copy is queued:
  ``test_activations_are_copied...`` (the copies read poison: gradients differ);
- the memory engine keeping a write's copy event as an extent's fence after ``DeviceCopy``
  recycled it at landing (``commit`` not dropping it): ``test_an_extent_is_fenced...``
  ("the memory engine fences an extent with eN, an event the data path recycled");
- ``DeviceCopy.written`` giving a staged copy-back block back without its ready event:
  ``test_a_staged_copy_back_block...`` ("staging reuse ... is not ordered before");
- ``_retire`` querying the lowest sequence: ``test_retired_ready_events...`` (same message);
- ``DeviceCopy.unused`` a no-op: ``test_a_restore_nobody_consumed...`` (micro-batch 1's
  gradient changed).

- the memory engine's pool read not fenced (cache/reads.py ``self._engine.fence(rec.id,
  ready)`` removed): ``test_a_side_stream_consumer_leaves_buffers_fenced...[memory-*]``
  ("staging reuse ... is not ordered before"), and tests/test_event_fences.py's memory scene.
"""

from __future__ import annotations

from typing import Any, List

import pytest
import torch

from ssdtrain_megatron import ActivationOffloader, OffloadConfig
from ssdtrain_megatron.cache.device_copy import DeviceCopy
from ssdtrain_megatron.io import make_engine
from tests import gpu_scenes as scene
from tests.recording_streams import Recorder
from tests.staging_checks import check_staging_reuse
from tests.test_staging_race import Logged

MICRO = 2


def _config(tmp_path, engine: str, **kw) -> OffloadConfig:
    base = dict(dirs=[str(tmp_path)], engine=engine, min_tensor_bytes=0, keep_last_layers=0,
                prefetch_layers=2, chunk_bytes=scene.NBYTES, max_inflight_bytes=1 << 20,
                pinned_staging_bytes=4 * scene.LAYERS * scene.NBYTES,
                host_memory_bytes=4 * MICRO * scene.LAYERS * scene.NBYTES)
    base.update(kw)
    return OffloadConfig(**base)


def run_scene(tmp_path, engine: str, seed: int, side: bool, watch=None, **kw):
    """Two micro-batches, 1F1B-like: both forwards, then both backwards (on a side stream
    when ``side``: a consumer on another stream than the compute stream the restores are
    allocated on). Returns (recorder, offloader, logged engine, gradients); the offloader is
    closed, every stream ran, the staging pool and the memory engine's pool checked."""
    rec = Recorder(seed=seed, poison=True, deferred_compute=True)
    cfg = _config(tmp_path, engine, **kw)
    eng = Logged(make_engine(cfg), rec)
    off = ActivationOffloader(cfg, device=torch.device("cpu"), engine=eng, streams=rec)
    if watch is not None:
        watch(off, eng)
    pools = [off.copy.pool._mem] + ([eng.inner._pool] if engine == "memory" else [])
    side_stream = rec.new_stream(torch.device("cpu"), "side")
    outs: List[torch.Tensor] = [torch.zeros(scene.SHAPE) for _ in range(MICRO)]
    try:
        hs = [scene.forward(rec, mb, outs[mb], off) for mb in range(MICRO)]
        for mb in range(MICRO):
            off.begin_backward(mb)
            h = hs[mb]
            hs[mb] = None
            if side:
                with rec.use(side_stream):
                    scene.backward(h)
            else:
                scene.backward(h)
            del h
            off.poll()
        off.end_step()
    finally:
        off.close()
    rec.run_all()
    pairs = [check_staging_reuse(rec, pool) for pool in pools]
    assert pairs[-1] > 0, f"no block of the {engine} engine's pinned memory was reused (nothing was checked)"
    return rec, off, eng, outs


@pytest.mark.parametrize("seed", scene.SEEDS)
@pytest.mark.parametrize("engine", ["posix", "memory"])
def test_a_consumer_on_another_stream_than_the_allocating_one_gets_its_bytes(tmp_path, engine, seed):
    """Restores are allocated on the compute stream (named at install); backward consumes
    them on a side stream. The side stream waits for the ready event and marks the tensor
    (``record_stream``): its block is not reused, nor poisoned, before the side stream's
    kernel read it."""
    rec, off, eng, grads = run_scene(tmp_path, engine, seed, side=True)
    waits = [n for n in rec.log if n.kind == "wait" and n.agent == "side"]
    assert waits, "no consumer on the side stream waited for a reload (nothing checked)"
    scene.exact(rec, grads, f"{engine}, side stream: ")


@pytest.mark.parametrize("seed", scene.SEEDS)
@pytest.mark.parametrize("engine", ["posix", "memory"])
def test_activations_are_copied_before_their_memory_goes(tmp_path, engine, seed):
    """The compute stream deferred too: an activation's block goes back to its pool (and is
    poisoned) once the data path lets it go; every copy to host must have read it first."""
    rec, off, eng, grads = run_scene(tmp_path, engine, seed, side=False)
    assert not off.copy.staging_overflows
    scene.exact(rec, grads, f"{engine}: ")


def _fences(eng) -> List[Any]:
    inner = eng.inner
    with inner._lock:
        return list(inner._fences.values()) + [e for _, e in inner._fenced]


@pytest.mark.parametrize("seed", scene.SEEDS)
def test_an_extent_is_fenced_by_its_own_event_or_none(tmp_path, monkeypatch, seed):
    """The memory engine: no extent's fence names an event the data path gave back to its
    event pool (which the next producer or ready event re-records, so the fence would then
    answer for another stream's point). Checked at every give-back."""
    seen = []

    def watch(off, eng):
        recycle = DeviceCopy._recycle

        def checked(self, event):
            if event is not None:
                seen.append(event)
                assert not any(f is event for f in _fences(eng)), (
                    f"the memory engine fences an extent with {event.name}, an event the data path "
                    f"recycled (seed {eng.rec.seed})")
            recycle(self, event)

        monkeypatch.setattr(DeviceCopy, "_recycle", checked)

    rec, off, eng, grads = run_scene(tmp_path, "memory", seed, side=True, watch=watch)
    assert seen, "no event was recycled (nothing checked)"
    scene.exact(rec, grads, "memory: ")


def _last_backward(off, h) -> None:
    """Micro-batch 1's writes finish, its backward runs on the compute stream, the step ends."""
    off.wait_writes()
    off.begin_backward(1)
    scene.backward(h)
    off.end_step()


@pytest.mark.parametrize("seed", scene.SEEDS)
def test_a_staged_copy_back_block_waits_for_a_side_stream_consumers_reload(tmp_path, seed):
    """Micro-batch 0's writes are staged (their copies landed) behind one IO thread held in the
    first write, so backward (on a side stream) copies them back out of their staging blocks
    and takes the unstarted writes back: each block goes back to the pool fenced by its
    reload's ready event. The host never sees the reload stream finish meanwhile (a GPU far
    behind: only the fence orders the block's reuse), and micro-batch 1's writes take blocks;
    every copy into a block must be ordered after the copy back out of it."""
    from tests.faulty import FaultyEngine, HeldWrites

    rec = Recorder(seed=seed, poison=True, deferred_compute=True)
    held = HeldWrites()
    cfg = _config(tmp_path, "posix", io_threads=1, prefetch_layers=scene.LAYERS,
                  pinned_staging_bytes=(2 * scene.LAYERS + 1) * scene.NBYTES)
    eng = Logged(FaultyEngine(make_engine(cfg), held), rec)
    off = ActivationOffloader(cfg, device=torch.device("cpu"), engine=eng, streams=rec)
    side = rec.new_stream(torch.device("cpu"), "side")
    pool = off.copy.pool._mem
    outs = [torch.zeros(scene.SHAPE) for _ in range(MICRO)]
    try:
        held.held = True
        h = scene.forward(rec, 0, outs[0], off)
        assert held.entered.wait(60), "the IO thread never started a write"
        rec.run_all()  # every copy to host lands ...
        off.poll()  # ... and is seen: the queued writes' records are STAGED
        rec.unobserved.add(off.copy.reload_stream.name)
        off.begin_backward(0)
        with rec.use(side):
            scene.backward(h)
        del h
        off.poll()
        taken = [n for n in rec.nodes("engine_cancel") if n.tags["taken"]]
        assert taken, "no staged write was taken back (the path under test did not run)"
        # The host may see the reload stream run from here on: micro-batch 1's writes want
        # the blocks micro-batch 0's reloads came out of (one block more than a micro-batch's).
        rec.unobserved.discard(off.copy.reload_stream.name)
        h = scene.forward(rec, 1, outs[1], off)
        held.go.set()
        _last_backward(off, h)
    finally:
        held.go.set()
        off.close()
    rec.run_all()
    pairs = check_staging_reuse(rec, pool)
    assert pairs > 0, "no staging block was reused (nothing was checked)"
    scene.exact(rec, outs, "staged copy-back: ")


@pytest.mark.parametrize("seed", scene.SEEDS)
def test_retired_ready_events_come_back_only_once_the_last_recorded_one_ran(tmp_path, seed):
    """Micro-batch 0's backward consumes on a side stream; its records go, and their ready
    events are retired, each still fencing the staging block its reload came out of. The GPU
    then runs the reload stream up to the *first* ready event only, and micro-batch 1's forward
    takes events and blocks while the compute stream runs after each layer: a retired event
    handed out again is re-recorded there and completes at once, so it must not come back
    before the last one recorded (whose completion covers all) ran; else a block it fences is
    handed to a write before the copy out of it ran. Broken variant: ``_retire`` keeping the
    lowest sequence as the one to query: "staging reuse ... is not ordered before"."""
    rec = Recorder(seed=seed, poison=True, deferred_compute=True, pace=0.0)
    cfg = _config(tmp_path, "posix", io_threads=1, prefetch_layers=scene.LAYERS)
    eng = Logged(make_engine(cfg), rec)
    off = ActivationOffloader(cfg, device=torch.device("cpu"), engine=eng, streams=rec)
    side = rec.new_stream(torch.device("cpu"), "side")
    pool = off.copy.pool._mem
    reload = off.copy.reload_stream
    outs = [torch.zeros(scene.SHAPE) for _ in range(MICRO)]
    try:
        h = scene.forward(rec, 0, outs[0], off)
        off.wait_writes()
        off.begin_backward(0)
        with rec.use(side):
            scene.backward(h)
        del h
        off.poll()
        readies = [n for n in rec.log if n.kind == "record" and n.agent == reload.name]
        assert len(readies) > 2 and reload.done < readies[-1].pos, "the reloads ran already (nothing to check)"
        rec._run_to((reload, readies[0].pos))  # the GPU ran the first reload only
        _last_backward(off, scene.forward(rec, 1, outs[1], off, between=lambda: rec.run(rec.default)))
    finally:
        off.close()
    rec.run_all()
    assert check_staging_reuse(rec, pool) > 0, "no staging block was reused (nothing was checked)"
    scene.exact(rec, outs, "retired events: ")


@pytest.mark.parametrize("seed", scene.SEEDS)
def test_a_restore_nobody_consumed_lands_before_its_block_is_reused(tmp_path, seed):
    """Micro-batch 0's reads start (restores allocated on the compute stream, their copies
    queued on the reload stream), then its graph is dropped: the restored tensors go
    unconsumed and their blocks back to the compute stream's pool at once. Micro-batch 1's
    activations take those blocks; after each layer the GPU happens to run the compute stream
    and then the reload stream. The compute stream must have waited for each abandoned copy
    before its block was let go (``DeviceCopy.unused``), or the copy lands on micro-batch 1's
    activation. Broken variant: ``unused`` a no-op: micro-batch 1's gradient differs."""
    rec = Recorder(seed=seed, poison=True, deferred_compute=True)
    cfg = _config(tmp_path, "memory", prefetch_layers=scene.LAYERS)
    off = ActivationOffloader(cfg, device=torch.device("cpu"), engine=Logged(make_engine(cfg), rec), streams=rec)
    reload = off.copy.reload_stream
    outs = [torch.zeros(scene.SHAPE) for _ in range(MICRO)]
    try:
        h = scene.forward(rec, 0, outs[0], off)
        off.wait_writes()
        rec.pace = 0.0  # streams run only when something waits for them
        off.begin_backward(0)  # every layer's read starts: copies queued on the reload stream
        assert reload.done < reload.issued, "the reloads ran before the graph was dropped"
        del h
        off.poll()  # the handles dropped: the records, and their restored tensors, go

        def gpu_runs():
            rec.run(rec.default)
            rec.run(reload)

        h = scene.forward(rec, 1, outs[1], off, between=gpu_runs)
        rec.pace = 0.3  # from here on the host sees the streams progress as it polls
        _last_backward(off, h)
    finally:
        off.close()
    rec.run_all()
    want = scene.reference(MICRO)[1]
    assert torch.equal(outs[1].view(torch.int32), want.view(torch.int32)), (
        f"micro-batch 1's gradient changed: an abandoned reload landed on its activations (seed {rec.seed})")


@pytest.mark.parametrize("seed", scene.SEEDS)
@pytest.mark.parametrize("engine", ["posix", "memory"])
def test_a_side_stream_consumer_leaves_buffers_fenced_while_the_gpu_is_behind(tmp_path, engine, seed):
    """Micro-batch 0's backward consumes on a side stream while the host never sees the
    reload stream finish (a GPU far behind); micro-batch 1's writes then want the staging
    blocks or extents micro-batch 0's reloads came out of (one more than a micro-batch's):
    only their fences (the reads' ready events) order the copies into them. Broken variant:
    the memory engine's pool read not fenced (cache/reads.py): "staging reuse ... is not
    ordered before"."""
    rec = Recorder(seed=seed, poison=True, deferred_compute=True)
    room = (2 * scene.LAYERS + 1) * scene.NBYTES
    cfg = _config(tmp_path, engine, io_threads=1, prefetch_layers=scene.LAYERS, host_memory_bytes=room,
                  pinned_staging_bytes=room)
    eng = Logged(make_engine(cfg), rec)
    off = ActivationOffloader(cfg, device=torch.device("cpu"), engine=eng, streams=rec)
    pool = eng.inner._pool if engine == "memory" else off.copy.pool._mem
    side = rec.new_stream(torch.device("cpu"), "side")
    outs = [torch.zeros(scene.SHAPE) for _ in range(MICRO)]
    try:
        h = scene.forward(rec, 0, outs[0], off)
        off.wait_writes()
        rec.unobserved.add(off.copy.reload_stream.name)
        off.begin_backward(0)
        with rec.use(side):
            scene.backward(h)
        del h
        off.poll()
        h = scene.forward(rec, 1, outs[1], off)
        rec.unobserved.discard(off.copy.reload_stream.name)
        _last_backward(off, h)
    finally:
        off.close()
    rec.run_all()
    assert check_staging_reuse(rec, pool) > 0, "no buffer was reused (nothing was checked)"
    scene.exact(rec, outs, f"{engine}, GPU behind: ")
