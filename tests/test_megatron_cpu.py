"""megatron-core trains on CPU (tests/megatron_cpu_compat.py) in every layout the integration
tests use, and training is deterministic: two identical runs give bitwise identical losses and
gradients. The offload tests rely on both."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

pytest.importorskip("megatron.core")

# megatron-core's own deprecation notes (tp_group=None, ...) and "Apex is not installed".
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron.*"),
              pytest.mark.filterwarnings("ignore::UserWarning:megatron.*")]

import megatron_cpu_compat  # noqa: E402
import megatron_harness as harness  # noqa: E402
from megatron_harness import LAYOUTS, LayoutSpec, Phase  # noqa: E402
from bitwise import bitwise_equal  # noqa: E402

TWICE = [Phase("first"), Phase("second")]


def _with_phases(spec: LayoutSpec, phases) -> LayoutSpec:
    return dataclasses.replace(spec, phases=list(phases))


@pytest.fixture(scope="module")
def layout_results(tmp_path_factory):
    """Each layout run once (two phases in the same processes), shared by the tests below."""
    cache = {}

    def get(name):
        if name not in cache:
            spec = _with_phases(LAYOUTS[name], TWICE)
            cache[name] = harness.run_layout(spec, str(tmp_path_factory.mktemp(name)))
        return cache[name]

    return get


# The MoE, MLA and interleaved layouts (-m slow here, 12-26 s each) are trained twice more by
# tests/test_megatron_integration.py, whose bitwise comparison with plain training would fail
# if they were not deterministic.
DETERMINISM_SLOW = {"moe_ep2_pp2", "moe_ep2_allgather", "moe_ep2_recompute_full",
                    "moe_ep2_alltoall_recompute_selective", "mla_tp2", "pp2_interleaved_vp2"}


@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.slow)
                                    if name in DETERMINISM_SLOW | harness.SLOW_LAYOUTS else name
                                    for name in LAYOUTS])
def test_layout_trains_with_finite_losses_and_is_deterministic(layout, layout_results):
    spec = LAYOUTS[layout]
    results = layout_results(layout)
    assert len(results) == spec.world_size
    assert sorted(r.rank for r in results) == list(range(spec.world_size))
    last_stage = [r for r in results if r.pp_rank == spec.pp - 1]
    for r in results:
        first, second = r.phases["first"], r.phases["second"]
        assert harness.all_finite(first)
        assert len(first.grads) == spec.iterations
        assert all(g is not None for g in first.grads[0].values()), "a parameter got no gradient"
        if r in last_stage:
            assert [len(step) for step in first.losses] == [spec.num_microbatches] * spec.iterations
        else:
            assert first.losses == [[]] * spec.iterations
        assert harness.phase_differences(first, second) == []
    # Training moves: the last iteration's parameters differ from a fresh model's (the loss
    # changes between iterations even on identical data would be a weaker check).
    assert any(r.phases["first"].losses[0] != r.phases["first"].losses[-1] for r in last_stage)


def test_tensor_parallel_ranks_agree_on_the_loss(layout_results):
    r0, r1 = layout_results("tp2")
    for a, b in zip(r0.phases["first"].loss_tensors, r1.phases["first"].loss_tensors):
        assert all(bitwise_equal(x, y) for x, y in zip(a, b))
    # Each TP rank holds its own shard of the column-parallel weights.
    name = "chunk0.decoder.layers.0.mlp.linear_fc1.weight"
    g0, g1 = r0.phases["first"].grads[0][name], r1.phases["first"].grads[0][name]
    assert g0.shape == g1.shape and not bitwise_equal(g0, g1)


@pytest.mark.parametrize("layout,reference", [
    ("recompute_full_uniform", "tp1_pp1"),
    ("recompute_full_block", "tp1_pp1"),
    ("recompute_selective", "tp1_pp1"),
    ("pp2_recompute_full", "pp2_1f1b"),
    ("mla_recompute_up_proj", "mla"),
    ("recompute_selective_layernorm", "tp1_pp1"),
])
def test_recomputation_reproduces_dropout_bitwise(layout, reference, layout_results):
    """Recompute restores the RNG states through the CPU-backed tracker, so the recomputed
    forward (with dropout) equals the original and gradients are bitwise those of no recompute."""
    for r, ref in zip(layout_results(layout), layout_results(reference)):
        assert harness.phase_differences(r.phases["first"], ref.phases["first"]) == []


def test_a_fresh_process_reproduces_an_in_process_run(tmp_path, layout_results):
    spec = _with_phases(LAYOUTS["tp1_pp1"], [Phase("first")])
    (sub,) = harness.run_layout(spec, str(tmp_path), in_process=False)
    (here,) = layout_results("tp1_pp1")
    assert harness.phase_differences(sub.phases["first"], here.phases["first"]) == []


def test_compat_disable_restores_every_patched_attribute():
    from megatron.core import utils as mcore_utils
    from megatron.core.tensor_parallel import random as mcore_random

    watched = [
        (torch.cuda, "current_device"), (torch.cuda, "synchronize"),
        (torch.cuda, "manual_seed"), (torch.cuda, "get_rng_state"),
        (torch.cuda, "set_rng_state"), (mcore_random, "_get_cuda_rng_state"),
        (mcore_random, "_set_cuda_rng_state"), (mcore_random.CudaRNGStatesTracker, "add"),
        (mcore_random.CudaRNGStatesTracker, "fork"),
        (mcore_utils.GlobalMemoryBuffer, "get_tensor"),
    ]
    before = [getattr(owner, name) for owner, name in watched]
    assert not megatron_cpu_compat.is_enabled()
    megatron_cpu_compat.enable()
    try:
        assert torch.empty(2, device="cuda").device.type == "cpu"
        assert torch.zeros(2, device=torch.cuda.current_device()).device.type == "cpu"
        assert torch.ones(1).cuda().device.type == "cpu"
        assert torch.device(0).type == "cpu"  # yarn rotary: with torch.device(current_device())
        assert all(getattr(o, n) is not b for (o, n), b in zip(watched, before))
    finally:
        megatron_cpu_compat.disable()
    assert [getattr(owner, name) for owner, name in watched] == before
    assert not torch.overrides._is_torch_function_mode_enabled()
    with pytest.raises((RuntimeError, AssertionError)):
        torch.empty(1, device="cuda")


def test_multi_latent_attention_sees_no_transformer_engine_where_there_is_none():
    """megatron-core 0.16's multi_latent_attention sets its own HAVE_TE when importing the TE
    extension succeeds, which it does without TE (its classes are then mocks), and building
    MLA then calls isinstance() on a mock. The CPU runtime sets that flag to the extension's
    while enabled, and puts the module's own value back after.
    Broken variant: drop ``_patch_mla_without_te(state)`` from enable(): this test fails
    (True == False) and the "mla" layout fails to build with "TypeError: isinstance() arg 2
    must be a type, a tuple of types, or a union when instantiating MLASelfAttention"."""
    from megatron.core.extensions import transformer_engine as te_extension
    from megatron.core.transformer import multi_latent_attention

    before = multi_latent_attention.HAVE_TE
    with megatron_cpu_compat.enabled():
        assert bool(multi_latent_attention.HAVE_TE) == bool(te_extension.HAVE_TE)
    assert multi_latent_attention.HAVE_TE is before


def test_checkpoint_without_output_finds_fp8_off_without_transformer_engine():
    """CheckpointWithoutOutput() (selective recompute of "layernorm", "moe_act") counts as FP8
    by default in megatron-core 0.16-0.17 and asks three TE names that tensor_parallel.random
    defines only with TE: the CPU runtime stands in for them while enabled, and removes them
    after. Broken variant: drop ``_patch_fp8_checkpoint_stand_ins(state)`` from enable(): this
    test fails (AttributeError: no FP8GlobalStateManager) and the "recompute_selective_layernorm"
    layout fails with "NameError: name 'FP8GlobalStateManager' is not defined"."""
    from megatron.core.tensor_parallel import random as mcore_random

    names = ["FP8GlobalStateManager", "activation_recompute_forward", "fp8_autocast"]
    had = {n: hasattr(mcore_random, n) for n in names}
    with megatron_cpu_compat.enabled():
        assert not mcore_random.FP8GlobalStateManager.is_fp8_enabled()
        with mcore_random.fp8_autocast(enabled=False, fp8_recipe=None), \
                mcore_random.activation_recompute_forward(activation_recompute=True,
                                                          recompute_phase=False):
            pass
    assert {n: hasattr(mcore_random, n) for n in names} == had
