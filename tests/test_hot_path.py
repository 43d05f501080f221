"""The offloader's hot path: what IO threads may hold, how their errors reach the training
thread, and what each tensor is counted as (issue 14's defects 1-3, each a regression test
that failed before its fix)."""

from __future__ import annotations

import gc
import threading
import time
from typing import List

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from ssdtrain_megatron import ActivationOffloader
from ssdtrain_megatron.cache.record import TensorRecord
from ssdtrain_megatron.io.memory import PoolFull
import tests.test_engines as engine_suite
from tests.faulty import FaultyEngine, HeldWrites, faulty_offloader
from tests.test_engines import ALL, _param
from tests.test_offloader import cfg, files_under

MIB16 = 16 << 20
open_engine = engine_suite.open_engine  # the engine suite's fixture


def _gone(ref: StorageWeakRef, poll=None) -> bool:
    """Whether the storage is freed; IO threads get a moment to come back to their queue
    (the regression kept it alive for good, so a short grace does not hide it)."""
    for _ in range(50):
        if poll is not None:
            poll()
        gc.collect()
        if ref.expired():
            return True
        time.sleep(0.02)
    return False


# -- defect 1: IO worker threads kept the last tensor they handled alive ---------------------


@pytest.mark.parametrize("queue_api", [False, True], ids=["futures", "completions"])
@pytest.mark.parametrize("name", [_param(n) for n in ALL])
def test_io_threads_do_not_keep_a_written_and_read_tensor_alive(open_engine, name, queue_api):
    engine = open_engine(name, host_memory_bytes=64 << 20 if name != "tiered" else 0)
    done = None
    if queue_api:
        import queue

        done = engine.completions = queue.SimpleQueue()
    data = torch.randint(0, 256, (MIB16,), dtype=torch.uint8)
    out = torch.empty_like(data)
    refs = [StorageWeakRef(data.untyped_storage()), StorageWeakRef(out.untyped_storage())]
    fut = engine.write(0, data)
    assert (done.get(timeout=30) == (0, None)) if queue_api else fut.result(30) == MIB16
    fut = engine.read(0, out)
    assert (done.get(timeout=30) == (0, None)) if queue_api else fut.result(30) == MIB16
    assert torch.equal(out, data)
    del data, out, fut
    assert _gone(refs[0]), f"{name}: a thread still holds the 16 MiB tensor that was written"
    assert _gone(refs[1]), f"{name}: a thread still holds the 16 MiB tensor that was read into"


