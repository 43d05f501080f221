"""``ssdtrain plan``'s table: the plan of ``plan_cli.build_plan`` as aligned lines."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from ..plan.lifespan import RETENTION_FACTOR, WAF, WAF_RATED
from ..plan.model import ModelShape
from ..plan.policy import KEEP


def _bytes(n: float) -> str:
    """Exact byte count, then the same in the largest decimal unit that keeps it >= 1."""
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{round(n):,} B ({n / scale:.3f} {unit})"
    return f"{round(n):,} B"


def _duration(years: float) -> str:
    days = years * 365.25
    return f"{days:,.1f} days" if days < 2 * 365.25 else f"{years:.4f} years ({days:,.1f} days)"


def print_plan(shape: ModelShape, r: Dict[str, Any]) -> None:
    dtype = {2: "16-bit", 4: "fp32"}[shape.dtype_bytes]
    print(f"plan for {r['config']}: {shape.num_layers} layers ({shape.layers_per_stage} per "
          f"stage), h={shape.hidden}, heads={shape.heads}, kv_groups={shape.groups}, "
          f"ffn={shape.ffn_hidden}, s={shape.seq_len}, b={shape.micro_batch}, {dtype}, "
          f"tp={shape.tp}, pp={shape.pp}, sp={shape.sequence_parallel}, "
          + (f"cp={shape.cp}, " if shape.cp > 1 else "") +
          f"flash={shape.flash_attention}, recompute={shape.recompute}"
          + (f", swiglu ({'fused' if shape.swiglu_fusion else 'unfused'})" if shape.swiglu else "")
          + (f", experts={shape.num_experts} top-{shape.moe_topk} (width "
             f"{shape.moe_ffn_hidden or shape.ffn_hidden}), ep={shape.ep}"
             if shape.num_experts is not None else ""))
    print(f"{'layer':>5}  {'bytes':>18}  decision   (layers numbered from 1, as Megatron does)")
    for row in r["layers"]:
        print(f"{row['layer']:>5}  {row['bytes']:>18,}  {row['decision']}")
    kept = sum(1 for row in r["layers"] if row["decision"] == KEEP)
    rows = [
        ("activations per layer", _bytes(r["activation_bytes_per_layer"])),
        ("activations per micro-batch", _bytes(r["activation_bytes_per_micro_batch"])),
        ("offloaded per step", _bytes(r["offloaded_bytes_per_step"])),
        ("resident per micro-batch", f"{_bytes(r['resident_bytes_per_micro_batch'])}, "
                                     f"{kept} layer(s) kept"),
        ("step time (estimate)", f"{r['step_time_s']:.4f} s at {r['gpu_tflops']:g} TFLOP/s "
                                 f"per GPU, {r['num_micro_batches']} micro-batch(es)"),
    ]
    rows += bandwidth_rows(r)
    if r["ssd_gbps"] is None:
        rows.append(("SSD bandwidth", "not given (--ssd-gbps): every layer but the last "
                                      f"{r['keep_last_layers']} offloaded"))
    else:
        rows.append(("SSD bandwidth", f"{r['ssd_gbps']:g} GB/s: predicted IO stall "
                                      f"{r['predicted_io_stall_s']:.4f} s, recompute "
                                      f"{r['recompute_s']:.4f} s per step"))
    if r["lifespan"] is None:
        rows.append(("SSD lifespan", "not computed (needs --ssd-tbw and offloaded bytes)"))
    else:
        life = r["lifespan"]
        rated = life["rated_lifespan_years"]
        rows.append(("SSD lifespan (rated TBW)", f"{_duration(rated)} at "
                                                 f"{_bytes(life['bytes_per_day'])} per day"))
        rows.append(("SSD lifespan (paper)", f"{life['lifespan_years']:.4f} years = rated x "
                                             f"{life['lifespan_years'] / rated:g} (WAF correction "
                                             f"{WAF_RATED:g}/{WAF:g} x retention factor "
                                             f"{RETENTION_FACTOR:g}: estimates)"))
    rows += memory_rows(r)
    for name, value in rows:
        print(f"{name:<28} {value}")


def bandwidth_rows(r: Dict[str, Any]) -> List[Tuple[str, str]]:
    """Write and read GB/s of full offload and of the chosen plan, per GPU, node and drive."""
    where = (f"{r['gpus_per_node']} GPUs and {r['drives_per_node']} drives per node "
             "(--gpus-per-node, --drives)")

    def line(b: Dict[str, Any]) -> str:
        return (f"write {b['write_gbps_per_gpu']:.3f} / read {b['read_gbps_per_gpu']:.3f} GB/s "
                f"per GPU, {b['write_gbps_per_node']:.1f} / {b['read_gbps_per_node']:.1f} GB/s "
                f"per node, {b['write_gbps_per_drive']:.2f} / {b['read_gbps_per_drive']:.2f} "
                "GB/s per drive")

    full, plan = r["bandwidth"]["full_offload"], r["bandwidth"]["plan"]
    return [("bandwidth, full offload", line(full)),
            ("bandwidth, this plan", line(plan) + ("" if r["bandwidth_considered"] else
                                                   " (= full offload: no --ssd-gbps)")),
            ("", where + "; writes in half the step, reads in the other half")]


def memory_rows(r: Dict[str, Any]) -> List[Tuple[str, str]]:
    """Model state, the activation budget beside it, and the largest micro-batch within it."""
    m = r["memory"]
    state = m["model_state"]
    budget = m["activation_budget_bytes"]
    model = r["model"]
    per_param = "6 + 12/d B" if model["distributed_optimizer"] else "18 B"
    rows = [("model state per GPU", f"{state['bytes'] / 1e9:.1f} GB: {state['dense_parameters']:,} "
             f"dense + {state['expert_parameters']:,} expert parameters x {per_param} (dp="
             f"{model['dp']}, distributed optimizer {'on' if model['distributed_optimizer'] else 'off'})"),
            ("activation budget", f"{budget / 1e9:.1f} GB ({m['activation_budget_source']}); "
             f"GPU {m['gpu_memory_bytes'] / 1e9:g} GB (--gpu-memory)"
             + ("" if m["fits"] else ": MODEL STATE AND BUDGET EXCEED THE GPU'S MEMORY"))]
    best = r["largest_micro_batch"]
    rows.append((f"largest micro-batch in {budget / 1e9:.3g} GB",
                 f"keep {best['keep']}, offload {best['offload']}, recompute {best['recompute']}"
                 + ("" if r["bandwidth_considered"] else
                    " (offload: bandwidth not considered; give --ssd-gbps)")))
    return rows
