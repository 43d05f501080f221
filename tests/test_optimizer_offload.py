"""Model state by precision and optimizer, and megatron-core's optimizer CPU offload in the
planner (issue 67; issue 69 item 2's model state): the bytes on the GPU and in host memory
(plan/memory.py), the step's time (plan/optimizer_step.py, in every plan's iteration through
the stage), the least fraction that fits and the plan that offers it (plan/optimizer_offload.py,
tools/plan/optimizer_offer.py), the node's CPU AdamW rate (plan/node.py, tools/cpu_adam.py).
Real presets, the real planner and CLI; torch's real fused AdamW on this CPU."""

from __future__ import annotations

import json
import math

import pytest

from ssdtrain_megatron.plan.fit import DEFAULT_RESERVE_BYTES, check
from ssdtrain_megatron.plan.memory import layer_parameters, model_state_bytes
from ssdtrain_megatron.plan.node import CPU_ADAM_ESTIMATES, BUILTIN, NodeProfile, load_profile
from ssdtrain_megatron.plan.optimizer_offload import least_fraction
from ssdtrain_megatron.plan.optimizer_step import cpu_adam_rate, optimizer_step
from ssdtrain_megatron.plan.shape import ModelShape, SaveProfile
from ssdtrain_megatron.plan.stage import stage
from ssdtrain_megatron.tools import cpu_adam
from ssdtrain_megatron.tools.cli import main
from ssdtrain_megatron.tools.plan.cli import read_preset

P = 4 * 49_280
"""Parameters of the small shape below: four layers of 49,280 (tests/test_plan_needs.py)."""
QUESTION = ("plan", "--config", "llama3-70b", "--node", "dgx-h100", "--gpus", "8",
            "--global-batch-size", "16")
PARAMS_70B_TP8 = 8_687_878_144
"""Llama 3 70B's first stage at TP8 PP1: its layers' and word embeddings' parameters / 8."""


def _small(**changes) -> ModelShape:
    shape = ModelShape(num_layers=4, hidden=64, heads=4, ffn_hidden=256, seq_len=32, micro_batch=2)
    assert 4 * layer_parameters(shape)["dense"] == P
    return shape.replace(**changes)


def _70b() -> ModelShape:
    return read_preset("configs/llama3-70b.yaml")[0].replace(tp=8, pp=1, dp=1)


# -- model state -----------------------------------------------------------------------------


def test_gradients_are_counted_in_their_precision():
    """bf16 weights: 18 B with fp32 main gradients (Megatron's default with bf16), 16 B with
    bf16 ones; distributed over 4 ranks 6 + 3 and 4 + 3. Broken variant (MAIN_GRAD_BYTES
    always): 18 B for bf16 gradients too."""
    assert model_state_bytes(_small())["bytes"] == P * 18
    assert model_state_bytes(_small(main_grad_bytes=2))["bytes"] == P * 16
    sharded = _small(distributed_optimizer=True, dp=4)
    assert model_state_bytes(sharded)["bytes"] == P * 9
    assert model_state_bytes(sharded.replace(main_grad_bytes=2))["bytes"] == P * 7
    # --grad-reduce-in-bf16: Megatron leaves --accumulate-allreduce-grads-in-fp32 off for bf16,
    # so the gradient buffer is bf16 too
    assert model_state_bytes(sharded.replace(grad_reduce_in_bf16=True))["bytes"] == P * 7


def test_optimizer_offload_moves_main_weights_and_adam_states_to_host_memory():
    """Fraction 0.5 of each rank's shard (P / 4 over 4 ranks): the GPU keeps 6 B and half of
    the 12 / 4; host memory takes 18 B per offloaded parameter (12 pageable: fp32 main weight,
    Adam m and v; 6 pinned: the fp32 gradient copy and the bf16 first copy torch's pinned
    cache keeps). Broken variant (host bytes without the pinned part): 295,680 host bytes."""
    state = model_state_bytes(_small(distributed_optimizer=True, dp=4,
                                     optimizer_offload_fraction=0.5))
    offloaded = P // 4 // 2
    assert state == {"dense_parameters": P, "expert_parameters": 0, "bytes": P * 15 // 2,
                     "offloaded_parameters": offloaded, "host_bytes": offloaded * 18,
                     "pinned_host_bytes": offloaded * 6}


