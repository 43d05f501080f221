"""The recompute pass is measured per layer: a layer whose forward a checkpoint runs again in
backward has its time counted in StepStats.layers (``recompute_s``, ``recomputes``), which the
bench's predictor and adaptive price recomputing with (instead of the layer's forward)."""

import time

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ssdtrain_megatron import ActivationOffloader, OffloadConfig
from ssdtrain_megatron.cache.adaptive import AdaptivePlanner

DELAY = 0.03


class _Layer(nn.Module):
    """A layer whose forward takes at least ``delay`` seconds."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.lin, self.delay = nn.Linear(64, 64), delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay)
        return torch.tanh(self.lin(x))


def _step(off, layers, recomputed, micro_batches=2):
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    for mb in range(micro_batches):
        with off.microbatch(mb):
            h = x
            for i, layer in enumerate(layers):
                def run(t, i=i, layer=layer):
                    with off.layer(i):
                        return layer(t)
                h = checkpoint(run, h, use_reentrant=recomputed[i]) if recomputed[i] is not None else run(h)
        h.sum().backward()
    return off.end_step()


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_layer_run_again_in_backward_has_its_recompute_pass_timed(offload_dir, reentrant):
    """Layer 1 is checkpointed (megatron-core's checkpoint is reentrant, torch's default is
    not) and sleeps DELAY in its forward: its recompute passes are counted once per micro-batch
    and last at least DELAY each; the layers run once have none. Broken by not timing layer
    scopes entered inside backward: recomputes 0."""
    layers = [_Layer(0.0), _Layer(DELAY), _Layer(0.0)]
    with ActivationOffloader(OffloadConfig(dirs=[str(offload_dir)], policy="keep")) as off:
        st = _step(off, layers, [None, reentrant, None])
    rows = {r.layer: r for r in st.layers}
    assert rows["1"].recomputes == 2 and rows["1"].recompute_s >= 2 * DELAY, rows["1"]
    assert rows["1"].forward_s >= 2 * DELAY
    for k in ("0", "2"):
        assert (rows[k].recomputes, rows[k].recompute_s) == (0, 0.0), rows[k]


def test_adaptive_prices_a_recomputed_layer_at_its_measured_pass(offload_dir):
    """The adaptive planner's measurements carry the recompute pass of a layer once it ran
    recomputed, and keep it in later steps that did not recompute it; before, the model's
    default (None: the forward). Broken by not passing recompute_s: None after the step."""
    layers = [_Layer(0.0), _Layer(DELAY), _Layer(0.0)]
    planner = AdaptivePlanner(OffloadConfig(dirs=[str(offload_dir)], policy="adaptive"), None)
    with ActivationOffloader(OffloadConfig(dirs=[str(offload_dir)], policy="keep")) as off:
        plain = _step(off, layers, [None, None, None])
        again = _step(off, layers, [None, False, None])
        after = _step(off, layers, [None, None, None])

    def measured(st):
        rows = {r.layer: r for r in st.layers}
        return planner.measure(st, [0, 1, 2], rows, 2)

    assert [m.recompute_s for m in measured(plain)] == [None, None, None]
    got = measured(again)[1].recompute_s
    assert got is not None and got >= DELAY
    assert measured(after)[1].recompute_s == got  # remembered
