"""plan/step_time.py's and plan/gpu_kind.py's terms, one at a time, on exact figures (issue 69).
Pure: no torch."""

from __future__ import annotations

import pytest

from ssdtrain_megatron.plan.gpu_kind import (KINDS, attention_rate, gemm_seconds,
                                             wave_efficiency)
from ssdtrain_megatron.plan.node import load_profile
from ssdtrain_megatron.plan.shape import ModelShape, SaveProfile
from ssdtrain_megatron.plan.stage import stage
from ssdtrain_megatron.plan.step_time import (LINK_EFFICIENCY, layer_gemms, layer_time,
                                              stage_parameters)

H100 = KINDS["h100-sxm"]
NODE = load_profile("dgx-h100")
LLAMA_8B = dict(num_layers=32, hidden=4096, heads=32, kv_groups=8, ffn_hidden=14336,
                seq_len=8192, micro_batch=1, swiglu=True, flash_attention=True, vocab=128256,
                attention_dropout=0.0, hidden_dropout=0.0)


def test_a_gemm_runs_its_waves_of_tiles_over_the_sms():
    """4096 x 6144 outputs: 32 x 24 = 768 tiles of 128 x 256 on 132 SMs run 6 waves, the last
    one partly idle. Broken variant (no wave quantization): the time is 2mnk / rate."""
    assert wave_efficiency(4096, 6144, 132) == 4096 * 6144 / (6 * 132 * 128 * 256)
    seconds = gemm_seconds(H100, 4096, 6144, 4096)
    assert seconds == 2 * 4096 * 6144 * 4096 / (989.4 * 0.72 * 1e12
                                                * wave_efficiency(4096, 6144, 132))


def test_fp8_gemms_run_at_the_fp8_rate_and_a_kind_without_fp8_at_bf16():
    ratio = gemm_seconds(H100, 8192, 8192, 8192, "bf16") / gemm_seconds(H100, 8192, 8192, 8192, "fp8")
    assert ratio == pytest.approx(1978.9 * 0.62 / (989.4 * 0.72), rel=1e-12)
    a100 = KINDS["a100-sxm"]
    assert gemm_seconds(a100, 8192, 8192, 8192, "fp8") == gemm_seconds(a100, 8192, 8192, 8192)


def test_the_layer_gemms_are_megatrons_at_this_ranks_shape():
    """Llama 3 8B, CP2, FP8: 4096 rows a rank; fc1 2f wide (SwiGLU); FP8 for the linears.
    Qwen3-30B-A3B's experts: 8192 x 8 rows over 16 local experts of 128 with EP8."""
    shape = ModelShape(**LLAMA_8B, cp=2, fp8=True)
    assert [(g.name, g.m, g.n, g.k, g.precision) for g in layer_gemms(shape)] == [
        ("qkv", 4096, 6144, 4096, "fp8"), ("proj", 4096, 4096, 4096, "fp8"),
        ("fc1", 4096, 28672, 4096, "fp8"), ("fc2", 4096, 4096, 14336, "fp8")]
    moe = ModelShape(num_layers=48, hidden=2048, heads=32, kv_groups=4, kv_channels=128,
                     ffn_hidden=6144, seq_len=4096, micro_batch=2, swiglu=True,
                     flash_attention=True, num_experts=128, moe_topk=8, moe_ffn_hidden=768,
                     ep=8, dp=8, moe_grouped_gemm=True)
    experts = [g for g in layer_gemms(moe) if g.name.startswith("expert")]
    assert [(g.m, g.n, g.k, g.count, g.grouped) for g in experts] == [
        (4096, 1536, 2048, 16, True), (4096, 2048, 768, 16, True)]


def test_attention_runs_at_its_own_rate_rising_with_the_keys_a_call_sees():
    """Broken variant (the rate without the L / (L + 512) factor): 8k and 4k keys tie."""
    assert attention_rate(H100, 512) == pytest.approx(989.4e12 * 0.65 / 2)
    assert attention_rate(H100, 8192) / attention_rate(H100, 4096) == pytest.approx(
        (8192 / 8704) / (4096 / 4608))
    assert attention_rate(H100, 8192, backward=True) == pytest.approx(
        989.4e12 * 0.48 * 8192 / 8704)


def test_tp_communication_is_exposed_unless_overlapped_then_one_step_of_it():
    """Llama 3 70B TP4 with sequence parallelism: four collectives of 3/4 of s x b x h x 2
    bytes over NVLink at 0.8; with --tp-comm-overlap a quarter of it (one of four pipelined
    steps) where the GEMMs cover the rest. Broken variant (overlap ignored): the same time."""
    shape = ModelShape(num_layers=80, hidden=8192, heads=64, kv_groups=8, ffn_hidden=28672,
                       seq_len=8192, micro_batch=1, swiglu=True, flash_attention=True, tp=4,
                       sequence_parallel=True)
    comm = 4 * 8192 * 8192 * 2 * 3 / 4 / (450e9 * LINK_EFFICIENCY)
    assert layer_time(shape, NODE).forward["tp_comm"] == pytest.approx(comm)
    overlapped = layer_time(shape.replace(tp_comm_overlap=True), NODE)
    assert overlapped.forward["tp_comm"] == pytest.approx(comm / 4)


