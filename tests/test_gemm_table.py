"""A measured GEMM table in the node profile (issue 69 item 2's "profile field for a measured
table"): ``ssdtrain doctor --node-profile``'s sweep (tools/gemm_sweep.py), the profile field
``gemm_tflops_by_shape`` (plan/node.py), the nearest-shape lookup (plan/gpu_kind.py) and the
planner's GEMM time from it (plan/step_time.py), said in the plan's assumptions.

CUDA cannot run here: the sweep's timing function is replaced by a fake (a fixed TFLOP/s per
dtype and shape), the rest is the real code; the real CUDA timer runs in the GPU check
(docs/gpu-check.md)."""

from __future__ import annotations

import json

import pytest
import yaml

from ssdtrain_megatron.plan.gpu_kind import gemm_seconds, gpu_kind, nearest_measured
from ssdtrain_megatron.plan.node import BUILTIN, NodeProfile, ProfileError, load_profile
from ssdtrain_megatron.plan.published import assumed_terms
from ssdtrain_megatron.plan.shape import ModelShape
from ssdtrain_megatron.plan.step_time import Gemm, gemm_source, gemm_time, layer_gemms, layer_time
from ssdtrain_megatron.tools import gemm_sweep
from ssdtrain_megatron.tools.cli import main
from ssdtrain_megatron.tools.node_profile import kind_of_device

H100 = gpu_kind("h100-sxm")


def fake_timer(m: int, n: int, k: int, dtype: str):
    """Stands in for CUDA's: BF16 at 600 TFLOP/s, 300 where the narrowest dimension is under
    1024; no FP8 (as on a card where torch._scaled_mm does not run)."""
    if dtype == "fp8":
        return None
    tflops = 600.0 if min(m, n, k) >= 1024 else 300.0
    return 2 * m * n * k / (tflops * 1e12)


def _table_node(table) -> NodeProfile:
    return load_profile("dgx-h100").replace(gemm_tflops_by_shape=table)


# -- the sweep ---------------------------------------------------------------------------------


def test_the_sweep_times_each_shape_in_each_dtype_and_drops_a_dtype_that_cannot_run():
    rows, notes = gemm_sweep.sweep(fake_timer)
    assert len(rows) == len(gemm_sweep.SHAPES) == 22
    assert rows[0] == {"m": 2048, "n": 6144, "k": 4096, "dtype": "bf16", "tflops": 600.0}
    # the 70B layer at TP4, 2,048 tokens: QKV (8192 + 2 x 1024) / 4 wide
    assert rows[8] == {"m": 2048, "n": 2560, "k": 8192, "dtype": "bf16", "tflops": 600.0}
    # a narrow expert GEMM: 512 rows of a 768-wide expert's fc2
    assert rows[17] == {"m": 512, "n": 2048, "k": 768, "dtype": "bf16", "tflops": 300.0}
    assert notes == ["fp8 not measured: it does not run on this GPU"]


def test_the_sweep_is_bounded_in_time():
    ticks = iter(range(100))
    rows, notes = gemm_sweep.sweep(fake_timer, budget_s=2.5, clock=lambda: next(ticks))
    # the clock reads 0 at the start, then 1, 2, 3 s before each shape: the third is not begun
    assert len(rows) == 2
    assert notes[-1] == "stopped after 2.5 s: 20 of 22 shapes not measured"


class FakeEvent:
    """Stands in for torch.cuda.Event (CUDA cannot run here): 25 ms between any two."""

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.recorded = self.waited = False

    def record(self) -> None:
        self.recorded = True

    def synchronize(self) -> None:
        self.waited = True

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.recorded and end.recorded and end.waited
        return 25.0


