"""Adaptive with the tiered engine: keep, host, ssd or recompute (cache/four_places.py), the
four-place plan (plan/tiers.py) as measured selection's prior, never over the GPU budget or host
memory. The model part is pure; the runtime part trains a small tanh MLP through the real
offloader and tiered engine on tmp_path and compares gradients as integer views."""

from __future__ import annotations

import pytest
import torch

from ssdtrain_megatron import OffloadConfig
from ssdtrain_megatron.cache import ActivationOffloader
from ssdtrain_megatron.cache.four_places import FourPlaces
from ssdtrain_megatron.plan.policy import LayerMeasurement
from ssdtrain_megatron.plan.step_plan import Position
from ssdtrain_megatron.plan.tiers import Tiers, plan_tiers, price
from ssdtrain_megatron.telemetry.stats import StepStats
from tests.bitwise import bitwise_equal

MB = 10 ** 6


def _stats(**tier_gbps) -> StepStats:
    return StepStats(step=0, bytes_offloaded=0, bytes_read=0, bytes_deduplicated=0, tensors_offloaded=0,
                     tensors_passed_through=0, tensors_kept=0, tensors_forwarded=0, io_wait_s=0.0,
                     peak_resident_bytes=0, write_gbps=0.0, read_gbps=0.0, bytes_on_disk=0, fallbacks=0,
                     step_time_s=1.0, tier_gbps=tier_gbps)


LAYERS = [LayerMeasurement(forward_s=0.01, activation_bytes=10 * MB, checkpoint_bytes=MB)] * 6
POSITIONS = [Position(), Position()]


def test_price_of_the_plans_own_places_is_the_plans_iteration():
    """plan/tiers.py price(): the cost of given places, as plan_tiers prices its own, and
    whether they fit the budget. Broken by pricing every plan as fitting: keep-all (60 MB per
    position against a 30 MB share) fits."""
    t = Tiers(budget_bytes=40 * MB, host_capacity_bytes=20 * MB, host_link_bps=5e9, ssd_write_bps=0.3e9,
              ssd_read_bps=0.3e9, reserve_bytes=10 * MB)
    plan = plan_tiers(LAYERS, POSITIONS, t)
    assert price(LAYERS, POSITIONS, t, plan.decisions).iteration_s == pytest.approx(plan.iteration_s)
    keep = price(LAYERS, POSITIONS, t, [["keep"] * 6] * 2)
    assert keep.iteration_s == pytest.approx(keep.compute_s) and not keep.fits_budget
    with pytest.raises(ValueError, match=r"expected one row of 6 places"):
        price(LAYERS, POSITIONS, t, [["keep"] * 5] * 2)


def test_the_model_takes_each_tiers_bandwidth_and_plans_only_with_measured_tiers():
    """Broken by taking the faster direction of the host link: link_bps == 4e9."""
    four = FourPlaces(OffloadConfig(engine="tiered", host_memory_bytes=20 * MB))
    four.measure(_stats(host={"write": 4.0, "read": 2.0}))
    assert four.link_bps == 2e9 and four.ssd_bps is None and four.measured
    assert four.tiers(40 * MB, 10 * MB, 0.0).usable() == ("host",)  # no SSD figure yet
    four.measure(_stats(ssd={"write": 0.3, "read": 0.0}))
    assert four.ssd_bps == (0.3e9, 0.3e9) and four.tiers(40 * MB, 10 * MB, 0.0).usable() == ("host", "ssd")


