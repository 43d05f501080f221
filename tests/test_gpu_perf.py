"""`make gpu-perf` (ssdtrain_megatron/tools/gpucheck/gpu_perf*.py) on a machine without a GPU:
the time plan, the measure step with both shapes and torch's save_on_cpu through the CPU
stand-in, the model's prediction, the targets (the compute-bound shape's SDPA attention:
tests/test_gpu_sdpa.py). What only a GPU shows (real asynchrony, the rates, the memory figures)
is the GPU run's."""

from __future__ import annotations

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from ssdtrain_megatron.tools.minigpt import GPTSpec, MegatronRuntime  # noqa: E402


@pytest.fixture
def runtime():
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    with MegatronRuntime() as rt:
        model_parallel_cuda_manual_seed(1234, force_reset_rng=True)  # the dropout's RNG (megatron's fork)
        yield rt



import json  # noqa: E402
import subprocess  # noqa: E402

from ssdtrain_megatron.tools.gpucheck import gpu_check_measure  # noqa: E402
from ssdtrain_megatron.tools.gpucheck import gpu_perf  # noqa: E402
from ssdtrain_megatron.tools.gpucheck import gpu_perf_plan  # noqa: E402
from ssdtrain_megatron.tools.gpucheck import gpu_perf_step  # noqa: E402
from ssdtrain_megatron.tools.gpucheck import gpu_perf_targets  # noqa: E402
from tests.test_gpu_archive import unpacked  # noqa: E402

TARGETS = [t[0] for t in gpu_perf_targets.TARGETS]


def _make(tmp_path, dry, args=""):
    env = dict(os.environ, GPU_CHECK_DRY="1" if dry else "0")
    return subprocess.run(["make", "-s", "-C", ROOT, "gpu-perf", f"PYTHON={sys.executable}",
                           f"GPU_PERF_ARGS=--out {tmp_path / 'res'} --scratch {tmp_path / 'scratch'} {args}"],
                          env=env, capture_output=True, text=True, timeout=300)


