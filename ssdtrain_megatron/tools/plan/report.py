"""``ssdtrain plan``'s table: the plan of ``build.build_plan`` as aligned lines."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from ...plan.shape import ModelShape
from .headline import assumptions, keep_words
from .optimizer_offer import optimizer_rows


def _bytes(n: float) -> str:
    """Exact byte count, then the same in the largest decimal unit that keeps it >= 1."""
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{round(n):,} B ({n / scale:.3f} {unit})"
    return f"{round(n):,} B"


def _duration(years: float) -> str:
    days = years * 365.25
    return f"{days:,.1f} days" if days < 2 * 365.25 else f"{years:.4f} years ({days:,.1f} days)"


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB"


def header(shape: ModelShape, config: str) -> str:
    dtype = {2: "16-bit", 4: "fp32"}[shape.dtype_bytes]
    return (f"plan for {config}: {shape.num_layers} layers ({shape.layers_per_stage} per "
            f"stage), h={shape.hidden}, heads={shape.heads}, kv_groups={shape.groups}"
            + (f", head_dim={shape.head_dim}" if shape.kv_channels is not None else "")
            + f", ffn={shape.ffn_hidden}, s={shape.seq_len}, b={shape.micro_batch}, {dtype}, "
            f"tp={shape.tp}, pp={shape.pp}, sp={shape.sequence_parallel}, "
            + (f"cp={shape.cp}, " if shape.cp > 1 else "") +
            f"flash={shape.flash_attention}, recompute={shape.recompute}"
            + (f", swiglu ({'fused' if shape.swiglu_fusion else 'unfused'})" if shape.swiglu else "")
            + (f", experts={shape.num_experts} top-{shape.moe_topk} (width "
               f"{shape.moe_ffn_hidden or shape.ffn_hidden}), ep={shape.ep}"
               if shape.num_experts is not None else ""))


def print_plan(shape: ModelShape, r: Dict[str, Any], job: str = "", first: str = "") -> None:
    """The plan as aligned lines; ``first``: the first line (whether the job fits as planned,
    its gain, the job it answers for: cli.run_plan), then the model planned; without it,
    ``job`` (the GPUs and global batch planned) ends the model's line."""
    from ...plan.node import NodeProfile

    node = NodeProfile(**{k: r["node"][k] for k in NodeProfile.FIELDS})
    if first:
        print(first)
    print(header(shape, r["config"]) + (f"; {job}" if job else ""))
    print(f"node {node.describe()} ({r['node_source']})"
          + (f"; {assumptions(r)}" if "memory" in r else ""))
    print(f"policy {r['policy']}, engine {r['engine']}: places " + ", ".join(r["places"]))
    print(r["engine_choice"]["reason"])
    print("the job runs: " + r["settings_line"])
    for note in r.get("notes", ()):
        print(f"note: {note}")
    print(f"{'layer':>5}  {'bytes':>18}  place   (layers numbered from 1, as Megatron does)")
    for row in r["layers"]:
        print(f"{row['layer']:>5}  {row['bytes']:>18,}  {row['decision']}")
    rows = [
        ("activations per layer", _bytes(r["activation_bytes_per_layer"])),
        ("activations per micro-batch", _bytes(r["activation_bytes_per_micro_batch"])),
        ("per micro-batch, by place", ", ".join(f"{k} {_gb(v)}" for k, v in r["tiers"].items())),
    ]
    rows += tier_rows(r)
    rows += lifespan_rows(r)
    rows += memory_rows(r)
    every = r["every_place"]
    if list(r["places"]) != list(every["places"]):
        flags = every_place_flags(r)
        rows.append(("all four places", f"{every['iteration_s']:.4f} s per iteration "
                     f"(x{every['vs_keep']:.3f} keep), binding {every['binding']}: "
                     + " ".join(flags)))
    slower = r.get("slower_than_the_node")
    if slower:
        named = r["engine_choice"]["reason"].split(": named by ", 1)[-1]
        rows.append(("slower than the node's", f"engine {r['engine']}, named by {named}, plans "
                     f"x{r['vs_keep']:.3f} keep; without it the engine follows the node: "
                     f"{slower['reason']}; x{slower['vs_keep']:.3f} keep"))
    for name, value in rows:
        print(f"{name:<28} {value}")


