"""A Megatron layer class our patches do not reach (issue 28, section 1): its layers save
outside any layer scope, and the warning names the class and the layers.

The stand-in for "a layer class the patches missed in some release" is a TransformerLayer
subclass whose forward calls megatron's unpatched forward, so it never enters
``offloader.layer()``; a tiny GPT trains on the CPU, in this process."""

from __future__ import annotations

import logging
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

pytest.importorskip("megatron.core")

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron.*"),
              pytest.mark.filterwarnings("ignore::UserWarning:megatron.*")]

import megatron_harness as harness  # noqa: E402
from megatron.core.transformer.transformer_layer import TransformerLayer  # noqa: E402
from megatron_harness import LayoutSpec, Phase  # noqa: E402

from ssdtrain_megatron import megatron as integration  # noqa: E402


class UnscopedLayer(TransformerLayer):
    """Overrides forward without going through the patched TransformerLayer.forward."""

    def forward(self, *args, **kwargs):
        return integration.installed().scopes._layer_forward(self, *args, **kwargs)


def test_an_unpatched_layer_class_is_named_in_the_warning(tmp_path, monkeypatch, caplog):
    """Break: make unscoped_layers() return {} (scopes.py) -> no warning, why is ''."""
    build = harness.build_model

    def build_with_one_unscoped_layer(spec, config):
        chunks = build(spec, config)
        for m in chunks[0].modules():
            if isinstance(m, TransformerLayer) and m.layer_number == 2:
                m.__class__ = UnscopedLayer
        return chunks

    monkeypatch.setattr(harness, "build_model", build_with_one_unscoped_layer)
    spec = LayoutSpec(iterations=2, num_microbatches=2,
                      phases=[Phase("offload", offload=dict(policy="offload", min_tensor_bytes=0))])
    with caplog.at_level(logging.WARNING, logger="ssdtrain_megatron.cache.silence"):
        (r,) = harness.run_layout(spec, str(tmp_path), in_process=True)
    steps = r.phases["offload"].offload["steps"]
    assert steps[0]["not_offloaded_why"] == ""  # the first step is exempt
    why = steps[1]["not_offloaded_why"]
    assert why.startswith("layers 2 of class test_silence_megatron.UnscopedLayer run outside any "
                          "layer scope"), why
    layers = {row["layer"] for row in steps[1]["layers"]}
    assert {"1", "3", "4", "None"} <= layers and "2" not in layers
    assert steps[1]["bytes_offloaded"] > 0 and steps[1]["bytes_read"] > 0
    warned = [rec.getMessage() for rec in caplog.records if "UnscopedLayer" in rec.getMessage()]
    assert warned == ["ssdtrain: " + why]
