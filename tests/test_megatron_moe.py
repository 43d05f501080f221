"""Mixture-of-experts layers of megatron-core through install(): what only MoE brings.

The expert-parallel layouts themselves (EP=2 with the allgather and alltoall dispatchers, with
selective and full recompute, with PP=2) are in megatron_harness.LAYOUTS and go through every
check of test_megatron_integration.py. Here: the saved tensors of dtypes a dense GPT never
saves, and the CPU runtime's MoE stand-ins.
"""

from __future__ import annotations

import os
import sys
from typing import Dict, Set

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

pytest.importorskip("megatron.core")

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron.*"),
              pytest.mark.filterwarnings("ignore::UserWarning:megatron.*")]

import megatron_cpu_compat  # noqa: E402
import megatron_harness as harness  # noqa: E402
from megatron_harness import LayoutSpec, Phase  # noqa: E402

from ssdtrain_megatron.cache.hooks import SavedTensorHooks  # noqa: E402
from ssdtrain_megatron.io.posix import PosixEngine  # noqa: E402

OFFLOAD = dict(dirs=["{root}/a"], policy="offload", min_tensor_bytes=0)
MOE_DTYPES = (torch.bool, torch.int64, torch.float32)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same width (bool as uint8): compared exactly."""
    if t.dtype == torch.bool:
        return t.contiguous().view(torch.uint8)
    if t.is_floating_point():
        return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t.contiguous()


class _SavedTensorLog:
    """Wraps the offloader's pack/unpack and the posix engine's read (class attributes, this
    process only) to keep, per record, a copy of what was saved, its dtype, and whether it was
    read back from the engine; unpack compares what backward gets with the copy."""

    def __init__(self, monkeypatch) -> None:
        self.saved: Dict[int, torch.Tensor] = {}
        self.read: Set[int] = set()
        self.unpacked: Dict[torch.dtype, int] = {}
        self.read_back: Dict[torch.dtype, int] = {}
        self.written: Set[int] = set()
        self.forwarded_written: Dict[torch.dtype, int] = {}  # written, given back from memory
        self.mismatches: list = []
        pack, unpack = SavedTensorHooks.pack, SavedTensorHooks.unpack
        engine_read, engine_write = PosixEngine.read, PosixEngine.write

        def logged_pack(off, t):
            handle = pack(off, t)
            if not isinstance(handle, torch.Tensor):
                self.saved.setdefault(handle.record.id, t.detach().clone())
            return handle

        def logged_read(engine, key, out, ready_event=None):
            self.read.add(key)  # the engine's key is the record's id
            return engine_read(engine, key, out, ready_event)

        def logged_write(engine, key, data, ready_event=None):
            self.written.add(key)
            return engine_write(engine, key, data, ready_event)

        def logged_unpack(off, handle):
            out = unpack(off, handle)
            if isinstance(handle, torch.Tensor):
                return out
            rid = handle.record.id
            want = self.saved[rid]
            if out.dtype != want.dtype or out.shape != want.shape or \
                    not torch.equal(_bytes(out), _bytes(want)):
                self.mismatches.append((rid, want.dtype, tuple(want.shape)))
            self.unpacked[want.dtype] = self.unpacked.get(want.dtype, 0) + 1
            if rid in self.written and rid not in self.read:  # e.g. saved again while on disk
                self.forwarded_written[want.dtype] = self.forwarded_written.get(want.dtype, 0) + 1
            if rid in self.read:
                self.read_back[want.dtype] = self.read_back.get(want.dtype, 0) + 1
            return out

        monkeypatch.setattr(SavedTensorHooks, "pack", logged_pack)
        monkeypatch.setattr(SavedTensorHooks, "unpack", logged_unpack)
        monkeypatch.setattr(PosixEngine, "read", logged_read)
        monkeypatch.setattr(PosixEngine, "write", logged_write)


def test_moe_saved_tensors_of_every_dtype_are_read_back_byte_for_byte(tmp_path, monkeypatch):
    """The router saves fp32 probabilities, the dispatcher bool routing maps and int64 token
    indices: each is written, read back from the engine and given to backward with exactly
    the bytes autograd saved, and training stays bitwise that of a run without offload.
    Broken variants (each run once): invert bool tensors in Transfers.materialize ->
    "first extra item: (110, torch.bool, (16, 2))"; pass int64 tensors through in
    SavedTensorHooks.pack -> "AssertionError: (torch.int64, ...) assert 0 > 0".
    One process, EP=1: megatron-core 0.16.1's SequentialMLP with linear biases modifies the
    world-size-1 reduce's output in place and autograd refuses it, so no biases here (the
    expert-parallel layouts of LAYOUTS keep them)."""
    spec = LayoutSpec(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
                      num_layers=2, num_microbatches=2, add_bias_linear=False,
                      iterations=2, phases=[Phase("plain"), Phase("offload", offload=OFFLOAD)])
    log = _SavedTensorLog(monkeypatch)
    (r,) = harness.run_layout(spec, str(tmp_path))
    assert log.mismatches == []
    for dtype in (torch.int64, torch.float32):
        assert log.read_back.get(dtype, 0) > 0, (dtype, log.unpacked, log.read_back)
    # The routing map (bool): on megatron-core 0.19 it is saved a second time after its write
    # completed, alive, so backward gets it from memory (no read: reading would only repeat the
    # bytes it has); on 0.16 it is read back. Either way it was written, and its bytes are
    # checked above (mismatches).
    assert log.read_back.get(torch.bool, 0) + log.forwarded_written.get(torch.bool, 0) > 0, \
        (log.unpacked, log.read_back, log.forwarded_written)
    assert harness.phase_differences(r.phases["plain"], r.phases["offload"]) == []
    assert sum(s["bytes_read"] for s in r.phases["offload"].offload["steps"]) > 0
    assert r.phases["offload"].offload["files_after_close"] == []


def test_cpu_runtime_moe_stand_ins_are_named_and_undone():
    """The alltoall dispatcher's side stream and megatron-core 0.16's missing TE gemm name
    exist only while the CPU runtime is enabled, as stand-ins; disable() puts back torch's own.
    Broken variants: no _patch_moe_stand_ins -> "RuntimeError: torch.cuda.Stream requires CUDA
    support"; no patch of the class's cuda_dtoh_stream -> "assert <...CpuStreamStandIn ...> is None"."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    from ssdtrain_megatron.tools.megatron_cpu import CpuStreamStandIn

    stream_cls, had_gemm = torch.cuda.Stream, hasattr(moe_utils, "te_general_gemm")
    apply = torch.autograd.function.BackwardCFunction.__dict__["apply"]
    move = token_dispatcher.maybe_move_tensor_to_cpu
    dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher
    class_stream = dispatcher.cuda_dtoh_stream
    with megatron_cpu_compat.enabled():
        dispatcher.cuda_dtoh_stream = torch.cuda.Stream()  # what the first dispatcher does
        side = torch.cuda.Stream()
        assert isinstance(side, CpuStreamStandIn) and side != torch.cuda.current_stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            side.record_event().synchronize()
        assert moe_utils.te_general_gemm is None or had_gemm
        splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
        assert splits.tolist() == [3, 1] and not torch.is_tensor(splits)
    assert torch.cuda.Stream is stream_cls
    assert hasattr(moe_utils, "te_general_gemm") == had_gemm
    assert torch.autograd.function.BackwardCFunction.__dict__["apply"] is apply
    assert token_dispatcher.maybe_move_tensor_to_cpu is move
    assert dispatcher.cuda_dtoh_stream is class_stream  # no stand-in left on the class


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="grouped GEMM experts and the flex dispatcher need CUDA (TE, DeepEP) "
                           "and 2 GPUs for EP=2; not yet run")
def test_moe_grouped_gemm_expert_parallel_on_gpus_is_bitwise(tmp_path):  # pragma: no cover
    spec = LayoutSpec(**harness._MOE, device="cuda", moe_grouped_gemm=True,
                      phases=[Phase("plain"), Phase("offload", offload=OFFLOAD)])
    for r in harness.run_layout(spec, str(tmp_path)):
        assert harness.phase_differences(r.phases["plain"], r.phases["offload"]) == []
        assert sum(s["bytes_read"] for s in r.phases["offload"].offload["steps"]) > 0
