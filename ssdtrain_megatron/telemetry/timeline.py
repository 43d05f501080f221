"""A timeline of one training step: every copy, wait and layer, on the host and on the GPU.

Why: a step that is slower than its bound says nothing about where the time went. A timeline
does: which stream ran what and when, where the training thread blocked and why, when the
drive moved each chunk, what the collector paused, how much CPU each thread burned. It is
what a GPU run brings back (``make gpu-perf``) and what the breakdown of the excess over the
bound is computed from (``timeline_breakdown.py``).

How it is recorded, and what it costs:

- Off by default: the offloader's parts hold ``timeline = None`` and test it before any work
  (one attribute load per hook). :meth:`ActivationOffloader.record_timeline` hands one in for
  the steps to record; tools turn it on for one step (the last timed step of a point).
- Host events carry ``time.perf_counter_ns()`` and the calling thread's id and name.
- GPU events are pairs of timing events recorded on a stream (``gpu_begin``/``gpu_end``), or
  one (``gpu_mark``); nothing waits on them while the step runs. :meth:`stop` (after the
  caller synchronised the device) turns them into times with ``elapsed_time`` from a base
  event recorded at :meth:`start`, right after a synchronisation, so GPU and host times share
  one origin to within the synchronisation's latency. Each GPU event keeps the host time at
  which it was *issued* too: a GPU event that ran as soon as it was issued found its stream
  idle, waiting for the host.
- The drive: the engines' per-chunk trace hook (``IOEngine.tracer``'s signature) feeds
  :meth:`on_io`; the chunk's submit and completion times.
- The garbage collector: ``gc.callbacks`` while recording (pauses as spans).
- CPU time per thread: ``/proc/self/task/*/stat`` at start and stop (Linux; elsewhere empty).

:meth:`to_chrome` gives the Chrome trace format (``{"traceEvents": [...]}``: complete events
``ph: "X"``, instants ``"i"``, counters ``"C"``, metadata ``"M"``), which Perfetto and
chrome://tracing open and which torch.profiler also writes; :meth:`write` caps the file's size
by leaving out the finest categories first, and says so in its metadata.
"""

from __future__ import annotations

import gc
import json
import os
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

__all__ = ["Timeline", "CATEGORIES", "WAIT_REASONS", "thread_cpu_seconds"]

CATEGORIES = ("layer", "copy", "wait", "hook", "drain", "drive", "gc", "memory", "phase", "step")
"""What the events are about: a layer's forward or backward on the compute stream ("layer"),
a device<->host copy ("copy"), the training thread or the compute stream waiting for the
offloader ("wait"), pack and unpack calls ("hook"), the processing of IO completions
("drain"), a drive chunk ("drive"), a garbage-collector pause ("gc"), memory figures
("memory"), a phase of the step (forward, backward, optimizer, step end: "phase") and the
whole step ("step")."""

WAIT_REASONS = ("back-pressure", "read", "budget", "step-end", "reload")
"""Why something waited: pack waited for writes in flight (back-pressure), unpack for a read,
the activation budget for room, end_step for IO still in flight; "reload" is the compute
stream waiting for a host->device copy (a GPU-side wait)."""

DROP_ORDER = ("hook", "drain", "drive", "memory", "copy")
"""Categories :meth:`Timeline.write` leaves out, in this order, to fit its size cap."""

_PROCESSES = ("host", "gpu", "drive")
_TRACK_NAMES = {"compute": 1, "offload": 2, "reload": 3}


class _GpuEvent:
    __slots__ = ("stream", "name", "cat", "args", "start", "end", "issued_ns", "end_issued_ns")

    def __init__(self, stream: str, name: str, cat: str, args: dict, start: Any, issued_ns: int) -> None:
        self.stream, self.name, self.cat, self.args = stream, name, cat, args
        self.start, self.end = start, None
        self.issued_ns, self.end_issued_ns = issued_ns, None


