"""`ssdtrain bench` (the ROK comparison) and the Megatron telemetry of StepStats, small and on CPU."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import subprocess
import types
from typing import List

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

# megatron-core's own deprecation notes and "Apex is not installed".
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron.*"),
              pytest.mark.filterwarnings("ignore::UserWarning:megatron.*")]

from ssdtrain_megatron import OffloadConfig  # noqa: E402
from ranks import REPO  # noqa: E402
from ssdtrain_megatron.tools.bench.cli import add_bench_parser, summarize  # noqa: E402
from ssdtrain_megatron.tools.bench.measure import BenchRun, _Series  # noqa: E402
from ssdtrain_megatron.megatron import telemetry  # noqa: E402
from ssdtrain_megatron.tools.minigpt import GPTSpec  # noqa: E402
from ssdtrain_megatron.telemetry.peak_memory import PeakMemory  # noqa: E402
from ssdtrain_megatron.telemetry.stats import StepStats  # noqa: E402
from tests.drives import mount  # noqa: E402

TINY = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "2", "--seq-length", "64",
        "--vocab-size", "128", "--micro-batch-size", "1,2", "--steps", "2", "--warmup", "1",
        "--min-tensor-bytes", "4096"]


def _bench(argv):
    """``ssdtrain bench ARGV`` through the entry point (argparse's exits raise SystemExit)."""
    from ssdtrain_megatron.tools.cli import main

    return main(["bench", *argv])


# -- ssdtrain bench ---------------------------------------------------------------------------


def test_quick_json_has_every_strategy_positive_figures_equal_losses_and_a_plot(tmp_path, capsys):
    out, ssd = tmp_path / "out", tmp_path / "ssd"
    rc = _bench(["--quick", "--json", "--out", str(out), "--dir", str(ssd), *TINY])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    result = json.loads(captured.out)  # stdout is exactly one JSON object
    points = result["points"]
    assert {(p["strategy"], p["micro_batch"]) for p in points} == {
        (s, mb) for s in ("keep", "offload", "adaptive", "recompute") for mb in (1, 2)}
    for p in points:
        assert set(p) == {"strategy", "micro_batch", "step_s", "tokens_per_s",
                          "peak_activation_bytes", "peak_memory_bytes", "step_s_min", "step_s_max"}
        assert p["step_s_min"] <= p["step_s"] <= p["step_s_max"]
        assert p["step_s"] > 0 and p["peak_activation_bytes"] > 0 and p["peak_memory_bytes"] > 0
        assert p["tokens_per_s"] == pytest.approx(64 * p["micro_batch"] * 2 / p["step_s"])
    assert {"offload_vs_keep_step_time", "offload_vs_keep_peak_activation",
            "recompute_vs_keep_step_time"} <= set(result["ratios"])
    assert all(v > 0 for v in result["ratios"].values())
    assert result["ratios_micro_batch"] == 2
    assert result["losses_bitwise_equal"] is True
    assert result["control_losses_bitwise_equal"] is True and result["first_differences"] == []
    assert "keep-control@2" in result["diagnostics"]  # the control ran beside the others
    # Offload really wrote activations (bitwise-equal losses would prove nothing otherwise).
    diag = result["diagnostics"]
    assert diag["offload@1"]["bytes_offloaded"] > 0 and diag["offload@2"]["bytes_offloaded"] > 0
    assert diag["offload@1"]["bytes_read"] > 0 and diag["offload@2"]["bytes_read"] > 0  # and read back
    assert "tensors_forwarded" in diag["offload@2"] and diag["keep@2"]["bytes_read"] == 0
    assert diag["keep@2"]["bytes_offloaded"] == diag["recompute@2"]["bytes_offloaded"] == 0
    assert (out / "rok.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "points.json").read_text()) == result
    assert result["offload_files_left"] == 0
    assert [f for _, _, fs in os.walk(ssd) for f in fs] == []
    assert "micro-batch 2, step 3/3" in captured.err  # progress on stderr
    assert "Transformer Engine and Apex are not installed" not in captured.err  # megatron's noise
    assert "min_tensor_bytes 4.0 KiB" in captured.err  # the settings that matter, in the header


def test_a_strategy_out_of_device_memory_is_dropped_for_larger_micro_batches(tmp_path, monkeypatch):
    from ssdtrain_megatron.tools.bench.measure import measure
    from ssdtrain_megatron.tools import minigpt

    real_step = minigpt.installed_step

    def step(model, offloader):
        if offloader.config.policy == "keep" and model.spec.recompute is None and model.spec.micro_batch >= 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_step(model, offloader)

    monkeypatch.setattr(minigpt, "installed_step", step)
    spec = GPTSpec(layers=2, hidden=64, heads=2, seq=64, vocab=128, num_microbatches=1)
    cfg = OffloadConfig(dirs=mount(tmp_path / "ssd"), min_tensor_bytes=4096)
    run = measure(spec, cfg, [1, 2, 4], steps=1, warmup=0)
    assert run.out_of_memory == [("keep", 2)]
    assert sorted(run.series) == sorted([(s, mb) for s in ("offload", "adaptive", "recompute") for mb in (1, 2, 4)]
                                        + [("keep", 1)])
    s = summarize(run)
    assert s["ratios_micro_batch"] == 1
    assert s["out_of_memory"] == [{"strategy": "keep", "micro_batch": 2}]
    assert s["offload_files_left"] == 0


def _run(series, warmup=0):
    spec = GPTSpec(layers=2, hidden=64, heads=2, seq=100, vocab=128, num_microbatches=1)
    run = BenchRun(spec, steps=2, warmup=warmup, device="cpu", memory_kind="RSS high-water mark")
    for (name, mb), (times, act, losses) in series.items():
        run.series[(name, mb)] = _Series(losses=losses, mb_losses=[[v] for v in losses], times=times, activation=act,
                                         memory=[1000] * len(times), io_wait=[0.0] * len(times),
                                         offloaded=[0] * len(times), cpu=[1.0] * len(times))
    return run


def test_ratios_are_taken_at_the_largest_micro_batch_every_strategy_ran():
    same = [1.0, 0.9, 0.8]
    run = _run({("keep", 1): ([9.0, 1.0, 1.0], [50, 100, 100], same),
                ("keep", 2): ([9.0, 2.0, 2.0], [200, 200, 200], same),
                ("offload", 1): ([9.0, 1.5, 1.5], [10, 40, 40], same),
                ("offload", 2): ([9.0, 2.2, 2.2], [80, 80, 80], same),
                ("offload", 4): ([9.0, 4.0, 4.0], [160, 160, 160], same),
                ("recompute", 2): ([9.0, 3.0, 3.0], [20, 20, 20], [1.0, 0.9, 0.7])}, warmup=1)
    s = summarize(run)
    assert s["ratios_micro_batch"] == 2
    assert s["ratios"]["offload_vs_keep_step_time"] == 2.2 / 2.0
    assert s["ratios"]["offload_vs_keep_peak_activation"] == 80 / 200
    assert s["ratios"]["recompute_vs_keep_step_time"] == 3.0 / 2.0
    assert s["ratios"]["offload_vs_keep_cpu_time"] == 1.0  # every step 1 CPU second here
    assert s["targets"]["recompute_vs_keep_step_time"] == {"target": ">= 1.2", "met": True}
    assert s["targets"]["offload_vs_keep_step_time"] == {"target": "<= 1.05", "met": False}
    points = {(p["strategy"], p["micro_batch"]): p for p in s["points"]}
    assert points[("offload", 4)]["tokens_per_s"] == 100 * 4 / 4.0
    # Default budget: keep's peak at the middle micro-batch size (of 1, 2, 4: 2) = 200 bytes.
    assert (s["memory_budget_bytes"], s["memory_budget_from_keep_micro_batch"]) == (200, 2)
    assert s["largest_micro_batch_under_budget"] == {"keep": 2, "offload": 4, "recompute": 2}
    assert s["losses_bitwise_equal"] is True
    assert s["recompute_losses_bitwise_equal"] is False
    assert summarize(run, memory_budget=90)["largest_micro_batch_under_budget"] == {
        "keep": None, "offload": 2, "recompute": 2}


def test_adaptive_is_compared_with_the_fastest_fixed_strategy_within_the_budget():
    from ssdtrain_megatron.tools.bench.render import render

    same = [1.0, 0.9]
    run = _run({("keep", 1): ([1.0, 1.0], [100, 100], same), ("keep", 2): ([2.0, 2.0], [200, 200], same),
                ("offload", 2): ([2.4, 2.4], [90, 90], same), ("adaptive", 2): ([2.1, 2.1], [95, 95], same),
                ("recompute", 2): ([2.2, 2.2], [150, 150], [1.0, 0.8])})
    s = summarize(run, memory_budget=120)
    # recompute is faster than offload but does not fit 120 bytes: offload is the best fixed.
    assert s["best_fixed"] == "offload"
    assert s["ratios"]["adaptive_vs_best_fixed_step_time"] == 2.1 / 2.4
    assert s["ratios"]["adaptive_peak_vs_budget"] == 95 / 120
    s = summarize(run, memory_budget=160)
    assert s["best_fixed"] == "recompute"
    assert s["ratios"]["adaptive_vs_best_fixed_step_time"] == 2.1 / 2.2
    assert "(best fixed within the budget: recompute)" in render(s)
    s = summarize(run, memory_budget=50)
    assert s["best_fixed"] is None and "adaptive_vs_best_fixed_step_time" not in s["ratios"]
    assert "no fixed strategy (offload, recompute) fits the budget" in render(s)


def test_the_table_shows_no_target_the_user_did_not_set_and_shows_fallbacks():
    from ssdtrain_megatron.tools.bench.render import render

    same = [1.0, 0.9]
    run = _run({("keep", 1): ([1.0, 1.0], [100, 100], same), ("offload", 1): ([2.0, 2.0], [90, 90], same)})
    table = render(summarize(run))
    assert "offload / keep step time" in table
    assert "target" not in table and "MISSED" not in table
    assert "fallbacks" not in table
    # Recompute did not run: no claim about it (it used to print "recompute equal to keep: True").
    assert "recompute" not in table and summarize(run)["recompute_losses_bitwise_equal"] is None
    assert "models of every strategy run (keep, offload) resident" in table
    run.series[("offload", 1)].fallbacks = [0, 24]
    table = render(summarize(run))
    assert "fallbacks (writes that failed, a full disk?, and stayed in memory" in table
    assert "offload at micro-batch 1: 24" in table


def test_losses_that_differ_in_the_last_bit_are_reported_unequal():
    a = [1.0, 0.5]
    b = [1.0, float(np.nextafter(0.5, 1.0))]
    s = summarize(_run({("keep", 1): ([1.0, 1.0], [1, 1], a), ("offload", 1): ([1.0, 1.0], [1, 1], b)}))
    assert s["losses_bitwise_equal"] is False


def test_the_first_difference_says_strategy_micro_batch_step_and_both_values_bits():
    """A run that is not bitwise must say exactly where (issue 38, 4.3): per strategy, the first
    step and micro-batch whose loss differs from keep's in any bit, with both values' bits; and
    the control (a second keep run) says whether the process's arithmetic is reproducible."""
    from ssdtrain_megatron.tools.bench.render import render

    keep = [[1.0, 0.5], [0.75, 0.25]]
    off = [[1.0, 0.5], [0.75, float(np.nextafter(0.25, 1.0))]]
    run = _run({("keep", 2): ([1.0, 1.0], [1, 1], [0.75, 0.5]), ("keep-control", 2): ([1.0, 1.0], [1, 1], [0.75, 0.5]),
                ("offload", 2): ([1.0, 1.0], [1, 1], [0.75, 0.5]), ("recompute", 2): ([1.0, 1.0], [1, 1], [0.75, 0.5])})
    run.series[("keep", 2)].mb_losses = run.series[("keep-control", 2)].mb_losses = keep
    run.series[("recompute", 2)].mb_losses = [list(x) for x in keep]
    run.series[("offload", 2)].mb_losses = off
    s = summarize(run)
    assert s["losses_bitwise_equal"] is False and s["recompute_losses_bitwise_equal"] is True
    assert s["control_losses_bitwise_equal"] is True
    (d,) = s["first_differences"]
    assert (d["strategy"], d["micro_batch"], d["step"], d["microbatch_index"]) == ("offload", 2, 1, 1)
    assert d["keep_bits"] == (0.25).hex() and d["value_bits"] == float(np.nextafter(0.25, 1.0)).hex()
    table = render(s)
    assert f"first difference: offload at micro-batch 2, step 1, micro-batch 1: {d['value_bits']}" in table
    assert "the control (keep-control) agrees with keep: the strategies above changed the numbers" in table
    assert "keep-control" not in {p["strategy"] for p in s["points"]}
    run.series[("keep-control", 2)].mb_losses = off  # now keep itself is not reproducible
    s = summarize(run)
    assert s["control_losses_bitwise_equal"] is False
    assert "say nothing about offloading" in render(s)


@pytest.mark.parametrize("argv, message", [
    (["--micro-batch-size", "1,0"], "expected positive integers separated by commas"),
    (["--memory-budget", "12parsecs"], "expected a size: bytes, or a number with a unit kB"),
    (["--memory-budget", "0"], "e.g. 80GB or 512MiB, above 0; got '0'"),
])
def test_bad_flags_are_refused_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _bench(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert err.startswith(f"ssdtrain bench: error: argument {argv[0]}: ") and message in err


def test_memory_budget_takes_binary_units():
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--memory-budget", "512MiB", "--micro-batch-size", "4,1,2,2"])
    assert args.memory_budget == 512 << 20
    assert args.micro_batches == [1, 2, 4]


def test_peak_memory_is_the_rss_high_water_mark_since_the_last_reset():
    peak = PeakMemory(torch.device("cpu"))
    if peak.kind is None:
        pytest.skip("/proc/self/clear_refs is not writable here")
    big = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, every page touched
    high = peak.peak()
    del big
    peak.reset()
    assert peak.peak() <= high - (48 << 20)


def test_an_emulated_node_keeps_freed_heap_memory_between_steps():
    """Node emulation (trim=False) must not hand the heap back before each step, or every step
    faults its activations in again; the kind says the peak then includes what others left.
    Broken by trimming whatever trim says: 'trimmed [0] with trim=False'."""
    for trim in (True, False):
        peak = PeakMemory(torch.device("cpu"), trim=trim)
        if peak.kind is None:
            pytest.skip("/proc/self/clear_refs is not writable here")
        calls = []
        peak._trim = calls.append  # malloc_trim's stand-in: what reset() hands back
        peak.reset()
        assert calls == ([0] if trim else []), f"trimmed {calls} with trim={trim}"
        assert ("kept between steps" in peak.kind) == (not trim)


# -- telemetry ----------------------------------------------------------------------------------


def _stats(step=0, **changes):
    fields = dict(step=step, bytes_offloaded=3 << 20, bytes_read=2 << 20, bytes_deduplicated=4096,
                  tensors_offloaded=12, tensors_passed_through=5, tensors_kept=1, tensors_forwarded=2,
                  io_wait_s=0.25, peak_resident_bytes=1 << 20, write_gbps=1.5, read_gbps=0.75,
                  bytes_on_disk=0, fallbacks=0, step_time_s=2.0)
    fields.update(changes)
    return StepStats(**fields)


class _Recorder:
    """Anything with add_scalar(tag, value, step) is a TensorBoard writer to publish_step."""

    def __init__(self):
        self.scalars = []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))


def test_every_numeric_field_is_a_scalar_at_megatrons_iteration_and_interval():
    w = _Recorder()
    args = argparse.Namespace(tensorboard_log_interval=2, log_interval=100, curr_iteration=0)
    assert telemetry.publish_step(_stats(), writer=w, args=args, lookup=False) is None  # iteration 1
    args.curr_iteration = 1
    assert telemetry.publish_step(_stats(step=1), writer=w, args=args, lookup=False) == 2
    assert w.scalars == [
        ("ssd_offload/bytes_offloaded", 3 << 20, 2), ("ssd_offload/bytes_read", 2 << 20, 2),
        ("ssd_offload/bytes_deduplicated", 4096, 2), ("ssd_offload/tensors_offloaded", 12, 2),
        ("ssd_offload/tensors_passed_through", 5, 2), ("ssd_offload/tensors_kept", 1, 2),
        ("ssd_offload/tensors_forwarded", 2, 2), ("ssd_offload/io_wait_s", 0.25, 2),
        ("ssd_offload/peak_resident_bytes", 1 << 20, 2), ("ssd_offload/write_gbps", 1.5, 2),
        ("ssd_offload/read_gbps", 0.75, 2), ("ssd_offload/bytes_on_disk", 0, 2),
        ("ssd_offload/fallbacks", 0, 2), ("ssd_offload/step_time_s", 2.0, 2),
        ("ssd_offload/iteration_time_s", 0.0, 2), ("ssd_offload/bytes_wasted", 0, 2),
        ("ssd_offload/bytes_wasted_held", 0, 2), ("ssd_offload/tensors_held_by_schedule", 0, 2),
        ("ssd_offload/writes_taken_back", 0, 2), ("ssd_offload/tensors_from_staging", 0, 2),
        ("ssd_offload/bytes_from_staging", 0, 2), ("ssd_offload/offload_submit_s", 0.0, 2),
        ("ssd_offload/budget_waits", 0, 2), ("ssd_offload/budget_wait_s", 0.0, 2),
        ("ssd_offload/budget_deferred_written", 0, 2), ("ssd_offload/budget_readahead_cuts", 0, 2),
        ("ssd_offload/budget_forced_offloads", 0, 2), ("ssd_offload/budget_recomputes", 0, 2),
        ("ssd_offload/budget_overruns", 0, 2), ("ssd_offload/captured_kept", 0, 2),
        ("ssd_offload/read_retries", 0, 2), ("ssd_offload/step_end_wait_s", 0.0, 2)]


def test_without_a_megatron_training_loop_nothing_is_published(monkeypatch):
    for name in telemetry.GLOBAL_VARS_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert telemetry.megatron_training_globals() == (None, None)
    assert telemetry.publish_step(_stats()) is None


def test_args_not_yet_initialised_still_use_the_writer(monkeypatch):
    def get_args():
        raise AssertionError("args is not initialized.")

    w = _Recorder()
    gv = types.SimpleNamespace(get_tensorboard_writer=lambda: w, get_args=get_args)
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", gv)
    assert telemetry.publish_step(_stats(step=6)) == 7  # the offloader's count, plus one
    assert len(w.scalars) == 32  # every numeric StepStats field, iteration_time_s and budget_* included


def test_megatron_training_steps_reach_the_writer_and_the_log(monkeypatch, tmp_path, caplog):
    """Through install(): a megatron-core step ends in pipeline.py, which publishes its StepStats
    to the writer and arguments a Megatron-LM training loop keeps in global_vars."""
    from ssdtrain_megatron.megatron import install, uninstall
    from ssdtrain_megatron.tools.minigpt import MegatronRuntime, MiniGPT

    writer = _Recorder()
    args = argparse.Namespace(log_interval=2, tensorboard_log_interval=1, curr_iteration=None)
    gv = types.ModuleType("megatron.training.global_vars")
    gv.get_tensorboard_writer = lambda: writer
    gv.get_args = lambda: args
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", gv)
    cfg = OffloadConfig(dirs=mount(tmp_path / "ssd"), min_tensor_bytes=4096)
    stats = []
    with caplog.at_level(logging.INFO, logger=telemetry.__name__), MegatronRuntime() as rt:
        model = MiniGPT(GPTSpec(layers=2, hidden=64, heads=2, seq=64, vocab=128, micro_batch=1,
                                num_microbatches=2), rt.device)
        off = install(cfg)
        try:
            for it in range(10, 13):  # resumed at iteration 10, as Megatron counts
                args.curr_iteration = it
                model.step()
                stats.append(off.last_step_stats)
        finally:
            uninstall()
    assert stats[0].bytes_offloaded > 0
    assert writer.scalars == [(tag, value, 11 + i) for i, s in enumerate(stats)
                              for tag, value in telemetry.step_scalars(s).items()]
    assert [r.getMessage() for r in caplog.records if r.name == telemetry.__name__] == [
        f"ssdtrain iteration 12: {stats[1].summary()}"]


def test_scalars_are_readable_from_a_tensorboard_event_file(tmp_path):
    SummaryWriter = pytest.importorskip("torch.utils.tensorboard").SummaryWriter
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = SummaryWriter(log_dir=str(tmp_path))
    stats = _stats(step=3, bytes_offloaded=123_456_789)
    assert telemetry.publish_step(stats, writer=writer, args=argparse.Namespace(curr_iteration=41),
                                  lookup=False) == 42
    writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == sorted(telemetry.step_scalars(stats))
    for tag, value in telemetry.step_scalars(stats).items():
        # TensorBoard stores scalars as float32.
        assert [(e.step, e.value) for e in events.Scalars(tag)] == [(42, float(np.float32(value)))]


def test_the_bench_sets_a_passive_openmp_wait_policy_unless_the_environment_sets_one():
    """Set before torch loads (its OpenMP runtime reads it once), never over the user's.
    `ssdtrain demo` calls the same function first (its header line: tests/test_demo.py)."""
    code = ("import os; from ssdtrain_megatron.tools.cli_types import openmp_wait_policy as w; "
            "print(w('the bench')); print(os.environ.get('OMP_WAIT_POLICY'))")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}

    def run(src: str, **extra) -> List[str]:
        out = subprocess.run([sys.executable, "-c", src], env=dict(env, **extra), capture_output=True,
                             text=True, check=True, cwd=REPO)
        return out.stdout.splitlines()

    said, value = run(code)
    assert said.startswith("PASSIVE (set by the bench") and value == "PASSIVE"
    assert run(code, OMP_WAIT_POLICY="ACTIVE") == ["ACTIVE (from the environment)", "ACTIVE"]
    said, value = run("import torch; " + code)  # too late: the bench says so and sets nothing
    assert said.startswith("the OpenMP runtime's default") and value == "None"



def test_an_exploring_step_taken_back_leaves_every_per_step_list_one_shorter():
    """Adaptive's exploring steps leave the measured series (bench_measure._settle): every list
    with one entry per step loses its last one. Broken by appending one more per-step figure in
    add_step outside PER_STEP: that list keeps the exploring step and is a step out of line."""
    import dataclasses

    st = types.SimpleNamespace(peak_resident_bytes=7, io_wait_s=0.1, budget_wait_s=0.0, bytes_offloaded=3,
                               bytes_read=2, tensors_forwarded=1, fallbacks=0, layers=[])
    series = _Series()
    for k in range(2):
        series.add_step(1.0 + k, [1.0 + k], 2.0 + k, st, 5, 0.5, 1)
    per_step = [f.name for f in dataclasses.fields(series)
                if isinstance(getattr(series, f.name), list) and getattr(series, f.name)]
    assert sorted(per_step) == sorted(_Series.PER_STEP)
    assert series.take_last_step() == (3.0, 7)
    assert {name: len(getattr(series, name)) for name in per_step} == {name: 1 for name in per_step}
    assert series.times == [2.0] and series.losses == [1.0] and series.last_stats is st
