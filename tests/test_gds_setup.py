"""GDS as cuFile wants it (issue 24, 1.6): kvikio's thread pool, compat mode, 4 KiB reads.

kvikio cannot run without libcuda, so on this CPU machine it is the tests' stand-in
(tests/fake_kvikio.py: compat-mode POSIX IO on host buffers, and ``kvikio.defaults``); the
engine, offloader, files and autograd are real, and the streams are the recording stand-in.
What only a GPU run shows: that cuFile really DMAs the aligned buffers without bouncing, and
kvikio's pool really runs the chunks in parallel.
"""

from __future__ import annotations

import logging
import types

import pytest
import torch

from ssdtrain_megatron import ActivationOffloader, OffloadConfig
from ssdtrain_megatron.io.gds import GDS_ALIGN, configure_kvikio
from ssdtrain_megatron.io.slab_engine import aligned_buffer
from tests import fake_kvikio
from tests.recording_streams import Recorder, _range
from tests.test_staging_race import Logged

COLS = 384


def _config(tmp_path, **kw) -> OffloadConfig:
    kw.setdefault("io_threads", 6)
    return OffloadConfig(dirs=[str(tmp_path)], min_tensor_bytes=0, keep_last_layers=0, chunk_bytes=64 * 1024,
                         max_inflight_bytes=1 << 20, pinned_staging_bytes=1 << 20, **kw)


def _gds(config):
    from ssdtrain_megatron.io.gds import GdsEngine

    return GdsEngine(config)


# -- kvikio's thread pool ----------------------------------------------------------------------

def test_kvikios_thread_pool_gets_io_threads(tmp_path, monkeypatch):
    monkeypatch.delenv("KVIKIO_NTHREADS", raising=False)
    defaults = fake_kvikio.install(monkeypatch)
    _gds(_config(tmp_path, io_threads=6)).close()
    assert defaults.get("num_threads") == 6


def test_kvikio_nthreads_in_the_environment_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("KVIKIO_NTHREADS", "3")
    defaults = fake_kvikio.install(monkeypatch)
    _gds(_config(tmp_path, io_threads=6)).close()
    assert defaults.get("num_threads") == 1  # left to kvikio, which reads the variable itself


def test_the_older_kvikio_api_is_configured_too(monkeypatch):
    monkeypatch.delenv("KVIKIO_NTHREADS", raising=False)
    calls = []
    off, on = object(), object()
    old = types.SimpleNamespace(
        CompatMode=types.SimpleNamespace(OFF=off, ON=on),
        defaults=types.SimpleNamespace(num_threads_reset=calls.append, compat_mode=lambda: on))
    assert configure_kvikio(old, 5) is True and calls == [5]
    old.defaults.compat_mode = lambda: off
    assert configure_kvikio(old, 5) is False


# -- a model whose saved tensors start on a page ----------------------------------------------

