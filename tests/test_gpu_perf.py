"""`make gpu-perf` (scripts/gpu_perf*.py) on a machine without a GPU: the compute-bound shape's
SDPA core attention against megatron-core's own, the time plan, the measure step with both
shapes and torch's save_on_cpu through the CPU stand-in, the model's prediction, the targets.
What only a GPU shows (real asynchrony, the rates, the memory figures) is the GPU run's."""

from __future__ import annotations

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from ssdtrain_megatron.tools.minigpt import GPTSpec, MegatronRuntime  # noqa: E402


@pytest.fixture
def runtime():
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    with MegatronRuntime() as rt:
        model_parallel_cuda_manual_seed(1234, force_reset_rng=True)  # the dropout's RNG (megatron's fork)
        yield rt


def _config(groups=None, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=groups,
                             attention_dropout=0.0, hidden_dropout=0.0, masked_softmax_fusion=False, **kw)


@pytest.mark.parametrize("mask_type, groups", [("causal", None), ("padding", None), ("causal", 2)],
                         ids=["causal", "padding-mask", "grouped-query"])
def test_sdpa_core_attention_matches_megatrons_local_attention(runtime, mask_type, groups):
    """The same query, key, value and mask through megatron-core's DotProductAttention (the
    local spec's) and SDPAttention: the same output, [s, b, hidden]. Padding: a boolean mask
    that is True where attention is not allowed, as megatron passes it."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from gpu_check_sdpa import SDPAttention

    cfg = _config(groups)
    kind = AttnMaskType.causal if mask_type == "causal" else AttnMaskType.padding
    s, b, d = 16, 2, cfg.kv_channels
    g = torch.Generator().manual_seed(0)
    q = torch.randn(s, b, 4, d, generator=g)
    k, v = (torch.randn(s, b, groups or 4, d, generator=g) for _ in range(2))
    if mask_type == "causal":
        mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)
    else:
        mask = torch.zeros(b, 1, s, s, dtype=torch.bool)
        mask[0, :, :, 11:] = True  # the first sample's last five tokens are padding
    args = dict(config=cfg, layer_number=1, attn_mask_type=kind, attention_type="self")
    want = DotProductAttention(**args)(q, k, v, mask)
    got = SDPAttention(**args)(q, k, v, mask)
    assert got.shape == want.shape == (s, b, 4 * d)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_sdpa_gpt_saves_no_seq_squared_tensor(runtime):
    """What the compute-bound shape is for: the local spec saves the softmax and the
    probabilities (b x heads x seq^2 each); with SDPA the largest saved tensor is linear in
    seq, and the step saves less. Gradients flow (the step trains)."""
    from gpu_check_bounds import record_sizes
    from gpu_check_common import GpuGPT

    spec = GPTSpec(layers=2, hidden=64, heads=4, seq=128, vocab=128, micro_batch=2, num_microbatches=1)
    square = spec.micro_batch * spec.heads * spec.seq ** 2 * 2  # bf16 probabilities of one layer
    local = GpuGPT(spec, runtime.device, attention="local")
    sdpa = GpuGPT(spec, runtime.device, attention="sdpa")
    local_sizes, sdpa_sizes = record_sizes(local, 1024), record_sizes(sdpa, 1024)
    assert max(local_sizes) >= square > max(sdpa_sizes)
    assert sum(sdpa_sizes) < sum(local_sizes) - 2 * spec.layers * square
    assert all(p.grad is not None and torch.isfinite(p.grad.float()).all() for p in sdpa.params)
    with pytest.raises(ValueError, match="attention='flash': expected 'local' or 'sdpa'"):
        GpuGPT(spec, runtime.device, attention="flash")
