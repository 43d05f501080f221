"""Every step of `make gpu-check` runs its own code here, on the CPU, before a GPU box ever runs
it (issue 38, 1.1): the steps' GPU calls go through a box (ssdtrain_megatron/tools/gpucheck/gpu_check_common.py), which
this test replaces with stand-ins: the recording streams of tests/recording_streams.py for the
offloaders (so the copy layer, staging pools and events are the real code, on a CPU device),
host callables for the compute-stream sleeps, the stand-in's own streams for the side stream,
counters for memory. megatron-core, the offloader, the engines and the files are real; kvikio
is tests/fake_kvikio.py (the gds steps, direct and compat). Shapes are shrunk (the code is
what is checked, not the numbers); each step's result must be what the step reports on
success, and every recorder's log must order every reuse of a staging block or pool extent
after the copies that used it (tests/test_staging_race.py) and the release of each pinned
pool after its last copy.

Before the fix of issue 38, 1.1 the bitwise-memory and bitwise-tiered steps failed here with
``TypeError: counting_stage_out() takes 2 positional arguments but 4 were given``: the check's
wrapper of ``DeviceCopy.stage_out`` did not take the pool view the memory engine passes.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import json
import os
import sys
from typing import List

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from ssdtrain_megatron.tools.gpucheck import gpu_check  # noqa: E402
from ssdtrain_megatron.tools.gpucheck import gpu_check_common  # noqa: E402
from ssdtrain_megatron.tools.gpucheck import gpu_check_cuda  # noqa: E402
from ssdtrain_megatron.tools.gpucheck import gpu_check_steps  # noqa: E402
from ssdtrain_megatron.tools.gpucheck import gpu_check_plan  # noqa: E402
from ssdtrain_megatron.tools.gpucheck import gpu_check_targets  # noqa: E402
from ssdtrain_megatron.tools.minigpt import GPTSpec  # noqa: E402
from tests import fake_kvikio  # noqa: E402
from tests.recording_streams import Recorder, overlaps  # noqa: E402
from tests.test_staging_race import check_staging_reuse  # noqa: E402

TINY = dict(layers=2, hidden=64, heads=4, seq=32, vocab=128, micro_batch=2, num_microbatches=2)
# The stress's own settings (16 KiB and up offloaded): megatron's split QKV views are that big here.
TINY_STRESS = dict(TINY, hidden=128, seq=64)


class StandInBox(gpu_check_common.CudaBox):
    """The box on a CPU: one recording stand-in per offloader, sleeps counted on the host."""

    def __init__(self) -> None:
        self.recorders: List[Recorder] = []
        self.sleeps = 0
        self.pools: List[tuple] = []  # (recorder, the staging pool's byte range)

    def streams(self):
        rec = Recorder()
        self.recorders.append(rec)
        return rec

    def sleeper(self, cycles):
        def sleep():
            self.sleeps += 1
        return sleep

    def side_stream(self, device):
        rec = self.recorders[-1]  # the offloader's: its current stream becomes the side stream
        side = rec.new_stream(device, "side")
        done = rec.new_event()
        done.record(rec.current_stream(device))
        side.wait_event(done)
        return lambda: rec.use(side)

    @contextlib.contextmanager
    def sync_debug(self):
        """The training thread's event synchronisations, as torch's sync debug mode would flag
        host waits."""
        marks = [len(r.log) for r in self.recorders]
        found: List[str] = []
        yield found
        for r, start in zip(self.recorders, marks):
            found += [f"{n}" for n in r.log[start:] if n.kind == "synchronize" and n.thread == "MainThread"]

    def total_memory(self, device):
        return 1 << 40

    def set_fraction(self, fraction, device):
        pass

    def empty_cache(self):
        pass

    def reset_peak(self, device):
        pass

    def peak(self, device):
        return 3 << 20, 4 << 20

    def now(self, device):
        return 1 << 20, 2 << 20

    def stream_ops(self):
        return self.streams()  # logged, and its copies' ordering checked, with the offloaders'

    def timing_ops(self, streams):
        return streams if streams is not None else Recorder()

    def synchronize(self, device):
        pass

    def registration_works(self):
        return True


def test_the_stand_in_box_replaces_every_gpu_call_of_the_real_one():
    """No step can reach real CUDA here through a method the stand-in forgot."""
    real = {n for n, f in inspect.getmembers(gpu_check_common.CudaBox, inspect.isfunction) if not n.startswith("_")}
    mine = {n for n in real if getattr(StandInBox, n) is not getattr(gpu_check_common.CudaBox, n)}
    assert mine == real, f"not replaced: {sorted(real - mine)}"


@pytest.fixture
def shrunk(monkeypatch, tmp_path):
    """Tiny shapes and step counts in every step; the args the parent gives a child."""
    monkeypatch.setattr(gpu_check_steps, "BITWISE_SPEC", GPTSpec(**TINY))
    monkeypatch.setattr(gpu_check_steps, "STRESS_SPEC", GPTSpec(**TINY_STRESS))
    monkeypatch.setattr(gpu_check_steps, "BITWISE_STEPS", 2)
    monkeypatch.setattr(gpu_check_steps, "STRESS_STEPS", 3)
    monkeypatch.setattr(gpu_check_steps, "bitwise_settings", _tiny_settings)
    args = gpu_check.parse_args(["--out", str(tmp_path / "res"), "--scratch", str(tmp_path / "scratch"), "--layers", "2", "--hidden", "64", "--heads", "4",
                                 "--seq", "32", "--vocab", "128", "--micro-batch", "1", "--steps", "1"])
    os.makedirs(args.scratch)
    return args


def _tiny_settings(engine):
    """The bitwise steps' settings at the tiny shape: the same rules, small tensors offloaded."""
    from ssdtrain_megatron.tools.gpucheck.gpu_check_plan import bitwise_settings

    kw = bitwise_settings(engine)
    kw["min_tensor_bytes"] = 1024
    if engine == "memory":
        kw["host_memory_bytes"] = 8 << 20
    return kw


