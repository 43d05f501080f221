"""Analytic model of activation bytes, FLOPs and bandwidth, and `ssdtrain plan`."""

import argparse
import dataclasses
import json

import pytest

from ssdtrain_megatron.tools.plan.cli import add_lifespan_parser, add_plan_parser
from ssdtrain_megatron.plan.model import (ModelShape, SaveProfile, estimate_step_time_s,
                                          forward_flops_per_layer, head_activation_terms,
                                          largest_micro_batch, layer_activation_bytes,
                                          layer_activation_terms, peak_activation_bytes,
                                          required_write_gbps, training_flops_per_micro_batch)

# A GPT shape in the paper's range: s=2048, b=4, h=4096, a=32, f=4h, 16-bit.
S, B, H, A = 2048, 4, 4096, 32
GPT = ModelShape(num_layers=32, hidden=H, heads=A, ffn_hidden=4 * H, seq_len=S, micro_batch=B)
SBH = S * B * H
AS2B = A * S * S * B


# -- Korthikanti et al. -----------------------------------------------------------------------


def test_no_recompute_matches_korthikanti():
    assert layer_activation_bytes(GPT) == 34 * SBH + 5 * AS2B


def test_flash_attention_drops_the_score_term():
    assert layer_activation_bytes(GPT.replace(flash_attention=True)) == 34 * SBH


def test_tensor_parallel_splits_all_but_norms_dropouts_and_linear_inputs():
    shape = GPT.replace(tp=8)
    assert layer_activation_bytes(shape) == 10 * SBH + 24 * SBH // 8 + 5 * AS2B // 8


def test_sequence_parallel_splits_the_rest():
    shape = GPT.replace(tp=8, sequence_parallel=True)
    assert layer_activation_bytes(shape) == (34 * SBH + 5 * AS2B) // 8


def test_selective_recompute_drops_the_attention_core():
    shape = GPT.replace(tp=8, sequence_parallel=True, recompute="selective")
    assert layer_activation_bytes(shape) == 34 * SBH // 8


def test_full_recompute_keeps_only_the_layer_input():
    assert layer_activation_terms(GPT.replace(recompute="full")) == {"layer_input": 2 * SBH}
    shape = GPT.replace(tp=4, sequence_parallel=True, recompute="full")
    assert layer_activation_bytes(shape) == 2 * SBH // 4


def test_paper_terms_by_name():
    sbh = SBH
    assert layer_activation_terms(GPT) == {
        "attn_norm_input": 2 * sbh, "qkv_input": 2 * sbh, "query": 2 * sbh, "key": 2 * sbh,
        "softmax_output": 2 * AS2B, "attention_dropout_mask": AS2B,
        "attention_probs": 2 * AS2B, "value": 2 * sbh, "proj_input": 2 * sbh,
        "attn_residual_dropout_mask": sbh, "mlp_norm_input": 2 * sbh, "fc1_input": 2 * sbh,
        "activation_input": 8 * sbh, "fc2_input": 8 * sbh, "mlp_residual_dropout_mask": sbh,
    }