def test_the_cuda_timer_warms_up_times_between_events_and_runs_fp8_as_scaled_mm(monkeypatch):
    """The timer's real torch calls on CPU tensors (torch runs _scaled_mm on the CPU too);
    CUDA's events and synchronize faked."""
    import torch

    synced, calls = [], {"mm": 0, "scaled": 0}
    real_mm, real_scaled = torch.mm, torch._scaled_mm

    def mm(a, b):
        calls["mm"] += 1
        return real_mm(a, b)

    def scaled(a, b, **kw):
        calls["scaled"] += 1
        assert a.dtype == b.dtype == torch.float8_e4m3fn and b.stride() == (1, b.shape[0])
        return real_scaled(a, b, **kw)

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", synced.append)
    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(torch, "_scaled_mm", scaled)
    timer = gemm_sweep.cuda_timer("cpu")
    assert timer(64, 48, 32, "bf16") == 25.0 / 1e3 / gemm_sweep.TIMED
    assert timer(64, 48, 32, "fp8") == 25.0 / 1e3 / gemm_sweep.TIMED
    assert calls == {"mm": 13, "scaled": 13} and synced == ["cpu", "cpu"]

    def refuses(*args, **kw):
        raise RuntimeError("torch._scaled_mm is only supported on compute capability >= 8.9")

    monkeypatch.setattr(torch, "_scaled_mm", refuses)
    assert timer(64, 48, 32, "fp8") is None


def test_on_this_cpu_the_sweep_is_skipped_and_says_why():
    table, words = gemm_sweep.measure_gemm_table()
    assert table is None
    assert words.startswith("skipped the GEMM sweep (gemm_tflops_by_shape): no CUDA device")


def test_the_sweep_with_a_timer_gives_the_profiles_table_and_its_note():
    table, words = gemm_sweep.measure_gemm_table(fake_timer)
    assert len(table) == 22 and words.startswith("gemm_tflops_by_shape: 22 torch matmuls")
    assert words.endswith("; fp8 not measured: it does not run on this GPU")
    node = _table_node(table)
    assert node.gemm_tflops_by_shape[0] == (2048, 6144, 4096, "bf16", 600.0)


def test_the_jobs_own_shapes_are_swept_first(tmp_path):
    """Qwen3-30B-A3B's preset (TP1 PP2 EP8): its layer's GEMMs at b x s tokens, the router,
    the 16 local experts' GEMMs at their 4096 x top-8 / 16 rows each (one after another: the
    preset does not set moe_grouped_gemm), the output layer."""
    first = gemm_sweep.job_shapes("configs/qwen3-30b-a3b.yaml")
    assert first == [(4096, 5120, 2048), (4096, 2048, 4096), (4096, 128, 2048),
                     (2048, 1536, 2048), (2048, 2048, 768), (4096, 151936, 2048)]
    table, words = gemm_sweep.measure_gemm_table(fake_timer, first=first)
    assert [(r["m"], r["n"], r["k"]) for r in table[:6]] == first
    # grouped, the experts' GEMMs are priced (and swept) as one of their stacked rows
    data = yaml.safe_load(open("configs/qwen3-30b-a3b.yaml"))
    data["model"]["moe_grouped_gemm"] = True
    grouped = tmp_path / "grouped.yaml"
    grouped.write_text(yaml.safe_dump(data))
    assert gemm_sweep.job_shapes(str(grouped))[3:5] == [(16 * 2048, 1536, 2048), (16 * 2048, 2048, 768)]
    # the two expert GEMMs at 2,048 rows are among the usual shapes too: measured once
    assert len(table) == 6 + 22 - 2 and "the job's 6 first" in words


def test_doctor_refuses_an_unreadable_preset_for_the_sweep_in_one_line(tmp_path, capsys):
    bad = tmp_path / "job.yaml"
    bad.write_text("model: {hidden: 64}\noffload: {dirs: [/tmp]}\n")
    out = tmp_path / "node.yaml"
    rc = main(["doctor", "--dir", str(tmp_path), "--config", str(bad), "--node-profile", str(out), "--json"])
    assert rc == 1 and not out.exists()
    err = capsys.readouterr().err
    assert err.startswith(f"ssdtrain doctor: --node-profile with --config {bad}: ")
    assert "missing key(s)" in err and err.count("\n") == 1