def test_the_interleaved_schedule_divides_the_bubble_by_vp():
    """Broken variant (bubble at pp - 1 micro-batch times whatever vp): 5x the bubble."""
    shape = ModelShape(**{**LLAMA_8B, "num_layers": 32}, pp=4, dp=2)
    plain = stage(shape, SaveProfile.paper(), NODE, 16)
    interleaved = stage(shape.replace(vp=4), SaveProfile.paper(), NODE, 16)
    assert plain.bubble_s == pytest.approx(3 * plain.micro_batch_s)
    assert interleaved.bubble_s == pytest.approx(3 / 4 * interleaved.micro_batch_s)
    # the interleaved schedule overlaps its pipeline sends; 1F1B's are exposed
    assert interleaved.terms["step"]["pipeline_sends"] == 0
    assert plain.terms["step"]["pipeline_sends"] > 0


def test_data_parallel_reduction_is_hidden_by_overlap_grad_reduce_where_backward_covers_it():
    """Llama 3 8B on 64 GPUs (DP64 across 8 nodes): the gradient reduce-scatter of the
    stage's parameters in bf16 over the GPU's 400 Gb/s NIC at 0.8, exposed without the flag;
    behind the last micro-batch's backward with it. Broken variant (the flag ignored): the
    exposed time stays."""
    shape = ModelShape(**LLAMA_8B, dp=64, distributed_optimizer=True, grad_reduce_in_bf16=True)
    dense, _ = stage_parameters(shape)
    reduce_s = dense * 2 * 63 / 64 / (50e9 * LINK_EFFICIENCY)
    gather_s = dense * 2 * 63 / 64 / (50e9 * LINK_EFFICIENCY)
    exposed = stage(shape, SaveProfile.paper(), NODE, 2).terms["step"]
    assert exposed["dp_grad_reduce"] == pytest.approx(reduce_s)
    assert exposed["dp_param_gather"] == pytest.approx(gather_s)
    hidden = stage(shape.replace(overlap_grad_reduce=True, overlap_param_gather=True),
                   SaveProfile.paper(), NODE, 2).terms["step"]
    lt = layer_time(shape, NODE)
    assert hidden["dp_grad_reduce"] == pytest.approx(max(0.0, reduce_s - 32 * lt.backward_s))
    assert hidden["dp_param_gather"] == pytest.approx(max(0.0, gather_s - 32 * lt.forward_s))
    assert hidden["dp_grad_reduce"] < exposed["dp_grad_reduce"]


def test_the_context_parallel_ring_hides_behind_attention_and_the_all_to_all_does_not():
    shape = ModelShape(**LLAMA_8B, cp=2)
    assert layer_time(shape, NODE).forward["cp_comm"] == 0.0
    moe = ModelShape(num_layers=48, hidden=2048, heads=32, kv_groups=4, kv_channels=128,
                     ffn_hidden=6144, seq_len=4096, micro_batch=2, swiglu=True,
                     flash_attention=True, num_experts=128, moe_topk=8, moe_ffn_hidden=768,
                     ep=8, dp=8)
    rows = 8192 * 8
    assert layer_time(moe, NODE).forward["ep_all_to_all"] == pytest.approx(
        2 * rows * 2048 * 2 * 7 / 8 / (450e9 * LINK_EFFICIENCY))


def test_a_node_without_a_gpu_kind_times_every_flop_at_its_one_rate():
    """Broken variant (the kind's terms whatever gpu_kind): the step overheads appear."""
    flat = NODE.replace(gpu_kind=None)
    st = stage(ModelShape(**LLAMA_8B), SaveProfile.paper(), flat, 4)
    assert st.step_s == 0.0 and st.terms == {} and st.backward_s is None


def test_a_grouped_gemm_shares_its_waves_between_the_experts():
    """16 experts of 4096 x 1536: each alone runs 192 tiles in 2 waves of 132 (0.73 busy);
    grouped, 3,072 tiles run in 24 waves (0.97 busy). Broken variant (the grouped flag
    ignored): the two times are equal."""
    from ssdtrain_megatron.plan.step_time import Gemm, gemm_time

    alone = gemm_time(Gemm("e", 4096, 1536, 2048, "bf16", 16, False), H100, NODE, 8192)
    grouped = gemm_time(Gemm("e", 4096, 1536, 2048, "bf16", 16, True), H100, NODE, 8192)
    assert alone / grouped == pytest.approx((3072 / (24 * 132)) / (192 / (2 * 132)))
