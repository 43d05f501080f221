"""The analytic model's MLP terms: SwiGLU fused (Megatron-LM's default) and unfused.

What the offloader really writes for each is checked in test_plan_vs_megatron.py; the preset
figures here are docs/models.md's planning table.
"""

import pathlib

import pytest

from ssdtrain_megatron.plan.model import (ModelShape, SaveProfile, layer_activation_bytes,
                                          layer_activation_terms)
from ssdtrain_megatron.tools.plan.cli import load_preset

S, B, H, A = 2048, 4, 4096, 32
SBH = S * B * H
GPT = ModelShape(num_layers=32, hidden=H, heads=A, ffn_hidden=4 * H, seq_len=S, micro_batch=B)
CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"


def test_fused_swiglu_saves_the_fc1_output_once():
    """Megatron's default (--bias-swiglu-fusion): one autograd function saves the whole fc1
    output (gate and up halves, 2f wide); fc2 saves its input. Three f-wide tensors, not four."""
    shape = GPT.replace(swiglu=True, ffn_hidden=11008, flash_attention=True)
    assert shape.swiglu_fusion
    terms = layer_activation_terms(shape)
    sbf = S * B * 11008
    assert (terms["swiglu_input"], terms["fc2_input"]) == (4 * sbf, 2 * sbf)
    assert not {"swiglu_gate_input", "swiglu_gate_output", "swiglu_up"} & set(terms)
    assert layer_activation_bytes(shape) == 18 * SBH + 6 * sbf


def test_unfused_swiglu_saves_gate_input_gate_output_and_up_projection():
    shape = GPT.replace(swiglu=True, swiglu_fusion=False, ffn_hidden=11008, flash_attention=True)
    terms = layer_activation_terms(shape, SaveProfile(strided_view_span=False))
    sbf = S * B * 11008
    assert [terms[k] for k in ("swiglu_gate_input", "swiglu_gate_output", "swiglu_up",
                               "fc2_input")] == [2 * sbf] * 4
    assert layer_activation_bytes(shape, SaveProfile(strided_view_span=False)) == 18 * SBH + 8 * sbf
    # The gate is the first half of each fc1 output row: our offloader writes its whole span,
    # from the first row's gate to the last row's gate.
    spanned = layer_activation_terms(shape)
    assert spanned["swiglu_gate_input"] == 2 * ((S * B - 1) * 2 * 11008 + 11008)


@pytest.mark.parametrize("preset, fused, unfused", [
    ("llama2-7b", 538968064, 719312128),
    ("llama3-70b", 281018368, 398451712),
])
def test_preset_bytes_per_layer_follow_swiglu_fusion(preset, fused, unfused):
    """docs/models.md's planning table: fused is the default; unfused writes the gate's span."""
    shape, _ = load_preset(str(CONFIGS / f"{preset}.yaml"))
    assert shape.swiglu and shape.swiglu_fusion
    assert layer_activation_bytes(shape) == fused
    assert layer_activation_bytes(shape.replace(swiglu_fusion=False)) == unfused
