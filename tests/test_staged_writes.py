"""A drive engine's write on the GPU path is two steps: the device->host copy into pinned
staging, then the drive write from there. The device memory goes when the copy has landed,
not when the drive has the bytes (issue 47: a slow drive fills host staging, not the GPU).

The streams are the recording stand-in (tests/recording_streams.py: every stream deferred, the
compute stream too, whose kernels run when it runs them (``Recorder.launch``); copies run when
their stream runs them, at seeded random moments; poison on; the copy-back and read-ahead
scenes over tests/gpu_scenes.py ``SEEDS``, printed; a scene that needs the copies landed says
so with ``run_all``, one that needs them never seen to land marks the offload stream
``unobserved``); the
posix engine, its files and IO threads are real, with an IO thread held inside a write where a
test needs a drive write to be under way (tests/faulty.py). What only a GPU shows: how fast
the copies land, and the memory the allocator really gets back.

Broken variants, each tried once: the landing poll disabled (``Progress.poll_copies``
returning False) fails the first test (records stay WRITING, resident); a restore that reads
the block before the landing is seen fails the ordering check of the second ("not ordered
before"); ``_staging_block`` overflowing at once fails the third (``staging_overflows == 1``);
the fallback without the copy back from staging fails the fourth ("no copy back").
"""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest
import torch

from ssdtrain_megatron import ActivationOffloader, OffloadConfig
from ssdtrain_megatron.cache.lifecycle import State
from ssdtrain_megatron.io import make_engine
from tests.faulty import FaultyEngine
from tests.gpu_scenes import SEEDS
from tests.recording_streams import Recorder, contains
from tests.test_staging_race import Logged, check_staging_reuse

NBYTES = 64 * 1024


def _plus_one(y, out, x) -> None:
    torch.add(x, 1, out=y)
    out.copy_(y)


def _seen(s, keep) -> None:
    keep.copy_(s)


class Saves(torch.autograd.Function):
    """y = x + 1, saved for backward; backward keeps a copy of what it got (``seen``). Every
    stream is deferred, the compute stream too: the kernels go through it
    (``Recorder.launch``), so the host never reads a tensor before its stream ran; ``seen``
    holds the bytes once every stream ran (``run_all``)."""

    @staticmethod
    def forward(ctx, x, rec, seen):
        y = rec.empty(x.numel(), x.dtype, x.device).view(x.shape)
        out = rec.empty(x.numel(), x.dtype, x.device).view(x.shape)
        rec.launch("produce", _plus_one, y, out, x)
        ctx.save_for_backward(y)
        ctx.rec, ctx.seen = rec, seen
        return out

    @staticmethod
    def backward(ctx, g):
        (s,) = ctx.saved_tensors
        keep = torch.empty(s.shape, dtype=s.dtype)
        ctx.rec.launch("consume", _seen, s, keep)
        ctx.seen.append(keep)
        return g, None, None


def _backward(y: torch.Tensor) -> None:
    """Backward from ``y`` with a gradient of ones (no host op reads ``y``)."""
    torch.autograd.backward(y, torch.ones(y.shape))


def _recorder() -> Recorder:
    return Recorder(poison=True, deferred_compute=True)


class Drive:
    """A real posix engine whose one IO thread can be held inside a write (``hold``), and
    whose writes can be made to fail (``fail``)."""

    def __init__(self) -> None:
        self.holding = False
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.fail = False

    def __call__(self, op, path, offset, nbytes):
        if op != "write":
            return None
        if self.holding:
            self.entered.set()
            assert self.gate.wait(60), "the drive was never let go"
        if self.fail:
            return OSError(errno.EIO, os.strerror(errno.EIO))
        return None


def _scene(tmp_path, seed=None, deferred_compute=False, **kw):
    """(recorder, drive, offloader); ``deferred_compute``: every stream deferred (this file's
    scenes, whose kernels are launched); left eager for tests/test_late_tail.py's, whose
    kernels run on the host when issued."""
    rec = Recorder(seed=seed, poison=True, deferred_compute=deferred_compute)
    drive = Drive()
    settings = dict(min_tensor_bytes=0, keep_last_layers=0, prefetch_layers=1, chunk_bytes=NBYTES, io_threads=1,
                    max_inflight_bytes=1 << 20, pinned_staging_bytes=1 << 20)
    config = OffloadConfig(dirs=[str(tmp_path)], engine="posix", **dict(settings, **kw))
    engine = Logged(FaultyEngine(make_engine(config), drive), rec, pooled=False)
    off = ActivationOffloader(config, device=torch.device("cpu"), engine=engine, streams=rec)
    return rec, drive, off


