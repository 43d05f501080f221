"""One behaviour suite, run against every IO engine.

Engines that cannot run here skip with the reason their ``is_available()`` gives: 'aio' needs
DeepSpeed, libaio-dev and a C++ toolchain (its tests carry the ``aio`` mark, so CI can select
them with ``-m aio``), 'gds' needs CUDA and kvikio (``cuda`` mark).

'gds-fake' is the gds engine on ``tests/fake_kvikio.py``, a stand-in for kvikio (which cannot
do IO without CUDA): it runs everywhere and covers the engine's own logic, not kvikio or GDS.

This module holds the suite's helpers and ``open_engine`` fixture, and the errors and merged
requests; the other parts are test_engine_round_trip.py, test_engine_lifecycle.py and
test_engine_backends.py.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path
from typing import List

import pytest
import torch

from ssdtrain_megatron.config import OffloadConfig
from ssdtrain_megatron.io import EngineError, Identity, engine_class, make_engine
from tests.faulty import FaultyEngine
from tests.drives import mount

CHUNK = 64 * 1024
ALL = ["posix", "aio", "memory", "tiered", "gds", "gds-fake"]
ON_DISK = ["posix", "aio", "gds", "gds-fake", "tiered"]
WITH_FAULT_HOOK = ["posix", "aio", "gds-fake"]  # faults through tests/faulty.py
STAGED = ["posix", "aio"]  # engines that stage chunks in bounce buffers (and merge them)


def _param(name: str):
    marks = {"aio": [pytest.mark.aio], "gds": [pytest.mark.cuda]}.get(name, [])
    return pytest.param(name, marks=marks, id=name)


def _skip_unless_available(name: str) -> None:
    ok, why = engine_class(name).is_available()
    if not ok:
        pytest.skip(f"engine {name!r} cannot run here: {why}")


def _config(name: str, roots: List[Path], **overrides) -> OffloadConfig:
    values = dict(dirs=[str(r) for r in roots], engine=name, job="test", io_threads=2,
                  chunk_bytes=CHUNK, host_memory_bytes=64 << 20)
    if name == "tiered":
        values["host_memory_bytes"] = 0  # everything on SSD unless a test says otherwise
    values.update(overrides)
    return OffloadConfig(**values)


@pytest.fixture
def open_engine(tmp_path, monkeypatch):
    """open_engine(name, n_roots=1, rank=0, **config) -> an engine, closed after the test."""
    engines = []

    def make(name: str, n_roots: int = 1, rank: int = 0, **overrides):
        if name == "gds-fake":
            from tests import fake_kvikio

            fake_kvikio.install(monkeypatch)
            name = "gds"
        _skip_unless_available(name)
        roots = [tmp_path / f"root{i}" for i in range(n_roots)]
        mount(*roots)  # the drives
        engine = make_engine(_config(name, roots, **overrides),
                             Identity(rank=rank, local_rank=rank, hostname="host", job="test"))
        engine.test_roots = roots
        engines.append(engine)
        return engine

    yield make
    for e in engines:
        e.close()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _round_trip(engine, tensors: List[torch.Tensor], first_key: int = 0) -> List[torch.Tensor]:
    writes = [engine.write(first_key + i, _bytes(t)) for i, t in enumerate(tensors)]
    assert [f.result(30) for f in writes] == [t.numel() * t.element_size() for t in tensors]
    outs = [torch.empty(t.numel() * t.element_size(), dtype=torch.uint8) for t in tensors]
    reads = [engine.read(first_key + i, o) for i, o in enumerate(outs)]
    assert [f.result(30) for f in reads] == [o.numel() for o in outs]
    return outs


def _files_under(root: Path) -> List[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


# -- errors are surfaced, never swallowed -----------------------------------------------------


@pytest.mark.parametrize("name", [_param(n) for n in WITH_FAULT_HOOK])
@pytest.mark.parametrize("op", ["write", "read"])
def test_an_io_error_fails_the_future_naming_file_and_offset(open_engine, name, op):
    engine = open_engine(name)
    data = torch.randint(0, 256, (3 * CHUNK,), dtype=torch.uint8)
    if op == "read":
        engine.write(0, data).result(30)

    def fault(kind, path, offset, nbytes):
        if kind == op and offset + nbytes > CHUNK:  # a call that reaches past the first chunk
            return OSError(errno.EIO, os.strerror(errno.EIO))
        return None

    engine = FaultyEngine(engine, fault)
    fut = engine.write(0, data) if op == "write" else engine.read(0, torch.empty_like(data))
    with pytest.raises(EngineError, match=r"slab\.bin at offset \d+.*Input/output error"):
        fut.result(30)


@pytest.mark.parametrize("name", [_param(n) for n in ["posix", "aio", "tiered", "gds-fake"]])
def test_a_full_disk_fails_the_write_future_and_keeps_nothing_once_released(open_engine, name, monkeypatch):
    from ssdtrain_megatron.io import slab

    monkeypatch.setattr(slab, "GROW_BYTES", CHUNK)  # reserve little ahead, so the next write must
    engine = open_engine(name)
    engine.write(0, torch.ones(CHUNK, dtype=torch.uint8)).result(30)  # the slab exists
    held = engine.bytes_on_disk

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    fut = engine.write(1, torch.ones(8 * CHUNK, dtype=torch.uint8))  # the caller is not held up
    with pytest.raises(EngineError, match=r"cannot reserve .* No space left on device \(.* MiB free in ") as info:
        fut.result(30)
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    engine.release(1)  # what the offloader does with a failed write
    assert engine.bytes_on_disk == held
    with pytest.raises(EngineError, match="unknown key 1"):
        engine.read(1, torch.empty(1, dtype=torch.uint8))
    got = torch.empty(CHUNK, dtype=torch.uint8)
    engine.read(0, got).result(30)
    assert torch.equal(got, torch.ones(CHUNK, dtype=torch.uint8))


@pytest.mark.parametrize("name", [_param(n) for n in ["posix", "aio", "gds-fake"]])
def test_the_callers_thread_never_reserves_space_or_does_io(open_engine, name, monkeypatch):
    """Handing a tensor over must not block the training thread on the disk: fallocate, the
    writes and the reads all happen on the engine's threads. Every read and write is seen at
    the engine's syscall seam (``engine._sys``, through tests/faulty.py), whatever call the
    engine makes there (the spies on os.pwrite/os.preadv this replaced never saw posix's
    pwritev). Broken variant: PosixEngine._enqueue making one ``self._sys.pwritev`` on the
    caller's thread before queueing: "IO on the caller's thread: [('write', ...), ...]"."""
    from ssdtrain_megatron.io import slab

    monkeypatch.setattr(slab, "GROW_BYTES", CHUNK)  # so that every write needs a reservation
    caller = threading.get_ident()
    calls = []
    real_fallocate = os.posix_fallocate

    def fallocate(*args):
        calls.append(("posix_fallocate", threading.get_ident()))
        return real_fallocate(*args)

    def seam(op, path, offset, nbytes):  # every pwritev/preadv, aio submission, kvikio call
        calls.append((op, threading.get_ident()))
        return None

    engine = FaultyEngine(open_engine(name), seam)
    monkeypatch.setattr(os, "posix_fallocate", fallocate)  # after opening: the hand-over's calls
    tensors = [torch.full((3 * CHUNK + k,), k, dtype=torch.uint8) for k in range(8)]
    outs = _round_trip(engine, tensors)
    assert len(outs) == len(tensors)
    for o, t in zip(outs, tensors):
        assert torch.equal(o, t)  # uint8: bytes
    kinds = {c[0] for c in calls}
    assert {"posix_fallocate", "write", "read"} <= kinds, f"the seam saw only {sorted(kinds)}"
    assert not [c for c in calls if c[1] == caller], f"IO on the caller's thread: {[c for c in calls if c[1] == caller]}"