def test_gqa_with_flash_attention_saves_grouped_key_and_value():
    shape = GPT.replace(kv_groups=8, flash_attention=True)
    terms = layer_activation_terms(shape)
    assert terms["key"] == terms["value"] == 2 * S * B * 8 * (H // A)
    assert layer_activation_bytes(shape) == 34 * SBH - 2 * (2 * SBH - 2 * S * B * 1024)


def test_no_dropout_saves_no_masks_and_one_softmax_output():
    shape = GPT.replace(attention_dropout=0.0, hidden_dropout=0.0)
    assert layer_activation_bytes(shape) == 32 * SBH + 2 * AS2B


# -- megatron-core local spec, fp32 on CPU ------------------------------------------------------
# Reference bytes were measured with a saved_tensors_hooks pack hook around one TransformerLayer
# built from get_gpt_layer_local_spec() (megatron-core 0.16.1, torch CPU, fp32, dropout 0.1),
# counting every saved tensor that is not a parameter, each distinct (storage, offset, shape,
# stride) once. CPU dropout saves an fp32 noise tensor, not a bool mask.

LOCAL = SaveProfile.megatron_local_cpu()
TINY = ModelShape(num_layers=1, hidden=64, heads=4, ffn_hidden=256, seq_len=32, micro_batch=2,
                  dtype_bytes=4)


@pytest.mark.parametrize("changes, measured", [
    ({}, 395264),
    ({"kv_groups": 2}, 395264),  # key and value are repeat_interleave'd to all heads
    ({"swiglu": True, "swiglu_fusion": False}, 526336),
    ({"swiglu": True}, 460800),
    ({"attention_dropout": 0.0, "hidden_dropout": 0.0}, 329728),
    ({"recompute": "selective"}, 296960),  # + a 4-byte int32 the checkpoint saves, not modelled
    ({"recompute": "selective", "kv_groups": 2}, 280576),
    ({"hidden": 96, "heads": 6, "ffn_hidden": 200, "seq_len": 48, "micro_batch": 3,
      "kv_groups": 3, "swiglu": True, "swiglu_fusion": False}, 1516032),
])
def test_local_spec_profile_matches_bytes_measured_on_megatron_core(changes, measured):
    # The pack hook counts a view's elements; what the offloader writes for a strided view
    # (its span) is checked against the offloader in test_plan_vs_megatron.py.
    profile = dataclasses.replace(LOCAL, strided_view_span=False)
    assert layer_activation_bytes(TINY.replace(**changes), profile) == measured


def test_local_spec_terms_by_name():
    assert layer_activation_terms(TINY, LOCAL) == {
        "attn_norm_input": 16384, "attn_norm_mean": 256, "attn_norm_rstd": 256,
        "qkv_input": 16384, "query": 16384, "key": 16384, "attention_mask": 1024,
        "softmax_output": 32768, "attention_dropout_mask": 32768, "attention_probs": 32768,
        "value": 16384, "proj_input": 16384, "attn_residual_dropout_mask": 16384,
        "mlp_norm_input": 16384, "mlp_norm_mean": 256, "mlp_norm_rstd": 256,
        "fc1_input": 16384, "activation_input": 65536, "fc2_input": 65536,
        "mlp_residual_dropout_mask": 16384,
    }


def test_small_tensors_and_the_shared_mask_can_be_left_out():
    assert layer_activation_bytes(TINY, LOCAL, min_tensor_bytes=512) == 395264 - 4 * 256
    assert layer_activation_bytes(TINY, LOCAL, include_shared=False) == 395264 - 1024


def test_softmax_in_fp32_on_16_bit_activations_saves_a_cast_copy_without_dropout():
    shape = GPT.replace(attention_dropout=0.0)
    terms = layer_activation_terms(shape, SaveProfile(softmax_bytes=4))
    assert terms["softmax_output"] == 4 * AS2B
    assert terms["attention_probs"] == 2 * AS2B


def test_head_terms_count_the_output_layer_and_fp32_loss():
    shape = GPT.replace(vocab=50304, tp=2)
    assert head_activation_terms(shape) == {
        "embedding_dropout_mask": SBH, "final_norm_input": 2 * SBH,
        "output_layer_input": 2 * SBH, "loss_softmax": 4 * S * B * 25152,
    }
    assert head_activation_terms(GPT) == {}


# -- FLOPs, step time, bandwidth ---------------------------------------------------------------


def test_training_flops_match_megatrons_formula():
    shape = GPT.replace(vocab=51200)
    L, V = shape.num_layers, 51200
    # 72 B s L h^2 (1 + s/(6h) + V/(12 h L)), multiplied out.
    assert training_flops_per_micro_batch(shape) == \
        72 * B * S * L * H * H + 12 * B * S * S * L * H + 6 * B * S * H * V


def test_recompute_adds_the_recomputed_forward():
    base = training_flops_per_micro_batch(GPT)
    assert training_flops_per_micro_batch(GPT.replace(recompute="full")) == \
        base + 32 * forward_flops_per_layer(GPT)
    assert training_flops_per_micro_batch(GPT.replace(recompute="selective")) == \
        base + 32 * 4 * B * S * S * H


def test_causal_flash_attention_computes_half_the_square():
    """Flash attention's kernels skip the blocks above the causal mask's diagonal: the core
    attention (scores and attention over values) is 2bs^2q, not 4bs^2q; unfused attention
    computes the whole square and masks it. At 128k the square is most of a layer's FLOPs, so
    the planned layer is that much shorter. Broken variant (4bs^2q with flash attention, the
    full square): the forward FLOPs and the stage's compute are the unfused figures."""
    from ssdtrain_megatron.plan.model import attention_core_flops
    from ssdtrain_megatron.plan.node import load_profile
    from ssdtrain_megatron.plan.stage import stage

    shape = ModelShape(num_layers=1, hidden=4096, heads=32, ffn_hidden=14336, seq_len=131072,
                       micro_batch=1, kv_groups=8, swiglu=True, flash_attention=True)
    s, h = 131072, 4096
    unfused = shape.replace(flash_attention=False)
    assert attention_core_flops(unfused) == 4 * s * s * h
    assert attention_core_flops(shape) == 2 * s * s * h
    assert forward_flops_per_layer(unfused) - forward_flops_per_layer(shape) == 2 * s * s * h
    selective = shape.replace(recompute="selective")
    assert training_flops_per_micro_batch(selective) - training_flops_per_micro_batch(shape) \
        == 2 * s * s * h  # the recomputed core: half the square too
    node = load_profile("dgx-h100").replace(gpu_kind=None)  # one rate for every FLOP
    flash_s = stage(shape, SaveProfile.paper(), node, 1).layers[0].forward_s
    unfused_s = stage(unfused, SaveProfile.paper(), node, 1).layers[0].forward_s
    assert unfused_s / flash_s > 1.6  # 128k: the square is most of the layer
    again = stage(selective, SaveProfile.paper(), node, 1).layout_recompute_s
    assert again == pytest.approx(2 * s * s * h / node.gpu_flops, rel=1e-12)


def test_gqa_and_swiglu_flops():
    shape = ModelShape(num_layers=1, hidden=4096, heads=32, ffn_hidden=11008, seq_len=4096,
                       micro_batch=1, kv_groups=8, swiglu=True)
    s, h = 4096, 4096
    assert forward_flops_per_layer(shape) == \
        2 * s * h * (h + 2 * 1024) + 4 * s * s * h + 2 * s * h * h + 6 * s * h * 11008


def test_step_time_splits_flops_over_tp_and_pp():
    shape = GPT.replace(tp=2, pp=4)
    flops = training_flops_per_micro_batch(shape)
    assert estimate_step_time_s(shape, 200.0, num_micro_batches=8) == \
        flops * 8 / 8 / (200.0 * 1e12)


def test_required_write_bandwidth_is_bytes_over_half_the_step():
    assert required_write_gbps(1.8e12, 10.0) == 360.0
    with pytest.raises(ValueError):
        required_write_gbps(1.0, 0.0)


# -- memory per mode --------------------------------------------------------------------------


def test_peak_activation_bytes_per_mode():
    shape = GPT.replace(pp=4)  # 8 layers per stage, 4 micro-batches in flight
    layer = 34 * SBH + 5 * AS2B
    assert peak_activation_bytes(shape, "keep") == 4 * 8 * layer
    assert peak_activation_bytes(shape, "offload", kept_layers=1) == 2 * layer
    assert peak_activation_bytes(shape, "offload", resident_bytes=7) == 7 + layer
    assert peak_activation_bytes(shape, "recompute") == 4 * 8 * 2 * SBH + layer


def test_largest_micro_batch_searches_the_boundary():
    assert largest_micro_batch(lambda b: 7 * b <= 100) == 14
    assert largest_micro_batch(lambda b: False) == 0
    assert largest_micro_batch(lambda b: True, limit=1000) == 1000


# -- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize("changes, message", [
    ({"hidden": 100}, "ModelShape.hidden=100 is invalid: expected a multiple of heads (32), or "
                      "kv_channels set"),
    ({"kv_groups": 5}, "ModelShape.kv_groups=5 is invalid: expected a divisor of heads (32)"),
    ({"tp": 3}, "ModelShape.heads=32 is invalid: expected a multiple of tp (3)"),
    ({"recompute": "some"}, "ModelShape.recompute='some' is invalid: allowed: none, selective, full"),
    ({"dtype_bytes": 3}, "ModelShape.dtype_bytes=3 is invalid: expected 2 (bf16/fp16) or 4 (fp32)"),
    ({"micro_batch": 0}, "ModelShape.micro_batch=0 is invalid: expected an integer >= 1"),
    ({"sequence_parallel": True}, "ModelShape.sequence_parallel=True is invalid: needs tp > 1"),
    ({"pp": 5}, "ModelShape.num_layers=32 is invalid: expected a multiple of pp (5)"),
])
def test_invalid_shapes_name_the_field(changes, message):
    with pytest.raises(ValueError) as err:
        GPT.replace(**changes)
    assert str(err.value) == message


