"""A recording stand-in for CUDA streams, events and copies, and a happens-before checker.

What it checks is OUR ordering logic (cache/device_copy.py and the offloader's calls into it),
not CUDA: the stand-in models a GPU the way the CUDA programming model defines one and logs
every operation, and the checker asks whether, by those rules alone, one operation is
guaranteed to happen before another:

- operations on one stream run in issue order, and each runs after the host issued it;
- ``stream.wait_event(e)`` orders the stream's later operations after ``e``'s record point;
- ``e.synchronize()`` (or a ``query()`` that returned True) orders the host's later
  operations after ``e``'s record point;
- host operations are ordered by real time (the log's order, taken under one lock): our
  threads hand work to each other through futures and locks, and the hazard this checks is
  the GPU's asynchrony, not the host's.

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

import contextlib
import mmap
import threading
import time
import weakref
from typing import Any, Dict, List, Optional

import torch

from ssdtrain_megatron.cache.device_copy import StreamOps

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

    __slots__ = ("idx", "kind", "agent", "thread", "tags", "vc")

    def __init__(self, idx: int, kind: str, agent: str, thread: str, tags: dict, vc: Dict[str, int]) -> None:
        self.idx, self.kind, self.agent, self.thread, self.tags, self.vc = idx, kind, agent, thread, tags, vc

    def __repr__(self) -> str:
        return f"#{self.idx} {self.kind}@{self.agent}({self.thread}) {self.tags}"


class RecStream:
    def __init__(self, rec: "Recorder", name: str, real: Any = None) -> None:
        self.rec, self.name, self.real, self.vc = rec, name, real, {}

    def wait_event(self, event: "RecEvent") -> None:
        if self.real is not None:
            self.real.wait_event(event.real)
        self.rec._stream_op(self, "wait", event=event.name, joins=event.vc)

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


class RecEvent:
    def __init__(self, rec: "Recorder", name: str, real: Any = None) -> None:
        self.rec, self.name, self.real = rec, name, real
        self.vc: Dict[str, int] = {}  # empty until recorded: waiting on it orders nothing
        self.node: Optional[Node] = None
        self.recorded_ns = 0  # the stand-in's "GPU time": the host time of the record (elapsed_time)

    def record(self, stream: RecStream) -> None:
        if self.real is not None:
            self.real.record(stream.real)
        self.node = self.rec._stream_op(stream, "record", event=self.name)
        self.vc = self.node.vc
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
        self.rec._host_op("synchronize", joins=self.vc, event=self.name)

    def query(self) -> bool:
        self.rec._check_capture("query", self.name)
        done = self.real.query() if self.real is not None else self.node is not None
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
                 pin_fails: bool = False) -> None:
        self.inner = inner
        self.delay_s = delay_s
        self.pin_fails = pin_fails
        self.log: List[Node] = []
        self._lock = threading.RLock()
        self._host_vc: Dict[str, int] = {}
        self._local = threading.local()
        self._streams: Dict[Any, RecStream] = {}
        self._n_events = 0
        self.default = self._wrap_stream(None, "default")
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

    def new_stream(self, device: torch.device, name: Optional[str] = None) -> RecStream:
        real = self.inner.new_stream(device) if self.inner is not None else None
        return self._wrap_stream(real, name or f"s{len(self._streams)}")

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
        dst.copy_(src, non_blocking=self.inner is not None)
        self._stream_op(stream, "copy", dst=_range(dst), src=_range(src))

    def compact(self, t: torch.Tensor) -> torch.Tensor:
        out = t.contiguous()
        self._stream_op(self.current_stream(t.device), "compact", dst=_range(out), src=_range(t))
        return out

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Memory for a restored tensor, logged as an ``alloc`` on the current stream with the
        bytes asked for; on the stand-in 512-byte aligned, as CUDA's caching allocator's is."""
        if self.inner is not None:
            t = self.inner.empty(numel, dtype, device)
        else:  # a storage of its own, starting on a page (as torch.empty's: storage offset 0)
            from ssdtrain_megatron.io.slab_engine import aligned_buffer

            t = aligned_buffer(numel * dtype.itemsize).view(dtype)
        self._stream_op(self.current_stream(device), "alloc", ptr=_range(t), nbytes=numel * dtype.itemsize)
        return t

    def record_stream(self, t: torch.Tensor, stream: RecStream) -> None:
        if self.inner is not None:
            t.record_stream(stream.real)
        self._host_op("record_stream", ptr=_range(t), stream=stream.name)

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
        ``t``'s bytes."""
        if kind == "produce":
            self._delay()
        return self._stream_op(self.current_stream(t.device), kind, ptr=_range(t))

    def host(self, kind: str, **tags) -> Node:
        return self._host_op(kind, **tags)

    def tracer(self, op, key, path, offset, nbytes, t_submit, t_done, depth) -> None:
        """An IO engine's trace sink: one host node per chunk that reached (or left) the file."""
        self._host_op("disk_" + op, key=key, offset=offset, nbytes=nbytes)

    # -- the model --------------------------------------------------------------------------

    def happens_before(self, a: Node, b: Node) -> bool:
        return a is not b and a.vc.get(a.agent, 0) <= b.vc.get(a.agent, 0)

    def nodes(self, kind: str, **tags) -> List[Node]:
        return [n for n in self.log if n.kind == kind and all(n.tags.get(k) == v for k, v in tags.items())]

    def _wrap_stream(self, real: Any, name: Optional[str] = None) -> RecStream:
        with self._lock:
            key = id(real) if real is None else (real.device, real.cuda_stream)
            s = self._streams.get(key) if real is not None else None
            if s is None:
                s = RecStream(self, name or f"s{len(self._streams)}", real)
                if real is not None:
                    self._streams[key] = s
                else:
                    self._streams[("fake", len(self._streams))] = s
            return s

    def _stream_op(self, stream: RecStream, kind: str, joins: Optional[Dict[str, int]] = None, **tags) -> Node:
        with self._lock:
            vc = _join(stream.vc, self._host_vc)  # runs after the host issued it
            if joins:
                vc = _join(vc, joins)
            vc[stream.name] = vc.get(stream.name, 0) + 1
            stream.vc = vc
            node = Node(len(self.log), kind, stream.name, threading.current_thread().name, tags, dict(vc))
            self.log.append(node)
            return node

    def _host_op(self, kind: str, joins: Optional[Dict[str, int]] = None, **tags) -> Node:
        with self._lock:
            vc = _join(self._host_vc, joins or {})
            vc[HOST] = vc.get(HOST, 0) + 1
            self._host_vc = vc
            node = Node(len(self.log), kind, HOST, threading.current_thread().name, tags, dict(vc))
            self.log.append(node)
            return node

    def _delay(self) -> None:
        if self.inner is not None and self.delay_s > 0:
            torch.cuda._sleep(int(self.delay_s * 1e9))  # about a cycle per ns on current GPUs


def _range(t: torch.Tensor) -> tuple:
    """(first byte, one past the last byte) that ``t`` spans."""
    start = t.data_ptr()
    if t.numel() == 0:
        return (start, start)
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return (start, start + span * t.element_size())


def overlaps(a: tuple, b: tuple) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def contains(outer: tuple, inner: tuple) -> bool:
    return outer[0] <= inner[0] and inner[1] <= outer[1]
