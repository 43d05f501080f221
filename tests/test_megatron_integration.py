"""ssdtrain_megatron.megatron on real megatron-core (CPU, gloo, real processes).

Every layout trains three iterations (several micro-batches, Adam step) three times in the same
processes: plain, with install() (offload to two roots), and plain again after uninstall().
Offloaded training must be bitwise identical to plain training, every rank must offload, files
must stay in each rank's own directories and be gone after each step and after close, and
uninstall() must leave megatron as it was.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

pytest.importorskip("megatron.core")

# megatron-core's own deprecation notes (tp_group=None, ...) and "Apex is not installed".
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron.*"),
              pytest.mark.filterwarnings("ignore::UserWarning:megatron.*")]

import megatron_harness as harness  # noqa: E402
from megatron_harness import LAYOUTS, LayoutSpec, Phase  # noqa: E402

from ssdtrain_megatron import OffloadConfig  # noqa: E402
from ssdtrain_megatron import megatron as integration  # noqa: E402

OFFLOAD = dict(dirs=["{root}/a", "{root}/b"], policy="offload", min_tensor_bytes=0)
PHASES = [Phase("plain"), Phase("offload", offload=OFFLOAD), Phase("after_uninstall")]


# Layers each rank runs (megatron's global, 1-based layer numbers), in forward order.
EXPECTED_LAYERS = {
    "tp1_pp1": [[1, 2, 3, 4]],
    "tp2": [[1, 2, 3, 4], [1, 2, 3, 4]],
    "pp2_1f1b": [[1, 2], [3, 4]],
    "pp2_interleaved_vp2": [[1, 3], [2, 4]],
    "recompute_full_uniform": [[1, 3]],  # one checkpoint per 2 layers, named by its first
    "recompute_full_block": [[1, 2, 3, 4]],
    "recompute_selective": [[1, 2, 3, 4]],
    "recompute_selective_mlp": [[1, 2, 3, 4]],
    "recompute_selective_layernorm": [[1, 2, 3, 4]],
    "pp2_recompute_full": [[1, 2], [3, 4]],
    "moe_ep2_allgather": [[1, 2], [1, 2]],
    "moe_ep2_alltoall_recompute_selective": [[1, 2], [1, 2]],
    "moe_ep2_recompute_full": [[1, 2], [1, 2]],
    "moe_ep2_pp2": [[1, 2], [1, 2], [3, 4], [3, 4]],
    "mla": [[1, 2, 3, 4]],
    "mla_tp2": [[1, 2, 3, 4], [1, 2, 3, 4]],
    "mla_recompute_up_proj": [[1, 2, 3, 4]],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache = {}

    def get(layout):
        if layout not in cache:
            spec = dataclasses.replace(LAYOUTS[layout], phases=list(PHASES))
            workdir = str(tmp_path_factory.mktemp(layout))
            results = harness.run_layout(spec, workdir)
            leftovers = [os.path.join(d, f)
                         for d, _, files in os.walk(os.path.join(workdir, "offload_root"))
                         for f in files]
            cache[layout] = (results, leftovers)
        return cache[layout][0]

    get.leftovers = lambda layout: cache[layout][1]
    return get


def _under(path: str, directory: str) -> bool:
    return os.path.commonpath([path, directory]) == directory


NOTHING_TO_OFFLOAD = {
    # The last stage under full recompute saves each layer's checkpointed input, which the 1F1B
    # schedule holds in input_tensors until that micro-batch's backward (registered as held:
    # passes through), and its last layer, kept (keep_last_layers). From the second step on it
    # writes nothing; the first writes a few small tensors it then finds alive at backward and
    # learns are held (cache/held.py).
    "pp2_recompute_full": {1: "last stage, full recompute"},
}


@pytest.mark.parametrize("layout", harness.layout_params())
def test_offloaded_training_is_bitwise_equal_to_plain_training(layout, runs):
    read = {}
    for r in runs(layout):
        assert harness.phase_differences(r.phases["plain"], r.phases["offload"]) == [], r.rank
        read[r.rank] = sum(s["bytes_read"] for s in r.phases["offload"].offload["steps"])
    # Equality alone could come from tensors that never left: every rank read bytes back,
    # but where the layout leaves nothing to offload (see NOTHING_TO_OFFLOAD).
    assert all(n > 0 for rank, n in read.items() if rank not in NOTHING_TO_OFFLOAD.get(layout, {})), read
    assert sum(read.values()) > 0, read


@pytest.mark.parametrize("layout", harness.layout_params())
def test_written_bytes_earn_their_keep(layout, runs):
    """From the second step on, at most 5% of the bytes a rank writes are wasted (written,
    then never read back), in total and not only the part held by someone else: tensors the
    schedule holds until backward (its received input) pass through, the first step learns
    what the caller holds (the batch's labels, the causal mask, the rotary table: cache/held.py),
    and a tensor whose graph is freed before its deferred write starts (megatron's
    bias-dropout-add, run under torch.enable_grad inside a full-recompute checkpoint's no-grad
    forward) is released, not written. The harness lets queued writes finish before each
    backward (Phase.settle_writes), so writes under way at backward cost nothing here; the
    take-back of queued ones is tests/test_held.py.
    Broken variants: make HeldStorages.learn() a no-op: every step writes the mask, the rotary
    table and the labels again (tp1_pp1: ~8% held); drop the _drain() at the top of
    Transfers.submit_all (cache/transfers.py): pp2_recompute_full's last stage wastes 100% of
    what it writes (its layer-3 bias-dropout-add tensors)."""
    for r in runs(layout):
        steps = r.phases["offload"].offload["steps"]
        for s in steps:
            assert s["bytes_wasted"] == s["bytes_offloaded"] - s["bytes_read"], (r.rank, s)
            assert s["bytes_wasted_held"] <= s["bytes_wasted"], (r.rank, s)
            # Every wasted byte is counted by how and origin (StepStats.bytes_wasted_by_origin).
            assert sum(s["bytes_wasted_by_origin"].values()) == s["bytes_wasted"], (r.rank, s)
        later = steps[1:]
        written = sum(s["bytes_offloaded"] for s in later)
        wasted = sum(s["bytes_wasted"] for s in later)
        held = sum(s["bytes_wasted_held"] for s in later)
        assert held <= 0.05 * written, (r.rank, held, written)
        assert wasted <= 0.05 * written, (r.rank, wasted, written, [s["bytes_wasted"] for s in steps])
        assert all(s["tensors_held_by_schedule"] > 0 for s in later), (r.rank, later)


@pytest.mark.parametrize("layout", harness.layout_params())
def test_training_after_uninstall_matches_a_never_patched_run(layout, runs):
    for r in runs(layout):
        assert harness.phase_differences(r.phases["plain"], r.phases["after_uninstall"]) == []


@pytest.mark.parametrize("layout", harness.layout_params())
def test_every_rank_offloads_in_every_step_and_names_its_real_layers(layout, runs):
    spec = LAYOUTS[layout]
    for r in runs(layout):
        steps = r.phases["offload"].offload["steps"]
        assert len(steps) == spec.iterations
        for i, s in enumerate(steps):
            if r.rank in NOTHING_TO_OFFLOAD.get(layout, {}):
                assert i == 0 or s["bytes_offloaded"] == 0, (r.rank, s)  # writes freeing nothing
            else:
                assert s["bytes_offloaded"] > 0 and s["tensors_offloaded"] > 0, (r.rank, s)
            assert s["fallbacks"] == 0
            # The layers whose forward ran in a scope (a layer run only again in backward, inside
            # a checkpoint named by another, has a row of its recompute pass alone).
            layers = [int(row["layer"]) for row in s["layers"] if row["layer"] != "None" and row["forward_s"] > 0]
            assert sorted(layers) == EXPECTED_LAYERS[layout][r.rank]
            passes = {int(row["layer"]): row["recomputes"] for row in s["layers"] if row["layer"] != "None"}
            if (spec.recompute_granularity, spec.recompute_method) == ("full", "uniform"):
                # Megatron's uniform full recompute runs every layer of the rank again in
                # backward, once per micro-batch; each pass is timed under its own layer.
                ranks_layers = range(min(EXPECTED_LAYERS[layout][r.rank]), max(passes) + 1)
                assert all(passes.get(k) == spec.num_microbatches for k in ranks_layers), passes
            elif spec.recompute_granularity != "full":
                assert not any(passes.values()), passes  # selective recompute reruns no whole layer
            assert sum(row["bytes"] for row in s["layers"]) > 0


@pytest.mark.parametrize("layout", harness.layout_params())
def test_backward_order_prediction_matches_megatrons_schedule(layout, runs):
    spec = LAYOUTS[layout]
    for r in runs(layout):
        info = r.phases["offload"].offload
        assert info["steps_predicted"] == spec.iterations
        assert info["mispredictions"] == 0


@pytest.mark.parametrize("layout", harness.layout_params())
def test_files_stay_in_each_ranks_own_directories(layout, runs):
    results = runs(layout)
    dirs = {r.rank: r.phases["offload"].offload["rank_dirs"] for r in results}
    for rank, own in dirs.items():
        assert len(own) == len(OFFLOAD["dirs"])  # one per root
        for other_rank, other in dirs.items():
            if other_rank != rank:
                assert not any(_under(a, b) or _under(b, a) for a in own for b in other)
    seen = set()
    for r in results:
        seen.update(r.phases["offload"].offload["files_seen"])
    owners = {path: [rank for rank, own in dirs.items() if any(_under(path, d) for d in own)]
              for path in seen}
    assert all(len(o) == 1 for o in owners.values()), owners
    for rank in dirs:
        assert any(o == [rank] for o in owners.values()), f"rank {rank} wrote no file"


@pytest.mark.parametrize("layout", harness.layout_params())
def test_nothing_is_left_on_disk_after_each_step_or_after_close(layout, runs):
    for r in runs(layout):
        info = r.phases["offload"].offload
        for s in info["steps"]:
            assert s["bytes_on_disk"] == 0
        for files in info["files_after_step"]:
            # Bookkeeping (an owner marker) and an emptied, sparse slab may stay until close;
            # no block of activation data may.
            assert all(size <= 4096 or allocated == 0 for _, size, allocated in files), files
        assert info["files_after_close"] == []
        assert not any(os.path.exists(d) for d in info["rank_dirs"])
    assert runs.leftovers(layout) == []  # all ranks done: nothing anywhere under the roots


def test_recompute_fallback_runs_chosen_layers_under_checkpoint_bitwise(tmp_path):
    spec = LayoutSpec(phases=[
        Phase("plain"),
        Phase("fallback", offload=OFFLOAD, recompute_layers=[2, 3]),
    ])
    (r,) = harness.run_layout(spec, str(tmp_path))
    assert harness.phase_differences(r.phases["plain"], r.phases["fallback"]) == []
    info = r.phases["fallback"].offload
    assert info["fallback_layers_run"] == spec.iterations * spec.num_microbatches * 2
    for s in info["steps"]:
        decisions = {row["layer"]: row["decision"] for row in s["layers"]}
        assert decisions["2"] == decisions["3"] == "recompute"
        assert decisions["1"] == decisions["4"] == "offload"
        rows = {row["layer"]: row for row in s["layers"]}
        # A recomputed layer saves only its checkpoint inputs: far less than a stored layer.
        assert 0 < rows["2"]["bytes"] < rows["1"]["bytes"] / 4
        # Its recompute pass in backward is timed, once per micro-batch; a stored layer has none.
        assert rows["2"]["recomputes"] == rows["3"]["recomputes"] == spec.num_microbatches, rows
        assert rows["2"]["recompute_s"] > 0 and rows["1"]["recomputes"] == rows["4"]["recomputes"] == 0
    # Equality alone could come from tensors that never left: the offloaded layers came back.
    assert sum(s["bytes_read"] for s in info["steps"]) > 0, info["steps"]


# -- install() / uninstall() in this process ---------------------------------------------------


def _patch_points():
    """Every attribute install() replaces on this release, from compat's table; the indices
    used below: 4 forward_step, 6 get_forward_backward_func."""
    from megatron.core import pipeline_parallel, tensor_parallel
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from ssdtrain_megatron.megatron import compat

    release = compat.release_for(compat.megatron_core_version())
    recompute_owner, recompute_name, _ = compat.recompute_patch_point(release)
    points = [
        (TransformerLayer, "forward"), (recompute_owner, recompute_name),
        (tp_random, "checkpoint"), (tensor_parallel, "checkpoint"),
        (schedules, "forward_step"), (schedules, "backward_step"),
        (schedules, "get_forward_backward_func"),
        (pipeline_parallel, "get_forward_backward_func"),
    ]
    points += [(schedules, name) for name in release.backward_steps if name != "backward_step"]
    points.append((tp_random.CheckpointWithoutOutput, "checkpoint"))
    if not release.recompute_is_method:
        # 0.18+: the block imported the free function by name; that name is replaced too.
        from megatron.core.transformer import transformer_block

        points.append((transformer_block, recompute_name))
    return points


def test_uninstall_restores_every_patched_attribute_exactly(tmp_path):
    from megatron.core.pipeline_parallel import schedules

    # A module that imported the functions by name before install() holds its own references.
    user = types.ModuleType("user_training_script")
    user.forward_step = schedules.forward_step
    user.get_forward_backward_func = schedules.get_forward_backward_func
    sys.modules[user.__name__] = user
    try:
        points = _patch_points()
        before = [vars(owner)[name] for owner, name in points]
        offloader = integration.install(OffloadConfig(dirs=[str(tmp_path)], min_tensor_bytes=0))
        try:
            during = [vars(owner)[name] for owner, name in points]
            assert all(a is not b for a, b in zip(before, during))
            assert user.forward_step is schedules.forward_step is not before[4]
            assert user.get_forward_backward_func is schedules.get_forward_backward_func
            assert integration.installed().offloader is offloader
        finally:
            integration.uninstall()
        assert [vars(owner)[name] for owner, name in points] == before
        assert all(vars(owner)[name] is b for (owner, name), b in zip(points, before))
        assert user.forward_step is before[4] and user.get_forward_backward_func is before[6]
        assert integration.installed() is None
        assert os.listdir(tmp_path) == []  # uninstall() closed the offloader
        integration.uninstall()  # a second uninstall is a no-op
    finally:
        del sys.modules[user.__name__]


def test_install_twice_is_refused(tmp_path):
    integration.install(OffloadConfig(dirs=[str(tmp_path)]))
    try:
        with pytest.raises(RuntimeError, match="already"):
            integration.install(OffloadConfig(dirs=[str(tmp_path)]))
    finally:
        integration.uninstall()


@pytest.mark.parametrize("version", ["0.15.3", "0.21.0", "1.0.0"])
def test_unsupported_megatron_core_versions_fail_with_a_clear_message(version, monkeypatch):
    with pytest.raises(integration.UnsupportedMegatronVersion,
                       match=r"0\.16\.x, 0\.17\.x, 0\.18\.x, 0\.19\.x, 0\.20\.x"):
        integration.check_megatron_version(version)
    # The package's `install` attribute is the function; the module is only in sys.modules.
    install_module = importlib.import_module("ssdtrain_megatron.megatron.install")
    monkeypatch.setattr(install_module, "megatron_core_version", lambda: version)
    with pytest.raises(integration.UnsupportedMegatronVersion, match=version):
        integration.install(OffloadConfig(dirs=["/nonexistent-never-created"]))
    assert integration.installed() is None


@pytest.mark.parametrize("version", ["0.16.1", "0.17.1", "0.18.2", "0.19.2", "0.19.0rc1",
                                     "0.20.0"])
def test_supported_versions_are_accepted(version):
    assert integration.check_megatron_version(version) == version


def test_the_imported_megatron_core_is_supported():
    assert integration.check_megatron_version()[:4] in integration.SUPPORTED_MEGATRON_CORE


def test_forward_only_steps_are_not_recorded(tmp_path):
    spec = LayoutSpec(iterations=1, eval_iterations=2,
                      phases=[Phase("plain"), Phase("offload", offload=OFFLOAD)])
    (r,) = harness.run_layout(spec, str(tmp_path))
    assert harness.phase_differences(r.phases["plain"], r.phases["offload"]) == []
    assert len(r.phases["offload"].eval_losses) == 2
    # Evaluation ended no offloader step: the last StepStats is still the training step's.
    assert r.phases["offload"].offload["last_step_after_eval"] == 0


# -- Transformer Engine spec and sequence parallel (CUDA only) --------------------------------


def _te_skip_reason():
    if not torch.cuda.is_available():
        return "needs CUDA: the local spec's torch LayerNorm refuses sequence parallel, so the " \
               "sequence-parallel test uses the Transformer Engine spec, which needs CUDA"
    if importlib.util.find_spec("transformer_engine") is None:
        return "needs transformer-engine (the TE layer spec)"
    if torch.cuda.device_count() < 2:
        return "needs 2 CUDA devices (TP=2 with sequence parallel)"
    return None


@pytest.mark.skipif(_te_skip_reason() is not None, reason=str(_te_skip_reason()))
def test_sequence_parallel_with_transformer_engine_spec_is_bitwise_equal(tmp_path):
    spec = LayoutSpec(tp=2, phases=list(PHASES), device="cuda", layer_spec="transformer_engine",
                      sequence_parallel=True)
    for r in harness.run_layout(spec, str(tmp_path)):
        assert harness.phase_differences(r.phases["plain"], r.phases["offload"]) == []
        assert all(s["bytes_offloaded"] > 0 for s in r.phases["offload"].offload["steps"])
        assert sum(s["bytes_read"] for s in r.phases["offload"].offload["steps"]) > 0, r.rank


@pytest.mark.cuda
@pytest.mark.skipif(_te_skip_reason() is not None, reason=str(_te_skip_reason()))
def test_moe_with_tensor_parallel_and_multi_latent_attention_on_te_spec_is_bitwise(tmp_path):
    """MoE with TP=2 (megatron-core demands sequence parallel there, which the local spec's
    LayerNorm refuses) and multi-latent attention with TE's own core attention (the local
    spec's DotProductAttention takes no k_channels; the CPU layout "mla" runs MLA with our
    stand-in for it, tests/mla_attention_stand_in.py): both need the Transformer Engine
    spec. Not yet run."""
    spec = LayoutSpec(tp=2, phases=list(PHASES), device="cuda", layer_spec="transformer_engine",
                      sequence_parallel=True, num_moe_experts=4, multi_latent_attention=True)
    for r in harness.run_layout(spec, str(tmp_path)):
        assert harness.phase_differences(r.phases["plain"], r.phases["offload"]) == []
        assert sum(s["bytes_read"] for s in r.phases["offload"].offload["steps"]) > 0


@pytest.mark.cuda
@pytest.mark.skipif(_te_skip_reason() is not None, reason=str(_te_skip_reason()))
def test_context_parallel_with_transformer_engine_spec_is_bitwise(tmp_path):
    """Context parallelism (CP=2: each GPU its slices of every sequence, keys and values
    exchanged by TE's attention) through install(). Needs TE and 2 GPUs. Not yet run."""
    spec = LayoutSpec(cp=2, phases=list(PHASES), device="cuda", layer_spec="transformer_engine",
                      seq_length=32, dropout=0.0)
    for r in harness.run_layout(spec, str(tmp_path)):
        assert harness.phase_differences(r.phases["plain"], r.phases["offload"]) == []
        assert sum(s["bytes_read"] for s in r.phases["offload"].offload["steps"]) > 0
