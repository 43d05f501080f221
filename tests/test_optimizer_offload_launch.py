"""megatron-core's optimizer CPU offload with ours (issue 67, item 4): ``--ssd-offload`` with
``--optimizer-cpu-offload`` is accepted, and ``ssdtrain plan -- ARGS``, the pre-flight (every
local rank) and the launcher's install path read the optimizer flags through the one sequence
(plan/job.py rule 0): they agree on the host memory the optimizer leaves for activations, and
refuse in the same one line a node that cannot hold both. megatron-core's HybridDeviceOptimizer
itself needs CUDA tensors (and Transformer Engine for the precision-aware path), so it does not
run here: the flags, the settings and the host-memory accounting do, through the real CLIs and
the launcher's real install_from_args (tests/test_one_sequence.py's installer, which returns
the config)."""

from __future__ import annotations

import json

import pytest

from ssdtrain_megatron.megatron.host_memory import HostMemory
from ssdtrain_megatron.megatron.launch import LaunchError
from ssdtrain_megatron.megatron.preset_flags import megatron_args_from_preset
from ssdtrain_megatron.tools.cli import main
from tests.test_one_sequence import GB, free_for, install_path, three_ways

PARAMS_PER_GPU = 8_687_878_144
"""Llama 3 70B at TP8 PP1, the first stage: 80 layers' and the word embeddings' parameters / 8
(plan/memory.py parameters_per_gpu)."""
STAGING = 2 * 4_294_967_296
"""The preset's pinned staging: twice its max_inflight_bytes."""


def _args(*optimizer: str) -> list:
    """llama3-70b as a whole Megatron command line at TP8 PP1 (one DGX), global batch 16."""
    args = megatron_args_from_preset("llama3-70b")
    at = args.index("--pipeline-model-parallel-size")
    args[at + 1] = "1"
    return [*args, "--global-batch-size", "16", "--ssd-offload-config", "llama3-70b",
            "--ssd-offload-activation-budget", "6GB", *optimizer]


OFFLOAD = ("--use-precision-aware-optimizer", "--optimizer-cpu-offload",
           "--optimizer-offload-fraction", "0.85", "--overlap-cpu-optimizer-d2h-h2d")


def test_plan_preflight_and_install_leave_the_same_host_memory_for_activations(
        capsys, monkeypatch, tmp_path):
    """0.85 of 8.69 B parameters at 18 B each (fp32 main weights and Adam states, the pinned
    fp32 gradient and the pinned first copy) is 132.92 GB of the 150 GB per GPU: the plan's host
    capacity is what is left after it and the pinned staging, and the three doors hold the same
    pool. Broken variant (rule 0 left out of job_settings): the three agree but on a pool of
    17.4 GB above a capacity of 8.5 GB (the plan subtracts, the settings do not)."""
    out = three_ways(capsys, monkeypatch, tmp_path, _args(*OFFLOAD), gpus=8, per_node=8,
                     host_per_gpu=150 * GB)
    taken = int(0.85 * PARAMS_PER_GPU * 18)
    assert out["optimizer_offload"]["host_bytes"] == taken == 132_924_535_603
    assert out["host_capacity_bytes"] == 150 * GB - taken - STAGING
    assert out["settings"]["host_pool_bytes"] <= out["host_capacity_bytes"]
    assert out["settings"]["staging_bytes"] == STAGING
    reason = out["engine_choice"]["reason"]
    assert "less 132.9 GB for megatron-core's optimizer CPU offload" in reason
    assert out["model"]["optimizer_offload_fraction"] == 0.85
    assert out["model"]["overlap_optimizer_d2h_h2d"] is True


def test_without_the_optimizer_flag_the_host_memory_is_ours(capsys, monkeypatch, tmp_path):
    """The same job without --optimizer-cpu-offload (it does not fit the GPU then, so the plan
    refuses it): the door reads no fraction. Broken variant (the fraction's Megatron default
    1.0 taken without the flag): fraction 1.0."""
    from ssdtrain_megatron.megatron.follow_node import megatron_namespace, optimizer_fields

    ns = megatron_namespace(_args(), 8)
    assert optimizer_fields(ns) == {"main_grad_bytes": 4, "optimizer_offload_fraction": 0.0}
    ns = megatron_namespace(_args("--main-grads-dtype", "bf16", *OFFLOAD), 8)
    assert optimizer_fields(ns) == {"main_grad_bytes": 2, "optimizer_offload_fraction": 0.85,
                                    "overlap_optimizer_d2h_h2d": True}


def _refusals(capsys, monkeypatch, tmp_path, args: list) -> list:
    """The one-line refusal of plan, the pre-flight and install for ``args`` (8 GPUs, 150 GB)."""
    argv = ["--ssd-offload", "--ssd-offload-dir", str(tmp_path), "--ssd-offload-allow-system-disk",
            *args]
    assert main(["plan", "--gpus", "8", "--host-memory", f"{150 * GB}B", "--", *argv]) == 2
    planned = capsys.readouterr().err.strip().splitlines()
    free = free_for(150 * GB, 8)
    monkeypatch.setenv("SSDTRAIN_HOST_MEMORY_FREE", f"{free}B")
    assert main(["doctor", "--preflight", "--nproc-per-node", "8", "--nnodes", "1", "--",
                 *argv]) != 0
    checked = capsys.readouterr()
    with pytest.raises(LaunchError) as exc:
        install_path(argv, 8, HostMemory(free, 8, "$SSDTRAIN_HOST_MEMORY_FREE"))
    return [planned, checked.out + checked.err, str(exc.value)]


def test_a_node_that_cannot_hold_the_optimizer_and_the_staging_is_refused_in_one_line(
        capsys, monkeypatch, tmp_path):
    """Fraction 1: 156.4 GB of optimizer state per GPU on 150 GB. Plan, pre-flight and install
    say the same line, with the fraction that fits. Broken variant (rule 0 left out of
    job_settings): plan exits 1, not 2 with this line."""
    planned, checked, installed = _refusals(
        capsys, monkeypatch, tmp_path,
        _args("--use-precision-aware-optimizer", "--optimizer-cpu-offload"))
    line = ("--optimizer-offload-fraction 1 puts 156.4 GB of optimizer state in host memory per "
            "rank, which with 8.6 GB of pinned staging is more than the 150.0 GB there is")
    assert line in installed and "at most 0.9 fits" in installed
    assert len(planned) == 1 and line in planned[0] and "at most 0.9 fits" in planned[0]
    assert line in checked


def test_optimizer_offload_without_the_precision_aware_optimizer_is_refused(
        capsys, monkeypatch, tmp_path):
    """Megatron runs --optimizer-cpu-offload only with --use-precision-aware-optimizer (and so
    the distributed optimizer): refused before Megatron would assert. Broken variant (no such
    check in follow_node.optimizer_fields): the host-memory refusal comes instead."""
    planned, checked, installed = _refusals(capsys, monkeypatch, tmp_path,
                                            _args("--optimizer-cpu-offload"))
    line = ("--optimizer-cpu-offload needs --use-precision-aware-optimizer (megatron-core steps "
            "the offloaded part with its precision-aware distributed optimizer): add "
            "--use-precision-aware-optimizer")
    assert line in installed and line in planned[0] and line in checked
