"""A pinned staging block is handed out again only after every copy into or out of it ran.

The hazard (issue 24, 1.1): the device->host copy of an offloaded tensor into a staging block
is asynchronous (offload stream). Normally an IO thread waits for its event before the engine
reads the block, and only then does the block go back to the pool. Three paths give the block
back although no thread ever waited for that copy:

- **cancel**: a dropped graph releases a tensor whose write no IO thread started;
  ``engine.cancel`` takes the write back (cache/transfers.py ``_release``); or backward needs
  such a tensor, and the write is taken back to serve it from memory (``_wanted_while_writing``);
- **PoolFull**: the memory engine refuses the write (``_submit``, expected refusal);
- **engine error**: ``engine.write`` raises (``_submit``, an engine bug).

If the pool hands that block to the next ``stage_in``, an IO thread reads disk bytes into it,
and the stale copy lands on top: the restored tensor gets the other tensor's bytes, silently.

The CPU tests run the real offloader, real engines and files, with the recording stand-in for
CUDA streams and events (tests/recording_streams.py): copies happen at once there, so the
hazard is checked as ordering: every operation that writes into a staging byte range (a copy
into it, or an engine read into it, logged at submission by :class:`Logged`) must be ordered,
by the CUDA programming model's rules alone, after every earlier copy into or out of that
range. The tests marked ``cuda`` run the same three paths on real streams, with the compute
stream delayed by ``torch.cuda._sleep`` (and the reload copy delayed longer), never calling
``wait_writes()``: there the stale copy really lands, and the restored bytes are compared as
integers.

Before the fix (``DeviceCopy.written`` gave the block back with no event) the three CPU tests
fail with ``staging reuse: #.. copy@s0 ... is not ordered before #.. engine_read@host``.
"""

from __future__ import annotations

import threading
import time
from typing import Dict, List, Optional

import pytest
import torch

from ssdtrain_megatron import ActivationOffloader, OffloadConfig
from ssdtrain_megatron.cache.record import State
from ssdtrain_megatron.io import IOEngine, make_engine
from tests.faulty import FaultyEngine
from tests.forwarding import ForwardingEngine
from tests.gpu_scenes import SEEDS
from tests.recording_streams import Recorder, _range, overlaps
from tests.staging_checks import check_staging_reuse  # noqa: F401 - other tests import it from here

CUDA = torch.cuda.is_available()
NBYTES = 64 * 1024  # one staging block; every tensor of these tests has this size
OPS = ["stand-in", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not CUDA, reason="needs a CUDA device")])]


class Logged(ForwardingEngine):
    """A real engine, with each submission logged as a host operation (key, the memory it
    reads from or writes into), and, for the engine-error path, a synchronous failure of
    ``write`` for chosen keys (``refuse``): what an engine bug looks like to the offloader.
    Everything else, ``cancel`` and ``completions`` included, is the inner engine's
    (tests/forwarding.py)."""

    _own = ("rec", "refuse", "pooled")

    def __init__(self, inner: IOEngine, rec: Recorder, pooled: bool = True) -> None:
        super().__init__(inner)
        self.rec, self.refuse = rec, {}
        self.pooled = pooled  # False: hide the engine's pool_view
        inner.tracer = rec.tracer  # each chunk at the file, after its submission
        if hasattr(inner, "memory"):  # tiered: both tiers trace
            inner.memory.tracer = inner.ssd.tracer = rec.tracer

    def __setattr__(self, name, value):
        # The completion queue through the recorder: each report is ordered before what the
        # offloader does once it took it (recording_streams.py).
        super().__setattr__(name, self.rec.completions(value) if name == "completions" else value)

    def write(self, key, data, ready_event=None):
        self.rec.host("engine_write", key=key, ptr=_range(data))
        if key in self.refuse:
            raise self.refuse[key]
        return self.inner.write(key, data, ready_event)

    def read(self, key, out, ready_event=None):
        self.rec.host("engine_read", key=key, ptr=_range(out))
        return self.inner.read(key, out, ready_event)

    def cancel(self, key):
        taken = self.inner.cancel(key)
        self.rec.host("engine_cancel", key=key, taken=taken)
        return taken

    def pool_view(self, key, nbytes):
        return self.inner.pool_view(key, nbytes) if self.pooled else None

    def pool_view_of(self, key):
        return self.inner.pool_view_of(key) if self.pooled else None