def test_an_fp32_model_has_no_separate_main_weights_on_either_side():
    """fp32 weights: 4 B weights + 4 B gradients on the GPU at fraction 1; in host memory the
    fp32 copy is itself pinned (8 pinned: it and the gradient; 8 pageable: m and v)."""
    state = model_state_bytes(_small(dtype_bytes=4, distributed_optimizer=True, dp=4,
                                     optimizer_offload_fraction=1.0))
    assert (state["bytes"], state["host_bytes"], state["pinned_host_bytes"]) == \
        (P * 8, P // 4 * 16, P // 4 * 8)


def test_offload_needs_the_distributed_optimizer():
    with pytest.raises(ValueError) as exc:
        _small(optimizer_offload_fraction=0.5)
    assert str(exc.value) == (
        "ModelShape.optimizer_offload_fraction=0.5 is invalid: needs distributed_optimizer: "
        "true (megatron runs --optimizer-cpu-offload with --use-precision-aware-optimizer, "
        "which needs --use-distributed-optimizer)")
    with pytest.raises(ValueError, match="main_grad_bytes=3 is invalid: expected 4"):
        _small(main_grad_bytes=3)


def test_nvidias_8b_row_keeps_every_activation_with_bf16_gradients(capsys):
    """Llama 3.1 8B BF16 on 8 H100s at TP1 PP1 CP2 with the distributed optimizer (NVIDIA's
    published row; its runs reduce gradients in bf16): 7.50 B parameters on the rank at
    2 + 2 + 12 / 8 B = 41.3 GB, and keep fits. With fp32 gradients (6 + 12 / 8 B: 56.3 GB)
    keep's 21 GB of activations do not fit. ``--grad-reduce-in-bf16`` (what NVIDIA's recipes
    pass) gives bf16 gradients too. Broken variant (main_grad_bytes ignored): keep does not fit
    either way."""
    args = ["--ssd-offload", "--ssd-offload-config", "llama3-8b", "--ssd-offload-policy", "keep",
            "--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
            "--group-query-attention", "--num-query-groups", "8", "--ffn-hidden-size", "14336",
            "--seq-length", "8192", "--micro-batch-size", "1", "--global-batch-size", "128",
            "--context-parallel-size", "2", "--bf16", "--swiglu", "--attention-dropout", "0",
            "--hidden-dropout", "0", "--use-distributed-optimizer"]
    fits = {}
    for grads in ((), ("--use-precision-aware-optimizer", "--main-grads-dtype", "bf16"),
                  ("--grad-reduce-in-bf16",)):
        assert main(["plan", "--node", "dgx-h100", "--gpus", "8", "--json", "--", *args,
                     *grads]) == 0
        out = json.loads(capsys.readouterr().out)
        state = out["memory"]["model_state"]
        assert state["dense_parameters"] == 7_504_920_576
        fits[state["bytes"]] = out["fits_budget"]
    assert fits == {7_504_920_576 * 15 // 2: False, 7_504_920_576 * 11 // 2: True}


# -- the step --------------------------------------------------------------------------------


def test_the_step_copies_4_bytes_each_way_and_steps_on_the_cpu_at_the_profiles_rate():
    """70B at TP8, fraction 0.85, on dgx-h100 (host copies 38.4 GB/s per GPU with every GPU
    copying; CPU AdamW 1.37e9 parameters/s per rank, an estimate): overlapped, the step is its
    slowest part; one after another, their sum. Broken variant (the step summed when
    overlapped): 6.93 s, not 5.39 s."""
    node = load_profile("dgx-h100")
    shape = _70b().replace(optimizer_offload_fraction=0.85, overlap_optimizer_d2h_h2d=True)
    step = optimizer_step(shape, node)
    n = PARAMS_70B_TP8 * 0.85
    assert step.offloaded_parameters == int(n) == 7_384_696_422
    assert step.d2h_s == step.h2d_s == pytest.approx(n * 4 / 38.4e9, rel=1e-12)
    assert step.cpu_s == pytest.approx(n / 1.37e9, rel=1e-12)
    assert step.step_s == step.cpu_s
    assert step.words() == (
        "fraction 0.85: 132.9 GB of host memory per GPU (44.3 pinned), +5.39 s per step "
        "(gradients to host 0.77 s, CPU AdamW 5.39 s, weights back 0.77 s, overlapped)")
    serial = optimizer_step(shape.replace(overlap_optimizer_d2h_h2d=False), node)
    assert serial.step_s == serial.d2h_s + serial.cpu_s + serial.h2d_s
    assert optimizer_step(shape.replace(optimizer_offload_fraction=0.0), node) is None


def test_every_plan_of_the_stage_carries_the_step():
    """The stage adds the step to the iteration outside the layers, so keep, search and the
    baseline all pay it, and the GPU's own optimizer pass (plan/step_time.py) prices only the
    part not offloaded. Broken variant (stage without optimizer_step_s): a difference of minus
    the offloaded part of the GPU pass."""
    node = load_profile("dgx-h100")
    shape = _70b().replace(optimizer_offload_fraction=0.85)
    without = stage(shape.replace(optimizer_offload_fraction=0.0), SaveProfile.paper(), node, 16)
    with_ = stage(shape, SaveProfile.paper(), node, 16)
    added = with_.keep_iteration_s - without.keep_iteration_s
    gpu_pass = without.terms["step"]["optimizer"]
    assert gpu_pass > 0
    assert math.isclose(added, optimizer_step(shape, node).step_s - 0.85 * gpu_pass,
                        rel_tol=1e-9)


def test_the_least_fraction_is_the_first_that_leaves_room_for_the_least_activations():
    """70B at TP8 on one H100 at 16 micro-batches: 0.85 leaves 7.2 GB for at least 2.2 GB of
    activations, 0.80 leaves 2.0 GB. Broken variant (rounded down): 0.8, which does not fit."""
    node = load_profile("dgx-h100")
    least = least_fraction(_70b(), node, DEFAULT_RESERVE_BYTES, 16)
    assert least == 0.85
    fits = {f: check(_70b().replace(optimizer_offload_fraction=f), node, DEFAULT_RESERVE_BYTES,
                     16).fits for f in (0.8, 0.85)}
    assert fits == {0.8: False, 0.85: True}


# -- the verdict -----------------------------------------------------------------------------


def test_70b_on_one_dgx_answers_first_that_it_fits_with_megatrons_optimizer_offload(capsys):
    """The issue's question: the first line says it fits 8 GPUs with the optimizer offload,
    the flags, fraction, host memory, the step's time, the modeled tokens/s with ours and
    alone, and against the nearest layout on more GPUs; the old answer follows it. Broken
    variant (fit_answer without the offer): the line starts "DOES NOT FIT"."""
    assert main(list(QUESTION)) == 1
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(
        "FITS 8 GPUs WITH MEGATRON'S OPTIMIZER OFFLOAD, with ours: 764 tokens/s per GPU "
        "(modeled) as TP8 PP1 DP1, b=1, keep and recompute per layer, optimizer offload 0.85 "
        "(overlapped); fraction "
        "0.85: 132.9 GB of host memory per GPU (44.3 pinned), +5.39 s per step")
    assert ("flags: --use-distributed-optimizer --use-precision-aware-optimizer "
            "--optimizer-cpu-offload --optimizer-offload-fraction 0.85 "
            "--overlap-cpu-optimizer-d2h-h2d; optimizer offload alone: 722") in first
    assert "against 32 GPUs as TP4 PP4 VP5 CP2 DP1, b=1, keep: 1,106 tokens/s per GPU; without it: " \
           "DOES NOT FIT: " in first
    assert main([*QUESTION, "--json"]) == 1
    offered = json.loads(capsys.readouterr().out)["optimizer_offload"]
    ours, alone = offered["with_ours"], offered["alone"]
    assert (ours["optimizer_offload"]["fraction"], alone["optimizer_offload"]["fraction"]) == \
        (0.85, 0.95)
    assert ours["offloads_activations"] is True and alone["offloads_activations"] is False
    assert round(ours["tokens_per_s_per_gpu"]) == 764 and offered["more_gpus"]["gpus"] == 32


# -- the CPU rate ----------------------------------------------------------------------------


def test_built_in_profiles_carry_a_stated_estimate_and_a_profile_file_its_own(tmp_path):
    """Broken variant (the estimates not applied in _builtin): dgx-h100's rate None."""
    assert {name: p.cpu_adam_params_per_s for name, p in BUILTIN.items()} == CPU_ADAM_ESTIMATES
    rate, words = cpu_adam_rate(load_profile("dgx-h100"))
    assert (rate, words) == (1.37e9, "1.37e+09 params/s per rank (an estimate, not measured: "
                                     "docs/models.md)")
    path = tmp_path / "node.yaml"
    path.write_text("base: dgx-h100\nname: mine\ncpu_adam_params_per_s: 2.5e9\n")
    mine = NodeProfile.from_yaml(str(path))
    assert cpu_adam_rate(mine) == (2.5e9, "2.5e+09 params/s per rank (the profile's "
                                          "cpu_adam_params_per_s)")
    path.write_text("base: dgx-h100\nname: bad\ncpu_adam_params_per_s: 0\n")
    with pytest.raises(ValueError) as exc:
        NodeProfile.from_yaml(str(path))
    assert str(exc.value) == (f"{path}.cpu_adam_params_per_s=0 is invalid: expected a number > 0 "
                              "(parameters per second), or null (not known)")


def test_the_cpu_rate_is_torchs_fused_adamw_bounded_by_the_ranks_share_of_the_bus():
    """One rank's cores (2 CPUs over 2 ranks: 1 thread); a bus of 0.028 GB/s over 2 ranks bounds
    it to 0.5e6 parameters/s (28 B each). Broken variant (no bound): the measured rate."""
    assert cpu_adam.cores_per_rank(8, cpus=112) == 14 and cpu_adam.cores_per_rank(16, cpus=2) == 1
    got = cpu_adam.measure_cpu_adam(2, host_memory_gbps=0.028, cpus=2)
    assert got["threads"] == 1.0 and got["measured"] > 0
    assert got["bus_bound"] == 0.028e9 / 2 / 28 and got["params_per_s"] == min(
        got["measured"], got["bus_bound"])
    assert cpu_adam.measure_cpu_adam(1, cpus=1)["bus_bound"] == 0.0
