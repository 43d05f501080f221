"""Pinned memory of the size asked (issue 24, 1.4).

torch's caching host allocator rounds each pinned allocation up to a power of two (a 40 GB
memory tier would pin 64 GiB). The pools allocated once (memory engine, staging pool, aio
bounce buffers) are anonymous mappings registered with ``cudaHostRegister`` instead
(io/pinned.py). On this CPU machine the CUDA runtime (``torch.cuda.cudart()``) is a stand-in
that records the registrations; the mappings, engines and copies are real. Only a GPU run
(the ``cuda`` test) shows that torch treats the memory as pinned and copies it by DMA.
"""

from __future__ import annotations

import gc

import pytest
import torch

from ssdtrain_megatron import OffloadConfig
from ssdtrain_megatron.io import memory as memory_mod
from ssdtrain_megatron.io import pinned as pinned_mod
from ssdtrain_megatron.io.pinned import PAGE, pin_exact, pinned_size

CUDA = torch.cuda.is_available()
MiB = 1 << 20


class Runtime:
    """A stand-in for ``torch.cuda.cudart()``: records registrations; ``fail`` makes
    ``cudaHostRegister`` return that error."""

    def __init__(self, fail: int = 0) -> None:
        self.fail = fail
        self.registered = {}
        self.unregistered = []
        self.last_error = 0  # the calling thread's last CUDA error, as the runtime keeps it

    def cudaHostRegister(self, addr, size, flags):  # noqa: N802 - the C name
        if self.fail:
            self.last_error = self.fail
            return self.fail
        self.registered[addr] = (size, flags)
        return 0

    def cudaGetLastError(self):  # noqa: N802
        err, self.last_error = self.last_error, 0
        return err

    def cudaHostUnregister(self, addr):  # noqa: N802
        self.unregistered.append(addr)
        return 0

    def cudaGetErrorString(self, err):  # noqa: N802
        return "out of memory" if err == 2 else f"error {err}"


def test_a_pool_pins_its_size_rounded_to_a_page_not_to_a_power_of_two():
    rt = Runtime()
    n = 40 * MiB + 5
    t = pin_exact(n, runtime=rt)
    assert t.numel() == n and t.dtype == torch.uint8
    ((addr, (size, flags)),) = rt.registered.items()
    assert addr == t.data_ptr() and addr % PAGE == 0
    assert size == pinned_size(n) == 40 * MiB + PAGE and flags == 0
    t[-1] = 7  # the memory is real
    view = t[10:20]
    del t
    gc.collect()
    assert rt.unregistered == [], "unregistered while a view still uses the memory"
    del view
    gc.collect()
    assert rt.unregistered == [addr]


def test_a_refused_registration_is_a_clear_error():
    rt = Runtime(fail=2)
    with pytest.raises(RuntimeError, match=r"cudaHostRegister of 8192 bytes .*out of memory.*ulimit -l"):
        pin_exact(5000, runtime=rt)
    assert rt.last_error == 0, "the refused call's error was left for the next launch check"


def _host_alloc_stand_in(calls):
    """torch's pinned allocator, as the fallback sees it (pin_memory=True needs CUDA here)."""
    def alloc(n):
        calls.append(n)
        return torch.empty(n, dtype=torch.uint8)
    return alloc


