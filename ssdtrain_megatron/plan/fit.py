"""Does the job fit? The first question of every plan, answered before any tier is placed.

A GPU holds, besides activations, the model state (weights, gradients, optimizer state:
memory.model_state_bytes, with the distributed optimizer's sharding over the data-parallel
ranks, gradients in their precision, less what megatron-core's optimizer CPU offload moves to
host memory) and what no plan controls: the CUDA context, NCCL's communicators and buffers, and the
caching allocator's fragmentation. That last part is the *reserve*: a stated figure
(:data:`DEFAULT_RESERVE_BYTES`, ``ssdtrain plan --memory-reserve`` replaces it), never zero,
because a plan that fills the GPU to the byte does not start.

What is left, ``GPU memory - model state - reserve``, is the room for activations. A job fits
when that room holds the least any plan can run in: each in-flight micro-batch's layer inputs
(full recompute keeps only those) plus one layer re-created in backward and the head's bytes.
Offload could move the layer inputs out too, but not the layer being computed nor the head,
so a job whose room is below one layer and the head fits no plan at all.

When a job does not fit, :func:`nearest_fits` names the layouts that would: more pipeline
stages or tensor parallelism on the same GPUs, the distributed optimizer, or more GPUs (the
fewest that hold the model); plan/optimizer_offload.py, megatron-core's optimizer CPU offload
on the same GPUs. Pure: no IO, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Optional

from .memory import model_state_bytes
from .node import GB, NodeProfile
from .shape import ModelShape, SaveProfile
from .stage import stage

DEFAULT_RESERVE_BYTES = 5 * GB
"""GPU memory no plan may use, per GPU: the CUDA context (about 0.5-1 GB on an H100 with
cuBLAS and cuDNN workspaces), NCCL's communicators and buffers (about 1-2 GB with the tensor,
pipeline and data-parallel groups) and the caching allocator's fragmentation (a few GB on an
80 GB GPU). An estimate, not a measurement: ``--memory-reserve`` replaces it."""

MAX_PP = 16
"""Pipeline stages tried for a layout that fits (as plan/search.py)."""
MAX_GPU_FACTOR = 64
"""More GPUs are tried up to this many times the job's (8 GPUs: up to 512)."""


def reserve_bytes(given: Optional[float], gpu_memory: int) -> int:
    """The reserve: ``given`` in bytes, or as a fraction (<= 1) of ``gpu_memory``; None: the
    default."""
    if given is None:
        return DEFAULT_RESERVE_BYTES
    if isinstance(given, float) and given <= 1:
        return round(given * gpu_memory)
    return int(given)


def least_activation_bytes(shape: ModelShape, node: NodeProfile, num_micro_batches: int = 1,
                           profile: SaveProfile = SaveProfile.paper()) -> int:
    """The least activation memory a plan of ``shape`` runs in on one GPU of the first stage:
    full recompute's (each in-flight micro-batch keeps its layers' inputs) plus one layer
    re-created in backward and the head (see the module docstring)."""
    st = stage(shape.replace(recompute="none"), profile, node, max(1, num_micro_batches))
    live = st.positions[0].live
    inputs = sum(layer.checkpoint_bytes for layer in st.layers)
    return live * inputs + st.layer_bytes + st.head_bytes


@dataclass(frozen=True)
class Fit:
    """One layout on one GPU: model state, reserve and least activations against its memory."""

    shape: ModelShape
    gpus: int
    gpu_memory_bytes: int
    state_bytes: int
    reserve_bytes: int
    least_activation_bytes: int

    @property
    def room_bytes(self) -> int:
        """GPU memory left for activations: less the model state and the reserve."""
        return self.gpu_memory_bytes - self.state_bytes - self.reserve_bytes

    @property
    def needed_bytes(self) -> int:
        return self.state_bytes + self.reserve_bytes + self.least_activation_bytes

    @property
    def fits(self) -> bool:
        return self.room_bytes >= self.least_activation_bytes

    @property
    def excess_bytes(self) -> int:
        """How much more than the GPU's memory it needs (negative: to spare)."""
        return self.needed_bytes - self.gpu_memory_bytes

    def layout(self) -> str:
        """'TP8 PP4 DP2, distributed optimizer' (CP and EP where above 1)."""
        s = self.shape
        return (f"TP{s.tp} PP{s.pp}" + (f" CP{s.cp}" if s.cp > 1 else "") + f" DP{s.dp}"
                + (f" EP{s.ep}" if s.ep > 1 else "")
                + (", distributed optimizer" if s.distributed_optimizer else "")
                + (f", optimizer offload {s.optimizer_offload_fraction:.2f}"
                   if s.optimizer_offload_fraction else ""))

    def sums(self) -> str:
        """'model state 156.4 GB + reserve 5.0 GB + activations 1.2 GB = 162.6 GB of 80 GB'."""
        return (f"model state {self.state_bytes / GB:.1f} GB + reserve {self.reserve_bytes / GB:.1f}"
                f" GB + activations at least {self.least_activation_bytes / GB:.1f} GB = "
                f"{self.needed_bytes / GB:.1f} GB of {self.gpu_memory_bytes / GB:g} GB")

    def to_dict(self) -> dict:
        s = self.shape
        return {"tp": s.tp, "pp": s.pp, "cp": s.cp, "dp": s.dp, "ep": s.ep, "gpus": self.gpus,
                "distributed_optimizer": s.distributed_optimizer, "fits": self.fits,
                "optimizer_offload_fraction": s.optimizer_offload_fraction,
                "gpu_memory_bytes": self.gpu_memory_bytes, "model_state_bytes": self.state_bytes,
                "reserve_bytes": self.reserve_bytes,
                "least_activation_bytes": self.least_activation_bytes,
                "room_bytes": self.room_bytes, "excess_bytes": self.excess_bytes}


