"""The ordering scenes' model: every kernel goes through its stream, every tensor through the
allocator model (tests/recording_streams.py ``Recorder(deferred_compute=True)``,
tests/stand_in_allocator.py).

A layer computes ``y = tanh(x) * x`` and saves ``tanh(x)`` and a copy of ``x``: two
activations only the saved-tensor hooks hold, so that whatever lets one go before its copies
ran frees its block under them. Its forward and backward kernels are ``Recorder.launch``-ed:
the torch code runs when the stream runs it, on views of the allocator's blocks, as a GPU runs
a kernel, so a consumer on a stream that did not wait for a reload reads what the block held
then (poison, another tensor's bytes). The input's gradient lands in a host buffer through a
kernel of the last backward node (:class:`Sink`), read once every stream ran.
"""

from __future__ import annotations

import os
from typing import List

import torch

from tests.recording_streams import Recorder

LAYERS = 4
SHAPE = (64, 64)  # 16 KiB of float32: a 512-byte multiple
NBYTES = SHAPE[0] * SHAPE[1] * 4
SEEDS = [int(os.environ["SSDTRAIN_STANDIN_SEED"])] if os.environ.get("SSDTRAIN_STANDIN_SEED") else list(range(5))
"""Each ordering scene runs over these seeds (printed by the recorder); one set replays one."""


def _like(rec: Recorder, x: torch.Tensor) -> torch.Tensor:
    return rec.empty(x.numel(), x.dtype, x.device).view(x.shape)


def _forward_kernel(t, c, y, x) -> None:
    torch.tanh(x, out=t)
    c.copy_(x)
    torch.mul(t, x, out=y)


def _backward_kernel(gx, g, t, c) -> None:
    torch.mul(g, (1 - t * t) * c + t, out=gx)


class Layer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rec):
        t, c, y = _like(rec, x), _like(rec, x), _like(rec, x)
        rec.launch("produce", _forward_kernel, t, c, y, x)
        ctx.save_for_backward(t, c)
        ctx.rec = rec
        return y

    @staticmethod
    def backward(ctx, g):
        t, c = ctx.saved_tensors
        gx = _like(ctx.rec, g)
        ctx.rec.launch("consume", _backward_kernel, gx, g, t, c)
        return gx, None


class Sink(torch.autograd.Function):
    """The input, moved into allocator memory; backward copies the gradient into ``out``."""

    @staticmethod
    def forward(ctx, x, out, rec):
        y = _like(rec, x)
        rec.launch("produce", lambda y, x: y.copy_(x), y, x)
        ctx.out, ctx.rec = out, rec
        return y

    @staticmethod
    def backward(ctx, g):
        ctx.rec.launch("consume", lambda o, g: o.copy_(g), ctx.out, g)
        return None, None, None


def inputs(mb: int) -> torch.Tensor:
    return torch.randn(*SHAPE, generator=torch.Generator().manual_seed(mb)).requires_grad_()


def forward(rec: Recorder, mb: int, out: torch.Tensor, off=None, between=None) -> torch.Tensor:
    """Micro-batch ``mb``'s forward (under the offloader when given; ``between()`` after each
    layer): its output."""
    x = inputs(mb)
    if off is None:
        h = Sink.apply(x, out, rec)
        for _ in range(LAYERS):
            h = Layer.apply(h, rec)
        return h
    with off.microbatch(mb):
        h = Sink.apply(x, out, rec)
        for i in range(LAYERS):
            with off.layer(i):
                h = Layer.apply(h, rec)
            if between is not None:
                between()
    return h


def backward(h: torch.Tensor) -> None:
    """Backward from ``h`` with a gradient of ones (no host op reads ``h``)."""
    torch.autograd.backward(h, torch.ones(SHAPE))


def reference(n: int) -> List[torch.Tensor]:
    """The gradients of micro-batches 0..n-1 without the offloader."""
    rec = Recorder(seed=0)
    grads = []
    for mb in range(n):
        out = torch.zeros(SHAPE)
        backward(forward(rec, mb, out))
        rec.run_all()
        grads.append(out)
    return grads


def exact(rec: Recorder, grads: List[torch.Tensor], what: str = "") -> None:
    for mb, (got, want) in enumerate(zip(grads, reference(len(grads)), strict=True)):
        if not torch.equal(got.view(torch.int32), want.view(torch.int32)):
            bad = (got.view(torch.int32) != want.view(torch.int32)).nonzero()[0].tolist()
            raise AssertionError(f"{what}micro-batch {mb}'s gradient differs at {bad}: "
                                 f"{got[tuple(bad)].item()!r}, expected {want[tuple(bad)].item()!r} "
                                 f"(seed {rec.seed})")
