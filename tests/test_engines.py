"""One behaviour suite, run against every IO engine.

Engines that cannot run here skip with the reason their ``is_available()`` gives: 'aio' needs
DeepSpeed, libaio-dev and a C++ toolchain (its tests carry the ``aio`` mark, so CI can select
them with ``-m aio``), 'gds' needs CUDA and kvikio (``cuda`` mark).

'gds-fake' is the gds engine on ``tests/fake_kvikio.py``, a stand-in for kvikio (which cannot
do IO without CUDA): it runs everywhere and covers the engine's own logic, not kvikio or GDS.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List

import pytest
import torch

from ssdtrain_megatron.config import ENGINES, ConfigError, OffloadConfig
from ssdtrain_megatron.io import EngineError, EngineUnavailable, Identity, engine_class, make_engine
from ssdtrain_megatron.io.layout import OWNER_FILE
from tests.faulty import FaultyEngine

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


# -- round trips -------------------------------------------------------------------------------


DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.bool]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("name", [_param(n) for n in ALL])
def test_round_trip_is_bitwise_for_every_dtype(open_engine, name, dtype):
    engine = open_engine(name, host_memory_bytes=64 << 20 if name != "tiered" else 96 * 1024)
    gen = torch.Generator().manual_seed(1)
    # Random bit patterns, so NaN payloads, negative zeros and denormals are all in there.
    raw = torch.randint(0, 256, (3 * CHUNK + 1234,), dtype=torch.uint8, generator=gen)
    if dtype is torch.bool:
        tensor = raw.remainder(2).bool()
    else:
        size = torch.empty(0, dtype=dtype).element_size()
        tensor = raw[: raw.numel() // size * size].view(dtype)
    (out,) = _round_trip(engine, [tensor])
    assert torch.equal(out, _bytes(tensor))
    assert torch.equal(out.view(dtype).view(torch.uint8), _bytes(tensor))


ODD_SIZES = [0, 1, 511, 512, 4095, 4097, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 123]


@pytest.mark.parametrize("name", [_param(n) for n in ALL])
def test_round_trip_of_odd_sizes_in_flight_together(open_engine, name):
    engine = open_engine(name, n_roots=2, host_memory_bytes=64 << 20 if name != "tiered" else 128 * 1024)
    gen = torch.Generator().manual_seed(2)
    tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in ODD_SIZES]
    outs = _round_trip(engine, tensors)
    for t, o in zip(tensors, outs):
        assert torch.equal(o, t), f"{t.numel()} bytes"


@pytest.mark.parametrize("name", [_param(n) for n in ALL])
def test_views_and_non_contiguous_sources_are_stored_as_their_bytes(open_engine, name):
    engine = open_engine(name)
    base = torch.arange(40000, dtype=torch.float32)
    view = base[1000:30001]  # a view with a storage offset
    (out,) = _round_trip(engine, [view])
    assert torch.equal(out.view(torch.float32), view)


@pytest.mark.parametrize("name", [_param(n) for n in ALL])
def test_ready_event_is_waited_for_before_the_data_is_read(open_engine, name):
    engine = open_engine(name)
    data = torch.zeros(3 * CHUNK, dtype=torch.uint8)

    class Event:  # stands in for a CUDA event: the producer finishes inside synchronize()
        calls = 0

        def synchronize(self):
            Event.calls += 1
            data.fill_(7)

    assert engine.write(0, data, Event()).result(30) == data.numel()
    out = torch.empty_like(data)
    engine.read(0, out).result(30)
    assert Event.calls >= 1
    assert torch.equal(out, torch.full_like(data, 7))


@pytest.mark.parametrize("name", [_param(n) for n in ALL])
def test_many_writers_and_readers_on_threads(open_engine, name):
    engine = open_engine(name, n_roots=2, host_memory_bytes=64 << 20 if name != "tiered" else 512 * 1024)
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randint(0, 256, (17 * 1024 * (i + 1),), dtype=torch.uint8, generator=gen) for i in range(24)]
    errors = []

    def worker(k: int) -> None:
        try:
            for i in range(k, len(tensors), 4):
                engine.write(i, tensors[i]).result(30)
                out = torch.empty_like(tensors[i])
                engine.read(i, out).result(30)
                assert torch.equal(out, tensors[i])
                engine.release(i)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert engine.bytes_on_disk == 0


# -- layout: striping, per-rank directories ---------------------------------------------------


@pytest.mark.parametrize("name", [_param(n) for n in ON_DISK])
def test_chunks_are_striped_over_every_root(open_engine, name):
    engine = open_engine(name, n_roots=3)
    data = torch.randint(0, 256, (6 * CHUNK,), dtype=torch.uint8)
    (out,) = _round_trip(engine, [data])
    assert torch.equal(out, data)
    for root in engine.test_roots:
        slabs = [p for p in root.rglob("slab.bin")]
        assert len(slabs) == 1, root
        assert slabs[0].stat().st_blocks * 512 >= 2 * CHUNK, f"{root} holds too little of the tensor"


@pytest.mark.parametrize("n_roots", [1, 2, 3])
def test_chunks_are_placed_round_robin_without_overlap(open_engine, n_roots):
    engine = open_engine("posix", n_roots=n_roots)
    sizes = [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 5 * CHUNK + 3, 7 * CHUNK]
    spans = {r: [] for r in range(n_roots)}
    for key, n in enumerate(sizes):
        engine.write(key, torch.zeros(n, dtype=torch.uint8)).result(30)
        extents = engine._placed[key].extents
        assert [e.length for e in extents] == [CHUNK] * (len(extents) - 1) + [n - CHUNK * (len(extents) - 1)]
        assert len(extents) == max(1, -(-n // CHUNK))
        first = extents[0].root
        assert [e.root for e in extents] == [(first + i) % n_roots for i in range(len(extents))]
        for e in extents:
            assert e.offset % 4096 == 0
            spans[e.root].append((e.offset, e.offset + max(e.length, 1)))
    assert len({engine._placed[k].extents[0].root for k in range(len(sizes))}) == n_roots  # first roots take turns
    for root_spans in spans.values():
        root_spans.sort()
        assert all(end <= nxt for (_, end), (nxt, _) in zip(root_spans, root_spans[1:]))
    padded = sum(-(-max(e.length, 1) // 4096) * 4096 for k in range(len(sizes)) for e in engine._placed[k].extents)
    assert engine.bytes_on_disk == padded


@pytest.mark.parametrize("name", [_param(n) for n in ON_DISK])
def test_each_rank_uses_its_own_private_directory(open_engine, name):
    rank0 = open_engine(name, rank=0)
    rank1 = open_engine(name, rank=1)
    a = torch.full((CHUNK + 5,), 1, dtype=torch.uint8)
    b = torch.full((CHUNK + 5,), 2, dtype=torch.uint8)
    (out0,) = _round_trip(rank0, [a])
    (out1,) = _round_trip(rank1, [b])  # same key, other rank: no clash
    assert torch.equal(out0, a) and torch.equal(out1, b)
    root = rank0.test_roots[0]
    dirs = sorted(p.name for p in root.iterdir())
    assert len(dirs) == 2
    assert any(".rank0." in d for d in dirs) and any(".rank1." in d for d in dirs)
    for d in dirs:
        assert (root / d).stat().st_mode & 0o777 == 0o700


# -- lifecycle ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [_param(n) for n in ALL])
def test_nothing_is_left_after_release_end_step_and_close(open_engine, name, tmp_path):
    engine = open_engine(name, n_roots=2)
    tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (1, CHUNK, 3 * CHUNK + 7)]
    _round_trip(engine, tensors)
    assert engine.bytes_on_disk > 0
    for i in range(len(tensors)):
        engine.release(i)
    assert engine.bytes_on_disk == 0
    engine.end_step()
    for root in engine.test_roots:
        leftovers = [f for f in _files_under(root) if not f.endswith(OWNER_FILE) and "/" in f]
        assert leftovers == [], f"files left after end_step: {leftovers}"
    # The next step works on fresh slabs.
    (out,) = _round_trip(engine, [tensors[2]], first_key=10)
    assert torch.equal(out, tensors[2])
    engine.release(10)
    engine.close()
    for root in engine.test_roots:
        assert _files_under(root) == []


@pytest.mark.parametrize("name", [_param(n) for n in ON_DISK])
def test_end_step_keeps_the_slab_while_a_key_is_live(open_engine, name):
    engine = open_engine(name)
    data = torch.randint(0, 256, (CHUNK,), dtype=torch.uint8)
    engine.write(0, data).result(30)
    engine.end_step()  # a key is still live: nothing may be dropped
    out = torch.empty_like(data)
    engine.read(0, out).result(30)
    assert torch.equal(out, data)


@pytest.mark.parametrize("name", [_param(n) for n in ALL])
def test_released_space_is_reused(open_engine, name):
    engine = open_engine(name, host_memory_bytes=4 * CHUNK if name != "tiered" else 0)
    data = torch.randint(0, 256, (3 * CHUNK,), dtype=torch.uint8)
    for step in range(5):
        engine.write(step, data).result(30)
        held = engine.bytes_on_disk
        engine.release(step)
        assert engine.bytes_on_disk == 0
    assert held >= data.numel()


@pytest.mark.parametrize("name", [_param(n) for n in ALL])
def test_misuse_raises_engine_error(open_engine, name):
    engine = open_engine(name)
    data = torch.ones(100, dtype=torch.uint8)
    with pytest.raises(EngineError, match="unknown key 5"):
        engine.read(5, torch.empty(100, dtype=torch.uint8))
    engine.write(1, data).result(30)
    with pytest.raises(EngineError, match="key 1 written twice"):
        engine.write(1, data)
    engine.release(1)
    engine.release(1)  # releasing twice is harmless
    engine.close()
    with pytest.raises(EngineError, match="closed"):
        engine.write(2, data)
    engine.close()  # closing twice is harmless


@pytest.mark.parametrize("name", [_param(n) for n in ALL])
def test_every_request_is_traced_before_its_future_completes(open_engine, name):
    engine = open_engine(name, n_roots=2)
    rows = []
    engine.tracer = lambda *row: rows.append(row)
    data = torch.randint(0, 256, (3 * CHUNK + 10,), dtype=torch.uint8)
    engine.write(7, data).result(30)
    writes = [r for r in rows if r[0] == "write"]
    engine.read(7, torch.empty_like(data)).result(30)
    reads = [r for r in rows if r[0] == "read"]
    for traced in (writes, reads):
        assert traced and all(r[1] == 7 for r in traced)
        assert sum(r[4] for r in traced) == data.numel()  # nbytes
        assert all(r[5] <= r[6] for r in traced)  # t_submit <= t_done
        assert all(r[7] >= 1 for r in traced)  # queue depth
    if name != "memory":
        assert {os.path.basename(r[2]) for r in writes} == {"slab.bin"}
        assert len({r[2] for r in writes}) == 2  # both roots


@pytest.mark.parametrize("name", [_param(n) for n in ON_DISK])
def test_step_peak_bytes_is_each_roots_high_water_mark(open_engine, name):
    engine = open_engine(name, n_roots=2)
    _round_trip(engine, [torch.ones(4 * CHUNK, dtype=torch.uint8)])
    engine.release(0)
    engine.end_step()
    assert engine.step_peak_bytes == [2 * CHUNK, 2 * CHUNK]


@pytest.mark.parametrize("name", [_param(n) for n in ON_DISK])
def test_remove_files_takes_every_file_away_at_once(open_engine, name):
    engine = open_engine(name, n_roots=2)
    _round_trip(engine, [torch.ones(4 * CHUNK, dtype=torch.uint8)])
    engine.remove_files()  # keys still live, nothing waited for
    for root in engine.test_roots:
        assert _files_under(root) == []


@pytest.mark.parametrize("name", [_param(n) for n in ALL])
def test_meters_count_every_byte_moved(open_engine, name):
    engine = open_engine(name)
    data = torch.ones(3 * CHUNK, dtype=torch.uint8)
    _round_trip(engine, [data])
    assert engine.write_meter.take()[0] == data.numel()
    assert engine.read_meter.take()[0] == data.numel()


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
    writes and the reads all happen on the engine's threads."""
    from ssdtrain_megatron.io import slab

    monkeypatch.setattr(slab, "GROW_BYTES", CHUNK)  # so that every write needs a reservation
    engine = open_engine(name)
    caller = threading.get_ident()
    calls = []
    for mod, fn in ((os, "posix_fallocate"), (os, "pwrite"), (os, "preadv")):
        real = getattr(mod, fn)

        def spy(*args, _real=real, _fn=fn):
            calls.append((_fn, threading.get_ident()))
            return _real(*args)

        monkeypatch.setattr(mod, fn, spy)
    tensors = [torch.full((3 * CHUNK + k,), k, dtype=torch.uint8) for k in range(8)]
    outs = _round_trip(engine, tensors)
    assert all(torch.equal(o, t) for o, t in zip(outs, tensors))
    assert ("posix_fallocate", caller) not in calls and any(c[0] == "posix_fallocate" for c in calls)
    assert not [c for c in calls if c[1] == caller], calls


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
    engine = open_engine(name, checksum=True)
    data = torch.randint(0, 256, (2 * CHUNK,), dtype=torch.uint8)
    engine.write(0, data).result(30)
    slab = next(engine.test_roots[0].rglob("slab.bin"))
    fd = os.open(slab, os.O_RDWR)
    try:
        os.pwrite(fd, b"\xff" * 16, 100)
        os.fsync(fd)
    finally:
        os.close(fd)
    with pytest.raises(EngineError, match="checksum mismatch"):
        engine.read(0, torch.empty_like(data)).result(30)


