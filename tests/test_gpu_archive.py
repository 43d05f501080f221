"""What a GPU run leaves under --out: one archive, whatever ended it (gpucheck/gpu_archive.py),
and a step's process that dies with the run's (gpu_check.py). The GPU machines copy back 8
files of 16 MiB at most, two folders down: a run that left its results folder, its installed
bundle and its scratch under --out would come back in pieces, or not at all.

Real processes throughout; the CPU stand-in box (tests/test_gpu_check_steps.py) for the
stand-in run's GPU calls. This module is also a step's program for the process tests
(``python -m tests.test_gpu_archive --child perf ...``): a step that saves, then waits."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tarfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ssdtrain_megatron.tools.gpucheck import gpu_archive, gpu_check, gpu_check_plan, gpu_perf  # noqa: E402

RETURNED = 16 << 20  # what the GPU machine copies back of one file


def unpacked(out, suite: str):
    """The results folder of the run that left its archive in ``out`` (a pathlib.Path),
    extracted beside it: ``out/../<suite>-unpacked/<suite>-results``."""
    dest = out.parent / f"{suite}-unpacked"
    with tarfile.open(out / f"{suite}-results.tar.gz") as tar:
        tar.extractall(dest, filter="data")
    return dest / f"{suite}-results"


def _members(path):
    with tarfile.open(path) as tar:
        return sorted(m.name for m in tar.getmembers())


def _read(path, name):
    with tarfile.open(path) as tar:
        return tar.extractfile(name).read().decode()


def test_a_dry_run_leaves_one_archive_and_no_scratch(tmp_path):
    """`GPU_CHECK_DRY=1 make gpu-perf`: --out holds the archive alone, with the plan in it;
    the scratch folder the run made is gone. On a975649 --out held plan.json loose."""
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    os.makedirs(scratch)
    proc = subprocess.run(["make", "-s", "-C", ROOT, "gpu-perf", f"PYTHON={sys.executable}",
                           f"GPU_PERF_ARGS=--out {out} --scratch {scratch}"],
                          env=dict(os.environ, GPU_CHECK_DRY="1"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert os.listdir(out) == ["gpu-perf-results.tar.gz"]
    archive = out / "gpu-perf-results.tar.gz"
    assert _members(archive) == ["gpu-perf-results/plan.json"]
    assert json.loads(_read(archive, "gpu-perf-results/plan.json"))["dry_run"] is True
    assert os.path.getsize(archive) < RETURNED
    assert os.listdir(scratch) == []
    assert f"gpu-perf: archive {archive}: " in proc.stdout


@pytest.mark.parametrize("flag", ["inside", "around"])
def test_scratch_inside_out_or_out_inside_scratch_is_refused_in_one_line(tmp_path, flag):
    out = tmp_path / "out"
    scratch = out / "scratch" if flag == "inside" else tmp_path
    proc = subprocess.run([sys.executable, "-m", "ssdtrain_megatron.tools.gpucheck.gpu_perf", "--out", str(out),
                           "--scratch", str(scratch)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    want = f"--scratch {scratch} is inside --out {out}" if flag == "inside" else f"--out {out} is inside --scratch {scratch}"
    assert want in line, line
    assert not out.exists()


def test_the_archive_leaves_out_traces_then_logs_largest_first_to_stay_under_its_cap(tmp_path):
    """Incompressible traces over the cap: the largest go first, left-out.txt names them, the
    results and the steps' results are always in."""
    work = tmp_path / "gpu-perf-results"
    for rel, size in (("gpu-perf.json", 10), ("table.txt", 10), ("steps/perf.json", 10), ("logs/perf.log", 1000),
                      ("traces/a/big.json", 600_000), ("traces/a/mid.json", 400_000), ("traces/b/small.json", 200_000)):
        os.makedirs((work / rel).parent, exist_ok=True)
        (work / rel).write_bytes(os.urandom(size))
    dest = str(tmp_path / "a.tar.gz")
    packed = gpu_archive.pack(str(work), dest, max_bytes=700_000)
    assert packed["left_out"] == ["traces/a/big.json"] and packed["bytes"] <= 700_000 == 700_000
    names = _members(dest)
    assert names == sorted(f"gpu-perf-results/{n}" for n in ("gpu-perf.json", "table.txt", "steps/perf.json",
                                                              "logs/perf.log", "traces/a/mid.json",
                                                              "traces/b/small.json", "left-out.txt"))
    assert _read(dest, "gpu-perf-results/left-out.txt").startswith("traces/a/big.json (600000 bytes)")
    packed = gpu_archive.pack(str(work), dest, max_bytes=20_000)
    assert packed["left_out"] == ["traces/a/big.json", "traces/a/mid.json", "traces/b/small.json"]
    assert "gpu-perf-results/logs/perf.log" in _members(dest)


