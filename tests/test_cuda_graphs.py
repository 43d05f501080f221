"""CUDA graphs and offload (issue 24, 1.2).

While a stream captures a CUDA graph, nothing of an offload (an event, a stream switch, a
copy, a hand-off to an IO thread) may enter the capture: a replay would repeat the kernels and
none of the host side. The pack hook therefore leaves every tensor saved during a capture to
autograd and counts it (``StepStats.captured_kept``). On this CPU machine the capture query
(``torch.cuda.is_current_stream_capturing()``) is a stand-in flag on the recording streams
(tests/recording_streams.py); the offloader, engine and files are real. Megatron's own
CUDA-graph flags do not compose with ``--ssd-offload`` (docs/megatron.md, "CUDA graphs"): the launcher
and the first step stop with one line naming the flag to remove.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
import types

import pytest
import torch

from ssdtrain_megatron import ActivationOffloader, OffloadConfig
from tests.recording_streams import Recorder

CUDA = torch.cuda.is_available()


class Capturing(Recorder):
    """The recording stand-in, with the capture query answered by ``capture``."""

    capture = False

    def capturing(self) -> bool:
        return self.capture


def _config(tmp_path) -> OffloadConfig:
    return OffloadConfig(dirs=[str(tmp_path)], min_tensor_bytes=0, keep_last_layers=0,
                         chunk_bytes=64 * 1024, max_inflight_bytes=1 << 20, pinned_staging_bytes=1 << 20)


def _forward(off, rec, x):
    with off.microbatch(0):
        return torch.tanh(x * 2).sum()  # tanh saves its output (a fresh tensor): offloadable


def test_tensors_saved_while_a_graph_is_captured_stay_with_autograd_and_are_counted(tmp_path):
    rec = Capturing()
    x = torch.randn(4096, requires_grad=True)
    ref = torch.autograd.grad(torch.tanh(x * 2).sum(), x)[0]
    with ActivationOffloader(_config(tmp_path), device=torch.device("cpu"), streams=rec) as off:
        streams_before = len(rec.log)
        rec.capture = True
        loss = _forward(off, rec, x)
        rec.capture = False
        during = rec.log[streams_before:]
        assert during == [], f"stream/event operations entered the capture: {during}"
        assert len(off.table) == 0, "a record was made during the capture"
        (g,) = torch.autograd.grad(loss, x)
        stats = off.end_step()
    assert stats.captured_kept == 1
    assert stats.passed_through_by_reason.get("cuda_graph_capture") == 1
    assert stats.tensors_offloaded == 0 and stats.bytes_offloaded == 0
    assert torch.equal(g.view(torch.int32), ref.view(torch.int32))


def test_outside_a_capture_the_same_tensor_is_offloaded(tmp_path):
    """The control: the same forward, not capturing, offloads (so the test above can fail)."""
    rec = Capturing()
    x = torch.randn(4096, requires_grad=True)
    with ActivationOffloader(_config(tmp_path), device=torch.device("cpu"), streams=rec) as off:
        loss = _forward(off, rec, x)
        off.wait_writes()
        torch.autograd.grad(loss, x)
        stats = off.end_step()
    assert stats.captured_kept == 0 and stats.tensors_offloaded == 1 and stats.bytes_read > 0


def test_unpacking_inside_a_capture_a_tensor_offloaded_outside_it_is_an_error(tmp_path):
    rec = Capturing()
    x = torch.randn(4096, requires_grad=True)
    with ActivationOffloader(_config(tmp_path), device=torch.device("cpu"), streams=rec) as off:
        loss = _forward(off, rec, x)
        off.wait_writes()
        rec.capture = True
        with pytest.raises(RuntimeError, match="offloaded outside CUDA graph capture is needed inside one"):
            torch.autograd.grad(loss, x)
        rec.capture = False
        off.end_step()


def test_entering_a_micro_batch_layer_or_backward_while_capturing_touches_no_stream_or_io(tmp_path):
    """Scope entry inside a capture: micro-batch 0 leaves deferred last layers (not yet written);
    then, capturing, entering micro-batch 1 and its layers, micro-batch 0's next layer, and a
    backward hint for micro-batch 0 must record no event, wait on no stream, copy nothing, call no
    ``record_stream`` and hand nothing to the engine (those writes wait for the next entry
    outside the capture, where they are written). Before the fix each of the three entries
    wrote micro-batch 0's deferred layers or started its reads: copies and events inside the
    capture."""
    rec = Capturing()
    cfg = _config(tmp_path).replace(keep_last_layers=1)
    x = torch.randn(4096, requires_grad=True)
    with ActivationOffloader(cfg, device=torch.device("cpu"), streams=rec) as off:
        with off.microbatch(0):
            hs = x
            for i in range(3):
                with off.layer(i):
                    hs = torch.tanh(hs * 2)
        loss0 = hs.sum()
        off.wait_writes()
        deferred = list(off.table.find_microbatch(0).deferred)
        assert deferred, "micro-batch 0 left no deferred layer: nothing to check"
        before, written = len(rec.log), off.step.counters.bytes_offloaded
        rec.capture = True
        with off.microbatch(1):
            for i in range(2):
                with off.layer(i):
                    torch.tanh(x * 3)
        with off.microbatch(0), off.layer(3):  # a later layer: entering it writes layer 2's
            torch.tanh(x * 3)
        off.begin_backward(0)  # would start reads
        rec.capture = False
        during = rec.log[before:]
        assert during == [], f"stream/event operations entered the capture: {during}"
        assert off.step.counters.bytes_offloaded == written, "a write was handed to the engine during the capture"
        assert list(off.table.find_microbatch(0).deferred) == deferred
        with off.microbatch(2):  # outside the capture: the deferred writes go now
            torch.tanh(x * 4)
        assert rec.log[before:] and not off.table.find_microbatch(0).deferred
        (g,) = torch.autograd.grad(loss0, x)
        stats = off.end_step()
    ref = x
    for _ in range(3):
        ref = torch.tanh(ref * 2)
    (gref,) = torch.autograd.grad(ref.sum(), x)
    assert torch.equal(g.view(torch.int32), gref.view(torch.int32))
    assert stats.bytes_read > 0


def test_io_threads_wait_for_copy_events_during_a_global_capture_in_thread_local_mode(tmp_path, monkeypatch):
    """A capture in ``capture_error_mode="global"`` (torch's default) begins on the training
    thread while an IO thread still has a write to do: the IO thread's wait for that write's
    copy event runs during the capture. CUDA refuses an event wait from a thread in the global
    interaction mode then (and invalidates the capture); the stand-in does the same
    (tests/recording_streams.py). The IO threads switch themselves to the thread-local mode
    around the wait (io/gpu_wait.py): no refusal, no fallback, and the write completes. Before
    the fix the wait was refused, the write failed and the tensor fell back to memory."""
    from ssdtrain_megatron.io import gpu_wait, make_engine
    from tests.faulty import FaultyEngine, HeldWrites

    rec = Recorder()
    monkeypatch.setattr(gpu_wait, "capture_driver", lambda: rec.driver)
    cfg = _config(tmp_path).replace(io_threads=1, chunk_bytes=16 * 1024)
    hold = HeldWrites()
    engine = FaultyEngine(make_engine(cfg), hold)
    x = torch.randn(4096, requires_grad=True)
    with ActivationOffloader(cfg, device=torch.device("cpu"), engine=engine, streams=rec) as off:
        hold.held = True
        with off.microbatch(0):
            a = torch.tanh(x * 2)  # its write holds the one IO thread (after its event wait)
            assert hold.entered.wait(60)
            b = torch.tanh(a * 3)  # queued behind it: its copy event not waited for yet
        loss = b.sum()
        del a, b  # backward reads them back from the drive
        rec.begin_capture()
        hold.go.set()  # the IO thread now waits for b's copy event, inside the capture
        deadline = time.monotonic() + 60
        while engine.completions.qsize() < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        rec.end_capture()
        assert engine.completions.qsize() >= 2, "the IO thread did not finish both writes"
        (g,) = torch.autograd.grad(loss, x)
        stats = off.end_step()
        engine.close()
    refused = rec.nodes("refused")
    assert refused == [], f"event waits refused during the capture: {refused}"
    waits = [n for n in rec.nodes("synchronize") if n.thread != threading.current_thread().name]
    assert len(waits) == 2, waits
    assert stats.fallbacks == 0 and stats.tensors_offloaded == 2 and stats.bytes_read > 0
    (gref,) = torch.autograd.grad(torch.tanh(torch.tanh(x * 2) * 3).sum(), x)
    assert torch.equal(g.view(torch.int32), gref.view(torch.int32))


# -- Megatron's CUDA-graph flags --------------------------------------------------------------

GRAPH_SETTINGS = [
    ({"enable_cuda_graph": True, "cuda_graph_impl": "local"}, "--enable-cuda-graph"),
    ({"external_cuda_graph": True, "cuda_graph_impl": "transformer_engine"}, "--external-cuda-graph"),
    ({"cuda_graph_impl": "local"}, "--cuda-graph-impl local"),
    ({"cuda_graph_impl": "transformer_engine"}, "--cuda-graph-impl transformer_engine"),
]


@pytest.mark.parametrize("setting,flag", GRAPH_SETTINGS)
def test_the_launcher_refuses_cuda_graphs_with_one_line_naming_the_flag(tmp_path, setting, flag):
    pytest.importorskip("megatron.core")
    from ssdtrain_megatron import megatron as integration
    from ssdtrain_megatron.megatron.launch import LaunchError, install_from_args

    args = argparse.Namespace(ssd_offload=True, ssd_offload_dir=[str(tmp_path)], **setting)
    try:
        with pytest.raises(LaunchError) as err:
            install_from_args(args)
    finally:
        if integration.installed() is not None:  # the refusal failed: leave the next test a clean slate
            integration.uninstall()
    assert str(err.value).count("\n") == 0
    assert f"remove {flag}, or run without --ssd-offload" in str(err.value)
    assert integration.installed() is None
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("setting,flag", GRAPH_SETTINGS)
def test_a_step_whose_model_config_has_cuda_graphs_is_refused_before_it_runs(tmp_path, setting, flag):
    pytest.importorskip("megatron.core")
    from ssdtrain_megatron import megatron as integration

    model = torch.nn.Linear(2, 2)
    model.config = types.SimpleNamespace(**setting)
    ran = []
    integration.install(OffloadConfig(dirs=[str(tmp_path)], min_tensor_bytes=0))
    try:
        from megatron.core.pipeline_parallel import get_forward_backward_func  # the patched one

        fb = get_forward_backward_func(pp_size=1, vp_size=None)
        with pytest.raises(ValueError, match=f"remove {flag}, or run without --ssd-offload"):
            fb(forward_step_func=lambda *a: ran.append(a), data_iterator=None, model=model,
               num_microbatches=1, seq_length=1, micro_batch_size=1)
        assert ran == []
    finally:
        integration.uninstall()


def test_cuda_graphs_off_are_not_a_conflict():
    pytest.importorskip("megatron.core")
    from ssdtrain_megatron.megatron import compat

    off = types.SimpleNamespace(enable_cuda_graph=False, external_cuda_graph=False, cuda_graph_impl="none")
    assert compat.cuda_graphs_in_use(off) == []
    assert compat.cuda_graphs_in_use(argparse.Namespace()) == []


# -- on a GPU ----------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_a_real_capture_inside_a_micro_batch_keeps_its_tensors(tmp_path):
    """torch.cuda.graph capturing a forward that saves tensors, inside the offloader's scope:
    no error from the capture (an event or copy inside it would raise), every saved tensor
    counted in captured_kept, nothing offloaded; the replayed output is bitwise the eager one."""
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(1 << 16, device=dev)
    eager = torch.tanh(x * 2)
    static_x = x.clone().requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with ActivationOffloader(_config(tmp_path), device=dev) as off:
        with torch.cuda.stream(side):  # warm up outside the capture, as torch asks
            with off.microbatch(0):
                torch.tanh(static_x * 2)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with off.microbatch(1), torch.cuda.graph(g):
            out = torch.tanh(static_x * 2)
        g.replay()
        torch.cuda.synchronize()
        stats = off.end_step()
    assert stats.captured_kept >= 1
    assert torch.equal(out.detach().view(torch.int32), eager.view(torch.int32))
