"""The engine follows the node (issue 49): where neither the preset nor a flag names the engine,
a job runs tiered (adaptive, recompute as the fallback) where host memory is to spare and posix
where it is not, and says which and why in one line. The rule (plan/engine_choice.py) on
numbers, the measured side (megatron/host_memory.py) on fake /proc and cgroup files, and the
launcher's pre-flight (megatron/preflight.py) on real presets with the measurement replaced
by SSDTRAIN_HOST_MEMORY_FREE. The launcher under torchrun: tests/test_engine_follows_node.py."""

from __future__ import annotations

import pytest

from ssdtrain_megatron.config import OffloadConfig
from ssdtrain_megatron.megatron import host_memory
from ssdtrain_megatron.megatron.preflight import FlagError, check, read_launch
from ssdtrain_megatron.plan.engine_choice import (HostNeed, choose_engine, free_per_rank,
                                                  host_need)
from ssdtrain_megatron.plan.model import peak_disk_bytes
from ssdtrain_megatron.plan.node import load_profile
from ssdtrain_megatron.io.layout import Identity
from tests.test_plan_model import LAYER_BYTES, PRESET

GB = 10 ** 9
NEED = HostNeed(planned_bytes=60 * GB, layer_bytes=GB)


def test_with_host_memory_to_spare_tiered_runs_adaptive_with_recompute_and_a_pool_the_plan_needs():
    """With a budget to place within (the preset's activation_budget_bytes). Broken variant (the
    pool left at host_memory_bytes' 4 GiB): 'host_memory_bytes': 4294967296."""
    budget = OffloadConfig(activation_budget_bytes=0.35)
    choice = choose_engine({"activation_budget_bytes": "the preset"}, budget, 150 * GB,
                           "1.2 TB host memory free", NEED)
    assert choice.engine == "tiered" and choice.followed
    assert choice.changes == {"engine": "tiered", "policy": "adaptive", "recompute_fallback": True,
                              "host_memory_bytes": 61 * GB}  # the plan's 60 GB and one layer more
    assert choice.reason == ("engine tiered: 1.2 TB host memory free, 60.0 GB per rank planned: a "
                             "host pool of 61.0 GB of 150.0 GB per rank; policy adaptive, recompute "
                             "fallback on")
    deepspeed = choose_engine({}, budget, 150 * GB, "free", NEED, recompute=False)
    assert deepspeed.changes["recompute_fallback"] is False  # it refuses the fallback


def test_without_a_budget_tiered_offloads_every_layer_as_the_offload_policy_does():
    """The adaptive policy without a budget keeps everything (cache/adaptive.py): --ssd-offload
    alone would then offload nothing. Broken variant (adaptive regardless): 'policy': 'adaptive'."""
    choice = choose_engine({}, OffloadConfig(), 150 * GB, "free", NEED)
    assert choice.changes == {"engine": "tiered", "policy": "offload", "recompute_fallback": False,
                              "host_memory_bytes": 61 * GB}
    assert choice.reason.endswith("policy offload, recompute fallback off")


