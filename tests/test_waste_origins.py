"""Where written bytes that are never read back come from (issue 37).

``StepStats.bytes_wasted_by_origin`` adds up every wasted byte by how (released unread,
forwarded, held) and origin (layer, dtype, shape; with ``debug_save_sites`` the code that
saved it) at the record transition that wastes it, so the pack hook does no extra work; what a
checkpoint's no-grad forward saves under ``torch.enable_grad()`` passes through
(``discarded_graph``); and with ``keep_last_layers: 0`` what is saved after a micro-batch's
last layer waits for its backward. Gradients are compared as integer views (tests/bitwise.py).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ssdtrain_megatron import ActivationOffloader
from ssdtrain_megatron.cache import hooks
from tests.bitwise import bitwise_equal
from tests.faulty import HeldWrites, faulty_offloader
from tests.test_offloader import cfg, files_under

ROWS, WIDTH = 64, 256
NBYTES = ROWS * WIDTH * 4
KIND = f"float32[{ROWS}, {WIDTH}]"


def _save_two(lin: nn.Linear) -> torch.Tensor:
    """Saves two tensors: the linear's input (for the weight's gradient) and its output (sin)."""
    return lin(torch.randn(ROWS, WIDTH)).sin()


def _dropped_after_writes(offload_dir, monkeypatch=None, **kw):
    """One micro-batch whose graph is dropped, without a backward, once its writes are done."""
    lin = nn.Linear(WIDTH, WIDTH)
    with ActivationOffloader(cfg(offload_dir, keep_last_layers=0, **kw)) as off:
        with off.microbatch(0):
            with off.layer(1):
                out = _save_two(lin)
        off.wait_writes()
        del out
        st = off.end_step()
    assert files_under(offload_dir) == []
    return st


def test_a_write_released_unread_is_counted_by_layer_dtype_and_shape(offload_dir, monkeypatch):
    """No stack is walked without debug_save_sites (save_site raises here). Broken variant:
    give (ON_DISK, RELEASED) no effect in cache/record.py TRANSITIONS: bytes_wasted_by_origin
    is {} while bytes_wasted is 2 tensors."""

    def no_stack_walk(*_):
        raise AssertionError("save_site called without debug_save_sites")

    monkeypatch.setattr(hooks, "save_site", no_stack_walk)
    st = _dropped_after_writes(offload_dir)
    assert st.bytes_offloaded == st.bytes_wasted == 2 * NBYTES and st.bytes_read == 0
    assert st.bytes_wasted_by_origin == {f"released unread: layer 1 {KIND}": 2 * NBYTES}


def test_debug_save_sites_names_the_code_that_saved_them(offload_dir):
    st = _dropped_after_writes(offload_dir, debug_save_sites=True)
    (key, n), = st.bytes_wasted_by_origin.items()
    line = _save_two.__code__.co_firstlineno + 2
    assert n == 2 * NBYTES
    assert key.startswith(f"released unread: layer 1 {KIND} at test_waste_origins.py:{line} _save_two"), key


def test_a_forwarded_write_dropped_before_it_completes_counts_as_forwarded(offload_dir):
    """Backward takes the tensor from memory while its write is under way, and is done with it
    before the write completes: its bytes are wasted as "forwarded", not "released unread".
    Broken variant: let cache/transfers.py _release move a WRITING_WANTED record to
    WRITE_DROPPED (as before): {"released unread: no layer scope float32[64, 256]": 65536}."""
    lin = nn.Linear(WIDTH, WIDTH)
    x = torch.randn(ROWS, WIDTH)
    lin(x).sum().backward()
    ref = [p.grad.clone() for p in lin.parameters()]
    lin.zero_grad(set_to_none=True)
    with faulty_offloader(cfg(offload_dir, keep_last_layers=0, io_threads=1)) as off:
        gate = off.engine.fault = HeldWrites()
        gate.held = True
        with off.microbatch(0):
            out = lin(x).sum()  # saves x only
        assert gate.entered.wait(30)  # its write is under way: it cannot be taken back
        out.backward()  # forwarded from memory; autograd then drops its handle
        del out
        off.poll()
        gate.go.set()
        off.wait_writes()
        st = off.end_step()
    assert all(bitwise_equal(a, p.grad) for a, p in zip(ref, lin.parameters(), strict=True))
    assert st.tensors_forwarded == 1 and st.bytes_offloaded == st.bytes_wasted == NBYTES
    assert st.bytes_wasted_by_origin == {f"forwarded: no layer scope {KIND}": NBYTES}


def _masked(x: torch.Tensor, bias: nn.Parameter) -> torch.Tensor:
    """What megatron-core's TransformerLayer does inside a checkpoint's no-grad forward: the
    bias-dropout-add under torch.enable_grad() (its dropout saves the mask on CPU). The
    checkpoint's output gets its own grad_fn; here the caller drops the graph when it likes."""
    with torch.no_grad():
        with torch.enable_grad():
            return torch.nn.functional.dropout(x + bias, 0.5) + x


