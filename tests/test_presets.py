"""Every preset in configs/ loads and validates where it is used: OffloadConfig.from_yaml, the
planner (ModelShape.from_preset, `ssdtrain plan --config`) and the Megatron flags."""

from __future__ import annotations

import json
import os

import pytest
import torch
import yaml

from ssdtrain_megatron.tools import cli
from ssdtrain_megatron.cache import ActivationOffloader
from ssdtrain_megatron.config import OffloadConfig
from ssdtrain_megatron.megatron.args import megatron_args_from_preset
from ssdtrain_megatron.tools.plan.cli import PRESET_SECTIONS, load_preset
from ssdtrain_megatron.plan.model import (ModelShape, SaveProfile, layer_activation_bytes,
                                          layer_activation_terms)

from models import assert_bitwise_equal, mlp, run_steps

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")

LAYOUTS = {  # preset: (tp, pp)
    "gpt3-1.3b": (1, 1),
    "llama2-7b": (2, 1),
    "llama2-13b": (4, 2),
    "llama3-8b": (2, 2),
    "llama3-70b": (8, 4),
    "mixtral-8x7b": (1, 4),
    "qwen3-30b-a3b": (1, 2),
    "llama3-8b-128k": (2, 1),
    "llama3-8b-dgx": (1, 2),
    "cpu-tiny": (1, 1),
}
RAID = {"llama3-8b-dgx"}  # a DGX as it ships: one RAID-0 at /raid shared by the node's ranks
GPU_PRESETS = [name for name in LAYOUTS if name != "cpu-tiny"]


def _path(name: str) -> str:
    return os.path.join(CONFIGS, f"{name}.yaml")