class SavesAligned(torch.autograd.Function):
    """y = x + 1 written into page-aligned memory (residue 0, as a fresh GPU allocation of
    that size would be), saved whole or as a strided (compact) view; backward uses it."""

    @staticmethod
    def forward(ctx, x, compact):
        y = aligned_buffer(x.nbytes).view(x.dtype).view(x.shape)
        torch.add(x, 1, out=y)
        saved = y[:, COLS // 3:2 * COLS // 3] if compact else y
        ctx.save_for_backward(saved)
        ctx.compact = compact
        return y * 1

    @staticmethod
    def backward(ctx, g):
        (s,) = ctx.saved_tensors
        gx = g.clone()
        if ctx.compact:
            gx[:, COLS // 3:2 * COLS // 3] *= s
        else:
            gx *= s
        return gx, None


def _run(off, compact: bool):
    grads = []
    for mb in range(2):
        x = torch.randn(64, COLS, generator=torch.Generator().manual_seed(mb)).requires_grad_()
        with off.microbatch(mb):
            h = x
            for _ in range(3):
                h = SavesAligned.apply(h, compact)
            loss = h.sum()
        off.wait_writes()
        loss.backward()
        grads.append(x.grad)
    return grads, off.end_step()


@pytest.mark.parametrize("compact", [False, True], ids=["dense", "compact"])
def test_gds_reads_land_on_4k_boundaries(tmp_path, monkeypatch, compact):
    """cuFile DMAs a 4 KiB-aligned device buffer directly and bounces any other: every read
    the offloader hands the gds engine targets an aligned address (the restored tensor
    itself, or a compact record's packed bytes). Before the fix the target was aligned only
    mod 512 (the original's residue), and this printed 'read into ... not 4 KiB-aligned'."""
    fake_kvikio.install(monkeypatch)
    rec = Recorder()
    engine = Logged(_gds(_config(tmp_path)), rec)
    with ActivationOffloader(_config(tmp_path), device=torch.device("cpu"), engine=engine, streams=rec) as off:
        assert off.copy.direct
        grads, stats = _run(off, compact)
    reads = rec.nodes("engine_read")
    assert reads and len(reads) == stats.tensors_offloaded > 0 and stats.bytes_read > 0
    for r in reads:
        start = r.tags["ptr"][0]
        assert start % GDS_ALIGN == 0, f"read into {start:#x}: not 4 KiB-aligned ({start % GDS_ALIGN} past)"
    ref = _reference(compact)
    for a, b in zip(grads, ref):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def _reference(compact: bool):
    grads = []
    for mb in range(2):
        x = torch.randn(64, COLS, generator=torch.Generator().manual_seed(mb)).requires_grad_()
        h = x
        for _ in range(3):
            h = SavesAligned.apply(h, compact)
        h.sum().backward()
        grads.append(x.grad)
    return grads


# -- compat mode: staged through pinned host memory, no kvikio device copies -------------------

def test_in_compat_mode_gds_stages_through_pinned_host_memory(tmp_path, monkeypatch, caplog):
    """kvikio's compat mode would copy device memory on its own blocking streams (ordered with
    the legacy default stream, torch's default compute stream) or on that stream itself; the
    engine is then not device_direct: the offloader's own streams copy into pinned staging
    and kvikio moves host bytes only."""
    fake_kvikio.install(monkeypatch, compat=True)
    caplog.set_level(logging.INFO, logger="ssdtrain_megatron.io.gds")
    rec = Recorder()
    engine = Logged(_gds(_config(tmp_path)), rec)
    assert engine.device_direct is False
    assert "compat mode" in caplog.text
    with ActivationOffloader(_config(tmp_path), device=torch.device("cpu"), engine=engine, streams=rec) as off:
        assert not off.copy.direct and off.copy.pool is not None
        pool = _range(off.copy.pool._mem)
        grads, stats = _run(off, compact=False)
    subs = rec.nodes("engine_write") + rec.nodes("engine_read")
    assert subs and len(rec.nodes("copy")) >= 2 * stats.tensors_offloaded > 0
    for n in subs:
        lo, hi = n.tags["ptr"]
        assert pool[0] <= lo and hi <= pool[1], f"{n}: the engine got memory outside the staging pool"
    for a, b in zip(grads, _reference(False)):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


# -- on a GPU with kvikio ----------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("compact", [False, True], ids=["dense", "compact"])
def test_cuda_gds_reads_are_4k_aligned_and_bitwise(tmp_path, compact):
    """Real kvikio (GDS or compat mode, whichever this box has) and real streams: reads land
    4 KiB-aligned when the engine is direct, the engine is staged in compat mode, and the
    gradients are bitwise those of a run without offload. (The first GPU run failed it with
    0 bytes read: the test itself still held the saved tensors.)"""
    from ssdtrain_megatron.io.gds import GdsEngine, gds_unavailable_reason

    if gds_unavailable_reason():
        pytest.skip(gds_unavailable_reason())
    import kvikio

    from ssdtrain_megatron.cache.stream_ops import CudaStreams

    dev = torch.device("cuda", torch.cuda.current_device())
    rec = Recorder(inner=CudaStreams(), delay_s=0.002)
    engine = Logged(GdsEngine(_config(tmp_path)), rec)
    assert engine.device_direct == (not configure_kvikio(kvikio, 6))
    with ActivationOffloader(_config(tmp_path), device=dev, engine=engine, streams=rec) as off:
        grads = []
        for mb in range(2):
            x = torch.randn(64, COLS, generator=torch.Generator().manual_seed(mb)).to(dev).requires_grad_()
            with off.microbatch(mb):
                y = torch.tanh(x)
                saved = y[:, COLS // 3:2 * COLS // 3] if compact else y
                loss = (saved * saved).sum()
            del y, saved  # held here, they would be served from memory at unpack: no read
            off.wait_writes()
            loss.backward()
            grads.append(x.grad)
        stats = off.end_step()
    torch.cuda.synchronize()
    assert stats.bytes_read > 0
    if engine.device_direct:
        assert all(r.tags["ptr"][0] % GDS_ALIGN == 0 for r in rec.nodes("engine_read"))
    for mb, g in enumerate(grads):
        x = torch.randn(64, COLS, generator=torch.Generator().manual_seed(mb)).to(dev).requires_grad_()
        y = torch.tanh(x)
        saved = y[:, COLS // 3:2 * COLS // 3] if compact else y
        (saved * saved).sum().backward()
        assert torch.equal(g.view(torch.int32), x.grad.view(torch.int32))


def test_kvikio_defaults_is_imported_when_the_package_does_not_import_it(tmp_path, monkeypatch):
    """kvikio 26.10's ``import kvikio`` leaves its ``defaults`` submodule unimported (the first
    GPU run of gpu-check: "module 'kvikio' has no attribute 'defaults'"). A stand-in package laid
    out the same way (kvikio itself needs CUDA) must still be configured. Broken by reading
    ``kvikio.defaults`` as an attribute only: AttributeError."""
    import importlib
    import sys

    pkg = tmp_path / "kvikio_layout"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "defaults.py").write_text("calls = []\n"
                                     "def set(name, value):\n    calls.append((name, value))\n"
                                     "def is_compat_mode_preferred():\n    return True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("KVIKIO_NTHREADS", raising=False)
    module = importlib.import_module("kvikio_layout")
    try:
        assert not hasattr(module, "defaults")
        assert configure_kvikio(module, 3) is True
        assert sys.modules["kvikio_layout.defaults"].calls == [("num_threads", 3)]
    finally:
        sys.modules.pop("kvikio_layout.defaults", None)
        sys.modules.pop("kvikio_layout", None)
