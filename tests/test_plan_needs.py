"""``ssdtrain plan`` answers what a user planning a job asks (issue 27, section 3): the bandwidth
of full offload and of the chosen plan per GPU, node and drive; the largest micro-batch beside
the weights, gradients and optimizer state; presets by name in every subcommand; sizes written
the same way in every flag; ``demo --config PRESET`` with a budget that is a fraction of GPU
memory.

Real parsers, real preset files, the real planner; no GPU is needed for any of it (the demo's
CUDA branch is the one thing a GPU run shows).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import runpy
import sys

import pytest

from ssdtrain_megatron import presets
from ssdtrain_megatron.plan.memory import layer_parameters, model_state_bytes
from ssdtrain_megatron.plan.shape import ModelShape
from ssdtrain_megatron.tools.cli import build_parser, main
from ssdtrain_megatron.tools.cli_types import (byte_count, size_or_fraction, size_with_unit,
                                               size_with_unit_or_fraction,
                                               size_with_unit_zero_or_fraction)
from tests.test_plan_model import LAYER_BYTES, PRESET

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = PRESET  # tests/test_plan_model.py's tiny preset: one layer is LAYER_BYTES at b=2
# One layer's parameters: QKV 64 x 192 + proj 64 x 64 + 2 norms of 64 + fc1/fc2 2 x 64 x 256.
LAYER_PARAMS = 64 * 192 + 64 * 64 + 2 * 64 + 2 * 64 * 256


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    return path


def plan(capsys, *argv):
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# -- bandwidth ---------------------------------------------------------------------------------


def test_the_drives_bytes_cross_the_host_link_and_share_the_nodes_drives(capsys, tiny):
    """The node's drives are shared by its GPUs: 4 GPUs and 2 drives of 1 GB/s give each GPU
    0.5 GB/s; what the drives carry crosses the host link too (the bounce through pinned host
    memory), so the link's bytes are the drives' plus host memory's."""
    out = plan(capsys, "--config", str(tiny), "--gpu-tflops", "0.001", "--engine", "tiered",
               # one layer's room once the 2 GiB of pinned staging is out (issue 57)
               "--host-memory", f"{LAYER_BYTES + (2 << 30)}B", "--gpus-per-node", "4", "--drives", "2",
               "--ssd-gbps", "0.5")
    node = out["node"]
    assert (node["gpus_per_node"], node["drives"]) == (4, 2)
    assert node["ssd_write_gbps"] == node["ssd_read_gbps"] == 0.5
    assert out["tiers"]["host"] == LAYER_BYTES and out["tiers"]["ssd"] == 2 * LAYER_BYTES
    link = out["bandwidth_gbps"]["host"]
    assert link["used"] == pytest.approx(3 * LAYER_BYTES / out["iteration_s"] / 1e9)
    assert out["bandwidth_gbps"]["ssd"]["available"] == pytest.approx(0.25)  # 1/(1/0.5 + 1/0.5)


def test_the_table_names_the_node_and_each_tier_against_it(capsys, tiny):
    assert main(["plan", "--config", str(tiny), "--gpu-tflops", "0.001"]) == 0
    text = capsys.readouterr().out
    for said in ("node dgx-h100: 8 GPUs", "host link, each way", "drives", "per GPU",
                 "(the default; --node picks another, with flags)", "binding"):
        assert said in text, said
    plan_parser = build_parser()._subparsers._group_actions[0].choices["plan"]  # noqa: SLF001
    drives = next(a for a in plan_parser._actions if "--drives" in a.option_strings)  # noqa: SLF001
    assert "drives per node" in drives.help