def test_preset_rejects_unknown_keys_and_dtypes():
    model = {"num_layers": 2, "hidden": 64, "heads": 4, "ffn_hidden": 256, "seq_len": 32,
             "micro_batch": 2}
    with pytest.raises(ValueError, match=r"^model: unknown key\(s\) hiden; allowed: "):
        ModelShape.from_preset({**model, "hiden": 64})
    with pytest.raises(ValueError, match=r"^model.dtype='int8' is invalid: allowed: bf16, fp16, fp32$"):
        ModelShape.from_preset({**model, "dtype": "int8"})
    with pytest.raises(ValueError, match=r"^parallel: unknown key\(s\) zp"):
        ModelShape.from_preset(model, {"zp": 2})
    assert ModelShape.from_preset({**model, "dtype": "fp32"}, {"tp": 2}).dtype_bytes == 4


# -- ssdtrain plan ----------------------------------------------------------------------------

PRESET = """\
model:
  num_layers: 4
  hidden: 64
  heads: 4
  ffn_hidden: 256
  seq_len: 32
  micro_batch: 2
  dtype: bf16
parallel:
  tp: 1
  pp: 1
  sequence_parallel: false
offload:
  keep_last_layers: 1
  engine: posix
  dirs: [/tmp/ssdtrain]
"""
# The engine named, posix: the plan of the drives alone (without it, the node's host memory
# would choose tiered: tests/test_plan_job.py). One layer at b=2: 34 sbh + 5 as^2 b = 139264 + 40960 bytes; forward 6815744 FLOPs.
LAYER_BYTES = 180224
STEP_FLOPS = 3 * 4 * 6815744


