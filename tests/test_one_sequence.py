"""What the plan says is what the job runs (issue 57): ``ssdtrain plan``, the pre-flight and
install() take their settings from one sequence (plan/job.py ``job_settings``), so for one
job the three print equal settings. The issue's nine cases, each through the real CLIs
(``ssdtrain plan ... -- ARGS``, ``ssdtrain doctor --preflight --json -- ARGS``) and the
launcher's install path up to the OffloadConfig it hands to ``install()`` (the installer is
this module's :func:`install`, which returns the config: no megatron, no CUDA); then a grid of
combinations through the three doors.

Host memory: the plan's ``--host-memory X`` is per GPU, staging included; the job measures
what is free on the node (``SSDTRAIN_HOST_MEMORY_FREE`` here) and takes 3/4 of it over its
local ranks, so a node with ``X x ranks x 4/3`` free gives each rank X."""

from __future__ import annotations

import argparse
import json
from typing import Any, Dict, List, Optional, Sequence

import pytest

from ssdtrain_megatron.config import OffloadConfig
from ssdtrain_megatron.megatron import launch
from ssdtrain_megatron.megatron.args import add_ssd_offload_args
from ssdtrain_megatron.megatron.follow_node import megatron_namespace
from ssdtrain_megatron.megatron.host_memory import HostMemory
from ssdtrain_megatron.megatron.preflight import disk_peak_bytes, read_launch
from ssdtrain_megatron.tools.cli import main

GB = 10 ** 9
CAPTURE = launch.Target("capture", "unused", "unused", "unused", __name__, "unused")
"""The launcher's install path with this module as the installer: it returns the config."""


def install(config: OffloadConfig) -> OffloadConfig:
    """The installer of :data:`CAPTURE`: what ``install()`` would have been given."""
    return config


def free_for(per_gpu: int, ranks: int) -> int:
    """Host memory free on a node that gives each of ``ranks`` ranks ``per_gpu``."""
    assert per_gpu % 3 == 0
    return per_gpu * ranks * 4 // 3


def install_path(argv: Sequence[str], world: int, host: HostMemory) -> OffloadConfig:
    """The OffloadConfig the launcher's install path takes for ``argv`` (Megatron's namespace:
    its flags as Megatron parses them, with the world size)."""
    flags = add_ssd_offload_args(argparse.ArgumentParser()).parse_known_args(list(argv))[0]
    ns = argparse.Namespace(**vars(megatron_namespace(argv, world)), **vars(flags), rank=0)
    return launch.install_from_args(ns, CAPTURE, host)


def config_fields(summary: Dict[str, Any]) -> Dict[str, Any]:
    """The settings an OffloadConfig carries, from a summary."""
    return {k: summary[k] for k in ("engine", "policy", "recompute_fallback", "host_pool_bytes",
                                    "staging_bytes", "prefetch_layers", "keep_last_layers")}


def of_config(config: OffloadConfig) -> Dict[str, Any]:
    return {"engine": config.engine, "policy": config.policy,
            "recompute_fallback": config.recompute_fallback,
            "host_pool_bytes": config.host_memory_bytes if config.engine in ("tiered", "memory") else 0,
            "staging_bytes": config.staging_bytes(), "prefetch_layers": config.prefetch_layers,
            "keep_last_layers": config.keep_last_layers}


