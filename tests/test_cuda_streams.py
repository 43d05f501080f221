"""Copies that really overlap (issue 24, 1.3): our own streams, sleeping waits, the rank's device.

- The offload and reload streams are created for us alone (``cudaStreamCreateWithPriority``,
  non-blocking, wrapped in ``torch.cuda.ExternalStream``), never drawn from torch's stream
  pool that NCCL's process groups draw from (cache/stream_ops.py).
- Events are created with blocking sync, so an IO thread waiting for a copy sleeps.
- An IO thread makes the event's device current before its first CUDA call (io/gpu_wait.py),
  so no rank creates a context on GPU 0.

On this CPU machine the CUDA runtime, ``torch.cuda.Event``/``Stream``/``ExternalStream`` and
``torch.cuda.set_device`` are stand-ins that record how they were called; the IO engines,
their threads and files are real (gds: kvikio is the tests' fake, tests/fake_kvikio.py). What
only a GPU run shows: that the runtime found is torch's own, that the stream handles differ
from the pool's (the ``cuda`` test below), and that a blocking-sync wait frees its core.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import List, Tuple

import pytest
import torch

from ssdtrain_megatron import OffloadConfig
from ssdtrain_megatron.cache import stream_ops
from ssdtrain_megatron.cache.stream_ops import CudaStreams, dedicated_stream, loaded_library
from ssdtrain_megatron.io import make_engine
from tests import fake_kvikio

CUDA = torch.cuda.is_available()


# -- IO threads: the event's device first, then the wait ---------------------------------------

class DeviceEvent:
    """A recorded CUDA event of device cuda:3, as the IO threads see one: ``device`` and a
    ``synchronize()`` (logged with the calling thread)."""

    def __init__(self, calls: List[Tuple[str, object, str]]) -> None:
        self.device = torch.device("cuda", 3)
        self.calls = calls

    def synchronize(self) -> None:
        self.calls.append(("synchronize", None, threading.current_thread().name))


def _engine(name: str, tmp_path, monkeypatch):
    config = OffloadConfig(dirs=[str(tmp_path)], engine="posix" if name == "gds" else name,
                           chunk_bytes=64 * 1024, host_memory_bytes=1 << 20, io_threads=2)
    if name == "gds":
        fake_kvikio.install(monkeypatch)
        from ssdtrain_megatron.io.gds import GdsEngine

        return GdsEngine(config)
    return make_engine(config)


@pytest.mark.parametrize("name", ["posix", "memory", "tiered", "gds"])
def test_io_threads_make_the_events_device_current_before_they_wait(tmp_path, monkeypatch, name):
    calls: List[Tuple[str, object, str]] = []
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: calls.append(("set_device", torch.device(d), threading.current_thread().name)))
    engine = _engine(name, tmp_path, monkeypatch)
    try:
        data = torch.arange(40_000, dtype=torch.int32).view(torch.uint8)
        engine.write(0, data, DeviceEvent(calls)).result(30)
        out = torch.empty_like(data)
        engine.read(0, out, DeviceEvent(calls)).result(30)
        assert torch.equal(out, data)
    finally:
        engine.close()
    waits = [i for i, c in enumerate(calls) if c[0] == "synchronize"]
    assert waits, "the engine never waited for the event"
    for i in waits:
        thread = calls[i][2]
        assert thread != threading.main_thread().name, "the wait ran on the training thread"
        before = [c for c in calls[:i] if c[0] == "set_device" and c[2] == thread]
        assert before and before[-1][1] == torch.device("cuda", 3), (
            f"thread {thread} waited for a cuda:3 event without making cuda:3 current first: {calls}")


# -- events and streams ------------------------------------------------------------------------

def test_copy_events_are_created_with_blocking_sync(monkeypatch):
    made = []
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: made.append(kw) or object())
    CudaStreams().new_event()
    assert made == [{"blocking": True}]


class Runtime:
    """A stand-in for libcudart: ``cudaStreamCreateWithPriority`` writes a handle (or fails)."""

    def __init__(self, err: int = 0) -> None:
        self.err = err
        self.calls = []

    def cudaStreamCreateWithPriority(self, pstream, flags, priority):  # noqa: N802 - the C name
        self.calls.append((flags, priority))
        if self.err == 0:
            pstream._obj.value = 0xC0FFEE
        return self.err


class FakeStream:
    made: List[dict] = []

    def __init__(self, *args, **kwargs) -> None:
        FakeStream.made.append({"args": args, **kwargs})

    @staticmethod
    def priority_range():
        return 0, -5


def _stand_ins(monkeypatch):
    external = []
    FakeStream.made = []
    monkeypatch.setattr(torch.cuda, "device", lambda d: _Null())
    monkeypatch.setattr(torch.cuda, "ExternalStream",
                        lambda handle, device=None: external.append((handle, device)) or ("external", handle))
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    return external


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_streams_are_our_own_non_blocking_streams_not_the_pools(monkeypatch):
    external = _stand_ins(monkeypatch)
    rt = Runtime()
    dev = torch.device("cuda", 1)
    s = dedicated_stream(dev, runtime=rt)
    assert rt.calls == [(1, 0)], "expected cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, 0)"
    assert s == ("external", 0xC0FFEE) and external == [(0xC0FFEE, dev)]
    assert FakeStream.made == [], "a stream was drawn from torch's pool"


def test_without_the_runtime_the_stream_comes_from_the_high_priority_pool_with_a_warning(monkeypatch, caplog):
    _stand_ins(monkeypatch)
    caplog.set_level(logging.WARNING, logger="ssdtrain_megatron.cache.stream_ops")
    dedicated_stream(torch.device("cuda", 0), runtime=Runtime(err=2))
    assert FakeStream.made and FakeStream.made[-1]["priority"] == -5
    assert "cudaStreamCreateWithPriority returned error 2" in caplog.text
    monkeypatch.setattr(stream_ops, "cuda_runtime", lambda: None)
    dedicated_stream(torch.device("cuda", 0))
    assert len(FakeStream.made) == 2 and "not among this process's shared libraries" in caplog.text


def test_the_cuda_runtime_is_found_among_the_mapped_libraries(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
        "7f02-7f03 rw-p 00000000 00:00 0 \n"
        "7f04-7f05 r-xp 00000000 08:01 2 /venv/nvidia/cuda_runtime/lib/libcudart.so.13\n")
    assert loaded_library("libcudart.so", str(maps)) == "/venv/nvidia/cuda_runtime/lib/libcudart.so.13"
    assert loaded_library("libcufile.so", str(maps)) is None
    assert loaded_library("libcudart.so", str(tmp_path / "missing")) is None


def test_byref_handles_are_what_the_stand_in_writes_through():
    """The stand-in writes through ``byref(handle)._obj`` as the C function writes through the
    pointer: check that the attribute is the handle itself (ctypes keeps it)."""
    h = ctypes.c_void_p()
    ctypes.byref(h)._obj.value = 7
    assert h.value == 7


# -- on a GPU ----------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_offload_and_reload_streams_are_not_in_torchs_stream_pool():
    """torch's pool holds 32 low- and 32 high-priority streams per device, handed out round
    robin: drawing 128 covers both twice. Ours must be none of them."""
    from ssdtrain_megatron.cache.device_copy import DeviceCopy

    dev = torch.device("cuda", torch.cuda.current_device())
    copy = DeviceCopy(dev, 1 << 20)
    pool = {torch.cuda.Stream(dev, priority=p).cuda_stream for p in (0, -1) for _ in range(64)}
    ours = {copy.offload_stream.cuda_stream, copy.reload_stream.cuda_stream}
    assert len(ours) == 2 and not ours & pool
    x = torch.randn(1 << 20, device=dev)
    host = torch.empty(x.shape, pin_memory=True)
    ev = copy.ops.new_event()
    with copy.ops.use(copy.offload_stream):
        copy.offload_stream.wait_stream(torch.cuda.current_stream(dev))
        host.copy_(x, non_blocking=True)
        ev.record(copy.offload_stream)
    ev.synchronize()
    assert torch.equal(host.view(torch.int32), x.cpu().view(torch.int32))
