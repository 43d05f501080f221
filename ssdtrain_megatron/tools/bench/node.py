"""`ssdtrain bench --node-emulation`: a GPU node's shape on a CPU machine.

On a GPU node the model's compute runs on the GPU and the IO threads on host cores, so IO
costs the step only where it makes the step wait; the drives are slower than a full offload
needs, and host memory smaller than a step's activations. The plain CPU bench runs compute and
IO on the same cores, which hides all of that behind contention. With ``--node-emulation``:

* compute runs on one core: the training thread is confined to ``--compute-cpus`` (default:
  the first CPU this process may use) and torch uses that many threads; the IO engines'
  threads confine themselves to ``--io-cpus`` (default: the next CPU; ``OffloadConfig.io_cpus``);
* the SSD tier's bandwidth is capped (``--ssd-gbps``; default: half of what a full offload of
  the largest micro-batch size needs: every layer but the last written in the first half of
  keep's step and read back in the second) and the host tier holds ``--host-memory`` (default:
  half of one micro-batch's layer activations at that size, below what one step writes);
* the C allocator keeps freed host memory for reuse (:func:`cache_freed_host_memory`), as a
  GPU's caching allocator keeps freed device memory;
* the strategies are keep, offload (to the capped SSD, posix), host (the host tier alone, the
  memory engine: what does not fit stays in memory), planned (the four-place plan of
  plan/tiers.py for this node, run as fixed per-layer decisions on the tiered engine), adaptive
  (on the tiered engine: measured selection from the four-place plan) and recompute, side by
  side at one memory budget (budget.py).

The figures a run needs beyond the defaults (keep's bytes and step time at the largest size)
come from a calibration: two steps of keep before the measured ones.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from ...config import OffloadConfig
from ..cli_types import byte_count, positive_float

SSD_FRACTION = 0.5
"""The default SSD cap, as a fraction of what a full offload needs."""
HOST_FRACTION = 0.5
"""The default host tier, as a fraction of one micro-batch's layer activations."""
TIERED = ("planned", "adaptive")
"""Strategies that run on the tiered engine (both tiers)."""