class SlowReload(Recorder):
    """Real streams; the reload stream's copies start ``reload_delay_s`` late, so that a stale
    device->host copy into the same staging block (delayed behind the compute stream's sleep)
    lands between the engine's read into the block and the copy out of it."""

    def __init__(self, delay_s: float, reload_delay_s: float) -> None:
        from ssdtrain_megatron.cache.device_copy import CudaStreams

        super().__init__(inner=CudaStreams(), delay_s=delay_s)
        self.reload_delay_s = reload_delay_s
        self.reload_name: Optional[str] = None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.current_stream(dst.device if dst.device.type != "cpu" else src.device).name == self.reload_name:
            torch.cuda._sleep(int(self.reload_delay_s * 1e9))
        dst.copy_(src, non_blocking=True)
        self._stream_op(self.current_stream(dst.device if dst.device.type != "cpu" else src.device),
                        "copy", dst=_range(dst), src=_range(src))


class Saves(torch.autograd.Function):
    """y = x + 1, saved for backward; backward logs its use and keeps a copy of what it got."""

    @staticmethod
    def forward(ctx, x, rec, seen):
        y = x + 1
        rec.kernel("produce", y)
        ctx.save_for_backward(y)
        ctx.rec, ctx.seen = rec, seen
        return y * 1

    @staticmethod
    def backward(ctx, g):
        (s,) = ctx.saved_tensors
        ctx.rec.kernel("consume", s)
        ctx.seen.append(s.clone())
        return g * 1, None, None


def _config(tmp_path, engine: str, **kw) -> OffloadConfig:
    return OffloadConfig(dirs=[str(tmp_path)], engine=engine, min_tensor_bytes=0, keep_last_layers=0,
                         prefetch_layers=1, chunk_bytes=NBYTES, max_inflight_bytes=1 << 20,
                         pinned_staging_bytes=1 << 20, **kw)


def _settle(off: ActivationOffloader, rid: int, state: int = State.ON_DISK, timeout: float = 30.0) -> None:
    """Process IO completions until record ``rid`` reached ``state`` (no wait_writes())."""
    deadline = time.monotonic() + timeout
    while off.table.get(rid).state != state:
        assert time.monotonic() < deadline, f"record {rid} stuck in {off.table.get(rid).state_name}"
        off.poll()
        time.sleep(0.002)


