"""`ssdtrain bench --node-emulation` (issue 35, part 5): its flags, the settings each strategy
runs with on the emulated node, the planner's predictions next to the measurements, and the
ratios against the best single and fixed strategies; one small run end to end (slow)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import pytest

pytest.importorskip("megatron.core")

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron.*"),
              pytest.mark.filterwarnings("ignore::UserWarning:megatron.*")]

from ssdtrain_megatron import OffloadConfig  # noqa: E402
from ssdtrain_megatron.telemetry.stats import LayerStats, StepStats  # noqa: E402
from ssdtrain_megatron.tools.bench.cli import summarize  # noqa: E402
from ssdtrain_megatron.tools.bench.node import NodeEmulation, node_from_args  # noqa: E402
from ssdtrain_megatron.tools.bench.predict import fixed_rows, measurements, predict  # noqa: E402
from test_bench import TINY, _bench, _run  # noqa: E402

TWO_CPUS = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                              reason="node emulation needs two CPUs")


def _args(**given) -> argparse.Namespace:
    base = dict(node_emulation=True, compute_cpus=None, io_cpus=None, ssd_gbps=None, host_memory=None, node=None)
    base.update(given)
    return argparse.Namespace(**base)


@TWO_CPUS
def test_the_flags_put_compute_and_io_on_different_cpus_and_refuse_overlap():
    """Broken by not checking the overlap in node_from_args: no error for 0 and 0."""
    cpus = sorted(os.sched_getaffinity(0))
    node = node_from_args(_args())
    assert node.compute_cpus == (cpus[0],) and node.io_cpus == (cpus[1],)
    with pytest.raises(argparse.ArgumentTypeError, match=r"--compute-cpus 0 and --io-cpus 0 overlap"):
        node_from_args(_args(compute_cpus=(0,), io_cpus=(0,)))
    with pytest.raises(argparse.ArgumentTypeError, match=r"--io-cpus 999: this process may use CPUs"):
        node_from_args(_args(io_cpus=(999,)))
    with pytest.raises(argparse.ArgumentTypeError, match=r"--ssd-gbps needs --node-emulation"):
        node_from_args(_args(node_emulation=False, ssd_gbps=1.0))
    with pytest.raises(argparse.ArgumentTypeError, match=r"--node: 'nope' is neither a built-in node profile"):
        node_from_args(_args(node="nope"))
    assert node_from_args(_args(node_emulation=False)) is None


def test_each_strategy_runs_on_its_tier_of_the_emulated_node():
    """Broken by giving 'offload' the tiered engine: its engine is not posix."""
    node = NodeEmulation((0,), (1,), ssd_gbps=0.2, host_bytes=1 << 20)
    cfg = OffloadConfig()
    off, host, planned, keep = (node.config(n, cfg) for n in ("offload", "host", "planned", "keep"))
    assert (off.engine, off.bandwidth_cap_gbps, off.io_cpus) == ("posix", 0.2, [1])
    assert (host.engine, host.host_memory_bytes, host.bandwidth_cap_gbps) == ("memory", 1 << 20, None)
    assert (planned.engine, planned.host_memory_bytes, planned.bandwidth_cap_gbps,
            planned.recompute_fallback) == ("tiered", 1 << 20, 0.2, True)
    assert (keep.engine, keep.io_cpus) == ("posix", [1])


def _keep_stats(forward_s=0.01, nbytes=10_000_000, layers=4, n=2, step_s=None) -> StepStats:
    rows = tuple(LayerStats(layer=str(i + 1), bytes=n * nbytes, bytes_offloaded=0, tensors=1, decision="keep",
                            io_wait_s=0.0, forward_s=n * forward_s) for i in range(layers))
    step = step_s if step_s is not None else n * layers * 3 * forward_s
    return StepStats(step=3, bytes_offloaded=0, bytes_read=0, bytes_deduplicated=0, tensors_offloaded=0,
                     tensors_passed_through=0, tensors_kept=4, tensors_forwarded=0, io_wait_s=0.0,
                     peak_resident_bytes=0, write_gbps=0.0, read_gbps=0.0, bytes_on_disk=0, fallbacks=0,
                     step_time_s=step, layers=rows)


def test_the_prediction_prices_what_each_strategy_does_at_run_time():
    """offload sends every layer but the last to the (capped) SSD, host fills its tier
    first-come, recompute recomputes every layer; the ratio to keep follows from keep's own
    figures. Broken by pricing host as last-layers-first: layers 3 and 2 on host instead of 1, 2."""
    stats = _keep_stats()
    layers, _, names = measurements(stats, 2)
    assert names == ["1", "2", "3", "4"] and layers[0].activation_bytes == 10_000_000
    assert fixed_rows("host", layers, 25_000_000, 1) == (("host", "host", "keep", "keep"),)
    assert fixed_rows("offload", layers, 0, 1) == (("ssd", "ssd", "ssd", "keep"),)
    fast = NodeEmulation((0,), (1,), ssd_gbps=100.0, host_bytes=25_000_000, link_gbps=100.0)
    slow = NodeEmulation((0,), (1,), ssd_gbps=0.1, host_bytes=25_000_000, link_gbps=100.0)
    step = 2 * 4 * 3 * 0.01
    on_fast = predict(fast, stats, step, 2, {})
    assert on_fast["keep"] == 1.0 and on_fast["offload"] == pytest.approx(1.0, abs=0.02)
    assert on_fast["recompute"] == pytest.approx((step + 2 * 4 * 0.01) / step)
    on_slow = predict(slow, stats, step, 2, {"planned": (("ssd", "ssd", "host", "keep"),) * 2})
    assert on_slow["offload"] > 2.0  # 60 MB each way at 0.1 GB/s against a 0.24 s step
    assert on_slow["host"] == pytest.approx(1.0, abs=0.02) and 1.0 < on_slow["planned"] < on_slow["offload"]
    # One layer's 10 MB per micro-batch is written in 0.1 s and forwarded from memory (backward
    # comes first): the drive carries 0.2 s of the 0.24 s step, and nothing waits.
    once = predict(slow, stats, step, 2, {"planned": (("ssd", "host", "host", "keep"),) * 2})
    assert once["planned"] == pytest.approx(1.0)


def test_recomputing_is_priced_at_the_recompute_pass_the_runtime_measured():
    """Where the recompute strategy's step measured each layer's recompute pass (a quarter of
    its forward here, as on a CPU whose forward under keep also pays page faults), recompute's
    prediction adds those passes, not the forward; a layer with no pass measured keeps the
    forward. Broken by leaving ``recomputed`` out of measurements(): 1.333 predicted."""
    stats = _keep_stats()
    step = 2 * 4 * 3 * 0.01
    rows = tuple(dataclasses.replace(r, decision="recompute", recompute_s=2 * 0.0025, recomputes=2)
                 for r in stats.layers)
    recomputed = dataclasses.replace(stats, layers=rows[:3] + (stats.layers[3],))
    fast = NodeEmulation((0,), (1,), ssd_gbps=100.0, host_bytes=25_000_000, link_gbps=100.0)
    got = predict(fast, stats, step, 2, {}, recomputed=recomputed)
    assert got["recompute"] == pytest.approx((step + 2 * (3 * 0.0025 + 0.01)) / step)
    assert [m.recompute_cost_s for m in measurements(stats, 2, recomputed)[0]] == \
        pytest.approx([0.0025] * 3 + [0.01])


def test_the_planned_strategy_prices_recomputing_at_the_measured_passes_too(tmp_path):
    """The planned strategy's plan (PlannedTiers, bench/node.py) prices a recomputed layer as the
    prediction does: at the pass the recompute strategy measured, not at keep's forward. Drives
    and host memory too small to help: the budget is met by recomputing. Broken by leaving
    ``recomputed`` out of plan_for: recompute_s 0.06 (the forward), not 0.015."""
    from ssdtrain_megatron.cache import ActivationOffloader
    from ssdtrain_megatron.tools.bench.node import PlannedTiers

    stats = _keep_stats()
    rows = tuple(dataclasses.replace(r, decision="recompute", recompute_s=2 * 0.0025, recomputes=2)
                 for r in stats.layers)
    recomputed = dataclasses.replace(stats, layers=rows)
    node = NodeEmulation((0,), (1,), ssd_gbps=1e-6, host_bytes=1, link_gbps=100.0)
    budget = 10_000_000 + 2 * 10_000_000  # the reserve (one layer) and two layers' room
    cfg = OffloadConfig(dirs=[str(tmp_path)], policy="keep", create_dirs=True)
    with ActivationOffloader(cfg) as off:
        planned = PlannedTiers(node, budget, 4, off)
        planned.plan_from(off, stats, 2, recomputed)
        measured = planned.plan
        planned.plan_from(off, stats, 2)
        forward = planned.plan
    k = measured.decisions[0].count("recompute")
    assert k >= 2 and forward.decisions[0].count("recompute") == k  # the inputs stay: 2 are not enough
    assert measured.recompute_s == pytest.approx(k * 2 * 0.0025)  # per layer, per micro-batch
    assert forward.recompute_s == pytest.approx(k * 2 * 0.01)


def test_planned_and_adaptive_are_compared_with_the_fastest_strategy_within_the_budget():
    """At the ratios' size, planned's step time over the fastest single strategy whose peak
    fits the budget (keep does not fit here, host does not either), adaptive's over the
    fastest of those and planned. Broken by leaving the peak check out of best_within: keep
    (1.0 s, over the budget) is the best single."""
    same = [1.0, 0.9, 0.8]
    run = _run({("keep", 1): ([9.0, 0.5, 0.5], [50] * 3, same),
                ("keep", 2): ([9.0, 1.0, 1.0], [100] * 3, same),
                ("offload", 2): ([9.0, 1.6, 1.6], [40] * 3, same),
                ("host", 2): ([9.0, 1.1, 1.1], [70] * 3, same),
                ("recompute", 2): ([9.0, 1.4, 1.4], [20] * 3, [1.0] * 3),
                ("planned", 2): ([9.0, 1.2, 1.2], [50] * 3, same),
                ("adaptive", 2): ([9.0, 1.26, 1.26], [50] * 3, same)}, warmup=1)
    # keep's step is 0.12 s of layers and 0.88 s of optimizer, during which the drive works on:
    # 30 MB of writes take 3 s at 0.01 GB/s, more than the whole step.
    run.node = NodeEmulation((0,), (1,), ssd_gbps=0.01, host_bytes=10_000_000, link_gbps=5.0)
    for key, ser in run.series.items():
        ser.last_stats = _keep_stats(n=1) if key == ("keep", 2) else None
    run.series[("planned", 2)].plan_rows = (("ssd", "host", "keep", "keep"),)
    s = summarize(run, memory_budget=50)
    r = s["ratios"]
    assert r["planned_vs_best_single_step_time"] == pytest.approx(1.2 / 1.4)  # recompute: the fastest fitting
    assert s["best_single"] == "recompute" and s["best_fixed"] == "planned"
    assert r["adaptive_vs_best_fixed_step_time"] == pytest.approx(1.26 / 1.2)
    assert r["planned_peak_vs_budget"] == 1.0
    table = s["node_emulation"]["vs_keep_step_time"]
    assert set(table) == {"keep", "offload", "host", "recompute", "planned"}  # adaptive has no plan rows
    assert table["offload"]["measured"] == pytest.approx(1.6) and table["offload"]["predicted"] > 1.0
    assert s["targets"]["planned_vs_best_single_step_time"] == {"target": "<= 1.0", "met": True}
    assert s["targets"]["adaptive_vs_best_fixed_step_time"] == {"target": "<= 1.02", "met": False}
    assert "prediction_max_abs_error" in s["targets"]
    from ssdtrain_megatron.tools.bench.render import render

    text = render(s)
    assert "planned / best single step time" in text and "predicted" in text


_REFAULTS = r"""
import resource, sys
sys.path.insert(0, {root!r})
if {cached}:
    from ssdtrain_megatron.tools.bench.node import cache_freed_host_memory
    print(cache_freed_host_memory(), file=sys.stderr)
