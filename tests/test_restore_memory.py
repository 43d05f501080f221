"""Which memory a restored tensor takes on the GPU path (issue 54, fault A), on the recording
stand-in's model of CUDA's caching allocator (tests/stand_in_allocator.py: one pool per stream,
a freed block serving only its own stream's allocations).

A 16-layer model whose activations are allocated on the compute stream, as a GPU model's are,
runs two steps through the offloader (memory engine). Its activations are let go once their
copies to host memory landed, back to the compute stream's pool; backward's restored tensors
must come from that same pool, so that the memory forward freed serves backward's reads and the
allocator keeps about what is in use. Were they allocated on the reload stream (main before
this change), the reload stream's pool would grow beside the compute stream's, never able to
use its blocks, and the second step's peak would find reserved memory far above what is
allocated.

What only a GPU shows: the real allocator's reserved and allocated bytes per stream at the
step's peak (``torch.cuda.memory_stats``: ``reserved_bytes.all.peak`` against
``allocated_bytes.all.peak``), and how long the reload stream waits for the compute stream at
each restore's allocation event.
"""

from __future__ import annotations

import pytest
import torch

from ssdtrain_megatron import ActivationOffloader, OffloadConfig
from tests.gpu_scenes import SEEDS, Sink
from tests.recording_streams import Recorder

LAYERS = 16
SHAPE = (64, 384)  # 96 KiB of float32: a 512-byte multiple, as a dense activation's block is


def _tanh(y, x) -> None:
    torch.tanh(x, out=y)


def _tanh_grad(y, gx, g) -> None:
    torch.mul(g, 1 - y * y, out=gx)


class Tanh(torch.autograd.Function):
    """y = tanh(x), y allocated on the current (compute) stream's pool and saved for backward.
    Both kernels go through the stream (``Recorder.launch``: every stream is deferred, so the
    host never reads a tensor before its stream ran)."""

    @staticmethod
    def forward(ctx, x, rec):
        y = rec.empty(x.numel(), x.dtype, x.device).view(x.shape)
        rec.launch("produce", _tanh, y, x)
        ctx.save_for_backward(y)
        ctx.rec = rec
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        gx = ctx.rec.empty(g.numel(), g.dtype, g.device).view(g.shape)
        ctx.rec.launch("consume", _tanh_grad, y, gx, g)
        return gx, None


def _model(rec: Recorder, x: torch.Tensor, out: torch.Tensor, off=None) -> torch.Tensor:
    """The input moved into allocator memory (its gradient lands in ``out`` through the
    stream: tests/gpu_scenes.py ``Sink``), then the layers (each under the offloader)."""
    h = Sink.apply(x, out, rec)
    for i in range(LAYERS):
        if off is None:
            h = Tanh.apply(h, rec)
            continue
        with off.layer(i):
            h = Tanh.apply(h, rec)
        rec.run_all()  # the GPU keeps up with forward: each copy lands, its memory goes back
        off.poll()
    return h


def _input(step: int) -> torch.Tensor:
    return torch.randn(*SHAPE, generator=torch.Generator().manual_seed(step)).requires_grad_()


def _step(off: ActivationOffloader, rec: Recorder, step: int):
    out = torch.zeros(SHAPE)
    with off.microbatch(0):
        h = _model(rec, _input(step), out, off)
    off.wait_writes()
    torch.autograd.backward(h, torch.ones(SHAPE))  # no host op reads h
    del h
    off.end_step()
    rec.run_all()  # the gradient's kernel ran: out holds it
    return out


def _reference(step: int):
    """The same model without the offloader (eager streams: kernels run when issued)."""
    rec = Recorder(seed=0)
    out = torch.zeros(SHAPE)
    torch.autograd.backward(_model(rec, _input(step), out), torch.ones(SHAPE))
    rec.run_all()
    return out