def main(argv):
    parser = argparse.ArgumentParser(prog="ssdtrain")
    sub = parser.add_subparsers(dest="command", required=True)
    add_lifespan_parser(sub)
    add_plan_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.fixture
def preset(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(PRESET)
    return str(path)


def plan_json(capsys, preset, *extra):
    assert main(["plan", "--config", preset, "--gpu-tflops", "0.001", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_layers_are_numbered_from_one_like_megatron(capsys, preset):
    out = plan_json(capsys, preset)
    assert [row["layer"] for row in out["layers"]] == [1, 2, 3, 4]


def test_plan_old_flag_spellings_still_work(capsys, preset):
    assert main(["plan", "--config", preset, "--json", "--micro-batch", "8", "--num-micro-batches", "2"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["model"]["micro_batch"] == 8 and out["num_micro_batches"] == 2
    assert "--micro-batch is deprecated, use --micro-batch-size" in captured.err
    assert "--num-micro-batches is deprecated, use --num-microbatches" in captured.err


def test_plan_rejects_a_bad_preset_in_one_line(capsys, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(PRESET.replace("hidden: 64", "hiden: 64"))
    assert main(["plan", "--config", str(path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1
    assert err[0].startswith(f"ssdtrain plan: error: {path}: model: unknown key(s) hiden; ")


def test_plan_rejects_a_bad_offload_section(capsys, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(PRESET.replace("keep_last_layers: 1", "keep_last_layers: -1"))
    assert main(["plan", "--config", str(path)]) == 2
    assert capsys.readouterr().err == (
        f"ssdtrain plan: error: {path}: OffloadConfig.keep_last_layers=-1 is invalid: "
        "expected an integer >= 0\n")


def test_plan_rejects_a_missing_preset(capsys, tmp_path):
    missing = str(tmp_path / "none.yaml")
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--config", missing])
    assert exit_info.value.code == 2  # a usage error, as in every subcommand (tests/test_presets_cli.py)
    assert capsys.readouterr().err.splitlines()[-1].startswith(
        f"ssdtrain plan: error: argument --config: {missing}: no such file and no preset of "
        "that name; presets: cpu-tiny, ")


@pytest.mark.parametrize("flag, value, message", [
    ("--micro-batch-size", "0", "argument --micro-batch-size: expected an integer >= 1, got '0'"),
    ("--gpu-tflops", "-1", "argument --gpu-tflops: expected a number > 0, got '-1'"),
    ("--ssd-gbps", "fast", "argument --ssd-gbps: expected a number > 0, got 'fast'"),
    ("--drives", "-1", "argument --drives: expected an integer >= 0, got '-1'"),
    ("--gpu-memory", "80", "argument --gpu-memory: 80: give a unit, e.g. 80GB"),
    ("--node", "dgx-h900", "argument --node: 'dgx-h900' is neither a built-in node profile "
                           "(a100-80g, dgx-h100, dgx-h200, dgx-b200, gh200, cloud-h100) nor a "
                           "profile file (YAML)"),
    ("--memory-budget-gb", "inf", "argument --memory-budget-gb: expected a number > 0, got 'inf'"),
])
def test_plan_rejects_bad_flags_naming_the_flag(capsys, preset, flag, value, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--config", preset, flag, value])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"ssdtrain plan: error: {message}"
