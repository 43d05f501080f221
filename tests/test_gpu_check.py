"""`make gpu-check` (scripts/gpu_check.sh, gpu_check.py, gpu_check_targets.py) and `make gpu-bundle`
(ssdtrain_megatron/tools/gpucheck/gpu_bundle.py) on a machine without a GPU: the time plan, the table that has a row for
every target every time, the exit status that is 0 only when every target passed, the offline
install and the bundle's completeness proof. The GPU steps themselves run only on a GPU box."""

import ast
import json
import xml.etree.ElementTree as ET
import os
import re
import subprocess
import sys
import time
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from ssdtrain_megatron.tools.gpucheck import gpu_bundle  # noqa: E402
from ssdtrain_megatron.tools.gpucheck import gpu_check  # noqa: E402
from ssdtrain_megatron.tools.gpucheck import gpu_check_cuda  # noqa: E402
from ssdtrain_megatron.tools.gpucheck import gpu_check_measure  # noqa: E402,F401 - imports cleanly (its step runs on a GPU only)
from ssdtrain_megatron.tools.gpucheck import gpu_check_plan  # noqa: E402
from ssdtrain_megatron.tools.gpucheck import gpu_check_targets  # noqa: E402
from ssdtrain_megatron.tools.gpucheck.gpu_check_bounds import judge_points  # noqa: E402
from tests.test_gpu_archive import unpacked  # noqa: E402
from tests.test_gpu_optimizer_row import RECORDED as OPTIMIZER_RECORDED  # noqa: E402

TARGET_NAMES = [t[0] for t in gpu_check_targets.TARGETS]