def test_without_room_for_one_layer_posix_runs_as_before_and_says_why():
    """Broken variant (the comparison turned round, '<='): tiered with a pool of 0.5 GB."""
    choice = choose_engine({}, OffloadConfig(), GB // 2, "4.0 GB host memory free", NEED)
    assert (choice.engine, choice.changes) == ("posix", {})
    assert choice.reason == ("engine posix: 4.0 GB host memory free, 500.0 MB per rank for offload, "
                             "less than one layer's activations (1.0 GB)")


def test_the_pool_never_takes_more_than_is_free_per_rank():
    choice = choose_engine({}, OffloadConfig(), 30 * GB, "free", NEED)
    assert choice.changes["host_memory_bytes"] == 30 * GB


def test_what_the_preset_or_a_flag_sets_is_left_as_it_is():
    """policy, recompute_fallback and host_memory_bytes given: only the engine follows the node;
    a given pool larger than what is free is posix, naming the pool."""
    config = OffloadConfig(policy="offload", recompute_fallback=False, host_memory_bytes=8 * GB)
    given = {"policy": "the preset", "recompute_fallback": "the preset",
             "host_memory_bytes": "--ssd-offload-host-memory-bytes"}
    choice = choose_engine(given, config, 150 * GB, "free", NEED)
    assert choice.changes == {"engine": "tiered"}
    assert choice.reason.endswith("a host pool of 8.0 GB of 150.0 GB per rank; policy offload, "
                                  "recompute fallback off")
    short = choose_engine(given, config, 6 * GB, "free", NEED)
    assert short.engine == "posix" and short.reason.endswith("less than the 8.0 GB host pool "
                                                             "(host_memory_bytes)")


def test_without_a_model_to_plan_the_pool_must_fit_in_what_is_free():
    config = OffloadConfig()  # host_memory_bytes 4 GiB
    assert choose_engine({}, config, 5 * GB, "free").engine == "tiered"
    small = choose_engine({}, config, 4 * GB, "free")
    assert small.engine == "posix" and "less than the 4.3 GB host pool" in small.reason
    assert "no preset model to plan with" in choose_engine({}, config, 5 * GB, "free").reason


def test_free_per_rank_leaves_a_quarter_and_each_ranks_staging():
    assert free_per_rank(800 * GB, 8, 2 * GB) == 73 * GB
    assert free_per_rank(GB, 8, 2 * GB) == 0


def test_the_plan_need_is_what_the_tiered_plan_puts_in_host_memory(tmp_path):
    """The tiny preset's stage with policy offload: every layer but the last goes to host memory
    while it has room (three layers of one live micro-batch), none where it has no room."""
    from ssdtrain_megatron.tools.plan.cli import read_preset

    path = tmp_path / "tiny.yaml"
    path.write_text(PRESET)
    shape, offload = read_preset(str(path))
    node = load_profile("dgx-h100")
    need = host_need(shape, offload, node, 1, 100 * GB, "offload", False)
    assert need == HostNeed(3 * LAYER_BYTES, LAYER_BYTES)
    assert host_need(shape, offload, node, 1, LAYER_BYTES - 1, "offload", False).planned_bytes == 0


# -- the measured side ------------------------------------------------------------------------


def test_mem_available_and_the_cgroup_limit_are_read_from_their_files(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683784 kB\nMemAvailable:   1000 kB\n")
    assert host_memory.mem_available(str(meminfo)) == 1000 * 1024
    assert host_memory.mem_available(str(tmp_path / "none")) is None
    cg = tmp_path / "cgroup"
    (cg / "memory" / "job7").mkdir(parents=True)
    (cg / "memory" / "job7" / "memory.limit_in_bytes").write_text("8000\n")
    (cg / "memory" / "job7" / "memory.usage_in_bytes").write_text("3000\n")
    proc = tmp_path / "self-cgroup"
    proc.write_text("5:cpu:/\n4:memory:/job7\n")
    assert host_memory.cgroup_room(str(proc), str(cg)) == 5000
    (cg / "memory" / "job7" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert host_memory.cgroup_room(str(proc), str(cg)) is None  # v1's "no limit"
    v2 = tmp_path / "v2"
    (v2 / "slurm").mkdir(parents=True)
    (v2 / "slurm" / "memory.max").write_text("max\n")
    (v2 / "slurm" / "memory.current").write_text("10\n")
    proc.write_text("0::/slurm\n")
    assert host_memory.cgroup_room(str(proc), str(v2)) is None
    (v2 / "slurm" / "memory.max").write_text("110\n")
    assert host_memory.cgroup_room(str(proc), str(v2)) == 100


def test_a_cgroup_limit_below_mem_available_is_what_is_free(monkeypatch):
    """Slurm's --mem: the kernel's MemAvailable is the node's, the job may take less. Broken
    variant (measure ignoring the cgroup): 'MemAvailable' 64 GB."""
    monkeypatch.setattr(host_memory, "mem_available", lambda: 64 * GB)
    monkeypatch.setattr(host_memory, "cgroup_room", lambda: 16 * GB)
    assert host_memory.measure({"LOCAL_WORLD_SIZE": "2"}) == \
        host_memory.HostMemory(16 * GB, 2, "the memory cgroup's limit")
    monkeypatch.setattr(host_memory, "cgroup_room", lambda: None)
    assert host_memory.measure({}) == host_memory.HostMemory(64 * GB, 1, "MemAvailable")
    monkeypatch.setattr(host_memory, "mem_available", lambda: None)
    assert host_memory.measure({}) is None


def test_the_environment_names_the_local_ranks_and_may_replace_the_measurement():
    assert host_memory.local_ranks({"LOCAL_WORLD_SIZE": "8"}) == 8
    assert host_memory.local_ranks({"SLURM_NTASKS_PER_NODE": "4(x2)"}) == 4
    assert host_memory.local_ranks({}) == 1
    measured = host_memory.measure({"SSDTRAIN_HOST_MEMORY_FREE": "1.2TB", "LOCAL_WORLD_SIZE": "8"})
    assert measured == host_memory.HostMemory(1_200_000_000_000, 8, "$SSDTRAIN_HOST_MEMORY_FREE")
    assert measured.describe() == ("1.2 TB host memory free ($SSDTRAIN_HOST_MEMORY_FREE) for 8 "
                                   "local rank(s)")
    with pytest.raises(ValueError, match="SSDTRAIN_HOST_MEMORY_FREE='lots' is invalid: expected a size"):
        host_memory.measure({"SSDTRAIN_HOST_MEMORY_FREE": "lots"})


# -- where a job starts: the launcher's pre-flight on the presets -------------------------------


def _launch(*flags, free="1.9TB", ranks="8"):
    return read_launch(["--ssd-offload", *flags],
                       environ={"SSDTRAIN_HOST_MEMORY_FREE": free, "LOCAL_WORLD_SIZE": ranks})


def test_a_preset_on_a_dgx_class_node_runs_tiered_and_on_a_small_one_posix():
    """llama3-70b names no engine: on 1.9 TB free for 8 ranks its plan puts about 67 GB per rank
    in host memory (micro-batch 4); on 92 GB free, the 8.6 GB of pinned staging per rank leave
    less than one layer, and posix runs, saying why (on 4 GB free the staging alone does not
    fit: refused, issue 66)."""
    big = _launch("--ssd-offload-config", "llama3-70b", "--micro-batch-size", "4")
    assert (big.config.engine, big.config.policy, big.config.recompute_fallback) == ("tiered", "adaptive", True)
    assert 60 * GB < big.config.host_memory_bytes < 170 * GB
    assert big.choice.reason.startswith("engine tiered: 1.9 TB host memory free "
                                        "($SSDTRAIN_HOST_MEMORY_FREE) for 8 local rank(s), ")
    small = _launch("--ssd-offload-config", "llama3-70b", free="92GB")
    assert small.config.engine == "posix" and small.config.host_memory_bytes == 4 << 30
    assert "35.1 MB per rank for offload, less than one layer's activations (281.0 MB)" in small.choice.reason


def test_a_named_engine_is_honoured_whatever_the_node():
    """Broken variant (given_fields ignoring the flags): engine tiered for --ssd-offload-engine posix."""
    forced = _launch("--ssd-offload-config", "llama3-70b", "--ssd-offload-engine", "posix")
    assert forced.config.engine == "posix" and not forced.choice.followed
    assert forced.choice.reason == "engine posix: named by --ssd-offload-engine (posix)"
    assert forced.config == OffloadConfig.from_yaml(forced.preset).replace(engine="posix")
    tiny = _launch("--ssd-offload-config", "cpu-tiny")  # the demo's preset names posix
    assert tiny.choice.reason == "engine posix: named by the preset (posix)"


def test_a_bad_measurement_override_is_one_line():
    with pytest.raises(FlagError, match="SSDTRAIN_HOST_MEMORY_FREE='x' is invalid"):
        _launch(free="x")


def test_the_free_space_check_counts_the_host_pool_the_node_chose(tmp_path):
    """The drive must hold the peak less the pool: a drive too small for posix is enough for
    tiered. Broken variant (the pre-flight not resolving the engine): a problem for both."""
    root = tmp_path / "ssd"
    root.mkdir()
    preset = tmp_path / "p.yaml"
    preset.write_text(PRESET.replace("  dirs: [/tmp/ssdtrain]\n", "").replace("  engine: posix\n", ""))
    flags = ["--ssd-offload-config", str(preset), "--ssd-offload-dir", f"{root}/{{job}}",
             "--ssd-offload-allow-system-disk"]
    tiered = _launch(*flags)
    assert tiered.config.engine == "tiered"
    posix = _launch(*flags, "--ssd-offload-engine", "posix")
    peak = peak_disk_bytes(posix.shape, posix.config.keep_last_layers)
    assert peak > 0 and tiered.config.host_memory_bytes >= peak
    ranks = [Identity(lr, lr, "node-a", "77") for lr in range(1)]
    import ssdtrain_megatron.megatron.preflight as preflight

    real = preflight.free_bytes
    try:
        preflight.free_bytes = lambda path: peak - 1  # a drive just too small for the peak
        assert check(tiered, ranks) == []
        (problem,) = check(posix, ranks)
        assert "of activations there at the peak of a step" in problem.what
    finally:
        preflight.free_bytes = real


def test_without_a_preset_the_model_megatron_trains_is_planned():
    """No preset: the shape comes from Megatron's parsed arguments, and the pool is what its plan
    (policy offload: every layer but the last) puts in host memory and one layer more; without
    Megatron's shape (the flag group alone) the pool is host_memory_bytes. Broken variant
    (megatron_model returning None): a pool of 4 GiB."""
    import argparse

    from ssdtrain_megatron.megatron.args import add_ssd_offload_args
    from ssdtrain_megatron.megatron.follow_node import settings_from_args
    from ssdtrain_megatron.plan.model import ModelShape, SaveProfile, layer_activation_bytes

    def job_settings(args, host):
        settings = settings_from_args(args, host)
        return settings.config, settings.choice

    parser = add_ssd_offload_args(argparse.ArgumentParser())
    args = parser.parse_args(["--ssd-offload"])
    host = host_memory.HostMemory(100 * GB, 2)
    alone, choice = job_settings(args, host)
    assert alone.host_memory_bytes == 4 << 30 and "no preset model to plan with" in choice.reason
    megatron = dict(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                    seq_length=32, micro_batch_size=2, tensor_model_parallel_size=1,
                    pipeline_model_parallel_size=1, transformer_impl="local", bf16=True,
                    attention_dropout=0.0, hidden_dropout=0.0)
    config, choice = job_settings(argparse.Namespace(**vars(args), **megatron), host)
    layer = layer_activation_bytes(ModelShape(num_layers=4, hidden=64, heads=4, ffn_hidden=256,
                                              seq_len=32, micro_batch=2, attention_dropout=0.0,
                                              hidden_dropout=0.0), SaveProfile.paper())
    assert (config.engine, config.policy, config.host_memory_bytes) == ("tiered", "offload", 4 * layer)
    assert f"{3 * layer / 1e3:.1f} kB per rank planned" in choice.reason


def test_where_host_memory_cannot_be_measured_posix_runs_and_says_so():
    from ssdtrain_megatron.plan.job import Job, job_settings

    settings = job_settings(Job(OffloadConfig(), {}, None, load_profile("dgx-h100"), None))
    config, choice = settings.config, settings.choice
    assert config == OffloadConfig() and choice.engine == "posix"
    assert choice.reason == ("engine posix: host memory cannot be measured here (no "
                             "/proc/meminfo); --ssd-offload-engine tiered uses it")


def test_the_launchers_hooks_measure_before_megatron_and_refuse_a_bad_override(monkeypatch, tmp_path):
    """The hooks measure when applied (before Megatron starts); a bad SSDTRAIN_HOST_MEMORY_FREE
    stops the job at install in one line, and only with --ssd-offload. Broken variant (the
    override ignored at apply): no LaunchError."""
    import dataclasses

    from ssdtrain_megatron.megatron import launch
    from tests.test_args_launcher import _fake_megatron

    calls = []
    state, training, _ = _fake_megatron(monkeypatch, calls)
    target = dataclasses.replace(launch.MEGATRON_LM, installer="fake_installer")
    monkeypatch.setenv("SSDTRAIN_HOST_MEMORY_FREE", "plenty")
    state["argv"] = ["--num-layers", "2", "--ssd-offload", "--ssd-offload-dir", str(tmp_path)]
    with pytest.raises(launch.LaunchError, match="SSDTRAIN_HOST_MEMORY_FREE='plenty' is invalid"):
        with launch.TrainingHooks(target):
            training.initialize_megatron()
    state["argv"] = ["--num-layers", "2"]
    with launch.TrainingHooks(target):
        training.initialize_megatron()  # no offload: the override is not read
    monkeypatch.setenv("SSDTRAIN_HOST_MEMORY_FREE", "4GB")  # one rank: 3 GB, 2.1 GB staging
    state["argv"] = ["--num-layers", "2", "--ssd-offload", "--ssd-offload-dir", str(tmp_path)]
    with launch.TrainingHooks(target):
        training.initialize_megatron()
    config = [c for c in calls if isinstance(c, tuple)][-1][1]
    assert config.engine == "posix"  # 0.9 GB after staging: less than the 4 GiB pool
