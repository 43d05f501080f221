"""Every preset on every built-in node profile (issue 35): with no stall, no tier carries more
than the node gives it; host memory holds no more than it has; the peak stays in the budget;
and a plan that needs more bandwidth than a tier has never reports 0 stall. The real presets,
profiles and planner, through ``ssdtrain plan --json``; pure Python, no GPU needed."""

from __future__ import annotations

import json

import pytest

from ssdtrain_megatron.plan.node import BUILTIN
from ssdtrain_megatron.tools.cli import main

PRESETS = ("gpt3-1.3b", "llama2-7b", "llama2-13b", "llama3-8b", "llama3-70b", "mixtral-8x7b",
           "qwen3-30b-a3b", "llama3-8b-128k")
EPS = 1e-9


def _plan(capsys, *argv):
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _check(out, label):
    bw = out["bandwidth_gbps"]
    for tier in ("host", "ssd"):
        needed, available = bw[tier]["needed"], bw[tier]["available"]
        assert bw[tier]["used"] <= available * (1 + EPS), (label, tier, bw[tier])
        if out["stall_s"] == 0:
            assert needed <= available * (1 + EPS), (label, tier, bw[tier])
        if needed > available * (1 + EPS):
            assert out["stall_s"] > 0, (label, tier, bw[tier])
    assert out["host_peak_bytes"] <= out["host_capacity_bytes"], label
    if out["fits_budget"]:
        assert out["peak_bytes"] <= out["budget_bytes"], label
    else:
        assert out["binding"] == "GPU memory", label


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_on_every_node_stays_within_its_tiers(capsys, preset):
    """At the preset's micro-batch and at four times it (where offload has to carry bytes),
    with the preset's own policy and with every place allowed. Broken variant (the iteration
    not held to the drives' time, plan/tiers.py ``_Step.iteration`` without ``*self.busy``):
    "AssertionError: ('llama3-8b on a100-80g, preset', 'ssd', {'used': 2.839..., 'needed':
    10.077..., 'available': 2.384...})": used above what the drives have, the stall too small."""
    from ssdtrain_megatron.plan.node import load_profile
    from ssdtrain_megatron.tools.plan.cli import read_preset

    tp = read_preset(f"configs/{preset}.yaml")[0].tp
    for node in BUILTIN:
        if tp > load_profile(node).gpus_per_node:  # beyond its NVLink domain: refused (test_plan_fit)
            assert main(["plan", "--config", preset, "--node", node, "--num-microbatches", "8"]) == 1
            assert "NVLink domain" in capsys.readouterr().out.splitlines()[0]
            continue
        for extra, kind in (((), "preset"),
                            # adaptive places within a budget (without one it keeps: issue 57)
                            (("--policy", "adaptive", "--engine", "tiered", "--recompute-fallback",
                              "--micro-batch-size", "4", "--activation-budget", "0.4"),
                             "all places, b=4")):
            out = _plan(capsys, "--config", preset, "--node", node, "--num-microbatches", "8",
                        *extra)
            _check(out, f"{preset} on {node}, {kind}")
            if kind != "preset":
                every = out["tiers"]
                assert sum(every.values()) == out["activation_bytes_per_layer"] * \
                    out["layers_per_stage"]


def test_a_drive_slower_than_the_plan_needs_stalls_the_iteration(capsys):
    """The issue's case: Llama-3 70B offloading 6 GB/s worth of layers to a 6 GB/s drive
    predicted 0 stall. Offload everything to drives a tenth as fast as that needs: the stall is
    the difference, and the drives bind. The drives' time is the floor; the budget's waits for
    writes inside each micro-batch's forward (plan/tier_costs.py) may add a little to it."""
    drives = ("--config", "llama3-70b", "--num-microbatches", "8", "--policy", "offload",
              "--engine", "posix")  # the drives alone (the node's choice would take host memory)
    full = _plan(capsys, *drives, "--ssd-gbps", "1000")
    needed = full["bandwidth_gbps"]["ssd"]["needed"]
    slow = _plan(capsys, *drives, "--ssd-gbps", f"{needed / 5:.6f}")  # a tenth each way
    assert slow["stall_s"] > 0 and slow["binding"] == "the drives"
    assert 10 * slow["compute_s"] * (1 - 1e-6) <= slow["iteration_s"] <= 10.5 * slow["compute_s"]
    ssd = slow["bandwidth_gbps"]["ssd"]
    assert 0.95 * ssd["available"] <= ssd["used"] <= ssd["available"] * (1 + 1e-6)