def test_a_presets_node_section_picks_the_node_and_the_flag_wins(capsys, tiny):
    tiny.write_text(TINY + "node:\n  base: gh200\n  host_memory_bytes: 100GB\n")
    out = plan(capsys, "--config", str(tiny))
    assert out["node"]["name"] == "gh200" and out["node"]["host_memory_bytes"] == 100 * 10 ** 9
    assert out["host_capacity_bytes"] == 100 * 10 ** 9 - out["staging_default_bytes"]
    assert out["node_source"] == "the preset's node: section"
    assert plan(capsys, "--config", str(tiny), "--node", "a100-80g")["node"]["name"] == "a100-80g"
    tiny.write_text(TINY + "node:\n  base: gh200\n  host_memory_bytes: '100'\n")
    assert main(["plan", "--config", str(tiny)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"ssdtrain plan: error: {tiny}: node.host_memory_bytes: 100: give a unit, "
                   "e.g. 100GB"]


# -- model state and the largest micro-batch ---------------------------------------------------


def test_model_state_is_18_bytes_per_parameter_or_6_plus_12_over_d_sharded():
    shape = ModelShape(num_layers=4, hidden=64, heads=4, ffn_hidden=256, seq_len=32,
                       micro_batch=2)
    assert layer_parameters(shape) == {"dense": LAYER_PARAMS, "expert": 0}
    assert model_state_bytes(shape)["bytes"] == 4 * LAYER_PARAMS * 18
    sharded = shape.replace(distributed_optimizer=True, dp=4)
    assert model_state_bytes(sharded)["bytes"] == 4 * LAYER_PARAMS * (6 + 12 // 4)
    on_two_stages = shape.replace(pp=2, tp=2)  # half the layers per stage, half of each per rank
    assert model_state_bytes(on_two_stages)["bytes"] == LAYER_PARAMS * 18


@pytest.mark.parametrize("preset, billions", [("llama3-8b", 8.03), ("llama3-70b", 70.55),
                                              ("mixtral-8x7b", 46.70)])
def test_parameter_counts_match_the_published_sizes(preset, billions):
    from ssdtrain_megatron.tools.plan.cli import load_preset

    shape, _ = load_preset(os.path.join(REPO, "configs", f"{preset}.yaml"))
    layer = layer_parameters(shape)
    total = shape.num_layers * (layer["dense"] + layer["expert"]) + 2 * shape.vocab * shape.hidden
    assert abs(total / 1e9 - billions) < 0.01 * billions


def test_the_largest_micro_batch_fits_beside_the_model_state(capsys, tiny):
    """Without a budget, activations get what the state leaves of --gpu-memory: a larger state
    (no distributed optimizer) leaves room for fewer samples."""
    gpu = 4 * LAYER_PARAMS * 18 + 10 ** 7  # the state plus 10 MB, no reserve (test_plan_fit)
    # no reserve, and a job of a day: the tiny model at 400 TFLOP/s keeps the drives writing
    # (their rated life ~30 days; test_plan_fit counts it)
    out = plan(capsys, "--config", str(tiny), "--gpu-memory", f"{gpu}B", "--memory-reserve", "0B",
               "--job-days", "1")
    assert out["memory"]["activation_budget_bytes"] == 10 ** 7
    assert out["memory"]["activation_budget_source"] == "GPU memory less the model state"
    alone = out["largest_micro_batch"]
    assert alone == {"keep": 27, "planned": 55, "recompute": 93}  # 1e7 B, as test_plan_model
    sharded = plan(capsys, "--config", str(tiny), "--gpu-memory", f"{gpu}B", "--memory-reserve",
                   "0B", "--job-days", "1", "--use-distributed-optimizer", "--data-parallel-size", "8")
    assert sharded["memory"]["model_state"]["bytes"] == 4 * LAYER_PARAMS * (6 + 1.5)
    assert all(sharded["largest_micro_batch"][m] > alone[m] for m in alone)


def test_the_presets_fraction_budget_is_of_gpu_memory_and_the_flag_wins(capsys, tiny):
    tiny.write_text(TINY + "  activation_budget_bytes: 0.5\n")
    out = plan(capsys, "--config", str(tiny), "--gpu-memory", "20MB", "--memory-reserve", "0B",
               "--job-days", "1")
    assert out["memory"]["activation_budget_bytes"] == 10 ** 7
    assert out["memory"]["activation_budget_source"].startswith(
        "the preset's activation_budget_bytes: 0.5 x GPU memory")
    assert out["largest_micro_batch"] == {"keep": 27, "planned": 55, "recompute": 93}
    flag = plan(capsys, "--config", str(tiny), "--gpu-memory", "20MB", "--activation-budget", "1MB",
                "--memory-reserve", "0B")
    assert flag["memory"]["activation_budget_bytes"] == 10 ** 6
    over = plan(capsys, "--config", str(tiny), "--gpu-memory", "4MB", "--activation-budget", "0.9",
                "--memory-reserve", "0B")
    assert over["memory"]["fits"] is False  # 3.5 MB of state + 3.6 MB of budget > 4 MB
    assert main(["plan", "--config", str(tiny), "--gpu-memory", "4MB", "--activation-budget",
                 "0.9", "--memory-reserve", "0B"]) == 0
    assert "MODEL STATE AND BUDGET EXCEED THE GPU'S MEMORY" in capsys.readouterr().out


def test_the_old_memory_budget_gb_flag_is_the_activation_budget(capsys, tiny):
    out = plan(capsys, "--config", str(tiny), "--memory-budget-gb", "0.01")
    assert out["memory"]["activation_budget_bytes"] == 10 ** 7
    assert out["memory"]["activation_budget_source"] == "--activation-budget"


def test_the_help_states_the_formula():
    plan_parser = build_parser()._subparsers._group_actions[0].choices["plan"]  # noqa: SLF001
    text = " ".join(plan_parser.format_help().split())
    assert "18 bytes per parameter held" in text and "6 + 12/d" in text


# -- presets by name ---------------------------------------------------------------------------


def test_a_preset_name_plans_like_its_file(capsys):
    by_name = plan(capsys, "--config", "llama3-70b")
    by_path = plan(capsys, "--config", os.path.join(REPO, "configs", "llama3-70b.yaml"))
    assert by_name["config"] == by_path["config"]  # the same file
    assert by_name == by_path


@pytest.mark.parametrize("command", ["plan", "doctor", "clean", "demo", "bench"])
def test_every_subcommands_config_takes_a_name_and_refuses_an_unknown_one_with_2(command, capsys):
    parser = build_parser()
    args = parser.parse_args([command, "--config", "llama3-8b"])
    assert os.path.samefile(args.config, os.path.join(REPO, "configs", "llama3-8b.yaml"))
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--config", "llama3-9b"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith(f"ssdtrain {command}: error: argument --config: llama3-9b: no such "
                             "file and no preset of that name; presets: cpu-tiny, gpt3-1.3b, ")


def test_the_megatron_flag_takes_a_preset_name_too():
    from ssdtrain_megatron.megatron.args import add_ssd_offload_args, megatron_args_from_preset

    parser = argparse.ArgumentParser()
    add_ssd_offload_args(parser)
    args = parser.parse_args(["--ssd-offload-config", "llama3-8b"])
    assert args.ssd_offload_config.endswith(os.path.join("configs", "llama3-8b.yaml"))
    assert megatron_args_from_preset("llama3-8b")[:2] == ["--num-layers", "32"]


def test_an_installed_package_finds_the_presets_setup_py_installs(tmp_path, monkeypatch):
    """setup.py installs every configs/*.yaml under <prefix>/share/ssdtrain-megatron/configs,
    and the lookup finds them there when no checkout sits beside the package."""
    captured = {}
    import setuptools

    monkeypatch.setattr(setuptools, "setup", lambda **kw: captured.update(kw))
    monkeypatch.chdir(REPO)
    runpy.run_path(os.path.join(REPO, "setup.py"))
    (dest, files), = captured["data_files"]
    assert dest == presets.SHARE
    shipped = sorted(os.path.basename(f) for f in files)
    assert shipped == sorted(f for f in os.listdir(os.path.join(REPO, "configs"))
                             if f.endswith(".yaml"))
    prefix = tmp_path / "prefix"
    share = prefix / presets.SHARE
    share.mkdir(parents=True)
    (share / "llama3-70b.yaml").write_text(TINY)
    site = tmp_path / "site-packages" / "ssdtrain_megatron"
    site.mkdir(parents=True)
    monkeypatch.setattr(presets, "__file__", str(site / "presets.py"))
    monkeypatch.setattr(sys, "prefix", str(prefix))
    assert presets.resolve_preset("llama3-70b") == str(share / "llama3-70b.yaml")
    assert presets.preset_names() == ["llama3-70b"]


# -- sizes -------------------------------------------------------------------------------------

SIZE_TYPES = (byte_count, size_or_fraction, size_with_unit, size_with_unit_or_fraction,
              size_with_unit_zero_or_fraction)
"""Every argparse type that reads a size: with a unit or not (only where the name says bytes)."""


def _byte_flags():
    subs = build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001
    for name, sub in subs.items():
        for action in sub._actions:  # noqa: SLF001
            if action.type in SIZE_TYPES and action.help != argparse.SUPPRESS:
                yield name, action.option_strings[0], action.dest


def test_every_size_flag_of_every_subcommand_takes_gb_and_gib():
    flags = list(_byte_flags())
    assert {(c, f) for c, f, _ in flags} >= {("demo", "--min-tensor-bytes"),
                                              ("bench", "--memory-budget"),
                                              ("plan", "--gpu-memory"),
                                              ("plan", "--activation-budget"),
                                              ("demo", "--activation-budget")}
    required = {"plan": ["--config", "llama3-8b"]}
    for command, flag, dest in flags:
        for text, value in (("80GB", 80 * 10 ** 9), ("80GiB", 80 << 30)):
            args, _ = build_parser().parse_known_args([command, *required.get(command, []),
                                                       flag, text])
            assert getattr(args, dest) == value, (command, flag, text)


def test_a_size_flag_whose_name_does_not_say_bytes_refuses_a_plain_number(capsys):
    """--gpu-memory 80 meant 80 GB, not 80 bytes: refused in one line. Broken variant:
    --gpu-memory with type byte_count -> the plan runs on an 80-byte GPU."""
    for flag in ("--gpu-memory", "--host-memory", "--activation-budget"):
        with pytest.raises(SystemExit) as exit_info:
            main(["plan", "--config", "llama3-8b", flag, "80"])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1].startswith(
            f"ssdtrain plan: error: argument {flag}: 80: give a unit, e.g. 80GB")


