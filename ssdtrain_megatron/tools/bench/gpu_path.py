"""``ssdtrain core-bench --gpu-path``: the GPU data path's own Python, per offloaded tensor.

On a CPU the path runs with streams, events and copies that do nothing but count their calls
(``cache/stream_ops.NullStreams``): what is timed is this package's code on that path (the
pack and unpack hooks, the hand-over in batches at each layer's start, staging, events,
bookkeeping), not CUDA. A step of ``n`` tensors of ``nbytes`` in layers of ``per_layer``
(about what one transformer layer saves), one micro-batch; the forward's and the backward's
thread CPU time over the tensors, and the stream, event and copy calls per record on the way
out (forward, hand-over, completion) and back (read-ahead, reads, unpack). Two engines: the
memory engine (copies into and out of its pool) and posix (through pinned staging; its IO
threads do real IO of bytes nobody checks).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from typing import Dict, List, Tuple

from ...config import OffloadConfig
from ..gc_freeze import gc_frozen

PER_LAYER = 18
"""Tensors per layer: what a transformer layer of the local spec saves (GPU-REVIEW: ~18)."""


def gpu_path_costs(cfg: OffloadConfig, n: int, nbytes: int, rounds: int, per_layer: int = PER_LAYER) -> dict:
    """Per engine: ``gpu_path_pack_us`` and ``gpu_path_unpack_us`` (µs of thread CPU time per
    tensor, the median over ``rounds`` steps), the same with Python's collector frozen
    (``..._gc_frozen``: what Megatron's --manual-gc gives; with it on, a full collection now and
    then walks the whole heap, torch's and the model's, inside whichever call allocated last),
    and ``stream_calls_per_record`` (``out``, ``back``)."""
    keys = ("gpu_path_pack_us", "gpu_path_unpack_us", "gpu_path_pack_us_gc_frozen",
            "gpu_path_unpack_us_gc_frozen", "stream_calls_per_record")
    out: Dict[str, dict] = {k: {} for k in keys}
    for engine in ("memory", "posix"):
        c = cfg.replace(engine=engine, policy="offload", min_tensor_bytes=0, keep_last_layers=1,
                        host_memory_bytes=2 * n * nbytes + (64 << 20), max_inflight_bytes=2 * n * nbytes,
                        pinned_staging_bytes=2 * n * nbytes + (64 << 20))
        runs, frozen = [], []
        for _ in range(rounds):  # the two kinds alternate, so the machine's swings hit both
            runs.append(gpu_path_step(c, n, nbytes, per_layer))
            with gc_frozen():
                frozen.append(gpu_path_step(c, n, nbytes, per_layer))
        for i, key in ((0, "pack"), (1, "unpack")):
            out[f"gpu_path_{key}_us"][engine] = statistics.median(r[i] for r in runs)
            out[f"gpu_path_{key}_us_gc_frozen"][engine] = statistics.median(r[i] for r in frozen)
        out["stream_calls_per_record"][engine] = {k: statistics.median(r[2][k] for r in runs) for k in ("out", "back")}
        calls = out["stream_calls_per_record"][engine]
        print(f"gpu path ({engine}): pack {out['gpu_path_pack_us'][engine]:.1f} µs/tensor "
              f"({out['gpu_path_pack_us_gc_frozen'][engine]:.1f} after gc.freeze()), unpack "
              f"{out['gpu_path_unpack_us'][engine]:.1f} ({out['gpu_path_unpack_us_gc_frozen'][engine]:.1f}); "
              f"stream calls per record: out {calls['out']:.1f}, back {calls['back']:.1f}", file=sys.stderr)
    return out


def gpu_path_step(cfg: OffloadConfig, n: int, nbytes: int, per_layer: int) -> Tuple[float, float, Dict[str, float]]:
    """One step through the GPU path with no-op streams: (pack µs, unpack µs, calls per record
    out and back), per tensor.

    Raises:
        RuntimeError: the step offloaded or read back less than it should have (the figures
            would not include the path they claim to).
    """
    import torch

    from ...cache import ActivationOffloader
    from ...cache.stream_ops import NullStreams

    ops = NullStreams()
    src = torch.randn(nbytes // 4, requires_grad=True)
    tensors = [src.mul(1.0) for _ in range(n)]  # activations: distinct storages, with grad_fn
    clock = time.thread_time_ns
    with ActivationOffloader(cfg, streams=ops) as off:
        pack, unpack = off.hooks.pack, off.hooks.unpack
        handles: List[object] = []
        t0, calls0 = clock(), ops.calls
        with off.microbatch(0), contextlib.ExitStack() as layers:
            for i, t in enumerate(tensors):
                if i % per_layer == 0:  # the next layer: the one before it is handed over now
                    layers.close()
                    layers.enter_context(off.layer(i // per_layer))
                handles.append(pack(t))
        off.wait_writes()
        out_ns, calls_out = clock() - t0, ops.calls - calls0
        del tensors, t
        t0, calls0 = clock(), ops.calls
        for i in range(len(handles) - 1, -1, -1):
            h, handles[i] = handles[i], None
            unpack(h)  # backward is done with it at once, and drops the handle
            del h
        back_ns, calls_back = clock() - t0, ops.calls - calls0
        stats = off.end_step()
    offloaded = n - per_layer  # the last layer is kept (keep_last_layers=1)
    if stats.tensors_offloaded < offloaded or stats.bytes_read < offloaded * nbytes:
        raise RuntimeError(f"core-bench --gpu-path ({cfg.engine}): {stats.tensors_offloaded} tensors offloaded, "
                           f"{stats.bytes_read} bytes read back; expected {offloaded} and {offloaded * nbytes}")
    return out_ns / n / 1e3, back_ns / n / 1e3, {"out": calls_out / offloaded, "back": calls_back / offloaded}
