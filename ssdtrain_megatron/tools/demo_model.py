"""A small GPT in plain torch: the offloader's own test and demo model (no Megatron needed).

Its attention splits one fused QKV projection into views of the same storage, the case where
an identity that ignores the storage offset returns one view's data for another.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Optional

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: Optional[int] = None) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn or 4 * hidden)
        self.fc2 = nn.Linear(ffn or 4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)  # three views of one storage
        q, k, v = (t.reshape(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(h // self.heads)
        mask = torch.ones(s, s, dtype=torch.bool).triu(1)
        att = scores.masked_fill(mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(y)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 256, hidden: int = 128, heads: int = 4, layers: int = 4,
                 seq: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(torch.zeros(seq, hidden))
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor, layer_scope: Optional[Callable[[int], object]] = None) -> torch.Tensor:
        """Logits; ``layer_scope(i)`` (e.g. ``offloader.layer``) wraps layer i when given."""
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for i, blk in enumerate(self.blocks):
            with (layer_scope(i) if layer_scope else contextlib.nullcontext()):
                x = blk(x)
        return self.head(self.ln(x))


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