@pytest.mark.parametrize("seed", SEEDS)
def test_restored_tensors_reuse_the_memory_forward_freed(tmp_path, seed):
    """At the second step's peak, reserved memory is within 1.1x of allocated memory (all
    streams together), and backward's restores reused the compute stream's blocks instead of
    growing a pool of their own. Broken variant: ``DeviceCopy.restore`` allocating inside
    ``ops.use(reload_stream)`` (fault A, main before this change): the reload stream's pool
    holds the read-ahead window beside the compute stream's: 1.20 at seed 54 with an eager
    compute stream (1.25 on main's code); with the fix 1.00 (384 KiB reserved, all on the
    compute stream, 58 of 62 blocks reused). Every seed here fails it, and so does the reload
    stream not waiting for the allocation event (the poisoned block reused under the copy)."""
    rec = Recorder(seed=seed, poison=True, deferred_compute=True)
    cfg = OffloadConfig(dirs=[str(tmp_path)], engine="memory", min_tensor_bytes=0, keep_last_layers=0,
                        prefetch_layers=2, host_memory_bytes=64 << 20, max_inflight_bytes=64 << 20,
                        pinned_staging_bytes=4 << 20)
    with ActivationOffloader(cfg, device=torch.device("cpu"), streams=rec) as off:
        compute, reload = rec.current_stream(torch.device("cpu")).name, off.copy.reload_stream.name
        first = _step(off, rec, 0)
        rec.alloc.reset_peak()
        second = _step(off, rec, 1)
        report = rec.streams_report()
    for got, want in ((first, _reference(0)), (second, _reference(1))):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    peak = report["peak"]
    ratio = rec.alloc.peak_ratio()
    assert ratio <= 1.1, (f"reserved {peak['reserved']} against allocated {peak['allocated']} bytes per "
                          f"stream at the second step's peak: {ratio:.2f}x (seed {rec.seed})")
    assert report["reserved"].get(reload, 0) == 0, f"restored tensors grew the reload stream's pool: {report}"
    assert report["reserved"][compute] > 0


@pytest.mark.parametrize("seed", SEEDS)
def test_a_restored_tensor_nobody_consumed_is_written_only_before_its_block_is_reused(tmp_path, seed):
    """The first micro-batch's reads are started, then its graph is dropped: its restored
    tensors are released unconsumed and their blocks go back to the compute stream's pool at
    once, while their copies may still be queued on the reload stream. The second micro-batch's
    activations take those blocks; the GPU happens to run the reload stream before the copies
    of those activations to host memory. The compute stream must have waited for the
    abandoned copies before it let the blocks go (``DeviceCopy.unused``), or they land on the
    new activations and the second micro-batch's gradients change. Broken variant:
    ``DeviceCopy.unused`` a no-op: this scene passes (it did on a975649 too: the second
    micro-batch's activations take other free blocks first); the deferred-compute scene
    tests/test_gpu_ordering.py::test_a_restore_nobody_consumed_lands_before_its_block_is_reused
    fails it."""
    rec = Recorder(seed=seed, poison=True, pace=0.0, deferred_compute=True)  # streams run only when waited for
    cfg = OffloadConfig(dirs=[str(tmp_path)], engine="memory", min_tensor_bytes=0, keep_last_layers=0,
                        prefetch_layers=LAYERS, host_memory_bytes=64 << 20, max_inflight_bytes=64 << 20,
                        pinned_staging_bytes=4 << 20)
    with ActivationOffloader(cfg, device=torch.device("cpu"), streams=rec) as off:
        reload = off.copy.reload_stream
        grad = torch.zeros(SHAPE)
        for mb in range(2):
            h = Sink.apply(_input(mb), grad, rec)
            with off.microbatch(mb):
                for i in range(LAYERS):
                    with off.layer(i):
                        h = Tanh.apply(h, rec)
                    rec.run(reload)  # whatever the reload stream still holds runs first
                    rec.run_all()
                    off.poll()
            off.wait_writes()
            if mb == 0:
                off.begin_backward(0)  # every layer's read starts: copies queued on the reload stream
                assert reload.done < reload.issued, "the reloads ran before the graph was dropped"
                del h
                off.poll()  # the handles dropped: the records, and their restored tensors, go
                continue
            torch.autograd.backward(h, torch.ones(SHAPE))
            del h
        off.end_step()
        rec.run_all()
    assert torch.equal(grad.view(torch.int32), _reference(1).view(torch.int32)), (
        f"the second micro-batch's gradients changed: an abandoned reload landed on its activations (seed {rec.seed})")