def step():  # a micro-batch's activations: 48 blocks of 4 MiB written, then all freed
    held = [bytearray(4 << 20) for _ in range(48)]
    del held
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="glibc's allocator (Linux)")
def test_the_emulated_node_reuses_freed_host_memory_as_a_gpu_allocator_does():
    """Four more rounds of 192 MiB allocated, written and freed: with glibc's defaults each round
    faults its pages in again (the heap is trimmed when they are freed); after
    cache_freed_host_memory() the heap keeps them. Run in a child process: the thresholds stay
    set for the life of a process. Broken by making it return before mallopt: 'faulted ...'."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    faults = {}
    for cached in (False, True):
        out = subprocess.run([sys.executable, "-c", _REFAULTS.format(root=root, cached=cached)],
                             capture_output=True, text=True, timeout=120, check=True)
        faults[cached] = int(out.stdout.split()[-1])
    pages = 4 * 48 * (4 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert faults[False] > pages // 2, \
        f"the defaults faulted {faults[False]} of {pages} pages: the test shows nothing"
    assert faults[True] < pages // 100, f"faulted {faults[True]} pages again after cache_freed_host_memory()"
    assert "kept for reuse" in out.stderr


def test_host_and_planned_need_node_emulation(tmp_path, capsys):
    """Broken by accepting them without it: the bench runs (exit 0)."""
    rc = _bench(["--strategies", "keep,host", "--out", str(tmp_path / "o"), "--dir", str(tmp_path / "s"),
                 *TINY])
    assert rc == 2
    assert "--strategies host: run only with --node-emulation" in capsys.readouterr().err


@pytest.mark.slow
@TWO_CPUS
def test_a_small_node_emulation_runs_every_strategy_with_equal_losses(tmp_path, capsys):
    """End to end at a tiny shape: six strategies, the node's figures, the planned places and
    predictions in --json, bitwise-equal losses, nothing left on disk."""
    out, ssd = tmp_path / "out", tmp_path / "ssd"
    argv = [a if a != "1,2" else "1,2,4" for a in TINY if a not in ("--warmup", "1")]
    rc = _bench(["--node-emulation", "--json", "--out", str(out), "--dir", str(ssd), *argv])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    result = json.loads(captured.out)
    assert {p["strategy"] for p in result["points"]} == {"keep", "offload", "host", "planned", "adaptive",
                                                         "recompute"}
    node = result["node_emulation"]
    assert node["node"]["ssd_gbps"] < node["node"]["calibration"]["full_offload_needs_gbps"]
    assert node["planned_places"] is not None and "planned_peak_vs_budget" in result["ratios"]
    assert set(node["vs_keep_step_time"]) >= {"keep", "offload", "host", "recompute"}
    assert result["losses_bitwise_equal"] is True and result["offload_files_left"] == 0
    assert result["warmup"] == 2 and "node emulation: compute on CPU" in captured.err
    assert "host allocator: freed host memory kept for reuse" in captured.err


def test_a_layer_the_budget_ran_recomputed_is_priced_as_recompute():
    """The adaptive plan says ssd, but the runtime's budget (recompute_fallback) ran layer 1
    recomputed: the prediction prices what ran. Broken by returning the plan's rows as they
    are in as_run: ('ssd', ...)."""
    import dataclasses

    from ssdtrain_megatron.tools.bench.predict import as_run

    stats = _keep_stats()
    first = dataclasses.replace(stats.layers[0], decision="recompute")
    stats = dataclasses.replace(stats, layers=(first,) + stats.layers[1:])
    plan = (("ssd", "ssd", "host", "keep"),) * 2
    assert as_run(plan, stats, ["1", "2", "3", "4"]) == (("recompute", "ssd", "host", "keep"),) * 2
    assert as_run(plan, None, ["1", "2", "3", "4"]) == plan


def test_the_planned_strategy_sizes_layers_by_what_offloading_them_moved(tmp_path):
    """keep counted 256 KiB more in the bench's first layer than that layer hands a tier when
    offloaded (a tensor something else holds), and a host tier of exactly four offloaded layers
    then could not take the first four in the model: the plan recomputed a layer the runtime
    would have put in host memory. Sized by what the offload step moved, four layers go to host
    memory and none is recomputed. Broken by leaving ``moved`` out of plan_for: 1 recomputed."""
    from ssdtrain_megatron.cache import ActivationOffloader
    from ssdtrain_megatron.tools.bench.node import PlannedTiers

    mib = 1 << 20
    stats = _keep_stats(nbytes=64 * mib, layers=8, forward_s=0.05)
    first = dataclasses.replace(stats.layers[0], bytes=2 * (64 * mib + 256 * 1024))
    stats = dataclasses.replace(stats, layers=(first,) + stats.layers[1:])
    moved = dataclasses.replace(stats, layers=tuple(
        dataclasses.replace(r, bytes=2 * 64 * mib, bytes_offloaded=2 * 64 * mib, decision="offload")
        for r in stats.layers[:7]) + stats.layers[7:])
    node = NodeEmulation((0,), (1,), ssd_gbps=1e-6, host_bytes=4 * 64 * mib + 64 * 1024, link_gbps=100.0)
    cfg = OffloadConfig(dirs=[str(tmp_path)], policy="keep", create_dirs=True)
    with ActivationOffloader(cfg) as off:
        planned = PlannedTiers(node, 4 * 64 * mib + 256 * 1024 + mib, 8, off)
        planned.plan_from(off, stats, 2, None, moved)
        sized = planned.plan.decisions[0]
        planned.plan_from(off, stats, 2)
        unsized = planned.plan.decisions[0]
    assert sized.count("host") == 4 and "recompute" not in sized and "ssd" not in sized
    assert unsized.count("host") == 3
