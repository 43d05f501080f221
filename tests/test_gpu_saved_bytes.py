"""The bytes a layer of the SDPA spec saves (issue 64 item 6), measured on the CPU: the records
an offloader keyed by view would write (each saved tensor of at least one s x b x h row:
RoPE's tables, the log-sum-exp and the norms' statistics are below any min_tensor_bytes), the
planner's terms with SDPA_SPEC, and gpu-perf's figure (gpu_check_plan.activation_bytes) are
the same 34 sbh; what the layer holds is 36 sbh (value is a view of the whole QKV buffer).
On a975649 the planner had no term for SDPA's output (saved beside the projection's view of
it): 32 sbh at dropout 0."""

from __future__ import annotations

import torch

from ssdtrain_megatron.plan.model import layer_activation_bytes, layer_activation_terms
from ssdtrain_megatron.plan.shape import SDPA_SPEC, ModelShape
from ssdtrain_megatron.tools.gpucheck.gpu_check_plan import activation_bytes
from ssdtrain_megatron.tools.minigpt import GPTSpec
from tests.test_gpu_perf import runtime  # noqa: F401  (the fixture: megatron-core on the CPU runtime)

H, HEADS, S, B = 512, 4, 64, 2
SBH = S * B * H  # sbh: a bf16 s x b x h tensor is 2 sbh bytes


def _saved(model) -> tuple:
    """(record bytes, storage bytes) one step of ``model`` saves, its parameters left out,
    counting the tensors of at least one bf16 s x b x h row (2 sbh bytes)."""
    params = {p.untyped_storage().data_ptr() for p in model.params}
    records, storages = {}, {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and t.nbytes >= 2 * SBH:
            records[(ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()))] = t.nbytes
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.step()
    return sum(records.values()), sum(storages.values())


def test_the_planner_and_gpu_perf_count_what_the_sdpa_spec_saves(runtime):  # noqa: F811
    from ssdtrain_megatron.tools.gpucheck.gpu_check_common import GpuGPT

    per = []
    for layers in (1, 2):
        spec = GPTSpec(layers=layers, hidden=H, heads=HEADS, seq=S, vocab=128, micro_batch=B, num_microbatches=1)
        per.append(_saved(GpuGPT(spec, runtime.device, attention="sdpa")))
    records, storage = per[1][0] - per[0][0], per[1][1] - per[0][1]
    assert (records, storage) == (34 * SBH, 36 * SBH)
    shape = ModelShape(num_layers=1, hidden=H, heads=HEADS, ffn_hidden=4 * H, seq_len=S, micro_batch=B,
                       flash_attention=True, attention_dropout=0.0, hidden_dropout=0.0)
    assert layer_activation_bytes(shape, SDPA_SPEC, min_tensor_bytes=2 * SBH) == records
    assert "attention_output" in layer_activation_terms(shape, SDPA_SPEC)
    gpu_perf_shape = dict(layers=1, hidden=H, heads=HEADS, seq=S, micro_batch=B, attention="sdpa")
    assert activation_bytes(gpu_perf_shape) == records