@pytest.mark.parametrize("name", [_param(n) for n in STAGED])  # chunks on several threads
def test_a_failed_chunk_fails_the_future_only_once_no_chunk_is_in_flight(open_engine, name):
    # The caller frees the extents of a failed write at once: a chunk still being written
    # there would land in space handed to the next tensor.
    engine = open_engine(name, io_threads=2)
    gate, second_started = threading.Event(), threading.Event()

    def fault(op, path, offset, nbytes):
        if offset == 0:
            second_started.wait(30)
            return OSError(errno.EIO, os.strerror(errno.EIO))
        second_started.set()
        gate.wait(30)
        return None

    engine = FaultyEngine(engine, fault)
    fut = engine.write(0, torch.ones(2 * CHUNK, dtype=torch.uint8))
    assert second_started.wait(30)
    time.sleep(0.2)
    assert not fut.done()  # chunk 0 failed, chunk 1 is still being written
    gate.set()
    with pytest.raises(EngineError, match="Input/output error"):
        fut.result(30)


@pytest.mark.parametrize("name", [_param(n) for n in ["posix", "aio"]])
def test_checksum_catches_bytes_changed_on_disk(open_engine, name):
    engine = open_engine(name, verify="crc32c")
    data = torch.randint(0, 256, (2 * CHUNK,), dtype=torch.uint8)
    engine.write(0, data).result(30)
    slab = next(engine.test_roots[0].rglob("slab.bin"))
    fd = os.open(slab, os.O_RDWR)
    try:
        ext = engine._placed[0].extents[0]
        os.pwrite(fd, b"\xff" * 16, ext.offset + ext.shift + 100)  # the tensor's bytes (io/bounce.py)
        os.fsync(fd)
    finally:
        os.close(fd)
    with pytest.raises(EngineError, match="checksum mismatch"):
        engine.read(0, torch.empty_like(data)).result(30)


