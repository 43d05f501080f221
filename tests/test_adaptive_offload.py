"""policy="adaptive" on a real model with a capped drive: it must stop stalling on IO."""

import logging

import pytest
import torch

from ssdtrain_megatron import ActivationOffloader, OffloadConfig
from tests.bitwise import float_bits
from tests.models import assert_bitwise_equal, run_steps, tiny_gpt
from tests.drives import mount


def batches(n=2, b=4, s=128):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (b, s), generator=g) for _ in range(n)]


def test_adaptive_cuts_io_wait_by_three_quarters_under_a_slow_drive(offload_dir, caplog):
    model = tiny_gpt(layers=6, hidden=128, seq=128)
    data = batches()
    ref = run_steps(model, data, steps=4)
    waits = {}
    for policy in ("offload", "adaptive"):
        c = OffloadConfig(dirs=[str(offload_dir)], policy=policy, min_tensor_bytes=1024,
                          bandwidth_cap_gbps=0.05, prefetch_layers=1)
        with caplog.at_level(logging.INFO, logger="ssdtrain_megatron"):
            with ActivationOffloader(c) as off:
                got = run_steps(model, data, off, steps=4)
        assert_bitwise_equal(ref, got)
        stats = got[2]
        waits[policy] = sum(s.io_wait_s for s in stats[1:])  # after the warm-up step
        if policy == "adaptive":
            decisions = [r.decision for r in stats[-1].layers if r.layer != "None"]
            assert "keep" in decisions
    print("io wait after warm-up:", waits)
    # The drive stalls offload: 2.4 s alone, 0.41 s in a suite run beside a bench (slower
    # compute leaves the IO more time), so the bar is that it stalls at all, measurably.
    assert waits["offload"] > 0.25
    # Measured alone 0.06; 0.18 while the whole suite and other jobs share the 2 cores.
    assert waits["adaptive"] <= 0.25 * waits["offload"], waits
    assert "ssdtrain adaptive plan #1" in caplog.text


def test_adaptive_without_a_budget_keeps_everything_from_the_first_step(offload_dir):
    model = tiny_gpt(layers=6, hidden=128, seq=128)
    c = OffloadConfig(dirs=[str(offload_dir)], policy="adaptive", min_tensor_bytes=1024)
    with ActivationOffloader(c) as off:
        _, _, stats = run_steps(model, batches(), off, steps=2)
    assert [s.bytes_offloaded for s in stats] == [0, 0]
    assert {d for _, _, d in stats[-1].plan} == {"keep"}


def test_adaptive_on_a_fast_drive_offloads_within_a_budget(offload_dir):
    model = tiny_gpt(layers=6, hidden=128, seq=128)
    data = batches()
    ref = run_steps(model, data, steps=3)
    c = OffloadConfig(dirs=mount(offload_dir / "keep"), policy="keep", min_tensor_bytes=1024)
    with ActivationOffloader(c) as off:
        keep_peak = run_steps(model, data, off, steps=1)[2][0].peak_resident_bytes
    budget = keep_peak // 2
    c = OffloadConfig(dirs=[str(offload_dir)], policy="adaptive", min_tensor_bytes=1024,
                      activation_budget_bytes=budget)
    with ActivationOffloader(c) as off:
        got = run_steps(model, data, off, steps=3)
    assert_bitwise_equal(ref, got)
    stats = got[2]
    decisions = {d for _, _, d in stats[-1].plan}
    assert decisions == {"keep", "offload"}, stats[-1].plan  # keeps what fits, offloads the rest
    assert stats[-1].bytes_offloaded > 0 and stats[-1].bytes_read > 0
    assert all(s.peak_resident_bytes <= budget for s in stats)


def test_adaptive_on_megatron_core_stops_stalling_under_a_slow_drive(offload_dir, exact):
    """Adaptive against offload for the stall, and both against keep (no offloader) for the
    numbers: agreeing with offload alone would pass if both were wrong the same way."""
    pytest.importorskip("megatron.core")
    from ssdtrain_megatron.megatron import install, uninstall
    from ssdtrain_megatron.tools.minigpt import GPTSpec, MegatronRuntime, MiniGPT

    spec = GPTSpec(layers=4, hidden=128, heads=4, seq=128, micro_batch=2, num_microbatches=2)
    waits, losses, layers = {}, {}, {}
    with MegatronRuntime() as rt:
        plain = MiniGPT(spec, rt.device)
        losses["keep"] = [plain.step() for _ in range(4)]
        models = {p: MiniGPT(spec, rt.device) for p in ("offload", "adaptive")}
        offs = {p: ActivationOffloader(OffloadConfig(dirs=mount(offload_dir / p), policy=p, min_tensor_bytes=1024,
                                                     bandwidth_cap_gbps=0.02))
                for p in models}
        try:
            for step in range(4):
                for p, off in offs.items():
                    install(off.config, offloader=off)
                    try:
                        losses.setdefault(p, []).append(models[p].step())
                    finally:
                        uninstall(close=False)
                    if step:  # after the warm-up step
                        waits[p] = waits.get(p, 0.0) + off.last_step_stats.io_wait_s
                    layers[p] = [r.decision for r in off.last_step_stats.layers if r.layer != "None"]
        finally:
            for off in offs.values():
                off.close()
    print("io wait after warm-up:", waits, layers)
    assert len(losses["offload"]) == len(losses["adaptive"]) == 4
    assert float_bits(losses["offload"]) == float_bits(losses["keep"])
    assert float_bits(losses["adaptive"]) == float_bits(losses["keep"])
    # The drive stalls offload: 2.4 s alone, 0.41 s in a suite run beside a bench (slower
    # compute leaves the IO more time), so the bar is that it stalls at all, measurably.
    assert waits["offload"] > 0.25
    # Measured alone 0.06; 0.18 while the whole suite and other jobs share the 2 cores.
    assert waits["adaptive"] <= 0.25 * waits["offload"], waits
    assert "keep" in layers["adaptive"]


def test_adaptive_recompute_fallback_runs_layers_under_checkpoint(offload_dir, exact):
    """With recompute_fallback, a slow drive and a tight memory budget, the planner picks
    recompute for some layers, and the integration runs them under megatron's checkpoint."""
    pytest.importorskip("megatron.core")
    from ssdtrain_megatron.megatron import install, installed, uninstall
    from ssdtrain_megatron.tools.minigpt import GPTSpec, MegatronRuntime, MiniGPT

    spec = GPTSpec(layers=4, hidden=128, heads=4, seq=128, micro_batch=2, num_microbatches=2)
    # A drive slow enough that IO cannot hide even behind the slow compute of a loaded machine.
    cfg = OffloadConfig(dirs=[str(offload_dir)], policy="adaptive", min_tensor_bytes=1024,
                        bandwidth_cap_gbps=0.005, recompute_fallback=True, memory_budget_bytes=0)
    with MegatronRuntime() as rt:
        plain = MiniGPT(spec, rt.device)
        model = MiniGPT(spec, rt.device)
        ref = [plain.step() for _ in range(3)]
        off = install(cfg)
        try:
            got, read = [], 0
            for _ in range(3):
                got.append(model.step())
                read += off.last_step_stats.bytes_read
            decisions = [r.decision for r in off.last_step_stats.layers if r.layer != "None"]
            ran = installed().scopes.fallback_layers_run
        finally:
            uninstall()
    assert len(got) == len(ref) == 3 and float_bits(got) == float_bits(ref)
    assert "recompute" in decisions, decisions
    assert ran > 0
    assert read > 0, "nothing was read back from the engine: the offloaded layers were not offloaded"