@pytest.mark.parametrize("name, kind", [
    ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", None), ("NVIDIA H200", "h200"),
    ("NVIDIA GH200 480GB", "gh200"), ("NVIDIA A100-SXM4-80GB", "a100-sxm"),
    ("NVIDIA A100 80GB PCIe", None), ("NVIDIA B200", "b200"), ("Tesla T4", None)])
def test_the_gpu_kind_comes_from_the_device_name(name, kind):
    assert kind_of_device(name) == kind


# -- the profile field -------------------------------------------------------------------------

TABLE = [{"m": 8192, "n": 4096, "k": 4096, "dtype": "bf16", "tflops": 640.0},
         {"m": 512, "n": 1536, "k": 2048, "dtype": "bf16", "tflops": 210.0},
         {"m": 8192, "n": 4096, "k": 4096, "dtype": "fp8", "tflops": 1100.0}]


def test_the_table_round_trips_through_yaml_and_json(tmp_path):
    node = _table_node(TABLE)
    path = tmp_path / "node.yaml"
    node.save(str(path))
    assert NodeProfile.from_yaml(str(path)) == node
    again = NodeProfile.from_dict(json.loads(json.dumps(node.to_dict())))
    assert again == node and again.to_dict()["gemm_tflops_by_shape"] == TABLE


@pytest.mark.parametrize("rows, message", [
    ([{"m": 1, "n": 2, "k": 3, "dtype": "fp16", "tflops": 1.0}], "gemm_tflops_by_shape[0]="),
    ([TABLE[0], {"m": 0, "n": 2, "k": 3, "dtype": "bf16", "tflops": 1.0}], "gemm_tflops_by_shape[1]="),
    ([{"m": 1, "n": 2, "k": 3, "dtype": "bf16"}], "gemm_tflops_by_shape[0]="),
    ([{"m": 1, "n": 2, "k": 3, "dtype": "bf16", "tflops": -5}], "gemm_tflops_by_shape[0]="),
    ([], "gemm_tflops_by_shape=[]"),
    ("fast", "gemm_tflops_by_shape='fast'"),
])
def test_a_bad_table_is_one_line_naming_the_file_the_field_and_the_row(tmp_path, rows, message):
    path = tmp_path / "node.yaml"
    path.write_text(json.dumps({"base": "dgx-h100", "gemm_tflops_by_shape": rows}))
    with pytest.raises(ProfileError) as err:
        NodeProfile.from_yaml(str(path))
    text = str(err.value)
    assert text.startswith(f"{path}.{message}") and "\n" not in text
    assert "expected a list of {m, n, k, dtype, tflops}" in text


def test_no_built_in_profile_holds_a_table():
    assert [p.gemm_tflops_by_shape for p in BUILTIN.values()] == [None] * len(BUILTIN)


# -- the planner -------------------------------------------------------------------------------


def test_nearest_is_the_same_dtype_by_log_flops_and_the_narrowest_dimension():
    rows = _table_node(TABLE).gemm_tflops_by_shape
    assert nearest_measured(rows, 8192, 4096, 4096, "bf16") == rows[0]
    assert nearest_measured(rows, 4096, 4096, 4096, "bf16") == rows[0]
    assert nearest_measured(rows, 1024, 1536, 2048, "bf16") == rows[1]  # narrow: the expert's
    # by FLOPs alone row 0 (ln 8 away, row 1 ln 10.7); its narrowest dimension 512 is row 1's
    assert nearest_measured(rows, 8192, 4096, 512, "bf16") == rows[1]
    assert nearest_measured(rows, 512, 1536, 2048, "fp8") == rows[2]  # the only FP8 row
    assert nearest_measured(rows[:2], 512, 1536, 2048, "fp8") is None


