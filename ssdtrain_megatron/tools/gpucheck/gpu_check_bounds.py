"""The rates of the fair bounds (ssdtrain_megatron/telemetry/bounds.py), measured in the measure
step's own run and in the step's own pattern, and each point's bound from them.

- :func:`record_sizes`: what autograd saves in one step of keep (the sizes the offloader
  records: the device's tensors of at least ``min_tensor_bytes``, parameters left out, each
  tensor once), in save order.
- :func:`measure_link`: device -> host, host -> device, and both at once, on registered host
  memory (``StreamOps.pinned_pool``: an anonymous mapping pinned with ``cudaHostRegister``, as
  the memory engine's pool is) at the records' sizes, each at a 512-byte extent as the pool
  places them, on two streams of our own. The first GPU run's bound came from one 1 GiB
  ``cudaHostAlloc`` copy, one direction at a time.
- :func:`measure_drive`: the posix engine with the point's settings writing the step's bytes at
  the records' sizes, sustained (at most ``max_inflight_bytes`` in flight), then reading them
  back last-written first, into its slab as it allocates it (io/slab.py: created on the first
  write). The first run's bound came from io-bench's 256 MiB segments of CPU tensors.

Everything goes through ``StreamOps`` (cache/stream_ops.py) and the engine interface: on the
CPU the recording stand-in (tests/recording_streams.py) runs the same code.
"""

from __future__ import annotations

import collections
import statistics
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch

from .gpu_check_plan import LINK_BYTES
from ssdtrain_megatron import OffloadConfig
from ssdtrain_megatron.io.layout import align_up
from ssdtrain_megatron.io.memory import POOL_ALIGN
from ssdtrain_megatron.telemetry.bounds import Bound, drive_bound, link_bound, stall_beyond_deficit
from ssdtrain_megatron.telemetry.breakdown import breakdown

LINK_REPEATS = 3


def record_sizes(model, min_bytes: int) -> List[int]:
    """The bytes of each tensor one step of ``model`` saves for backward that the offloader
    would record (module docstring); the step runs with nothing installed (keep)."""
    params = {p.untyped_storage().data_ptr() for p in model.params}
    seen, sizes = set(), []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.device == model.device and t.nbytes >= min_bytes and t.untyped_storage().data_ptr() not in params:
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
            if key not in seen:
                seen.add(key)
                sizes.append(t.nbytes)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.step()
    return sizes


def _cycle(sizes: Sequence[int], total: float) -> List[int]:
    """``sizes`` in order, again from the start as needed, until they add up to ``total``."""
    if not sizes:
        raise ValueError("no record sizes: the step saved nothing the offloader would record")
    out, n = [], 0
    while n < total:
        out.append(sizes[len(out) % len(sizes)])
        n += out[-1]
    return out


def measure_link(ops: Any, device: torch.device, sizes: Sequence[int], hold: Callable[[], None],
                 nbytes: int = LINK_BYTES, repeats: int = LINK_REPEATS) -> Dict[str, object]:
    """Bytes per second D2H, H2D and both at once (both: the bytes of the two directions over
    the time the two take together), the median of ``repeats``; see the module docstring.
    ``hold()`` delays the current stream (a sleep kernel) while the copies are issued, so
    that they start together and the host's issuing is not timed."""
    chunk = _cycle(sizes, min(nbytes, sum(sizes)))
    offsets, total = [], 0
    for n in chunk:
        offsets.append(total)
        total += align_up(n, POOL_ALIGN)
    host_out, host_in = ops.pinned_pool(total), ops.pinned_pool(total)
    dev_out = torch.empty(total, dtype=torch.uint8, device=device)
    dev_in = torch.zeros(total, dtype=torch.uint8, device=device)

    def views(buf: torch.Tensor) -> List[torch.Tensor]:
        return [buf[o:o + n] for o, n in zip(offsets, chunk)]

    out_s, in_s = ops.new_stream(device), ops.new_stream(device)
    plans = {"d2h": [(out_s, views(host_out), views(dev_out))], "h2d": [(in_s, views(dev_in), views(host_in))]}
    plans["both"] = plans["d2h"] + plans["h2d"]

    def once(name: str) -> float:
        hold()
        start = ops.timing_event()
        start.record(ops.current_stream(device))
        ends = []
        for stream, dsts, srcs in plans[name]:
            stream.wait_event(start)
            with ops.use(stream):
                for d, s in zip(dsts, srcs):
                    ops.copy(d, s)
            end = ops.timing_event()
            end.record(stream)
            ends.append(end)
        for e in ends:
            e.synchronize()
        return max(float(start.elapsed_time(e)) for e in ends) / 1e3

    once("both")  # first touch of the device buffers, the copy engines' set-up
    moved = sum(chunk)
    rates = {}
    for name, n in (("d2h", moved), ("h2d", moved), ("both", 2 * moved)):
        rates[name] = n / max(statistics.median(once(name) for _ in range(repeats)), 1e-9)
    return dict(rates, bytes=moved, records=len(chunk), memory="registered (StreamOps.pinned_pool)")


