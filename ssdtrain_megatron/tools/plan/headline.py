"""``ssdtrain plan``'s headline: this plan against the best that runs without offload on the
same GPUs at the same global batch (the library's plan/baseline.py), in tokens/s per GPU.

"x1.000 keep" says how the plan compares with keeping every activation in this layout; when
keep does not fit that layout's activation budget it is no run anyone can make, so the
headline's gain is over the best plan that does fit without offload (keep at the largest
micro-batch that fits, per-layer, selective or full recompute, another layout).
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, Optional

from ...plan.baseline import best_without_offload, describe
from ...plan.node import NodeProfile
from ...plan.published import assumed_terms, beyond_error
from ...plan.shape import ModelShape
from .fit_answer import reserve_of


def against_without_offload(shape: ModelShape, args: argparse.Namespace, node: NodeProfile,
                            result: Dict[str, Any], keep_last_layers: int) -> Dict[str, Any]:
    """The JSON-ready comparison: this plan's tokens/s per GPU, the best without offload's
    (None where nothing fits without it) and the gain."""
    gpus, global_batch = result["gpus"], result["global_batch"]
    mine = global_batch * shape.seq_len / result["iteration_s"] / gpus
    best = best_without_offload(shape, gpus, global_batch, node,
                                keep_last_layers=keep_last_layers, reserve=reserve_of(args, node))
    keep_fits = result["largest_micro_batch"]["keep"] >= shape.micro_batch
    return {"tokens_per_s_per_gpu": mine, "keep_fits": keep_fits,
            "best": None if best is None else {
                "layout": describe(best), "tp": best.shape.tp, "pp": best.shape.pp,
                "cp": best.shape.cp, "dp": best.shape.dp, "micro_batch": best.shape.micro_batch,
                "recompute": best.shape.recompute, "iteration_s": best.plan.iteration_s,
                "tokens_per_s_per_gpu": best.tokens_per_s_per_gpu},
            "gain": None if best is None else mine / best.tokens_per_s_per_gpu}


def headline(against: Dict[str, Any]) -> str:
    """'x1.012 the best without offload (TP4 PP8 DP2, b=1, keep: 764 tokens/s per GPU; this
    plan 773)', or that nothing fits without offload."""
    mine = against["tokens_per_s_per_gpu"]
    best: Optional[Dict[str, Any]] = against["best"]
    if best is None:
        return (f"{mine:,.0f} tokens/s per GPU; nothing fits these GPUs and this global batch "
                "without offload")
    within = "" if against["gain"] <= 1 or beyond_error(against["gain"]) else \
        ", within the model's error"  # plan/published.py
    return (f"x{against['gain']:.3f} the best without offload ({best['layout']}: "
            f"{best['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU; this plan {mine:,.0f}{within})")


def assumptions(r: Dict[str, Any]) -> str:
    """The assumptions that move the answer, in the plan's first lines (docs/models.md, "The
    model's terms"): each one a user can check against their node or replace."""
    node = r["node"]
    reserve = r["memory"].get("reserve_bytes", 0) / 1e9
    compute, comm = assumed_terms(node)  # plan/published.py: the GPU kind's terms, the error
    return (f"assumed: {compute or _tflops(node)}; attention FLOPs over half the s^2 square with flash attention (causal: its "
            "kernels skip the masked half), the full square unfused; TP within one node's NVLink at "
            f"{node['nvlink_gbps']:g} GB/s; the host tier {node['host_copy_gbps']:.1f} GB/s each way "
            f"per GPU with every GPU copying both ways at once ({_bus(node)}); {comm}; "
            f"a {reserve:.1f} GB reserve")


def _tflops(node: Dict[str, Any]) -> str:
    table = node.get("gpu_tflops_by_tokens")
    if not table:
        return (f"{node['gpu_tflops']:g} TFLOP/s per GPU at every micro-batch (GEMM efficiency "
                "by tokens is not modelled: --gpu-tflops or a profile's measured "
                "gpu_tflops_by_tokens replaces it)")
    measured = ", ".join(f"{at:,} tokens {tflops:g}" for at, tflops in sorted(table.items()))
    return (f"TFLOP/s per GPU by tokens per micro-batch as the profile measured them ({measured}; "
            "a micro-batch takes the figure at the most tokens not above its own)")


def _bus(node: Dict[str, Any]) -> str:
    if node.get("host_memory_gbps") is None:
        return f"the {node['host_link_gbps']:g} GB/s link; the memory bus they share not known"
    return (f"the {node['host_link_gbps']:g} GB/s link, or the {node['host_memory_gbps']:g} GB/s "
            f"memory bus shared by {node['gpus_per_node']} GPU(s), whichever is less")


def keep_words(r: Dict[str, Any]) -> str:
    """What "x keep" is against: a keep that fits, or one that does not in this layout (no gain
    then; the headline's best without offload may be another layout or micro-batch)."""
    if r.get("without_offload", {}).get("keep_fits", True):
        return "keep"
    most = r["largest_micro_batch"]["keep"]
    return ("a keep that does not fit (in this layout keep fits "
            + (f"micro-batch {most} at most" if most else "no micro-batch") + "): no gain")


def micro_batch_source(args: argparse.Namespace) -> str:
    """Where the job's micro-batch comes from, in the flag's or the preset's words."""
    if getattr(args, "micro_batch", None) is not None:
        return "--micro-batch-size"
    if getattr(args, "launch_args", None):
        return "the arguments after --"
    return "the preset's model.micro_batch; --micro-batch-size changes it"


def job_words(size: str, micro_batch: int, source: str, num_micro_batches: int) -> str:
    """The job the first line answers for: '8 GPUs, a global batch of 64 x 8192 tokens,
    micro-batch 2 (--micro-batch-size), 16 micro-batch(es) per iteration'."""
    return (f"{size}, micro-batch {micro_batch} ({source}), {num_micro_batches} micro-batch(es) "
            "per iteration")


__all__ = ["against_without_offload", "assumptions", "headline", "job_words", "keep_words",
           "micro_batch_source"]
