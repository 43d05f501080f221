"""Small models for the offloader tests, and a runner that trains with and without it."""

import copy

import torch
from torch import nn

from ssdtrain_megatron.tools.demo_model import TinyGPT, lm_loss
from tests.bitwise import bitwise_equal


def mlp(width=256, depth=4, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)])


def tiny_gpt(seed=0, **kw):
    torch.manual_seed(seed)
    return TinyGPT(**kw)


def run_steps(model, batches, offloader=None, steps=2, schedule=None, annotate=True, lr=0.01,
              wait_writes=False):
    """Train a deepcopy of ``model``; returns (losses, grads of the last step, stats list).

    ``batches[mb]`` is one micro-batch; ``schedule`` is a list of ("F", mb) / ("B", mb) in
    execution order (default: forward then backward per micro-batch). Gradients accumulate
    over micro-batches, SGD steps once per step. ``wait_writes``: let every write finish
    before each backward, so that backward reads from the drive instead of forwarding.
    """
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    schedule = schedule or [op for mb in range(len(batches)) for op in (("F", mb), ("B", mb))]
    losses, stats = [], []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        pending = {}
        for op, mb in schedule:
            if op == "F":
                pending[mb] = _forward(model, batches[mb], offloader, mb, annotate)
                losses.append(pending[mb].detach().clone())
            else:
                if offloader is not None:
                    if wait_writes:
                        offloader.wait_writes()
                    offloader.begin_backward(mb)
                (pending.pop(mb) / len(batches)).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        if offloader is not None:
            stats.append(offloader.end_step())
    return losses, grads, stats


def _forward(model, batch, offloader, mb, annotate):
    if offloader is None:
        return _loss(model, batch, None)
    with offloader.microbatch(mb):
        return _loss(model, batch, offloader.layer if annotate else None)


def _loss(model, batch, scope):
    if isinstance(model, TinyGPT):
        return lm_loss(model(batch, scope), batch)
    h = batch
    for i, layer in enumerate(model):
        if scope is None:
            h = layer(h)
        else:
            with scope(i):
                h = layer(h)
    return h.pow(2).mean()


def assert_bitwise_equal(ref, got):
    ref_losses, ref_grads, _ = ref
    losses, grads, _ = got
    assert len(ref_losses) == len(losses)
    for a, b in zip(ref_losses, losses):
        assert bitwise_equal(a, b), (a, b)
    assert ref_grads.keys() == grads.keys()
    for name in ref_grads:
        assert bitwise_equal(ref_grads[name], grads[name]), name