# -- memory and tiered --------------------------------------------------------------------------


def test_memory_pool_full_raises_naming_host_memory_bytes_and_the_way_out(open_engine):
    from ssdtrain_megatron.io.memory import PoolFull

    engine = open_engine("memory", host_memory_bytes=2 * CHUNK)
    engine.write(0, torch.ones(CHUNK, dtype=torch.uint8)).result(30)
    with pytest.raises(PoolFull, match=r"host_memory_bytes=131072.*engine='tiered'"):
        engine.write(1, torch.ones(2 * CHUNK, dtype=torch.uint8))
    engine.release(0)
    assert engine.write(1, torch.ones(2 * CHUNK, dtype=torch.uint8)).result(30) == 2 * CHUNK


def test_memory_pool_is_pinned_exactly_when_the_engine_says_so(open_engine):
    """``pinned`` is defined as "CUDA exists"; what can go wrong is the pool itself."""
    engine = open_engine("memory")
    assert engine._pool.is_pinned() == engine.pinned
    assert engine._pool.numel() == engine.capacity


def test_memory_engine_creates_no_files(open_engine):
    engine = open_engine("memory")
    _round_trip(engine, [torch.ones(CHUNK, dtype=torch.uint8)])
    assert all(_files_under(r) == [] for r in engine.test_roots)