def every_place_flags(r: Dict[str, Any]) -> List[str]:
    """The flags that plan the every-place plan (the adaptive policy's: offload, every layer
    out, and keep, none, do not reach it whatever the places)."""
    return (["--policy adaptive"] if r["policy"] != "adaptive" else []) \
        + (["--engine tiered"] if r["engine"] != "tiered" else []) \
        + (["--recompute-fallback"] if not r["recompute_fallback"] else [])


def faster_with(r: Dict[str, Any], error: float = 1.02) -> str:
    """For the first line: the flags that plan faster than this plan beyond the model's error,
    and by how much; '' where none do."""
    every = r["every_place"]
    if list(r["places"]) == list(every["places"]) or every["iteration_s"] * error >= r["iteration_s"] \
            or not every["fits_budget"]:
        return ""
    return (f"{' '.join(every_place_flags(r))} plans x{every['vs_keep']:.3f} keep against this "
            f"plan's x{r['vs_keep']:.3f}")


def tier_rows(r: Dict[str, Any]) -> List[Tuple[str, str]]:
    """Bandwidth per tier against the node's, the iteration against keep and full recompute,
    the peaks and what binds."""
    host, ssd = r["bandwidth_gbps"]["host"], r["bandwidth_gbps"]["ssd"]
    return [
        ("host link, each way", f"{host['used']:.2f} GB/s used, {host['needed']:.2f} needed, of "
                                f"{host['available']:g} per GPU (carries the SSD tier's bytes too)"),
        ("drives", f"{ssd['used']:.2f} GB/s used, {ssd['needed']:.2f} needed, of "
                   f"{ssd['available']:.2f} per GPU each way (write {ssd['write_available']:.2f}"
                   f" / read {ssd['read_available']:.2f}, sharing the drives' time)"),
        ("iteration time (model)", f"{r['iteration_s']:.4f} s {r['iteration_label']}, "
                                   f"{r['num_micro_batches']} micro-batch(es); stall "
                                   f"{r['stall_s']:.4f} s, recompute {r['recompute_s']:.4f} s"),
        ("against keep and recompute", f"x{r['vs_keep']:.3f} {keep_words(r)} "
                                       f"({r['keep_iteration_s']:.4f} s), "
                                       f"x{r['vs_recompute']:.3f} full recompute "
                                       f"({r['recompute_iteration_s']:.4f} s)"),
        ("peak activations per GPU", f"{_gb(r['peak_bytes'])} of a {_gb(r['budget_bytes'])} budget"
                                     + ("" if r["fits_budget"] else ": DOES NOT FIT")),
        ("host memory per GPU", f"{_gb(r['host_peak_bytes'])} of {_gb(r['host_capacity_bytes'])}"
                                + (f": {r['host_memory_source']}" if r.get("host_memory_source") else "")),
    ] + staging_rows(r) + [
        ("binding", binding_words(r)),
    ]


def binding_words(r: Dict[str, Any]) -> str:
    """What binds, and, where it is a tier whose need over the iteration is within its rate
    (the plan gives it what it needs), why it binds all the same: a serial term of the model,
    or one layer more that would not fit the iteration."""
    binding = r["binding"]
    if not r["fits_budget"]:
        return (f"GPU memory: the peak of {_gb(r['peak_bytes'])} is over the "
                f"{_gb(r['budget_bytes'])} budget")
    tier = {"the host link": "host", "the drives": "ssd"}.get(binding)
    if tier is None:
        return binding
    bw = r["bandwidth_gbps"][tier]
    if bw["needed"] > bw["available"] * (1 + 1e-9):
        return (f"{binding}: it needs {bw['needed']:.2f} GB/s over the iteration, more than its "
                f"{bw['available']:.2f}")
    if r["stall_s"] > 0:
        return (f"{binding}, though it needs {bw['needed']:.2f} of its {bw['available']:.2f} GB/s "
                "over the iteration: the stall is serial, not its rate: each micro-batch reads its "
                f"layers back one after another in reverse, at most {r['prefetch_layers']} "
                "layer(s) ahead within the read-ahead byte cap (max_inflight_bytes), none "
                "before its write has ended, while its backward waits")
    return (f"{binding}: it needs {bw['needed']:.2f} of its {bw['available']:.2f} GB/s, and one "
            "layer more on it would not fit the iteration (the rest is recomputed or kept)")