def test_an_offloaded_tensor_is_freed_once_written_and_dropped(offload_dir):
    """What defect 1 looked like to a user: 16 MiB written, waited for and dropped by the
    model, still alive (and uncounted in peak_resident_bytes)."""
    with ActivationOffloader(cfg(offload_dir, keep_last_layers=0)) as off:
        x = torch.randn(MIB16 // 4, requires_grad=True)
        with off.microbatch(0):
            a = x.mul(2)
            b = a.sin()  # saves a
        ref = StorageWeakRef(a.untyped_storage())
        off.wait_writes()
        del a, b
        assert _gone(ref, off.wait_writes)  # wait_writes also processes dropped handles
        st = off.end_step()
    assert st.bytes_offloaded == MIB16 and st.bytes_read == 0


# -- defect 2: errors in completion handling were dropped; engine bugs became "fallbacks" ----


class OutOfMemory(RuntimeError):
    pass


def test_an_error_finishing_a_read_reaches_backward_unchanged_at_once(offload_dir, monkeypatch):
    """finish_read raising (say, out of memory) must surface in backward as that very error,
    not as an IOTimeout io_timeout_s later (it was raised on an IO thread and lost)."""
    error = OutOfMemory("CUDA out of memory (test)")

    def finish_read(self):
        raise error

    monkeypatch.setattr(TensorRecord, "finish_read", finish_read)
    lin = nn.Linear(256, 256)
    with ActivationOffloader(cfg(offload_dir, keep_last_layers=0, io_timeout_s=5)) as off:
        with off.microbatch(0):
            out = lin(torch.randn(64, 256)).sin()
        off.wait_writes()
        t0 = time.monotonic()
        with pytest.raises(OutOfMemory) as info:
            out.sum().backward()
        assert info.value is error
        assert time.monotonic() - t0 < 4, "waited for a timeout instead of raising at once"
        monkeypatch.undo()  # other reads (prefetched) finish normally from here on
        del out
        off.end_step()
    assert files_under(offload_dir) == []


def test_a_bug_in_the_engine_write_propagates_instead_of_falling_back(offload_dir, monkeypatch, caplog):
    lin = nn.Linear(256, 256)
    with ActivationOffloader(cfg(offload_dir, keep_last_layers=0)) as off:
        def broken(key, data, event=None):
            raise TypeError("engine bug (test)")

        monkeypatch.setattr(off.engine, "write", broken)
        with pytest.raises(TypeError, match="engine bug"):
            with off.microbatch(0):
                lin(torch.randn(64, 256)).sin()
    assert "fallback" not in caplog.text


def test_a_full_memory_pool_still_falls_back_to_keeping_the_tensor(offload_dir, monkeypatch):
    lin = nn.Linear(256, 256)
    x = torch.randn(64, 256)
    ref = lin(x).sin().sum()
    ref.backward()
    ref_grad = lin.weight.grad.clone()
    lin.weight.grad = None
    with ActivationOffloader(cfg(offload_dir, keep_last_layers=0)) as off:
        def full(key, data, event=None):
            raise PoolFull("host memory pool full (test)")

        monkeypatch.setattr(off.engine, "write", full)
        with off.microbatch(0):
            out = lin(x).sin().sum()
        out.backward()
        st = off.end_step()
    assert st.fallbacks == st.tensors_kept == 2 and st.bytes_offloaded == 0  # input and output of lin
    assert torch.equal(lin.weight.grad.view(torch.int32), ref_grad.view(torch.int32))


# -- defect 3: tensors_forwarded counted twice -----------------------------------------------


class WriteGate:
    """A fault hook that holds every write until opened (writes in flight as long as we like)."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.entered = threading.Event()  # an IO thread holds a write here

    def __call__(self, op, path, offset, nbytes):
        if op == "write":
            self.entered.set()
            self.open.wait(60)
        return None


def test_a_tensor_forwarded_while_its_write_is_in_flight_counts_once(offload_dir):
    """Unpacked while its write is in flight (forwarded from memory), and still referenced
    when the write completes: one forward, not two (2 tensors reported 4 before)."""
    lin = nn.Linear(256, 256)
    with faulty_offloader(cfg(offload_dir, keep_last_layers=0)) as off:
        gate = off.engine.fault = WriteGate()
        x = torch.randn(64, 256, requires_grad=True)
        with off.microbatch(0):
            h = lin(x)
            out = (h.sin() * h.cos()).sum()  # saves h twice (deduplicated) and sin/cos outputs
            del h
        # An IO thread must have taken a write before backward asks for it (else every write is
        # still queued, and backward takes them all back: nothing is in flight to forward).
        assert gate.entered.wait(30)
        torch.autograd.grad(out, [x], retain_graph=True)  # unpacks while the writes are held
        gate.open.set()
        off.wait_writes()
        torch.autograd.grad(out, [x])
        del out
        st = off.end_step()
    # The write the gate holds completes; writes still queued behind it were taken back when
    # backward wanted their tensors (tests/test_held.py). Each tensor is forwarded once.
    assert st.tensors_offloaded >= 1
    assert st.tensors_offloaded + st.writes_taken_back >= 2
    assert st.tensors_forwarded == st.tensors_offloaded + st.writes_taken_back, st
    assert st.bytes_read == 0


# -- reads before writes; writes of released tensors are cancelled ----------------------------


# posix: its queue is ours, and reads are served first. aio's writes race each other across
# lanes (seen: [1, 2, 0, 3]), so this order is not its claim; its reads have lanes of their own
# (the next test).
@pytest.mark.parametrize("name", [_param(n) for n in ("posix",)])
def test_a_read_never_waits_behind_queued_writes(open_engine, name):
    # One chunk each: queued writes cannot merge into the run the held write is in.
    early, rest, out, data = _read_while_writes_are_held(open_engine(name, io_threads=1),
                                                         read_may_finish_early=False)
    keys = [k for k, _ in early + rest]
    assert keys.index(0) < keys.index(2) and keys.index(0) < keys.index(3), keys
    assert torch.equal(out, data)


def _read_while_writes_are_held(engine, read_may_finish_early: bool = True):
    """Writes 1-3 held (the first inside its IO, the others queued behind it), then a read of
    key 0: returns the completions reported before the writes were let go (looked for only when
    ``read_may_finish_early``: else the wait would only cost its timeout), those after, the
    bytes read and the bytes written."""
    import queue

    done = engine.completions = queue.SimpleQueue()
    gate = HeldWrites()
    engine = FaultyEngine(engine, gate)
    data = torch.randint(0, 256, (engine_suite.CHUNK,), dtype=torch.uint8)
    engine.write(0, data)
    assert done.get(timeout=30) == (0, None)
    gate.held = True
    for key in (1, 2, 3):
        engine.write(key, data.clone())
    assert gate.entered.wait(30)
    out = torch.empty_like(data)
    engine.read(0, out)
    early = []
    try:
        if read_may_finish_early:
            early = [done.get(timeout=30)]  # the read, or nothing: every write is still held
    except queue.Empty:
        pass
    finally:
        gate.go.set()
    rest = [done.get(timeout=30) for _ in range(4 - len(early))]
    assert all(exc is None for _, exc in early + rest), early + rest
    return early, rest, out, data


# aio: reads have their own lanes (own aio_handle each, since wait() waits for every operation
# of its handle), so a read does not even wait for the write in flight: it completes while every
# write is still held. (The same check on posix with one IO thread fails by design: that thread
# is inside the held write; there the guarantee is the order above.)
@pytest.mark.parametrize("name", [_param("aio")])
def test_an_aio_read_completes_while_every_write_is_held(open_engine, name):
    early, _, out, data = _read_while_writes_are_held(open_engine(name, io_threads=1))
    assert early == [(0, None)], early
    assert torch.equal(out, data)


def test_a_queued_write_of_a_released_tensor_is_cancelled(offload_dir):
    lin = nn.Linear(256, 256)
    with faulty_offloader(cfg(offload_dir, keep_last_layers=0, io_threads=1)) as off:
        gate = off.engine.fault = HeldWrites()
        gate.held = True
        with off.microbatch(0):
            outs = [lin(torch.randn(64, 256)).sin()]  # 2 saved tensors
            # The first write holds the only IO thread (with the second, if it was queued in
            # time to join the same run); everything saved from here on waits in the queue.
            assert gate.entered.wait(30)
            outs += [lin(torch.randn(64, 256)).sin() for _ in range(2)]  # 4 more
        # Backward uses every tensor from memory and then drops it: each record is released
        # while its write is in flight; the 4 later writes are still queued.
        torch.stack(outs).sum().backward()
        del outs
        off.poll()
        gate.go.set()
        st = off.end_step()
    assert 1 <= st.tensors_offloaded <= 2, st  # the held run; the 4 queued writes cancelled
    assert st.tensors_forwarded == 6 and st.bytes_read == 0
    assert sum(layer.tensors for layer in st.layers) == 6
    assert st.bytes_offloaded == st.tensors_offloaded * 64 * 256 * 4
    assert st.bytes_on_disk == 0 and st.fallbacks == 0
    assert files_under(offload_dir) == []


# -- the pack hook: no torch call while IO threads run ---------------------------------------


class _Ops(TorchDispatchMode):
    """Records every torch operator dispatched on this thread while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: List[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("policy", ["offload", "keep"])
def test_the_pack_of_an_offloaded_activation_makes_no_torch_call(offload_dir, policy):
    """A torch call (detach, view) releases the GIL, and in the pack hook each release lets a
    waiting IO thread take the interpreter from the training thread. Offloading a dense
    activation makes none: the engine takes the byte view on its own thread (io/base.py),
    and the record holds the tensor itself until its write completes (record.py). Keeping
    one makes exactly one, the detach of the alias that keeps no graph alive."""
    with ActivationOffloader(cfg(offload_dir, keep_last_layers=0, policy=policy)) as off:
        x = torch.randn(256, 256, requires_grad=True)
        with off.microbatch(0):
            a = x.mul(2)
            with _Ops() as seen:
                handle = off.hooks.pack(a)
        assert seen.ops == ([] if policy == "offload" else ["aten.detach.default"]), seen.ops
        b = a.detach().clone()
        del a
        off.wait_writes()
        out = off.hooks.unpack(handle)
        assert out.grad_fn is None and torch.equal(out.view(torch.int32), b.view(torch.int32))
        del handle, out
        st = off.end_step()
    expected = 256 * 256 * 4 if policy == "offload" else 0
    assert st.bytes_offloaded == expected and st.bytes_read == expected  # read back from the engine


def test_a_graph_dropped_without_backward_is_freed_once_its_writes_complete(offload_dir):
    """An offloaded record holds the saved tensor itself while its write is in flight. A
    tensor saved by the op that made it (tanh saves its output) then forms a cycle with its
    graph (tensor -> grad_fn -> handle -> record -> tensor): a graph dropped without backward
    stays alive until that write completes (never past the step's end), and is written
    instead of cancelled. A backward releases saved tensors as usual (the test above)."""
    lin = nn.Linear(256, 256)
    with faulty_offloader(cfg(offload_dir, keep_last_layers=0, io_threads=1)) as off:
        gate = off.engine.fault = HeldWrites()
        gate.held = True
        with off.microbatch(0):
            out = lin(torch.randn(64, 256)).tanh()  # saves the input, and its own output
        ref = StorageWeakRef(out.untyped_storage())
        del out  # no backward
        assert gate.entered.wait(30)  # the input's write holds the only IO thread
        off.poll()
        gc.collect()
        assert not ref.expired()  # held by its record: its write is queued
        gate.go.set()
        assert _gone(ref, off.poll)  # written: the record lets go, and the graph goes with it
        st = off.end_step()
    assert st.tensors_offloaded == 2 and st.bytes_on_disk == 0
    assert files_under(offload_dir) == []

