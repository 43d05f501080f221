"""Outputs megatron-core frees itself and re-creates in backward: never offload them.

megatron-core's ``tensor_parallel.CheckpointWithoutOutput`` (the selective recompute modules
``layernorm``, ``mla_up_proj``, ``moe_act``) runs a function, lets the next module save its
output for backward, then frees the output's memory in place
(``output.untyped_storage().resize_(0)``) and, in backward, recomputes it into that same
storage before the saving module's backward reads it. A tensor saved on such a storage is
already "offloaded" by megatron: writing it to the drive frees nothing, and a write still
queued when megatron frees the memory reads freed memory (on CPU seen as ``EFAULT``, "Bad
address", and a fallback that keeps the tensor; where the memory is still mapped, it could
write whatever lies there by then). So the outputs' storages are registered as held for the step
(``ActivationOffloader.register_held``): saved tensors on them stay with autograd, and
megatron's refill is what their backward reads, as without the offloader.
"""

from __future__ import annotations

from typing import Any, Callable


class DiscardedOutputs:
    """The replacement of ``CheckpointWithoutOutput.checkpoint``: megatron's, then register
    the outputs' storages with the offloader."""

    def __init__(self, offloader: Any, checkpoint: Callable) -> None:
        self.offloader = offloader
        self._checkpoint = checkpoint

    def checkpoint(self, owner: Any, run_function: Callable, *args: Any) -> Any:
        outputs = self._checkpoint(owner, run_function, *args)
        self.offloader.register_held(outputs if isinstance(outputs, (tuple, list)) else (outputs,))
        return outputs