def test_what_a_no_grad_forward_saves_under_enable_grad_passes_through(offload_dir):
    """Inside ``discarded_graph()`` the mask is left to autograd (it is freed with its graph);
    outside, the same code writes it, and it is released unread."""
    bias = nn.Parameter(torch.zeros(WIDTH))
    x = torch.randn(ROWS, WIDTH)
    stats = {}
    with ActivationOffloader(cfg(offload_dir, keep_last_layers=0)) as off:
        for discarded in (True, False):
            with off.microbatch(0):
                if discarded:
                    with off.discarded_graph():
                        out = _masked(x, bias)
                else:
                    out = _masked(x, bias)
            off.wait_writes()  # written (not taken back as the graph goes)
            del out
            stats[discarded] = off.end_step()
    assert stats[True].passed_through_by_reason == {"discarded_graph": 1}
    assert stats[True].bytes_offloaded == stats[True].bytes_wasted == 0
    assert stats[False].bytes_wasted_by_origin == {f"released unread: no layer scope {KIND}": NBYTES}


def _two_layers_and_a_head(lin, head, seed, off=None):
    """Two layers (scoped when ``off`` is given) and a head after them: 4 tensors saved in the
    layers (each linear's input, each sin's input), 1 after the last layer (the head's input)."""
    x = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(seed))
    h = x
    for layer in (1, 2):
        with off.layer(layer) if off is not None else contextlib.nullcontext():
            h = lin(h).sin()
    return head(h).sum()


def _run(lin, head, batches, off=None, announce=False):
    """Forward the micro-batches in order, then their backwards in order; the gradients and,
    with ``off``, the step's StepStats."""
    for p in (*lin.parameters(), *head.parameters()):
        p.grad = None
    outs = []
    for mb, seed in enumerate(batches):
        with off.microbatch(mb) if off is not None else contextlib.nullcontext():
            outs.append(_two_layers_and_a_head(lin, head, seed, off))
    if off is not None:
        off.wait_writes()  # written before backward (what is under way then is forwarded)
        if announce:
            off.begin_backward(0)  # its backward is next (as a pipeline's last stage says)
    for out in outs:
        out.backward()
    del outs
    grads = [p.grad.clone() for p in (*lin.parameters(), *head.parameters())]
    return grads, (off.end_step() if off is not None else None)


def test_with_keep_last_layers_0_what_follows_the_last_layer_waits_for_its_backward(offload_dir):
    """The head's input is saved after the last layer: kept when its micro-batch's backward
    comes next (a pipeline's last stage), written when another micro-batch's forward comes
    first. Broken variant: in cache/hooks.py SavedTensorHooks.pack defer only with keep_last_layers (drop
    ``or layer is None``): the head's input is written at once (tensors_kept 0, 5 tensors
    written by the first step)."""
    lin, head = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
    refs = [_run(lin, head, batches)[0] for batches in ([0], [0, 1])]
    with ActivationOffloader(cfg(offload_dir, keep_last_layers=0)) as off:
        one = _run(lin, head, [0], off, announce=True)  # backward next: the head's input stays
        two = _run(lin, head, [0, 1], off)  # micro-batch 1 first: 0's head input is written
    for ref, (grads, _) in zip(refs, (one, two), strict=True):
        assert all(bitwise_equal(a, b) for a, b in zip(ref, grads, strict=True))
    backward_next, forward_next = one[1], two[1]
    assert backward_next.tensors_kept == 1 and backward_next.tensors_offloaded == 4, backward_next
    assert forward_next.tensors_kept == 1 and forward_next.tensors_offloaded == 4 + 1 + 4, forward_next
    assert backward_next.bytes_wasted == forward_next.bytes_wasted == 0
    assert forward_next.bytes_read == forward_next.bytes_offloaded
