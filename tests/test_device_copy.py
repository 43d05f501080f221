"""The GPU data path (cache/device_copy.py): the happens-before chain of every offloaded tensor.

On this CPU-only machine the streams, events and copies are a recording stand-in
(tests/recording_streams.py): it checks OUR ordering logic (which event is recorded where,
which stream waits on what, which thread synchronises on what) against the rules of the CUDA
programming model, not CUDA itself. The engines, files, offloader and autograd are real. The
tests marked ``cuda`` run the same checks with the recorder wrapped around real torch.cuda
streams and events (copies really asynchronous, with ``torch.cuda._sleep`` in front of every
producer and copy so that a missing wait also shows up as wrong bytes). The engine wrapper that
logs submissions forwards everything the offloader reads or sets (tests/forwarding.py), and
every run asserts that the production completion-queue path ran, not the Future relay.

For each tensor the offloader hands to the engine, the chain asserted is:
  write: producer kernel -> compaction (compact views) -> device->host copy -> every disk
         write of its key (gds: producer -> compaction -> disk write, no copy);
  read:  what ran on the allocating stream before the read started -> host->device copy
         (gds: -> cuFile read) and disk read -> host->device copy -> scatter (compact)
         -> the consumer kernel in backward.
"""

from __future__ import annotations

import contextlib

import threading
import types
from concurrent.futures import Future
from typing import List, Optional

import pytest
import torch

from ssdtrain_megatron import ActivationOffloader, OffloadConfig
from ssdtrain_megatron.cache.device_copy import DeviceCopy
from ssdtrain_megatron.io import IOEngine, make_engine
from tests import fake_kvikio
from tests.faulty import FaultyEngine, HeldWrites
from tests.forwarding import ForwardingEngine
from tests.gpu_scenes import SEEDS, Sink
from tests.chain_checks import check_read_chains, check_write_chains
from tests.recording_streams import Recorder, _range
from tests.staging_checks import check_staging_reuse

CUDA = torch.cuda.is_available()
ENGINES = ["posix", "memory", "tiered", "gds"]


# -- an engine wrapper that logs what the offloader hands over ------------------------------

class LoggedEngine(ForwardingEngine):
    """Delegates to a real engine (tests/forwarding.py: every attribute the offloader reads or
    sets, ``completions`` above all, reaches it); logs each write/read submission (key, the
    bytes handed over, the event), each pool extent handed out, each commit of a copy into one
    and each read the offloader copies out of one itself, what the engine returned, each
    ``cancel`` and its answer, and each chunk that reached or left the file (the engine's
    tracer)."""

    _own = ("rec", "returned", "cancels")

    def __init__(self, inner: IOEngine, rec: Recorder) -> None:
        super().__init__(inner)
        self.rec = rec
        self.returned: List[object] = []  # what inner.write/read returned: None on the queue path
        self.cancels: List[tuple] = []  # (key, the real engine's answer)
        inner.tracer = rec.tracer
        if hasattr(inner, "memory"):  # tiered: both tiers trace
            inner.memory.tracer = inner.ssd.tracer = rec.tracer

    def __setattr__(self, name, value):
        # The offloader's completion queue reaches the engine through the recorder, which
        # orders each report before what the offloader does once it took it (recording_streams.py).
        super().__setattr__(name, self.rec.completions(value) if name == "completions" else value)

    def write(self, key: int, data: torch.Tensor, ready_event=None) -> Future:
        self.rec.host("submit_write", key=key, ptr=_range(data), event=getattr(ready_event, "name", None))
        out = self.inner.write(key, data, ready_event)
        self.returned.append(out)
        return out

    def read(self, key: int, out: torch.Tensor, ready_event=None) -> Future:
        self.rec.host("submit_read", key=key, ptr=_range(out), event=getattr(ready_event, "name", None))
        fut = self.inner.read(key, out, ready_event)
        self.returned.append(fut)
        return fut

    def pool_view(self, key: int, nbytes: int):
        view = self.inner.pool_view(key, nbytes)
        if view is not None:
            self.rec.host("pool_view", key=key, ptr=_range(view))
        return view

    def commit(self, key: int) -> None:
        self.rec.host("commit", key=key)
        self.inner.commit(key)
        self.returned.append(None)

    def pool_read(self, key: int, started: bool) -> None:
        if started:
            self.rec.host("submit_pool_read", key=key, ptr=_range(self.inner.pool_view_of(key)))
        self.inner.pool_read(key, started)

    def cancel(self, key: int) -> bool:
        taken = self.inner.cancel(key)
        self.cancels.append((key, taken))
        return taken


