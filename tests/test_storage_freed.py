"""A saved tensor whose owner frees its storage in place before our write starts (as megatron's
CheckpointWithoutOutput does with an output it recomputes in backward; megatron/discarded.py
registers those, this is the guard for anyone else) stays in memory as a counted fallback,
never a crash in the training thread and never bytes read from freed memory.

Real torch, the posix engine on a real directory."""

from __future__ import annotations

import logging

import torch

from ssdtrain_megatron import ActivationOffloader
from tests.bitwise import bitwise_equal
from tests.test_offloader import cfg, files_under

ROWS, WIDTH = 128, 512


def _forward(w: torch.Tensor, x: torch.Tensor, off=None):
    """Layer 0 saves ``h.t()`` (a strided view: the write would take its span) and then frees
    ``h``'s storage in place; layer 1 starts, which submits layer 0's deferred records. Before
    backward the owner puts the storage back, as CheckpointWithoutOutput's recompute does."""
    h = x * 2.0
    keep = h.detach().clone()
    if off is None:
        y = ((h.t() @ w) * 1.5).sum()
    else:
        with off.layer(0):
            z = h.t() @ w  # saves h.t() (and w, a leaf)
        h.untyped_storage().resize_(0)  # the owner frees it: it will recompute it
        with off.layer(1):
            y = (z * 1.5).sum()
    return h, keep, y


def test_a_storage_freed_before_its_write_is_a_counted_fallback_and_backward_is_exact(offload_dir, caplog):
    """Broken variant: the ``rec.check_storage()`` call removed from ``_submit`` (transfers.py): the
    strided record's span view raises in the training thread ("setStorage: ... out of bounds"
    or similar), and this test fails with that error."""
    torch.manual_seed(0)
    x = torch.randn(ROWS, WIDTH)
    w = torch.randn(ROWS, WIDTH, requires_grad=True)
    _, _, y = _forward(w, x)
    y.backward()
    ref = w.grad.clone()
    w.grad = None
    with caplog.at_level(logging.WARNING), ActivationOffloader(cfg(offload_dir, keep_last_layers=1)) as off:
        with off.microbatch(0):
            h, keep, y = _forward(w, x, off)
        off.wait_writes()
        h.untyped_storage().resize_(keep.numel() * keep.element_size())
        h.untyped_storage().copy_(keep.untyped_storage())  # the owner's recompute (no version bump)
        y.backward()
        st = off.end_step()
    assert bitwise_equal(w.grad, ref)
    assert st.fallbacks == 1, st
    assert "freed in place by its owner" in caplog.text
    assert files_under(offload_dir) == []