def test_tiered_fills_memory_first_then_spills_to_ssd(open_engine):
    engine = open_engine("tiered", host_memory_bytes=2 * CHUNK)
    tensors = [torch.full((CHUNK,), i, dtype=torch.uint8) for i in range(4)]
    outs = _round_trip(engine, tensors)
    assert [engine.tier_of(i) for i in range(4)] == ["memory", "memory", "posix", "posix"]
    assert engine.tensors_spilled == 2
    assert engine.bytes_in_memory == 2 * CHUNK and engine.bytes_on_ssd == 2 * CHUNK
    assert all(torch.equal(o, t) for o, t in zip(outs, tensors))
    engine.release(0)
    engine.write(9, tensors[0]).result(30)  # freed memory is used again
    assert engine.tier_of(9) == "memory"


# -- aio: DeepNVMe's traps ----------------------------------------------------------------------


@pytest.mark.aio
@pytest.mark.parametrize("parallelism", [2, 3])
def test_aio_pads_requests_to_a_multiple_of_intra_op_parallelism(open_engine, parallelism):
    engine = open_engine("aio", n_roots=2, aio_intra_op_parallelism=parallelism, aio_block_bytes=8192)
    tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in ODD_SIZES]
    outs = _round_trip(engine, tensors)
    assert all(torch.equal(o, t) for o, t in zip(outs, tensors))