def check_completion_queue_path(off: ActivationOffloader, logged: LoggedEngine) -> None:
    """The offloader's production path ran: the real engine reported to the offloader's queue
    and returned no Future (a wrapper that kept ``completions`` to itself runs the fallback
    relay in cache/transfers.py instead, and these tests would prove nothing about it)."""
    assert logged.inner.completions is not None, "the offloader's queue did not reach the real engine"
    assert logged.returned, "nothing was submitted"
    futures = [r for r in logged.returned if r is not None]
    assert not futures, f"{len(futures)} of {len(logged.returned)} submissions returned a Future: the relay path ran"


# -- the scene (its chains are checked by tests/chain_checks.py) ---------------------------

def _saves_forward(y, out, x, k, compact) -> None:
    torch.tanh(x, out=y)
    if compact:
        out.copy_(y[:, k:2 * k].repeat(1, 3))
    else:
        out.copy_(y)


def _saves_backward(s, gx, g, k, compact) -> None:
    if compact:
        gx.zero_()
        gx[:, k:2 * k] = (g[:, :k] + g[:, k:2 * k] + g[:, 2 * k:]) * (1 - s * s)
    else:
        torch.mul(g, 1 - s * s, out=gx)


def _like(rec: Recorder, x: torch.Tensor) -> torch.Tensor:
    return rec.empty(x.numel(), x.dtype, x.device).view(x.shape)


class Saves(torch.autograd.Function):
    """y = tanh(x); saves y (or, ``compact``, the middle third of its columns: a view that
    touches a third of its storage span) and uses it in backward. The producing and the
    consuming kernels go through the current stream (``Recorder.launch``, logged with the
    saved tensor's bytes): on the deferred stand-in their torch code runs when the stream
    runs it, so the host never reads a tensor before its stream ran."""

    @staticmethod
    def forward(ctx, x, compact, rec):
        rec._delay()
        k = x.shape[1] // 3
        y, out = _like(rec, x), _like(rec, x)
        rec.launch("produce", lambda y, out, x: _saves_forward(y, out, x, k, compact), y, out, x)
        ctx.compact, ctx.rec, ctx.k = compact, rec, k
        ctx.save_for_backward(y[:, k:2 * k] if compact else y)
        return out

    @staticmethod
    def backward(ctx, g):
        (s,) = ctx.saved_tensors
        gx = _like(ctx.rec, g)
        k, compact = ctx.k, ctx.compact
        ctx.rec.launch("consume", lambda s, gx, g: _saves_backward(s, gx, g, k, compact), s, gx, g)
        return gx, None, None


def _forward(off: Optional[ActivationOffloader], rec: Recorder, device, compact: bool, mb: int,
             out: torch.Tensor, n_layers: int = 4) -> torch.Tensor:
    """Micro-batch ``mb``'s forward (under the offloader when given): its output. The input's
    gradient lands in ``out`` through the stream (tests/gpu_scenes.py ``Sink``)."""
    x = torch.randn(64, 3 * 128, generator=torch.Generator().manual_seed(mb)).to(device).requires_grad_()
    h = Sink.apply(x, out, rec)
    with off.microbatch(mb) if off is not None else _null():
        for i in range(n_layers):
            with (off.layer(i) if off is not None else _null()):
                h = Saves.apply(h, compact, rec)
    return h


def _backward(h: torch.Tensor) -> None:
    """Backward from ``h`` with a gradient of ones (no host op reads ``h``)."""
    torch.autograd.backward(h, torch.ones_like(h))


def _run(off: Optional[ActivationOffloader], rec: Recorder, device, compact: bool, stream, n_layers=4, n_mb=2):
    grads = []
    ctx = rec.use(stream) if stream is not None else _null()
    with ctx:
        for mb in range(n_mb):
            out = torch.zeros(64, 3 * 128, device=device)
            h = _forward(off, rec, device, compact, mb, out, n_layers)
            if off is not None:
                off.wait_writes()  # every tensor goes to the engine and comes back by a read
            _backward(h)
            del h
            grads.append(out)
    stats = off.end_step() if off is not None else None
    rec.run_all()  # the gradients' kernels ran
    return grads, stats


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _config(d, engine: str, **kw) -> OffloadConfig:
    kw.setdefault("host_memory_bytes", 96 * 1024 if engine == "tiered" else 64 << 20)
    return OffloadConfig(dirs=[str(d)], engine="posix" if engine == "gds" else engine, min_tensor_bytes=0,
                         keep_last_layers=0, prefetch_layers=1, chunk_bytes=64 * 1024,
                         max_inflight_bytes=1 << 20, **kw)


