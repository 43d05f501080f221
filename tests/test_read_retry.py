"""A failed read is retried a bounded number of times and counted; when every try fails the
step stops with one error naming the tensor's layer and the file, never a wrong tensor, and
the files are removed (issue 28, section 2). Faults come from tests/faulty.py on real files."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from torch import nn

from ssdtrain_megatron import OffloadConfig
from ssdtrain_megatron.cache.transfers import READ_RETRIES
from tests.faulty import faulty_offloader
from tests.test_offloader import files_under


def _step(off, lin, x):
    with off.microbatch(0):
        with off.layer(3):
            out = lin(x).sin()  # saves lin's output: 64 KiB, dropped by us, read in backward
    off.wait_writes()
    return out


def _failing_reads(times):
    calls = []

    def fault(op, path, offset, nbytes):
        if op == "read":
            calls.append(path)
            if len(calls) <= times:
                return OSError(errno.EIO, os.strerror(errno.EIO))
        return None
    return fault, calls


def _conf(d):
    return OffloadConfig(dirs=[str(d)], min_tensor_bytes=1024, keep_last_layers=0)


def test_a_read_that_fails_once_is_retried_and_the_gradient_is_bitwise_right(offload_dir):
    """Break: READ_RETRIES = 0 -> backward raises "failed ... the only copy is lost"."""
    torch.manual_seed(0)
    lin = nn.Linear(128, 128)
    x = torch.randn(128, 128)
    lin(x).sin().sum().backward()
    want = lin.weight.grad.clone()
    lin.weight.grad = lin.bias.grad = None
    with faulty_offloader(_conf(offload_dir)) as off:
        out = _step(off, lin, x)
        off.engine.fault, calls = _failing_reads(1)
        out.sum().backward()
        st = off.end_step()
    assert st.read_retries == 1 and st.bytes_read >= 128 * 128 * 4  # read back from the engine
    assert len(calls) >= 2
    assert torch.equal(lin.weight.grad.view(torch.int32), want.view(torch.int32))
    assert files_under(offload_dir) == []


def test_a_read_whose_retries_all_fail_names_layer_and_file_and_leaves_no_file(offload_dir):
    """Break: drop the layer from TensorRecord.describe() -> the match fails."""
    lin = nn.Linear(128, 128)
    with faulty_offloader(_conf(offload_dir)) as off:
        out = _step(off, lin, torch.randn(128, 128))
        off.engine.fault, calls = _failing_reads(10 ** 6)
        with pytest.raises(RuntimeError, match=rf"reading back a tensor of shape \[128, 128\] .* \(layer 3, "
                                               rf"micro-batch 0\) failed \({READ_RETRIES + 1} attempts\), "
                                               rf"the only copy is lost: .*{offload_dir}.*slab.bin.*Input/output error"):
            out.sum().backward()
        assert lin.weight.grad is None  # nothing computed from a wrong tensor
        assert len(calls) >= READ_RETRIES + 1  # this tensor's tries (a prefetch may add one)
        off.end_step()
    assert files_under(offload_dir) == []
