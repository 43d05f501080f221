"""Small models for the offloader tests, and a runner that trains with and without it."""

import copy
from typing import Optional

import torch
from torch import nn

from ssdtrain_megatron.tools.demo_model import TinyGPT, lm_loss
from tests.bitwise import bitwise_equal
from tests.exactness import ExactnessOracle


def mlp(width=256, depth=4, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)])


def tiny_gpt(seed=0, **kw):
    torch.manual_seed(seed)
    return TinyGPT(**kw)


class Steps(tuple):
    """(losses, grads of the last step, stats list), and with an offloader, ``exactness``: the
    exactness oracle's report (tests/exactness.py) of every tensor it packed and unpacked."""

    exactness: Optional[dict] = None


def run_steps(model, batches, offloader=None, steps=2, schedule=None, annotate=True, lr=0.01,
              wait_writes=False):
    """Train a deepcopy of ``model``; returns (losses, grads of the last step, stats list),
    with ``.exactness`` the exactness oracle's report when an offloader ran
    (:func:`assert_bitwise_equal` checks it).

    ``batches[mb]`` is one micro-batch; ``schedule`` is a list of ("F", mb) / ("B", mb) in
    execution order (default: forward then backward per micro-batch). Gradients accumulate
    over micro-batches, SGD steps once per step. ``wait_writes``: let every write finish
    before each backward, so that backward reads from the drive instead of forwarding.
    """
    if offloader is None:
        return Steps(_train(model, batches, None, steps, schedule, annotate, lr, wait_writes))
    with ExactnessOracle() as oracle:
        out = Steps(_train(model, batches, offloader, steps, schedule, annotate, lr, wait_writes))
    out.exactness = oracle.report()
    return out


def _train(model, batches, offloader, steps, schedule, annotate, lr, wait_writes):
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
    """Losses and gradients bitwise equal; and where ``got`` ran an offloader, every restored
    tensor bitwise what was packed, with at least one offloaded one compared when the steps
    read bytes back (tests/exactness.py)."""
    ref_losses, ref_grads, _ = ref
    losses, grads, stats = got
    report = getattr(got, "exactness", None)
    if report is not None:
        assert not report["mismatches"], "restored bytes differ from the packed ones:\n" + "\n".join(
            report["mismatches"][:10])
        if any(st.bytes_read for st in stats):
            assert report["compared_offloaded"] > 0, f"nothing read back was compared: {report}"
    assert len(ref_losses) == len(losses)
    for a, b in zip(ref_losses, losses):
        assert bitwise_equal(a, b), (a, b)
    assert ref_grads.keys() == grads.keys()
    for name in ref_grads:
        assert bitwise_equal(ref_grads[name], grads[name]), name