def _run(args, tmp_path, dry=True, timeout=300):
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_DRY="1" if dry else "0")
    return subprocess.run([os.path.join(ROOT, "scripts", "gpu_check.sh")] + args, cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _make(tmp_path, dry, args=""):
    env = dict(os.environ, GPU_CHECK_DRY="1" if dry else "0")
    return subprocess.run(["make", "-s", "-C", ROOT, "gpu-check", f"PYTHON={sys.executable}",
                           f"GPU_CHECK_ARGS=--out {tmp_path / 'res'} --scratch {tmp_path / 'scratch'} {args}"],
                          env=env, capture_output=True, text=True, timeout=300)


def test_the_plan_fits_480_s_with_every_estimate_inside_its_limit():
    """Each step's estimate (start, pinning its pools, collecting tests, its work) within its
    limit, the limits within 480 s less the parent's share. Fails when the limits are raised
    past 480 s (they added up to ~1030 s before issue 24), when the measure shape is grown past
    its slot (e.g. the old 16 layers x 4096 x 2048: ~400 s), or when a step's pools are left
    at the defaults (the memory engine's 4 GiB and 2 GiB of staging for bitwise-memory)."""
    args = gpu_check.parse_args(["--dry-run"])
    steps = gpu_check.plan(args)
    assert [s["step"] for s in steps] == [s[0] for s in gpu_check.STEPS]
    assert sum(s["timeout_s"] for s in steps) <= gpu_check.TOTAL_S - gpu_check_plan.PARENT_S <= 480
    est = gpu_check_plan.estimates(args)
    for s in steps:
        assert est[s["step"]]["total"] <= s["timeout_s"], (s, est[s["step"]])
    assert est["measure"]["register"] > 0 and est["cuda-tests"]["collect"] > 0
    assert est["bitwise-memory"]["register"] < 1.0  # its pool is sized to the step
    big = gpu_check.parse_args(["--layers", "16", "--hidden", "4096", "--heads", "32", "--seq", "2048"])
    slot = next(s["timeout_s"] for s in steps if s["step"] == "measure")
    assert gpu_check_plan.estimates(big)["measure"]["total"] > slot


def test_adaptive_warm_up_cap_is_one_round_of_measured_selection_and_its_first_steps():
    """The measure step's adaptive waits at most ADAPTIVE_SETTLE_CAP steps to settle: one round
    of its bounds (plan/explore.py) and the three steps before the round (no bandwidth yet, the
    model's plan, one re-plan). At 8, before paired exploration was counted, the first GPU run's
    adaptive row could not settle; the dry-run plan prices the cap's steps."""
    from ssdtrain_megatron.plan.explore import Bounds

    bounds = Bounds(gpu_check_plan.ADAPTIVE_TRIAL_STEPS, gpu_check_plan.ADAPTIVE_EXPLORE_STEPS)
    assert gpu_check_plan.ADAPTIVE_SETTLE_CAP == 3 + bounds.round_steps
    args = gpu_check.parse_args(["--dry-run"])
    adaptive = next(p for p in gpu_check_plan.measure_points(args) if p["name"].startswith("adaptive"))
    assert adaptive["steps"] == gpu_check_plan.ADAPTIVE_SETTLE_CAP + args.steps


def test_the_bitwise_pools_are_sized_to_the_step_and_hold_a_micro_batch():
    mb = gpu_check_plan.activation_bytes(gpu_check_plan.BITWISE_SHAPE)
    memory = gpu_check_plan.bitwise_settings("memory")
    assert mb < memory["host_memory_bytes"] < 2 * mb
    assert gpu_check_plan.pinned_bytes("memory", memory) < 1 << 30
    assert gpu_check_plan.pinned_bytes("gds", gpu_check_plan.bitwise_settings("gds"), direct=True) == 0


def test_make_dry_run_prints_each_limit_estimate_and_the_sum(tmp_path):
    proc = _make(tmp_path, dry=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    est = gpu_check_plan.estimates(gpu_check.parse_args([]))
    for name, limit, *_ in gpu_check.STEPS:
        assert f"{name:<19} limit {limit:>4}s  estimate {est[name]['total']:>5.0f}s  (" in proc.stdout
    total = sum(s[1] for s in gpu_check.STEPS)
    assert f"sum                 limit {total:>4}s  of {gpu_check.TOTAL_S - gpu_check_plan.PARENT_S}s" in proc.stdout
    assert "registering pinned memory" in proc.stdout and "collecting tests 15s" in proc.stdout
    assert "the plan fits" in proc.stdout
    res = unpacked(tmp_path / "res", "gpu-check")
    plan = json.loads((res / "plan.json").read_text())
    measure_limit = next(limit for name, limit, *_ in gpu_check.STEPS if name == "measure")
    assert plan["dry_run"] and plan["measure_estimate"]["seconds"] <= measure_limit
    assert plan["estimates"]["measure"]["register"] > 0
    assert sorted(os.listdir(res)) == ["plan.json"]  # nothing ran
    assert os.listdir(tmp_path / "res") == ["gpu-check-results.tar.gz"]


@pytest.mark.parametrize("argv", [["--total-s", "300"], ["--layers", "32", "--seq", "2048"]],
                         ids=["limits-over-the-total", "measure-over-its-slot"])
def test_dry_run_fails_when_the_plan_does_not_fit(tmp_path, argv):
    proc = _run(argv + ["--out", str(tmp_path / "res"), "--scratch", str(tmp_path / "scratch")], tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "the plan does NOT fit" in proc.stdout


def test_the_check_scripts_import_one_way():
    """No circle among gpucheck/gpu_*.py, imports inside functions included (before issue
    38: gpu_check_measure imported gpu_check_steps' helpers, and gpu_check_steps the measure
    step: "gpu_check_measure -> gpu_check_steps -> gpu_check_measure")."""
    folder = os.path.join(ROOT, "ssdtrain_megatron", "tools", "gpucheck")
    mods = {f[:-3] for f in os.listdir(folder) if f.startswith("gpu_") and f.endswith(".py")}
    edges = {}
    for m in mods:
        tree = ast.parse(open(os.path.join(folder, m + ".py")).read())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.module for a in n.names}
        edges[m] = sorted(names & mods)

    def visit(m, path):
        for nxt in edges[m]:
            assert nxt not in path, "import circle: " + " -> ".join(path + [nxt])
            visit(nxt, path + [nxt])

    for m in sorted(mods):
        visit(m, [m])
    assert "gpu_check_steps" not in edges["gpu_check_measure"]


def test_make_gpu_check_without_a_gpu_lists_every_target_not_run_and_fails(tmp_path):
    """On this CPU machine: exit status 1, a NOT RUN row for every target, each naming the reason
    (the env step found no CUDA), and no step past env started."""
    proc = _make(tmp_path, dry=False)
    assert proc.returncode != 0 and "gpu-check] Error 1" in proc.stderr, proc.stdout + proc.stderr
    out = unpacked(tmp_path / "res", "gpu-check")
    data = json.loads((out / "gpu-check.json").read_text())
    assert [t["target"] for t in data["targets"]] == TARGET_NAMES
    for t in data["targets"]:
        assert t["result"] == "NOT RUN", t
        assert "torch.cuda.is_available() is False" in t["detail"], t
    table = (out / "table.txt").read_text()
    for name in TARGET_NAMES:
        assert f"{name:<56} NOT RUN" in table
    assert f"0 of {len(TARGET_NAMES)} targets PASS, 0 FAIL, {len(TARGET_NAMES)} NOT RUN" in proc.stdout
    assert sorted(os.listdir(out / "logs")) == ["env.log"]
    assert os.listdir(tmp_path / "scratch") == []  # the run's scratch is removed at the end


@pytest.mark.parametrize("argv, message", [
    (["--only", "bitwise-posix,warp-drive"], "unknown step(s) warp-drive"),
    (["--hidden", "100", "--heads", "3"], "not a multiple of --heads"),
    (["--seq", "0"], "must be >= 1"),
])
def test_bad_arguments_fail_before_anything_runs(tmp_path, argv, message):
    proc = _run(argv + ["--out", str(tmp_path / "res"), "--scratch", str(tmp_path / "scratch")], tmp_path)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert not (tmp_path / "res").exists()


@pytest.mark.parametrize("corrupt, stopped", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["equal", "one-element-changed", "stopped-early", "changed-then-stopped"])
def test_bitwise_comparison_of_the_script_on_megatron_bf16(tmp_path, monkeypatch, corrupt, stopped):
    """The gpu-check's keep-vs-offload comparison, run here on the CPU (megatron-core GPT in
    bf16 through the CPU runtime): it passes when offload is exact, and fails, naming the step,
    when one element of one restored activation differs. The compute-stream delay runs before
    every layer's forward and in its backward (on the GPU: torch.cuda._sleep). Stopped by its
    deadline after one of its two steps it is NOT RUN with the count, not a pass (before issue
    38 it passed), unless that step already differed (a failure)."""
    import argparse

    import torch

    from ssdtrain_megatron.tools.gpucheck import gpu_check_common
    from ssdtrain_megatron.tools.gpucheck import gpu_check_steps as steps
    from ssdtrain_megatron import ActivationOffloader
    from ssdtrain_megatron.cache.record import State
    from ssdtrain_megatron.cache.transfers import Transfers
    from ssdtrain_megatron.tools.minigpt import GPTSpec

    if corrupt:
        real = Transfers.materialize

        def materialize(self, rec):
            out = real(self, rec)
            if rec.state == State.READY and out.is_floating_point():  # read back (kept ones stay KEPT)
                out = out.clone()
                out[(0,) * out.dim()] += 1
            return out
        monkeypatch.setattr(Transfers, "materialize", materialize)
    args = argparse.Namespace(scratch=str(tmp_path / "scratch"), out=str(tmp_path))
    os.makedirs(args.scratch)  # as gpu_check.py's main does before any step
    spec = GPTSpec(layers=2, hidden=64, heads=4, seq=32, vocab=128, micro_batch=2, num_microbatches=2)
    if stopped:
        monkeypatch.setattr(steps, "deadline_left", lambda: 0.0)
    cfg = gpu_check_common.offload_config(args, "posix", min_tensor_bytes=1024, max_inflight_bytes=1 << 20)
    calls = []  # stands in for torch.cuda._sleep on the compute stream (no CUDA here)

    def delay():
        calls.append(1)
        time.sleep(0.02)

    # The subject is the comparison, not the drive's speed: each micro-batch's backward starts
    # once the writes handed to the drive have completed, so what the offloaded model restores
    # comes back from the drive. Without this, a write still under way when backward asks for
    # its layer is forwarded from memory, and a stall of this VM's disk (often, while another
    # job writes) left the stopped variants' one step with nothing read back (bytes_read 0 of
    # 369664 written, about one run in six).
    real_begin = ActivationOffloader.begin_backward

    def begin_backward(self, key):
        self.wait_writes()
        real_begin(self, key)
    monkeypatch.setattr(ActivationOffloader, "begin_backward", begin_backward)

    result = steps.compare(args, lambda r: None, spec, cfg, 2, gpu_check_common.CudaBox(), stream=False,
                           delay=delay)
    # bytes_written, fallbacks and status say why, should nothing have been read back again
    assert result["init_same"] and result["bytes_read"] > 0, result
    n = 1 if stopped else 2
    # 3 models x n steps x 2 micro-batches x 2 layers, once in forward and once in backward
    assert result["compute_delays"] == {"forward": 12 * n, "backward": 12 * n} and len(calls) == 24 * n
    assert not result["baseline_steps_differing"] and result["steps_run"] == n
    if corrupt:
        assert result["status"] == "fail" and "offload differs from keep at steps [0" in result["why"]
    elif stopped:
        assert result["status"] == "not run" and result["why"] == "out of time: 1 of 2 steps ran (all bitwise equal)"
        row = gpu_check_targets.targets({"bitwise-posix": result})[3]
        assert row["result"] == "NOT RUN" and "1 of 2 steps" in row["detail"], row
    else:
        assert result["status"] == "pass", result
    assert torch.is_grad_enabled()


def _point(name, step_s, reserved, written=0.0, read=0.0, mb=1, seq=2048, stall=0.0, start=60, policy="keep",
           engine=None, **kw):
    """A measured point; ``start``: memory at its step's start (weights, Adam state), the same
    for every point of one model."""
    return dict(name=name, ok=True, micro_batch=mb, policy=policy, engine=engine, step_s=step_s, steps_timed=5,
                spread=0.02, peak_bytes=reserved * 0.9, peak_reserved=reserved, start_bytes=start * 0.9,
                start_reserved=start, activation_bytes=(reserved - start) * 0.9, activation_reserved=reserved - start,
                bytes_written=written, bytes_read=read, tokens_per_s=mb * seq / step_s, stall_s=stall,
                stall_fraction=stall / step_s, **kw)


RATES = {"link": {"d2h": 50e9, "h2d": 50e9, "both": 80e9}, "drive": {"write": 5e9, "read": 5e9}}


def _passing_steps():
    """Results of every step as a GPU box whose every target passes would write them, the
    measure step's points judged as it judges them (gpu_check_bounds.judge_points). As at the
    default measure shape, weights and Adam state are most of keep's peak: offload halves the
    activations' part (40 -> 15, 18) while the whole peak only drops to 0.75x. The memory
    engine is bound by its schedule: one micro-batch reads each record after its write, so its
    50 GB are written (1 s at 50 GB/s) before the first is read back (1 s): 2 s, above both
    directions at once (100 GB over 80 GB/s: 1.25 s), which one micro-batch cannot reach; the posix
    engine by its drive (10 s), which forces 9 s of waiting on a keep step of 1 s: posix is
    blocked 9.05 s, 0.05 s beyond that deficit."""
    measure = {"status": "pass", "micro_batch": 1, "rates": RATES, "points": [
        _point("keep@1", 1.0, 100),
        _point("offload-memory@1", 2.08, 75, written=50e9, read=50e9, stall=1.01, policy="offload",
               engine="memory"),  # 1.04x its bound, 0.01 s beyond the 1 s deficit
        _point("offload-posix@1", 10.4, 78, written=25e9, read=25e9, stall=9.05, policy="offload", engine="posix"),
        {"name": "keep@2", "ok": False, "oom": True, "micro_batch": 2},
        _point("recompute@2", 3.0, 90, mb=2),
        _point("adaptive@2", 1.9, 80, mb=2, settled=True, warmup_steps=6, still_settled=True, policy="adaptive",
               engine="posix"),
    ]}
    judge_points(measure["points"], 1, RATES, {})
    steps = {n: {"status": "pass"} for n, *_ in gpu_check.STEPS}
    steps.update(measure=measure, syncs={"status": "pass", "keep_syncs": 2.0, "offload_syncs": 2.0},
                 imports={"status": "pass", "megatron_core": {"version": "0.16.1"},
                          "kvikio": {"version": "26.10.00", "gds_unavailable": "", "mode": "direct", "nvidia_fs": True}})
    steps["bitwise-gds"] = {"status": "pass", "kvikio_mode": "direct"}
    steps["bitwise-gds-compat"] = {"status": "pass", "kvikio_mode": "compat"}
    steps["optimizer-offload"] = json.loads(json.dumps(OPTIMIZER_RECORDED))  # tests/test_gpu_optimizer_row.py
    return steps


def test_targets_compute_pass_fail_and_not_run_from_the_results():
    """Each judge can fail: breaking one measurement at a time turns exactly its row to FAIL
    (or NOT RUN where the premise is missing)."""
    steps = _passing_steps()
    rows = {r["target"]: r for r in gpu_check_targets.targets(steps)}
    assert list(rows) == TARGET_NAMES
    assert all(r["result"] == "PASS" for r in rows.values()), [r for r in rows.values() if r["result"] != "PASS"]

    def result(name, **change):
        s = json.loads(json.dumps(steps))
        for path, value in change.items():
            step, key = path.split("__", 1)
            if key.startswith("point"):
                i, field = key[len("point"):].split("_", 1)
                s[step]["points"][int(i)][field] = value
            else:
                s[step][key] = value
        judge_points(s["measure"]["points"], 1, RATES, {})  # as the step judges what it measured
        return {r["target"]: r for r in gpu_check_targets.targets(s)}[name]["result"]

    stall_mem, stall_posix = (f"stall beyond the IO deficit offload-{e} <= 2% of step" for e in ("memory", "posix"))
    assert result(stall_mem, measure__point1_stall_s=1.06) == "FAIL"  # 0.06 s beyond the deficit: 2.9%
    assert result(stall_posix, measure__point2_stall_s=9.5) == "FAIL"
    # 87% of the step blocked, but all but 0.05 s of it forced by the drive
    assert rows[stall_posix]["detail"].startswith("0.48% beyond the IO deficit (9050.0 ms per step blocked")
    assert "deficit 9000.0 ms = max(0, IO 10000.0 - keep 1000.0)" in rows[stall_posix]["detail"]
    assert result("peak activation memory offload-posix <= 0.5x keep", measure__point2_activation_reserved=21) == "FAIL"
    # allocated alone would pass: the row judges reserved memory
    assert result("peak activation memory offload-memory <= 0.5x keep", measure__point1_activation_reserved=30,
                  measure__point1_activation_bytes=1) == "FAIL"
    # the whole peaks were always over 0.5x here (75/100): the row judges the activations' part
    assert rows["peak activation memory offload-memory <= 0.5x keep"]["detail"].startswith("0.38x activation reserved")
    assert "; whole peak reserved " in rows["peak activation memory offload-memory <= 0.5x keep"]["detail"]
    assert result("peak activation memory offload-memory <= 0.5x keep", measure__point0_activation_reserved=0) == "NOT RUN"
    # fewer than 5 timed steps: not judged
    assert result("peak activation memory offload-memory <= 0.5x keep", measure__point1_steps_timed=4) == "NOT RUN"
    assert result("ROK: adaptive at K+1 >= keep's best and > recompute", measure__point5_settled=False) == "NOT RUN"
    assert result("ROK: adaptive at K+1 >= keep's best and > recompute", measure__point5_still_settled=False) == "NOT RUN"
    assert result("bitwise gds (GPUDirect Storage): keep == offload", **{"bitwise-gds__kvikio_mode": "compat"}) == "NOT RUN"
    assert result("bitwise gds-compat (kvikio compat mode): keep == offload",
                  **{"bitwise-gds-compat__kvikio_mode": "direct"}) == "NOT RUN"
    assert result("bitwise gds (GPUDirect Storage): keep == offload", **{"bitwise-gds__status": "not run"}) == "NOT RUN"
    assert result("bitwise posix: keep == offload, compute stream delayed", **{"bitwise-posix__status": "not run"}) == "NOT RUN"
    assert "prefers direct mode (GPUDirect Storage)" in rows["import kvikio; the gds engine is available"]["detail"]
    assert result("overlap offload-posix <= 1.05x its bound", measure__point2_step_s=11.0) == "FAIL"
    # one micro-batch: the schedule's 2.0 s binds, and the row says both-ways is unreachable
    overlap_mem = "overlap offload-memory <= 1.05x its bound"
    assert result(overlap_mem, measure__point1_step_s=2.2) == "FAIL"
    assert "vs R / D2H + R / H2D (reads after their writes) = 2000.0 ms" in rows[overlap_mem]["detail"]
    assert "both-ways unreachable" in rows[overlap_mem]["detail"]
    # two micro-batches a step: reads may overlap writes, both ways at once (1.25 s) binds
    assert result(overlap_mem, measure__point1_num_microbatches=2, measure__point1_step_s=1.3) == "PASS"
    assert result(overlap_mem, measure__point1_num_microbatches=2) == "FAIL"  # 2.08 s: 1.66x
    assert result("ROK: adaptive at K+1 >= keep's best and > recompute", measure__point5_tokens_per_s=1.0) == "FAIL"
    assert result("ROK: adaptive at K+1 >= keep's best and > recompute", measure__point3_oom=False) == "NOT RUN"
    assert result("no host sync added by offload (memory engine)", syncs__offload_syncs=3.0) == "FAIL"
    assert result("stress: 50 steps bitwise, side stream, compact views", stress__status="fail") == "FAIL"
    assert result("bitwise gds (GPUDirect Storage): keep == offload", **{"bitwise-gds__status": "error"}) == "NOT RUN"
    assert result("import kvikio; the gds engine is available", imports__kvikio={"error": "no libcufile"}) == "FAIL"
    assert result("import megatron.core 0.16.1", imports__megatron_core={"version": "0.17.1"}) == "FAIL"
    assert result(stall_posix, measure__point2_ok=False) == "NOT RUN"
    assert "recompute@2" in gpu_check_targets.render({"targets": [], "steps": steps})


def test_every_target_has_a_row_when_nothing_ran():
    rows = gpu_check_targets.targets({}, {"measure": "not selected (--only)"})
    assert [r["target"] for r in rows] == TARGET_NAMES
    assert {r["result"] for r in rows} == {"NOT RUN"}
    assert {r["detail"] for r in rows if r["step"] == "measure"} == {"not selected (--only)"}


def _junit(tmp_path, cases):
    """A junit file as pytest writes it: (node id, outcome, message) per test."""
    body = []
    for node, outcome, msg in cases:
        path, name = node.split("::", 1)
        inner = {"passed": "", "skipped": f'<skipped type="pytest.skip" message="{msg}"/>',
                 "failed": f'<failure message="{msg}">trace</failure>'}[outcome]
        body.append(f'<testcase classname="{path[:-3].replace("/", ".")}" name="{name}" time="0.1">{inner}</testcase>')
    f = tmp_path / "junit.xml"
    f.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{"".join(body)}</testsuite></testsuites>')
    return str(f)


def test_cuda_tests_pass_only_when_every_required_test_ran_and_passed(tmp_path):
    """Before issue 38 any "N passed" passed, however many were skipped."""
    req = gpu_check_cuda.REQUIRED_TESTS
    judge = lambda cases: gpu_check_cuda.judge(gpu_check_cuda.outcomes(_junit(tmp_path, cases)), 0, [])  # noqa: E731
    ok = judge([(t, "passed", "") for t in req])
    assert ok["status"] == "pass" and ok["ran"] == len(req), ok
    skipped = judge([(t, "passed", "") for t in req[1:]] + [(req[0], "skipped", "kvikio is not installed")])
    assert skipped["status"] == "fail" and req[0] in skipped["why"] and "kvikio is not installed" in skipped["why"]
    missing = judge([(t, "passed", "") for t in req[1:]])
    assert missing["status"] == "fail" and missing["missing"] == [req[0]]
    extra = judge([(t, "passed", "") for t in req] + [("tests/test_pinned.py::test_cuda_new", "failed", "boom")])
    assert extra["status"] == "fail" and "test_cuda_new failed: boom" in extra["why"]
    assert judge([])["status"] == "fail"
    assert gpu_check_cuda.node_id(ET.fromstring('<testcase classname="tests.test_x.TestA" name="test_b[1]"/>')) \
        == "tests/test_x.py::TestA::test_b[1]"


def test_the_cuda_test_files_named_are_every_file_with_a_cuda_test():
    """A new file with a cuda test must be named, required or optional with its reason."""
    named = set(gpu_check_cuda.REQUIRED_FILES) | set(gpu_check_cuda.OPTIONAL_FILES)
    mark = "pytest.mark." + "cuda"  # spelled apart: this file is not one of them
    found = {f"tests/{f}" for f in os.listdir(os.path.join(ROOT, "tests"))
             if f.startswith("test_") and f.endswith(".py") and mark in open(os.path.join(ROOT, "tests", f)).read()}
    assert found == named, (sorted(found - named), sorted(named - found))
    assert {t.split("::")[0] for t in gpu_check_cuda.REQUIRED_TESTS} <= set(gpu_check_cuda.REQUIRED_FILES)


def test_the_required_cuda_tests_are_what_pytest_collects_from_their_files():
    """The list against pytest's own collection of those files (about 8 s on a quiet 2-core
    machine; kept in the default suite: a stale list would cost the GPU box's one run)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", "-p", "no:cacheprovider"]
                          + gpu_check_cuda.REQUIRED_FILES, cwd=ROOT, capture_output=True, text=True, timeout=600)
    collected = sorted(line for line in proc.stdout.splitlines() if "::" in line)
    assert collected == gpu_check_cuda.REQUIRED_TESTS, proc.stdout[-2000:]


@pytest.mark.parametrize("registers", [True, False], ids=["registered", "torch-allocator"])
def test_the_ram_guard_counts_the_staging_pool_and_what_pinning_really_locks(tmp_path, registers):
    """A point's pinned pools: the engine's pool and the 2 x max_inflight_bytes staging pool, at
    their page-rounded sizes where cudaHostRegister works, at torch's powers of two where it
    was refused; a point whose pools exceed 3/4 of the RAM is not run, saying so."""
    from ssdtrain_megatron import OffloadConfig

    m = gpu_check_measure.Measure.__new__(gpu_check_measure.Measure)
    m.registers, m.host_ram, m.per_sample, m.until, m.estimates = registers, 64 << 30, None, None, {}
    m.base_cfg = OffloadConfig(dirs=[str(tmp_path)], engine="posix")
    m.args = gpu_check.parse_args(["--out", str(tmp_path / "res"), "--scratch", str(tmp_path / "scratch")])
    os.makedirs(m.args.scratch, exist_ok=True)
    mem = dict(engine="memory", host_memory_bytes=3 << 30, max_inflight_bytes=5 << 30)
    want = (13 << 30) if registers else (16 << 30) + (4 << 30)  # staging 10 GiB (or 16), pool 3 GiB (or 4)
    assert m.pinned("offload", mem) == want
    assert m.pinned("keep", mem) == 0
    why = m._skip(1, "offload", "memory", {"host_memory_bytes": 40 << 30, "max_inflight_bytes": 5 << 30})
    assert why and why.startswith("not run (host memory)") and "staging included" in why
    assert m._skip(1, "offload", "memory", {"host_memory_bytes": 1 << 30}) is None


@pytest.mark.parametrize("change, code", [(None, 0), ("fail", 1), ("timeout", 1), ("missing", 1)],
                         ids=["all-pass", "one-step-fails", "one-step-times-out", "one-step-never-reports"])
def test_exit_status_is_0_only_when_every_target_passed(tmp_path, monkeypatch, capsys, change, code):
    """The parent with its step runners replaced by canned results (no GPU here): 0 with every
    target PASS; 1 as soon as one step fails, times out or leaves no result."""
    steps = _passing_steps()
    if change == "fail":
        steps["bitwise-tiered"] = {"status": "fail", "why": "offload differs from keep at steps [1]"}
    elif change == "timeout":
        steps["measure"] = dict(steps["measure"], status="timeout", points=steps["measure"]["points"][:3])
    elif change == "missing":
        steps["cuda-tests"] = {"status": "error", "why": "exit status 1, no result"}
    monkeypatch.setattr(gpu_check, "run_child", lambda args, name, env, limit: dict(steps[name]))
    monkeypatch.setattr(gpu_check, "install", lambda args, prefix, env, limit: dict(steps["install"]))
    rc = gpu_check.run_parent(gpu_check.parse_args(["--out", str(tmp_path / "res"), "--scratch", str(tmp_path / "scratch")]))
    out = capsys.readouterr().out
    assert rc == code, out
    if code == 0:
        assert f"{len(TARGET_NAMES)} of {len(TARGET_NAMES)} targets PASS" in out


def test_requirements_carry_the_projects_own_install_requires():
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.keyword) and n.arg == "install_requires")
    wanted = {r.value for r in call.value.elts} - {r for r in (r.value for r in call.value.elts) if r.startswith("torch")}
    assert wanted <= set(gpu_bundle.REQUIREMENTS)


def _wheel(folder, name, version, requires=()):
    """A tiny real wheel (one module, its dependencies as Requires-Dist) for the offline tests."""
    os.makedirs(folder, exist_ok=True)
    dist = f"{name.replace('-', '_')}-{version}"
    path = os.path.join(folder, f"{dist}-py3-none-any.whl")
    meta = "\n".join(["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
                     + [f"Requires-Dist: {r}" for r in requires]) + "\n"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name.replace('-', '_')}.py", "VALUE = 1\n")
        z.writestr(f"{dist}.dist-info/METADATA", meta)
        z.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}.dist-info/RECORD", "")
    return path


def test_install_takes_the_bundle_offline_and_what_the_box_has_from_the_box(tmp_path, monkeypatch):
    """The install step: pip --no-index from the bundle into <out>/prefix. pyyaml is installed
    here and not in the bundle: it is taken from the environment. A wheel missing from the
    bundle fails the step with pip's reason; an empty bundle folder is NOT RUN, naming
    `make gpu-bundle`."""
    monkeypatch.setattr(gpu_check, "REQUIREMENTS", ["demo-top==1.0"])
    whl = tmp_path / "whl"
    _wheel(whl, "demo-top", "1.0", ["demo-dep>=2", "pyyaml"])
    dep = _wheel(whl, "demo-dep", "2.1")
    args = gpu_check.parse_args(["--out", str(tmp_path / "res"), "--scratch", str(tmp_path / "scratch"), "--wheels", str(whl)])
    os.makedirs(tmp_path / "res" / "logs")
    prefix = str(tmp_path / "res" / "prefix")
    result = gpu_check.install(args, prefix, dict(os.environ), 120)
    assert result["status"] == "pass", result
    installed = [f for d in gpu_check.prefix_sites(prefix) if os.path.isdir(d) for f in os.listdir(d)]
    assert "demo_top.py" in installed and "demo_dep.py" in installed
    assert not any(f.lower().startswith("pyyaml") or f == "yaml" for f in installed)
    os.unlink(dep)
    result = gpu_check.install(args, str(tmp_path / "prefix2"), dict(os.environ), 120)
    assert result["status"] == "fail" and "demo-dep" in result["why"], result
    args.wheels = str(tmp_path / "empty")
    result = gpu_check.install(args, str(tmp_path / "prefix3"), dict(os.environ), 120)
    assert result["status"] == "not run" and "make gpu-bundle" in result["why"]


def test_bundle_proof_resolves_offline_against_the_box_and_finds_gaps(tmp_path, monkeypatch):
    """gpu_bundle.prove_offline with a made-up bundle: complete, it lists each package as on the
    box (a stand-in) or a wheel of the folder; a missing dependency or an unused wheel fails it,
    and `--offline-only` exits 1 when the folder is over --max-mib."""
    monkeypatch.setattr(gpu_bundle, "REQUIREMENTS", ["demo-top==1.0"])
    monkeypatch.setattr(gpu_bundle, "BOX_ALSO", [])
    whl = tmp_path / "whl"
    _wheel(whl, "demo-top", "1.0", ["demo-dep>=2", "torch>=2.6"])
    dep = _wheel(whl, "demo-dep", "2.1")
    box = {"torch": {"version": "2.11.0", "provides_extra": [], "requires_dist": ["filelock"]},
           "filelock": {"version": "3.0", "provides_extra": []}}
    lines = gpu_bundle.prove_offline(str(whl), box, str(tmp_path / "w1"))
    assert any("torch" in x and "on the box" in x for x in lines)
    assert any("filelock" in x and "on the box" in x for x in lines)  # torch's own needs: the box's
    (whl / "box.json").write_text(json.dumps(box))
    assert gpu_bundle.main(["--dest", str(whl), "--offline-only"]) == 0
    assert gpu_bundle.main(["--dest", str(whl), "--offline-only", "--max-mib", "0.001"]) == 1  # over the size
    assert any("demo-dep" in x and "demo_dep-2.1-py3-none-any.whl" in x for x in lines)
    extra = _wheel(whl, "demo-unused", "1.0")
    with pytest.raises(RuntimeError, match="demo_unused-1.0-py3-none-any.whl is in .* but nothing needs it"):
        gpu_bundle.prove_offline(str(whl), box, str(tmp_path / "w2"))
    os.unlink(extra)
    os.unlink(dep)
    with pytest.raises(RuntimeError, match="demo-dep"):
        gpu_bundle.prove_offline(str(whl), box, str(tmp_path / "w3"))


def _pypi_reachable():
    import socket

    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False


@pytest.mark.slow
def test_make_gpu_bundle_downloads_a_complete_bundle_under_60_mib(tmp_path):
    """The real thing (about 25 MiB from PyPI, a minute or two): needs network."""
    if not _pypi_reachable():
        pytest.skip("pypi.org is not reachable: `make gpu-bundle` needs network")
    dest = tmp_path / "whl"
    proc = subprocess.run(["make", "-s", "-C", ROOT, "gpu-bundle", f"PYTHON={sys.executable}", f"GPU_BUNDLE_DEST={dest}"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"\n  torch +2\.11\.0 +on the box\n", proc.stdout), proc.stdout
    files = sorted(f for f in os.listdir(dest) if f.endswith(".whl"))
    assert any(f.startswith("megatron_core-0.16.1-cp312") for f in files)
    assert any(f.startswith("kvikio_cu13-26.10") for f in files) and any(f.startswith("libkvikio_cu13-26.10") for f in files)
    assert not any(f.startswith(("torch-", "nvidia_", "cupy")) for f in files)
    assert sum(os.path.getsize(dest / f) for f in files) < 60 * 2**20


def test_stall_probe_times_the_training_threads_waits_on_the_offloader(tmp_path, monkeypatch):
    """The measure step's StallProbe around a real offloaded run on the CPU (an MLP, posix
    engine; every write finished before backward, so backward reads from the drive), on a
    drive whose reads are made slow, 200 ms per system call: backward has to wait for them,
    and the probe must count those waits, at least what StepStats.io_wait_s counts of them;
    afterwards the method is restored."""
    import time

    import torch

    from ssdtrain_megatron import ActivationOffloader, OffloadConfig
    from ssdtrain_megatron.cache.progress import Progress
    from ssdtrain_megatron.io.syscalls import SysCalls
    from tests.models import mlp, run_steps

    real_read = SysCalls.preadv
    monkeypatch.setattr(SysCalls, "preadv", lambda self, *a: (time.sleep(0.2), real_read(self, *a))[1])
    real = Progress.next_event
    batches = [torch.randn(32, 256, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    with gpu_check_measure.StallProbe() as probe, \
            ActivationOffloader(OffloadConfig(dirs=[str(tmp_path)], engine="posix", min_tensor_bytes=1024)) as off:
        assert probe.works and Progress.next_event is not real
        stats = run_steps(mlp(), batches, off, steps=1, wait_writes=True)[2]
    assert sum(st.bytes_read for st in stats) > 0
    counted = sum(st.io_wait_s for st in stats)
    assert counted > 0 and probe.seconds >= 0.9 * counted - 1e-3, (probe.seconds, counted)
    assert Progress.next_event is real


def test_imports_step_reports_megatron_and_kvikio_as_the_targets_read_them():
    """The imports step run here: megatron-core 0.16.1 imports (the shared venv has it), kvikio
    does not (no CUDA): the megatron row passes, the kvikio row fails naming the import."""
    from ssdtrain_megatron.tools.gpucheck import gpu_check_steps as steps

    result = steps.step_imports(None, lambda r: None)
    rows = {r["target"]: r for r in gpu_check_targets.targets({"imports": result})}
    assert rows["import megatron.core 0.16.1"]["result"] == "PASS", result
    kv = rows["import kvikio; the gds engine is available"]
    assert kv["result"] == "FAIL" and "import kvikio failed" in kv["detail"], kv