@dataclass
class NodeEmulation:
    """The emulated node: where compute and IO run, and what each tier can carry."""

    compute_cpus: Tuple[int, ...]
    io_cpus: Tuple[int, ...]
    ssd_gbps: Optional[float] = None
    """The SSD tier's cap, GB/s (None: from the calibration)."""
    host_bytes: Optional[int] = None
    """The host tier's capacity (None: from the calibration)."""
    profile: Optional[object] = None
    """The NodeProfile (``--node``) whose host link and drives the planner uses, under the caps;
    None: the host link measured here and the SSD cap."""
    link_gbps: float = 0.0
    """The host link the planner uses, GB/s (set by ``start``)."""
    allocator: str = ""
    """What ``start`` did to the C allocator (:func:`cache_freed_host_memory`)."""
    calibration: Dict[str, float] = field(default_factory=dict)
    """What the calibration measured: keep's step time and bytes at the largest size, what a
    full offload needs, and the caps derived from them."""

    def start(self, spec, cfg: OffloadConfig, device, micro_batch: int) -> None:
        """Confine the training thread, measure the host link, calibrate what is left to it."""
        confine_training_thread(self.compute_cpus)
        self.allocator = cache_freed_host_memory()
        if self.profile is not None:
            self.link_gbps = self.profile.host_link_gbps
        else:
            from ..node_profile import host_copy_gbps

            self.link_gbps = host_copy_gbps(64 << 20)
        if self.ssd_gbps is None or self.host_bytes is None:
            self._calibrate(spec, cfg, device, micro_batch)

    def _calibrate(self, spec, cfg: OffloadConfig, device, micro_batch: int) -> None:
        import dataclasses

        from ...cache import ActivationOffloader
        from ..minigpt import MiniGPT, installed_step

        model = MiniGPT(dataclasses.replace(spec, micro_batch=micro_batch), device)
        with ActivationOffloader(cfg.replace(policy="keep", job="bench-calibrate"), device=device) as off:
            for _ in range(2):
                _, seconds = installed_step(model, off)
        stats = off.last_step_stats
        rows = [r for r in stats.layers if r.layer != "None"]
        n = spec.num_microbatches
        offloadable = sum(r.bytes for r in rows[:-1])  # the last layer stays (keep_last_layers)
        need = offloadable / (seconds / 2) / 1e9
        self.calibration = {"micro_batch": micro_batch, "keep_step_s": seconds, "layer_bytes_per_step": sum(
            r.bytes for r in rows), "full_offload_needs_gbps": need}
        if self.ssd_gbps is None:
            self.ssd_gbps = max(SSD_FRACTION * need, 1e-3)
        if self.host_bytes is None:
            self.host_bytes = max(int(HOST_FRACTION * sum(r.bytes for r in rows) / n), 1 << 20)

    def drive_gbps(self) -> Tuple[float, float]:
        """(write, read) GB/s of the emulated drives: the cap, or the profile's if lower."""
        cap = self.ssd_gbps or float("inf")
        if self.profile is None:
            return cap, cap
        return min(cap, self.profile.ssd_write_gbps), min(cap, self.profile.ssd_read_gbps)

    def config(self, name: str, cfg: OffloadConfig) -> OffloadConfig:
        """The settings of strategy ``name`` on this node (the bench's own for keep and recompute)."""
        cpus = {"io_cpus": list(self.io_cpus)}
        if name in ("offload", "offload+crc32c"):
            return cfg.replace(engine="posix", bandwidth_cap_gbps=self.ssd_gbps, **cpus)
        if name == "host":
            return cfg.replace(engine="memory", host_memory_bytes=self.host_bytes, verify="off", **cpus)
        if name in TIERED:
            return cfg.replace(engine="tiered", host_memory_bytes=self.host_bytes,
                               bandwidth_cap_gbps=self.ssd_gbps, recompute_fallback=True, **cpus)
        return cfg.replace(**cpus)

    def describe(self) -> List[str]:
        write, read = self.drive_gbps()
        cal = self.calibration
        lines = [f"node emulation: compute on CPU {_cpus(self.compute_cpus)} (torch threads "
                 f"{len(self.compute_cpus)}), IO threads on CPU {_cpus(self.io_cpus)}; SSD tier capped at "
                 f"{self.ssd_gbps:.3g} GB/s (planner: write {write:.3g}, read {read:.3g}); host tier "
                 f"{(self.host_bytes or 0) / 1e6:.1f} MB over a {self.link_gbps:.3g} GB/s link"
                 + (f" (node profile {self.profile.name})" if self.profile is not None else
                    " (the host copy measured here)"),
                 f"host allocator: {self.allocator}"]
        if cal:
            lines.append(f"calibration (keep at micro-batch {cal['micro_batch']:.0f}): step "
                         f"{cal['keep_step_s']:.3f}s, {cal['layer_bytes_per_step'] / 1e6:.1f} MB of layer "
                         f"activations per step; a full offload needs {cal['full_offload_needs_gbps']:.3g} GB/s")
        return lines

    def as_dict(self) -> dict:
        write, read = self.drive_gbps()
        return {"compute_cpus": list(self.compute_cpus), "io_cpus": list(self.io_cpus),
                "ssd_gbps": self.ssd_gbps, "host_memory_bytes": self.host_bytes,
                "host_link_gbps": self.link_gbps, "drive_write_gbps": write, "drive_read_gbps": read,
                "node_profile": None if self.profile is None else self.profile.name,
                "host_allocator": self.allocator,
                "calibration": dict(self.calibration)}


