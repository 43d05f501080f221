"""A saved tensor whose owner frees its storage in place while its copy to host memory runs is
kept in memory, not trusted from that copy.

Nothing marks the device bytes a write's device->host copy reads as used by the offload
stream (no ``record_stream``: cache/device_copy.py), so an owner that frees the storage in
place (``untyped_storage().resize_(0)``) after the record was handed over lets the allocator
give that memory out again under the copy. megatron-core's ``CheckpointWithoutOutput`` does
this (its outputs are kept out of offload: megatron/discarded.py); any other owner that frees a
saved tensor in place must refill it before backward, as it does, or backward breaks without us
too. So when the copy is seen landing on a storage that no longer holds the bytes at the same
place (``Transfers._landed``), the record falls back to memory (counted in ``fallbacks``) and
backward reads the owner's refill, as without the offloader.

CPU machine: the recording stand-in for CUDA with the offload stream ``unobserved`` until the
owner has freed the storage (tests/recording_streams.py); engines, files and autograd are
real. The stand-in copies when the copy is issued, so the bytes it landed are right here; on a
GPU they may not be. Broken variant tried: the storage check in ``_landed`` removed fails both
cases (the record is written and read back: ``fallbacks == 0``).
"""

from __future__ import annotations

import pytest
import torch

from ssdtrain_megatron import ActivationOffloader, OffloadConfig
from ssdtrain_megatron.cache.lifecycle import State
from ssdtrain_megatron.io import make_engine
from tests.recording_streams import Recorder
from tests.test_staging_race import Logged

N = 16 * 1024


class SavesAndShares(torch.autograd.Function):
    """y = x + 1, saved for backward; the saved tensor is handed to ``owner`` (who frees it
    in place and refills it later, as CheckpointWithoutOutput does); backward records it."""

    @staticmethod
    def forward(ctx, x, owner, seen):
        y = x + 1
        ctx.save_for_backward(y)
        owner.append(y)
        ctx.seen = seen
        return y * 1

    @staticmethod
    def backward(ctx, g):
        (s,) = ctx.saved_tensors
        ctx.seen.append(s.clone())
        return g * 1, None, None


@pytest.mark.parametrize("engine", ["posix", "memory"])
def test_a_storage_freed_in_place_under_its_copy_is_kept_and_refilled_by_its_owner(tmp_path, engine):
    config = OffloadConfig(dirs=[str(tmp_path)], engine=engine, min_tensor_bytes=0, keep_last_layers=0,
                           prefetch_layers=1, max_inflight_bytes=1 << 20, pinned_staging_bytes=1 << 20,
                           host_memory_bytes=1 << 20)
    rec = Recorder()
    off = ActivationOffloader(config, device=torch.device("cpu"), engine=Logged(make_engine(config), rec),
                              streams=rec)
    owner, seen = [], []
    try:
        rec.unobserved.add(off.copy.offload_stream.name)  # the copy has not been seen to land
        x = torch.full((N,), 2.0).requires_grad_()
        with off.microbatch(0):
            y = SavesAndShares.apply(x, owner, seen)
        r = off.table.get(0)
        assert r.state == State.WRITING and r.inflight
        (saved,) = owner
        saved.untyped_storage().resize_(0)  # the owner frees it in place, under the copy
        rec.unobserved.discard(off.copy.offload_stream.name)
        off.wait_writes()
        saved.untyped_storage().resize_(N * 4)  # ... and refills it before backward
        # as CheckpointWithoutOutput refills: storage to storage (the version does not change)
        saved.untyped_storage().copy_(torch.full((N,), 3.0).untyped_storage())
        y.sum().backward()
        stats = off.end_step()
        assert stats.fallbacks == 1 and stats.tensors_offloaded == 0, (stats.fallbacks, stats.tensors_offloaded)
        assert torch.equal(seen[0].view(torch.int32), torch.full((N,), 3.0).view(torch.int32))
    finally:
        off.close()