def test_the_plan_fits_198_s_and_prints_every_points_estimate(tmp_path):
    """`GPU_CHECK_DRY=1 make gpu-perf`: each step's limit and estimate, each point's steps x
    (compute + bytes moved) + registration, the limits within 198 s less the parent's share.
    Fails when a point is added or the shapes grown past their slots."""
    proc = _make(tmp_path, dry=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    args = gpu_perf.parse_args([])
    est = gpu_perf_plan.estimates(args)
    for name, limit, *_ in gpu_perf_plan.STEPS:
        assert f"{name:<19} limit {limit:>4}s  estimate {est[name]['total']:>5.0f}s  (" in proc.stdout
        assert est[name]["total"] <= limit
    assert sum(s[1] for s in gpu_perf_plan.STEPS) + gpu_perf_plan.PARENT_S <= gpu_perf_plan.TOTAL_S == 198
    for shape in gpu_perf_plan.SHAPES.values():
        k = shape["micro_batch"]
        for point, _ in gpu_perf_plan.STRATEGIES:
            assert f"  {point}@{k}".ljust(24) in proc.stdout and "steps x (" in proc.stdout
    assert "the plan fits" in proc.stdout
    # each shape's activation-peak floor beside its target
    assert ("io-bound: 8 layers" in proc.stdout and "activation-peak target 0.7x keep's; floor at 500 TFLOP/s, link "
            "50 GB/s, drive 2 GB/s: memory 0.56 (1 kept + 3.5 read ahead (the byte cap) of 8 layers") in proc.stdout
    assert "activation-peak target 0.8x keep's; floor at 500 TFLOP/s, link 50 GB/s, drive 2 GB/s: memory 0.50 (1 " \
           "kept + 2 read ahead of 6 layers" in proc.stdout  # the regime's floor per card: tests/test_gpu_regime.py
    res = unpacked(tmp_path / "res", "gpu-perf")
    plan = json.loads((res / "plan.json").read_text())
    assert plan["dry_run"] and plan["steps_per_point"] == 5 and set(plan["shapes"]) == {"io-bound", "compute-bound"}
    assert sorted(os.listdir(res)) == ["plan.json"]  # nothing ran


def test_the_two_shapes_sit_on_either_side_of_the_papers_regime():
    """A layer's compute against its bytes over the link at 500 TFLOP/s and 50 GB/s: >= 10,000
    FLOP per saved byte is the paper's (compute-bound) regime."""
    from ssdtrain_megatron.tools.gpucheck.gpu_check_plan import parameters

    io, compute = (gpu_perf_plan.flop_per_saved_byte(gpu_perf_plan.SHAPES[n]) for n in ("io-bound", "compute-bound"))
    assert io < 10_000 <= compute
    # with the local spec's attention the compute shape would be IO-bound again (about 6,700 at seq 2048)
    unfused = dict(gpu_perf_plan.SHAPES["compute-bound"], attention="local", seq=2048)
    assert gpu_perf_plan.flop_per_saved_byte(unfused) < 10_000
    assert 8 * parameters(gpu_perf_plan.SHAPES["compute-bound"]) < 0.5 * 141e9  # fits an H200


def test_the_peak_floor_is_the_offloaders_own_window_and_config():
    """The plan's floor reads ahead as plan/readahead.py does, with OffloadConfig's defaults
    (the parent imports neither: the figures are copied, and must agree)."""
    from ssdtrain_megatron import OffloadConfig
    from ssdtrain_megatron.plan.readahead import BACKWARD_PER_FORWARD, readahead_layers

    cfg = OffloadConfig()
    assert (gpu_perf_plan.KEEP_LAST_LAYERS, gpu_perf_plan.PREFETCH_LAYERS) == (cfg.keep_last_layers, cfg.prefetch_layers)
    assert gpu_perf_plan.READAHEAD_CAP["memory"] == cfg.max_inflight_bytes
    assert gpu_perf_plan.BACKWARD_SHARE == pytest.approx(BACKWARD_PER_FORWARD / (1 + BACKWARD_PER_FORWARD))
    for size in (0, 1e6, 5e7, 3e8):
        for read in (1e9, 2e10, 5e10):
            for backward in (1e-4, 1e-3, 4e-3):
                for layers in (1, 6, 16):
                    assert gpu_perf_plan.readahead_window(size, read, backward, layers) == \
                        readahead_layers(cfg.prefetch_layers, size, read, backward, layers)
    # 16 layers, reads 2 ms, backward 1 ms: 3 ahead, the last kept: 4 of 16
    f = gpu_perf_plan.peak_floor(16, 1e8, 5e10, 1e-3, 1 << 30)
    assert (f["floor"], f["ahead"], f["by"]) == (0.25, 3, "time")
    f = gpu_perf_plan.peak_floor(8, 3e8, 2e9, 1e-3, 1 << 30)  # the byte cap holds 3.6 layers of the 8 by time
    assert f["by"] == "byte cap" and f["floor"] == pytest.approx((1 + (1 << 30) / 3e8) / 8)
    assert gpu_perf_plan.peak_floor(4, 1e8, 1e9, 1e-3, 1 << 30)["floor"] == 1.0  # all ahead but the kept one


def test_each_shape_can_reach_its_peak_target_with_margin_on_an_h100():
    """The read-window floors sit 0.1 or more under each target (the compute-bound shape's
    whole floor, forward side and weight-gradient temporary included, is
    tests/test_gpu_regime.py's), the IO-bound one's byte-capped floor 0.1 under its 0.7; the
    compute-bound shape's weights, gradients and Adam state and its activations fit an H100's
    80 GB with room to spare."""
    from ssdtrain_megatron.tools.gpucheck.gpu_check_plan import activation_bytes, parameters

    for name, shape in gpu_perf_plan.SHAPES.items():
        floor = gpu_perf_plan.nominal_floors(shape)["memory"]["floor"]
        assert floor <= gpu_perf_plan.PEAK_MAX[name] - 0.1 + 1e-9, (name, floor)
    assert gpu_perf_plan.nominal_floors(gpu_perf_plan.SHAPES["compute-bound"])["memory"]["floor"] <= 0.5
    assert gpu_perf_plan.nominal_floors(gpu_perf_plan.SHAPES["io-bound"])["posix"]["floor"] <= gpu_perf_plan.PEAK_MAX[
        "io-bound"] - 0.1
    compute = gpu_perf_plan.SHAPES["compute-bound"]
    assert 8 * parameters(compute) + 2 * activation_bytes(compute) < 0.8 * 80e9


def test_the_floor_at_the_boxs_rates_takes_keeps_layers_and_the_engines_read_rate():
    """8 layers of 200 MB, a forward of 1 ms on the compute stream (backward 2 ms): at 25 GB/s
    a read takes 8 ms, 5 layers ahead by time: (1 + 5) / 8. The drive at 1 GB/s would want all
    7, the 1 GiB cap holds 5.4."""
    from ssdtrain_megatron.tools.gpucheck.gpu_perf_model import floors
    from ssdtrain_megatron.telemetry.stats import LayerStats, StepStats

    rows = tuple(LayerStats(layer=str(i), bytes=200_000_000, bytes_offloaded=0, tensors=3, decision="keep",
                            io_wait_s=0, forward_s=0.5) for i in range(8))  # the host's clock: launches only
    stats = StepStats(step=1, bytes_offloaded=0, bytes_read=0, bytes_deduplicated=0, tensors_offloaded=0,
                      tensors_passed_through=0, tensors_kept=24, tensors_forwarded=0, io_wait_s=0.0,
                      peak_resident_bytes=0, write_gbps=0.0, read_gbps=0.0, bytes_on_disk=0, fallbacks=0,
                      step_time_s=0.1, layers=rows)
    gpu = [{"pid": "gpu", "tid": "compute", "cat": "layer", "ph": "X", "name": f"forward layer {i}", "ts": 0.0,
            "dur": 1000.0} for i in range(8)]
    got = floors(stats, gpu, {"link": {"h2d": 25e9, "d2h": 25e9, "both": 40e9}, "drive": {"read": 1e9, "write": 1e9}})
    assert (got["memory"]["ahead"], got["memory"]["floor"], got["memory"]["by"]) == (5, 0.75, "time")
    assert got["posix"]["by"] == "byte cap" and got["posix"]["floor"] == pytest.approx((1 + (1 << 30) / 2e8) / 8)
    assert set(floors(stats, gpu, {"link": None, "drive": {"read": 1e9}})) == {"posix"}


@pytest.mark.parametrize("argv", [["--total-s", "150"], ["--steps", "20"]], ids=["limits-over-the-total", "too-many-steps"])
def test_dry_run_fails_when_the_plan_does_not_fit(tmp_path, argv):
    proc = subprocess.run([sys.executable, "-m", "ssdtrain_megatron.tools.gpucheck.gpu_perf", "--dry-run", "--out",
                           str(tmp_path / "res")] + argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "the plan does NOT fit" in proc.stdout


@pytest.mark.parametrize("argv, message", [(["--only", "perf-gpu"], "--only: unknown step(s) perf-gpu"),
                                           (["--steps", "0"], "argument --steps: 0 must be >= 1")])
def test_bad_flags_fail_in_one_line_before_anything_runs(tmp_path, argv, message):
    proc = subprocess.run([sys.executable, "-m", "ssdtrain_megatron.tools.gpucheck.gpu_perf", "--out",
                           str(tmp_path / "res")] + argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "res").exists()


def test_make_gpu_perf_without_the_bundle_lists_every_target_not_run_and_fails(tmp_path):
    """No wheels here: install is not run, nothing after it runs, every row says why."""
    os.makedirs(tmp_path / "nowheels")
    proc = _make(tmp_path, dry=False, args=f"--wheels {tmp_path / 'nowheels'}")
    assert proc.returncode != 0 and "gpu-perf] Error 1" in proc.stderr, proc.stdout + proc.stderr
    data = json.loads((unpacked(tmp_path / "res", "gpu-perf") / "gpu-perf.json").read_text())
    assert [t["target"] for t in data["targets"]] == TARGETS
    for t in data["targets"]:
        assert t["result"] == "NOT RUN" and "no wheels in" in t["detail"], t
    assert f"0 of {len(TARGETS)} targets PASS, 0 FAIL, {len(TARGETS)} NOT RUN" in proc.stdout


def test_the_parent_imports_nothing_of_the_package_and_shares_its_figures():
    """The box's bare python runs the parent: no torch, and of the package only what needs
    nothing beyond the standard library (its ``__init__``, config, the gpucheck folder); the
    figures its labels quote are the package's."""
    code = ("import sys; from ssdtrain_megatron.tools.gpucheck import gpu_perf; "
            "ok = ('ssdtrain_megatron', 'ssdtrain_megatron.config', 'ssdtrain_megatron.config_checks', "
            "'ssdtrain_megatron.sizes', 'ssdtrain_megatron.tools', 'ssdtrain_megatron.tools.gpucheck'); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m.split('.')[0] == "
            "'ssdtrain_megatron' and m not in ok and not m.startswith('ssdtrain_megatron.tools.gpucheck.')); "
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    from ssdtrain_megatron.telemetry.breakdown import TYPICAL, UNEXPLAINED_MAX

    assert (gpu_perf_targets.TYPICAL, gpu_perf_targets.UNEXPLAINED_MAX) == (TYPICAL, UNEXPLAINED_MAX)


# -- the steps through the CPU stand-in ------------------------------------------------------

TINY_SHAPES = {
    "io-bound": dict(layers=2, hidden=64, heads=4, seq=64, vocab=128, micro_batch=2, num_microbatches=1,
                    attention="local"),
    "compute-bound": dict(layers=2, hidden=128, heads=4, seq=32, vocab=128, micro_batch=1, num_microbatches=1,
                         attention="sdpa"),
}


@pytest.fixture
def perf_args(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_perf_step, "SHAPES", TINY_SHAPES)
    monkeypatch.setattr(gpu_check_measure, "MIN_TENSOR_BYTES", 1024)  # the tiny shapes' tensors
    args = gpu_perf.parse_args(["--out", str(tmp_path / "res"), "--scratch", str(tmp_path / "scratch")])
    os.makedirs(args.scratch)
    return args


def test_both_shapes_run_every_strategy_save_on_cpu_included_through_the_stand_in(perf_args, monkeypatch):
    """Each shape's step as the GPU box runs it, with the stand-in box (tests/test_gpu_check_steps.py):
    every strategy measured on 5 timed steps, the bounds' rates measured, each point's
    last step a well-formed trace under 2 MB, each point at K judged against its bound with
    its excess split by cause, the planner's prediction beside the offload and recompute
    points with the box's measured figures, and every target row judged from it (PASS or
    FAIL: the numbers of a CPU mean nothing)."""
    import gc

    from ssdtrain_megatron.tools.gpucheck import gpu_check_sdpa
    from ssdtrain_megatron.tools.gpucheck.gpu_check_plan import OVERFLOW_STAGING
    from tests.test_gpu_check_steps import StandInBox, _check_ordering
    from tests.test_timeline import _well_formed

    used = {"save_on_cpu": [], "sdpa": 0}
    real_soc, real_sdpa = torch.autograd.graph.save_on_cpu, gpu_check_sdpa.SDPAttention.forward

    def save_on_cpu(**kw):
        used["save_on_cpu"].append(kw)
        return real_soc(**kw)

    def sdpa(self, *a, **kw):
        used["sdpa"] += 1
        return real_sdpa(self, *a, **kw)

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", save_on_cpu)
    monkeypatch.setattr(gpu_check_sdpa.SDPAttention, "forward", sdpa)
    perf_args.child = "perf"
    box = StandInBox()
    saved = []  # as the child writes them: serialised at once
    result = gpu_perf_step.run_step(perf_args, lambda r: saved.append(json.loads(json.dumps(r, default=str))), box)
    json.dumps(result, default=str)
    assert result["status"] == "pass", result
    assert [list(r["shapes"]) for r in saved][:2] == [["io-bound"], ["io-bound"]]  # saved as it goes
    for name, shape in TINY_SHAPES.items():
        r = result["shapes"][name]
        assert r["status"] == "pass", r
        k = shape["micro_batch"]
        points = {p["name"]: p for p in r["points"]}
        assert list(points) == [f"{n}@{k}" for n, _ in gpu_perf_plan.STRATEGIES]
        assert all(p["ok"] and p["steps_timed"] == 5 for p in points.values()), points
        soc = points[f"save_on_cpu@{k}"]
        assert soc["engine"] is None and soc["bound"]["formula"] == "keep" and "breakdown" in soc
        assert points[f"adaptive@{k}"]["settled"] is True and points[f"adaptive@{k}"]["engine"] == "memory"
        for p in points.values():
            trace = json.load(open(p["trace"]["path"]))
            _well_formed(trace)
            assert p["trace"]["bytes"] <= 2 << 20 and trace["otherData"]["point"] == p["name"]
            assert f"/traces/{name}/" in p["trace"]["path"]
            assert any(e["ph"] == "X" and e["name"] == "step" for e in trace["traceEvents"])
        link = r["rates"]["link"]
        model = r["model"]
        assert model["node"]["link_gbps"] == pytest.approx(min(link["d2h"], link["h2d"]) / 1e9)
        assert model["node"]["host_bytes"] == points[f"offload-memory@{k}"]["pinned_bytes"] - OVERFLOW_STAGING
        assert {f"offload-memory@{k}", f"offload-posix@{k}", f"recompute@{k}"} <= set(model["points"])
        assert f"save_on_cpu@{k}" not in model["points"]  # none of the planner's places
        # the peak floor at this run's own figures: keep's layers, each engine's measured read rate
        assert set(model["floors"]) == {"memory", "posix"} and model["floors"]["memory"]["layers"] == shape["layers"]
        assert model["floors"]["memory"]["read_gbps"] == pytest.approx(link["h2d"] / 1e9)
    assert used["save_on_cpu"] and all(kw == {"pin_memory": True} for kw in used["save_on_cpu"])
    assert used["sdpa"] > 0  # the compute-bound shape's attention
    cb, io = result["shapes"]["compute-bound"], result["shapes"]["io-bound"]
    assert cb["attention_backend"] == "FLASH_ATTENTION" and cb["attention_first_step_s"] > 0
    assert io["attention_backend"] is None and "attention_first_step_s" not in io
    gc.collect()
    assert _check_ordering(box) >= 6
    steps = {"perf": result}
    rows = gpu_perf_targets.targets(steps)
    assert [r["target"] for r in rows] == TARGETS
    for row in rows:
        if "explained" in row["target"] or "typical" in row["target"]:  # a CPU step may have no excess
            assert row["result"] != "NOT RUN" or row["detail"] in ("no point of ours had an excess to split",
                                                                   "no breakdown of ours"), row
        else:
            assert row["result"] in ("PASS", "FAIL"), row
    table = gpu_perf_targets.render({"targets": rows, "steps": steps})
    assert "the planner's prediction with this box's figures" in table and "link on registered memory" in table
    assert "activation-peak target 0.8x keep's; floor: memory " in table and " at the measured rates" in table


class MemoryOfTheModel:
    """A stand-in box whose memory follows the model: now, a base plus every gradient tensor
    that exists; the peak since the last reset, that plus the step's activations while the
    forward and backward run, and the optimizer's working memory once it has stepped. Records
    the order of its calls and the steps'."""

    BASE, ACTIVATIONS, OPTIMIZER = 100 << 20, 40 << 20, 30 << 20

    def __init__(self, box, model, log):
        self.box, self.model, self.log = box, model, log
        self.optimizer_ran = False
        model.optimizer.register_step_post_hook(lambda *a: setattr(self, "optimizer_ran", True))

    def grads(self) -> int:
        return sum(p.grad.nbytes for p in self.model.params if p.grad is not None)

    def now(self, device):
        self.log.append("now")
        return self.BASE + self.grads(), 2 * self.BASE + self.grads()

    def reset_peak(self, device):
        self.optimizer_ran = False

    def peak(self, device):
        every = sum(p.nbytes for p in self.model.params)  # the gradients, once backward ran
        top = self.BASE + every + self.ACTIVATIONS + (self.OPTIMIZER if self.optimizer_ran else 0)
        return top, self.BASE + top

    def empty_cache(self):
        self.log.append("empty_cache")

    def __getattr__(self, name):
        return getattr(self.box, name)


def test_the_peak_is_what_forward_and_backward_add_above_the_steps_start(runtime, tmp_path, monkeypatch):
    """Memory at the step's start is taken after zero_grad, with the gradients in it (allocated
    once, as Megatron's grad buffers are: GpuGPT(grad_buffers=True)); the step's peak is read
    as the optimizer starts (its working memory is not the activations'), each step's own; the
    cache is emptied after the warm-up, before the first timed step. Before issue 50 the
    baseline was taken after the step and the peak ran through the optimizer."""
    from ssdtrain_megatron.tools.gpucheck.gpu_check_common import GpuGPT
    from ssdtrain_megatron.tools.gpucheck.gpu_check_runner import Runner
    from tests.test_gpu_check_steps import StandInBox

    spec = GPTSpec(layers=2, hidden=64, heads=4, seq=32, vocab=128, micro_batch=1, num_microbatches=1)
    model = GpuGPT(spec, runtime.device, grad_buffers=True)
    log = []
    box = MemoryOfTheModel(StandInBox(), model, log)
    real_step = Runner.step
    monkeypatch.setattr(Runner, "step", lambda self: (log.append("step"), real_step(self))[1])
    args = gpu_perf.parse_args(["--out", str(tmp_path / "res"), "--scratch", str(tmp_path / "scratch"), "--steps", "5"])
    os.makedirs(args.scratch)
    m = gpu_check_measure.Measure(args, lambda r: None, model, runtime.device, box)
    p = m.point("keep", 1, "keep")
    assert p["ok"], p
    grads = sum(q.nbytes for q in model.params)
    assert p["start_bytes"] == box.BASE + grads and p["start_reserved"] == 2 * box.BASE + grads
    assert p["activation_bytes"] == box.ACTIVATIONS and p["activation_reserved"] == box.ACTIVATIONS
    assert p["peak_bytes"] == box.BASE + grads + box.ACTIVATIONS + box.OPTIMIZER  # the whole step's, shown beside
    assert log[log.index("step"):][:4] == ["step", "empty_cache", "now", "step"], log  # warm-up, empty, baseline


def test_the_planner_takes_each_layers_forward_from_the_compute_stream():
    from ssdtrain_megatron.tools.gpucheck.gpu_perf_model import with_gpu_forward
    from ssdtrain_megatron.telemetry.stats import LayerStats, StepStats

    rows = tuple(LayerStats(layer=str(i), bytes=1 << 20, bytes_offloaded=0, tensors=3, decision="keep", io_wait_s=0,
                            forward_s=0.001) for i in range(2))
    stats = StepStats(step=1, bytes_offloaded=0, bytes_read=0, bytes_deduplicated=0, tensors_offloaded=0,
                      tensors_passed_through=0, tensors_kept=6, tensors_forwarded=0, io_wait_s=0.0,
                      peak_resident_bytes=0, write_gbps=0.0, read_gbps=0.0, bytes_on_disk=0, fallbacks=0,
                      step_time_s=0.1, layers=rows)
    gpu = [{"pid": "gpu", "tid": "compute", "cat": "layer", "ph": "X", "name": f"forward layer {i}", "ts": 0.0,
            "dur": 3000.0} for i in (0, 1, 1)]  # layer 1 twice: two micro-batches
    got = with_gpu_forward(stats, gpu)
    assert [r.forward_s for r in got.layers] == [0.003, 0.006]
    assert with_gpu_forward(stats, gpu[:1]) is stats  # layer 1 has no span: the host's times stay


# -- the targets --------------------------------------------------------------------------------

def _perf_steps():
    """Both shapes' results as a GPU box whose every gpu-perf target passes would write them,
    judged as the step judges them (gpu_check_bounds.judge_points; tests/test_gpu_check.py's
    points: keep's activations 40 above a start of 60).
    IO-bound: memory 1.04x its bound of 2 s (one micro-batch: each byte read is written first,
    so both ways at once, 1.25 s, is out of reach), posix 1.04x its 10 s drive bound,
    each 0.05 s or less blocked beyond the IO deficit, peaks 0.375x keep's.
    Compute-bound: memory 1.02x keep at 0.3x its peak; posix 1.04x keep (its 2 GB each way
    take 0.8 s of drive, inside keep's 1 s); save_on_cpu 2 s: ours at 0.51x of it; its
    weights (1 B parameters: 2 GB of bf16 each way) and the 1 GB keep records cross the
    50 GB/s link both ways in 80 and 40 ms; recompute 1.33x keep's step at 0.1x its peak.
    The shapes are the plan's; the model measured no floors (the rows use the nominal ones)."""
    from ssdtrain_megatron.tools.gpucheck.gpu_check_bounds import judge_points
    from tests.test_gpu_check import RATES, _point

    io = {"status": "pass", "micro_batch": 1, "rates": RATES, "points": [
        _point("keep@1", 1.0, 100),
        _point("offload-memory@1", 2.08, 75, written=50e9, read=50e9, stall=1.01, policy="offload", engine="memory"),
        _point("offload-posix@1", 10.4, 75, written=25e9, read=25e9, stall=9.05, policy="offload", engine="posix"),
    ]}
    compute = {"status": "pass", "micro_batch": 1, "rates": RATES, "points": [
        _point("keep@1", 1.0, 100),
        _point("offload-memory@1", 1.02, 72, written=1e9, read=1e9, policy="offload", engine="memory"),
        _point("offload-posix@1", 1.04, 74, written=2e9, read=2e9, policy="offload", engine="posix"),
        _point("save_on_cpu@1", 2.0, 80, policy="save_on_cpu"),
        _point("recompute@1", 1.33, 64, policy="keep"),
    ], "parameters": 10**9, "record_sizes": {"records": 10, "bytes": 4 * 10**9, "largest": 10**8}}
    io["shape"], compute["shape"] = gpu_perf_plan.SHAPES["io-bound"], gpu_perf_plan.SHAPES["compute-bound"]
    io["rates"] = dict(RATES, drive_raw={"write": 5e9, "read": 5e9})  # the drive's own rate, as the engine's
    for step in (io, compute):
        judge_points(step["points"], 1, RATES, {})
        step["model"] = {"forward_from": "timeline", "points": {"offload-memory@1": {"error": 0.04},
                                                                "offload-posix@1": {"error": -0.09}}}
        for p in step["points"][1:]:
            p["breakdown"] = {"typical": True, "sum_s": 0.1, "excess_s": 0.105, "explained": True,
                              "unexplained_s": 0.015, "unexplained_parts": ["link idle while the host was busy"]}
    return {"perf": {"status": "pass", "shapes": {"io-bound": io, "compute-bound": compute}}}


def test_each_gpu_perf_target_passes_and_fails_at_its_own_limit():
    from ssdtrain_megatron.tools.gpucheck.gpu_check_bounds import judge_points
    from tests.test_gpu_check import RATES

    steps = _perf_steps()
    rows = {r["target"]: r for r in gpu_perf_targets.targets(steps)}
    assert list(rows) == TARGETS
    assert all(r["result"] == "PASS" for r in rows.values()), [r for r in rows.values() if r["result"] != "PASS"]

    def result(name, shape, i=None, **change):
        s = json.loads(json.dumps(steps))
        sub = s["perf"]["shapes"][shape]
        (sub["points"][i] if i is not None else sub).update(change)
        judge_points(sub["points"], 1, RATES, {})
        return {r["target"]: r for r in gpu_perf_targets.targets(s)}[name]["result"]

    # the bound 2 s and what cannot overlap: keep's forward and backward (1 s) over its 8 layers
    assert result("io-bound: memory <= 1.10x link bound + unoverlappable", "io-bound", 1, step_s=2.3) == "PASS"  # 1.08x of 2.125 s
    assert result("io-bound: memory <= 1.10x link bound + unoverlappable", "io-bound", 1, step_s=2.4) == "FAIL"  # 1.13x
    assert result("io-bound: posix <= 1.10x its raw drive bound", "io-bound", 2, step_s=11.5) == "FAIL"
    assert result("io-bound: stall beyond the IO deficit <= 2%: posix", "io-bound", 2, stall_s=9.5) == "FAIL"
    io_peak = "io-bound: activation peak <= 0.7x keep's: posix"
    assert result(io_peak, "io-bound", 2, activation_reserved=29) == "FAIL"  # 0.725x
    # the floor beside the ratio: the nominal one without the box's, the measured one with it
    assert "; floor at the nominal rates 0.56 (1 kept + 3.5 read ahead (the byte cap) of 8 layers" in rows[io_peak]["detail"]
    high = {"floor": 0.8, "kept": 1, "ahead": 5.4, "window": 8, "layers": 8, "by": "byte cap", "read_gbps": 2.0,
            "backward_ms": 0.9}
    s = json.loads(json.dumps(steps))
    s["perf"]["shapes"]["io-bound"]["model"]["floors"] = {"posix": high}
    row = {r["target"]: r for r in gpu_perf_targets.targets(s)}[io_peak]
    assert row["result"] == "PASS" and "; floor at the measured rates 0.80 (1 kept + 5.4 read ahead" in row["detail"]
    assert row["detail"].endswith("the target 0.7 is below it: the shape cannot reach it")
    memory = "compute-bound: memory <= keep + 3% fwd+bwd, peak <= 0.80x"  # tests/test_gpu_regime.py too
    assert result(memory, "compute-bound", 1, step_s=1.04) == "FAIL"
    assert result(memory, "compute-bound", 1, activation_reserved=33) == "FAIL"  # 0.825x
    assert "floor 0.72 on the H100 80 GB (the forward side, the read window" in rows[memory]["detail"]
    posix = "compute-bound: posix <= 1.05x keep (or 1.10x bound)"
    assert rows[posix]["detail"].startswith("the drive carries the bytes (800.0 ms of IO in keep's 1000.0 ms)")
    assert result(posix, "compute-bound", 2, step_s=1.06) == "FAIL"
    # 5 GB each way: 2 s of drive, more than keep's step: judged against its bound instead
    assert result(posix, "compute-bound", 2, bytes_written=5e9, bytes_read=5e9,
                  step_s=2.1) == "PASS"
    assert result(posix, "compute-bound", 2, bytes_written=5e9, bytes_read=5e9, step_s=2.3) == "FAIL"
    ours = "compute-bound: ours hides >= 70% of save_on_cpu copies"
    assert rows[ours]["detail"].startswith("ours hides 87% of the 160.0 ms save_on_cpu's activation copies take "
                                           "(+20.0 ms over keep); offload-memory@1 0.51x save_on_cpu's step")
    # against keep too, and save_on_cpu's weights' copies as their own term
    assert "keep 1000.0 ms: ours 1.02x, save_on_cpu 2.00x" in rows[ours]["detail"]
    assert ("save_on_cpu = keep 1000.0 + weights' copies 80.0 + activations' copies 160.0 + rest 760.0 ms; ours "
            "0.53x save_on_cpu less its weights' copies") in rows[ours]["detail"]
    bare = json.loads(json.dumps(steps))
    for sub in bare["perf"]["shapes"].values():  # the fixture's breakdowns and model are partial: not printed here
        sub.pop("model")
        for p in sub["points"]:
            p.pop("breakdown", None)
    table = gpu_perf_targets.render({"targets": [], "steps": bare})
    for line in ("  save_on_cpu@1          step 2.00x  activation peak 0.50x",
                 "  recompute@1            step 1.33x  activation peak 0.10x",
                 "  offload-memory@1       step 1.02x  activation peak 0.30x"):
        assert line in table, table
    assert "activation-peak target 0.8x keep's; floor: memory 0.50 (1 kept + 2 read ahead of 6 layers" in table
    assert result(ours, "compute-bound", 3, step_s=1.3) == "PASS"  # save_on_cpu's own step judges nothing
    assert result(ours, "compute-bound", record_sizes={"records": 10, "bytes": 10**9, "largest": 10**8}) == "FAIL"
    assert result(ours, "compute-bound", 3, activation_reserved=10) == "FAIL"  # none of ours as low
    model = "compute-bound: the model within 10% of every step"
    assert result(model, "compute-bound", model={"points": {"offload-posix@1": {"error": 0.11}}}) == "FAIL"
    assert result(model, "compute-bound", model={"why": "keep was not measured"}) == "NOT RUN"
    typical = "io-bound: every traced step typical, within 10%"
    explained = "io-bound: every excess explained, <= 20% unexplained"
    good = steps["perf"]["shapes"]["io-bound"]["points"][1]["breakdown"]
    # 55 ms off the median's excess: over 10% of it and over the steps' spread (2% of 2.08 s)
    assert result(typical, "io-bound", 1, breakdown=dict(good, sum_s=0.05)) == "FAIL"
    assert result(explained, "io-bound", 1, breakdown=dict(good, typical=False)) == "PASS"  # judged apart
    assert result(typical, "io-bound", 1, breakdown=dict(good, typical=None)) == "PASS"  # posix's still typical
    assert rows[explained]["detail"].startswith("offload-memory@1 15.0 of 105.0 ms unexplained")
    unexplained = dict(good, explained=False, unexplained_s=0.05)
    assert result(explained, "io-bound", 1, breakdown=unexplained) == "FAIL"
    assert result(typical, "io-bound", 1, breakdown=unexplained) == "PASS"
    assert result("io-bound: memory <= 1.10x link bound + unoverlappable", "io-bound", 1, steps_timed=4) == "NOT RUN"
    rows = gpu_perf_targets.targets({}, {"perf": "not selected (--only)"})
    assert {r["detail"] for r in rows} == {"not selected (--only)"}
    half = {"perf": {"status": "fail", "why": "compute-bound: out of memory", "shapes": steps["perf"]["shapes"]}}
    del half["perf"]["shapes"]["compute-bound"]
    rows = {r["target"]: r for r in gpu_perf_targets.targets(half)}
    assert rows[memory]["detail"] == "the compute-bound shape was not measured"
    assert rows["io-bound: memory <= 1.10x link bound + unoverlappable"]["result"] == "PASS"


def test_each_shape_gets_its_share_of_the_steps_time_and_a_failing_one_leaves_the_next_its_own(
        perf_args, monkeypatch):
    """The perf step splits what is left of its time by the plan's estimates, shape by shape;
    an error in one shape is its result (the step fails, naming it) and the next still runs."""
    import time

    from tests.test_gpu_check_steps import StandInBox

    now = time.time()
    monkeypatch.setenv("GPU_CHECK_DEADLINE", str(now + 105))
    est = {"io-bound": 60.0, "compute-bound": 40.0}
    monkeypatch.setattr(gpu_perf_step, "shares", lambda steps: est)
    seen = {}

    def measure_shape(args, save, box, name, until, device, probe):
        t = time.time()
        seen[name] = (until - t, now + 105 - gpu_perf_step.STEP_END_S - t)  # (its share, what was left)
        save({"status": "running", "points": []})
        if name == "io-bound":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return {"status": "pass", "points": []}

    monkeypatch.setattr(gpu_perf_step, "measure_shape", measure_shape)
    perf_args.child = "perf"
    result = gpu_perf_step.run_step(perf_args, lambda r: None, StandInBox())
    share, left = seen["io-bound"]
    assert share == pytest.approx(0.6 * left, abs=0.5)
    share, left = seen["compute-bound"]
    assert share == pytest.approx(left, abs=0.5)  # the last shape: all that is left
    assert result["status"] == "fail" and result["why"].startswith("io-bound: RuntimeError: CUDA error")
    assert result["shapes"]["compute-bound"]["status"] == "pass"
