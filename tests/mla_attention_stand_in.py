"""A CPU stand-in for Transformer Engine's core attention in multi-latent attention (MLA) layers.

megatron-core's local layer spec builds MLA (``get_gpt_layer_local_spec(multi_latent_attention=
True)``) with its local ``DotProductAttention`` as the core attention, but ``MLASelfAttention``
constructs it with ``k_channels`` and ``v_channels`` (queries and keys carry the no-position
and rotary parts, ``qk_head_dim + qk_pos_emb_head_dim`` wide; values ``v_head_dim``), keywords
only ``TEDotProductAttention`` takes: in megatron-core 0.16.1 and 0.17.1 the local MLA spec
fails at construction with a TypeError. On a GPU the TE spec runs MLA; here there is no TE.

:class:`MlaCoreAttentionStandIn` is ours: megatron-core's ``DotProductAttention`` (unfused
scaled, masked softmax; dropout under the model-parallel RNG tracker) that accepts those
keywords and shapes its output by the value head size. Everything else in an MLA layer built
with it is megatron-core's own module: the low-rank query and key/value projections, their
layernorms, the rotary embedding of the decoupled part, the output projection. Only the
tests use it (``megatron_harness.build_model`` puts it in the local MLA spec); what TE's fused
attention does with these tensors on a GPU is not shown by it.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from megatron.core.transformer.dot_product_attention import DotProductAttention


class MlaCoreAttentionStandIn(DotProductAttention):
    """megatron-core's local ``DotProductAttention`` taking MLA's ``k_channels`` (query/key head
    size) and ``v_channels`` (value head size) as TEDotProductAttention does.

    The parent's forward already multiplies ``[sq, b, np, k_channels]`` queries by keys of the
    same width and the probabilities by ``[sk, b, np, v_channels]`` values, whatever the widths;
    it only reshapes its output to ``kv_channels * heads``. Here that is ``v_channels * heads``.
    """

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 k_channels: Optional[int] = None, v_channels: Optional[int] = None,
                 cp_comm_type: Optional[str] = None, pg_collection: Any = None) -> None:
        if softmax_scale is None and k_channels is not None:
            softmax_scale = 1.0 / math.sqrt(k_channels)
        super().__init__(config, layer_number, attn_mask_type, attention_type,
                         attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        if v_channels is not None:
            self.hidden_size_per_attention_head = v_channels
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition
