"""Time by what was measured (issue 64 item 7): each point's reserve at the pace of the points
already run, install's unused seconds given to the step after it, the models' build in the
estimate, and the two GPU calls (`make gpu-perf`, then `make gpu-check ONLY=after-perf`) that
fit the device's 15 minutes, each within one 10-minute call."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from ssdtrain_megatron.tools.gpucheck import gpu_check, gpu_check_plan, gpu_perf, gpu_perf_plan  # noqa: E402

CALL_S = 600  # one device call at most
DEVICE_S = 900  # the device time of a task, machine starts included
MACHINE_START_S = 240  # no machine starts with less left (the device's notes)


def _measure(tmp_path, estimates):
    from ssdtrain_megatron.tools.gpucheck import gpu_check_measure

    args = gpu_perf.parse_args(["--out", str(tmp_path / "res"), "--scratch", str(tmp_path / "scratch")])
    os.makedirs(args.scratch)
    m = gpu_check_measure.Measure.__new__(gpu_check_measure.Measure)
    m.args, m.until, m.per_sample, m.registers, m.host_ram = args, None, None, True, 1 << 40
    m.estimates, m.ran, m.result = estimates, [], {}
    return m, gpu_check_measure


def test_each_reserve_is_its_estimate_at_the_pace_of_what_ran(tmp_path, monkeypatch):
    """A box twice as fast as the plan's rates (keep and the link took half their estimates):
    with 25 s left, compute-bound save_on_cpu (36.9 s estimated) starts, at its estimate's
    pace (18.5 s + the slack); before anything ran it would not. A slow box's reserves grow,
    within PACE_RANGE. On a975649 the reserve was the estimate alone."""
    m, gm = _measure(tmp_path, {"keep@1": 4.0, "link": 6.0, "save_on_cpu@1": 36.9})
    monkeypatch.setenv("GPU_CHECK_DEADLINE", str(time.time() + 25))
    assert m.pace() == 1.0 and m.reserve("save_on_cpu@1") == pytest.approx(36.9 + gm.RESERVE_SLACK_S)
    assert m._skip(1, "keep", "posix", {}, "save_on_cpu@1").startswith("not run: out of time")
    m._ran("keep@1", 2.0)
    m._ran("link", 3.0)
    m._ran("keep@9", 50.0)  # a point the plan does not know: no pace from it
    assert m.pace() == 0.5 and m.result["pace"] == 0.5
    assert m.reserve("save_on_cpu@1") == pytest.approx(18.45 + gm.RESERVE_SLACK_S)
    assert m._skip(1, "keep", "posix", {}, "save_on_cpu@1") is None
    m.ran = [(100.0, 1.0)]
    assert m.pace() == gm.PACE_RANGE[1]
    m.ran = [(0.001, 10.0)]
    assert m.pace() == gm.PACE_RANGE[0]


def test_installs_unused_seconds_go_to_the_step_after_it(tmp_path, monkeypatch):
    """gpu-perf: install passes at once, so perf's limit is its own and install's 29 s,
    within what the run has left; on a975649 it was 146 s whatever install left."""
    limits = {}

    def install(a, prefix, env, limit):
        limits["install"] = limit
        return {"status": "pass"}

    def run_child(a, name, env, limit):
        limits[name] = limit
        return {"status": "fail", "why": "not measured here"}

    monkeypatch.setattr(gpu_check, "install", install)
    monkeypatch.setattr(gpu_check, "run_child", run_child)
    args = gpu_perf.parse_args(["--out", str(tmp_path / "res"), "--scratch", str(tmp_path / "scratch")])
    gpu_check.run_parent(args)
    own = dict((n, t) for n, t, *_ in gpu_perf_plan.STEPS)
    assert limits["install"] == own["install"]
    budget = gpu_perf_plan.TOTAL_S - 5  # what _run_steps leaves the steps
    assert budget - 2 <= limits["perf"] <= min(own["perf"] + own["install"], budget)
    assert limits["perf"] > own["perf"] + own["install"] - 5


def test_each_shapes_model_build_is_in_its_estimate():
    """8 bytes a parameter at ASSUME's build rate: 3.1 s for the compute-bound shape's 7.72 B
    parameters, in its points' estimate and so in the perf step's."""
    for name, shape in gpu_perf_plan.SHAPES.items():
        est = gpu_check_plan.points_estimate(shape, gpu_perf_plan.points(name, 5))
        build = est["points"]["model build"]["seconds"]
        assert build == round(8 * gpu_check_plan.parameters(shape) / gpu_check_plan.ASSUME["build_bps"], 1)
        assert est["seconds"] == round(gpu_check_plan.ASSUME["start_s"] + sum(
            p["seconds"] for p in est["points"].values()), 1)
    assert gpu_check_plan.points_estimate(gpu_perf_plan.SHAPES["compute-bound"], gpu_perf_plan.points(
        "compute-bound", 5))["points"]["model build"]["seconds"] == 3.1


def test_the_two_gpu_calls_fit_one_10_minute_call_each_and_the_devices_15_minutes(tmp_path):
    """`make gpu-perf`, then `make gpu-check ONLY=after-perf` (every step but measure, which
    gpu-perf's io-bound shape is): each plan fits, each well within a call, and both with a
    machine's start within the device's 15 minutes."""
    env = dict(os.environ, GPU_CHECK_DRY="1")
    proc = subprocess.run(["make", "-s", "-C", ROOT, "gpu-check", "ONLY=after-perf", f"PYTHON={sys.executable}",
                           f"GPU_CHECK_ARGS=--out {tmp_path / 'c'} --scratch {tmp_path / 's'}"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "the plan fits" in proc.stdout, proc.stdout + proc.stderr
    chosen = [n for n, *_ in gpu_check_plan.STEPS if n != "measure"]
    assert "gpu-check:   measure " not in proc.stdout
    assert all(f"gpu-check:   {n:<19} limit" in proc.stdout for n in chosen)
    check_s = sum(t for n, t, *_ in gpu_check_plan.STEPS if n in chosen) + gpu_check_plan.PARENT_S
    assert f"sum                 limit {check_s - gpu_check_plan.PARENT_S:>4}s" in proc.stdout
    perf_s = gpu_perf_plan.TOTAL_S
    assert check_s <= CALL_S - 120 and perf_s <= CALL_S - 120  # 2 minutes of a call for transfers and packing
    assert MACHINE_START_S + perf_s + check_s <= DEVICE_S - 60, (perf_s, check_s)
    bad = subprocess.run([sys.executable, "-m", "ssdtrain_megatron.tools.gpucheck.gpu_check", "--only", "after-prf",
                          "--out", str(tmp_path / "x")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--only: unknown step(s) after-prf; steps: env, " in bad.stderr
    assert "; after-perf: env, install, imports, " in bad.stderr
