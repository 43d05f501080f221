"""The step timeline (telemetry/timeline.py): its Chrome trace is well formed, GPU spans come
from timing events on the streams they ran on, and the size cap leaves out the finest
categories first. The GPU here is the recording stand-in (tests/recording_streams.py), whose
timing events carry the host time of their record."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from ssdtrain_megatron import ActivationOffloader
from ssdtrain_megatron.telemetry.timeline import DROP_ORDER, Timeline, thread_cpu_seconds
from tests.recording_streams import Recorder
from tests.test_device_copy import _config, _run


def _well_formed(trace: dict) -> None:
    names = {}
    for e in trace["traceEvents"]:
        assert e["ph"] in ("X", "i", "C", "M"), e
        assert isinstance(e["pid"], int), e
        if e["ph"] == "M":
            names[(e["pid"], e["tid"], e["name"])] = e["args"]
            continue
        assert isinstance(e["ts"], float) and e["ts"] >= 0, e
        if e["ph"] == "X":
            assert e["dur"] >= 0, e
        if e["ph"] != "C":
            assert isinstance(e["tid"], int) and (e["pid"], e["tid"], "thread_name") in names, e
        assert (e["pid"], 0, "process_name") in names, e
    json.dumps(trace)


def test_gpu_spans_sit_on_their_streams_and_host_waits_on_their_thread():
    ops = Recorder()
    offload = ops.new_stream(torch.device("cpu"), "offload")
    tl = Timeline(ops, torch.device("cpu"))
    tl.start()
    token = tl.gpu_begin(offload, "offload", "d2h", "copy", record=7, bytes=1 << 20)
    time.sleep(0.002)
    tl.gpu_end(offload, token)
    t0 = tl.now()
    time.sleep(0.003)
    tl.wait("read", t0, record=7)
    tl.gpu_mark(ops.current_stream(torch.device("cpu")), "compute", "backward layer 3", "layer")
    tl.stop()
    trace = tl.to_chrome()
    _well_formed(trace)
    by_name = {e["name"]: e for e in trace["traceEvents"] if e["ph"] != "M"}
    d2h, wait, mark = by_name["d2h"], by_name["read"], by_name["backward layer 3"]
    assert d2h["dur"] >= 2000 and d2h["args"]["record"] == 7  # µs: the 2 ms between its two records
    assert wait["dur"] >= 3000 and wait["cat"] == "wait"
    assert mark["ph"] == "i" and mark["ts"] >= wait["ts"]
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert tracks[(d2h["pid"], d2h["tid"])] == "offload"
    assert tracks[(wait["pid"], wait["tid"])] == threading.current_thread().name


def test_nothing_is_recorded_before_start_or_after_stop():
    tl = Timeline()
    tl.span("pack", "hook", tl.now())
    tl.start()
    tl.span("pack", "hook", tl.now(), bytes=1)
    tl.stop()
    tl.span("pack", "hook", tl.now())
    assert len(tl.of("hook")) == 1


def test_the_size_cap_leaves_out_the_finest_categories_first(tmp_path):
    tl = Timeline()
    tl.start()
    for i in range(2000):
        tl.span("pack", "hook", tl.now(), record=i)
    tl.wait("step-end", tl.now())
    tl.stop()
    whole = len(json.dumps(tl.to_chrome(), separators=(",", ":")))
    out = tl.write(str(tmp_path / "t.json"), max_bytes=whole // 4)
    assert out["dropped"] == [DROP_ORDER[0]] and out["bytes"] <= whole // 4
    trace = json.loads((tmp_path / "t.json").read_text())
    _well_formed(trace)
    assert trace["otherData"]["dropped_categories"] == ["hook"]
    assert [e["name"] for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] != "gc"] == ["step-end"]


def test_garbage_collector_pauses_are_spans():
    tl = Timeline()
    tl.start()
    import gc

    gc.collect()
    tl.stop()
    assert tl.of("gc"), "gc.collect() left no pause in the timeline"


def test_thread_cpu_time_is_named_by_python_thread_and_family():
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            sum(range(1000))

    workers = [threading.Thread(target=spin, name=f"ssdtrain-mem-{i}", daemon=True) for i in range(2)]
    before = thread_cpu_seconds()
    for w in workers:
        w.start()
    time.sleep(0.3)
    after = thread_cpu_seconds()  # while they run: a thread that ended has left /proc
    stop.set()
    for w in workers:
        w.join()
    if not before and not after:
        return  # no /proc per-thread stat here
    assert "ssdtrain-mem-0" not in after
    assert after.get("ssdtrain-mem", 0) > 0.05


# -- the offloader's timeline ----------------------------------------------------------------

@pytest.mark.parametrize("engine", ["posix", "memory"])
def test_a_recorded_step_shows_every_copy_wait_layer_and_phase(tmp_path, engine):
    """A step of the recording stand-in's small model (tests/test_device_copy.py), recorded: one
    d2h per offloaded tensor on the offload track, one h2d per read on the reload track, the
    compute stream's wait for each reload, each layer's forward on the compute track and
    backward's marks, the drive's chunks (posix), pack and unpack spans, the phases with
    their memory figures; and the trace is well formed. The step after, not recorded, adds
    nothing."""
    rec = Recorder()
    cpu = torch.device("cpu")
    with ActivationOffloader(_config(tmp_path, engine), device=cpu, streams=rec) as off:
        tl = Timeline(off.copy.ops, off.device)
        off.record_timeline(tl)
        tl.start()
        _, stats = _run(off, rec, cpu, False, None)
        tl.stop()
        off.record_timeline(None)
        n_events = len(tl.events)
        _run(off, rec, cpu, False, None)
    assert len(tl.events) == n_events
    _well_formed(tl.to_chrome())
    d2h, h2d = tl.of("copy", name="d2h"), tl.of("copy", name="h2d")
    assert len(d2h) == stats.tensors_offloaded > 0 and {e["tid"] for e in d2h} == {"offload"}
    assert len(h2d) == stats.bytes_read // d2h[0]["args"]["bytes"] > 0 and {e["tid"] for e in h2d} == {"reload"}
    reloads = tl.of("wait", pid="gpu", name="reload")
    assert len(reloads) == len(h2d) and {e["tid"] for e in reloads} == {"compute"}
    assert len(tl.of("layer", pid="gpu")) >= 2 * 4 * 2  # 4 layers x 2 micro-batches: forward spans, backward marks
    assert len(tl.of("hook", name="pack")) == stats.tensors_offloaded
    assert tl.of("wait", pid="host", name="step-end")
    phases = [e["name"] for e in tl.of("phase")]
    assert phases[:2] == ["forward mb 0", "backward mb 0"] and phases[-1] == "step end"
    assert len(tl.of("memory")) == len(phases) and "resident" in tl.of("memory")[0]["args"]
    if engine == "posix":
        assert sum(e["args"]["bytes"] for e in tl.of("drive") if e["args"]["op"] == "write") >= stats.bytes_offloaded
    else:  # the memory engine's chunks are its pool's, on their own rows
        assert {e["tid"] for e in tl.of("drive")} <= {"write host memory", "read host memory"}
