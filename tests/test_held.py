"""Writes that would free nothing: tensors something else holds until backward pass through,
and a queued write whose tensor backward wants first is taken back (issue 31).

Each test compares gradients as integer views (tests/bitwise.py) against a run without the
offloader, and says what was written and read back.
"""

from __future__ import annotations

import torch
from torch import nn

from ssdtrain_megatron import ActivationOffloader
from tests.bitwise import bitwise_equal
from tests.faulty import HeldWrites, faulty_offloader
from tests.test_offloader import cfg, files_under

ROWS, WIDTH = 64, 256
TENSOR_BYTES = ROWS * WIDTH * 4


class Model(nn.Module):
    """``lin(x * scale)``: the product saves ``x`` (for the scale's gradient) as it is, so a
    tensor the caller holds is saved for backward without a copy."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((WIDTH,), 0.5))
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x * self.scale)


def _grads(model: nn.Module):
    return [p.grad.clone() for p in model.parameters()]


def _reference(model: nn.Module, x: torch.Tensor):
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    return grads


def test_a_registered_input_passes_through_and_the_rest_is_read_back(offload_dir):
    """The schedule's received input (here ``x``, held by the test until backward) is saved
    by the product: registered, it is not written. Broken variant: drop the
    ``in self._held`` test from the pack hook (hooks.py); ``x`` is then written and forwarded
    at backward (bytes_wasted_held == TENSOR_BYTES)."""
    model = Model()
    x = torch.randn(ROWS, WIDTH)
    ref = _reference(model, x)
    with ActivationOffloader(cfg(offload_dir, keep_last_layers=0)) as off:
        off.register_held([x, None])
        with off.microbatch(0):
            y = model(x)
        off.wait_writes()  # written before backward: a read, not a write still under way
        y.sum().backward()
        st = off.end_step()
    assert all(bitwise_equal(a, b) for a, b in zip(ref, _grads(model), strict=True))
    assert st.tensors_held_by_schedule == 1
    assert st.bytes_offloaded == st.bytes_read == TENSOR_BYTES  # x * scale: out and back
    assert st.bytes_wasted == st.bytes_wasted_held == 0
    assert files_under(offload_dir) == []


def test_a_storage_found_alive_at_backward_passes_through_in_later_steps(offload_dir):
    """A tensor the caller keeps across steps (a mask, a rotary table) is written once, found
    alive at backward, and from the next step on passes through. Broken variant: make
    ``HeldStorages.learn`` a no-op; step 2 then writes it again for nothing."""
    model = Model()
    kept = torch.randn(ROWS, WIDTH)
    ref = _reference(model, kept)
    steps = []
    with ActivationOffloader(cfg(offload_dir, keep_last_layers=0)) as off:
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            with off.microbatch(0):
                y = model(kept)
            off.wait_writes()
            y.sum().backward()
            steps.append(off.end_step())
            assert all(bitwise_equal(a, b) for a, b in zip(ref, _grads(model), strict=True))
    first, second = steps
    assert first.bytes_wasted_held == first.bytes_wasted == TENSOR_BYTES  # kept: forwarded
    assert first.bytes_read == TENSOR_BYTES  # kept * scale: written and read back
    assert second.tensors_held_by_schedule == 1
    assert second.bytes_wasted == 0 and second.bytes_offloaded == second.bytes_read == TENSOR_BYTES


def test_a_queued_write_that_backward_wants_is_taken_back(offload_dir):
    """The only IO thread is held inside the first write, the later writes wait in its queue,
    and backward starts: its prefetch wants every tensor of the micro-batch. The queued writes
    are taken back then, so when the IO thread is let go (from a gradient hook, mid-backward)
    there is nothing left to write; the gradients are exact. Broken variant: in
    ``_wanted_while_writing`` (cache/transfers.py) skip the cancel; the queued writes then run
    when the gate opens (seen: 3 of the 6 tensors written, for nothing: bytes_wasted)."""
    lin = nn.Linear(WIDTH, WIDTH)
    xs = [torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    torch.stack([lin(x).sin() for x in xs]).sum().backward()
    ref = _grads(lin)
    lin.zero_grad(set_to_none=True)
    with faulty_offloader(cfg(offload_dir, keep_last_layers=0, io_threads=1)) as off:
        gate = off.engine.fault = HeldWrites()
        gate.held = True

        def let_go(grad):  # runs in backward, after its first unpack and prefetch
            gate.go.set()
            off.wait_writes()

        with off.microbatch(0):
            outs = [lin(xs[0]).sin()]  # 2 saved tensors; the first write holds the IO thread
            assert gate.entered.wait(30)
            hidden = lin(xs[1])
            hidden.register_hook(let_go)
            outs += [hidden.sin(), lin(xs[2]).sin()]  # 4 more, queued behind it
        torch.stack(outs).sum().backward()
        del outs, hidden
        st = off.end_step()
    assert all(bitwise_equal(a, b) for a, b in zip(ref, _grads(lin), strict=True))
    assert st.bytes_offloaded <= 2 * TENSOR_BYTES, st  # the held run (it may hold a second)
    assert st.bytes_offloaded == st.tensors_offloaded * TENSOR_BYTES
    assert st.writes_taken_back >= 4 and st.tensors_offloaded + st.writes_taken_back == 6, st
    # The held run (and a second the IO thread may have taken with it) was under way when
    # read-ahead came: left to finish, then at its backward either read back, or found alive
    # (the input xs[0], which this test holds): held by someone else (cache/held.py).
    assert st.bytes_wasted + st.bytes_read == st.bytes_offloaded
    assert st.bytes_wasted_held == st.bytes_wasted == TENSOR_BYTES and st.bytes_on_disk == 0
    assert files_under(offload_dir) == []


def test_a_deferred_tensor_whose_graph_is_freed_before_its_write_is_not_written(offload_dir):
    """Megatron runs bias-dropout-add under torch.enable_grad even inside a full-recompute
    checkpoint's no-grad forward: a small graph is built, saved for, and freed when the
    checkpoint returns, before the next layer starts the deferred writes of this one
    (keep_last_layers). Those records have no user left and are released, not handed to the
    engine. Broken variant: drop the drain() at the top of Transfers.submit_all
    (cache/transfers.py): a tensor of layer 1 reaches the engine ("assert [0] == []"), as
    pp2_recompute_full's last stage wrote 100% waste (tests/test_megatron_integration.py)."""
    lin = nn.Linear(WIDTH, WIDTH)
    x = torch.randn(ROWS, WIDTH)
    lin(x).sin().sum().backward()
    ref = _grads(lin)
    lin.zero_grad(set_to_none=True)
    with ActivationOffloader(cfg(offload_dir, keep_last_layers=1)) as off:
        submitted = []
        write = off.engine.write

        def spy(key, data, event=None):  # the real engine's write, remembered
            submitted.append(key)
            return write(key, data, event)

        off.engine.write = spy
        with off.microbatch(0):
            with off.layer(1), torch.no_grad():
                with torch.enable_grad():
                    scratch = (x * 2).requires_grad_() * lin.weight.sum()  # saves x * 2 (fresh)
                    scratch = lin(scratch)  # saves its input (fresh), then the graph goes
                h = scratch.detach()
                del scratch
            with off.layer(2):
                out = lin(x).sin()
        out.sum().backward()
        st = off.end_step()
    assert h.shape == x.shape
    assert submitted == [], submitted
    assert st.bytes_offloaded == 0 and st.bytes_wasted == 0, st
    assert all(bitwise_equal(a, b) for a, b in zip(ref, _grads(lin), strict=True))


def test_every_transition_effect_is_counted():
    """record.TRANSITIONS names what each transition counts; StepCounters.count must know
    each effect (a new one left out would raise KeyError inside a step)."""
    from ssdtrain_megatron.cache.record import TRANSITIONS
    from ssdtrain_megatron.telemetry.stats import StepCounters

    effects = {e for names in TRANSITIONS.values() for e in names}
    assert effects >= {"offloaded", "read", "forwarded", "taken_back", "held"}
    for e in effects:
        c = StepCounters()
        c.count(e, 8, "layer", "offload")
        assert c != StepCounters(), e  # it moved some counter