# -- the stand-in run: the parent, its steps in this process, the CPU stand-in box ---------------

def _stand_in_step(args, save):
    from ssdtrain_megatron.tools.gpucheck import gpu_perf_step
    from tests.test_gpu_check_steps import StandInBox

    return gpu_perf_step.run_step(args, save, StandInBox())


def test_a_stand_in_run_leaves_one_archive_with_every_result_under_16_mib(tmp_path, monkeypatch, capsys):
    """The whole parent (install stood in: there are no wheels here), the perf step through
    the stand-in box at tiny shapes: --out ends with the archive alone, holding the suite's
    JSON, table.txt, the step's result and log, and the twelve traces; table.txt is printed;
    the run's scratch (the drive's files, the bundle's prefix) is gone."""
    from ssdtrain_megatron.tools.gpucheck import gpu_check_measure, gpu_perf_plan, gpu_perf_step
    from tests.test_gpu_perf import TINY_SHAPES

    monkeypatch.setattr(gpu_perf_step, "SHAPES", TINY_SHAPES)
    monkeypatch.setattr(gpu_check_measure, "MIN_TENSOR_BYTES", 1024)
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    os.makedirs(scratch)
    args = gpu_perf.parse_args(["--out", str(out), "--scratch", str(scratch)])
    seen = {}

    def install(a, prefix, env, limit):
        os.makedirs(prefix)
        seen["prefix"] = prefix
        return {"status": "pass"}

    def run_child(a, name, env, limit):
        seen["drive"] = a.scratch
        step = argparse_copy(a, child=name, suite=dataclasses.replace(a.suite,
                                                                      run_step="tests.test_gpu_archive:_stand_in_step"))
        with open(os.path.join(a.out, "logs", f"{name}.log"), "w") as log:
            log.write("the stand-in's step\n")
        assert gpu_check.child(step) == 0
        return json.load(open(os.path.join(a.out, "steps", f"{name}.json")))

    monkeypatch.setattr(gpu_check, "install", install)
    monkeypatch.setattr(gpu_check, "run_child", run_child)
    gpu_check.run_parent(args)
    printed = capsys.readouterr().out
    archive = out / "gpu-perf-results.tar.gz"
    assert os.listdir(out) == ["gpu-perf-results.tar.gz"]
    size = os.path.getsize(archive)
    assert size < RETURNED
    traces = [f"gpu-perf-results/traces/{shape}/{point}-mb{TINY_SHAPES[shape]['micro_batch']}.json"
              for shape in TINY_SHAPES for point, _ in gpu_perf_plan.STRATEGIES]
    assert _members(archive) == sorted(["gpu-perf-results/gpu-perf.json", "gpu-perf-results/table.txt",
                                        "gpu-perf-results/steps/perf.json", "gpu-perf-results/logs/perf.log"]
                                       + traces)
    table = _read(archive, "gpu-perf-results/table.txt")
    assert table in printed and f"gpu-perf: archive {archive}: {size:,} bytes, 16 files" in printed
    perf = json.loads(_read(archive, "gpu-perf-results/steps/perf.json"))
    assert perf["status"] == "pass"
    for sub in perf["shapes"].values():  # what the drive rows measured (tests/test_gpu_drive.py)
        assert sub["drive"]["dir"] == seen["drive"] and sub["drive"]["o_direct"] is True
    assert seen["prefix"].startswith(str(scratch)) and seen["drive"].startswith(str(scratch))
    assert os.listdir(scratch) == []