def test_a_refused_registration_falls_back_to_torchs_pinned_allocator_with_one_warning(caplog):
    """cudaHostRegister refused (a container, ``ulimit -l``): ``pin`` clears CUDA's last error,
    takes the memory from torch's pinned allocator (page-aligned, the size asked) and says so
    once, naming the limit, however many pools are pinned; it reports what that really locks
    (the next power of two), which a RAM check must count. Before, the run stopped with
    StagingUnavailable and the error stayed set."""
    pinned_mod._say_refused_once.cache_clear()
    rt, calls = Runtime(fail=2), []
    with caplog.at_level("WARNING", logger="ssdtrain_megatron.io.pinned"):
        t, locked = pinned_mod.pin(5000, runtime=rt, fallback=_host_alloc_stand_in(calls))
        t2, locked2 = pinned_mod.pin(3 * MiB, runtime=rt, fallback=_host_alloc_stand_in(calls))
    assert rt.last_error == 0
    assert t.numel() == 5000 and t.data_ptr() % PAGE == 0 and t2.numel() == 3 * MiB
    assert locked == pinned_mod.host_alloc_size(5000 + PAGE) == 16384
    assert locked2 == 4 * MiB == pinned_mod.pinned_cost(3 * MiB, registers=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert "ulimit -l" in warnings[0] and "memlock" in warnings[0] and "out of memory" in warnings[0]
    assert pinned_mod.pinned_cost(3 * MiB) == 3 * MiB  # where registration works: exact


def test_with_registration_refused_the_memory_engine_and_staging_pool_still_start(tmp_path, monkeypatch):
    from ssdtrain_megatron.cache.device_copy import StagingPool
    from ssdtrain_megatron.cache.stream_ops import CudaStreams

    pinned_mod._say_refused_once.cache_clear()
    rt, calls = Runtime(fail=2), []
    monkeypatch.setattr(memory_mod, "_cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    monkeypatch.setattr(pinned_mod, "torch_pinned", _host_alloc_stand_in(calls))
    cap = 3 * MiB + 512
    engine = memory_mod.MemoryEngine(OffloadConfig(dirs=[str(tmp_path)], engine="memory", host_memory_bytes=cap))
    try:
        assert engine.pinned_bytes == 4 * MiB and rt.registered == {}
        _round_trip(engine)
    finally:
        engine.close()

    class Ops(CudaStreams):
        def pinned_empty(self, nbytes):
            return _host_alloc_stand_in(calls)(nbytes)

    pool = StagingPool(6 * MiB + 100, Ops())
    assert pool.capacity == 6 * MiB + 100 and pool.take(MiB).offset == 0
    assert rt.last_error == 0


def _round_trip(engine) -> None:
    data = torch.arange(100_000, dtype=torch.int32).view(torch.uint8)
    engine.write(0, data).result(30)
    out = torch.empty_like(data)
    engine.read(0, out).result(30)
    assert torch.equal(out, data)


def test_the_memory_engine_pins_its_pool_exactly_and_says_how_much(tmp_path, monkeypatch):
    rt = Runtime()
    monkeypatch.setattr(memory_mod, "_cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    cap = 3 * MiB + 512
    engine = memory_mod.MemoryEngine(OffloadConfig(dirs=[str(tmp_path)], engine="memory", host_memory_bytes=cap))
    try:
        assert [s for s, _ in rt.registered.values()] == [pinned_size(cap)]
        assert engine.pinned_bytes == pinned_size(cap) < 4 * MiB
        _round_trip(engine)
    finally:
        engine.close()
    gc.collect()
    assert rt.unregistered == list(rt.registered)


def test_the_staging_pool_is_pinned_exactly(monkeypatch):
    from ssdtrain_megatron.cache.device_copy import StagingPool
    from ssdtrain_megatron.cache.stream_ops import CudaStreams

    rt = Runtime()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    pool = StagingPool(6 * MiB + 100, CudaStreams())
    assert [s for s, _ in rt.registered.values()] == [pinned_size(6 * MiB + 100)]
    assert pool.capacity == 6 * MiB + 100


def test_aio_bounce_buffers_are_pinned_exactly(monkeypatch):
    from ssdtrain_megatron.io.slab_engine import aligned_buffer

    rt = Runtime()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    b = aligned_buffer(MiB + PAGE, pin=True)
    assert b.numel() == MiB + PAGE and b.data_ptr() % PAGE == 0
    assert [s for s, _ in rt.registered.values()] == [MiB + PAGE]


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_exactly_pinned_memory_is_pinned_and_copies_asynchronously():
    dev = torch.device("cuda", torch.cuda.current_device())
    n = 40 * MiB + 5
    stats = getattr(torch.cuda, "host_memory_stats", None)
    before = stats().get("reserved_bytes.current", 0) if stats else 0
    host = pin_exact(n)
    assert host.is_pinned()
    if stats:  # nothing came from the caching host allocator
        assert stats().get("reserved_bytes.current", 0) == before
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev)
    host.copy_(src, non_blocking=True)
    back = torch.empty_like(src)
    back.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, src)
