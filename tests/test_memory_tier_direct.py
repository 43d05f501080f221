"""The memory tier copies once (issue 24, 1.5): device -> pinned pool, pool -> device.

Before, an offload to the 'memory' engine (and the memory tier of 'tiered') was two copies:
device -> pinned staging (offload stream), then staging -> pool (an IO thread's memcpy), and
the same twice back. Now the engine hands out the pool extent (``pool_view``) and the offload
stream copies into it directly; a read copies out of it on the reload stream. The extent is
reused only after the event of the last copy into or out of it completed (``fence``).

CPU machine: the streams are the recording stand-in (tests/recording_streams.py), every one
deferred, the compute stream too (``deferred_compute``: the model's kernels go through their
stream, ``Recorder.launch``), with the caching-allocator model and poison on; the two ordering scenes over
tests/gpu_scenes.py ``SEEDS`` (printed); the engines,
pool memory, offloader and autograd are real. Only a GPU run shows the bandwidth.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from ssdtrain_megatron import ActivationOffloader, OffloadConfig
from ssdtrain_megatron.io import make_engine
from tests.gpu_scenes import SEEDS, Sink
from tests.recording_streams import Recorder, _range, overlaps
from tests.test_staging_race import Logged, check_staging_reuse

ROWS, COLS, LAYERS = 64, 256, 3
NBYTES = ROWS * COLS * 4


def _like(rec: Recorder, x: torch.Tensor) -> torch.Tensor:
    return rec.empty(x.numel(), x.dtype, x.device).view(x.shape)


def _forward_kernel(y, out, x) -> None:
    torch.tanh(x, out=y)
    out.copy_(y)


def _backward_kernel(s, gx, g) -> None:
    torch.mul(g, 1 - s * s, out=gx)


class Saves(torch.autograd.Function):
    """y = tanh(x), saved for backward. Both kernels go through the stream
    (``Recorder.launch``): on the deferred stand-in the torch code runs when the stream runs
    it, so the host never reads a tensor before its stream ran."""

    @staticmethod
    def forward(ctx, x, rec):
        y, out = _like(rec, x), _like(rec, x)
        rec.launch("produce", _forward_kernel, y, out, x)
        ctx.save_for_backward(y)
        ctx.rec = rec
        return out

    @staticmethod
    def backward(ctx, g):
        (s,) = ctx.saved_tensors
        gx = _like(ctx.rec, g)
        ctx.rec.launch("consume", _backward_kernel, s, gx, g)
        return gx, None


def forward(off, rec: Recorder, mb: int, out: torch.Tensor, device=torch.device("cpu")) -> torch.Tensor:
    """Micro-batch ``mb``'s forward (under the offloader when given): its output. The input's
    gradient lands in ``out`` through the stream (tests/gpu_scenes.py ``Sink``)."""
    x = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(mb)).to(device).requires_grad_()
    h = Sink.apply(x, out, rec)
    with off.microbatch(mb) if off is not None else contextlib.nullcontext():
        for i in range(LAYERS):
            with off.layer(i) if off is not None else contextlib.nullcontext():
                h = Saves.apply(h, rec)
    return h


def backward(h: torch.Tensor) -> None:
    """Backward from ``h`` with a gradient of ones (no host op reads ``h``)."""
    torch.autograd.backward(h, torch.ones_like(h))


def _run(off, rec, abandon_first: bool = False, device=torch.device("cpu")):
    """Two micro-batches. ``abandon_first``: the first one's tensors are read back (its
    backward is announced) but its graph is dropped before backward used them: nothing on the
    compute stream waits for those reads, only the fence orders the extents' reuse."""
    grads = []
    for mb in range(2):
        out = torch.zeros(ROWS, COLS, device=device)
        h = forward(off, rec, mb, out, device)
        off.wait_writes()
        if abandon_first and mb == 0:
            off.begin_backward(0)  # reads start (prefetch_layers covers every layer)
            off.transfers.wait_all()
            del h
            off.poll()  # the handles dropped: the records (and their extents) are released
            continue
        backward(h)
        del h
        grads.append(out)
    return grads, off.end_step()