def _load(name: str) -> dict:
    with open(_path(name), encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def test_configs_holds_exactly_the_listed_presets():
    shipped = {f[:-len(".yaml")] for f in os.listdir(CONFIGS) if f.endswith(".yaml")}
    assert shipped == set(LAYOUTS)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_preset_has_model_parallel_and_offload_sections(name):
    """model, parallel and offload, in that order; node (the plan's node profile) optional."""
    assert [k for k in _load(name) if k != "node"] == ["model", "parallel", "offload"]
    assert set(_load(name)) <= set(PRESET_SECTIONS)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_preset_validates_as_offload_config_and_model_shape(name):
    data = _load(name)
    cfg = OffloadConfig.from_yaml(_path(name))
    assert cfg == OffloadConfig.from_dict(data["offload"])
    shape = ModelShape.from_preset(data["model"], data["parallel"])
    assert (shape.tp, shape.pp) == LAYOUTS[name]
    assert "micro_batch" in data["model"] and "policy" in data["offload"]
    assert load_preset(_path(name)) == (shape, cfg.keep_last_layers)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_ssdtrain_plan_accepts_preset(name, capsys):
    assert cli.main(["plan", "--config", _path(name), "--num-microbatches", "4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    tp, pp = LAYOUTS[name]
    assert (plan["model"]["tp"], plan["model"]["pp"]) == (tp, pp)
    layers = plan["activation_bytes_per_layer"] * plan["layers_per_stage"]
    assert sum(plan["tiers"].values()) == layers  # every layer's bytes have one place
    assert plan["iteration_s"] >= plan["compute_s"] > 0


@pytest.mark.parametrize("name", [n for n in GPU_PRESETS if n not in RAID])
def test_gpu_preset_writes_to_one_node_local_drive_per_local_rank_per_job(name):
    for template in OffloadConfig.from_yaml(_path(name)).dirs:
        assert template.startswith("/mnt/nvme{local_rank}/"), template
        assert template.endswith("/{job}"), template


@pytest.mark.parametrize("name", sorted(RAID))
def test_the_dgx_preset_gives_each_rank_its_folder_on_the_one_array(name, capsys):
    """A stock DGX: one RAID-0 at /raid (docs/cluster.md). Every local rank writes its own
    folder on it, the job's below; the plan is the DGX H100's, whose drive bandwidth per GPU is
    the node's drives shared by its GPUs, what eight ranks get from one array striped over
    them. Broken variants (the other presets' /mnt/nvme{local_rank} dirs; node: {base:
    dgx-h100, drives: 1}, the array counted as one drive): the path or the bandwidth differs.
    A folder per user above the ranks' ({user}, issue 65): two users of one node never meet in
    one folder (tests/test_folder_refusals.py starts two users' jobs on it)."""
    dirs = OffloadConfig.from_yaml(_path(name)).dirs
    assert list(dirs) == ["/raid/{user}/ssdtrain/{local_rank}/{job}"], dirs
    assert cli.main(["plan", "--config", _path(name), "--num-microbatches", "4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    node = plan["node"]
    assert node["name"] == "dgx-h100" and node["drives"] == 8 and node["gpus_per_node"] == 8
    assert node["ssd_write_gbps"] == pytest.approx(8 * 3.8 / 8)
    assert plan["bandwidth_gbps"]["ssd"]["available"] == pytest.approx(1 / (1 / 3.8 + 1 / 6.4))


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_gpu_preset_becomes_megatron_flags_for_its_layout(name):
    flags = megatron_args_from_preset(_path(name))
    tp, pp = LAYOUTS[name]
    assert flags[flags.index("--tensor-model-parallel-size") + 1] == str(tp)
    assert flags[flags.index("--pipeline-model-parallel-size") + 1] == str(pp)
    assert "--bf16" in flags


def test_cpu_tiny_offloads_under_the_current_folder(tmp_path, monkeypatch):
    """Broken variant: _write_done keeping every written tensor in memory (READY, never
    ON_DISK): numerics stay equal, and "assert (1048576 > 0 and 0 > 0)" (nothing read back)."""
    cfg = OffloadConfig.from_yaml(_path("cpu-tiny"))
    assert all(not os.path.isabs(d) or d.startswith("/tmp/") for d in cfg.dirs)
    monkeypatch.chdir(tmp_path)
    model = mlp(width=256, depth=3)
    batches = [torch.randn(128, 256) for _ in range(2)]  # 128 KiB activations: offloaded
    plain_losses, plain_grads, _ = run_steps(model, batches, steps=1)
    with ActivationOffloader(cfg) as off:
        # wait_writes: every write done before backward, which then reads the bytes back
        losses, grads, stats = run_steps(model, batches, off, steps=1, wait_writes=True)
        assert all(d.startswith(str(tmp_path)) for d in off.rank_dirs)
    assert_bitwise_equal((plain_losses, plain_grads, None), (losses, grads, None))  # lengths, keys, bits
    assert stats[0].bytes_offloaded > 0 and stats[0].bytes_read > 0, stats[0]
    leftovers = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path) for f in fs]
    assert leftovers == []


@pytest.mark.parametrize("name, experts, topk, ep", [("mixtral-8x7b", 8, 2, 8),
                                                     ("qwen3-30b-a3b", 128, 8, 8)])
def test_moe_preset_plans_experts_and_becomes_megatron_moe_flags(name, experts, topk, ep):
    """Broken variant: drop the MoE fields from megatron_args_from_preset -> ValueError:
    '--num-experts' is not in list."""
    flags = megatron_args_from_preset(_path(name))
    assert flags[flags.index("--num-experts") + 1] == str(experts)
    assert flags[flags.index("--moe-router-topk") + 1] == str(topk)
    assert flags[flags.index("--expert-model-parallel-size") + 1] == str(ep)
    shape, _ = load_preset(_path(name))
    terms = layer_activation_terms(shape, SaveProfile.paper())
    assert terms["routing_map"] == shape.seq_len * shape.micro_batch * experts  # bool: 1 B
    assert "fc1_input" not in terms and terms["expert_fc1_input"] > 0


def test_qwen3_heads_are_128_wide_in_the_plan_and_the_megatron_flags():
    """Qwen3's kv_channels (128, not hidden / heads = 64) reaches Megatron as --kv-channels and
    widens the planned query and attention output to heads x 128. Broken variant: drop the
    flag from megatron_args_from_preset -> "ValueError: '--kv-channels' is not in list"."""
    flags = megatron_args_from_preset(_path("qwen3-30b-a3b"))
    assert flags[flags.index("--kv-channels") + 1] == "128"
    shape, _ = load_preset(_path("qwen3-30b-a3b"))
    terms = layer_activation_terms(shape, SaveProfile.paper())
    tokens = shape.seq_len * shape.micro_batch
    assert terms["query"] == terms["proj_input"] == 2 * tokens * 32 * 128
    assert terms["key"] == 2 * tokens * 4 * 128


def test_long_context_preset_plans_per_context_parallel_rank():
    """Llama-3 8B at 128k with CP=8: a layer holds what the 8k preset's layer holds at 16k
    tokens (twice the 8k figure), plus the keys and values all-gathered to the whole 128k.
    Broken variant: drop the K/V all-gather from _context_parallel_terms ->
    "assert 1140850688 == 1375731712" (twice the 8k preset's layer)."""
    shape, _ = load_preset(_path("llama3-8b-128k"))
    assert shape.cp == 8 and shape.seq_len == 131072
    eight_k, _ = load_preset(_path("llama3-8b"))
    kv = 2 * shape.dtype_bytes * shape.micro_batch * shape.groups * shape.head_dim // shape.tp
    expected = 2 * layer_activation_bytes(eight_k.replace(pp=1), SaveProfile.paper()) \
        + kv * (shape.seq_len - shape.seq_len // shape.cp)
    assert layer_activation_bytes(shape, SaveProfile.paper()) == expected
    flags = megatron_args_from_preset(_path("llama3-8b-128k"))
    assert flags[flags.index("--context-parallel-size") + 1] == "8"
