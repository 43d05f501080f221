"""A CUDA out-of-memory while a record is brought back raises as one, and leaves no read that
never completes.

The memory engine's reads are copies out of its pinned pool issued at once on the reload
stream, into device memory allocated just before (cache/device_copy.py ``restore``). Before
the fix the record was moved to READING first: an out-of-memory there left it READING with no
completion ever coming, so the step's end waited ``io_timeout_s`` and raised ``IOTimeout``
instead of the error that happened. Now the allocation comes first: on failure the record
stays ON_DISK (its bytes still in the pool), a demand read raises ``torch.OutOfMemoryError``
as it is, and a read ahead stops there (warned once) for backward's own read to try again.

CPU machine: the recording stand-in for CUDA (tests/recording_streams.py), whose allocation
of restored tensors (``empty``) is made to raise torch's out-of-memory error; the memory
engine, its pool and autograd are real. Broken variant tried: ``Reads.start`` moving the
record to READING before the restore (as before) fails the first test with ``IOTimeout``;
the read ahead raising instead of stopping fails the second.
"""

from __future__ import annotations

import pytest
import torch

from ssdtrain_megatron import ActivationOffloader, OffloadConfig
from ssdtrain_megatron.cache.progress import IOTimeout
from ssdtrain_megatron.io import make_engine
from tests.recording_streams import Recorder
from tests.test_staging_race import Logged

ROWS, COLS, LAYERS = 64, 256, 3
TIMEOUT_S = 20.0  # only a broken variant waits for it


class Saves(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y * 1

    @staticmethod
    def backward(ctx, g):
        (s,) = ctx.saved_tensors
        return g * (1 - s * s)


class OutOfMemory(Recorder):
    """The stand-in, whose next ``fail`` allocations of restored tensors raise CUDA's error."""

    fail = 0

    def empty(self, numel, dtype, device):
        if self.fail:
            self.fail -= 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 KiB (stand-in)")
        return super().empty(numel, dtype, device)


def _offloader(tmp_path, prefetch_layers: int):
    config = OffloadConfig(dirs=[str(tmp_path)], engine="memory", min_tensor_bytes=0, keep_last_layers=0,
                           prefetch_layers=prefetch_layers, max_inflight_bytes=1 << 20,
                           host_memory_bytes=1 << 20, io_timeout_s=TIMEOUT_S)
    rec = OutOfMemory()
    return rec, ActivationOffloader(config, device=torch.device("cpu"), engine=Logged(make_engine(config), rec),
                                    streams=rec)


def _forward(off, seed: int):
    x = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(seed)).requires_grad_()
    with off.microbatch(0):
        h = x
        for i in range(LAYERS):
            with off.layer(i):
                h = Saves.apply(h)
    off.wait_writes()
    return x, h.sum()


def _reference_grad(seed: int) -> torch.Tensor:
    x = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(seed)).requires_grad_()
    h = x
    for _ in range(LAYERS):
        h = Saves.apply(h)
    h.sum().backward()
    return x.grad


def _exact(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_an_out_of_memory_in_a_demand_read_raises_and_the_step_ends(tmp_path):
    rec, off = _offloader(tmp_path, prefetch_layers=1)
    try:
        x, loss = _forward(off, 0)
        rec.fail = 2  # the read ahead, then backward's own read
        with pytest.raises(torch.OutOfMemoryError, match="stand-in"):
            loss.backward()
        del loss
        try:
            off.end_step()  # no read left that never completes: returns at once
        except IOTimeout as exc:
            pytest.fail(f"the step's end timed out instead: {exc}")
        x, loss = _forward(off, 1)  # memory is back: the next step is exact
        loss.backward()
        stats = off.end_step()
        assert stats.tensors_offloaded == LAYERS
        _exact(x.grad, _reference_grad(1))
    finally:
        off.close()


def test_an_out_of_memory_in_a_read_ahead_stops_it_and_backward_reads_again(tmp_path):
    rec, off = _offloader(tmp_path, prefetch_layers=LAYERS)
    try:
        x, loss = _forward(off, 0)
        rec.fail = 1  # the first read ahead
        loss.backward()
        stats = off.end_step()
        assert stats.bytes_read == stats.bytes_offloaded > 0
        _exact(x.grad, _reference_grad(0))
    finally:
        off.close()
