"""``ssdtrain plan``'s first answer: does the job fit (the library's plan/fit.py)?

A job that does not fit says so in its first line: the numbers (model state, the reserve, the
least activations, against the GPU's memory) and the nearest layouts that do; then one line per
layout, and the exit code 1, before any tier is placed. A preset whose model-parallel size does
not divide the job's GPUs is answered the same way: it cannot run there as laid out, and the
layouts that fit those GPUs (or the fewest more) are what would.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Dict, List, Optional

from ...plan import fit as fitting
from ...plan.node import GB, NodeProfile
from ...plan.shape import ModelShape
from .job_size import job_size
from .optimizer_offer import offer_answer

NOT_FIT = 1
"""Exit code of a plan whose job does not fit (2 stays bad input)."""


def reserve_of(args: argparse.Namespace, node: NodeProfile) -> int:
    """The reserve in bytes: --memory-reserve, else plan/fit.py's default."""
    return fitting.reserve_bytes(getattr(args, "memory_reserve", None), node.gpu_memory_bytes)


def reserve_words(args: argparse.Namespace, node: NodeProfile) -> str:
    """'reserve 5.0 GB per GPU (CUDA context, NCCL, fragmentation; --memory-reserve)'."""
    source = "--memory-reserve" if getattr(args, "memory_reserve", None) is not None \
        else "the default, --memory-reserve changes it"
    return (f"reserve {reserve_of(args, node) / GB:.1f} GB per GPU for the CUDA context, NCCL "
            f"and fragmentation: {source}")


def _layouts(fits: List[fitting.Fit]) -> str:
    return "; ".join(f"{f.gpus} GPUs as {f.layout()} ({f.state_bytes / GB:.1f} GB of model "
                     "state)" for f in fits)


def answer(shape: ModelShape, args: argparse.Namespace, node: NodeProfile) -> Optional[Dict[str, Any]]:
    """The fit answer for the job, or None when the preset's layout fits its GPUs (or the
    job's size is not settled yet: job_size then says why)."""
    size = job_size(shape, args, node, search=True)
    reserve = reserve_of(args, node)
    gbs = getattr(args, "global_batch_size", None)
    if size.dp is not None and shape.tp > node.gpus_per_node:
        # TP traffic is priced on NVLink; beyond one node it would cross the network, which the
        # model does not price: refused, with the layouts inside the domain
        job = None
        why = (f"the preset's tp {shape.tp} spans more than the node's NVLink domain of "
               f"{node.gpus_per_node} GPU(s) ({node.name}): its tensor-parallel traffic would "
               "cross the network, which the planner does not price")
    elif size.dp is not None:
        if size.num_micro_batches is None:
            return None
        job = fitting.check(shape.replace(dp=size.dp), node, reserve, size.num_micro_batches)
        if job.fits:
            return {"fits": True, "layout": job.to_dict()}
        why = (f"{job.layout()} on {size.gpus} GPUs needs {job.sums()}")
    else:
        job = None
        why = (f"the preset's layout tp {shape.tp} x pp {shape.pp} x cp {shape.cp} = "
               f"{shape.model_parallel} GPUs does not divide {size.gpus} GPUs (Megatron: the world "
               "size is a multiple of it)")
    miss = fitting.nearest_miss(shape, size.gpus, node, reserve, gbs)
    nearest = fitting.nearest_fits(shape, size.gpus, node, reserve, gbs)
    if job is None and nearest and nearest[0].gpus == size.gpus:
        why += f"; other layouts of {size.gpus} GPUs fit"
    elif miss is not None and (job is None or miss.shape != job.shape):
        why += (f"; no layout of {size.gpus} GPUs fits: the nearest, {miss.layout()}, needs "
                f"{miss.sums()}")
    result = {"fits": False, "gpus": size.gpus, "why": why,
              "layout": job.to_dict() if job else None,
              "nearest_miss": miss.to_dict() if miss else None,
              "nearest_fits": [f.to_dict() for f in nearest],
              "first_line": f"DOES NOT FIT: {why}; what fits: "
                            + (_layouts(nearest) or "no layout up to "
                               f"{size.gpus * fitting.MAX_GPU_FACTOR} GPUs")
                            + f" ({reserve_words(args, node)})",
              "nearest_text": [f"  {f.gpus} GPUs as {f.layout()}: {f.sums()}" for f in nearest]}
    if not (nearest and nearest[0].gpus == size.gpus):  # megatron-core's optimizer offload
        more = nearest[0].gpus if nearest else None
        offered = offer_answer(shape, size.gpus, size.global_batch, node, reserve, more)
        if offered is not None:
            result["optimizer_offload"] = offered
            result["first_line"] = offered["line"] + "; without it: " + result["first_line"]
    return result


def refuse_unfit(shape: ModelShape, args: argparse.Namespace, node: NodeProfile) -> Optional[int]:
    """Print the answer and return :data:`NOT_FIT` when the job does not fit; else None (the
    plan goes on)."""
    result = answer(shape, args, node)
    if result is None or result["fits"]:
        return None
    if getattr(args, "json", False):
        print(json.dumps({k: v for k, v in result.items() if k != "nearest_text"}, indent=2))
        return NOT_FIT
    print(result["first_line"])
    if result["nearest_text"]:
        print("layouts that fit (micro-batch 1; `ssdtrain plan --search --gpus N` ranks them by "
              "speed):")
        for line in result["nearest_text"]:
            print(line)
    return NOT_FIT


def fit_line(shape: ModelShape, args: argparse.Namespace, node: NodeProfile,
             num_micro_batches: int) -> str:
    """What a plan that fits says first: its model state, reserve and least activations."""
    job = fitting.check(shape, node, reserve_of(args, node), num_micro_batches)
    return f"fits: {job.sums()}"


def as_planned(r: Dict[str, Any]) -> Optional[str]:
    """Why the plan ``r`` (build.build_plan's) cannot run as planned, as the first line's
    verdict ('DOES NOT FIT as planned: ...'), or None when it can: the same budget, model state
    and node the later lines measure it against, so no line contradicts the first."""
    why = []
    if not r["memory"]["fits"]:
        m = r["memory"]
        why.append(f"model state {m['model_state']['bytes'] / GB:.1f} GB + reserve "
                   f"{m.get('reserve_bytes', 0) / GB:.1f} GB + the activation budget "
                   f"{m['activation_budget_bytes'] / GB:.1f} GB ({m['activation_budget_source']}) "
                   f"exceed the GPU's {m['gpu_memory_bytes'] / GB:g} GB")
    if not r["fits_budget"]:
        why.append(f"policy {r['planned_policy']} peaks at {r['peak_bytes'] / GB:.1f} GB of "
                   f"activations, over the {r['budget_bytes'] / GB:.1f} GB budget")
    if r.get("beyond_the_node"):
        why.append(f"not runnable on the node: {r['beyond_the_node']}")
    return f"DOES NOT FIT as planned: {'; '.join(why)}" if why else None


__all__ = ["NOT_FIT", "answer", "as_planned", "fit_line", "refuse_unfit", "reserve_of",
           "reserve_words"]
