"""What the GPU data path costs the training thread per record, counted on a CPU: stream,
event and copy calls (``NullStreams``, the no-op stand-in ``ssdtrain core-bench --gpu-path``
times the path with), one producer event and one stream context per layer's batch of writes,
events taken from a pool, and restored tensors allocated at their own size.

Figures before these changes (core-bench --gpu-path on the first H200 run's code, one record
handed over per pack): 10 calls per record out, 12 back. Broken variants, each tried once:
``DeviceCopy.writes`` opening no batch (each record its own producer event and context) fails
the batch test; ``_recycle`` dropping events fails the pool test; ``pad=False`` removed from
``DeviceCopy.restore`` fails the size test, and so does the allocation moved back inside
``ops.use(reload_stream)`` (issue 54, fault A).
"""

from __future__ import annotations

import pytest
import torch

from ssdtrain_megatron import ActivationOffloader, OffloadConfig
from ssdtrain_megatron.cache.device_copy import DeviceCopy
from ssdtrain_megatron.cache.record import TensorRecord
from ssdtrain_megatron.io.slab_engine import aligned_buffer
from ssdtrain_megatron.tools.bench.gpu_path import gpu_path_step
from tests.recording_streams import Recorder
from tests.test_device_copy import Saves, _config

PER_LAYER = 6


@pytest.mark.parametrize("engine", ["memory", "posix"])
def test_a_record_costs_a_few_stream_calls_each_way(tmp_path, engine):
    cfg = OffloadConfig(dirs=[str(tmp_path)], engine=engine, min_tensor_bytes=0, keep_last_layers=1,
                        host_memory_bytes=64 << 20, max_inflight_bytes=64 << 20, pinned_staging_bytes=64 << 20)
    _, _, calls = gpu_path_step(cfg, 20 * PER_LAYER, 4096, PER_LAYER)
    # Back: 2 more than before issue 54's fault A was fixed (the allocation event on the compute
    # stream and the reload stream's wait on it), one fewer where the consumer is the stream
    # the tensor came from (no record_stream).
    assert calls["out"] <= 6 and calls["back"] <= 10.5, calls


def _layers_of_saves(off, rec, n_layers: int, per_layer: int, device):
    """One micro-batch: ``n_layers`` layers, each saving ``per_layer`` tensors."""
    x = torch.randn(64, 3 * 128, generator=torch.Generator().manual_seed(0)).to(device).requires_grad_()
    with off.microbatch(0):
        h = x
        for i in range(n_layers):
            with off.layer(i):
                parts = [Saves.apply(h * (j + 1), False, rec) for j in range(per_layer)]
                h = sum(parts) / per_layer
        loss = h.sum()
    off.wait_writes()
    loss.backward()
    return off.end_step()


def test_a_layers_writes_wait_on_one_producer_event_in_one_stream_context(tmp_path):
    rec = Recorder()
    cpu = torch.device("cpu")
    with ActivationOffloader(_config(tmp_path, "posix").replace(keep_last_layers=1), device=cpu, streams=rec) as off:
        offload = off.copy.offload_stream.name
        stats = _layers_of_saves(off, rec, 4, PER_LAYER, cpu)
    waits = rec.nodes("wait")
    offload_waits = [n for n in waits if n.agent == offload]
    assert stats.tensors_offloaded == 3 * PER_LAYER  # the last layer is kept
    assert len(offload_waits) == 3, f"{len(offload_waits)} producer waits for 3 layers' batches"


def test_events_come_from_a_pool(tmp_path):
    """The second step makes no event the first did not: each went back to the pool once
    nothing would wait on it again."""
    rec = Recorder()
    cpu = torch.device("cpu")
    with ActivationOffloader(_config(tmp_path, "memory").replace(keep_last_layers=1), device=cpu, streams=rec) as off:
        _layers_of_saves(off, rec, 4, PER_LAYER, cpu)
        after_first = rec._n_events
        stats = _layers_of_saves(off, rec, 4, PER_LAYER, cpu)
        after_second = rec._n_events
    assert stats.bytes_read > 0
    assert after_second == after_first, f"{after_second - after_first} new events in the second step"


@pytest.mark.parametrize("residue", [0, 64])
def test_a_restored_tensor_is_allocated_at_its_own_size(residue):
    """A tensor that began on a 512-byte boundary (CUDA's allocator gives every block one) comes
    back in memory of exactly its bytes, allocated on the current (compute) stream: the stream
    whose pool the block it came from went back to, and padding would put it in the
    allocator's next size class, where it could not reuse that block (tests/test_restore_memory.py
    measures the reuse). One at another residue is padded to reach it (bitwise gradients must
    not depend on where the bytes came back to). The reload stream's copy waits for the
    allocation's point on the compute stream."""
    rec = Recorder()
    copy = DeviceCopy(torch.device("cpu"), 1 << 20, rec)
    mem = aligned_buffer(4096 * 4 + 512)[residue:residue + 4096 * 4].view(torch.float32)
    mem.copy_(torch.arange(4096, dtype=torch.float32))
    r = TensorRecord(0, mem, 0, 0)
    host = mem.clone().view(torch.uint8)
    copy.restore(r, source=host)
    (alloc,) = rec.nodes("alloc")
    assert alloc.tags["nbytes"] == r.nbytes + (0 if residue == 0 else 512)
    assert alloc.agent == rec.default.name, f"allocated on {alloc.agent}, not the current stream"
    (h2d,) = [n for n in rec.nodes("copy") if n.agent == copy.reload_stream.name]
    assert rec.happens_before(alloc, h2d), "the reload copy is not ordered after the allocation"
    assert r.tensor.data_ptr() % 512 == residue
    r.transfer.ready_event.synchronize()  # the copy ran (the stand-in's streams run when they like)
    assert torch.equal(r.tensor.view(torch.int32), mem.view(torch.int32))
    copy.close()