def _engine(engine: str, config: OffloadConfig, monkeypatch):
    if engine == "gds":
        if not CUDA:
            fake_kvikio.install(monkeypatch)
        from ssdtrain_megatron.io.gds import GdsEngine

        return GdsEngine(config)
    return make_engine(config)


def _offloaded_run(tmp_path, monkeypatch, engine, compact, stream_name, rec, device, patch=None):
    config = _config(tmp_path, engine)
    logged = LoggedEngine(_engine(engine, config, monkeypatch), rec)
    stream = rec.new_stream(device, "compute") if stream_name == "compute" else None
    # Built (installed) with the compute stream current: the stream restores are allocated on.
    with rec.use(stream) if stream is not None else contextlib.nullcontext():
        off = ActivationOffloader(config, device=device, engine=logged, streams=rec)
    with off:
        if patch is not None:
            patch(off.copy)
        # The pinned memory whose reuse _check_all checks: the staging pool, the memory tier's.
        memory = getattr(logged.inner, "memory", logged.inner)
        rec.pools = [_range(p) for p in (off.copy.pool._mem if off.copy.pool is not None else None,
                                         getattr(memory, "_pool", None)) if p is not None]
        grads, stats = _run(off, rec, device, compact, stream)
        direct = off.copy.direct
        check_completion_queue_path(off, logged)
    if engine != "memory":  # the real engine's meters reach the step's numbers (memory measures none)
        assert stats.write_gbps > 0 and stats.read_gbps > 0
    if engine == "posix":  # page-aligned staging blocks: written and read in place, never bounced
        assert logged.inner.zero_copy_bytes >= 2 * stats.bytes_read > 0
        assert logged.inner.bounced_bytes == 0
    logged.close()
    return grads, stats, direct, ("compute" if stream is not None else "default")


def _check_all(rec, stats, direct, alloc_stream):
    n_w = check_write_chains(rec, direct, alloc_stream)
    n_r = check_read_chains(rec, direct, alloc_stream)
    for pool in rec.pools:
        check_staging_reuse(rec, pool)
    assert n_w == stats.tensors_offloaded > 0
    assert n_r == n_w, "every offloaded tensor came back by a read"
    assert stats.bytes_read > 0


def _bitwise(a, b):
    assert len(a) == len(b) > 0, f"{len(a)} gradients against {len(b)}"
    for x, y in zip(a, b):
        assert torch.equal(x.view(torch.int32), y.view(torch.int32))


def _eager(device) -> Recorder:
    """Streams that run each kernel when it is issued, for a reference run: the stand-in's
    eager ones on the CPU, the real streams (logged) on a GPU, where the model's memory must
    be device memory."""
    if device.type == "cuda":
        from ssdtrain_megatron.cache.device_copy import CudaStreams

        return Recorder(inner=CudaStreams())
    return Recorder()


def _recorder() -> Recorder:
    """The stand-in as strict as CUDA for the compute stream too: every stream deferred, the
    model's kernels launched through theirs, poison on (tests/recording_streams.py)."""
    return Recorder(poison=True, deferred_compute=True)


def _reference(device, compact):
    grads, _ = _run(None, _eager(device), device, compact, None)
    return grads


# -- the tests ------------------------------------------------------------------------------

@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("compact", [False, True], ids=["span", "compact"])
@pytest.mark.parametrize("stream_name", ["default", "compute"])
def test_every_offloaded_tensor_is_ordered_producer_to_disk_to_consumer(tmp_path, monkeypatch, engine,
                                                                        compact, stream_name):
    rec = _recorder()
    cpu = torch.device("cpu")
    grads, stats, direct, alloc = _offloaded_run(tmp_path, monkeypatch, engine, compact, stream_name, rec, cpu)
    assert direct == (engine == "gds")
    _check_all(rec, stats, direct, alloc)
    _bitwise(_reference(cpu, compact), grads)
    if not direct:  # the device bytes of every copy were let go once it ran, not marked for the offload stream
        assert len(rec.nodes("let_go")) >= stats.tensors_offloaded
        offload = {n.agent for n in rec.nodes("copy") if n.tags["dst"] in
                   [w.tags["ptr"] for w in rec.nodes("submit_write")]}
        assert not [n for n in rec.nodes("record_stream") if n.tags["stream"] in offload]


@pytest.mark.parametrize("seed", SEEDS[1:])
@pytest.mark.parametrize("engine", ["posix", "memory"])
def test_every_offloaded_tensor_is_ordered_over_more_seeds(tmp_path, monkeypatch, engine, seed):
    """The scene above (compute stream, spans and compact records in one run each) over the
    other seeds of tests/gpu_scenes.py: with the variants' own seed, five in all."""
    monkeypatch.setenv("SSDTRAIN_STANDIN_SEED", str(seed))
    for compact in (False, True):
        (tmp_path / str(compact)).mkdir()
        test_every_offloaded_tensor_is_ordered_producer_to_disk_to_consumer(
            tmp_path / str(compact), monkeypatch, engine, compact, "compute")