# -- chunks merged into one request ---------------------------------------------------------


@pytest.mark.parametrize("name", [_param(n) for n in STAGED])
@pytest.mark.parametrize("read_order", ["forward", "reverse"])
def test_small_chunks_queued_together_merge_into_one_request(open_engine, name, read_order):
    engine = open_engine(name, io_threads=1)
    gen = torch.Generator().manual_seed(4)
    tensors = [torch.randint(0, 256, (1 + 997 * k % 9000,), dtype=torch.uint8, generator=gen) for k in range(40)]
    parts_per_request = []
    staging = engine.staging
    fill, drain = staging.fill, staging.drain

    def counting(step):
        def run(op, *args):
            parts_per_request.append((op.writing, len(op.parts)))
            return step(op, *args)
        return run

    staging.fill, staging.drain = counting(fill), counting(drain)
    write_gate, read_gate = threading.Event(), threading.Event()

    class HeldBack:  # the one write thread waits here while the other writes queue up
        def synchronize(self):
            write_gate.wait(30)

    futs = [engine.write(0, tensors[0], HeldBack())]
    futs += [engine.write(k, t) for k, t in enumerate(tensors[1:], 1)]
    write_gate.set()
    assert [f.result(30) for f in futs] == [t.numel() for t in tensors]

    engine = FaultyEngine(engine, lambda op, path, offset, nbytes: read_gate.wait(30) and None)  # holds the read thread
    outs = [torch.empty_like(t) for t in tensors]
    keys = list(range(len(tensors)))
    if read_order == "reverse":  # backward reads a layer's tensors in reverse save order
        keys.reverse()
    futs = {k: engine.read(k, outs[k]) for k in keys}
    read_gate.set()
    assert [futs[k].result(30) for k in range(len(tensors))] == [t.numel() for t in tensors]
    assert all(torch.equal(o, t) for o, t in zip(outs, tensors))
    for writing in (True, False):
        sizes = [n for w, n in parts_per_request if w == writing]
        assert sum(sizes) == len(tensors) and max(sizes) > 1, (writing, sizes)


@pytest.mark.parametrize("name", [_param(n) for n in STAGED])
def test_a_bad_chunk_in_a_merged_read_fails_only_its_own_tensor(open_engine, name):
    engine = open_engine(name, io_threads=1, verify="crc32c")
    tensors = [torch.full((3000,), k, dtype=torch.uint8) for k in range(6)]
    _round_trip(engine, tensors)
    slab = next(engine.test_roots[0].rglob("slab.bin"))
    fd = os.open(slab, os.O_RDWR)
    try:
        ext = engine._placed[3].extents[0]
        os.pwrite(fd, b"\xee" * 8, ext.offset + ext.shift + 10)  # tensor 3's bytes (io/bounce.py: shift)
        os.fsync(fd)
    finally:
        os.close(fd)
    gate = threading.Event()
    engine = FaultyEngine(engine, lambda op, path, offset, nbytes: gate.wait(30) and None)  # reads queue up, then merge
    outs = [torch.empty_like(t) for t in tensors]
    futs = [engine.read(k, o) for k, o in enumerate(outs)]
    gate.set()
    for k, fut in enumerate(futs):
        if k == 3:
            with pytest.raises(EngineError, match="checksum mismatch"):
                fut.result(30)
        else:
            assert fut.result(30) == 3000 and torch.equal(outs[k], tensors[k])
