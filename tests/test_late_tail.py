"""``late_tail`` gives layers back to offload once their writes land in time again.

Backward that wants a record before its device->host copy landed makes its layer (and those
after it) defer their writes like ``keep_last_layers``' (cache/decisions.py ``late_tail``).
Before the fix the tail only grew: one slow first step (a cold GPU, a warm-up) kept those
layers' activations in GPU memory for the whole run. Now it halves after a run of steps with no
late write, and a halving that finds them late again waits twice as long before the next.

The first test runs the real offloader, posix engine and autograd with the recording stand-in
for CUDA (tests/recording_streams.py: a stream marked ``unobserved`` is a GPU far behind the
host, whose copies never land before backward). Broken variant tried: ``late_tail`` only
growing (``Decisions._learn_late`` returning after its first branch) fails both tests.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ssdtrain_megatron import OffloadConfig
from ssdtrain_megatron.cache.decisions import Decisions
from tests.test_staged_writes import _scene
from tests.test_staging_race import Saves


def _step(off, rec, drive, step: int, hold: bool = False, land: bool = False):
    """One step of four layers; ``hold``: the drive holds its first write until backward ended
    (so backward finds the records' writes under way); ``land``: the offload stream runs every
    copy forward gave it before backward starts (the copies landed in time by that event, not
    by the stand-in's random pace, which under load could leave one not yet run)."""
    drive.holding = hold
    drive.gate.clear()
    x = torch.randn(64, 3 * 128, generator=torch.Generator().manual_seed(step)).requires_grad_()
    seen = []
    with off.microbatch(0):
        h = x
        for i in range(4):
            with off.layer(i):
                h = Saves.apply(h, rec, seen)
        loss = h.sum()
    if land:
        rec.run(off.copy.offload_stream)
    loss.backward()
    drive.holding = False
    drive.gate.set()
    return off.end_step()


def test_layers_a_slow_first_step_kept_are_offloaded_again_once_their_writes_land(tmp_path):
    """Step 0 on a GPU far behind (nothing lands before backward): the later layers are found
    late and kept from then on. From step 1 the copies land before backward (``land``): within
    a few steps the tail is empty and the step keeps only ``keep_last_layers``' layer again, as
    step 0 did."""
    rec, drive, off = _scene(tmp_path, keep_last_layers=1)
    try:
        rec.unobserved.add(off.copy.offload_stream.name)
        first = _step(off, rec, drive, 0, hold=True)
        assert {r.layer: r.late_writes for r in first.layers}["2"] > 0
        assert off._decisions.late_tail >= 2
        rec.unobserved.discard(off.copy.offload_stream.name)
        kept = []
        for step in range(1, 5):
            stats = _step(off, rec, drive, step, land=True)
            kept.append(stats.tensors_kept)
            assert not any(r.late_writes for r in stats.layers)
        assert off._decisions.late_tail == 0, f"late_tail {off._decisions.late_tail} after 4 steps in time"
        assert kept[0] > kept[-1] == first.tensors_kept, f"kept per step {kept}, step 0 {first.tensors_kept}"
    finally:
        drive.gate.set()
        off.close()


def _stats(late_layers=()):
    return SimpleNamespace(layers=[SimpleNamespace(layer=str(i), late_writes=int(str(i) in late_layers))
                                   for i in range(4)])


def test_a_give_back_that_is_late_again_waits_twice_as_long_before_the_next(tmp_path):
    d = Decisions(OffloadConfig(dirs=[str(tmp_path)]), None, None)
    order = [0, 1, 2, 3]
    tails = []
    for late in [("2", "3"), (), ("2",), (), (), (), ()]:
        d.learn(_stats(late), order, 1)
        tails.append(d.late_tail)
    # late at 2: tail 2; calm: halved (a probe); late again: 2, and two calm steps before
    # the next halving; calm after it: the next halving after two more.
    assert tails == [2, 1, 2, 2, 1, 1, 0], tails