def check(shape: ModelShape, node: NodeProfile, reserve: int, num_micro_batches: int = 1,
          profile: SaveProfile = SaveProfile.paper()) -> Fit:
    """``shape`` (its dp and distributed optimizer as given) on one GPU of ``node``."""
    return Fit(shape, shape.dp * shape.model_parallel, node.gpu_memory_bytes,
               model_state_bytes(shape)["bytes"], reserve,
               least_activation_bytes(shape, node, num_micro_batches, profile))


DEFAULT_JOB_DAYS = 30.0
"""The job's length the drives' rated life must cover (``ssdtrain plan --job-days``): a plan
that wears the node's drives out sooner is no plan to run."""


def beyond_the_node(host_peak_bytes: int, staging_bytes: int, host_memory_bytes: int,
                    rated_life_days: Optional[float], job_days: float) -> Optional[str]:
    """Why a plan that fits GPU memory cannot run on the node, or None: its host pool and the
    pinned staging its drive writes need (both come out of the host memory per GPU, as the
    job takes them: docs/flags.md, The engine follows the node) beyond that memory, or drives
    rated for fewer days than the job runs."""
    if host_peak_bytes + staging_bytes > host_memory_bytes:
        return (f"host pool {host_peak_bytes / GB:.1f} GB + pinned staging "
                f"{staging_bytes / GB:.1f} GB > {host_memory_bytes / GB:.1f} GB of host memory per GPU")
    if rated_life_days is not None and rated_life_days < job_days:
        return f"the drives' rated life {rated_life_days:,.1f} days < the job's {job_days:g} days"
    return None


def _divisors(n: int, limit: int) -> List[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def candidates(base: ModelShape, gpus: int, node: NodeProfile,
               global_batch: Optional[int] = None) -> Iterator[ModelShape]:
    """Layouts of ``base`` on ``gpus`` at micro-batch 1: tp within one node's GPUs, pp a
    divisor of the layers up to :data:`MAX_PP`, the preset's cp, the distributed optimizer as
    the preset has it and on; dp what is left (a divisor of ``global_batch`` when given)."""
    optimizers = sorted({base.distributed_optimizer, True})
    for tp in _divisors(node.gpus_per_node, node.gpus_per_node):
        for pp in _divisors(base.num_layers, MAX_PP):
            mp = tp * pp * base.cp
            if gpus % mp:
                continue
            dp = gpus // mp
            if (dp * base.cp) % base.ep or (global_batch and global_batch % dp):
                continue
            for opt in optimizers:
                try:
                    yield base.replace(tp=tp, pp=pp, dp=dp, micro_batch=1,
                                       sequence_parallel=tp > 1,
                                       distributed_optimizer=opt)
                except ValueError:
                    continue  # heads, groups or ffn not divisible by tp, and the like


def _order(fit: Fit) -> tuple:
    """Nearest first: the fewest GPUs, the preset's optimizer before a change, the fewest
    pipeline stages (a smaller bubble), then the most room."""
    s = fit.shape
    return (fit.gpus, s.distributed_optimizer, s.pp, -fit.room_bytes, -s.tp)


def nearest_fits(base: ModelShape, gpus: int, node: NodeProfile, reserve: int,
                 global_batch: Optional[int] = None, limit: int = 3) -> List[Fit]:
    """Up to ``limit`` layouts that fit, nearest first: on ``gpus`` if any fits there, else on
    the fewest more GPUs (doubling, up to :data:`MAX_GPU_FACTOR` times)."""
    counts = [gpus * 2 ** i for i in range(MAX_GPU_FACTOR.bit_length())]
    for count in counts:
        fits = [f for f in (check(s, node, reserve) for s in candidates(base, count, node,
                                                                         global_batch)) if f.fits]
        if fits:
            return sorted(fits, key=_order)[:limit]
    return []


def nearest_miss(base: ModelShape, gpus: int, node: NodeProfile, reserve: int,
                 global_batch: Optional[int] = None) -> Optional[Fit]:
    """The layout on ``gpus`` that comes closest to fitting (the least excess), or None where
    no layout divides them."""
    fits = [check(s, node, reserve) for s in candidates(base, gpus, node, global_batch)]
    return min(fits, key=lambda f: (f.excess_bytes, _order(f))) if fits else None


__all__ = ["DEFAULT_JOB_DAYS", "DEFAULT_RESERVE_BYTES", "Fit", "beyond_the_node", "candidates", "check", "least_activation_bytes",
           "nearest_fits", "nearest_miss", "reserve_bytes"]
