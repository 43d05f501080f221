"""The analytic activation model against bytes the offloader measures on megatron-core."""

import pytest

from ssdtrain_megatron import OffloadConfig
from ssdtrain_megatron.plan.model import ModelShape, SaveProfile, layer_activation_bytes

pytest.importorskip("megatron.core")

from ssdtrain_megatron.megatron import install, uninstall  # noqa: E402
from ssdtrain_megatron.tools.minigpt import GPTSpec, MegatronRuntime, MiniGPT  # noqa: E402


@pytest.mark.parametrize("recompute, mlp", [
    (None, {}), ("selective", {}),
    # SwiGLU unfused (--no-bias-swiglu-fusion): the gate is a strided view, written as its span.
    (None, {"swiglu": True}),
    # SwiGLU fused, Megatron-LM's default: the fc1 output once (megatron-core compiles the
    # fused function with torch.compile: about 15 s on the CPU the first time).
    (None, {"swiglu": True, "swiglu_fusion": True}),
    ("selective", {"swiglu": True, "swiglu_fusion": True}),
])
def test_local_spec_bytes_per_layer_within_5_percent(tmp_path, recompute, mlp):
    spec = GPTSpec(layers=3, hidden=128, heads=4, seq=64, micro_batch=2, num_microbatches=2,
                   recompute=recompute, **mlp)
    with MegatronRuntime() as rt:
        model = MiniGPT(spec, rt.device)
        off = install(OffloadConfig(dirs=[str(tmp_path)], min_tensor_bytes=0))
        try:
            model.step()
            stats = off.last_step_stats
        finally:
            uninstall()
    shape = ModelShape(num_layers=spec.layers, hidden=spec.hidden, heads=spec.heads,
                       ffn_hidden=4 * spec.hidden, seq_len=spec.seq, micro_batch=spec.micro_batch,
                       dtype_bytes=4, attention_dropout=0.0, hidden_dropout=0.0,
                       recompute=recompute or "none", swiglu=spec.swiglu,
                       swiglu_fusion=spec.swiglu_fusion)
    profile = SaveProfile.megatron_local_cpu()
    rows = {r.layer: r for r in stats.layers}
    for layer in range(1, spec.layers + 1):
        measured = rows[str(layer)].bytes / spec.num_microbatches
        # The causal mask is one tensor shared by every layer: the offloader writes it once,
        # in the first layer of the first micro-batch.
        predicted = layer_activation_bytes(shape, profile, include_shared=False)
        if layer == 1:
            predicted += (layer_activation_bytes(shape, profile) - predicted) / spec.num_microbatches
        assert abs(measured - predicted) <= 0.05 * predicted, (layer, measured, predicted)
