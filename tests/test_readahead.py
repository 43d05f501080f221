"""Read-ahead by time (plan/readahead.py, cache/reads.py): the window is as wide as the reads
need to arrive before backward reaches them, from the last step's measured read bandwidth and
compute; ``prefetch_layers`` is the start and the floor."""

from __future__ import annotations

import math

import pytest
import torch

from ssdtrain_megatron import ActivationOffloader, OffloadConfig
from ssdtrain_megatron.plan.readahead import measured_window, readahead_layers
from tests.models import mlp, run_steps


@pytest.mark.parametrize("layer_mb, gbps, backward_ms, start, most, expected", [
    (100, 10.0, 20.0, 2, 8, 2),   # 10 ms per layer's read, 20 ms of compute: 1 + 1, the floor 2
    (100, 1.0, 20.0, 2, 8, 6),    # 100 ms per read: 5 layers of compute ahead, plus one
    (100, 1.0, 5.0, 2, 8, 8),     # IO-bound (20 ms a read, 5 of compute): bounded by the layers
    (100, 10.0, 20.0, 4, 8, 4),   # prefetch_layers is also the least
    (0, 10.0, 20.0, 3, 8, 3),     # nothing measured: the start
])
def test_the_window_covers_the_reads_time_with_backward_compute(layer_mb, gbps, backward_ms, start, most, expected):
    assert readahead_layers(start, layer_mb * 1e6, gbps * 1e9, backward_ms / 1e3, most) == expected


def test_each_steps_window_is_the_one_its_own_figures_give(tmp_path, monkeypatch):
    """An 8-layer MLP on a drive capped at 0.002 GB/s and on an uncapped one: after the first
    step each window is the one that step's measured bytes, read rate and backward give
    (plan/readahead.measured_window), so the machine's load moves both sides alike; the
    formula's own cases are above. Then the window follows what the step measured whatever it
    is (a window of 7 handed back). Broken variant: Reads.learn never called from the
    offloader's end_step leaves the window at prefetch_layers (2): the last part fails.
    (How wide the slow drive's window gets depends on the machine: a layer's backward as the
    host times it includes its waits for reads, so a slow read also lengthens it.)"""
    from ssdtrain_megatron.cache import reads

    batches = [torch.randn(32, 256, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    windows, expected = {}, {}
    for name, cap in (("slow", 0.002), ("fast", None)):
        cfg = OffloadConfig(dirs=[str(tmp_path / name)], create_dirs=True, min_tensor_bytes=1024,
                            keep_last_layers=0, bandwidth_cap_gbps=cap)
        with ActivationOffloader(cfg) as off:
            _, _, stats = run_steps(mlp(depth=8), batches, off, steps=1, wait_writes=True)
            windows[name] = off.transfers.readahead_layers
            expected[name] = measured_window(cfg.prefetch_layers, stats[-1], len(batches))
    assert windows == expected, (windows, expected)
    seen = []
    monkeypatch.setattr(reads, "measured_window", lambda start, stats, n: seen.append(stats.step) or 7)
    cfg = OffloadConfig(dirs=[str(tmp_path / "any")], create_dirs=True, min_tensor_bytes=1024, keep_last_layers=0)
    with ActivationOffloader(cfg) as off:
        run_steps(mlp(depth=8), batches, off, steps=2, wait_writes=True)
        assert off.transfers.readahead_layers == 7 and seen == [0, 1], seen


def test_a_slow_drive_widens_the_window_by_compute_not_by_its_own_waits(tmp_path):
    """An 8-layer MLP on a drive capped at 0.0005 GB/s: a layer's read (65-131 KB) takes
    130-260 ms, its backward's compute (the CPU its thread spends: autograd, the hooks, the
    drains) about 10-20 ms, more on a loaded machine. A layer's backward is timed by the CPU
    its thread spent (LayerStats.backward_s), so the waits for the slow reads (counted or not:
    the throttle, the drain) do not lengthen it: it stays under half a read, and the window is
    the one the reads need, by the step's own figures (ceil(read / backward) + 1, at most every
    layer): at least 4. Not "every layer" as such: that needs backward under an eighth of a
    read, which load decides. On a975649 the host's wall time less the counted waits still held
    the reads' time (60-99 ms a layer at 0.001 GB/s) and the window stayed 3."""
    batches = [torch.randn(32, 256, generator=torch.Generator().manual_seed(0))]
    cfg = OffloadConfig(dirs=[str(tmp_path)], create_dirs=True, min_tensor_bytes=1024, keep_last_layers=0,
                        bandwidth_cap_gbps=0.0005)
    with ActivationOffloader(cfg) as off:
        _, _, stats = run_steps(mlp(depth=8), batches, off, steps=1, wait_writes=True)
        window = off.transfers.readahead_layers
    s = stats[-1]
    moved = [r for r in s.layers if r.bytes_offloaded]
    read_s = sum(r.bytes_offloaded for r in moved) / len(moved) / (s.read_gbps * 1e9)
    timed = [r.backward_s for r in moved if r.backward_s > 0]
    assert timed and max(timed) < read_s / 2, (timed, read_s)
    need = min(len(s.layers), max(cfg.prefetch_layers, math.ceil(read_s / (sum(timed) / len(timed))) + 1))
    assert window == measured_window(cfg.prefetch_layers, s, 1) == need > 3, (window, read_s, timed)