def _open_after_read_of(s: "Scene", key: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not s.rec.nodes("engine_read", key=key) and time.monotonic() < deadline:
        time.sleep(0.001)
    s.gate.set()


class Scene:
    """One offloader on a logged real engine, the streams of ``ops`` and tensors of NBYTES."""

    def __init__(self, tmp_path, ops: str, engine: str, pooled: bool = True, pace: float = 0.3, **kw) -> None:
        self.cuda = ops == "cuda"
        if self.cuda:
            self.device = torch.device("cuda", torch.cuda.current_device())
            # _sleep counts GPU cycles (about 0.5 ns each): the compute stream sleeps ~0.25 s
            # before each producer, the reload stream ~0.1 s before each copy.
            self.rec: Recorder = SlowReload(delay_s=0.5, reload_delay_s=0.2)
        else:
            self.device = torch.device("cpu")
            self.rec = Recorder(pace=pace)
        self.config = _config(tmp_path, engine, **kw)
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.gating = False
        inner = make_engine(self.config)
        if engine == "posix":
            inner = FaultyEngine(inner, self._fault)
        self.engine = Logged(inner, self.rec, pooled)
        self.off = ActivationOffloader(self.config, device=self.device, engine=self.engine, streams=self.rec)
        if self.cuda:
            self.rec.reload_name = self.off.copy.reload_stream.name
        self.seen: List[torch.Tensor] = []
        self.expected: Dict[str, torch.Tensor] = {}

    def _fault(self, op, path, offset, nbytes):
        if op == "write" and self.gating:  # hold the IO thread: writes queued behind it stay unstarted
            self.entered.set()
            assert self.gate.wait(60), "gate never opened"
        return None

    def a_on_disk_d_held_b_queued(self):
        """a (record 0) written and settled, its block back in the pool (its IO thread waited);
        d (1) being written by the one IO thread, held there; b (2) queued behind it, so that
        no thread ever waits for b's copy. Returns the three outputs."""
        ya = self.save("a", 1.0)
        _settle(self.off, 0)
        self.gating = True
        yd = self.save("d", 2.0)
        assert self.entered.wait(60)
        self.gating = False
        return ya, yd, self.save("b", 3.0)

    def read_a_while_d_is_held_then_finish(self, ya: torch.Tensor, yd: torch.Tensor, then=None) -> None:
        """a's read takes a staging block while d still holds another one (b's may be reused
        only after b's copy), then waits behind d in the one IO thread; d is let go as soon as
        a's read was handed to the engine. Then d's backward, ``then()``, and the ordering
        check, which must have checked some reuse of a block on the stand-in."""
        opener = threading.Thread(target=_open_after_read_of, args=(self, 0))
        opener.start()
        ya.sum().backward()
        opener.join()
        self.restored_bytes_match("a")
        yd.sum().backward()
        if then is not None:
            then()
        pairs = self.finish()
        if not self.cuda:
            assert pairs > 0, "the scenario never reused a staging block (nothing was checked)"

    def save(self, name: str, value: float) -> torch.Tensor:
        """Forward of one tensor saved for backward; returns the output whose backward unpacks it."""
        x = torch.full((NBYTES // 4,), value, device=self.device).requires_grad_()
        with self.off.microbatch(name):
            y = Saves.apply(x, self.rec, self.seen)
        # Computed on the host: a device->host copy here would wait for the delayed stream.
        self.expected[name] = torch.full((NBYTES // 4,), value) + 1
        return y

    def restored_bytes_match(self, name: str) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        got = self.seen[-1].cpu()
        assert torch.equal(got.view(torch.int32), self.expected[name].view(torch.int32)), (
            f"{name} came back with other bytes: first word {got.view(torch.int32)[0]:#x}, "
            f"expected {self.expected[name].view(torch.int32)[0]:#x}")

    def finish(self) -> int:
        """Checks the ordering; returns how many cross-agent reuses of staging it checked."""
        try:
            self.off.end_step()
            if self.cuda:
                torch.cuda.synchronize()
            return check_staging_reuse(self.rec, self.off.copy.pool._mem)
        finally:
            self.gate.set()
            self.off.close()


@pytest.mark.parametrize("ops", OPS)
def test_a_cancelled_write_returns_its_staging_only_after_its_copy(tmp_path, ops):
    """Backward releases a tensor whose write never started (``engine.cancel``): its staging
    block must not be read into before its device->host copy ran."""
    s = Scene(tmp_path, ops, "posix", io_threads=1)
    ya, yd, yb = s.a_on_disk_d_held_b_queued()
    del yb  # b's graph goes: its handle drops, its unstarted write is cancelled
    s.off.poll()
    assert 2 not in s.off.table, "b's write was not taken back by cancel()"
    s.read_a_while_d_is_held_then_finish(ya, yd)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_cancelled_writes_copy_event_is_not_reused_before_its_copy_ran(tmp_path, monkeypatch, seed):
    """The cancel scene with one more save between the cancel and a's read: that save's
    producer and copy events come from the event pool. b's copy event still fences b's block
    (its copy never seen to land), so it must not be in that pool: re-recorded on the compute
    stream, it would answer done for that point and hand b's block to a's read before b's copy
    ran. Broken variant: ``DeviceCopy.written`` recycling the copy event whether or not it
    landed: "a came back with other bytes" or "staging reuse ... is not ordered before"."""
    monkeypatch.setenv("SSDTRAIN_STANDIN_SEED", str(seed))
    # pace 0: the offload stream runs only when something waits for it, so b's copy has not
    # run by chance when e's events are recorded (the seeds still vary what runs at a wait)
    s = Scene(tmp_path, "stand-in", "posix", pace=0.0, io_threads=1)
    ya, yd, yb = s.a_on_disk_d_held_b_queued()
    del yb  # b's graph goes: its handle drops, its unstarted write is cancelled
    s.off.poll()
    assert 2 not in s.off.table, "b's write was not taken back by cancel()"
    ye = s.save("e", 5.0)  # queued behind d too

    def e_backward():
        ye.sum().backward()
        s.restored_bytes_match("e")

    s.read_a_while_d_is_held_then_finish(ya, yd, e_backward)


@pytest.mark.parametrize("ops", OPS)
def test_a_write_backward_takes_back_returns_its_staging_only_after_its_copy(tmp_path, ops):
    """The second cancel path (cache/transfers.py ``_wanted_while_writing``): backward needs a
    tensor whose write no IO thread has started; the write is taken back and the tensor served
    from memory. Its staging block goes back to the pool with its copy event, and the read
    that comes next (a's, while d still holds a block) must not get that block before the
    copy ran. With the event dropped on this path (``rec.transfer.copy_event = None`` before
    ``_written``) the stand-in fails with ``staging reuse: #.. copy@s1 ... is not ordered
    before #.. engine_read@host``."""
    s = Scene(tmp_path, ops, "posix", io_threads=1)
    ya, yd, yb = s.a_on_disk_d_held_b_queued()
    yb.sum().backward()  # backward wants b now: its unstarted write is taken back
    assert [n.tags["taken"] for n in s.rec.nodes("engine_cancel", key=2)] == [True], \
        "b's write was not taken back by backward (the path under test did not run)"
    s.restored_bytes_match("b")
    s.read_a_while_d_is_held_then_finish(ya, yd)


def test_close_waits_for_a_cancelled_writes_copy_before_the_staging_pool_is_released(tmp_path):
    """A write taken back by ``cancel`` gives its staging block back with a copy event no IO
    thread waited for; ``close()`` right after must not release (unregister, unmap) the pinned
    pool before that copy ran: every copy into or out of the pool is ordered before the
    stand-in's ``unpin`` of it. Before the fix (DeviceCopy had no close) the pool went with
    the offloader, and the cancelled copy was not ordered before the ``unpin``."""
    import gc

    s = Scene(tmp_path, "stand-in", "posix", io_threads=1)
    ya, yd, yb = s.a_on_disk_d_held_b_queued()
    del yb  # cancelled: its block goes back with b's copy event, pending
    s.off.poll()
    assert 2 not in s.off.table, "b's write was not taken back by cancel()"
    pool = _range(s.off.copy.pool._mem)
    s.gate.set()
    del ya, yd
    s.off.close()
    s.off = None
    gc.collect()
    (unpin,) = [n for n in s.rec.nodes("unpin") if n.tags["ptr"] == pool]
    copies = [n for n in s.rec.nodes("copy") if overlaps(n.tags["dst"], pool) or overlaps(n.tags["src"], pool)]
    assert len(copies) == 3
    for c in copies:
        assert s.rec.happens_before(c, unpin), f"the pinned pool was released before {c} ran"


@pytest.mark.parametrize("ops", OPS)
def test_a_write_refused_by_a_full_host_pool_returns_its_staging_only_after_its_copy(tmp_path, ops):
    """The memory engine refuses a write (``PoolFull``): the tensor stays in memory, and its
    staging block must not be read into before its device->host copy ran. The engine's
    ``pool_view`` is hidden (an engine without one, as the memory engine was before it copied
    device -> pool directly): with it, the refusal comes before any copy (the test below)."""
    s = Scene(tmp_path, ops, "memory", pooled=False, host_memory_bytes=NBYTES)
    ya = s.save("a", 1.0)
    _settle(s.off, 0)  # a fills the pool
    yb = s.save("b", 3.0)  # refused: kept in memory (a fallback), its staging given back
    assert s.off.table.get(1).state == State.KEPT
    ya.sum().backward()
    s.restored_bytes_match("a")
    yb.sum().backward()
    pairs = s.finish()
    if ops == "stand-in":
        assert pairs > 0, "the scenario never reused a staging block (nothing was checked)"


def test_with_pool_view_a_full_host_pool_refuses_before_any_copy(tmp_path):
    s = Scene(tmp_path, "stand-in", "memory", host_memory_bytes=NBYTES)
    ya = s.save("a", 1.0)
    _settle(s.off, 0)
    copies = len(s.rec.nodes("copy"))
    yb = s.save("b", 3.0)
    assert s.off.table.get(1).state == State.KEPT
    assert len(s.rec.nodes("copy")) == copies, "b was copied although the pool had no room for it"
    ya.sum().backward()
    s.restored_bytes_match("a")
    yb.sum().backward()
    s.finish()


@pytest.mark.parametrize("ops", OPS)
def test_a_write_the_engine_raised_on_returns_its_staging_only_after_its_copy(tmp_path, ops):
    """``engine.write`` raises (an engine bug; the caller sees the error): the staging block
    the copy went into must not be read into before that copy ran."""
    s = Scene(tmp_path, ops, "posix")
    ya = s.save("a", 1.0)
    _settle(s.off, 0)
    s.engine.refuse[1] = RuntimeError("stand-in engine bug")
    with pytest.raises(RuntimeError, match="stand-in engine bug"):
        s.save("b", 3.0)
    ya.sum().backward()
    s.restored_bytes_match("a")
    pairs = s.finish()
    if ops == "stand-in":
        assert pairs > 0, "the scenario never reused a staging block (nothing was checked)"


def test_the_pool_hands_out_a_block_only_once_its_event_completed_without_waiting():
    """A block given back with an event that has not completed is never handed out, whatever
    else is pending (no head-of-line blocking either); the pool never synchronizes."""
    from ssdtrain_megatron.cache.device_copy import StagingPool

    rec = Recorder()
    pool = StagingPool(3 * 4096, rec)
    a, b, c = pool.take(4096), pool.take(4096), pool.take(4096)
    slow, fast = rec.new_event(), rec.new_event()
    # A copy that has not run: its event recorded on a stream the host never sees finish (an
    # event never recorded would be done, as CUDA answers for one).
    behind = rec.new_stream(torch.device("cpu"))
    rec.unobserved.add(behind.name)
    slow.record(behind)
    pool.give(a, after=slow)
    pool.give(b, after=fast)
    fast.record(rec.default)
    d = pool.take(4096)
    assert d.offset == b.offset, "the completed block behind a pending one was not reclaimed"
    e = pool.take(4096)
    assert e.offset is None, "a block whose copy may still run was handed out"
    assert not rec.nodes("synchronize")
    del c
