"""`make gpu-check` (scripts/gpu_check.sh, scripts/gpu_check.py) on a machine without a GPU:
the dry run (arguments, wheel check, plan), the step runner reporting steps it cannot run, and
the PASS/FAIL arithmetic of the targets. The GPU steps themselves run only on a GPU box."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import gpu_check  # noqa: E402


def _run(args, tmp_path, dry=True, timeout=300):
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_DRY="1" if dry else "0")
    return subprocess.run([os.path.join(ROOT, "scripts", "gpu_check.sh")] + args, cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_dry_run_checks_the_wheels_and_writes_the_plan(tmp_path):
    wheels = tmp_path / "whl"
    wheels.mkdir()
    (wheels / "megatron_core-0.16.1-cp312-cp312-manylinux_2_39_x86_64.whl").write_bytes(b"")
    (wheels / "kvikio_cu13-26.10.00-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"")
    out = tmp_path / "res"
    proc = _run(["--out", str(out), "--wheels", str(wheels)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "libkvikio-cu13: MISSING" in proc.stdout
    data = json.loads((out / "gpu-check.json").read_text())
    assert data["header"]["dry_run"] is True
    assert [s["step"] for s in data["header"]["plan"]] == [s[0] for s in gpu_check.STEPS]
    w = data["header"]["wheels"]
    assert w["megatron-core"]["ok"] and w["kvikio-cu13"]["ok"] and not w["libkvikio-cu13"]["ok"]
    assert data["steps"]["wheels"]["status"] == "fail"
    assert (out / "table.txt").exists()
    assert sorted(os.listdir(out)) == ["gpu-check.json", "table.txt"]  # nothing ran


def test_make_gpu_check_dry_run(tmp_path):
    env = dict(os.environ, GPU_CHECK_DRY="1")
    proc = subprocess.run(["make", "-s", "-C", ROOT, "gpu-check", f"PYTHON={sys.executable}",
                           f"GPU_CHECK_ARGS=--out {tmp_path / 'res'} --only env,measure"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "would run 2 steps" in proc.stdout
    assert json.loads((tmp_path / "res" / "gpu-check.json").read_text())["header"]["dry_run"]


@pytest.mark.parametrize("argv, message", [
    (["--only", "bitwise-posix,warp-drive"], "unknown step(s) warp-drive"),
    (["--hidden", "100", "--heads", "3"], "not a multiple of --heads"),
    (["--seq", "0"], "must be >= 1"),
])
def test_bad_arguments_fail_before_anything_runs(tmp_path, argv, message):
    proc = _run(argv + ["--out", str(tmp_path / "res")], tmp_path)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert not (tmp_path / "res").exists()


def test_gpu_steps_without_a_gpu_are_reported_as_skipped(tmp_path):
    out = tmp_path / "res"
    proc = _run(["--out", str(out), "--wheels", str(tmp_path), "--only", "bitwise-posix,syncs"], tmp_path,
                dry=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((out / "gpu-check.json").read_text())
    for step in ("bitwise-posix", "syncs"):
        assert data["steps"][step]["status"] == "skip"
        assert "no CUDA device" in data["steps"][step]["why"]
        assert (out / "logs" / f"{step}.log").exists()
    assert all(t["result"] != "FAIL" for t in data["targets"])
    assert not (out / "scratch").exists()  # the scratch directory is removed at the end


def _point(name, step_s, peak, written=0.0, read=0.0, mb=1, seq=2048, **kw):
    return dict(name=name, ok=True, step_s=step_s, peak_bytes=peak, bytes_written=written, bytes_read=read,
                tokens_per_s=mb * seq / step_s, **kw)


def test_targets_compute_pass_and_fail_from_the_measurements():
    measure = {"status": "pass", "micro_batch": 1, "bandwidth": {"memory": {"write": 50e9, "read": 50e9},
                                               "posix": {"write": 5e9, "read": 5e9}},
               "points": [
                   _point("keep@1", 1.0, 100),
                   _point("offload-memory@1", 1.04, 40, written=25e9, read=25e9),  # bound max(1, 1.0) -> 1.04x
                   _point("offload-posix@1", 11.0, 60, written=25e9, read=25e9),  # bound 10 s -> 1.10x
                   {"name": "keep@2", "ok": False, "oom": True},
                   _point("recompute@2", 3.0, 90, mb=2),
                   _point("adaptive@2", 1.9, 80, mb=2),
               ]}
    steps = {"measure": measure, "syncs": {"status": "pass", "keep_syncs": 2.0, "offload_syncs": 2.0},
             "bitwise-gds": {"status": "skip", "why": "no kvikio"}, "stress": {"status": "fail", "why": "step 7"}}
    rows = {r["target"]: r for r in gpu_check.targets(steps)}
    assert rows["peak offload-memory <= 0.5x keep (micro-batch 1)"]["result"] == "PASS"
    assert rows["peak offload-posix <= 0.5x keep (micro-batch 1)"]["result"] == "FAIL"
    assert rows["overlap offload-memory <= 1.05x max(keep, bytes/bw)"]["result"] == "PASS"
    over = rows["overlap offload-posix <= 1.05x max(keep, bytes/bw)"]
    assert over["result"] == "FAIL" and "1.10x" in over["detail"]
    assert rows["ROK: adaptive@2 >= keep's best and > recompute (in budget)"]["result"] == "PASS"
    assert rows["no host sync added (memory engine, steady state)"]["result"] == "PASS"
    assert rows["bitwise-gds: bitwise / tests"]["result"] == "n/a"
    assert rows["stress: bitwise / tests"]["result"] == "FAIL"
    measure["points"][-1] = _point("adaptive@2", 2.5, 80, mb=2)  # slower than keep@1 per token
    rows = {r["target"]: r for r in gpu_check.targets(steps)}
    assert rows["ROK: adaptive@2 >= keep's best and > recompute (in budget)"]["result"] == "FAIL"
    measure["points"][3] = _point("keep@2", 2.0, 150, mb=2)  # keep fits: not the ROK regime
    rows = {r["target"]: r for r in gpu_check.targets(steps)}
    assert rows["ROK: adaptive@2 >= keep's best and > recompute (in budget)"]["result"] == "n/a"
    assert "recompute@2" in gpu_check.render({"targets": [], "steps": steps})


@pytest.mark.parametrize("corrupt", [False, True], ids=["equal", "one-element-changed"])
def test_bitwise_comparison_of_the_script_on_megatron_bf16(tmp_path, monkeypatch, corrupt):
    """The gpu-check's keep-vs-offload comparison, run here on the CPU (megatron-core GPT in
    bf16 through the CPU runtime): it passes when offload is exact, and fails, naming the step,
    when one element of one restored activation differs."""
    import argparse

    import torch

    import gpu_check_steps as steps
    from ssdtrain_megatron.cache.offloader import ActivationOffloader
    from ssdtrain_megatron.cache.record import State
    from ssdtrain_megatron.tools.minigpt import GPTSpec

    if corrupt:
        real = ActivationOffloader._materialize

        def materialize(self, rec):
            out = real(self, rec)
            if self.config.policy == "offload" and rec.state == State.READY and out.is_floating_point():
                out = out.clone()
                out[(0,) * out.dim()] += 1
            return out
        monkeypatch.setattr(ActivationOffloader, "_materialize", materialize)
    args = argparse.Namespace(scratch=str(tmp_path / "scratch"), out=str(tmp_path))
    spec = GPTSpec(layers=2, hidden=64, heads=4, seq=32, vocab=128, micro_batch=2, num_microbatches=2)
    cfg = steps._config(args, "posix", min_tensor_bytes=1024, max_inflight_bytes=1 << 20)
    result = steps._compare(args, lambda r: None, spec, cfg, steps=2, stream=None)
    assert result["init_same"] and result["bytes_read"] > 0
    assert not result["baseline_steps_differing"]
    if corrupt:
        assert result["status"] == "fail" and "offload differs from keep at steps [0" in result["why"]
    else:
        assert result["status"] == "pass", result
    assert torch.is_grad_enabled()