def argparse_copy(args, **changes):
    import argparse

    return argparse.Namespace(**dict(vars(args), **changes))


# -- real processes: a step that saves, then waits -------------------------------------------------

def _saves_then_waits(args, save):
    save({"status": "running", "pid": os.getpid(),
          "env": {k: os.environ.get(k) for k in ("GLOO_SOCKET_IFNAME", "MASTER_ADDR")}})
    time.sleep(120)
    return {"status": "pass"}


DRIVER = """
import dataclasses, sys
from ssdtrain_megatron.tools.gpucheck import gpu_check, gpu_check_plan, gpu_perf
steps = [("perf", 100, (), "saves, then waits")]
args = gpu_perf.parse_args(sys.argv[1:])
args.suite = dataclasses.replace(args.suite, module="tests.test_gpu_archive", steps=steps,
                                 plan=lambda a: gpu_check_plan.plan(a, steps))
sys.exit(gpu_check.run_parent(args))
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except OSError:
        return False


def _start_run(tmp_path):
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    os.makedirs(scratch)
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, "--out", str(out), "--scratch", str(scratch)], cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    saved = out / "gpu-perf-results" / "steps" / "perf.json"
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            step = json.loads(saved.read_text())  # the step's first save is the event waited for
            break
        except (OSError, ValueError):
            time.sleep(0.05)
    else:
        raise AssertionError(proc.communicate()[0] if proc.poll() is not None else "no save in 120 s")
    return proc, step, out, scratch


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def test_sigterm_to_the_run_kills_the_step_and_still_leaves_the_archive(tmp_path):
    """The machine's limit stops the run with SIGTERM: the step in flight is stopped (it saves
    where it was), table.txt is printed, the archive holds it all and --out nothing else; the
    step saw gloo on the loopback device and 127.0.0.1."""
    proc, step, out, scratch = _start_run(tmp_path)
    try:
        assert step["env"] == {"GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=60)[0]
        assert _gone_within(step["pid"], 10)
    finally:
        if _alive(step["pid"]):
            os.kill(step["pid"], signal.SIGKILL)
    archive = out / "gpu-perf-results.tar.gz"
    assert proc.returncode == 1 and os.listdir(out) == ["gpu-perf-results.tar.gz"], output
    saved = json.loads(_read(archive, "gpu-perf-results/steps/perf.json"))
    assert saved["status"] == "error" and saved["why"].startswith("Terminated: signal 15"), saved
    results = json.loads(_read(archive, "gpu-perf-results/gpu-perf.json"))
    assert results["stopped"].startswith("signal 15 (SIGTERM)")
    assert "gpu-perf: stopped: signal 15 (SIGTERM)" in output and "activation peak <= 0.7x keep's: memory" in output  # the table
    assert os.listdir(scratch) == []


def test_the_step_dies_with_the_run_when_the_run_is_killed(tmp_path):
    """SIGKILL to the run (no handler can run): the step's process goes too, at once (the
    parent-death signal), instead of holding the GPU for its 120 s."""
    proc, step, out, scratch = _start_run(tmp_path)
    try:
        proc.kill()
        proc.communicate(timeout=60)
        assert _gone_within(step["pid"], 30), "the step outlived the run"
    finally:
        if _alive(step["pid"]):
            os.kill(step["pid"], signal.SIGKILL)


if __name__ == "__main__":  # a step's process in the tests above
    args = gpu_perf.parse_args(sys.argv[1:])
    args.suite = dataclasses.replace(args.suite, run_step="tests.test_gpu_archive:_saves_then_waits")
    sys.exit(gpu_check.child(args))
