"""``ssdtrain plan --search``: the preset's model on its GPU count and global batch, every
layout planned on the node without and with offload (the library's plan/search.py), fastest first."""

from __future__ import annotations

import argparse
import json
from typing import Any, Dict, List, Optional

from ...plan.node import NodeProfile
from ...plan import fit as fitting
from ...plan.fit import DEFAULT_RESERVE_BYTES
from ...plan.search import Layout, search
from ...plan.shape import ModelShape
from .build import lifespan, tier_summary
from .fit_answer import NOT_FIT, reserve_of, reserve_words
from .optimizer_offer import offer_answer
from .job_size import JobSize

MODEL_LABEL = ("the model's figures (docs/models.md, \"The model's terms\"), not measurements: "
               "no GPU has measured them yet")


def layout_dict(x: Layout, node: NodeProfile) -> Dict[str, Any]:
    """One ranked layout as JSON: its shape, tokens/s per GPU and the plan's names."""
    s = x.shape
    life = lifespan(x.plan, node)
    return {"tp": s.tp, "pp": s.pp, "vp": s.vp, "cp": s.cp, "dp": s.dp, "ep": s.ep,
            "distributed_optimizer": s.distributed_optimizer,
            "micro_batch": s.micro_batch, "num_micro_batches": x.num_micro_batches,
            "recompute": s.recompute, "offloads": x.offloads,
            "tokens_per_s_per_gpu": x.tokens_per_s_per_gpu,
            **tier_summary(x.plan, x.stage, x.budget_bytes), "budget_bytes": x.budget_bytes,
            "host_capacity_bytes": node.host_memory_bytes,
            "lifespan_rated_years": life["rated_years"] if life else None}


def search_result(shape: ModelShape, size: JobSize, node: NodeProfile,
                  keep_last_layers: int = 1, top: Optional[int] = None,
                  reserve: int = DEFAULT_RESERVE_BYTES) -> Dict[str, Any]:
    """Both rankings for ``shape`` on ``size``'s GPUs at its global batch (sequences per
    iteration) on ``node``; the best of each and the gain. Where neither ranks a layout:
    ``nearest_miss`` (the layout closest to fitting and by how much) and ``nearest_fits``
    (plan/fit.py)."""
    gpus, global_batch = size.gpus, size.global_batch
    without, with_ = search(shape, gpus, global_batch, node, keep_last_layers=keep_last_layers,
                            reserve=reserve)
    best_without = without[0] if without else None
    best_with = with_[0] if with_ else None
    gain = (best_with.tokens_per_s_per_gpu / best_without.tokens_per_s_per_gpu
            if best_with and best_without else None)
    return {"node": node.name, "gpus": gpus, "global_batch": global_batch,
            "seq_len": shape.seq_len, "assumed": size.assumed, "label": MODEL_LABEL,
            "without_offload": [layout_dict(x, node) for x in without[:top]],
            "with_offload": [layout_dict(x, node) for x in with_[:top]],
            "gain": gain, "reserve_bytes": reserve,
            **(nothing_fits(shape, size, node, reserve) if not (without or with_) else {})}


def nothing_fits(shape: ModelShape, size: JobSize, node: NodeProfile,
                 reserve: int) -> Dict[str, Any]:
    """Why no layout ranks: the nearest miss on the job's GPUs, and the nearest that fit."""
    miss = fitting.nearest_miss(shape, size.gpus, node, reserve, size.global_batch)
    nearest = fitting.nearest_fits(shape, size.gpus, node, reserve, size.global_batch)
    why = (f"the nearest miss, {miss.layout()} at micro-batch 1, needs {miss.sums()}"
           if miss else f"no layout of tp x pp x cp divides {size.gpus} GPUs and "
                        f"{size.global_batch} sequences")
    if miss is not None and miss.fits:
        why = (f"{miss.layout()} at micro-batch 1 leaves {miss.room_bytes / 1e9:.1f} GB for "
               "activations, yet no plan of it fits them at the job's micro-batches")
    more = nearest[0].gpus if nearest and nearest[0].gpus > size.gpus else None
    return {"nearest_miss": miss.to_dict() if miss else None, "why_none": why,
            "optimizer_offload": offer_answer(shape, size.gpus, size.global_batch, node, reserve,
                                              more),
            "nearest_fits": [f.to_dict() for f in nearest],
            "nearest_fits_text": [f"{f.gpus} GPUs as {f.layout()}: {f.sums()}" for f in nearest]}


def _line(d: Dict[str, Any]) -> str:
    bw = d["bandwidth_gbps"]
    needs = (f"host {d['tiers']['host'] / 1e9:.1f} GB, drives {d['tiers']['ssd'] / 1e9:.1f} GB per "
             f"micro-batch; link {bw['host']['needed']:.1f}, drives {bw['ssd']['needed']:.1f} GB/s"
             if d["offloads"] else "no offload")
    return (f"  TP{d['tp']} PP{d['pp']}" + (f" VP{d['vp']}" if d.get("vp", 1) > 1 else "")
            + (f" CP{d['cp']}" if d["cp"] > 1 else "")
            + f" DP{d['dp']} b={d['micro_batch']} m={d['num_micro_batches']} "
            f"recompute={d['recompute']}: {d['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, "
            f"{d['iteration_s']:.3f} s per iteration, peak {d['peak_bytes'] / 1e9:.1f} of "
            f"{d['budget_bytes'] / 1e9:.1f} GB, binding {d['binding']}; {needs}")


def run_search(shape: ModelShape, offload: Any, args: argparse.Namespace, node: NodeProfile,
               source: str, size: JobSize) -> int:
    reserve = reserve_of(args, node)
    result = search_result(shape, size, node, offload.keep_last_layers, top=args.top,
                           reserve=reserve)
    found = bool(result["without_offload"] or result["with_offload"])
    if args.json:
        print(json.dumps(result, indent=2))
        return 0 if found else NOT_FIT
    if not found and result.get("optimizer_offload"):
        print(result["optimizer_offload"]["line"] + "; without it: ", end="")  # one line
    if not found:
        print(f"DOES NOT FIT: no layout of {args.config} on {result['gpus']} GPUs of {node.name} "
              f"at {result['global_batch']} sequences fits: {result['why_none']}; what fits: "
              + ("; ".join(result["nearest_fits_text"]) or "nothing up to "
                 f"{size.gpus * fitting.MAX_GPU_FACTOR} GPUs")
              + f" ({reserve_words(args, node)})")
    print(f"layouts for {args.config or 'the job after --'} on {result['gpus']} GPUs of {node.name} ({source}), "
          f"{result['global_batch']} sequences of {shape.seq_len} tokens per iteration"
          + (f" (assumed: {size.assumed})" if size.assumed else "") + f"; {MODEL_LABEL}")
    for title, key in (("without offload (keep, recompute)", "without_offload"),
                       ("with offload (keep, host, SSD, recompute)", "with_offload")):
        rows: List[Dict[str, Any]] = result[key]
        print(title + ("" if rows else ": none fits"))
        for d in rows:
            print(_line(d))
    if result["gain"] is not None:
        print(f"modeled gain of the best with offload over the best without: "
              f"x{result['gain']:.3f} tokens/s per GPU")
    return 0 if found else NOT_FIT