def test_candidates_stay_within_the_gpu_budget_and_host_memory():
    """Every plan offered keeps each position within its share of the budget and of host
    memory, the whole-plan ones first; moves to host and to ssd are both offered. Broken by
    dropping the host check in candidates(): 'all host' (60 MB of host, 20 MB allowed) is
    offered."""
    four = FourPlaces(OffloadConfig(engine="tiered", host_memory_bytes=20 * MB, recompute_fallback=True))
    four.measure(_stats(host={"write": 5.0, "read": 5.0}, ssd={"write": 0.3, "read": 0.3}))
    plan = four.plan(LAYERS, POSITIONS, 40 * MB, 10 * MB, 0.0)
    assert plan.fits_budget and {"host", "ssd"} <= {d for row in plan.decisions for d in row}
    offered = four.candidates(plan.decisions, LAYERS, POSITIONS, 40 * MB, 10 * MB, 0.0, [str(i) for i in range(6)])
    labels = [label for label, _ in offered]
    assert labels[:2] == ["all recompute", "all ssd"]  # all keep and all host do not fit
    for _, cand in offered:
        for row in cand:
            kept = sum(m.activation_bytes if d == "keep" else m.checkpoint_bytes if d == "recompute" else 0
                       for m, d in zip(LAYERS, row))
            host = sum(m.activation_bytes for m, d in zip(LAYERS, row) if d == "host")
            assert kept <= 30 * MB and host <= 20 * MB, (row, kept, host)
    moves = {label.split(" -> ")[1] for label in labels if " -> " in label}
    assert {"ssd", "recompute"} <= moves  # host is full under this plan
    all_ssd = dict(offered)["all ssd"]
    around = four.candidates(all_ssd, LAYERS, POSITIONS, 40 * MB, 10 * MB, 0.0, [str(i) for i in range(6)])
    assert any(label.endswith("ssd -> host") for label, _ in around)


def _steps(off, weights, x, steps):
    """Train ``steps`` steps of 2 micro-batches through ``off``; the last step's gradients and
    every step's stats."""
    out = []
    for _ in range(steps):
        for w in weights:
            w.grad = None
        for mb in range(2):
            with off.microbatch(mb):
                h = x
                for i, w in enumerate(weights):
                    with off.layer(i):
                        h = torch.tanh(h @ w)
            h.sum().backward()
        out.append(off.end_step())
    return [w.grad.clone() for w in weights], out


def test_adaptive_on_tiered_plans_host_and_ssd_within_budget_and_host_memory(tmp_path):
    """Under a budget that holds half of a micro-batch and host memory that holds a third,
    the model's plan uses both tiers, every step stays within the budget after the first, host
    memory is never exceeded, bytes come back from both tiers, and the gradients equal keep's
    bit for bit. Broken by building no FourPlaces for 'tiered' in AdaptivePlanner: the plan
    has no 'host' or 'ssd' (only offload). The drives are capped at 0.05 GB/s, well below any
    host copy: the model plans once, from the first step's host rate, and at 0.5 GB/s a slow
    first host measurement made it put all three layers on the drives in about one run of four."""
    torch.manual_seed(0)
    weights = [(torch.randn(256, 256) * 0.05).requires_grad_(True) for _ in range(6)]
    x = torch.randn(1024, 256)
    layer = 1024 * 256 * 4  # the tanh output each layer saves
    cfg = OffloadConfig(dirs=[str(tmp_path)], engine="tiered", min_tensor_bytes=4096,
                        host_memory_bytes=2 * layer, bandwidth_cap_gbps=0.05, policy="adaptive",
                        activation_budget_bytes=3 * layer, adaptive_explore_steps=0)
    with ActivationOffloader(cfg.replace(policy="keep")) as keep:
        want, _ = _steps(keep, weights, x, 1)
    with ActivationOffloader(cfg) as off:
        got, stats = _steps(off, weights, x, 4)
        planner = off.planner
    last = stats[-1]
    places = {d for _, _, d in last.plan}
    assert {"host", "ssd"} <= places, last.plan
    assert all(s.peak_resident_bytes <= 3 * layer for s in stats[1:])
    assert all(s.tier_bytes["host"] <= 2 * 2 * layer for s in stats)  # 2 micro-batches, one at a time
    assert last.tier_bytes["host"] > 0 and last.tier_bytes["ssd"] > 0 and last.bytes_read > 0
    assert planner._four.last is not None and planner._four.last.fits_budget
    assert all(bitwise_equal(a, b) for a, b in zip(got, want))
