"""A recording stand-in for CUDA streams, events and copies, and a happens-before checker.

What it checks is OUR ordering logic (cache/device_copy.py and the offloader's calls into it),
not CUDA: the stand-in models a GPU the way the CUDA programming model defines one and logs
every operation, and the checker asks whether, by those rules alone, one operation is
guaranteed to happen before another:

- operations on one stream run in issue order, and each runs after the host issued it;
- ``stream.wait_event(e)`` orders the stream's later operations after ``e``'s record point;
- ``e.synchronize()`` (or a ``query()`` that returned True) orders the calling thread's later
  operations after ``e``'s record point; an event never recorded is done (CUDA's
  ``cudaEventQuery``/``cudaEventSynchronize`` answer success for it) and orders nothing;
- each host thread has its own clock. Threads are ordered only by the hand-offs our code
  makes: a submission to an engine (a logged ``submit_*``/``engine_*`` node with a ``key``)
  is before the IO thread's file operations of that key (the engine's tracer), and those are
  before the report of that key (the engine counts a transfer's chunks under its lock); an IO
  thread's report on the offloader's completion queue (:meth:`Recorder.completions`) is
  before whatever the thread that took it off the queue does after unpacking it.

On the stand-in (``inner=None``) the streams also *run* as a GPU's do. A stream created by the
device-copy layer (``new_stream`` without a name) is *deferred*: each operation is queued, and
the stream runs its queue at random moments (a seeded ``random.Random``: ``seed``, printed,
and taken from ``$SSDTRAIN_STANDIN_SEED`` when set, so a failing interleaving can be replayed,
up to the order in which the host threads happen to run). Copies move their bytes only when
their stream runs them. An event is done only once its stream has run to its record point:
``query()`` may let the stream run a little (a GPU makes progress while the host polls), and
``synchronize()`` runs it up to there. A wait on another stream's event lets that stream run
first. The default stream and a stream a test names (``new_stream(device, "compute")``) are
*eager*: the tests' kernels run on the host when they are issued, so such a stream has always
run everything it was given, and its ``wait_event`` runs the waited-for stream up to the
record point before it returns; a test kernel (``kernel``) is refused on a deferred stream,
whose waits would not have run when the test's torch code reads the bytes. The ordering
scenes (``deferred_compute=True``) defer every stream, the default one and named ones too:
their kernels go through the stream (``launch``: the torch code runs when the stream runs
it), so a consumer's stream waits for a reload only as far as its events say. ``Recorder.alloc``
models CUDA's caching allocator (tests/stand_in_allocator.py): one pool per stream,
``record_stream`` honoured, reserved and allocated bytes reported; ``poison`` (on unless a
scene turns it off) overwrites each freed block.

Stream capture (CUDA graphs), as CUDA defines it for ``capture_error_mode="global"``:
between ``begin_capture()`` and ``end_capture()`` the calling thread captures (``capturing()``
is True there), and an event ``synchronize()`` or ``query()`` is refused, with CUDA's error,
on the capturing thread and on every other thread still in the global interaction mode; a
thread that switched itself to the thread-local mode (``driver``, a stand-in for
``cuThreadExchangeStreamCaptureMode``) may wait. Each refusal is logged as a ``refused`` node.

Nothing else orders a stream operation: a copy on the offload stream is *not* after a kernel
on the compute stream unless an event says so, even though the stand-in (on a CPU device)
performs every copy at once when it is issued.

``Recorder(inner=CudaStreams())`` wraps the real torch.cuda streams and events: the same log
and checks, while the copies really run asynchronously on the GPU (the tests marked ``cuda``;
there, ``delay_s`` puts a ``torch.cuda._sleep`` in front of each copy and producer so that a
missing wait shows up as wrong bytes too).
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import os
import random
import threading
import time
import weakref
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import torch

from ssdtrain_megatron.cache.device_copy import StreamOps
from tests.byte_ranges import _copy_or_stale, _range, contains, overlaps  # noqa: F401 (re-exported)
from tests.stand_in_allocator import CachingAllocator

HOST = "host"


def _join(a: Dict[str, int], b: Dict[str, int]) -> Dict[str, int]:
    out = dict(a)
    for k, v in b.items():
        if out.get(k, 0) < v:
            out[k] = v
    return out


class Node:
    """One logged operation: ``kind``, where it ran (``agent``: a stream's name or 'host'),
    the issuing thread, tags (pointers, keys), and its vector clock."""

    __slots__ = ("idx", "kind", "agent", "thread", "tags", "vc", "pos")

    def __init__(self, idx: int, kind: str, agent: str, thread: str, tags: dict, vc: Dict[str, int]) -> None:
        self.idx, self.kind, self.agent, self.thread, self.tags, self.vc = idx, kind, agent, thread, tags, vc
        self.pos = 0  # a stream operation's place in its stream (1, 2, ...)

    def __repr__(self) -> str:
        return f"#{self.idx} {self.kind}@{self.agent}({self.thread}) {self.tags}"


class RecStream:
    def __init__(self, rec: "Recorder", name: str, real: Any = None, eager: bool = True) -> None:
        self.rec, self.name, self.real, self.vc = rec, name, real, {}
        self.eager = eager  # module docstring: runs what it is given at once
        self.issued = 0  # operations given to it
        self.done = 0  # operations it has run
        self.queue: Deque[Tuple[Optional[Callable[[], None]], List[Tuple["RecStream", int]]]] = collections.deque()

    def wait_event(self, event: "RecEvent") -> None:
        if self.real is not None:
            self.real.wait_event(event.real)
        after = [event.point] if event.point is not None else []  # the record point at the time of the wait
        self.rec._stream_op(self, "wait", event=event.name, joins=event.vc, _after=after)

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


class RecEvent:
    def __init__(self, rec: "Recorder", name: str, real: Any = None) -> None:
        self.rec, self.name, self.real = rec, name, real
        self.vc: Dict[str, int] = {}  # empty until recorded: waiting on it orders nothing
        self.node: Optional[Node] = None
        self.point: Optional[Tuple[RecStream, int]] = None  # (stream, position) of the last record
        self.recorded_ns = 0  # the stand-in's "GPU time": the host time of the record (elapsed_time)

    def record(self, stream: RecStream) -> None:
        if self.real is not None:
            self.real.record(stream.real)
        node = self.rec._stream_op(stream, "record", event=self.name)
        self.node, self.vc, self.point = node, node.vc, (stream, node.pos)
        self.recorded_ns = time.perf_counter_ns()

    def elapsed_time(self, end: "RecEvent") -> float:
        """Milliseconds from this event to ``end`` (a timing event): the real events' where
        they exist; on the stand-in, which runs every operation when it is issued, the host
        times of the two records."""
        if self.real is not None:
            return self.real.elapsed_time(end.real)
        return (end.recorded_ns - self.recorded_ns) / 1e6

    def synchronize(self) -> None:
        self.rec._check_capture("synchronize", self.name)
        if self.real is not None:
            self.real.synchronize()
        elif self.point is not None:
            self.rec._run_to(self.point)
        self.rec._host_op("synchronize", joins=self.vc, event=self.name)

    def query(self) -> bool:
        self.rec._check_capture("query", self.name)
        if self.real is not None:
            done = self.real.query()
        else:
            done = self.rec._reached(self.point, poll=True)
        if done and self.node is not None and self.node.agent in self.rec.unobserved:
            return False  # a stream the host never sees finish (Recorder.unobserved)
        if done:
            self.rec._host_op("query_done", joins=self.vc, event=self.name)
        return done


CAPTURE_GLOBAL, CAPTURE_THREAD_LOCAL, CAPTURE_RELAXED = 0, 1, 2  # cudaStreamCaptureMode


class CaptureDriver:
    """A stand-in for the CUDA driver library of io/gpu_wait.py (``capture_driver()``): its one
    call sets the calling thread's stream-capture interaction mode in the recorder."""

    def __init__(self, rec: "Recorder") -> None:
        self.rec = rec

    def cuThreadExchangeStreamCaptureMode(self, mode) -> int:  # noqa: N802 - the C name
        cell = mode._obj  # ctypes.byref(c_int)
        me = threading.get_ident()
        with self.rec._lock:
            old = self.rec._modes.get(me, CAPTURE_GLOBAL)
            self.rec._modes[me] = cell.value
        cell.value = old
        return 0


class Recorder(StreamOps):
    """The stand-in (``inner=None``: a CPU device, copies done at once) or a logging wrapper
    around real streams (``inner=CudaStreams()``). See the module docstring."""

    def __init__(self, inner: Optional[StreamOps] = None, delay_s: float = 0.0,
                 pin_fails: bool = False, seed: Optional[int] = None, poison: bool = True,
                 pace: float = 0.3, deferred_compute: bool = False) -> None:
        self.inner = inner
        self.delay_s = delay_s
        self.pin_fails = pin_fails
        self.log: List[Node] = []
        self._lock = threading.RLock()
        self._clocks: Dict[int, Dict[str, int]] = {}  # each host thread's clock
        self._mail: Dict[Any, Dict[str, int]] = {}  # engine key -> the submitter's clock
        self._chunks: Dict[Any, Dict[str, int]] = {}  # engine key -> its file operations so far
        self._local = threading.local()
        self._streams: Dict[Any, RecStream] = {}
        self._n_events = 0
        if seed is None:
            env = os.environ.get("SSDTRAIN_STANDIN_SEED")
            seed = int(env) if env else random.randrange(1 << 31)
        self.seed = seed
        self.pace = pace
        """Chance that each deferred stream runs a little after each operation (and that a
        ``query`` lets its stream run); 0: streams run only when something waits for them
        (``synchronize``, a wait on an eager stream, ``run``/``run_all``)."""
        self._rng = random.Random(seed)
        if inner is None:
            print(f"recording stand-in: seed {seed} (SSDTRAIN_STANDIN_SEED={seed} replays it)")
        self.alloc: Optional[CachingAllocator] = None if inner is not None else CachingAllocator(
            lambda name: self._by_name(name).issued, lambda name: self._by_name(name).done,
            self._enqueue, poison=poison)
        self.deferred_compute = deferred_compute
        """Every stream deferred, the default one and those a test names too (the ordering
        scenes): the tests' kernels then go through their stream (``launch``), as CUDA's do."""
        self.default = self._wrap_stream(None, "default", eager=not deferred_compute)
        self.capture_thread: Optional[int] = None  # the thread capturing in global mode
        self._modes: Dict[int, int] = {}  # thread -> its stream-capture interaction mode
        self.driver = CaptureDriver(self)
        self.unobserved: set = set()
        """Names of streams whose events ``query()`` never reports done: the host then learns
        nothing of their progress, as on a GPU that runs far behind (``synchronize`` still
        waits and orders)."""

    # -- stream capture ---------------------------------------------------------------------

    def begin_capture(self) -> None:
        """The calling thread starts capturing a graph in ``capture_error_mode="global"``."""
        self.capture_thread = threading.get_ident()

    def end_capture(self) -> None:
        self.capture_thread = None

    def capturing(self) -> bool:
        if self.inner is not None and self.inner.capturing():
            return True
        return self.capture_thread is not None and self.capture_thread == threading.get_ident()

    def _check_capture(self, kind: str, event: str) -> None:
        """CUDA's rule for an event call while a global capture is under way (module docstring)."""
        if self.capture_thread is None:
            return
        me = threading.get_ident()
        mode = self._modes.get(me, CAPTURE_GLOBAL)
        if (me == self.capture_thread and mode != CAPTURE_RELAXED) or (me != self.capture_thread and mode == CAPTURE_GLOBAL):
            self._host_op("refused", call=kind, event=event)
            raise RuntimeError(f"CUDA error: operation not permitted when stream is capturing "
                               f"(stand-in: event {kind} during a global-mode capture)")

    # -- the StreamOps the layer calls ------------------------------------------------------

    def current_stream(self, device: torch.device) -> RecStream:
        if self.inner is not None:
            return self._wrap_stream(self.inner.current_stream(device))
        return getattr(self._local, "stream", None) or self.default

    def new_stream(self, device: torch.device, name: Optional[str] = None,
                   eager: Optional[bool] = None) -> RecStream:
        """A stream; deferred unless a test names it (or ``eager``): module docstring."""
        real = self.inner.new_stream(device) if self.inner is not None else None
        if eager is None:
            eager = name is not None and not self.deferred_compute
        return self._wrap_stream(real, name or f"s{len(self._streams)}", eager=eager)

    def new_event(self) -> RecEvent:
        with self._lock:
            self._n_events += 1
            name = f"e{self._n_events}"
        return RecEvent(self, name, self.inner.new_event() if self.inner is not None else None)

    def timing_event(self) -> RecEvent:
        with self._lock:
            self._n_events += 1
            name = f"t{self._n_events}"
        return RecEvent(self, name, self.inner.timing_event() if self.inner is not None else None)

    @contextlib.contextmanager
    def use(self, stream: RecStream):
        prev = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            if self.inner is not None:
                with self.inner.use(stream.real):
                    yield
            else:
                yield
        finally:
            self._local.stream = prev

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        stream = self.current_stream(dst.device if dst.device.type != "cpu" else src.device)
        self._delay()
        if self.inner is not None:
            dst.copy_(src, non_blocking=True)
            self._stream_op(stream, "copy", dst=_range(dst), src=_range(src))
            return
        d, s = self.alloc.raw(dst), self.alloc.raw(src)  # moved when the stream runs it
        self._stream_op(stream, "copy", dst=_range(dst), src=_range(src), _work=lambda: _copy_or_stale(d, s))

    def compact(self, t: torch.Tensor) -> torch.Tensor:
        stream = self.current_stream(t.device)
        if self.inner is not None:
            out = t.contiguous()
            self._stream_op(stream, "compact", dst=_range(out), src=_range(t))
            return out
        with self._lock:  # memory from the stream's pool, filled when the stream runs
            out = self.alloc.empty(t.numel() * t.element_size(), stream.name).view(t.dtype).view(t.shape)
        d, s = self.alloc.raw(out), self.alloc.raw(t)
        self._stream_op(stream, "compact", dst=_range(out), src=_range(t), _work=lambda: d.copy_(s))
        return out

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Memory (a restored tensor's, a test kernel's output), logged as an ``alloc`` on the
        current stream with the bytes asked for; on the stand-in from that stream's pool of
        the caching allocator model (512-byte aligned, as CUDA's)."""
        stream = self.current_stream(device)
        if self.inner is not None:
            t = self.inner.empty(numel, dtype, device)
        else:
            with self._lock:
                t = self.alloc.empty(numel * dtype.itemsize, stream.name).view(dtype)
        self._stream_op(stream, "alloc", ptr=_range(t), nbytes=numel * dtype.itemsize)
        return t

    def record_stream(self, t: torch.Tensor, stream: RecStream) -> None:
        if self.inner is not None:
            t.record_stream(stream.real)
        else:
            with self._lock:
                self.alloc.record_stream(t.data_ptr(), stream.name)
        self._host_op("record_stream", ptr=_range(t), stream=stream.name)

    def completions(self, queue: Any) -> Any:
        """The offloader's completion queue as the engine should see it: each report is logged
        (``complete``, on the IO thread) and orders what the thread that takes it off the queue
        does after it unpacked it (``_Report``)."""
        if queue is None:
            return queue
        return _Reports(self, queue)

    def let_go(self, t) -> None:
        """The data path dropped its reference to device bytes a copy read: a host ``let_go``
        node with their range (the checks order it after that copy)."""
        if t is not None:
            self._host_op("let_go", ptr=_range(t))

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        if self.pin_fails:
            raise RuntimeError("CUDA error: out of memory (stand-in: pinning refused)")
        if self.inner is not None:
            return self.inner.pinned_empty(nbytes)
        # Page-aligned, as cudaHostAlloc's memory is (the posix engine then moves staging
        # blocks in place: io/posix.py).
        from ssdtrain_megatron.io.slab_engine import aligned_buffer

        return aligned_buffer(nbytes)

    def pinned_pool(self, nbytes: int) -> torch.Tensor:
        """The staging pool. On the stand-in its release (what ``cudaHostUnregister`` and the
        unmapping of io/pinned.py do once the last view of it is gone) is logged as a host
        ``unpin`` node with the pool's byte range."""
        if self.inner is not None:
            return self.inner.pinned_pool(nbytes)
        if self.pin_fails:
            raise RuntimeError("CUDA error: out of memory (stand-in: pinning refused)")
        mm = mmap.mmap(-1, max(nbytes, 1))
        view = memoryview(mm)
        t = torch.frombuffer(view, dtype=torch.uint8)[:nbytes]
        weakref.finalize(view, self._host_op, "unpin", ptr=_range(t))
        return t

    # -- what tests log ---------------------------------------------------------------------

    def kernel(self, kind: str, t: torch.Tensor) -> Node:
        """A kernel of the model (``produce``/``consume``) on the current stream, touching
        ``t``'s bytes. On the stand-in the test's torch code touches those bytes on the host
        when it runs, so the stream must be eager (the default, or one a test names): on a
        deferred one, a consumer would read a restored tensor before its stream's wait for the
        reload copy ran, wrong bytes that no ordering check can name."""
        stream = self.current_stream(t.device)
        if self.inner is None and not stream.eager:
            raise AssertionError(f"stand-in: a test kernel ({kind}) on the deferred stream {stream.name} "
                                 f"runs on the host before that stream's queued waits; name the stream "
                                 f"(new_stream(device, name)) so that it is eager")
        if kind == "produce":
            self._delay()
        return self._stream_op(stream, kind, ptr=_range(t))

    def launch(self, kind: str, fn: Callable[..., None], *tensors: torch.Tensor) -> Node:
        """A kernel of the model on the current stream (any stream, deferred ones included):
        ``fn(*tensors)`` runs when the stream runs it, as a GPU kernel does, on views of the
        allocator model's blocks (``CachingAllocator.raw``), so a kernel queued on a tensor
        does not keep its block alive, as a queued CUDA kernel does not: a free before the
        kernel ran, unless ordered by the stream or marked by ``record_stream``, lets the
        block be poisoned or reused under it. Logged with the first tensor's byte range."""
        stream = self.current_stream(tensors[0].device)
        if self.inner is not None:
            fn(*tensors)
            return self._stream_op(stream, kind, ptr=_range(tensors[0]))
        with self._lock:
            raws = [self.alloc.raw(t) for t in tensors]
        return self._stream_op(stream, kind, ptr=_range(tensors[0]), _work=lambda: fn(*raws))

    def host(self, kind: str, **tags) -> Node:
        """A host operation of the calling thread. A submission to the engine (``submit_*``,
        ``engine_*``) with a ``key`` is what the IO thread's file operations of that key start
        from (module docstring)."""
        node = self._host_op(kind, **tags)
        if kind.startswith(("submit_", "engine_")) and "key" in tags:
            with self._lock:
                self._mail[tags["key"]] = _join(self._mail.get(tags["key"], {}), node.vc)
        return node

    def tracer(self, op, key, path, offset, nbytes, t_submit, t_done, depth) -> None:
        """An IO engine's trace sink: one host node per chunk that reached (or left) the file,
        after the submission of its key."""
        with self._lock:  # the engine counts a transfer's chunks under its lock: the last one reports
            node = self._host_op("disk_" + op, joins=self._mail.get(key), key=key, offset=offset, nbytes=nbytes)
            self._chunks[key] = _join(self._chunks.get(key, {}), node.vc)

    def streams_report(self) -> Dict[str, Any]:
        """The allocator model's reserved and allocated bytes per stream, now and at the peak."""
        with self._lock:
            return self.alloc.report()

    def run(self, stream: RecStream) -> None:
        """``stream`` runs everything it was given (and what that waits for): the GPU happened
        to run it first."""
        self._run_to((stream, stream.issued))

    def run_all(self) -> None:
        """Every stream runs everything it was given (the end of a scene: a device sync)."""
        with self._lock:
            for s in list(self._streams.values()):
                self._run_to((s, s.issued))

    # -- the model --------------------------------------------------------------------------

    def happens_before(self, a: Node, b: Node) -> bool:
        return a is not b and a.vc.get(a.agent, 0) <= b.vc.get(a.agent, 0)

    def is_host(self, n: Node) -> bool:
        return n.agent.startswith(HOST)

    def nodes(self, kind: str, **tags) -> List[Node]:
        return [n for n in self.log if n.kind == kind and all(n.tags.get(k) == v for k, v in tags.items())]

    def _wrap_stream(self, real: Any, name: Optional[str] = None, eager: bool = True) -> RecStream:
        with self._lock:
            key = id(real) if real is None else (real.device, real.cuda_stream)
            s = self._streams.get(key) if real is not None else None
            if s is None:
                s = RecStream(self, name or f"s{len(self._streams)}", real, eager=eager or real is not None)
                if real is not None:
                    self._streams[key] = s
                else:
                    self._streams[("fake", len(self._streams))] = s
            return s

    def _by_name(self, name: str) -> RecStream:
        for s in self._streams.values():
            if s.name == name:
                return s
        raise KeyError(name)

    def _clock(self) -> Dict[str, int]:
        return self._clocks.get(threading.get_ident(), {})

    def _acquire(self, report: Dict[str, int]) -> None:
        """The calling thread took a report off the completion queue (``_Report``)."""
        with self._lock:
            me = threading.get_ident()
            self._clocks[me] = _join(self._clocks.get(me, {}), report)

    def _stream_op(self, stream: RecStream, kind: str, joins: Optional[Dict[str, int]] = None,
                   _work: Optional[Callable[[], None]] = None,
                   _after: Optional[List[Tuple[RecStream, int]]] = None, **tags) -> Node:
        with self._lock:
            vc = _join(stream.vc, self._clock())  # runs after the host issued it
            if joins:
                vc = _join(vc, joins)
            vc[stream.name] = vc.get(stream.name, 0) + 1
            stream.vc = vc
            node = Node(len(self.log), kind, stream.name, threading.current_thread().name, tags, dict(vc))
            self.log.append(node)
            if self.inner is None:
                stream.issued += 1
                node.pos = stream.issued
                stream.queue.append((_work, list(_after or [])))
                if stream.eager:
                    self._run_to((stream, stream.issued))
                self.alloc.collect()
                self._pace()
            return node

    def _host_op(self, kind: str, joins: Optional[Dict[str, int]] = None, **tags) -> Node:
        with self._lock:
            agent = f"{HOST}:{threading.get_ident()}"
            vc = _join(self._clock(), joins or {})
            vc[agent] = vc.get(agent, 0) + 1
            self._clocks[threading.get_ident()] = vc
            node = Node(len(self.log), kind, agent, threading.current_thread().name, tags, dict(vc))
            self.log.append(node)
            return node

    def _report(self, item: Any, queue: Any) -> None:
        """An IO thread reports on the completion queue (``completions``)."""
        with self._lock:
            key = item[0] if isinstance(item, tuple) else None
            node = self._host_op("complete", joins=self._chunks.pop(key, None), key=key)
        queue.put(_Report(item, self, node.vc) if isinstance(item, tuple) else item)

    # -- the deferred streams ----------------------------------------------------------------

    def _enqueue(self, name: str, work: Callable[[], None], after: List[Tuple[str, int]]) -> None:
        """Queue ``work`` on a stream, behind the points in ``after`` (the allocator's poison)."""
        stream = self._by_name(name)
        stream.issued += 1
        stream.queue.append((work, [(self._by_name(s), pos) for s, pos in after]))
        if stream.eager:
            self._run_to((stream, stream.issued))

    def _run_to(self, point: Tuple[RecStream, int]) -> None:
        """The stream runs its queue up to ``point`` (what it waits for first)."""
        stream, pos = point
        with self._lock:
            while stream.done < pos:
                work, after = stream.queue.popleft()
                for p in after:
                    self._run_to(p)
                if work is not None:
                    with torch.no_grad():  # a GPU's work, whichever host thread made it run
                        work()
                stream.done += 1

    def _reached(self, point: Optional[Tuple[RecStream, int]], poll: bool = False) -> bool:
        """Whether the stream has run to ``point`` (never recorded: yes). ``poll``: a query,
        during which the stream may run a little."""
        if point is None or self.inner is not None:
            return True
        with self._lock:
            stream, pos = point
            if stream.done < pos and poll and self.pace > 0 and self._rng.random() < 0.5:
                self._run_to((stream, min(pos, stream.done + self._rng.randint(1, 3))))
            return stream.done >= pos

    def _pace(self) -> None:
        """After an operation, each deferred stream may run a few of its queued operations."""
        for s in list(self._streams.values()):
            if s.queue and s.done < s.issued and self._rng.random() < self.pace:
                self._run_to((s, min(s.issued, s.done + self._rng.randint(1, 4))))

    def _delay(self) -> None:
        if self.inner is not None and self.delay_s > 0:
            torch.cuda._sleep(int(self.delay_s * 1e9))  # about a cycle per ns on current GPUs


class _Reports:
    """The completion queue as an engine sees it under the recorder (``Recorder.completions``)."""

    def __init__(self, rec: Recorder, queue: Any) -> None:
        self.rec, self.queue = rec, queue

    def put(self, item: Any) -> None:
        self.rec._report(item, self.queue)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.queue, name)


class _Report(tuple):
    """A completion report as it travels the queue: the taker unpacks it (``*item``, as the
    offloader does), and from then on that thread is ordered after the report."""

    def __new__(cls, item: tuple, rec: Recorder, vc: Dict[str, int]) -> "_Report":
        out = super().__new__(cls, item)
        out._rec, out._vc = rec, vc
        return out

    def __iter__(self):
        self._rec._acquire(self._vc)
        return super().__iter__()