def test_the_wrapper_forwards_every_name_the_engine_interface_declares():
    """IOEngine's class defaults stop ``__getattr__``: a name it declares and the wrapper does
    not define itself reads the default and is set on the wrapper (the bug this guards against:
    ``completions`` kept by the wrapper, so the ordering tests above ran the relay path).
    Broken variant: delete ``completions = _forward(...)`` from tests/forwarding.py; this fails
    with "IOEngine names the wrapper does not forward: ['completions']", and so does
    check_completion_queue_path in every ordering test."""
    declared = {n for n in vars(IOEngine) if not n.startswith("_") and n != "is_available"}
    missing = sorted(n for n in declared if n not in vars(ForwardingEngine))
    assert not missing, f"IOEngine names the wrapper does not forward: {missing}"
    inner = make_engine(OffloadConfig(engine="memory", host_memory_bytes=1 << 20))
    try:
        wrapper = LoggedEngine(inner, Recorder())
        sink: List[tuple] = []
        wrapper.completions = sink
        assert inner.completions.queue is sink and "completions" not in vars(wrapper)
        assert wrapper.write_meter is inner.write_meter and wrapper.ident is inner.ident
    finally:
        inner.close()


def test_a_write_released_before_it_starts_is_cancelled_by_the_real_engine(tmp_path):
    """The offloader's cancel reaches the real engine through the wrapper and takes back the
    writes still queued behind a held one. Broken variant: LoggedEngine without the forwarding
    base (IOEngine.cancel, always False): "no write was taken back: cancels=[(1, False), ...]"."""
    rec = _recorder()
    cpu = torch.device("cpu")
    config = _config(tmp_path, "posix", io_threads=1)
    gate = HeldWrites()
    logged = LoggedEngine(FaultyEngine(make_engine(config), gate), rec)
    grad = torch.zeros(64, 3 * 128)
    with ActivationOffloader(config, device=cpu, engine=logged, streams=rec) as off:
        gate.held = True
        x = torch.randn(64, 3 * 128, generator=torch.Generator().manual_seed(0)).requires_grad_()
        h = Sink.apply(x, grad, rec)
        with off.microbatch(0):
            for i in range(4):
                with off.layer(i):
                    h = Saves.apply(h, False, rec)
                if i == 0:
                    assert gate.entered.wait(30), "the first write never reached the disk"
        _backward(h)  # every tensor from memory; each record released while its write waits
        del h
        off.poll()
        gate.go.set()
        stats = off.end_step()
        taken = [k for k, t in logged.cancels if t]
        assert taken, f"no write was taken back: cancels={logged.cancels}"
        check_completion_queue_path(off, logged)
    logged.close()
    assert stats.tensors_offloaded + len(taken) == 4 and stats.tensors_forwarded == 4
    assert stats.bytes_read == 0 and stats.bytes_on_disk == 0
    rec.run_all()
    _bitwise(_reference(cpu, False)[:1], [grad])


def test_the_checks_fail_when_the_offload_stream_does_not_wait_for_the_producer(tmp_path, monkeypatch):
    """The bug the producer event prevents: the copy (and a compact record's packing, on the
    offload stream) not ordered after the kernel that wrote the bytes."""
    rec = _recorder()

    def patch(copy: DeviceCopy) -> None:
        copy.offload_stream.wait_event = lambda ev: None

    _, stats, direct, alloc = _offloaded_run(tmp_path, monkeypatch, "posix", True, "compute", rec,
                                             torch.device("cpu"), patch)
    with pytest.raises(AssertionError, match="write"):
        check_write_chains(rec, direct)


def test_the_checks_fail_when_device_bytes_are_let_go_before_their_copy_ran(tmp_path, monkeypatch):
    """The bug the landing poll prevents: a write's device memory let go as soon as its copy
    was queued (the allocator could hand it out under the copy)."""
    rec = _recorder()

    def patch(copy: DeviceCopy) -> None:
        real = copy.stage_out

        def stage_out(r, *args, **kwargs):
            out = real(r, *args, **kwargs)
            copy.ops.let_go(out[2].source)  # dropped at once, before anyone saw the copy run
            return out
        copy.stage_out = stage_out

    _, stats, direct, alloc = _offloaded_run(tmp_path, monkeypatch, "posix", False, "compute", rec,
                                             torch.device("cpu"), patch)
    with pytest.raises(AssertionError, match="let go before their copy ran"):
        check_write_chains(rec, direct)