def test_a_plain_number_only_where_the_unit_is_in_the_flag_name():
    """A flag whose name says it holds bytes, a budget or memory takes a size; the plain-number
    size flags name their unit (--total-gib, --tensor-kib, --drive-tb, --ssd-gbps)."""
    subs = build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001
    wrong = []
    for name, sub in subs.items():
        for action in sub._actions:  # noqa: SLF001
            flag = action.option_strings[0] if action.option_strings else ""
            if action.help == argparse.SUPPRESS or flag.endswith(("-gb", "-gib", "-mib", "-kib")):
                continue
            if any(w in flag for w in ("bytes", "budget", "memory")) \
                    and action.type not in SIZE_TYPES:
                wrong.append(f"ssdtrain {name} {flag}")
    assert wrong == []


def test_every_megatron_size_flag_takes_gb_and_gib():
    from ssdtrain_megatron.config import OffloadConfig
    from ssdtrain_megatron.megatron.args import add_ssd_offload_args, dest_for, flag_for

    fields = [f.name for f in dataclasses.fields(OffloadConfig)
              if (f.metadata.get("unit") or "").startswith("bytes")]
    assert {"chunk_bytes", "max_inflight_bytes", "activation_budget_bytes"} <= set(fields)
    parser = argparse.ArgumentParser()
    add_ssd_offload_args(parser)
    for name in fields:
        for text, value in (("4096kB", 4096 * 1000), ("1MiB", 1 << 20)):  # valid for all
            args = parser.parse_args([flag_for(name), text])
            assert getattr(args, dest_for(name)) == value, (name, text)


