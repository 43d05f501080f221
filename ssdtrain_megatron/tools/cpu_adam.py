"""The CPU optimizer rate of a node: ``cpu_adam_params_per_s`` of its profile, measured.

megatron-core's optimizer CPU offload steps the offloaded part of each rank's parameters with
torch's AdamW on the CPU, ``fused=True`` (megatron/core/optimizer/__init__.py builds it so), one
optimizer per rank, every local rank at once. This times that class on fp32 parameters in the
process that measures, on the threads one rank gets (the node's cores over its local ranks), and
bounds the figure by the rank's share of the memory bus where that is known: a step moves 28 B
per parameter (reads the parameter, its gradient and both moments, writes back three), and
every rank steps at the same moment after its backward.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from typing import Dict, Optional

log = logging.getLogger(__name__)

ADAM_BYTES_PER_PARAM = 28
"""Bytes one fused AdamW step moves per fp32 parameter: 4 reads (parameter, gradient, m, v)
and 3 writes (parameter, m, v) of 4 B."""
PARAMS = 8 << 20
"""fp32 parameters stepped per measurement (32 MiB each of parameters, gradients, m and v:
beyond the caches, as a rank's shard is)."""
REPEATS = 3


def cores_per_rank(local_ranks: int, cpus: Optional[int] = None) -> int:
    """The cores one rank gets: the CPUs this process may run on over the node's local ranks
    (at least one)."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cpus or 1) // max(local_ranks, 1))


def fused_adamw_params_per_s(threads: int, params: Optional[int] = None,
                             repeats: int = REPEATS) -> float:
    """Parameters per second of ``torch.optim.AdamW(fused=True)`` stepping ``params`` fp32
    parameters (default :data:`PARAMS`) on the CPU with ``threads`` torch threads (the median
    of ``repeats`` steps after a first that makes the moments)."""
    import torch

    params = params or PARAMS

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        weight = torch.nn.Parameter(torch.randn(params))
        weight.grad = torch.randn(params)
        opt = torch.optim.AdamW([weight], lr=1e-4, fused=True)
        opt.step()  # makes exp_avg and exp_avg_sq, as the first training step does
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return params / statistics.median(times)


def measure_cpu_adam(local_ranks: int, host_memory_gbps: Optional[float] = None,
                     cpus: Optional[int] = None) -> Dict[str, float]:
    """``params_per_s`` one rank's CPU AdamW steps with its share of the cores, bounded by its
    share of ``host_memory_gbps`` (GB/s, every rank at once); ``measured`` (the timing alone),
    ``threads`` and ``bus_bound`` (0: not known)."""
    threads = cores_per_rank(local_ranks, cpus)
    measured = fused_adamw_params_per_s(threads)
    bound = host_memory_gbps * 1e9 / max(local_ranks, 1) / ADAM_BYTES_PER_PARAM \
        if host_memory_gbps else 0.0
    rate = min(measured, bound) if bound else measured
    log.info("CPU AdamW: %.3g params/s on %d thread(s); bus bound %.3g", measured, threads, bound)
    return {"params_per_s": rate, "measured": measured, "threads": float(threads),
            "bus_bound": bound}


def describe(figures: Dict[str, float], local_ranks: int) -> str:
    """The words for a profile's ``source``."""
    words = (f"cpu_adam_params_per_s {figures['params_per_s']:.3g}: torch's fused AdamW on fp32 "
             f"parameters, {int(figures['threads'])} thread(s) (the cores over {local_ranks} local "
             f"rank(s)) measured {figures['measured']:.3g}")
    if figures["bus_bound"]:
        words += (f", bounded by the memory bus's share per rank {figures['bus_bound']:.3g} "
                  f"({ADAM_BYTES_PER_PARAM} B per parameter)")
    return words


__all__ = ["ADAM_BYTES_PER_PARAM", "cores_per_rank", "describe", "fused_adamw_params_per_s",
           "measure_cpu_adam"]
