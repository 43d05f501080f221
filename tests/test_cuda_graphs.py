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