def three_ways(capsys, monkeypatch, tmp_path, args: List[str], *, gpus: int, per_node: int,
               host_per_gpu: int, plan_flags: Sequence[str] = ()) -> Dict[str, Any]:
    """The settings of the job ``args`` (launcher arguments) from ``ssdtrain plan -- ARGS``,
    ``ssdtrain doctor --preflight --json -- ARGS`` (every local rank) and the install path;
    asserts they are equal and returns the plan's JSON."""
    argv = ["--ssd-offload", "--ssd-offload-dir", str(tmp_path), "--ssd-offload-allow-system-disk",
            *args]
    assert main(["plan", "--gpus", str(gpus), "--host-memory", f"{host_per_gpu}B", *plan_flags,
                 "--json", "--", *argv]) == 0
    planned = json.loads(capsys.readouterr().out)
    ranks = min(per_node, gpus)
    free = free_for(host_per_gpu, ranks)
    monkeypatch.setenv("SSDTRAIN_HOST_MEMORY_FREE", f"{free}B")
    main(["doctor", "--preflight", "--json", "--nproc-per-node", str(ranks), "--nnodes",
          str(gpus // ranks), "--", *argv])
    checked = json.loads(capsys.readouterr().out)
    assert len(checked["ranks"]) == ranks
    for rank in checked["ranks"]:
        assert {k: rank[k] for k in planned["settings"]} == planned["settings"]
    config = install_path(argv, gpus, HostMemory(free, ranks, "$SSDTRAIN_HOST_MEMORY_FREE"))
    assert of_config(config) == config_fields(planned["settings"])
    return planned


def test_1_a_named_tiered_engine_gets_the_pool_its_plan_fills(capsys, monkeypatch, tmp_path):
    """Broken variant (the pool follows the plan only where the node chose the engine, as on
    main): the install path gets 4.29 GB where plan says 68.6 GB."""
    out = three_ways(capsys, monkeypatch, tmp_path,
                     ["--ssd-offload-config", "llama3-70b", "--ssd-offload-engine", "tiered",
                      "--micro-batch-size", "4", "--global-batch-size", "64"],
                     gpus=64, per_node=8, host_per_gpu=150 * GB)
    s = out["settings"]
    assert (s["engine"], s["num_micro_batches"]) == ("tiered", 8)
    assert s["host_pool_bytes"] == out["host_peak_bytes"] + out["activation_bytes_per_layer"]
    assert s["host_pool_bytes"] > 60 * GB


def test_2_the_data_parallel_size_is_the_world_size_over_the_layout(capsys, monkeypatch, tmp_path):
    """llama3-8b (tp 1 pp 1 ... of its preset), 512 GPUs, global batch 4096 at b=8: dp is 512 /
    (tp x pp x cp), one micro-batch. Broken variant (dp from the preset): 2 micro-batches."""
    out = three_ways(capsys, monkeypatch, tmp_path,
                     ["--ssd-offload-config", "llama3-8b", "--ssd-offload-policy", "adaptive",
                      "--ssd-offload-activation-budget", "0.35", "--micro-batch-size", "8",
                      "--global-batch-size", "4096"], gpus=512, per_node=8, host_per_gpu=150 * GB)
    shape = out["model"]
    assert shape["dp"] == 512 // (shape["tp"] * shape["pp"] * shape["cp"])
    assert out["settings"]["num_micro_batches"] == 4096 // (8 * shape["dp"])


def test_3_adaptive_without_a_budget_where_keep_does_not_fit_runs_the_plans_budget(
        capsys, monkeypatch, tmp_path):
    """The runtime's adaptive policy keeps every layer without a budget (cache/adaptive.py);
    where that does not fit, the job runs with the plan's budget (what the model state leaves),
    the same for the three (issue 66: it was planned keep, which does not fit). Broken variant
    (planned keep): every place 'keep', no budget."""
    out = three_ways(capsys, monkeypatch, tmp_path,
                     ["--ssd-offload-config", "llama3-8b", "--ssd-offload-policy", "adaptive",
                      "--micro-batch-size", "4", "--global-batch-size", "512"],
                     gpus=64, per_node=8, host_per_gpu=150 * GB)
    assert out["planned_policy"] == "adaptive" and set(out["settings"]["places"]) != {"keep"}
    assert out["settings"]["activation_budget_bytes"] == out["budget_bytes"]
    (note,) = [n for n in out["notes"] if n.startswith("policy adaptive without a budget")]
    assert "do not fit" in note and "activation_budget_bytes" in note


def test_4_a_gh200_is_planned_as_a_gh200_with_its_gpu_memory(capsys, monkeypatch, tmp_path):
    """--ssd-offload-node gh200 (plan: the same flag after --): the 0.35 budget is of 96 GB.
    Broken variant (the launcher's node the preset's or dgx-h100): a budget of 28.0 GB."""
    out = three_ways(capsys, monkeypatch, tmp_path,
                     ["--ssd-offload-config", "llama3-70b", "--ssd-offload-node", "gh200",
                      "--micro-batch-size", "4", "--global-batch-size", "64"],
                     gpus=64, per_node=1, host_per_gpu=288 * GB)
    assert out["node"]["name"] == "gh200"
    assert out["settings"]["activation_budget_bytes"] == round(0.35 * out["node"]["gpu_memory_bytes"])


def test_5_the_preflight_counts_the_global_batch(capsys, monkeypatch, tmp_path):
    """At --global-batch-size 16 (2 micro-batches, pp 4) the three plan 2 micro-batches.
    Broken variant (the pre-flight ignoring the global batch): 4 (the pipeline's depth)."""
    out = three_ways(capsys, monkeypatch, tmp_path,
                     ["--ssd-offload-config", "llama3-70b", "--micro-batch-size", "4",
                      "--global-batch-size", "16"], gpus=64, per_node=8, host_per_gpu=150 * GB)
    assert out["settings"]["num_micro_batches"] == 2


def test_6_context_parallel_sequence_parallel_and_recompute_flags_are_planned(capsys, monkeypatch,
                                                                                tmp_path):
    """TP8 PP2 CP2 with selective recompute and no sequence parallelism on a whole Megatron
    command line: the model planned is that one. Broken variant (the flags ignored): cp 1."""
    from ssdtrain_megatron.megatron.preset_flags import megatron_args_from_preset

    args = megatron_args_from_preset("llama3-70b")
    args = [a for a in args if a != "--sequence-parallel"]
    args += ["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "2",
             "--context-parallel-size", "2", "--recompute-granularity", "selective",
             "--micro-batch-size", "2", "--global-batch-size", "64",
             "--ssd-offload-config", "llama3-70b"]
    out = three_ways(capsys, monkeypatch, tmp_path, args, gpus=64, per_node=8,
                     host_per_gpu=150 * GB)
    m = out["model"]
    assert (m["tp"], m["pp"], m["cp"], m["sequence_parallel"], m["recompute"], m["dp"]) == \
        (8, 2, 2, False, "selective", 2)


def test_7_pinned_staging_comes_out_of_host_memory_before_the_pool(capsys, monkeypatch, tmp_path):
    """--ssd-offload-pinned-staging-bytes 19.6 GB on 21 GB per GPU: the pool is at most what is
    left, in the plan as in the job. Broken variant (staging not subtracted in the plan): the
    plan's pool 21 GB, the job's 1.4 GB."""
    staging = 19_600_000_000
    out = three_ways(capsys, monkeypatch, tmp_path,
                     ["--ssd-offload-config", "llama3-8b-128k", "--ssd-offload-pinned-staging-bytes",
                      str(staging), "--micro-batch-size", "1", "--global-batch-size", "8"],
                     gpus=16, per_node=8, host_per_gpu=21 * GB)
    s = out["settings"]
    assert s["staging_bytes"] == staging
    assert s["host_pool_bytes"] <= 21 * GB - staging


def test_8_the_free_space_check_counts_only_what_the_plan_puts_on_the_drives(monkeypatch, tmp_path):
    """With host memory for the whole plan (tiered, nothing on the SSD) the pre-flight holds
    nothing against the drive. Broken variant (every offloaded byte counted, as on main):
    18.8 GiB per GPU."""
    monkeypatch.setenv("SSDTRAIN_HOST_MEMORY_FREE", f"{free_for(150 * GB, 8)}B")
    got = read_launch(["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "4",
                       "--micro-batch-size", "4", "--global-batch-size", "64", "--seq-length",
                       "8192", "--ssd-offload", "--ssd-offload-config", "llama3-70b",
                       "--ssd-offload-dir", str(tmp_path)], local_ranks=8, world=64)
    assert got.config.engine == "tiered" and "ssd" not in got.settings.places
    assert disk_peak_bytes(got) == 0


def test_9_without_a_micro_batch_count_both_plan_the_pipelines_depth_and_say_so(capsys, monkeypatch,
                                                                                 tmp_path):
    """No --global-batch-size on the flag group alone: plan and pre-flight plan pp
    micro-batches, and a note says so. Broken variant (plan assuming 1 as on main): x1.000."""
    out = three_ways(capsys, monkeypatch, tmp_path,
                     ["--ssd-offload-config", "llama3-70b", "--micro-batch-size", "4"],
                     gpus=64, per_node=8, host_per_gpu=150 * GB)
    assert out["settings"]["num_micro_batches"] == out["model"]["pp"] == 4
    assert any("micro-batches per iteration not given" in n for n in out["notes"])
    assert main(["plan", "--config", "llama3-70b", "--micro-batch-size", "4", "--json"]) == 0
    own = json.loads(capsys.readouterr().out)
    assert own["settings"]["num_micro_batches"] == 4 and own["notes"] == out["notes"]


@pytest.mark.parametrize("args, gpus, says", [
    (["--ssd-offload-engine", "tiered", "--ssd-offload-host-memory-bytes", "200GB"], 64,
     ("--ssd-offload-host-memory-bytes: a host pool of 200.0 GB is more than the 141.4 GB of "
      "host memory per rank left after 8.6 GB of pinned staging", "at most 141.4 GB fits")),
    (["--ssd-offload-engine", "memory", "--ssd-offload-pinned-staging-bytes", "160GB"], 64,
     ("pinned staging of 160.0 GB (pinned_staging_bytes, set by --ssd-offload-pinned-staging-bytes) leaves no host pool in "
      "the 150.0 GB of host memory per rank", "at most 150.0 GB of staging fits")),
    (["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "4"], 48,
     ("the world size 48 is not a multiple of --tensor-model-parallel-size 8 x "
      "--pipeline-model-parallel-size 4 x --context-parallel-size 1 = 32: 32 GPUs would fit",)),
])
def test_a_job_that_cannot_run_is_refused_in_one_line_by_plan_and_preflight_alike(
        capsys, monkeypatch, tmp_path, args, gpus, says):
    """A pool larger than the host memory there is, staging that leaves no pool, a layout that
    does not divide the GPUs: plan and the pre-flight refuse alike, naming the flag and what
    would fit. Broken variant (plan/job.py's _check_host left out): plan exits 0."""
    argv = ["--ssd-offload", "--ssd-offload-config", "llama3-70b", "--ssd-offload-dir",
            str(tmp_path), "--micro-batch-size", "1", *args]
    assert main(["plan", "--gpus", str(gpus), "--host-memory", "150GB", "--", *argv]) == 2
    planned = capsys.readouterr().err.splitlines()
    monkeypatch.setenv("SSDTRAIN_HOST_MEMORY_FREE", f"{free_for(150 * GB, 8)}B")
    assert main(["doctor", "--preflight", "--nproc-per-node", "8", "--nnodes", str(gpus // 8),
                 "--", *argv]) == 2
    checked = capsys.readouterr().err.splitlines()
    assert len(planned) == len(checked) == 1
    assert planned[0].startswith("ssdtrain plan: error: ")
    assert checked[0].startswith("ssdtrain doctor: error: node ")
    for part in says:
        assert part in planned[0] and part in checked[0], (part, planned, checked)
