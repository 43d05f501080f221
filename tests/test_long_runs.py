"""A run of many small chunks: the posix engine merges contiguous queued chunks into one
preadv/pwritev, and a chunk read in place is its own iovec; the kernel refuses more than
IOV_MAX of them (EINVAL). Seen in tests/test_soak.py on a loaded machine: "posix read of
8220672 bytes ... failed: Invalid argument" (about 2,000 4 KiB chunks in one run).
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from ssdtrain_megatron.io.syscalls import IOV_MAX
from tests.bitwise import bitwise_equal
from tests.faulty import faulty_offloader
from tests.test_offloader import cfg, files_under


class _Sin(nn.Module):
    def forward(self, x):
        return x.sin()


class _FirstReadGate:
    """Holds the only IO thread in the first read until ``go``, so every later read queues
    behind it and the next run can take them all. Records each call's byte count."""

    def __init__(self) -> None:
        self.entered, self.go = threading.Event(), threading.Event()
        self.reads = []

    def __call__(self, op, path, offset, nbytes):
        if op == "read":
            self.reads.append(nbytes)
            if not self.go.is_set():
                self.entered.set()
                self.go.wait(60)
        return None


def test_more_queued_chunks_than_iov_max_are_read_back_in_several_calls(offload_dir):
    """Broken variant: drop ``IOV_MAX`` from the posix engine's get_run call; the run after
    the gate then takes every queued 4 KiB read (more than IOV_MAX) and preadv fails with
    EINVAL ("posix read of ... failed: Invalid argument")."""
    n = IOV_MAX + 200
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), *[_Sin() for _ in range(n)])
    x = torch.randn(1, 1024)
    model(x).sum().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    config = cfg(offload_dir, min_tensor_bytes=4096, io_threads=1, keep_last_layers=0,
                 prefetch_layers=1 << 20)
    with faulty_offloader(config) as off:
        gate = off.engine.fault = _FirstReadGate()
        with off.microbatch(0):
            loss = model(x).sum()
        off.wait_writes()  # every tensor on disk: backward reads them all
        threading.Timer(1.0, gate.go.set).start()  # the prefetch queues every read meanwhile
        loss.backward()
        st = off.end_step()
    assert gate.entered.is_set()
    assert all(bitwise_equal(a, b) for a, b in zip(ref, [p.grad for p in model.parameters()],
                                                   strict=True))
    assert st.bytes_read >= n * 4096
    assert max(gate.reads) <= IOV_MAX * 4096  # no call had more chunks than IOV_MAX
    assert max(gate.reads) > 4096  # reads were merged into runs, so the cap mattered
    assert files_under(offload_dir) == []