HEAP_THRESHOLD = 32 << 20
"""glibc's largest ``M_MMAP_THRESHOLD`` (64-bit): every smaller block comes from the heap."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h


def cache_freed_host_memory() -> str:
    """Make the C allocator keep freed blocks for reuse, as a GPU's caching allocator keeps
    freed device memory; returns what was done, for the run's header.

    Why: glibc gives a block above its mmap threshold (128 KiB at first, raised by frees up to
    32 MiB) a mapping of its own, unmapped when it is freed, and hands the top of its heap back
    to the kernel once more than its trim threshold is free there: either way the next
    micro-batch faults an activation's pages in again. On the CPU that cost falls on the
    strategy that holds the most (keep, 546 MB at the default shape: a median step of 6.51 s
    with glibc's defaults and 5.57 s with the thresholds raised, one run each of
    ``bench --node-emulation`` 8 minutes apart, offload's 9.41 and 9.40 s); a GPU's allocator
    hands freed blocks out again and has no such cost. With both thresholds raised, blocks
    below 32 MiB come from the heap and stay there: every strategy reuses what it freed. The
    bench's peak-memory reset does not trim the heap between steps under node emulation either
    (telemetry/peak_memory.py ``trim``)."""
    path = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(path), "mallopt", None) if path else None
    if mallopt is None:
        return "the C allocator's defaults (no glibc mallopt here)"
    if not (mallopt(_M_MMAP_THRESHOLD, HEAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)):
        return "the C allocator's defaults (mallopt refused the thresholds)"
    return (f"freed host memory kept for reuse, as a GPU's caching allocator does (glibc: blocks "
            f"below {HEAP_THRESHOLD >> 20} MiB from the heap, not trimmed between them)")


def _cpus(cpus: Sequence[int]) -> str:
    return ",".join(map(str, cpus))


def confine_training_thread(cpus: Sequence[int]) -> None:
    """The calling (training) thread and torch's intra-op threads on ``cpus`` only."""
    import torch

    os.sched_setaffinity(0, set(cpus))  # 0: this thread; threads it starts later inherit it
    torch.set_num_threads(len(cpus))


# -- command line -----------------------------------------------------------------------------


def add_node_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("node emulation (a GPU node's shape on a CPU machine: docs/benchmarks.md)")
    g.add_argument("--node-emulation", action="store_true",
                   help="compute on one core, IO threads on another, the SSD tier capped below what a "
                        "full offload needs and the host tier below one step's bytes; strategies keep, "
                        "offload, host, planned, adaptive, recompute")
    g.add_argument("--compute-cpus", type=_cpu_list, default=None, metavar="CPU[,CPU...]",
                   help="CPUs of the training thread and torch's threads (default: the first CPU this "
                        "process may use)")
    g.add_argument("--io-cpus", type=_cpu_list, default=None, metavar="CPU[,CPU...]",
                   help="CPUs of the IO threads (default: the next one)")
    g.add_argument("--ssd-gbps", type=positive_float, default=None, metavar="GB/S",
                   help=f"cap of the SSD tier (default: {SSD_FRACTION:g} x what a full offload needs, "
                        "from a calibration); a cap above the need measures offload/keep with IO on its "
                        "own core")
    g.add_argument("--host-memory", type=byte_count, default=None, metavar="SIZE",
                   help=f"host tier's capacity, e.g. 64MiB (default: {HOST_FRACTION:g} x one micro-batch's "
                        "layer activations at the largest size)")
    g.add_argument("--node", metavar="PROFILE", default=None,
                   help="node profile whose host link and drives the planner uses (a built-in name or "
                        "the YAML `ssdtrain doctor --node-profile` writes; default: the host copy measured "
                        "at start and the SSD cap)")


def _cpu_list(text: str) -> Tuple[int, ...]:
    try:
        cpus = tuple(sorted({int(t) for t in text.split(",")}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected CPU numbers separated by commas, got {text!r}") from None
    if not cpus or min(cpus) < 0:
        raise argparse.ArgumentTypeError(f"expected CPU numbers >= 0, got {text!r}")
    return cpus


def node_from_args(args: argparse.Namespace) -> Optional[NodeEmulation]:
    """The emulation the flags ask for (None without --node-emulation or any of its flags).

    Raises:
        SystemExit: (via ``args.error``-style messages on stderr) bad CPUs or profile.
    """
    given = [f for f in ("compute_cpus", "io_cpus", "ssd_gbps", "host_memory", "node")
             if getattr(args, f) is not None]
    if not args.node_emulation:
        if given:
            raise argparse.ArgumentTypeError(f"--{given[0].replace('_', '-')} needs --node-emulation")
        return None
    allowed = sorted(os.sched_getaffinity(0))
    compute = args.compute_cpus or (allowed[0],)
    io = args.io_cpus or tuple(c for c in allowed if c not in compute)[:1]
    for flag, cpus in (("--compute-cpus", compute), ("--io-cpus", io)):
        bad = [c for c in cpus if c not in allowed]
        if bad or not cpus:
            raise argparse.ArgumentTypeError(f"{flag} {_cpus(cpus) or '(none left)'}: this process may "
                                             f"use CPUs {_cpus(allowed)}; --node-emulation needs two")
    if set(compute) & set(io):
        raise argparse.ArgumentTypeError(f"--compute-cpus {_cpus(compute)} and --io-cpus {_cpus(io)} "
                                         "overlap: the point is that they do not")
    profile = None
    if args.node is not None:
        from ...plan.node import ProfileError, load_profile

        try:
            profile = load_profile(args.node)
        except ProfileError as exc:
            raise argparse.ArgumentTypeError(f"--node: {exc}") from None
    return NodeEmulation(compute, io, args.ssd_gbps, args.host_memory, profile)


# -- the planned strategy ---------------------------------------------------------------------


class PlannedTiers:
    """The 'planned' contender's places: the four-place plan (plan/tiers.py) for the bench's
    budget on the emulated node, from the per-layer figures of keep's latest warm-up step,
    recomputing a layer priced at the pass the recompute strategy measured for it, set as fixed
    per-layer decisions ('keep', 'host', 'ssd', 'recompute') before the measured steps. Its own
    warm-up steps offload to the tiered engine's default place (host memory first). Without a
    budget the plan keeps everything (keeping costs no time)."""

    def __init__(self, node: NodeEmulation, budget: Optional[int], layers: int, offloader) -> None:
        self.node = node
        self.budget = budget
        self.layer_keys = list(range(1, layers + 1))  # megatron numbers layers from 1
        self.plan = None
        """The TierPlan in force (None: no budget, or before the first plan)."""
        if budget is None:
            for k in self.layer_keys:
                offloader.set_layer_decision(k, "keep")

    def plan_from(self, offloader, keep_stats, num_micro_batches: int, recomputed=None,
                  moved=None) -> None:
        """Plan from ``keep_stats`` (StepStats of keep) and, where given, the recompute passes
        ``recomputed`` (StepStats of a step that recomputed) and the bytes per layer ``moved``
        (StepStats of a step that offloaded) measured."""
        if self.budget is None:
            return
        from .predict import plan_for

        self.plan = plan_for(self.node, keep_stats, num_micro_batches, self.budget, recomputed, moved)
        row = self.plan.decisions[0]  # no pipeline here: every position is alike
        for k, place in zip(self.layer_keys, row):
            offloader.set_layer_decision(k, place)
        print(f"ssdtrain bench: planned within {self.budget / 1e6:.1f} MB: "
              + ", ".join(f"layer {k} {d}" for k, d in zip(self.layer_keys, row))
              + f" (modeled step {self.plan.iteration_s:.3f}s, keep {self.plan.compute_s:.3f}s; binding: "
              f"{self.plan.binding})", file=sys.stderr)