def test_a_gemm_runs_at_the_rate_measured_at_its_nearest_shape():
    node = _table_node(TABLE)
    g = Gemm("fc2", 8192, 4096, 4096)
    assert gemm_time(g, H100, node, 8192) == 2 * 8192 * 4096 * 4096 / 640e12
    experts = Gemm("expert_fc1", 512, 1536, 2048, count=4)
    assert gemm_time(experts, H100, node, 8192) == 4 * 2 * 512 * 1536 * 2048 / 210e12
    # grouped: one GEMM of the experts' stacked rows (2,048 x 1536 x 2048: nearer row 1)
    grouped = Gemm("expert_fc1", 512, 1536, 2048, count=4, grouped=True)
    assert gemm_time(grouped, H100, node, 8192) == 2 * 2048 * 1536 * 2048 / 210e12
    fp8 = Gemm("fc1", 8192, 4096, 4096, "fp8")
    assert gemm_time(fp8, H100, node, 8192) == 2 * 8192 * 4096 * 4096 / 1100e12
    # without FP8 rows, FP8 at the kind's efficiency and waves; without a table, all of it
    bf16_only = _table_node(TABLE[:2])
    assert gemm_time(fp8, H100, bf16_only, 8192) == gemm_seconds(H100, 8192, 4096, 4096, "fp8")
    assert gemm_time(g, H100, load_profile("dgx-h100"), 8192) == gemm_seconds(H100, 8192, 4096, 4096)


def test_the_layer_time_follows_the_table_and_the_assumptions_say_so():
    shape = ModelShape(num_layers=32, hidden=4096, heads=32, kv_groups=8, ffn_hidden=14336,
                       seq_len=8192, micro_batch=1, swiglu=True, flash_attention=True)
    table = [{"m": m, "n": n, "k": k, "dtype": "bf16", "tflops": 500.0}
             for m, n, k in ((8192, 6144, 4096), (8192, 4096, 4096))]
    measured = layer_time(shape, _table_node(table)).forward["gemm"]
    flops = sum(g.flops for g in layer_gemms(shape))
    assert measured == pytest.approx(flops / 500e12, rel=1e-12)
    assert layer_time(shape, load_profile("dgx-h100")).forward["gemm"] != measured
    words = assumed_terms(_table_node(TABLE).to_dict())[0]
    assert "GEMMs at the rate of the nearest of the profile's measured shapes " \
           "(gemm_tflops_by_shape: 2 bf16, 1 fp8 rows" in words
    assert gemm_source(_table_node(TABLE[:2]).to_dict()).endswith(
        "; FP8 at the kind's efficiency and waves (not measured)")
    assert "GEMMs at the kind's efficiency and waves" in assumed_terms(load_profile("dgx-h100").to_dict())[0]


def test_ssdtrain_plan_with_a_measured_profile_says_so_and_prices_its_gemms(tmp_path, capsys):
    rows = [{"m": 8192, "n": n, "k": k, "dtype": "bf16", "tflops": 300.0}
            for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))]
    path = tmp_path / "node.yaml"
    _table_node(rows).save(str(path))
    question = ["plan", "--config", "llama3-8b", "--gpus", "8", "--json"]
    assert main(question + ["--node", "dgx-h100"]) == 0
    kind = json.loads(capsys.readouterr().out)
    assert main(question + ["--node", str(path)]) == 0
    measured = json.loads(capsys.readouterr().out)
    assert main(question[:-1] + ["--node", str(path)]) == 0
    text = capsys.readouterr().out  # the text's assumptions line
    assert "at h100-sxm (its GEMM, attention and memory rates, its GEMMs by 4 measured shapes)" \
        in _table_node(rows).describe()
    assert "GEMMs at the rate of the nearest of the profile's measured shapes" in text
    # 300 TFLOP/s is well below the kind's 0.72 x 989: the job runs slower
    assert measured["job_tokens_per_s_per_gpu"] < kind["job_tokens_per_s_per_gpu"]