def _deferred(tmp_path, seed=None, **kw):
    return _scene(tmp_path, seed, deferred_compute=True, **kw)


def _save(off, rec, seen, name: str, value: float):
    x = torch.full((NBYTES // 4,), value).requires_grad_()
    with off.microbatch(name):
        return Saves.apply(x, rec, seen)


def _copies_back(rec, off):
    """The copies out of the staging pool onto the device (reads, and copies back from staging)."""
    staging = off.copy.pool._mem
    lo, hi = staging.data_ptr(), staging.data_ptr() + staging.numel()
    return [n for n in rec.nodes("copy") if contains((lo, hi), n.tags["src"])], (lo, hi)


def _check_copies_back(rec, off) -> int:
    """Every copy out of a staging block runs after the copy into it (and the block's reuse is
    ordered: check_staging_reuse); returns how many copies back there were."""
    backs, (lo, hi) = _copies_back(rec, off)
    outs = [n for n in rec.nodes("copy") if contains((lo, hi), n.tags["dst"])]
    for back in backs:
        into = [o for o in outs if o.idx < back.idx and o.tags["dst"] == back.tags["src"]]
        if into:  # (a read's block is filled by the engine, not by a copy)
            assert rec.happens_before(into[-1], back), f"{back} reads the block before {into[-1]} landed"
    check_staging_reuse(rec, off.copy.pool._mem)
    return len(backs)


def _bits(t: torch.Tensor):
    return t.view(torch.int32)


def _is(value: float, t: torch.Tensor) -> bool:
    return torch.equal(_bits(t), _bits(torch.full((NBYTES // 4,), value) + 1))


def test_device_memory_goes_when_the_copy_lands_not_when_the_drive_has_it(tmp_path):
    """The drive holds the first write; the three records' copies have landed: all STAGED,
    none resident, no device bytes in flight, each record's device bytes let go (after its
    copy), while no drive write has completed. Backward then reads them back from the drive,
    bitwise."""
    rec, drive, off = _deferred(tmp_path)
    seen = []
    try:
        drive.holding = True
        ys = [_save(off, rec, seen, n, v) for n, v in (("a", 1.0), ("b", 2.0), ("c", 3.0))]
        assert drive.entered.wait(60)
        rec.run_all()  # the GPU ran the three copies (the stand-in's streams run when they like)
        off.poll()
        states = [off.table.get(i).state_name for i in range(3)]
        assert [off.table.get(i).state for i in range(3)] == [State.STAGED] * 3, states
        assert off.step.counters.resident_bytes == 0 and off.transfers.inflight_bytes == 0
        assert not rec.nodes("disk_write"), "a drive write completed: the test did not hold it"
        assert len(rec.nodes("let_go")) >= 3
        drive.holding = False
        drive.gate.set()
        off.wait_writes()
        for y in reversed(ys):
            _backward(y)
        stats = off.end_step()
        assert stats.bytes_read == 3 * NBYTES and stats.tensors_from_staging == 0
        rec.run_all()  # the consumers' kernels ran: seen holds their bytes
        assert [_is(v, s) for v, s in zip((3.0, 2.0, 1.0), seen)] == [True] * 3
    finally:
        drive.gate.set()
        off.close()


@pytest.mark.parametrize("seed", SEEDS)
def test_a_record_wanted_during_its_drive_write_comes_back_from_its_staging_block(tmp_path, seed):
    """a's drive write is under way (held), b's queued behind it. Backward wants b: its write
    is taken back and its bytes copied back from its staging block (no drive read); then a:
    its write cannot be taken back, so it too is copied back from staging, and READY once
    the write ends. Each copy back is ordered after the copy into that block, the consumer
    after the copy back, and the blocks are reused only after both."""
    rec, drive, off = _deferred(tmp_path, seed)
    seen = []
    try:
        drive.holding = True
        ya = _save(off, rec, seen, "a", 1.0)
        assert drive.entered.wait(60)
        yb = _save(off, rec, seen, "b", 2.0)
        rec.run_all()  # the GPU ran both copies: b is STAGED once the poll sees it
        off.poll()
        _backward(yb)
        assert off.table.get(1) is None or off.table.get(1).state in (State.READY, State.RELEASED)
        _backward(ya)
        assert off.table.get(0).state == State.STAGED_WANTED
        drive.holding = False
        drive.gate.set()
        stats = off.end_step()
        assert stats.tensors_from_staging == 2 and stats.bytes_from_staging == 2 * NBYTES
        assert stats.writes_taken_back == 1 and stats.bytes_read == 0
        assert stats.bytes_offloaded == NBYTES  # a's write completed; b's was taken back
        rec.run_all()  # the consumers' kernels ran: seen holds their bytes
        assert _is(2.0, seen[0]) and _is(1.0, seen[1])
        backs, (lo, hi) = _copies_back(rec, off)
        outs = [n for n in rec.nodes("copy") if contains((lo, hi), n.tags["dst"])]
        assert len(backs) == 2, "no copy back from staging"
        for back in backs:
            into = [o for o in outs if o.idx < back.idx and o.tags["dst"] == back.tags["src"]][-1]
            assert rec.happens_before(into, back), f"{back} reads the block before {into} landed"
            consumer = [n for n in rec.nodes("consume") if n.idx > back.idx][0]
            assert rec.happens_before(back, consumer)
        assert check_staging_reuse(rec, off.copy.pool._mem) >= 0
    finally:
        drive.gate.set()
        off.close()


def test_a_full_staging_pool_makes_pack_wait_for_the_drive_not_overflow(tmp_path):
    """Two blocks of staging, the drive held on the first write: the third save waits (counted
    as IO wait) until a drive write frees a block, instead of taking pinned memory from torch's
    allocator (cudaHostAlloc on a GPU: synchronising, slow)."""
    rec, drive, off = _deferred(tmp_path, pinned_staging_bytes=2 * NBYTES)
    seen = []
    try:
        drive.holding = True
        ys = [_save(off, rec, seen, "a", 1.0)]
        assert drive.entered.wait(60)
        ys.append(_save(off, rec, seen, "b", 2.0))
        threading.Timer(0.3, drive.gate.set).start()
        t0 = time.monotonic()
        ys.append(_save(off, rec, seen, "c", 3.0))
        waited = time.monotonic() - t0
        drive.holding = False
        assert waited >= 0.2, f"the third save did not wait for room ({waited:.3f} s)"
        assert off.copy.staging_overflows == 0
        assert off.step.counters.io_wait_s >= 0.2
        off.wait_writes()
        for y in reversed(ys):
            _backward(y)
        off.end_step()
        rec.run_all()  # the consumers' kernels ran: seen holds their bytes
        assert [_is(v, s) for v, s in zip((3.0, 2.0, 1.0), seen)] == [True] * 3
    finally:
        drive.gate.set()
        off.close()


def test_with_nothing_in_flight_a_record_larger_than_the_pool_overflows_with_a_warning(tmp_path, caplog):
    rec, drive, off = _deferred(tmp_path, pinned_staging_bytes=NBYTES // 2)
    seen = []
    try:
        y = _save(off, rec, seen, "a", 1.0)
        off.wait_writes()
        _backward(y)
        off.end_step()
        assert off.copy.staging_overflows >= 1 and "Raise pinned_staging_bytes" in caplog.text
        rec.run_all()  # the consumers' kernels ran: seen holds their bytes
        assert _is(1.0, seen[0])
    finally:
        off.close()


def test_a_drive_write_that_fails_after_its_copy_landed_comes_back_from_staging(tmp_path):
    """The device memory went when the copy landed; the drive write then fails: the tensor is
    copied back from its staging block (the fallback: kept in memory), and backward gets its
    bytes."""
    rec, drive, off = _deferred(tmp_path)
    seen = []
    try:
        drive.holding = True
        y = _save(off, rec, seen, "a", 1.0)
        assert drive.entered.wait(60)
        off.poll()
        assert off.table.get(0).state == State.STAGED
        drive.fail = True
        drive.holding = False
        drive.gate.set()
        off.wait_writes()
        assert off.table.get(0).state == State.KEPT
        _backward(y)
        stats = off.end_step()
        assert stats.fallbacks == 1 and stats.bytes_offloaded == 0
        assert _copies_back(rec, off)[0], "no copy back from staging"
        rec.run_all()  # the consumers' kernels ran: seen holds their bytes
        assert _is(1.0, seen[0])
    finally:
        drive.gate.set()
        off.close()


@pytest.mark.parametrize("engine", ["memory", "tiered"])
def test_the_memory_engine_needs_no_io_thread_either_way(tmp_path, engine):
    """Writes into its pool complete when their copy lands (commit), reads are copies out of
    it issued at once: the engine is never handed a write or a read, and its meters still
    count both ways."""
    rec = _recorder()
    config = OffloadConfig(dirs=[str(tmp_path)], engine=engine, min_tensor_bytes=0, keep_last_layers=0,
                           prefetch_layers=4, host_memory_bytes=8 * NBYTES, pinned_staging_bytes=1 << 20)
    engine_ = Logged(make_engine(config), rec)
    seen = []
    with ActivationOffloader(config, device=torch.device("cpu"), engine=engine_, streams=rec) as off:
        ys = [_save(off, rec, seen, str(i), float(i)) for i in range(3)]
        off.wait_writes()
        for y in reversed(ys):
            _backward(y)
        stats = off.end_step()
    assert not rec.nodes("engine_write") and not rec.nodes("engine_read")
    assert stats.bytes_offloaded == stats.bytes_read == 3 * NBYTES
    assert stats.write_gbps > 0 and stats.read_gbps > 0
    rec.run_all()  # the consumers' kernels ran: seen holds their bytes
    assert [_is(v, s) for v, s in zip((2.0, 1.0, 0.0), seen)] == [True] * 3


def test_writes_backward_wanted_before_their_copy_landed_are_not_started_in_the_next_step(tmp_path):
    """A GPU far behind the host (the offload stream's events never answer done: nothing lands
    before backward) and the drive held through backward: in the first step backward wants
    the later layers' records before their copies landed (each counted in its layer's
    ``late_writes``); from the next step the offloader defers those layers' writes like the
    last layer's, so they are kept for the backward that follows at once instead of copied
    out for nothing. Broken variant: ``Decisions.learn`` not growing ``late_tail`` leaves
    the second step writing the same layers ("written again")."""
    rec, drive, off = _deferred(tmp_path, keep_last_layers=1)
    rec.unobserved.add(off.copy.offload_stream.name)
    try:
        kept = []
        for step in range(2):
            drive.holding = True
            drive.gate.clear()
            x = torch.randn(64, 3 * 128, generator=torch.Generator().manual_seed(step)).requires_grad_()
            with off.microbatch(0):
                h = x
                for i in range(4):
                    with off.layer(i):
                        h = Saves.apply(h, rec, [])
            _backward(h)
            del h
            drive.holding = False
            drive.gate.set()
            stats = off.end_step()
            late = {r.layer: r.late_writes for r in stats.layers}
            kept.append(stats.tensors_kept)
            if step == 0:
                assert late["2"] > 0, late
                first_tail = off._decisions.late_tail
                # Nothing landed: no record may come back from a block its copy has not filled.
                _check_copies_back(rec, off)
        assert first_tail >= 2 and kept[1] > kept[0], f"written again: kept {kept}, tail {first_tail}"
        assert not any(r.late_writes for r in stats.layers)
    finally:
        drive.gate.set()
        off.close()


@pytest.mark.parametrize("seed", SEEDS)
def test_read_ahead_leaves_a_write_whose_copy_has_not_landed(tmp_path, seed):
    """Read-ahead does not take from memory a record whose device->host copy is still running
    (issue 54, break 3): with the offload stream never seen to finish and the drive held
    inside layer 0's write, layers 1 and 2's writes are taken back (``cancel``) only when
    backward itself reaches them, after the consumers of the layers above. Broken variant:
    the refusal in ``Transfers._wanted_while_writing`` (``elif ahead: return False``)
    removed: read-ahead takes layer 2's write back before layer 3's consumer ran."""
    rec, drive, off = _deferred(tmp_path, seed, keep_last_layers=1, prefetch_layers=1)
    rec.unobserved.add(off.copy.offload_stream.name)
    try:
        drive.holding = True
        x = torch.randn(64, 3 * 128, generator=torch.Generator().manual_seed(0)).requires_grad_()
        with off.microbatch(0):
            h = x
            for i in range(4):
                with off.layer(i):
                    h = Saves.apply(h, rec, [])  # records 0, 1, 2 (layer 3 is kept)
        assert drive.entered.wait(60), "layer 0's write never reached the drive"
        _backward(h)
        del h
        drive.holding = False
        drive.gate.set()
        off.end_step()
        taken = [n for n in rec.nodes("engine_cancel") if n.tags["taken"]]
        assert sorted(n.tags["key"] for n in taken) == [1, 2], taken
        for n in taken:
            above = sum(1 for m in rec.log[:n.idx] if m.kind == "consume")
            assert above == 3 - n.tags["key"], (
                f"layer {n.tags['key']}'s write was taken back after {above} consumers, before backward "
                f"reached it: read-ahead took a record whose copy had not landed")
    finally:
        drive.gate.set()
        off.close()