def _reference(abandon_first: bool = False, device=torch.device("cpu")):
    if device.type == "cuda":  # the model's memory on the device: real streams (logged)
        from ssdtrain_megatron.cache.stream_ops import CudaStreams

        rec = Recorder(inner=CudaStreams())
    else:
        rec = Recorder()  # eager streams: kernels run when issued
    grads = []
    for mb in range(1 if abandon_first else 0, 2):
        out = torch.zeros(ROWS, COLS, device=device)
        backward(forward(None, rec, mb, out, device))
        rec.run_all()
        grads.append(out)
    return grads


def _offload(tmp_path, engine: str, host_bytes: int, abandon_first: bool = False, cuda: bool = False,
             unobserved_reloads: bool = False, seed=None):
    config = OffloadConfig(dirs=[str(tmp_path)], engine=engine, min_tensor_bytes=0, keep_last_layers=0,
                           prefetch_layers=LAYERS, chunk_bytes=64 * 1024, max_inflight_bytes=1 << 20,
                           pinned_staging_bytes=1 << 20, host_memory_bytes=host_bytes)
    if cuda:  # real streams, 2 ms of sleep before every producer and copy
        from ssdtrain_megatron.cache.stream_ops import CudaStreams

        rec, device = Recorder(inner=CudaStreams(), delay_s=0.002), torch.device("cuda", torch.cuda.current_device())
    else:  # every stream deferred, the compute stream too, poison on
        rec, device = Recorder(seed=seed, poison=True, deferred_compute=True), torch.device("cpu")
    engine_ = Logged(make_engine(config), rec)
    with ActivationOffloader(config, device=device, engine=engine_, streams=rec) as off:
        if unobserved_reloads:  # the host never sees a copy out of the pool finish
            rec.unobserved.add(off.copy.reload_stream.name)
        memory = engine_.inner if engine == "memory" else engine_.inner.memory
        pool, staging = _range(memory._pool), _range(off.copy.pool._mem)
        grads, stats = _run(off, rec, abandon_first, device)
        if cuda:
            torch.cuda.synchronize()
        rec.run_all()
        check_staging_reuse(rec, memory._pool)
        check_staging_reuse(rec, off.copy.pool._mem)
    ref = _reference(abandon_first, device)
    if cuda:
        torch.cuda.synchronize()
    for a, b in zip(grads, ref, strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"gradients differ (seed {rec.seed})"
    return rec, stats, pool, staging


def _copies(rec, side: str, where):
    return [n for n in rec.nodes("copy") if overlaps(n.tags[side], where)]


@pytest.mark.parametrize("seed", SEEDS)
def test_the_memory_engine_is_written_and_read_with_one_copy_each_way(tmp_path, seed):
    """Its pool holds one micro-batch's tensors: the second micro-batch reuses the first's
    extents, which the reuse check orders after the first's copies out of them."""
    rec, stats, pool, staging = _offload(tmp_path, "memory", LAYERS * NBYTES, seed=seed)
    n = stats.tensors_offloaded
    assert n == 2 * LAYERS and stats.bytes_read == n * NBYTES and stats.fallbacks == 0
    assert len(_copies(rec, "dst", pool)) == n, "each tensor: one device->pool copy"
    assert len(_copies(rec, "src", pool)) == n, "each read: one pool->device copy"
    assert _copies(rec, "dst", staging) == [] and _copies(rec, "src", staging) == [], "staging was used"
    for w in rec.nodes("engine_write"):  # the engine got its own memory: nothing left to copy
        lo, hi = w.tags["ptr"]
        assert pool[0] <= lo and hi <= pool[1]
    reused = {c.tags["dst"] for c in _copies(rec, "dst", pool)}
    assert len(reused) == LAYERS, "the second micro-batch did not reuse the first one's extents"
    _check_copies_out_follow_copies_in(rec, pool)


def _check_copies_out_follow_copies_in(rec, pool) -> None:
    last_in = {}
    for n in rec.log:
        if n.kind != "copy":
            continue
        if overlaps(n.tags["src"], pool):
            into = last_in.get(n.tags["src"])
            assert into is not None and rec.happens_before(into, n), f"{n} reads the pool before {into}"
        if overlaps(n.tags["dst"], pool):
            last_in[n.tags["dst"]] = n


@pytest.mark.parametrize("seed", SEEDS)
def test_an_extent_read_back_but_never_used_is_reused_only_after_its_copy_out(tmp_path, seed):
    """The first micro-batch's reads are abandoned (nothing on the compute stream waits for
    them): the second micro-batch's copies into the same extents are still ordered after the
    copies out, by the fence the engine checks (``query``) before it hands an extent out."""
    rec, stats, pool, _ = _offload(tmp_path, "memory", LAYERS * NBYTES, abandon_first=True, seed=seed)
    assert len({c.tags["dst"] for c in _copies(rec, "dst", pool)}) == LAYERS  # reused
    assert len(_copies(rec, "src", pool)) == 2 * LAYERS  # the abandoned reads did copy out


def test_without_the_fence_the_abandoned_extents_reuse_is_unordered(tmp_path, monkeypatch):
    """The control: with ``fence`` a no-op, on a GPU whose copies out the host does not see
    finish before it reuses the extents (queries answer not yet), the test above fails
    ('staging reuse: ... is not ordered before ...'). ``DeviceCopy.unused`` is a no-op too:
    it makes the compute stream wait for each abandoned read's copy (issue 54, fault A: the
    restored tensor's block goes back to that stream's pool), and the next writes into the
    extents, ordered after the compute stream by their producer event, would then follow the
    copies out through it."""
    from ssdtrain_megatron.cache.device_copy import DeviceCopy
    from ssdtrain_megatron.io.memory import MemoryEngine

    monkeypatch.setattr(MemoryEngine, "fence", lambda self, key, event: None)
    monkeypatch.setattr(DeviceCopy, "unused", lambda self, xfer: None)
    with pytest.raises(AssertionError, match="staging reuse"):
        _offload(tmp_path, "memory", LAYERS * NBYTES, abandon_first=True, unobserved_reloads=True)


def test_the_tiered_memory_tier_is_direct_and_the_ssd_tier_staged(tmp_path):
    rec, stats, pool, staging = _offload(tmp_path, "tiered", 2 * NBYTES)
    n = stats.tensors_offloaded
    direct, staged = _copies(rec, "dst", pool), _copies(rec, "dst", staging)
    assert n == 2 * LAYERS and len(direct) + len(staged) == n
    assert len(direct) >= 2 and len(staged) >= 1
    assert len(_copies(rec, "src", pool)) == len(direct)


def test_a_failed_memory_tier_write_after_pool_view_frees_its_extent_on_release(tmp_path):
    """The memory tier's write raises after ``pool_view`` reserved an extent (here: bytes that
    are not the view's; any engine error there does the same). The offloader keeps the tensor
    and later releases the key: the extent must be freed. Before the fix the tiered engine
    had already dropped the reservation, so release found no tier for the key:
    ``after end_step: extents {0: (0, 65536)}``."""
    from ssdtrain_megatron.io.base import EngineError

    engine = make_engine(OffloadConfig(dirs=[str(tmp_path)], engine="tiered", host_memory_bytes=4 * NBYTES))
    try:
        view = engine.pool_view(0, NBYTES)
        assert view is not None
        with pytest.raises(EngineError, match="other memory than its pool_view"):
            engine.write(0, torch.zeros(NBYTES, dtype=torch.uint8))
        engine.release(0)
        engine.end_step()
        assert engine.memory._extents == {}, f"after end_step: extents {engine.memory._extents}"
        assert engine.bytes_on_disk == 0
        view = engine.pool_view(1, 4 * NBYTES)  # the whole pool is free again
        assert view is not None and view.data_ptr() == engine.memory._pool.data_ptr()
    finally:
        engine.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("abandon_first", [False, True])
def test_cuda_the_memory_engine_copies_device_to_pool_directly_and_bitwise(tmp_path, abandon_first):
    rec, stats, pool, staging = _offload(tmp_path, "memory", LAYERS * NBYTES, abandon_first, cuda=True)
    assert len(_copies(rec, "dst", pool)) == stats.tensors_offloaded > 0
    assert _copies(rec, "dst", staging) == []