def _run(args, name, box):
    args.child = name
    saved = []
    result = gpu_check_steps.run_step(args, saved.append, box)
    json.dumps(result, default=str)  # what the child writes must serialise
    return result


def _check_ordering(box: StandInBox) -> int:
    """Every recorder: each reuse of staging memory ordered after the copies that used it, and
    the staging pool released only after them. Returns how many recorders logged copies."""
    used = 0
    for rec in box.recorders:
        copies = rec.nodes("copy")
        if not copies:
            continue
        used += 1
        unpins = rec.nodes("unpin")
        assert unpins, "a staging pool was never released (no unpin logged)"
        for unpin in unpins:
            pool = unpin.tags["ptr"]
            check_staging_reuse(rec, pool)
            for c in copies:
                if overlaps(c.tags["dst"], pool) or overlaps(c.tags["src"], pool):
                    assert rec.happens_before(c, unpin), f"pinned pool released before {c}"
    return used


@pytest.mark.parametrize("engine", ["posix", "memory", "tiered"])
def test_a_bitwise_step_runs_through_the_copy_layer_and_passes(shrunk, engine):
    box = StandInBox()
    result = _run(shrunk, f"bitwise-{engine}", box)
    assert result["status"] == "pass", result
    assert result["steps_run"] == 2 and result["bytes_read"] > 0 and result["tensors_staged"] > 0
    assert box.sleeps == result["compute_delays"]["forward"] + result["compute_delays"]["backward"] > 0
    gc.collect()
    assert _check_ordering(box) == 1
    rows = {r["target"]: r for r in gpu_check_targets.targets({f"bitwise-{engine}": result})}
    assert rows[f"bitwise {engine}: keep == offload, compute stream delayed"]["result"] == "PASS"


@pytest.mark.parametrize("compat", [False, True], ids=["direct", "compat"])
def test_the_gds_steps_run_each_in_its_own_mode(shrunk, monkeypatch, compat):
    """bitwise-gds runs only where kvikio does GPUDirect Storage (else NOT RUN, saying why);
    bitwise-gds-compat runs the compat path. With kvikio's stand-in here."""
    fake_kvikio.install(monkeypatch, compat=compat)
    box = StandInBox()
    direct = _run(shrunk, "bitwise-gds", box)
    compat_run = _run(shrunk, "bitwise-gds-compat", StandInBox())
    rows = {r["target"]: r for r in gpu_check_targets.targets({"bitwise-gds": direct, "bitwise-gds-compat": compat_run})}
    d, c = rows["bitwise gds (GPUDirect Storage): keep == offload"], rows["bitwise gds-compat (kvikio compat mode): keep == offload"]
    if compat:
        assert direct["status"] == "not run" and "compat mode" in direct["why"], direct
        assert d["result"] == "NOT RUN" and "GPUDirect Storage cannot be exercised" in d["detail"]
        assert compat_run["status"] == "pass" and compat_run["kvikio_mode"] == "compat", compat_run
        assert c["result"] == "PASS"
    else:
        assert direct["status"] == "pass" and direct["kvikio_mode"] == "direct", direct
        assert d["result"] == "PASS"
        # KVIKIO_COMPAT_MODE=ON is kvikio's to honour; the stand-in ignores it, and the row says so
        assert c["result"] == "NOT RUN" and "not compat" in c["detail"], c