class Timeline:
    """One step's (or a few steps') events. See the module docstring.

    Args:
        ops: the offloader's StreamOps (cache/stream_ops.py) when there is a GPU data path:
            its ``timing_event()`` makes the GPU events; None: host events only.
        device: the training device (the base event's stream is its current stream).
        clock: nanoseconds on the host's monotonic clock (tests pass their own).
    """

    def __init__(self, ops: Any = None, device: Any = None,
                 clock: Callable[[], int] = time.perf_counter_ns) -> None:
        self.ops = ops
        self.device = device
        self.clock = clock
        self.events: List[dict] = []
        self._gpu: List[_GpuEvent] = []
        self._lock = threading.Lock()
        self._base: Any = None
        self.t0_ns = 0
        self.t1_ns = 0
        self.recording = False
        self._gc_started: Dict[int, int] = {}
        self._cpu0: Dict[str, float] = {}
        self.thread_cpu_s: Dict[str, float] = {}
        self.meta: Dict[str, Any] = {}
        self.probe: Optional[Callable[[], Dict[str, float]]] = None
        """Figures for :meth:`phase` (set by ``ActivationOffloader.record_timeline``)."""

    # -- start and stop ---------------------------------------------------------------------

    def start(self, synchronize: Optional[Callable[[], None]] = None) -> None:
        """Start recording: the base event on the compute stream (after ``synchronize``, the
        caller's device synchronisation, so that the base ran when the host time was read),
        the collector's callback, the threads' CPU times."""
        if synchronize is not None:
            synchronize()
        if self.ops is not None:
            self._base = self.ops.timing_event()
            self._base.record(self.ops.current_stream(self.device))
            self._base.synchronize()
        self.t0_ns = self.clock()
        self._cpu0 = thread_cpu_seconds()
        gc.callbacks.append(self._on_gc)
        self.recording = True

    def stop(self, synchronize: Optional[Callable[[], None]] = None) -> None:
        """Stop recording; resolve the GPU events (the caller's ``synchronize`` first: every
        event must have run)."""
        if not self.recording:
            return
        self.recording = False
        if synchronize is not None:
            synchronize()
        self.t1_ns = self.clock()
        try:
            gc.callbacks.remove(self._on_gc)
        except ValueError:
            pass
        cpu1 = thread_cpu_seconds()
        self.thread_cpu_s = {k: round(v - self._cpu0.get(k, 0.0), 6) for k, v in cpu1.items()
                             if v - self._cpu0.get(k, 0.0) > 0}
        self._resolve()

    def abandon(self) -> None:
        """Stop after an error in the recorded step, without raising: the caller is unwinding
        an exception that must reach its handler as it was (an out-of-memory stays one). No
        synchronisation (the device may be in a sticky error state); the GPU events that have
        run (``query()`` says so, which neither waits nor raises "not ready") are resolved, the
        others dropped and counted in ``meta["unresolved_gpu_events"]``: ``elapsed_time`` on an
        event that has not run raises, and would replace the step's own exception. A no-op
        after :meth:`stop`."""
        if not self.recording:
            return
        self.recording = False
        self.t1_ns = self.clock()
        try:
            gc.callbacks.remove(self._on_gc)
        except ValueError:
            pass
        finished, dropped = [], 0
        for g in self._gpu:
            if self._ran(g.start) and (g.end is None or self._ran(g.end)):
                finished.append(g)
            else:
                dropped += 1
        self._gpu = finished
        try:
            self._resolve()
        except Exception:  # noqa: BLE001 - a sticky device error fails even finished events' times
            dropped += len(self._gpu)
            self._gpu = []
        self.meta["unresolved_gpu_events"] = dropped

    @staticmethod
    def _ran(event: Any) -> bool:
        """Whether a recorded timing event has run; False where asking fails (a device in a
        sticky error state raises from every call)."""
        try:
            return bool(event.query())
        except Exception:  # noqa: BLE001 - unknown is not finished
            return False

    # -- host events ------------------------------------------------------------------------

    def now(self) -> int:
        return self.clock()

    def span(self, name: str, cat: str, t0_ns: int, t1_ns: Optional[int] = None, **args: Any) -> None:
        """A complete event on the calling thread, from ``t0_ns`` to ``t1_ns`` (default: now)."""
        if not self.recording:
            return
        t1 = self.clock() if t1_ns is None else t1_ns
        th = threading.current_thread()
        ev = {"name": name, "cat": cat, "ph": "X", "ts": self._us(t0_ns), "dur": max((t1 - t0_ns) / 1e3, 0.0),
              "pid": "host", "tid": th.name, "args": args}
        with self._lock:
            self.events.append(ev)

    def wait(self, reason: str, t0_ns: int, t1_ns: Optional[int] = None, **args: Any) -> None:
        """The training thread blocked on the offloader from ``t0_ns`` (a WAIT_REASONS reason)."""
        self.span(reason, "wait", t0_ns, t1_ns, **args)

    def instant(self, name: str, cat: str, **args: Any) -> None:
        if not self.recording:
            return
        th = threading.current_thread()
        ev = {"name": name, "cat": cat, "ph": "i", "s": "t", "ts": self._us(self.clock()), "pid": "host",
              "tid": th.name, "args": args}
        with self._lock:
            self.events.append(ev)

    def counter(self, name: str, values: Dict[str, float], cat: str = "memory") -> None:
        """Figures at this moment (memory allocated and reserved, resident bytes by state)."""
        if not self.recording:
            return
        ev = {"name": name, "cat": cat, "ph": "C", "ts": self._us(self.clock()), "pid": "host", "args": values}
        with self._lock:
            self.events.append(ev)

    def on_io(self, op: str, key: int, path: str, offset: int, nbytes: int, t_submit: float,
              t_done: float, queue_depth: int) -> None:
        """The engines' per-chunk trace hook (seconds on ``time.perf_counter``): one drive event
        (the memory engine's copies, whose path is "<host memory>", on their own rows)."""
        if not self.recording:
            return
        t0, t1 = int(t_submit * 1e9), int(t_done * 1e9)
        row = op if not path.startswith("<") else f"{op} {path.strip('<>')}"
        ev = {"name": f"{op} {nbytes >> 10} KiB", "cat": "drive", "ph": "X", "ts": self._us(t0),
              "dur": max((t1 - t0) / 1e3, 0.0), "pid": "drive", "tid": row,
              "args": {"op": op, "key": key, "file": os.path.basename(path), "offset": offset, "bytes": nbytes,
                       "queue_depth": queue_depth}}
        with self._lock:
            self.events.append(ev)

    # -- GPU events -------------------------------------------------------------------------

    def gpu_begin(self, stream: Any, track: str, name: str, cat: str, **args: Any) -> Optional[_GpuEvent]:
        """Start a GPU span on ``stream`` (shown on the ``track`` row: compute, offload,
        reload); returns the token :meth:`gpu_end` closes, or None when not recording."""
        if not self.recording or self.ops is None:
            return None
        ev = self.ops.timing_event()
        ev.record(stream)
        g = _GpuEvent(track, name, cat, args, ev, self.clock())
        with self._lock:
            self._gpu.append(g)
        return g

    def gpu_end(self, stream: Any, token: Optional[_GpuEvent], **args: Any) -> None:
        if token is None:
            return
        ev = self.ops.timing_event()
        ev.record(stream)
        token.end, token.end_issued_ns = ev, self.clock()
        if args:
            token.args.update(args)

    def gpu_mark(self, stream: Any, track: str, name: str, cat: str, **args: Any) -> None:
        """An instant on ``stream``: when the stream got there."""
        token = self.gpu_begin(stream, track, name, cat, **args)
        if token is not None:
            token.end_issued_ns = token.issued_ns

    # -- the compute stream (or, without a GPU data path, the training thread) ----------------

    def compute_begin(self, name: str, cat: str, **args: Any) -> Any:
        """Start a span where the model's work runs: on the current (compute) stream, or, on a
        CPU device (no ``ops``), on the calling thread. Returns the token for
        :meth:`compute_end` (None when not recording)."""
        if not self.recording:
            return None
        if self.ops is None:
            return (name, cat, self.clock(), args)
        return self.gpu_begin(self.ops.current_stream(self.device), "compute", name, cat, **args)

    def compute_end(self, token: Any) -> None:
        if token is None:
            return
        if isinstance(token, tuple):
            name, cat, t0, args = token
            self.span(name, cat, t0, **args)
        else:
            self.gpu_end(self.ops.current_stream(self.device), token)

    def compute_mark(self, name: str, cat: str, **args: Any) -> None:
        """An instant where the model's work runs (see :meth:`compute_begin`)."""
        if self.ops is None:
            self.instant(name, cat, **args)
        else:
            self.gpu_mark(self.ops.current_stream(self.device), "compute", name, cat, **args)

    def phase(self, name: str) -> None:
        """A phase boundary of the step (a micro-batch's forward or backward starts, the step
        ends): an instant, and the figures of ``probe`` (the offloader's memory: allocated and
        reserved on CUDA, resident bytes by record state) as a counter."""
        if not self.recording:
            return
        self.instant(name, "phase")
        if self.probe is not None:
            self.counter("memory", self.probe())

    # -- results ----------------------------------------------------------------------------

    def _us(self, t_ns: int) -> float:
        return (t_ns - self.t0_ns) / 1e3

    def _resolve(self) -> None:
        """GPU events -> trace events (ts: the stream's time from the base event; ``issued``:
        the host's time when it was issued, both in µs from the start)."""
        resolved = []
        for g in self._gpu:
            ts = self._gpu_us(g.start)
            ev = {"name": g.name, "cat": g.cat, "pid": "gpu", "tid": g.stream, "ts": ts,
                  "args": dict(g.args, issued_us=round(self._us(g.issued_ns), 3))}
            if g.end is None:
                ev.update(ph="i", s="t")
            else:
                ev.update(ph="X", dur=max(self._gpu_us(g.end) - ts, 0.0))
                ev["args"]["end_issued_us"] = round(self._us(g.end_issued_ns), 3)
            resolved.append(ev)
        self.events.extend(resolved)  # all or none: abandon() may give up half-way
        self._gpu = []

    def _gpu_us(self, event: Any) -> float:
        return float(self._base.elapsed_time(event)) * 1e3

    def of(self, cat: Optional[str] = None, pid: Optional[str] = None, name: Optional[str] = None) -> List[dict]:
        """The recorded events of one category / process / name, in time order."""
        out = [e for e in self.events if (cat is None or e["cat"] == cat) and (pid is None or e["pid"] == pid)
               and (name is None or e["name"] == name)]
        return sorted(out, key=lambda e: e["ts"])

    def to_chrome(self, drop: Tuple[str, ...] = ()) -> dict:
        """The Chrome trace (module docstring), leaving out the categories in ``drop``. Process
        and thread ids are numbers, named by metadata events (what chrome://tracing and
        Perfetto's JSON import both read); each event keeps its names in ``args`` too."""
        events = [e for e in self.events if e["cat"] not in drop]
        pids = {p: i + 1 for i, p in enumerate(_PROCESSES)}
        tids: Dict[Tuple[str, str], int] = {}
        for e in events:
            if e["ph"] != "C":
                key = (e["pid"], str(e["tid"]))
                if key not in tids:
                    tids[key] = _TRACK_NAMES.get(key[1], 10 + len(tids)) if key[0] == "gpu" else 10 + len(tids)
        names = [{"name": "process_name", "ph": "M", "pid": pids[p], "tid": 0, "args": {"name": p}}
                 for p in _PROCESSES if any(e["pid"] == p for e in events)]
        for (pid, tid), n in sorted(tids.items(), key=lambda kv: kv[1]):
            names.append({"name": "thread_name", "ph": "M", "pid": pids[pid], "tid": n, "args": {"name": tid}})
            names.append({"name": "thread_sort_index", "ph": "M", "pid": pids[pid], "tid": n,
                          "args": {"sort_index": n}})
        out = []
        for e in sorted(events, key=lambda e: e["ts"]):
            process = e["pid"]  # its name, before it becomes a number
            e = dict(e, pid=pids[e["pid"]], ts=round(e["ts"], 3))
            if e["ph"] == "C":
                e.pop("tid", None)
            else:
                e["tid"] = tids[(process, str(e["tid"]))]
            if "dur" in e:
                e["dur"] = round(e["dur"], 3)
            out.append(e)
        meta = dict(self.meta, duration_us=round(self._us(self.t1_ns), 3) if self.t1_ns else None,
                    thread_cpu_s=self.thread_cpu_s, dropped_categories=list(drop))
        return {"traceEvents": names + out, "displayTimeUnit": "ms", "otherData": meta}

    def write(self, path: str, max_bytes: int = 2 << 20) -> dict:
        """Write the Chrome trace to ``path``, at most ``max_bytes``: the categories of
        DROP_ORDER are left out one by one until it fits (named in ``otherData``). Returns
        {"path", "bytes", "dropped"}."""
        drop: Tuple[str, ...] = ()
        text = json.dumps(self.to_chrome(drop), separators=(",", ":"))
        for cat in DROP_ORDER:
            if len(text) <= max_bytes:
                break
            drop += (cat,)
            text = json.dumps(self.to_chrome(drop), separators=(",", ":"))
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
        return {"path": path, "bytes": len(text), "dropped": list(drop)}

    # -- the collector ------------------------------------------------------------------------

    def _on_gc(self, phase: str, info: dict) -> None:
        me = threading.get_ident()
        if phase == "start":
            self._gc_started[me] = self.clock()
        else:
            t0 = self._gc_started.pop(me, None)
            if t0 is not None:
                self.span("gc", "gc", t0, None, generation=info.get("generation"), collected=info.get("collected"))


