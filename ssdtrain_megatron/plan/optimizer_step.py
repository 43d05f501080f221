"""megatron-core's optimizer CPU offload, priced: what its step adds to an iteration (the stage
adds it to every plan's iteration: plan/stage.py) and the host memory it takes.

``--optimizer-cpu-offload --optimizer-offload-fraction F --use-precision-aware-optimizer``
(megatron/core/optimizer/cpu_offloading/, ``HybridDeviceOptimizer``) moves the fp32 main
weights and Adam states of the first F of each rank's optimizer shard to host memory
(plan/memory.py counts the bytes on both sides). Each iteration's optimizer step then:

1. copies those parameters' gradients to pinned host memory (D2H), in fp32: 4 B per parameter
   (a bf16 gradient is made fp32 on the GPU first, as torch does for a non-blocking copy that
   changes dtype);
2. steps them with torch's AdamW (``fused=True``) on the CPU, at the node's
   ``cpu_adam_params_per_s`` (measured by ``ssdtrain doctor --node-profile``, an estimate in the
   built-in profiles);
3. copies the updated fp32 main weights back into the bf16 parameters (H2D): 4 B per parameter.

Without ``--overlap-cpu-optimizer-d2h-h2d`` the three run one after another on the compute
stream; with it each parameter has its own CPU optimizer and its own copies, so they pipeline and
the step takes about the slowest of the three. Copies run at the host link's rate with every GPU
of the node copying at once (``NodeProfile.host_copy_gbps``): nothing of ours is in flight then,
the step comes after the last backward. The H2D copies read pageable memory (the fp32 main
weights are not pinned), which CUDA stages through a bounce buffer: that can be slower than
the link's pinned rate, and is not modelled. The part of the optimizer left on the GPU steps
there, as every plan's optimizer does, and is not counted. Pure: numbers in, numbers out.
plan/optimizer_offload.py finds the fraction and layout for a job that does not fit without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from .memory import model_state_bytes, optimizer_parameters
from .node import CPU_ADAM_ESTIMATES, DEFAULT_NODE, GB, NodeProfile
from .shape import ModelShape

COPY_BYTES_PER_PARAM = 4
"""Bytes per offloaded parameter each way per step: fp32 gradients to host, fp32 main weights
back (see the module docstring)."""


def cpu_adam_rate(node: NodeProfile) -> Tuple[float, str]:
    """(parameters per second, where the figure comes from) of the node's CPU AdamW per rank."""
    rate = node.cpu_adam_params_per_s
    if rate is None:
        fallback = CPU_ADAM_ESTIMATES[DEFAULT_NODE]
        return fallback, (f"{fallback:.3g} params/s per rank: the profile has no "
                          f"cpu_adam_params_per_s, {DEFAULT_NODE}'s estimate taken "
                          "(ssdtrain doctor --node-profile measures it)")
    if CPU_ADAM_ESTIMATES.get(node.name) == rate:
        return rate, f"{rate:.3g} params/s per rank (an estimate, not measured: docs/models.md)"
    return rate, f"{rate:.3g} params/s per rank (the profile's cpu_adam_params_per_s)"


@dataclass(frozen=True)
class OptimizerStep:
    """What the optimizer CPU offload of one GPU's rank costs per iteration, and holds."""

    fraction: float
    offloaded_parameters: int
    d2h_s: float
    cpu_s: float
    h2d_s: float
    overlapped: bool
    host_bytes: int
    pinned_host_bytes: int
    rate_words: str

    @property
    def step_s(self) -> float:
        """Seconds the step adds: the slowest part when overlapped, else their sum."""
        parts = (self.d2h_s, self.cpu_s, self.h2d_s)
        return max(parts) if self.overlapped else sum(parts)

    def words(self) -> str:
        """'fraction 0.90: 128.3 GB of host memory per GPU (42.1 pinned), +6.42 s per step
        (gradients to host 0.83 s, CPU AdamW 5.71 s, weights back 0.83 s, one after another)'."""
        how = "overlapped" if self.overlapped else "one after another"
        return (f"fraction {self.fraction:.2f}: {self.host_bytes / GB:.1f} GB of host memory per "
                f"GPU ({self.pinned_host_bytes / GB:.1f} pinned), +{self.step_s:.2f} s per step "
                f"(gradients to host {self.d2h_s:.2f} s, CPU AdamW {self.cpu_s:.2f} s, weights "
                f"back {self.h2d_s:.2f} s, {how})")

    def to_dict(self) -> Dict[str, Any]:
        return {"fraction": self.fraction, "offloaded_parameters": self.offloaded_parameters,
                "d2h_s": self.d2h_s, "cpu_s": self.cpu_s, "h2d_s": self.h2d_s,
                "overlapped": self.overlapped, "step_s": self.step_s,
                "host_bytes": self.host_bytes, "pinned_host_bytes": self.pinned_host_bytes,
                "cpu_adam": self.rate_words}


def optimizer_step(shape: ModelShape, node: NodeProfile) -> Optional[OptimizerStep]:
    """The optimizer CPU offload's step on one GPU of the first stage, or None without it."""
    if shape.optimizer_offload_fraction <= 0:
        return None
    state = model_state_bytes(shape)
    n = optimizer_parameters(shape)["offloaded"]
    link = node.host_copy_gbps * 1e9
    rate, words = cpu_adam_rate(node)
    copy_s = n * COPY_BYTES_PER_PARAM / link
    return OptimizerStep(shape.optimizer_offload_fraction, int(n), copy_s, n / rate, copy_s,
                         shape.overlap_optimizer_d2h_h2d, state["host_bytes"],
                         state["pinned_host_bytes"], words)


def optimizer_step_s(shape: ModelShape, node: NodeProfile) -> float:
    """Seconds the optimizer CPU offload's step adds to each iteration (0 without it)."""
    step = optimizer_step(shape, node)
    return step.step_s if step is not None else 0.0


__all__ = ["COPY_BYTES_PER_PARAM", "OptimizerStep", "cpu_adam_rate", "optimizer_step",
           "optimizer_step_s"]