def test_the_stress_step_runs_on_a_side_stream_with_compact_views(shrunk):
    box = StandInBox()
    result = _run(shrunk, "stress", box)
    assert result["status"] == "pass", result
    assert result["compact_tensors"] > 0 and result["steps_run"] == 3
    side = [n for r in box.recorders for n in r.log if n.agent == "side" and n.kind == "record"]
    assert side, "no producer event was recorded on the side stream"
    gc.collect()
    assert _check_ordering(box) == 1


def test_the_syncs_step_counts_training_thread_waits(shrunk):
    result = _run(shrunk, "syncs", StandInBox())
    assert result["status"] == "pass" and result["offload_syncs"] == 0, result


def test_the_env_and_imports_steps_run(shrunk):
    box = StandInBox()
    env = _run(shrunk, "env", box)
    assert env["status"] == "fail" and "is_available() is False" in env["why"]
    assert _run(shrunk, "imports", box)["status"] == "pass"


def test_the_measure_step_measures_every_point_and_the_targets_read_them(shrunk, monkeypatch):
    """Every point runs through the real offloaders and engines, the bounds' rates are measured
    through the stand-in's streams (the link) and the posix engine (the drive), each point's
    last timed step is a trace on disk, and every point at K gets its bound, its stall beyond
    the IO deficit and its breakdown."""
    from ssdtrain_megatron.tools.gpucheck import gpu_check_measure

    monkeypatch.setattr(gpu_check_measure, "MIN_TENSOR_BYTES", 1024)  # the tiny shape's tensors
    shrunk.steps = 2
    box = StandInBox()
    result = _run(shrunk, "measure", box)
    assert result["status"] == "pass", result
    points = {p["name"]: p for p in result["points"]}
    assert list(points) == ["keep@1", "offload-memory@1", "offload-posix@1", "recompute@1", "keep@2",
                            "recompute@2", "adaptive@2"]
    bad = {n: p.get("error") for n, p in points.items() if not p.get("ok")}
    assert not bad, bad
    # Settled within the warm-up cap: its timed steps measure the plan it chose.
    assert points["adaptive@2"]["settled"] is True, points["adaptive@2"]
    assert points["adaptive@2"]["warmup_steps"] <= gpu_check_plan.ADAPTIVE_SETTLE_CAP
    assert points["offload-posix@1"]["bytes_read"] > 0 and points["offload-posix@1"]["steps_timed"] == 2
    assert points["offload-memory@1"]["pinned_bytes"] > 0 and points["keep@1"]["activation_reserved"] == 2 << 20
    rates = result["rates"]
    assert {"d2h", "h2d", "both"} <= set(rates["link"]) and rates["drive"]["bytes_read"] > 0, result
    assert result["record_sizes"]["records"] > 0
    for name in ("offload-memory@1", "offload-posix@1", "recompute@1"):
        p = points[name]
        assert p["bound"]["formula"] and "stall_beyond_fraction" in p and p["breakdown"]["parts"], p
        trace = json.load(open(p["trace"]["path"]))
        assert trace["otherData"]["point"] == name
        assert {"step", "optimizer"} <= {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert points["offload-posix@1"]["bound"]["resource"] in ("drive", "compute")
    assert points["recompute@1"]["bound"]["formula"] == "keep"
    rows = {r["step"] + r["target"]: r for r in gpu_check_targets.targets({"measure": result})}
    assert all(r["result"] == "NOT RUN" and "of at least 5 timed steps" in r["detail"]
               for r in rows.values() if r["target"].startswith(("host stall", "overlap", "peak"))), rows
    gc.collect()
    assert _check_ordering(box) >= 3


def test_the_cuda_tests_step_runs_pytest_once_and_fails_on_a_skipped_required_test(shrunk, monkeypatch):
    """The real step, narrowed to one file: its one cuda test skips here (no CUDA), and a
    required test that skips is a failure that names it and the reason."""
    monkeypatch.setattr(gpu_check_cuda, "REQUIRED_FILES", ["tests/test_pinned.py"])
    monkeypatch.setattr(gpu_check_cuda, "REQUIRED_TESTS",
                        ["tests/test_pinned.py::test_cuda_exactly_pinned_memory_is_pinned_and_copies_asynchronously"])
    result = _run(shrunk, "cuda-tests", StandInBox())
    assert result["status"] == "fail", result
    assert result["ran"] == 1 and "skipped" in result["why"] and "needs a CUDA device" in result["why"], result
