"""`make gpu-perf` and `make gpu-check` keep what they measured whatever ends a step (issue 55,
items 1, 2 and 6): a CUDA error (one that passes, and a sticky one after which every call to
the device raises), an out-of-memory, a timeout, a signal. Each is injected on the CPU through
the stand-in box (tests/test_gpu_check_steps.py) or a fake device whose timing events run
only when it is synchronised (what CUDA does); the step's JSON and the table rendered from it
are checked. Also: the time each point keeps in hand scales with its own estimate, the kill
path ends within the step's limit, and the plan is checked on both lent cards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from ssdtrain_megatron.tools.gpucheck import gpu_check  # noqa: E402
from tests.test_gpu_archive import unpacked  # noqa: E402
from ssdtrain_megatron.tools.gpucheck import gpu_check_measure  # noqa: E402
from ssdtrain_megatron.tools.gpucheck import gpu_check_plan  # noqa: E402
from ssdtrain_megatron.tools.gpucheck import gpu_check_runner  # noqa: E402
from ssdtrain_megatron.tools.gpucheck import gpu_perf  # noqa: E402
from ssdtrain_megatron.tools.gpucheck import gpu_perf_step  # noqa: E402
from ssdtrain_megatron.tools.gpucheck import gpu_perf_targets  # noqa: E402
from ssdtrain_megatron.telemetry.timeline import Timeline  # noqa: E402
from ssdtrain_megatron.tools.minigpt import GPTSpec, MegatronRuntime  # noqa: E402
from tests.recording_streams import Recorder  # noqa: E402
from tests.test_gpu_check_steps import StandInBox  # noqa: E402

ILLEGAL = "CUDA error: an illegal memory access was encountered"
ONE_SHAPE = {"io-bound": dict(layers=2, hidden=64, heads=4, seq=64, vocab=128, micro_batch=2, num_microbatches=1,
                             attention="local")}


# -- a fake device: timing events run when the device is synchronised ------------------------

class PendingEvent:
    """A CUDA timing event as the host sees it: recorded, it has not run until the device is
    synchronised; ``elapsed_time`` on one that has not run raises "device not ready"; on a
    device in a sticky error state every call raises."""

    def __init__(self, device: "FakeDevice") -> None:
        self.device, self.ran, self.ns = device, False, 0

    def record(self, stream=None) -> None:
        self.device.check()
        self.ran, self.ns = False, time.perf_counter_ns()
        self.device.pending.append(self)

    def synchronize(self) -> None:
        self.device.synchronize()

    def query(self) -> bool:
        self.device.check()
        return self.ran

    def elapsed_time(self, end: "PendingEvent") -> float:
        self.device.check()
        if not (self.ran and end.ran):
            raise RuntimeError("CUDA error: device not ready")
        return (end.ns - self.ns) / 1e6


class FakeDevice:
    """Timing StreamOps over a Recorder (its streams), with PendingEvents; ``sticky`` makes
    every call raise as after an illegal address."""

    def __init__(self) -> None:
        self.rec, self.pending, self.sticky = Recorder(), [], False

    def check(self) -> None:
        if self.sticky:
            raise RuntimeError(ILLEGAL)

    def synchronize(self) -> None:
        self.check()
        for e in self.pending:
            e.ran = True
        self.pending = []

    def timing_event(self) -> PendingEvent:
        return PendingEvent(self)

    def current_stream(self, device):
        return self.rec.current_stream(device)


class FakeDeviceBox(StandInBox):
    """The stand-in box with the fake device's timing events and synchronisation; with
    ``sticky`` set, every call of the box raises as CUDA does after an illegal address."""

    def __init__(self) -> None:
        super().__init__()
        self.device = FakeDevice()

    def timing_ops(self, streams):
        return self.device

    def synchronize(self, device):
        self.device.synchronize()

    def __getattribute__(self, name):
        attr = object.__getattribute__(self, name)
        if name in ("empty_cache", "set_fraction", "reset_peak", "peak", "now", "streams", "synchronize") \
                and object.__getattribute__(self, "device").sticky:
            raise RuntimeError(ILLEGAL)
        return attr


def test_abandon_resolves_the_events_that_ran_and_drops_the_rest_without_raising():
    """After an error in a recorded step: no synchronisation, no times asked of events that
    have not run; the finished spans are kept, the others counted. A sticky device (every
    call raises) drops everything, still without raising."""
    dev = FakeDevice()
    tl = Timeline(dev, torch.device("cpu"))
    tl.start(dev.synchronize)
    done = tl.gpu_begin(None, "compute", "done", "step")
    tl.gpu_end(None, done)
    dev.synchronize()  # the first span has run
    tl.gpu_begin(None, "compute", "pending", "step")
    tl.abandon()
    assert [e["name"] for e in tl.events if e["pid"] == "gpu"] == ["done"]
    assert tl.meta["unresolved_gpu_events"] == 1 and not tl.recording
    tl2 = Timeline(dev, torch.device("cpu"))
    tl2.start(dev.synchronize)
    tl2.gpu_mark(None, "compute", "x", "step")
    dev.synchronize()
    dev.sticky = True
    tl2.abandon()
    assert tl2.meta["unresolved_gpu_events"] == 1 and tl2.events == []


@pytest.fixture
def runtime():
    with MegatronRuntime() as rt:
        yield rt


@pytest.mark.parametrize("error", ["oom", "cuda"])
def test_an_error_in_the_recorded_step_reaches_the_point_as_it_was(runtime, tmp_path, monkeypatch, error):
    """The step that is recorded as a timeline raises while its GPU events have not run: the
    point says what the step raised (an out-of-memory flagged as one), with its traceback, not
    "device not ready" from resolving the timeline on the way out."""
    from ssdtrain_megatron.tools.gpucheck.gpu_check_common import GpuGPT

    spec = GPTSpec(layers=1, hidden=64, heads=4, seq=32, vocab=128, micro_batch=1, num_microbatches=1)
    model = GpuGPT(spec, runtime.device, grad_buffers=True)
    box = FakeDeviceBox()
    args = gpu_perf.parse_args(["--out", str(tmp_path / "res"), "--scratch", str(tmp_path / "scratch"), "--steps", "2"])
    os.makedirs(args.scratch)
    real, calls = gpu_check_runner.Runner.step, []

    def step(self):
        calls.append(1)
        if len(calls) == 3:  # warm-up, the first timed step, then the recorded one
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB") if error == "oom" \
                else RuntimeError(ILLEGAL)
        return real(self)

    monkeypatch.setattr(gpu_check_runner.Runner, "step", step)
    m = gpu_check_measure.Measure(args, lambda r: None, model, runtime.device, box)
    p = m.point("keep", 1, "keep")
    assert len(calls) == 3 and not p["ok"], p
    if error == "oom":
        assert p["oom"] is True and p["error"] == "CUDA out of memory. Tried to allocate 2.00 GiB", p
        assert "OutOfMemoryError" in p["traceback"]
    else:
        assert "oom" not in p and p["error"] == f"RuntimeError: {ILLEGAL}", p
    assert "device not ready" not in json.dumps(p)


# -- the whole perf step, through the child, each kind of failure injected ------------------

def _child(tmp_path, monkeypatch, box, exc, shapes=ONE_SHAPE):
    """gpu-perf's child for the perf step, in this process, with ``box``, tiny ``shapes``, one
    timed step a point, and Runner.step raising ``exc()`` at its FAIL_AT-th call; returns (exit
    status, the saved JSON, the table the parent renders from it)."""
    monkeypatch.setattr(gpu_perf_step, "SHAPES", shapes)
    monkeypatch.setattr(gpu_check_measure, "MIN_TENSOR_BYTES", 1024)
    real_step, real_run, calls = gpu_check_runner.Runner.step, gpu_perf_step.run_step, []

    def step(self):
        calls.append(1)
        if len(calls) == FAIL_AT:
            if isinstance(box, FakeDeviceBox) and "illegal" in str(exc()):
                box.device.sticky = True
            raise exc()
        return real_step(self)

    monkeypatch.setattr(gpu_check_runner.Runner, "step", step)
    monkeypatch.setattr(gpu_perf_step, "run_step", lambda args, save: real_run(args, save, box))
    args = gpu_perf.parse_args(["--out", str(tmp_path / "res"), "--scratch", str(tmp_path / "scratch"), "--child", "perf", "--steps", "1"])
    os.makedirs(args.scratch)
    rc = gpu_check.child(args)
    saved = json.loads((tmp_path / "res" / "steps" / "perf.json").read_text())
    res = gpu_check.Results(args.out, {}, gpu_perf.PERF)
    res.step("perf", saved)
    return rc, saved, (tmp_path / "res" / "table.txt").read_text()


# With one timed step a point, Runner.step's calls: keep's warm-up and recorded step 1-2;
# offload-memory 3-4; posix 5-6; save_on_cpu 7-8. The failure lands in save_on_cpu's recorded step.
FAIL_AT = 8


def _first_three_kept(shape: dict, table: str) -> None:
    points = {p["name"]: p for p in shape["points"]}
    for name in ("keep@2", "offload-memory@2", "offload-posix@2"):
        assert points[name]["ok"] and points[name]["steps_timed"] == 1, points[name]
        assert f"\n{name:<22}" in table, name  # measured, and in the table
    for name in ("offload-memory@2", "offload-posix@2"):
        assert points[name]["bound"] and "breakdown" in points[name], points[name]  # judged
    assert shape["rates"]["link"] and shape["rates"]["drive"]


def test_a_sticky_cuda_error_keeps_every_point_measured_and_names_the_failing_one(tmp_path, monkeypatch):
    """An illegal address in save_on_cpu's recorded step, after which every call to the device
    raises (the point's cleanup, the cache emptied between shapes): the three points before
    it are in the JSON, judged, and in the table; save_on_cpu is there with the error and its
    traceback; the next shape says the device failed before it."""
    box = FakeDeviceBox()
    rc, saved, table = _child(tmp_path, monkeypatch, box, lambda: RuntimeError(ILLEGAL),
                              dict(ONE_SHAPE, **{"compute-bound": ONE_SHAPE["io-bound"]}))
    assert rc == 0 and saved["status"] == "fail", saved.get("why")
    io = saved["shapes"]["io-bound"]
    assert io["status"] == "error" and io["why"] == f"RuntimeError: {ILLEGAL}" and "Traceback" in io["traceback"]
    _first_three_kept(io, table)
    soc = io["points"][-1]
    assert soc["name"] == "save_on_cpu@2" and not soc["ok"] and soc["error"] == f"RuntimeError: {ILLEGAL}"
    assert "Runner" in soc["traceback"] or "runner.step" in soc["traceback"]
    assert soc["cleanup_error"] == f"RuntimeError: {ILLEGAL}"
    assert saved["shapes"]["compute-bound"] == {"status": "not run",
                                                "why": f"the device failed before it: RuntimeError: {ILLEGAL}"}
    assert f"{'save_on_cpu@2':<22}  RuntimeError: {ILLEGAL}" in table
    rows = {r["target"]: r for r in gpu_perf_targets.targets({"perf": saved})}  # judged from the points
    assert rows["io-bound: memory <= 1.10x link bound + unoverlappable"]["detail"] == "keep@2: 1 of at least 5 timed steps ran"


@pytest.mark.slow  # a whole shape's six points; the recorded-step test above covers the OOM flag quickly
@pytest.mark.parametrize("kind", ["cuda", "oom"])
def test_an_error_that_passes_fails_its_point_and_the_next_points_still_run(tmp_path, monkeypatch, kind):
    exc = (lambda: RuntimeError(ILLEGAL)) if kind == "cuda" else \
        (lambda: torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB"))
    rc, saved, table = _child(tmp_path, monkeypatch, StandInBox(), exc)
    io = saved["shapes"]["io-bound"]
    _first_three_kept(io, table)
    points = {p["name"]: p for p in io["points"]}
    soc = points["save_on_cpu@2"]
    assert not soc["ok"] and soc["traceback"] and soc.get("oom", False) == (kind == "oom")
    assert points["recompute@2"]["ok"] and points["adaptive@2"]["ok"]  # the ones after it ran
    assert ("out of memory" if kind == "oom" else ILLEGAL) in table
    assert rc == 0 and io["status"] == "pass", io.get("why")


def test_a_signal_in_a_point_saves_the_point_and_everything_before_it(tmp_path, monkeypatch):
    """SIGTERM, as the child's handler turns it into Terminated in the main thread: the point
    it interrupted is saved with it and its traceback, then the step ends, the child's last
    save holding everything measured, the status "error" and where it stopped."""
    rc, saved, table = _child(tmp_path, monkeypatch, StandInBox(),
                              lambda: gpu_check.Terminated("signal 15 (SIGTERM): stopped from outside"))
    assert rc == 1 and saved["status"] == "error" and saved["why"].startswith("Terminated: signal 15"), saved
    assert "Traceback" in saved["traceback"]
    io = saved["shapes"]["io-bound"]
    _first_three_kept(io, table)
    assert io["points"][-1]["name"] == "save_on_cpu@2" and io["points"][-1]["error"].startswith("Terminated")


def _saves_then_waits(args, save):
    """A step that saves a partial result, then waits to be stopped (for the signal test)."""
    save({"status": "running", "points": [{"name": "keep@1", "ok": True}]})
    time.sleep(120)
    return {"status": "pass"}


def test_sigterm_to_a_steps_process_leaves_what_it_saved_and_where_it_stopped(tmp_path):
    """A real child process, stopped by SIGTERM (what the parent's limit sends) once it has
    saved: its JSON keeps the points, says "error" and how it was stopped, with the
    traceback. Without the child's handler SIGTERM ends it where it stands, "running"."""
    out = tmp_path / "res"
    code = ("import sys, dataclasses; from ssdtrain_megatron.tools.gpucheck import gpu_check, gpu_perf; "
            f"args = gpu_perf.parse_args(['--out', {str(out)!r}, '--scratch', {str(tmp_path / 'scratch')!r}, "
            "'--child', 'perf']); "
            "args.suite = dataclasses.replace(args.suite, run_step='tests.test_gpu_results_kept:_saves_then_waits'); "
            "sys.exit(gpu_check.child(args))")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    path = out / "steps" / "perf.json"
    deadline = time.monotonic() + 120
    while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # the child's first save is the event waited for
    assert path.exists(), proc.communicate()[0] if proc.poll() is not None else "no save in 120 s"
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=60)[0]
    saved = json.loads(path.read_text())
    assert proc.returncode == 1, output
    assert saved["points"] == [{"name": "keep@1", "ok": True}] and saved["status"] == "error", saved
    assert saved["why"].startswith("Terminated: signal 15") and "_saves_then_waits" in saved["traceback"]


class FakeProc:
    """A step's process that saved a partial result and never ends by itself: its waits time
    out, each recorded; SIGTERM and SIGKILL are recorded too (os.killpg patched)."""

    def __init__(self, cmd, **kw):
        self.pid, self.waits = 4242, []
        out = cmd[cmd.index("--out") + 1]
        name = cmd[cmd.index("--child") + 1]
        with open(os.path.join(out, "steps", f"{name}.json"), "w") as f:
            json.dump({"status": "running", "points": [{"name": "keep@2", "ok": False, "error": "x"}]}, f)
        FakeProc.last = self

    def wait(self, timeout=None):
        self.waits.append(timeout)
        raise subprocess.TimeoutExpired("step", timeout)


def test_a_step_over_its_limit_is_killed_within_the_limit_and_keeps_what_it_saved(tmp_path, monkeypatch):
    """The parent's whole kill path (the wait, SIGTERM, its wait, SIGKILL, its wait) adds up to
    the step's limit at most; the step's result is what it saved, marked "timeout", and the
    table shows its points. The child's own deadline comes before the SIGTERM."""
    sent = []
    monkeypatch.setattr(gpu_check.subprocess, "Popen", FakeProc)
    monkeypatch.setattr(gpu_check.os, "killpg", lambda pid, sig: sent.append(sig))
    args = gpu_check.parse_args(["--out", str(tmp_path / "res"), "--scratch", str(tmp_path / "scratch")])
    os.makedirs(os.path.join(args.out, "logs"))
    limit = 60
    out = gpu_check.run_child(args, "measure", {"PATH": os.environ["PATH"]}, limit)
    proc = FakeProc.last
    assert sent == [signal.SIGTERM, signal.SIGKILL]
    assert sum(proc.waits) <= limit and proc.waits[0] == limit - gpu_check_plan.KILL_GRACE_S, proc.waits
    assert out["status"] == "timeout" and out["points"] == [{"name": "keep@2", "ok": False, "error": "x"}]
    res = gpu_check.Results(args.out, {}, gpu_check.CHECK)
    res.step("measure", out)
    assert f"\n{'keep@2':<22}  x" in (tmp_path / "res" / "table.txt").read_text()


# -- time shared by estimate ---------------------------------------------------------------------

def test_each_points_reserve_is_its_own_estimate_so_short_points_at_the_end_still_run(tmp_path, monkeypatch):
    """A point starts when what is left holds its own estimate (and the slack), not a fixed
    20 s: with 8 s left, a point estimated at 1.4 s runs and one at 31 s does not, saying how
    much it needed; a rate likewise; a point the plan does not know keeps the old 20 s."""
    args = gpu_perf.parse_args(["--out", str(tmp_path / "res"), "--scratch", str(tmp_path / "scratch")])
    os.makedirs(args.scratch)
    m = gpu_check_measure.Measure.__new__(gpu_check_measure.Measure)
    m.args, m.until, m.per_sample, m.registers, m.host_ram = args, None, None, True, 1 << 40
    m.estimates = {"recompute@2": 1.4, "offload-posix@2": 31.2, "drive": 5.0}
    m.ran, m.result = [], {}  # nothing ran yet: the estimates at the plan's pace (tests/test_gpu_time.py)
    monkeypatch.setenv("GPU_CHECK_DEADLINE", str(time.time() + 8))
    assert m._skip(2, "keep", "posix", {}, "recompute@2") is None
    why = m._skip(2, "offload", "posix", {}, "offload-posix@2")
    assert why.startswith("not run: out of time (") and "its estimate needs 33s" in why, why
    assert m.reserve("drive") == 5.0 + gpu_check_measure.RESERVE_SLACK_S
    assert m.reserve("keep@9") == gpu_check_measure.UNPLANNED_RESERVE_S
    shape = gpu_perf_step.SHAPES["io-bound"]
    est = gpu_check_plan.points_estimate(shape, gpu_check_plan.point_plan(
        shape, [("keep", 2, None), ("offload-posix", 2, "posix")], 5))
    r = gpu_check_plan.reserves(est)
    assert set(r) == {"keep@2", "offload-posix@2", "link", "drive", "drive_raw"} and r["drive"] > 0 and r["link"] == 0


def test_the_plan_is_checked_on_both_cards_and_names_the_one_it_assumed(tmp_path):
    """`GPU_CHECK_DRY=1 make gpu-perf`: a line per lent card (H100 80 GB, the assumed one, and
    H200 141 GB) with each shape's memory against the card's; the backend's first step in the
    compute-bound shape's estimate; a shape too large for the H100 makes the plan not fit."""
    proc = subprocess.run(["make", "-s", "-C", ROOT, "gpu-perf", f"PYTHON={sys.executable}",
                           f"GPU_PERF_ARGS=--out {tmp_path / 'res'} --scratch {tmp_path / 'scratch'}"], env=dict(os.environ, GPU_CHECK_DRY="1"),
                          capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "    H100 80 GB (assumed): io-bound " in proc.stdout and "    H200 141 GB: io-bound " in proc.stdout
    assert f"attention kernel       {gpu_check_plan.ASSUME['sdpa_first_s']:.1f}s" in proc.stdout
    plan = json.loads((unpacked(tmp_path / "res", "gpu-perf") / "plan.json").read_text())
    assert plan["card_assumed"] == "H100 80 GB" and set(plan["cards"]) == {"H100 80 GB", "H200 141 GB"}
    big = dict(gpu_perf_step.SHAPES["compute-bound"], layers=15)  # 19 B parameters: 152 GB of state
    fits, lines = gpu_check_plan.card_check({"big": (big, 1, 0)})
    assert not fits and all("does NOT fit" in line for line in lines)
    fits, lines = gpu_check_plan.card_check({"big": (dict(big, layers=4), 1, 0)})  # 42 GB: both
    assert fits


def test_a_step_whose_estimate_runs_into_its_kill_path_does_not_fit():
    """A step in its own process must fit its estimate before its SIGTERM (KILL_GRACE_S before
    the limit); the parent's own pip step has no kill path."""
    from ssdtrain_megatron.tools.gpucheck import gpu_perf_plan

    args = gpu_perf.parse_args(["--out", "unused"])
    est = gpu_perf_plan.estimates(args)
    lines = []

    def plan(perf_limit):
        steps = [{"step": "install", "timeout_s": int(est["install"]["total"]) + 1, "what": ""},
                 {"step": "perf", "timeout_s": perf_limit, "what": ""}]
        lines.clear()
        return gpu_check_plan.print_steps(args, steps, lines.append, est, 0, [])

    inside = int(est["perf"]["total"]) + 1 + gpu_check_plan.KILL_GRACE_S
    assert plan(inside) and not any("OVER" in line for line in lines)
    assert not plan(inside - 2) and any("perf" in line and "OVER" in line for line in lines)


def test_megatron_runtime_exit_tries_every_part_and_keeps_the_exception_in_flight(monkeypatch):
    """After a sticky CUDA error NCCL's teardown raises too: leaving the runtime then must not
    replace the step's exception, and must still undo the rest (the process group, the CPU
    runtime); with nothing in flight, the teardown's own error is raised once all ran."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    real = parallel_state.destroy_model_parallel

    def broken():
        real()  # what it undoes is undone; then it raises, as NCCL's teardown does after the error
        raise RuntimeError("NCCL error: unhandled cuda error")

    monkeypatch.setattr(parallel_state, "destroy_model_parallel", broken)
    with pytest.raises(torch.cuda.OutOfMemoryError, match="the step's own"):
        with MegatronRuntime():
            raise torch.cuda.OutOfMemoryError("the step's own")
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="NCCL error"):
        with MegatronRuntime():
            pass
    assert not dist.is_initialized()