def thread_cpu_seconds(task_dir: str = "/proc/self/task") -> Dict[str, float]:
    """CPU seconds (user + system) of each thread of this process, by name: a Python thread's
    own name (``threading``), else the OS's (torch's autograd threads name themselves), with
    the workers of one family summed (the IO engine's "ssdtrain-mem-0".."-3" are
    "ssdtrain-mem"); {} where /proc has no per-thread stat (not Linux)."""
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    python_names = {t.native_id: t.name for t in threading.enumerate()}
    out: Dict[str, float] = {}
    for tid in tids:
        try:
            with open(os.path.join(task_dir, tid, "stat")) as fh:
                stat = fh.read()
        except OSError:
            continue  # the thread ended meanwhile
        # "pid (comm) state ...": comm may hold spaces and parentheses; fields after the last ')'
        close = stat.rfind(")")
        comm = stat[stat.find("(") + 1:close]
        fields = stat[close + 2:].split()
        utime, stime = int(fields[11]), int(fields[12])
        name = _family(python_names.get(int(tid), comm))
        out[name] = out.get(name, 0.0) + (utime + stime) / tick
    return out


def _family(name: str) -> str:
    """A thread's family name: the IO workers' "ssdtrain-mem-3" is "ssdtrain-mem"."""
    head, _, tail = name.rpartition("-")
    return head if head and tail.isdigit() else name