def staging_rows(r: Dict[str, Any]) -> List[Tuple[str, str]]:
    """The pinned host staging the SSD tier needs on a GPU, against the default (none when
    nothing goes to the drives)."""
    need, default = r["staging_bytes"], r["staging_default_bytes"]
    if not need:  # the offloader pins its pool on a GPU whatever the engine
        return [("pinned staging per GPU", f"{_gb(default)} pinned at start (pinned_staging_bytes, "
                                           "twice max_inflight_bytes unless set); this plan's "
                                           "drives need none of it")]
    verdict = "the default holds it" if need <= default else \
        f"more than the default {_gb(default)}: set --ssd-offload-pinned-staging-bytes"
    return [("pinned staging per GPU", f"{_gb(need)}: what the drives have not taken yet when the forward "
                                       f"ends, and the reads ahead (pinned_staging_bytes; {verdict})")]


def lifespan_rows(r: Dict[str, Any]) -> List[Tuple[str, str]]:
    """The rated lifespan first (what to plan with), then the paper's relaxed estimate."""
    life = r["lifespan"]
    if life is None:
        return [("SSD lifespan", "no drive writes in this plan")]
    return [("SSD lifespan (rated TBW)", f"{_duration(life['rated_years'])} at "
                                         f"{_bytes(life['bytes_per_day_per_node'])} per day per "
                                         "node: plan with this"),
            ("SSD lifespan (paper, relaxed)", f"{_duration(life['paper_relaxed_years'])}: "
                                              f"{life['paper_factors']}")]


def memory_rows(r: Dict[str, Any]) -> List[Tuple[str, str]]:
    """Model state, the activation budget beside it, and the largest micro-batch within it."""
    m = r["memory"]
    state = m["model_state"]
    budget = m["activation_budget_bytes"]
    model = r["model"]
    # the bytes per parameter as plan/memory.py counts them (gradients in their precision,
    # the optimizer's part sharded and less what megatron-core's optimizer offload moves)
    params = state["dense_parameters"] + state["expert_parameters"]
    per_param = f"{state['bytes'] / params:.2f} B on average" if params else "0 B"
    rows = [("model state per GPU", f"{state['bytes'] / 1e9:.1f} GB: {state['dense_parameters']:,} "
             f"dense + {state['expert_parameters']:,} expert parameters x {per_param} (dp="
             f"{model['dp']}, distributed optimizer {'on' if model['distributed_optimizer'] else 'off'})"),
            *optimizer_rows(r),
            ("reserve per GPU", f"{m.get('reserve_bytes', 0) / 1e9:.1f} GB for the CUDA context, "
             "NCCL and fragmentation (--memory-reserve)"),
            ("activation budget", f"{budget / 1e9:.1f} GB ({m['activation_budget_source']}); "
             f"GPU {m['gpu_memory_bytes'] / 1e9:g} GB"
             + ("" if m["fits"] else ": MODEL STATE AND BUDGET EXCEED THE GPU'S MEMORY"))]
    best = r["largest_micro_batch"]
    rows.append((f"largest micro-batch in {budget / 1e9:.3g} GB",
                 f"keep {best['keep']}, this plan {best['planned']}, full recompute "
                 f"{best['recompute']} (this plan's within host memory with its pinned staging "
                 f"and drives rated for {r.get('job_days', 30):g} days: --job-days)"))
    if r.get("beyond_the_node"):
        rows.append(("NOT RUNNABLE ON THE NODE", r["beyond_the_node"]))
    return rows