def _sustained(engine: Any, op: str, keys: Sequence[Tuple[int, int]], buf: torch.Tensor, window: int,
               timeout: float) -> float:
    """Seconds for ``keys`` ((key, bytes), in order) written from or read into ``buf``, with at
    most ``window`` bytes in flight."""
    import time

    pending: Deque[Tuple[Any, int]] = collections.deque()
    inflight = 0
    t0 = time.perf_counter()
    for key, n in keys:
        while pending and inflight + n > window:
            fut, nb = pending.popleft()
            fut.result(timeout)
            inflight -= nb
        fut = engine.write(key, buf[:n]) if op == "write" else engine.read(key, buf[:n])
        pending.append((fut, n))
        inflight += n
    for fut, _ in pending:
        fut.result(timeout)
    return time.perf_counter() - t0


def measure_drive(cfg: OffloadConfig, ops: Any, sizes: Sequence[int], written: float,
                  read: float) -> Dict[str, float]:
    """The posix engine with ``cfg`` (its dirs, threads, chunks, ``max_inflight_bytes``) writing
    ``written`` bytes at the records' sizes, then reading ``read`` bytes back, last written
    first: bytes per second each way (module docstring)."""
    from ssdtrain_megatron.io import make_engine

    keys = list(enumerate(_cycle(sizes, written)))
    back, n_back = [], 0
    for key, n in reversed(keys):
        if n_back >= read:
            break
        back.append((key, n))
        n_back += n
    biggest = max(n for _, n in keys)
    src, dst = ops.pinned_pool(biggest), ops.pinned_pool(biggest)
    engine = make_engine(cfg.replace(engine="posix", policy="offload", job=f"{cfg.job_id()}-drive"))
    try:
        window = max(cfg.max_inflight_bytes, biggest)
        write_s = _sustained(engine, "write", keys, src, window, cfg.io_timeout_s)
        read_s = _sustained(engine, "read", back, dst, window, cfg.io_timeout_s) if back else 0.0
        for key, _ in keys:
            engine.release(key)
        engine.end_step()
    finally:
        engine.close()
    n_written = sum(n for _, n in keys)
    return {"write": n_written / max(write_s, 1e-9), "read": n_back / max(read_s, 1e-9) if back else 0.0,
            "bytes_written": n_written, "bytes_read": n_back, "write_s": write_s, "read_s": read_s}


def bound_for(point: dict, keep_s: float, rates: Dict[str, Optional[dict]]) -> Optional[Bound]:
    """The point's bound: its engine's (memory: the link; posix: the drive) with its bytes per
    step, or keep's step where it moves nothing through an engine; None when the rates it
    needs were not measured. With one micro-batch a step (every shape here; a point's
    ``num_microbatches``, 1 if absent) reads follow their writes: telemetry/bounds.py."""
    w, r = point.get("bytes_written") or 0.0, point.get("bytes_read") or 0.0
    engine = point.get("engine") if point.get("policy") not in ("keep", "save_on_cpu") else None
    if engine == "memory" and w:
        link = rates.get("link")
        return link_bound(keep_s, w, r, link["d2h"], link["h2d"], link["both"],
                          reads_after_writes=point.get("num_microbatches", 1) == 1) if link else None
    if engine == "posix" and w:
        drive = rates.get("drive")
        return drive_bound(keep_s, w, r, drive["write"], drive["read"]) if drive and drive["read"] else None
    return Bound(keep_s, "keep", "compute", {"keep": keep_s}, 0.0)


def assumed_rates(rates: Dict[str, Optional[dict]]) -> Dict[str, float]:
    """The bound's rates by the keys of telemetry/breakdown.py ``io_figures``."""
    link, drive = rates.get("link") or {}, rates.get("drive") or {}
    return {k: v for k, v in (("d2h", link.get("d2h")), ("h2d", link.get("h2d")), ("both", link.get("both")),
                              ("drive_write", drive.get("write")), ("drive_read", drive.get("read"))) if v}


def judge_points(points: List[dict], k: int, rates: Dict[str, Optional[dict]],
                 timelines: Dict[str, list]) -> None:
    """In place, every measured point at micro-batch ``k`` but keep: its bound (the formula and
    every term), its median over it, the stall beyond the IO deficit, and, where its timeline
    was recorded (``timelines``: point -> events), its excess split by cause
    (telemetry/breakdown.py; against keep's timeline where compute binds)."""
    keep = next((p for p in points if p["name"] == f"keep@{k}" and p.get("ok")), None)
    if keep is None:
        return
    for p in points:
        if not p.get("ok") or p["micro_batch"] != k or p is keep:
            continue
        bound = bound_for(p, keep["step_s"], rates)
        if bound is None:
            p["bound_why"] = f"no {'link' if p['engine'] == 'memory' else 'drive'} rates were measured"
            continue
        beyond = stall_beyond_deficit(p["stall_s"], bound.io_s, keep["step_s"])
        p.update(bound=bound.as_dict(), vs_bound=p["step_s"] / bound.seconds, stall_beyond_s=beyond,
                 stall_beyond_fraction=beyond / p["step_s"])
        if p["name"] in timelines:
            p["breakdown"] = breakdown(timelines[p["name"]], p["step_s"], bound,
                                       keep_events=timelines.get(keep["name"]), assumed=assumed_rates(rates))