def test_the_host_memory_bus_is_shared_by_the_nodes_gpus(capsys, tmp_path):
    """The issue's case: qwen3-30b-a3b on a DGX H100 planned 8 GPUs x 2 directions x 48 GB/s =
    768 GB/s of host copies against its two Xeons' 614 GB/s of DDR5. Each GPU's host tier now
    runs at min(link, bus / GPUs / 2) = 38.4 GB/s each way, and the node's copies stay within
    its bus; a profile that does not know its bus (host_memory_gbps: null) plans the link alone
    and says so. Broken variant (plan/stage.py pricing the host tier at host_link_gbps): 48."""
    out = _plan(capsys, "--config", "qwen3-30b-a3b", "--node", "dgx-h100")
    host = out["bandwidth_gbps"]["host"]
    assert host["available"] == pytest.approx(614.4 / 8 / 2)
    assert 8 * 2 * host["used"] <= 614.4 * (1 + EPS)
    assert out["node"]["host_copy_gbps"] == pytest.approx(38.4)
    unknown = tmp_path / "bus-unknown.yaml"
    unknown.write_text("base: dgx-h100\nhost_memory_gbps: null\n")
    out = _plan(capsys, "--config", "qwen3-30b-a3b", "--node", str(unknown))
    assert out["bandwidth_gbps"]["host"]["available"] == pytest.approx(48.0)
    assert main(["plan", "--config", "qwen3-30b-a3b", "--node", str(unknown)]) == 0
    assert "the memory bus they share not known" in capsys.readouterr().out
    gh200 = BUILTIN["gh200"]  # one GPU, NVLink-C2C faster than its LPDDR5X both ways at once
    assert gh200.host_copy_gbps == pytest.approx(min(300.0, 512.0 / 2))


def test_a_bad_host_memory_bus_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: dgx-h100\nhost_memory_gbps: -1\n")
    with pytest.raises(SystemExit) as exc:  # argparse's --node type refuses it
        main(["plan", "--config", "llama3-8b", "--node", str(bad)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "host_memory_gbps=-1 is invalid: expected a number > 0, or null" \
        in err[0], err


def test_gemm_efficiency_by_tokens_is_the_profiles_measurement_when_it_has_one(capsys, tmp_path):
    """Without measurements b=1, 2 and 4 run at the same TFLOP/s, so their compute per token
    ties (the issue: "b=1, 2, 4 tie"); a profile's gpu_tflops_by_tokens (measured TFLOP/s at
    tokens per micro-batch) replaces it, each micro-batch at the figure measured at the most
    tokens not above its own: no curve between the points. --gpu-tflops replaces the table.
    Broken variant (plan/stage.py at gpu_flops whatever the tokens): compute per token ties."""
    from ssdtrain_megatron.plan.node import NodeProfile

    measured = tmp_path / "measured.yaml"
    measured.write_text("base: dgx-h100\ngpu_tflops_by_tokens: {2048: 300, 4096: 360, "
                        "8192: 400}\n")
    profile = NodeProfile.from_yaml(str(measured))
    assert [profile.flops_at(t) / 1e12 for t in (1024, 2048, 4095, 4096, 65536)] == \
        [300.0, 300.0, 300.0, 360.0, 400.0]
    saved = tmp_path / "saved.yaml"
    profile.save(str(saved))
    assert NodeProfile.from_yaml(str(saved)) == profile

    def per_token(node, b, *flags):
        # gpt3-1.3b: TP1 PP1 (no TP traffic in the compute), 2,048 tokens a sequence
        out = _plan(capsys, "--config", "gpt3-1.3b", "--node", node, "--micro-batch-size", str(b),
                    "--num-microbatches", "8", *flags)
        return out["compute_s"] / (b * 8)

    # One rate at every micro-batch (--gpu-tflops: no GPU kind's terms either), said so
    flat = [per_token("dgx-h100", b, "--gpu-tflops", "400") for b in (1, 2, 4)]
    assert flat == pytest.approx([flat[0]] * 3, rel=1e-9)  # the assumption, stated
    by_tokens = [per_token(str(measured), b) for b in (1, 2, 4)]
    assert by_tokens[0] / by_tokens[1] == pytest.approx(360 / 300, rel=1e-9)
    assert by_tokens[1] / by_tokens[2] == pytest.approx(400 / 360, rel=1e-9)
    assert by_tokens[2] == pytest.approx(flat[2], rel=1e-9)  # 8,192 tokens: the 400 measured
    assert per_token(str(measured), 1, "--gpu-tflops", "400") == pytest.approx(flat[0], rel=1e-9)
    # dgx-h100's GPU kind times each GEMM by its shape (plan/step_time.py): no tie
    kind = [per_token("dgx-h100", b) for b in (1, 2, 4)]
    assert kind[0] != kind[1]
    assert main(["plan", "--config", "llama3-8b", "--node", str(measured)]) == 0
    assert "by tokens per micro-batch as the profile measured them (2,048 tokens 300" in \
        capsys.readouterr().out


@pytest.mark.parametrize("table", ["{}", "{0: 300}", "{8192: -1}", "[1, 2]"])
def test_a_bad_gemm_table_is_one_line(tmp_path, capsys, table):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"base: dgx-h100\ngpu_tflops_by_tokens: {table}\n")
    with pytest.raises(SystemExit):
        main(["plan", "--config", "llama3-8b", "--node", str(bad)])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "gpu_tflops_by_tokens=" in err[0] and \
        "expected a mapping of tokens per micro-batch" in err[0], err