# -- demo with a preset whose budget is a fraction ---------------------------------------------


def test_demo_with_a_fraction_budget_preset_runs_on_cpu_and_says_what_to_pass(tmp_path, capsys):
    """llama3-70b's budget is 0.35 of GPU memory: the CPU demo runs without it, says so and
    what to pass; --activation-budget 64MiB then runs within one (fails before the fix:
    "ValueError: OffloadConfig.activation_budget_bytes=0.35 is a fraction of device memory,
    but the training device is cpu")."""
    small = ["--steps", "2", "--num-layers", "2", "--hidden-size", "64", "--seq-length", "64",
             "--micro-batch-size", "2", "--num-microbatches", "2", "--min-tensor-bytes", "4KiB"]
    rc = main(["demo", "--config", "llama3-70b", "--dir", str(tmp_path / "a"), *small])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "0.35 is a fraction of GPU memory; not applied on the CPU (pass --activation-budget" \
        in out
    assert "losses bitwise equal to keep: True" in out
    rc = main(["demo", "--config", "llama3-70b", "--activation-budget", "1MiB",
               "--dir", str(tmp_path / "b"), *small])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "activation budget 1.0 MiB (offload run" in out


@pytest.mark.parametrize("command", ["plan", "doctor", "clean", "demo", "bench"])
def test_an_invalid_preset_is_a_usage_error_in_every_subcommand(command, tmp_path, capsys):
    """The same mistake, the same exit status: 2, with one line naming the bad key."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(TINY.replace("keep_last_layers: 1", "keep_last_layers: -1"))
    extra = ["--dir", str(tmp_path / "root")] if command in ("demo", "bench") else []
    assert main([command, "--config", str(bad), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "keep_last_layers=-1 is invalid" in err[0], err


def test_a_bad_size_is_a_usage_error_in_every_size_flag(capsys):
    required = {"plan": ["--config", "llama3-8b"]}
    for command, flag, _ in _byte_flags():
        with pytest.raises(SystemExit) as exit_info:
            main([command, *required.get(command, []), flag, "12parsecs"])
        assert exit_info.value.code == 2, (command, flag)
        assert f"argument {flag}: " in capsys.readouterr().err
