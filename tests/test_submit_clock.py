"""The hand-over of a write reads the clock only when something uses the figure (a budget or
the adaptive planner): a plain offload pays no clock read per saved tensor (issue 26)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ssdtrain_megatron import ActivationOffloader
from ssdtrain_megatron.cache import transfers
from tests.test_offloader import cfg


class _CountingClock:
    def __init__(self, real) -> None:
        self.real, self.calls = real, 0

    def perf_counter(self) -> float:
        self.calls += 1
        return self.real.perf_counter()

    def __getattr__(self, name):
        return getattr(self.real, name)


def _reads_per_save(offload_dir, monkeypatch, n: int, **config) -> int:
    clock = _CountingClock(transfers.time)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(n)])
    with ActivationOffloader(cfg(offload_dir, keep_last_layers=0, **config)) as off:
        with off.microbatch(0):
            monkeypatch.setattr(transfers, "time", clock)
            y = model(torch.randn(64, 256))
            monkeypatch.setattr(transfers, "time", clock.real)
        y.sum().backward()
        st = off.end_step()
    assert st.tensors_offloaded + st.writes_taken_back == n  # every input was handed over
    return clock.calls


@pytest.mark.parametrize("n", [4, 16])
def test_a_plain_offload_reads_no_clock_per_hand_over(offload_dir, monkeypatch, n):
    """Broken variant: read the clock in _submit unconditionally (as before): 2 reads per
    saved tensor, 2n here."""
    assert _reads_per_save(offload_dir, monkeypatch, n) == 0


def test_the_adaptive_policy_still_measures_its_hand_over_cost(offload_dir, monkeypatch):
    assert _reads_per_save(offload_dir, monkeypatch, 4, policy="adaptive",
                           activation_budget_bytes=1 << 30) >= 2 * 4
