"""The size of the job ``ssdtrain plan`` plans: how many GPUs and how many sequences per
iteration (Megatron's global batch), from --gpus or --nodes, --global-batch-size, or, where
they are not given, from the preset (its dp x tp x pp x cp GPUs; dp x micro-batch x
--num-microbatches, else the pipeline's depth, sequences), saying so in the plan's first line.

Megatron's rules hold: the GPUs are a multiple of the model-parallel size (tp x pp x cp), and
the global batch a multiple of the micro-batch times the data-parallel size; a value that
breaks one is refused in one line that says which rule.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

from ...plan.node import NodeProfile
from ...plan.shape import ModelShape


@dataclass(frozen=True)
class JobSize:
    """GPUs and global batch of the job planned, and for the preset's layout its data-parallel
    size and micro-batches per iteration."""

    gpus: int
    global_batch: int
    """Sequences per iteration (Megatron's --global-batch-size)."""
    dp: Optional[int]
    """Model replicas of the preset's layout on ``gpus``; None (--search) where they do not
    divide."""
    num_micro_batches: Optional[int]
    """Per iteration, of the preset's layout and micro-batch; None where they do not divide."""
    assumed: str = ""
    """What was not given and how it was assumed, in words; empty when both were given."""

    def describe(self, seq_len: int) -> str:
        """'64 GPUs, a global batch of 512 x 8192 tokens' and what was assumed."""
        return (f"{self.gpus} GPUs, a global batch of {self.global_batch} x {seq_len} tokens"
                + (f" (assumed: {self.assumed})" if self.assumed else ""))


def _gpus(shape: ModelShape, args: argparse.Namespace, node: NodeProfile) -> tuple:
    """(GPUs, how they were assumed or '') from --gpus, --nodes, or the preset's layout."""
    gpus, nodes = getattr(args, "gpus", None), getattr(args, "nodes", None)
    if nodes is not None:
        by_nodes = nodes * node.gpus_per_node
        if gpus is not None and gpus != by_nodes:
            raise ValueError(f"--gpus {gpus} and --nodes {nodes} disagree: {nodes} node(s) of "
                             f"{node.gpus_per_node} GPUs (--gpus-per-node) are {by_nodes}")
        return by_nodes, ""
    if gpus is not None:
        return gpus, ""
    dp = getattr(args, "dp", None) or shape.dp
    where = "--data-parallel-size" if getattr(args, "dp", None) else "the preset's dp"
    return dp * shape.model_parallel, (f"{dp * shape.model_parallel} GPUs = {where} {dp} x tp "
                                       f"{shape.tp} x pp {shape.pp}"
                                       + (f" x cp {shape.cp}" if shape.cp > 1 else ""))


def job_size(shape: ModelShape, args: argparse.Namespace, node: NodeProfile,
             search: bool = False) -> JobSize:
    """The GPUs and global batch to plan (see the module docstring); ``search``: the preset's
    layout need not divide them, each layout searched has its own.

    Raises:
        ValueError: one line naming the flags and Megatron's rule they break.
    """
    gpus, assumed_gpus = _gpus(shape, args, node)
    mp = shape.model_parallel
    dp: Optional[int] = gpus // mp if gpus % mp == 0 else None
    if dp is None and not search:
        raise ValueError(f"--gpus {gpus} is not a multiple of the preset's model-parallel size "
                         f"tp {shape.tp} x pp {shape.pp} x cp {shape.cp} = {mp} (Megatron: the "
                         "world size is a multiple of it)")
    given_dp = getattr(args, "dp", None)
    if given_dp is not None and not assumed_gpus and dp != given_dp:
        raise ValueError(f"--data-parallel-size {given_dp} disagrees with {gpus} GPUs: the "
                         f"preset's model-parallel size {mp} makes {gpus / mp:g} replicas")
    b, m_given = shape.micro_batch, getattr(args, "num_micro_batches", None)
    gbs = getattr(args, "global_batch_size", None)
    if gbs is None:
        m = m_given or shape.pp  # as the job's settings assume (plan/job.py)
        batch = (f"{(dp or 1) * b * m} sequences = dp {dp} x micro-batch {b} x {m} micro-batch(es)"
                 + ("" if m_given else " (the pipeline's depth)"))
        return JobSize(gpus, (dp or 1) * b * m, dp, m, _assumed(assumed_gpus, batch))
    per_step = b * dp if dp else None
    if per_step and gbs % per_step:
        if not search:
            raise ValueError(f"--global-batch-size {gbs} is not a multiple of micro-batch {b} x "
                             f"data-parallel size {dp} = {per_step} (Megatron's rule)")
        per_step = None
    m = gbs // per_step if per_step else None
    if m_given is not None and m_given != m:
        raise ValueError(f"--num-microbatches {m_given} disagrees with --global-batch-size {gbs}: "
                         + (f"{gbs} / (micro-batch {b} x data-parallel size {dp}) = {m}" if m
                            else "give one of them"))
    return JobSize(gpus, gbs, dp, m, _assumed(assumed_gpus, ""))


def _assumed(gpus: str, batch: str) -> str:
    parts = [p for p in (gpus, batch) if p]
    return "; ".join(parts) + (" (--gpus or --nodes, --global-batch-size: the job you will run)"
                               if parts else "")


__all__ = ["JobSize", "job_size"]
