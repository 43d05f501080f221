"""The engine suite (tests/test_engines.py), part: round trips of every dtype and size, and
the on-disk layout (striping, per-rank directories). Runs against every IO engine.
"""

from __future__ import annotations

import threading

import pytest
import torch


import tests.test_engines as engine_suite
from ssdtrain_megatron.io import EngineError
from tests.test_engines import ALL, CHUNK, ON_DISK, _bytes, _param, _round_trip

open_engine = engine_suite.open_engine  # the engine suite's fixture


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
def test_a_view_with_a_storage_offset_is_stored_as_its_bytes(open_engine, name):
    """(Was named "views and non-contiguous sources", with a contiguous view only: the engines
    take contiguous tensors, io/base.py; the next test is about the others.)"""
    engine = open_engine(name)
    base = torch.arange(40000, dtype=torch.float32)
    view = base[1000:30001]  # a view with a storage offset
    assert view.is_contiguous() and view.storage_offset() == 1000
    (out,) = _round_trip(engine, [view])
    assert torch.equal(out.view(torch.int32), view.view(torch.int32))


@pytest.mark.parametrize("name", [_param(n) for n in ALL])
def test_a_non_contiguous_source_is_refused_not_stored_wrong(open_engine, name):
    """The interface takes contiguous tensors (io/base.py); one that is not must fail its write,
    never come back as other bytes. A transposed 200x200 float32 matrix. posix and aio, which
    move bytes by address, stored it in memory order and reported success until the slab
    engines checked (broken variant: drop the is_contiguous() test in SlabEngine.write)."""
    engine = open_engine(name)
    t = torch.arange(40000, dtype=torch.float32).view(200, 200).t()
    assert not t.is_contiguous()
    with pytest.raises((EngineError, RuntimeError)):
        engine.write(0, t).result(30)


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
            spans[e.root].append((e.offset, e.offset + e.shift + max(e.length, 1)))  # io/bounce.py: shift
    assert len({engine._placed[k].extents[0].root for k in range(len(sizes))}) == n_roots  # first roots take turns
    for root_spans in spans.values():
        root_spans.sort()
        assert all(end <= nxt for (_, end), (nxt, _) in zip(root_spans, root_spans[1:]))
    # each chunk's place: its bytes and room for any shift, padded (io/bounce.py)
    extra = engine.staging.dio_align - 1
    padded = sum(-(-(extra + max(e.length, 1)) // 4096) * 4096 for k in range(len(sizes))
                 for e in engine._placed[k].extents)
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
