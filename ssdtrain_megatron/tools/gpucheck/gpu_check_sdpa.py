"""Core attention on torch's ``scaled_dot_product_attention``, as a megatron-core layer spec: the
compute-bound shape of `make gpu-perf` (gpu_perf_plan.py).

Why: megatron-core's local spec (``DotProductAttention``) is unfused: it saves the fp32 softmax
output and the bf16 probabilities, b x heads x seq^2 bytes that grow with the sequence squared
and that users on Transformer Engine's fused attention never save. With them a GPT at hidden
8192, seq 1024 does about 7,000 FLOP per saved byte, IO-bound again on a 50 GB/s link. With
SDPA (flash attention on an H200) autograd saves what fused attention saves: q, k, v, the
output and the log-sum-exp, and a layer does about 2.1 x hidden FLOP per saved byte (17,000 at
hidden 8192) whatever the sequence: the SSDTrain paper's regime. The module is for time and
memory only: flash attention's backward need not be deterministic, so the bitwise steps keep
the local spec. It runs on the CPU too (torch's CPU kernels), for the stand-in tests.

Which kernel: chosen, not left to torch's dispatcher, and recorded. On sm90 recent torch
prefers cuDNN attention over flash when both can run, and cuDNN builds its graph on the first
step (seconds, in the time plan as the shape's first-step cost). :func:`choose_backend` tries
BACKEND_ORDER with a small forward and backward at the shape's heads, head size and dtype under
``torch.nn.attention.sdpa_kernel`` and keeps the first that runs (flash where it is available);
every forward then runs under that one backend, and the shape's result names it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Tuple

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide


BACKEND_ORDER: Tuple[str, ...] = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")
"""SDPA backends in the order :func:`choose_backend` tries them (``torch.nn.attention.SDPBackend``
names): flash first, the math kernel (unfused: it saves the probabilities) last."""
PROBE_SEQ = 128


def choose_backend(device: torch.device, dtype: torch.dtype, heads: int, head_dim: int,
                   order: Tuple[str, ...] = BACKEND_ORDER) -> str:
    """The first SDPA backend of ``order`` that runs a causal forward and backward at these heads,
    head size and dtype on ``device`` (module docstring). Raises RuntimeError naming each
    backend and why it did not run, when none does."""
    why = []
    for name in order:
        backend = getattr(SDPBackend, name, None)
        if backend is None:
            why.append(f"{name}: not in this torch")
            continue
        try:
            with sdpa_kernel([backend]):
                q, k, v = (torch.randn(1, heads, PROBE_SEQ, head_dim, device=device, dtype=dtype, requires_grad=True)
                           for _ in range(3))
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        except RuntimeError as exc:
            why.append(f"{name}: {str(exc).splitlines()[0][:120]}")
            continue
        return name
    raise RuntimeError("no SDPA backend runs here: " + "; ".join(why))


class SDPAttention(MegatronModule):
    """megatron-core's core attention (the ``CoreAttention`` protocol of
    megatron/core/transformer/attention.py) on ``torch.nn.functional.scaled_dot_product_attention``:
    query, key and value ``[s, b, heads, head_dim]`` in, ``[s, b, heads x head_dim]`` out.
    Causal masks go to SDPA as ``is_causal`` (the mask tensor is not read: flash attention
    takes no mask); any other mask as a boolean ``attn_mask``. No context parallelism, packed
    sequences or attention bias (the local spec has none either). ``backend``: the
    ``SDPBackend`` name every forward runs under (:func:`choose_backend`; None: torch's choice)."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None, backend: Optional[str] = None) -> None:
        super().__init__(config=config)
        if backend is not None and backend not in BACKEND_ORDER:
            raise ValueError(f"backend={backend!r}: expected one of {', '.join(BACKEND_ORDER)}")
        self.backend = backend
        if config.context_parallel_size != 1:
            raise ValueError(f"context_parallel_size={config.context_parallel_size}: SDPAttention "
                             "supports 1 only")
        tp = pg_collection.tp.size() if pg_collection is not None and hasattr(pg_collection, "tp") \
            else parallel_state.get_tensor_model_parallel_world_size()
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups, tp)
        self.hidden_per_partition = divide(config.kv_channels * config.num_attention_heads, tp)
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.attn_mask_type = attn_mask_type

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params=None) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPAttention takes no packed sequences and no attention bias")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        # [s, b, n, d] -> [b, n, s, d]: views; SDPA wants the last dimension contiguous, which it is
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if self.groups < self.heads:  # grouped-query attention: each group serves heads / groups
            k, v = (t.repeat_interleave(self.heads // self.groups, dim=1) for t in (k, v))
        causal = mask_type == AttnMaskType.causal
        # megatron's masks are True where attention is *not* allowed; SDPA's the opposite
        mask = None if causal or attention_mask is None else ~attention_mask
        # sdpa_kernel here, not around the step: recompute runs this forward again in backward
        kernels = sdpa_kernel([getattr(SDPBackend, self.backend)]) if self.backend else _nothing()
        with kernels:
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0, is_causal=causal,
                scale=self.scale)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, self.hidden_per_partition)


def sdpa_layer_spec(backend: Optional[str] = None) -> ModuleSpec:
    """megatron-core's local GPT layer spec with its core attention replaced by
    :class:`SDPAttention` on ``backend`` (megatron builds core attention by calling what the
    spec names, so a partial carries the backend)."""
    spec = get_gpt_layer_local_spec()
    attention = spec.submodules.self_attention
    core = functools.partial(SDPAttention, backend=backend) if backend else SDPAttention
    inner = dataclasses.replace(attention.submodules, core_attention=core)
    return dataclasses.replace(spec, submodules=dataclasses.replace(
        spec.submodules, self_attention=dataclasses.replace(attention, submodules=inner)))


class _nothing:
    """A context manager that does nothing (contextlib.nullcontext, without the import per call)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None
