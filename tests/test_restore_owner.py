"""Restored tensors are allocated on the compute stream named at install, whatever stream is current.

Megatron's 1F1B schedule starts backward's reads of micro-batch a just before the next
micro-batch b's forward. A read of a that completes while b's writes are being handed over is
processed by the write batch's back-pressure (cache/transfers.py ``submit_all`` -> ``writes()``
-> ``_wait_below`` -> ``drain`` -> ``finish_in`` -> ``DeviceCopy.restore``), inside the offload
stream's context. Taking the current stream there made the offload stream the restored
tensor's owner: its memory came from the offload stream's pool (fault A's growth again), and
the reload copy waited behind every queued device->host copy, since the allocation event was
recorded on the offload stream.

CPU machine: the streams are the recording stand-in (tests/recording_streams.py, deferred
offload and reload streams, the caching-allocator model with poison); engine, files, pinned
pool and autograd are real. The engine holds a's read completions (:class:`Holding`) and
hands them to the completion queue when b's first write is submitted, so the next write's
back-pressure is what processes them, ordered by that hand-off, not by timing.

Broken variant: ``DeviceCopy.restore`` taking ``ops.current_stream`` as the owner again
(a975649): "restores allocated on ['s1', ...], not on the compute stream default".
"""

from __future__ import annotations

import threading

import pytest
import torch

from ssdtrain_megatron import ActivationOffloader, OffloadConfig
from ssdtrain_megatron.io import make_engine
from tests import gpu_scenes as scene
from tests.recording_streams import Recorder
from tests.staging_checks import check_staging_reuse
from tests.test_staging_race import Logged


class Holding(Logged):
    """A logged real engine whose read completions, while armed, are held (not put on the
    offloader's queue) until :meth:`hand_over`; the first ``write`` while armed disarms it and hands them over, so that the write
    batch it belongs to is what processes them."""

    _own = Logged._own + ("held", "cond", "queue", "reading", "armed")

    def __init__(self, inner, rec: Recorder) -> None:
        object.__setattr__(self, "held", [])
        object.__setattr__(self, "cond", threading.Condition())
        object.__setattr__(self, "queue", None)
        object.__setattr__(self, "reading", set())
        object.__setattr__(self, "armed", False)
        super().__init__(inner, rec)

    def __setattr__(self, name, value):
        if name == "completions" and value is not None:
            object.__setattr__(self, "queue", self.rec.completions(value))
            value = _HeldQueue(self)
            object.__setattr__(self.inner, "completions", value)
            return
        super().__setattr__(name, value)

    def read(self, key, out, ready_event=None):
        with self.cond:
            if self.armed:  # armed: a's reads, before b's first write
                self.reading.add(key)
        return super().read(key, out, ready_event)

    def write(self, key, data, ready_event=None):
        fut = super().write(key, data, ready_event)
        if self.armed:
            with self.cond:
                self.armed = False
            self.hand_over()
        return fut

    def wait_held(self, n: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.held) >= n, 60), f"{len(self.held)} of {n} reads completed"

    def hand_over(self) -> None:
        with self.cond:
            held, self.held[:] = list(self.held), []
        for item in held:
            self.queue.put(item)


class _HeldQueue:
    def __init__(self, eng: Holding) -> None:
        self.eng = eng

    def put(self, item) -> None:
        eng = self.eng
        with eng.cond:
            if isinstance(item, tuple) and item[0] in eng.reading:
                eng.reading.discard(item[0])
                eng.held.append(item)
                eng.cond.notify_all()
                return
        eng.queue.put(item)

    def __getattr__(self, name):
        return getattr(self.eng.queue, name)


def one_f_one_b(tmp_path, seed: int):
    """a's forward and writes; a's reads start (held in the engine); b's forward, whose first
    write hands the reads over and whose second write's back-pressure restores them. Returns
    (recorder, the compute stream's name, the streams of allocations made elsewhere from
    b's forward on, the allocator's report, the gradients)."""
    rec = Recorder(seed=seed, poison=True, deferred_compute=True)
    cfg = OffloadConfig(dirs=[str(tmp_path)], engine="posix", io_threads=1, min_tensor_bytes=0,
                        keep_last_layers=1, prefetch_layers=scene.LAYERS, chunk_bytes=scene.NBYTES,
                        max_inflight_bytes=scene.NBYTES, pinned_staging_bytes=4 * scene.LAYERS * scene.NBYTES)
    eng = Holding(make_engine(cfg), rec)
    outs = [torch.zeros(scene.SHAPE) for _ in range(2)]
    with ActivationOffloader(cfg, device=torch.device("cpu"), engine=eng, streams=rec) as off:
        compute = off.copy.compute_stream.name
        ha = scene.forward(rec, 0, outs[0], off)
        off.wait_writes()
        eng.armed = True
        off.begin_backward(0)
        eng.wait_held(1)  # read-ahead's byte cap (max_inflight_bytes) allows one read
        start = len(rec.log)
        hb = scene.forward(rec, 1, outs[1], off)
        assert not eng.held and not eng.armed, "b's writes never handed a's reads over"
        scene.backward(ha)
        off.begin_backward(1)
        scene.backward(hb)
        off.end_step()
        elsewhere = [n.agent for n in rec.log[start:] if n.kind == "alloc" and n.agent != compute]
        rec.run_all()
        report = rec.streams_report()
        check_staging_reuse(rec, off.copy.pool._mem)
    rec.run_all()
    return rec, compute, elsewhere, report, outs


@pytest.mark.parametrize("seed", scene.SEEDS)
def test_reads_restored_inside_a_write_batch_are_owned_by_the_compute_stream(tmp_path, seed):
    """Every restored tensor's memory comes from the compute stream's pool, none from the
    offload stream's, and the gradients of both micro-batches are exact (poison on)."""
    rec, compute, elsewhere, report, grads = one_f_one_b(tmp_path, seed)
    assert not elsewhere, (f"restores allocated on {elsewhere}, not on the compute stream {compute} "
                           f"(seed {rec.seed})")
    others = {s: b for s, b in report["reserved"].items() if s != compute and b}
    assert not others, f"bytes reserved on streams other than the compute stream: {others} (seed {rec.seed})"
    scene.exact(rec, grads)