@pytest.mark.parametrize("missing", ["alloc", "order", "consumer"])
def test_the_checks_fail_without_the_reload_waits(tmp_path, monkeypatch, missing):
    """Each broken variant: the restored tensor allocated on the reload stream (issue 54's fault
    A: its memory from a pool backward's frees never reach), the reload copy not ordered after
    the allocation on the compute stream (it could write into a block a compute kernel still
    uses), or the consumer not waiting for the reload."""
    rec = _recorder()

    def patch(copy: DeviceCopy) -> None:
        if missing == "alloc":
            real_empty, real_use = copy.ops.empty, copy.ops.use

            def empty(numel, dtype, device):
                with real_use(copy.reload_stream):
                    return real_empty(numel, dtype, device)
            copy.ops.empty = empty
        elif missing == "order":
            copy.reload_stream.wait_event = lambda ev: None
        else:
            copy.consume = types.MethodType(lambda self, r, out: None, copy)

    _, stats, direct, alloc = _offloaded_run(tmp_path, monkeypatch, "posix", False, "compute", rec,
                                             torch.device("cpu"), patch)
    check_write_chains(rec, direct)
    match = {"alloc": "not allocated on the compute stream", "order": "before the compute stream reached",
             "consumer": "consumer"}[missing]
    with pytest.raises(AssertionError, match=match):
        check_read_chains(rec, direct, alloc)


def test_gds_checks_fail_when_cufile_does_not_wait_for_the_producer(tmp_path, monkeypatch):
    rec = _recorder()

    def patch(copy: DeviceCopy) -> None:
        real = copy.stage_out

        def stage_out(r):
            data, _event, xfer = real(r)
            return data, None, xfer  # the engine is not told what to wait for
        copy.stage_out = stage_out

    _, stats, direct, alloc = _offloaded_run(tmp_path, monkeypatch, "gds", False, "compute", rec,
                                             torch.device("cpu"), patch)
    assert direct
    with pytest.raises(AssertionError, match=r"write reaches the disk: .*produce@compute.* is not ordered before .*disk_write"):
        check_write_chains(rec, direct)


# -- the same, for real ---------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("compact", [False, True], ids=["span", "compact"])
@pytest.mark.parametrize("stream_name", ["default", "compute"])
def test_cuda_every_offloaded_tensor_is_ordered_and_bitwise(tmp_path, monkeypatch, engine, compact, stream_name):
    """Real torch.cuda streams and events under the recorder; 2 ms of sleep in front of every
    producer and copy, so that a missing wait also corrupts bytes."""
    if engine == "gds":
        from ssdtrain_megatron.io.gds import gds_unavailable_reason

        if gds_unavailable_reason():
            pytest.skip(gds_unavailable_reason())
    from ssdtrain_megatron.cache.device_copy import CudaStreams

    dev = torch.device("cuda", torch.cuda.current_device())
    rec = Recorder(inner=CudaStreams(), delay_s=0.002)
    grads, stats, direct, _ = _offloaded_run(tmp_path, monkeypatch, engine, compact, stream_name, rec, dev)
    torch.cuda.synchronize()
    alloc = "compute" if stream_name == "compute" else rec.current_stream(dev).name
    _check_all(rec, stats, direct, alloc)
    ref = _reference(dev, compact)
    torch.cuda.synchronize()
    _bitwise(ref, grads)


@pytest.mark.parametrize("engine", ENGINES)
def test_engines_wait_for_the_read_event_before_writing_into_the_destination(tmp_path, monkeypatch, engine):
    """The event a read is given stands for kernels that still use the destination's memory
    (it was just allocated on a stream they run on): in this stand-in its synchronize() is
    where they finish, scribbling over the memory. Bytes written before it would be lost."""
    config = _config(tmp_path, engine, host_memory_bytes=1 << 20)
    eng = _engine(engine, config, monkeypatch)
    try:
        data = torch.arange(300_000, dtype=torch.int32).view(torch.uint8)[:1_000_000].clone()
        eng.write(0, data).result(30)
        out = torch.empty_like(data)

        class StillInUse:  # like a CUDA event: the first wait sees the kernels finish
            calls = 0
            lock = threading.Lock()

            def synchronize(self):
                with StillInUse.lock:
                    StillInUse.calls += 1
                    if StillInUse.calls == 1:
                        out.fill_(7)

        eng.read(0, out, StillInUse()).result(30)
        assert StillInUse.calls >= 1
        assert torch.equal(out, data)
    finally:
        eng.close()
