"""gpu-perf's rows judge the product and only it (issue 64 item 5): the peers' breakdowns are
not judged as ours; "typical" within the timed steps' spread; ours against what save_on_cpu
pays for the activations, its weights' copies apart; posix against the drive's raw O_DIRECT
rate (gpucheck/gpu_drive.raw_rates, on this machine's real drive); the io-bound link row with
the work no copy can overlap. Each test's case failed on a975649's rows."""

from __future__ import annotations

import json
import os

import pytest

from ssdtrain_megatron.tools.gpucheck import gpu_drive, gpu_perf_targets

EXPLAINED = "compute-bound: every excess explained, <= 20% unexplained"
TYPICAL = "io-bound: every traced step typical, within 10%"
OURS = "compute-bound: ours hides >= 70% of save_on_cpu copies"
RAW = "io-bound: posix <= 1.10x its raw drive bound"
LINK = "io-bound: memory <= 1.10x link bound + unoverlappable"


def _steps():
    from tests.test_gpu_perf import _perf_steps

    return json.loads(json.dumps(_perf_steps()))


def _row(steps, name):
    return {r["target"]: r for r in gpu_perf_targets.targets(steps)}[name]


def _point(steps, shape, name):
    return next(p for p in steps["perf"]["shapes"][shape]["points"] if p["name"] == name)


def test_the_peers_excess_is_not_judged_as_unexplained():
    """save_on_cpu's and recompute's excess over keep sits in "compute stream beyond keep's"
    (synchronous copies, a recomputed forward): shown, not judged. Ours still is."""
    steps = _steps()
    unexplained = {"typical": True, "sum_s": 1.0, "excess_s": 1.0, "explained": False, "unexplained_s": 0.9,
                   "unexplained_parts": ["compute stream beyond keep's"]}
    for peer in ("save_on_cpu@1", "recompute@1"):
        _point(steps, "compute-bound", peer)["breakdown"] = dict(unexplained)
    row = _row(steps, EXPLAINED)
    assert row["result"] == "PASS" and "save_on_cpu" not in row["detail"] and "recompute" not in row["detail"]
    _point(steps, "compute-bound", "offload-memory@1")["breakdown"] = dict(unexplained)
    assert _row(steps, EXPLAINED)["result"] == "FAIL"


def test_typical_is_judged_against_the_spread_of_the_timed_steps():
    """An excess of 10 ms on a 2.08 s step: the traced step's parts 5 ms off it are within the
    steps' 2% spread (41.6 ms) though 50% of the excess; 50 ms off is not."""
    steps = _steps()
    mem = _point(steps, "io-bound", "offload-memory@1")
    mem["breakdown"] = dict(mem["breakdown"], excess_s=0.010, sum_s=0.015)
    row = _row(steps, TYPICAL)
    assert row["result"] == "PASS" and "offload-memory@1 15.0 of 10.0 ms (within 41.6)" in row["detail"]
    mem["breakdown"]["sum_s"] = 0.060
    assert _row(steps, TYPICAL)["result"] == "FAIL"
    mem["spread"] = 0.0
    mem["breakdown"]["sum_s"] = 0.0105  # then 10% of the excess is the allowance
    assert _row(steps, TYPICAL)["result"] == "PASS"


def test_ours_against_save_on_cpu_is_judged_on_the_activations_copies_not_its_weights():
    """save_on_cpu 2 s, 80 ms of it copying weights: ours at 1.02 s was 0.51x it whatever the
    offloader did. Now: ours over keep (20 ms) against the activations' 160 ms of copies (4 GB
    each way at 50 GB/s): 87% hidden; at 1.05 s, 69%: FAIL, however slow save_on_cpu is."""
    steps = _steps()
    assert _row(steps, OURS)["result"] == "PASS"
    for name in ("offload-memory@1", "offload-posix@1"):
        _point(steps, "compute-bound", name)["step_s"] = 1.05
    _point(steps, "compute-bound", "save_on_cpu@1")["step_s"] = 9.0
    row = _row(steps, OURS)
    assert row["result"] == "FAIL" and row["detail"].startswith("ours hides 69% of the 160.0 ms")


def test_posix_is_judged_against_the_drives_raw_rate_measured_apart():
    """The engine's own pattern measured 5 GB/s and its step is 1.04x that bound; the drive
    itself does 8 GB/s with O_DIRECT: the engine's path is slow and the row fails."""
    steps = _steps()
    assert _row(steps, RAW)["result"] == "PASS"
    steps["perf"]["shapes"]["io-bound"]["rates"]["drive_raw"] = {"write": 8e9, "read": 8e9}
    row = _row(steps, RAW)
    assert row["result"] == "FAIL" and "at the raw O_DIRECT 8.00 / 8.00 GB/s" in row["detail"]
    del steps["perf"]["shapes"]["io-bound"]["rates"]["drive_raw"]
    assert _row(steps, RAW)["result"] == "NOT RUN"


def test_the_raw_rate_is_measured_on_the_drive_with_o_direct(tmp_path):
    if gpu_drive.filesystem(str(tmp_path))["type"] in gpu_drive.MEMORY_FILESYSTEMS:
        pytest.skip("tmp is tmpfs here")
    r = gpu_drive.raw_rates(str(tmp_path), 3 * gpu_drive.RAW_CHUNK)
    assert r["bytes"] == gpu_drive.RAW_THREADS * gpu_drive.RAW_CHUNK  # whole chunks, one a thread at least
    assert r["write"] > 0 and r["read"] > 0 and os.listdir(tmp_path) == []
    assert gpu_drive.raw_rates(str(tmp_path), 1 << 40)["bytes"] == gpu_drive.RAW_MAX_BYTES


def test_the_io_bound_link_row_counts_the_work_no_copy_can_overlap():
    """Keep's 1 s over 8 layers and 0.44 B parameters at the H100's 2.9 TB/s: the link's 2 s
    bound grows by 124.7 ms of a layer's forward and backward and 2.4 ms of optimizer and
    zero_grad; the memory engine at 2.3 s is within 1.10x of that, beyond 1.10x of 2 s."""
    steps = _steps()
    io = steps["perf"]["shapes"]["io-bound"]
    io["parameters"] = 440_000_000
    _point(steps, "io-bound", "offload-memory@1")["step_s"] = 2.3
    row = _row(steps, LINK)
    assert row["result"] == "PASS", row
    assert row["detail"].startswith("1.08x the bound with what cannot overlap, 2127.1 ms = 2000.0 + 127.1 "
                                    "(optimizer and zero_grad 2.4, a layer's forward and backward 124.7;")
    assert "against the bound alone 1.15x" in row["detail"]
    _point(steps, "io-bound", "offload-memory@1")["step_s"] = 2.4
    assert _row(steps, LINK)["result"] == "FAIL"