@pytest.mark.aio
def test_aio_first_writes_from_many_lanes_at_once_do_not_deadlock(tmp_path):
    # DeepNVMe's first write runs a std::call_once that takes the GIL; the engine makes that
    # write alone in its constructor. Only a fresh process shows the race.
    _skip_unless_available("aio")
    code = f"""
import torch
from ssdtrain_megatron.config import OffloadConfig
from ssdtrain_megatron.io import make_engine
e = make_engine(OffloadConfig(dirs=[{str(tmp_path)!r}], engine="aio", io_threads=8, chunk_bytes=65536))
futs = [e.write(i, torch.full((8 * 65536,), i, dtype=torch.uint8)) for i in range(4)]
assert [f.result(60) for f in futs] == [8 * 65536] * 4
e.close()
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("name", [_param(n) for n in STAGED])
@pytest.mark.parametrize("read_order", ["forward", "reverse"])
def test_small_chunks_queued_together_merge_into_one_request(open_engine, name, read_order):
    engine = open_engine(name, io_threads=1)
    gen = torch.Generator().manual_seed(4)
    tensors = [torch.randint(0, 256, (1 + 997 * k % 9000,), dtype=torch.uint8, generator=gen) for k in range(40)]
    parts_per_request = []
    fill, drain = engine._fill, engine._drain

    def counting(step):
        def run(op):
            parts_per_request.append((op.writing, len(op.parts)))
            return step(op)
        return run

    engine._fill, engine._drain = counting(fill), counting(drain)
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
    engine = open_engine(name, io_threads=1, checksum=True)
    tensors = [torch.full((3000,), k, dtype=torch.uint8) for k in range(6)]
    _round_trip(engine, tensors)
    slab = next(engine.test_roots[0].rglob("slab.bin"))
    fd = os.open(slab, os.O_RDWR)
    try:
        os.pwrite(fd, b"\xee" * 8, engine._placed[3].extents[0].offset + 10)  # tensor 3's bytes
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


@pytest.mark.aio
def test_aio_read_with_the_wrong_size_is_refused(open_engine):
    engine = open_engine("aio")
    engine.write(0, torch.ones(1000, dtype=torch.uint8)).result(30)
    with pytest.raises(EngineError, match="into 999 bytes; 1000 were written"):
        engine.read(0, torch.empty(999, dtype=torch.uint8))


def test_aio_availability_names_every_missing_piece(monkeypatch):
    from ssdtrain_megatron.io import aio, aio_support

    monkeypatch.setattr(aio_support, "_prebuilt_op", lambda ds_dir: False)
    monkeypatch.setattr(aio_support, "_has_libaio_dev", lambda: False)
    monkeypatch.setattr(aio_support.shutil, "which", lambda name: None)
    if aio_support.importlib.util.find_spec("deepspeed") is not None:
        why = aio_support.aio_unavailable_reason()
        assert "libaio-dev" in why and "C++ compiler" in why and "ninja" in why
    real_find_spec = aio_support.importlib.util.find_spec
    monkeypatch.setattr(aio_support.importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepspeed" else real_find_spec(name, *a))
    ok, why = aio.AioEngine.is_available()
    assert not ok and "pip install deepspeed==0.19.8" in why


def test_a_build_lock_left_by_a_killed_build_is_refused_not_waited_on(tmp_path, monkeypatch, caplog):
    import logging

    from ssdtrain_megatron.io import aio_support

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = aio_support.build_lock_path()
    assert lock == str(tmp_path / "async_io" / "lock")
    aio_support.check_build_lock(lock)  # no lock: nothing to say
    (tmp_path / "async_io" / "lock").touch()
    caplog.set_level(logging.WARNING, logger="ssdtrain_megatron")
    aio_support.check_build_lock(lock)  # a build is running: wait for it, and say so
    assert any("another process is building" in r.getMessage() for r in caplog.records)
    old = time.time() - 3600
    for entry in (tmp_path / "async_io").iterdir():
        os.utime(entry, (old, old))
    os.utime(tmp_path / "async_io", (old, old))
    with pytest.raises(EngineUnavailable, match=r"nothing in its directory has changed for 60 min.*rm .*async_io/lock"):
        aio_support.check_build_lock(lock)


def test_asking_whether_aio_can_run_neither_imports_deepspeed_nor_builds():
    code = ("import sys; from ssdtrain_megatron.io import engine_class; "
            "engine_class('aio').is_available(); engine_class('gds').is_available(); "
            "assert 'deepspeed' not in sys.modules and 'kvikio' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- gds and config -----------------------------------------------------------------------------


def test_every_configurable_engine_has_a_class_named_after_it():
    for name in ENGINES:
        assert engine_class(name).name == name
    with pytest.raises(EngineUnavailable, match="unknown engine 'nvme'"):
        engine_class("nvme")


def test_gds_refuses_checksums_it_could_not_compute():
    assert OffloadConfig(engine="gds").engine == "gds"  # the config probes nothing (test_capability.py)
    with pytest.raises(ConfigError, match=r"OffloadConfig.checksum=True.*engine='gds'.*'posix' or 'aio'"):
        OffloadConfig(engine="gds", checksum=True)


def test_memory_refuses_checksums_it_would_not_compute():
    with pytest.raises(ConfigError, match=r"OffloadConfig.checksum=True.*engine='memory'.*engine='tiered'"):
        OffloadConfig(engine="memory", host_memory_bytes=1 << 20, checksum=True)
    assert OffloadConfig(engine="tiered", checksum=True).checksum


@pytest.mark.parametrize("field, value, message", [
    ("aio_block_bytes", 5000, "multiple of 4096"),
    ("aio_block_bytes", 0, "integer >= 4096"),
    ("aio_queue_depth", 0, "integer >= 1"),
    ("aio_intra_op_parallelism", True, "integer >= 1"),
    ("host_memory_bytes", -1, "integer >= 0"),
])
def test_config_rejects_bad_engine_settings_naming_the_field(field, value, message):
    with pytest.raises(ConfigError, match=rf"OffloadConfig.{field}=.*{message}"):
        OffloadConfig(**{field: value})


def test_memory_engine_needs_a_pool():
    with pytest.raises(ConfigError, match="host_memory_bytes=0.*engine='memory'"):
        OffloadConfig(engine="memory", host_memory_bytes=0)
