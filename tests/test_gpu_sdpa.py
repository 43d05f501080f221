"""The compute-bound shape of `make gpu-perf` runs megatron-core with its core attention on
torch's SDPA (ssdtrain_megatron/tools/gpucheck/gpu_check_sdpa.py): on a machine without a GPU,
that attention against megatron-core's own, what it saves, and the backend it chooses and runs
every forward under."""

from __future__ import annotations

import pytest
import torch

from ssdtrain_megatron.tools.minigpt import GPTSpec
from tests.test_gpu_perf import runtime  # noqa: F401  (the fixture: megatron-core on the CPU runtime)


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

    from ssdtrain_megatron.tools.gpucheck.gpu_check_sdpa import SDPAttention

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
    from ssdtrain_megatron.tools.gpucheck.gpu_check_bounds import record_sizes
    from ssdtrain_megatron.tools.gpucheck.gpu_check_common import GpuGPT

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


def test_the_sdpa_backend_is_chosen_in_order_named_and_every_forward_runs_under_it(runtime):
    """choose_backend keeps the first of its order that runs here (flash on this CPU, as on an
    H100 or H200; the memory-efficient kernel has no CPU version, so the next is taken), the
    model names it, and its forwards run under that backend alone: one this device lacks
    fails the step instead of torch quietly choosing another."""
    from ssdtrain_megatron.tools.gpucheck.gpu_check_common import GpuGPT
    from ssdtrain_megatron.tools.gpucheck.gpu_check_sdpa import choose_backend

    assert choose_backend(runtime.device, torch.bfloat16, 4, 16) == "FLASH_ATTENTION"
    assert choose_backend(runtime.device, torch.bfloat16, 4, 16, ("EFFICIENT_ATTENTION", "MATH")) == "MATH"
    with pytest.raises(RuntimeError, match="no SDPA backend runs here: EFFICIENT_ATTENTION: "):
        choose_backend(runtime.device, torch.bfloat16, 4, 16, ("EFFICIENT_ATTENTION",))
    spec = GPTSpec(layers=1, hidden=64, heads=4, seq=32, vocab=128, micro_batch=1, num_microbatches=1)
    assert GpuGPT(spec, runtime.device, attention="sdpa").sdpa_backend == "FLASH_ATTENTION"
    assert GpuGPT(spec, runtime.device).sdpa_backend is None
    pinned = GpuGPT(spec, runtime.device, attention="sdpa", sdpa_backend="EFFICIENT_ATTENTION")
    with pytest.raises(RuntimeError, match="No viable backend"):
        pinned.step()
    with pytest.raises(ValueError, match="backend='flash': expected one of FLASH_ATTENTION"):
        GpuGPT(spec, runtime.device, attention="sdpa", sdpa_backend="flash")


# -- the plan, the flags, the parent ---------------------------------------------------------
